"""The public entries: ``make_loader`` (shards -> batches, on one GPU or many) and the
:class:`~seqshard.protocol.Loader` shape every loader follows.

A shard loader (``pipeline/rank/shard_loader.py``) runs a reader pipeline in each worker process
(``pipeline/workers/``, composed by a recipe from the stages of ``pipeline/stages/``), merges
the workers' batches into one deterministic stream, ends epochs as its options say, and keeps a
small position that ``state_dict()``/``load_state_dict()`` save and restore exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import options
from .dist import discover
from .formats.patterns import Patterns
from .mix import Mux
from .options import GROUP_OF, GROUPS, LoaderOptions
from .pipeline.loader_sources import open_sources
from .pipeline.rank.shard_loader import ShardLoader
from .protocol import Loader, PlannedBatches
from .text.label_override import LabelOverride
from .text.tokenizers import Tokenizer, make_tokenizer

__all__ = ["Loader", "PlannedBatches", "ShardLoader", "make_loader"]


Group = dict[str, Any] | None  # a group's options by name (or the group's class)


class _GroupDefault:
    def __repr__(self) -> str:
        return "<its group's default>"  # a flat keyword not given


GROUP_DEFAULT: Any = _GroupDefault()


def make_loader(
    patterns: Patterns | Mux,
    tokenizer: str | Path | Tokenizer | None = None,
    *,
    labels: str | Path | Sequence[str | Path] | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    batch_size: int | None = GROUP_DEFAULT,
    batch_frames: int | None = GROUP_DEFAULT,
    shuffle: bool = GROUP_DEFAULT,
    seed: int = GROUP_DEFAULT,
    num_workers: int | str = GROUP_DEFAULT,
    device: str | None = GROUP_DEFAULT,
    batching: options.Batching | Group = None,
    shuffling: options.Shuffling | Group = None,
    limits: options.Limits | Group = None,
    text: options.Text | Group = None,
    reading: options.Reading | Group = None,
    collation: options.Collation | Group = None,
    audio: options.Audio | Group = None,
    pipeline: options.Pipeline | Group = None,
    bad_data: options.BadData | Group = None,
    remote: options.Remote | Group = None,
    workers: options.Workers | Group = None,
    epochs: options.Epochs | Group = None,
    **flat: Any,
) -> ShardLoader:
    """A loader over the shards named by ``patterns`` (brace + glob, str or list).

    Batches are dicts: ``feats`` (B x T x D float tensor, zero padded), ``feat_lens``,
    ``labels`` (B x L, padded with ``pad_label``; when a tokenizer is given), ``label_lens``,
    ``keys``, ``texts``; any other field read is collated by its kind (arrays padded into
    ``NAME`` + ``NAME_lens``, numbers stacked, other values listed).

    ``tokenizer``: a SentencePiece ``.model`` or a units file (``token id`` per line,
    ``text={"split": "char"}`` or ``"word"``, chosen from the units when not given). ``labels``:
    Kaldi ``text`` file(s) whose labels replace the shards' by key. ``rank``/``world_size``
    override what ``torch.distributed`` or torchrun's environment say.

    The options most runs set are keywords of their own (``batch_size`` or ``batch_frames``,
    ``shuffle``, ``seed``, ``num_workers``, ``device="cuda"``: batches handed over on the
    GPU); every other option belongs to a group, given as a dict of its options or as the
    group's class from :mod:`seqshard.options` (each field's default and meaning there):
    ``batching`` (budgets, sort windows, buckets), ``shuffling``, ``limits`` (length and token
    filters), ``text`` (how label text becomes tokens), ``reading`` (fields), ``collation``,
    ``audio`` (fbank, resampling, augmentation), ``pipeline`` (``transforms``, ``recipe``),
    ``bad_data`` (``skip_bad``), ``remote``, ``workers`` and ``epochs`` (``uneven``, epoch
    length). E.g. ``make_loader(p, batch_frames=20000, audio={"features": "fbank"},
    epochs={"uneven": "repeat", "epoch_steps": 1000})``. Each option may also be given flat
    by its name (``features="fbank"``), as ``hyper-p.json`` does.

    ``patterns`` may be a :func:`seqshard.mux` of patterns (nested muxes too): each source is
    an endless stream of its own shards, mixed by weights or temperature; the stream goes on
    across epochs, an epoch being ``epoch_steps``, ``epoch_hours`` or ``epoch_source`` (one
    pass's worth of that source's utterances).
    """
    keywords = locals()  # the flat keywords and groups given, by name
    given = {n: v for n, v in keywords.items() if (n in GROUP_OF and v is not GROUP_DEFAULT) or (n in GROUPS and v)}
    loader_options = LoaderOptions(mixed=isinstance(patterns, Mux), **given, **flat)
    context = discover(rank, world_size)
    override = LabelOverride(labels) if labels is not None else None
    tokenizer = make_tokenizer(tokenizer, loader_options.text.split)
    access = loader_options.remote.access()
    table, mix = open_sources(patterns, loader_options, access)
    return ShardLoader(table, loader_options, context, tokenizer, override, mix, access)
