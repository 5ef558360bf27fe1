"""fairseq's batch for token pairs (``LanguagePairDataset.collater``), from numpy sequences."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class CollateRules:
    """``pad_id`` fills padding; ``eos_id`` starts ``prev_output_tokens``; sources are padded
    on the left (fairseq's default ``left_pad_source``), targets on the right."""

    pad_id: int = 1
    eos_id: int = 2
    left_pad_source: bool = True


def pad(sequences: Sequence[np.ndarray], pad_id: int, left: bool) -> np.ndarray:
    """B x longest int64 matrix of ``sequences``, padded on the left or the right."""
    longest = max((len(s) for s in sequences), default=0)
    out = np.full((len(sequences), longest), pad_id, dtype=np.int64)
    for row, sequence in enumerate(sequences):
        if len(sequence):
            if left:
                out[row, longest - len(sequence) :] = sequence
            else:
                out[row, : len(sequence)] = sequence
    return out


def collate_pairs(
    ids: np.ndarray,
    sources: Sequence[np.ndarray],
    targets: Sequence[np.ndarray] | None,
    rules: CollateRules,
    source_ids: np.ndarray | None = None,
) -> dict[str, Any]:
    """The batch as fairseq builds it: ``id``, ``nsentences``, ``ntokens`` (target tokens, or
    source tokens without a target), ``src_tokens``, ``src_lengths``, ``prev_output_tokens``
    (the target with its last token, EOS, moved to the front), ``target``, and ``net_input``
    holding the model's inputs; ``source`` (which source of a mix) when given."""
    import torch

    src_lengths = np.fromiter((len(s) for s in sources), dtype=np.int64, count=len(sources))
    batch: dict[str, Any] = {
        "id": torch.from_numpy(np.asarray(ids, dtype=np.int64)),
        "nsentences": len(sources),
        "src_tokens": torch.from_numpy(pad(sources, rules.pad_id, rules.left_pad_source)),
        "src_lengths": torch.from_numpy(src_lengths),
    }
    net_input = {"src_tokens": batch["src_tokens"], "src_lengths": batch["src_lengths"]}
    if targets is not None:
        target = pad(targets, rules.pad_id, left=False)
        previous = np.full_like(target, rules.pad_id)
        for row, sequence in enumerate(targets):
            if len(sequence):
                previous[row, 0] = rules.eos_id
                previous[row, 1 : len(sequence)] = sequence[:-1]
        batch["target"] = torch.from_numpy(target)
        batch["prev_output_tokens"] = net_input["prev_output_tokens"] = torch.from_numpy(previous)
        batch["ntokens"] = int(sum(len(t) for t in targets))
    else:
        batch["ntokens"] = int(src_lengths.sum())
    batch["net_input"] = net_input
    if source_ids is not None:
        batch["source"] = torch.from_numpy(np.asarray(source_ids, dtype=np.int64))
    return batch
