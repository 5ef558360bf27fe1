"""The padding and end-of-sentence ids of a token loader, from what the user gave, the
datasets' ``PREFIX.json`` (``seqshard binarize``), or fairseq's defaults.

- ``eos_id``: as given; else the metadata's (every dataset that has one must agree); else 2
  (fairseq's ``</s>``).
- ``pad_id``: as given (any id: batches carry masks and lengths, so nobody needs to tell
  padding by its id); else the metadata's pad (``seqshard binarize`` records one for every
  vocabulary: its own pad, else an id encoded text never holds); else fairseq's 1, once
  checked not to occur in the datasets that do not name a pad (a fairseq-preprocess dataset
  never holds it); where 1 occurs and every such dataset has a ``PREFIX.json`` (one written
  before pads were recorded), the largest ``vocab_size`` of the metadata, one past every id,
  checked the same way. Otherwise (GPT-2's ``"`` is 1, and Megatron's files have no
  metadata) the loader refuses and asks for one. The check reads each such ``.bin`` once, in
  blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..formats.peers.mmidx import TokenDataset

FAIRSEQ_PAD, FAIRSEQ_EOS = 1, 2
SCAN_TOKENS = 1 << 26  # tokens compared at once when checking that the pad never occurs


@dataclass(frozen=True)
class SpecialIds:
    """The ids chosen and where each came from (``"given"``, ``"metadata"``, ``"default"``,
    ``"vocab_size"``)."""

    pad_id: int
    eos_id: int
    pad_from: str
    eos_from: str


def _agreed(datasets: list[TokenDataset], name: str) -> int | None:
    """The metadata's ``name`` id if the datasets that record one agree; else ConfigError."""
    found = {str(d.bin_path)[:-4]: getattr(d.meta, name) for d in datasets if d.meta is not None}
    values = {v for v in found.values() if v is not None}
    if len(values) > 1:
        listed = ", ".join(f"{prefix}: {value}" for prefix, value in found.items())
        raise ConfigError(
            f"the datasets' PREFIX.json name different {name}s ({listed}); pass {name}=ID to choose one "
            "(datasets batched together need one vocabulary)."
        )
    return values.pop() if values else None


def occurrences(dataset: TokenDataset, token: int) -> int:
    """How often ``token`` occurs in the dataset (read in blocks of SCAN_TOKENS)."""
    tokens = dataset.tokens
    return sum(
        int(np.count_nonzero(tokens[at : at + SCAN_TOKENS] == token)) for at in range(0, len(tokens), SCAN_TOKENS)
    )


def special_ids(datasets: list[TokenDataset], pad_id: int | None, eos_id: int | None, pads: bool = True) -> SpecialIds:
    """Resolve ``pad_id``/``eos_id`` (None: choose) for batches of ``datasets`` (see the module
    docstring); ``pads=False`` when batches are never padded (language-model blocks)."""
    eos, eos_from = (eos_id, "given") if eos_id is not None else (_agreed(datasets, "eos_id"), "metadata")
    if eos is None:
        eos, eos_from = FAIRSEQ_EOS, "default"
    if pad_id is not None:
        return SpecialIds(pad_id, eos, "given", eos_from)
    pad = _agreed(datasets, "pad_id")
    if pad is not None:
        pad_from = "metadata"
    else:
        pad, pad_from = FAIRSEQ_PAD, "default"
    unnamed = [d for d in datasets if d.meta is None or d.meta.pad_id is None] if pads else []
    found = _first_occurrence(unnamed, pad)
    if found is not None and pad_from == "default" and all(d.meta is not None for d in unnamed):
        pad, pad_from = max(d.meta.vocab_size for d in unnamed), "vocab_size"  # type: ignore[union-attr]
        found = _first_occurrence(unnamed, pad)
    if found is not None:
        raise ConfigError(_pad_is_a_token(pad, pad_from, *found))
    return SpecialIds(pad, eos, pad_from, eos_from)


def _first_occurrence(datasets: list[TokenDataset], token: int) -> tuple[TokenDataset, int] | None:
    """The first of ``datasets`` that holds ``token``, with how often it does; None if none."""
    for dataset in datasets:
        found = occurrences(dataset, token)
        if found:
            return dataset, found
    return None


def _pad_is_a_token(pad: int, pad_from: str, dataset: TokenDataset, found: int) -> str:
    prefix = str(dataset.bin_path)[:-4]
    whose = {
        "default": "fairseq's padding",
        "metadata": "the pad the other datasets' PREFIX.json name",
        "vocab_size": "one past the vocabulary its PREFIX.json states",
    }[pad_from]
    if dataset.meta is None:
        why = (
            f"{prefix} has no PREFIX.json naming a pad (fairseq's or Megatron's files; `seqshard binarize` records one)"
        )
    else:
        why = f"{prefix}.json names no pad (an older `seqshard binarize` wrote it)"
    return (
        f"pad_id {pad} ({whose}) is a token of {prefix} ({found} times): {why}; pass pad_id=ID (any id that is "
        "not a token, e.g. the vocabulary size: batches carry src_mask/target_mask and src_lengths, so padding "
        "need not be told apart by its id)."
    )
