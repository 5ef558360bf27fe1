"""The example application over the library: the CTC trainer, `seqshard demo` and the CAT-style
hyper-p.json config."""
