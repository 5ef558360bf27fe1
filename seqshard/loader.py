"""The public entries: ``make_loader`` (shards -> batches, on one GPU or many) and the
:class:`~seqshard.protocol.Loader` shape every loader follows.

A shard loader (``pipeline/rank/loader.py``) runs a reader pipeline in each worker process
(``pipeline/workers/``, composed by a recipe from the stages of ``pipeline/stages/``), merges
the workers' batches into one deterministic stream, ends epochs as its options say, and keeps a
small position that ``state_dict()``/``load_state_dict()`` save and restore exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .dist import discover
from .formats.patterns import Patterns
from .mix import Mux
from .options import LoaderOptions
from .pipeline.rank.loader import ShardLoader
from .pipeline.sources import open_sources
from .protocol import Loader, PlannedBatches
from .text.labels import LabelOverride
from .text.tokenizers import Tokenizer, make_tokenizer

__all__ = ["Loader", "PlannedBatches", "ShardLoader", "make_loader"]


def make_loader(
    patterns: Patterns | Mux,
    tokenizer: str | Path | Tokenizer | None = None,
    *,
    labels: str | Path | Sequence[str | Path] | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    **options: Any,
) -> ShardLoader:
    """A loader over the shards named by ``patterns`` (brace + glob, str or list).

    Batches are dicts: ``feats`` (B x T x D float tensor, zero padded), ``feat_lens``,
    ``labels`` (B x L, padded with ``pad_label``; when a tokenizer is given), ``label_lens``,
    ``keys``, ``texts``; any other field read is collated by its kind (arrays padded into
    ``NAME`` + ``NAME_lens``, numbers stacked, other values listed).

    ``tokenizer``: a SentencePiece ``.model`` or a units file (``token id`` per line,
    ``split="char"`` or ``"word"``, chosen from the units when not given). ``labels``: Kaldi
    ``text`` file(s) whose labels replace the shards' by key. ``rank``/``world_size``
    override what ``torch.distributed`` or torchrun's environment say. Other options
    (groups and defaults in :mod:`seqshard.options`): batching (``batch_size`` or ``batch_frames``,
    ``quadratic_frames``, ``sort_window``, ``oversize``), randomness (``shuffle``, ``seed``,
    ``shuffle_window``, ``interleave``), fields (``fields``, ``feature_field``), the
    pipeline (``transforms``, ``recipe``), filters (``min_frames``, ``max_frames``,
    ``max_tokens``, ``min_frames_per_token``, ``max_frames_per_token``), labels (``split``,
    ``strip_spaces``, ``pad_label``), workers (``num_workers``, ``prefetch_factor``,
    ``persistent_workers``, ``pin_memory``; ``device="cuda"`` hands batches over on the GPU, each
    copied while the step before runs), bad data (``skip_bad``), and epochs across
    ranks (``uneven`` = ``"stop"``, ``"repeat"`` or ``"join"``; ``epoch_steps`` or
    ``epoch_hours``; ``bucket_sync``), audio (``features``, ``feature_device``, ``resample_to``,
    ...: README).

    ``patterns`` may be a :func:`seqshard.mux` of patterns (nested muxes too): each source is
    an endless stream of its own shards, mixed by weights or temperature; the stream goes on
    across epochs, an epoch being ``epoch_steps``, ``epoch_hours`` or ``epoch_source`` (one
    pass's worth of that source's utterances).
    """
    loader_options = LoaderOptions(mixed=isinstance(patterns, Mux), **options)
    context = discover(rank, world_size)
    override = LabelOverride(labels) if labels is not None else None
    tokenizer = make_tokenizer(tokenizer, loader_options.labels.split)
    access = loader_options.remote.access()
    table, mix = open_sources(patterns, loader_options, access)
    return ShardLoader(table, loader_options, context, tokenizer, override, mix, access)
