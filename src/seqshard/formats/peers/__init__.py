"""Readers (and writers) of what other tools write: Kaldi, WeNet, Lhotse Shar, NeMo, Hugging Face, fairseq/Megatron."""
