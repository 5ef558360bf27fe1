"""The padding and end-of-sentence ids of a token loader, from what the user gave, the
datasets' ``PREFIX.json`` (``seqshard binarize``), or fairseq's defaults.

- ``eos_id``: as given; else the metadata's (every dataset that has one must agree); else 2
  (fairseq's ``</s>``).
- ``pad_id``: as given (any id: batches carry masks and lengths, so nobody needs to tell
  padding by its id); else the metadata's pad (fairseq's ``<pad>`` 1 with a ``--dict``);
  else fairseq's 1, once checked not to occur in the datasets that do not name a pad (a
  fairseq-preprocess dataset never holds it; SentencePiece's ``<s>`` and GPT-2's ``"`` are 1
  too, and then the loader refuses it and asks for one). The check reads each such ``.bin``
  once, in blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..formats.mmidx import TokenDataset

FAIRSEQ_PAD, FAIRSEQ_EOS = 1, 2
SCAN_TOKENS = 1 << 26  # tokens compared at once when checking that the pad never occurs


@dataclass(frozen=True)
class SpecialIds:
    """The ids chosen and where each came from (``"given"``, ``"metadata"``, ``"default"``)."""

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
    pad_from = "metadata" if pad is not None else "default"
    if pad is None:
        pad = FAIRSEQ_PAD
    unnamed = [d for d in datasets if d.meta is None or d.meta.pad_id is None]
    for dataset in unnamed if pads else []:
        found = occurrences(dataset, pad)
        if found:
            raise ConfigError(
                f"pad_id {pad} ({'the metadata' if pad_from == 'metadata' else 'fairseq'}'s padding) is a token of "
                f"{str(dataset.bin_path)[:-4]} ({found} times), which has no PREFIX.json naming a pad: pass "
                "pad_id=ID (any id works: batches carry src_mask/target_mask and src_lengths, so padding need not be "
                "told apart by its id), or binarize with seqshard, which records one."
            )
    return SpecialIds(pad, eos, pad_from, eos_from)
