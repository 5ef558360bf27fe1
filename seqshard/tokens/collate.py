"""fairseq's batch for token pairs (``LanguagePairDataset.collater``), built with whole-array
numpy operations (no Python loop per sentence), from memory-mapped token arrays."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

MODEL_INPUTS = ("src_tokens", "src_lengths", "prev_output_tokens")  # what fairseq's net_input holds


@dataclass(frozen=True)
class CollateRules:
    """``pad_id`` fills padding; ``eos_id`` starts ``prev_output_tokens``; sources are padded
    on the left (fairseq's default ``left_pad_source``), targets on the right. (The loader
    chooses the ids: ``tokens/ids.py``.)"""

    pad_id: int = 1
    eos_id: int = 2
    left_pad_source: bool = True


@dataclass(frozen=True)
class Rows:
    """Some rows of a batch, all taken from one token array: row ``rows[k]`` is the
    ``lengths[k]`` tokens of ``data`` from ``starts[k]``, after ``prefix`` when given."""

    rows: np.ndarray
    data: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    prefix: int | None = None


def padded(parts: Sequence[Rows], batch_size: int, pad_id: int, left: bool) -> tuple[np.ndarray, np.ndarray]:
    """The B x longest int64 matrix of the rows in ``parts`` (padded on the left or the right)
    and each row's length (prefix included).

    The stored tokens of every row are placed at once: one flat index of where each comes from
    (its row's start plus its place in the row) and one of where it goes in the matrix, built
    for all parts together; then one gather from each part's ``data`` straight into the matrix.
    The work follows the tokens, not B x longest, and the number of numpy calls does not grow
    with the batch."""
    many = len(parts) > 1
    rows = np.concatenate([part.rows for part in parts]) if many else parts[0].rows
    stored = np.concatenate([part.lengths for part in parts]) if many else parts[0].lengths
    stored = stored.astype(np.int64, copy=False)
    prefixed = np.concatenate([np.full(len(part.rows), part.prefix is not None) for part in parts])
    lengths = np.zeros(batch_size, dtype=np.int64)
    lengths[rows] = stored + prefixed
    longest = int(lengths.max()) if batch_size else 0
    out = np.full((batch_size, longest), pad_id, dtype=np.int64)
    flat = out.reshape(-1)
    first = rows * longest + (longest - lengths[rows] if left else 0)  # where each row's first token goes
    before = np.cumsum(stored) - stored  # tokens of the rows before it, in parts' order
    place = np.arange(int(stored.sum()) if len(stored) else 0)
    source = np.repeat(np.concatenate([part.starts for part in parts]) - before, stored) + place
    target = np.repeat(first + prefixed - before, stored) + place
    row = token = 0
    for part in parts:
        count = int(part.lengths.sum())
        if count:
            flat[target[token : token + count]] = part.data[source[token : token + count]]
        if part.prefix is not None:
            flat[first[row : row + len(part.rows)]] = part.prefix
        row, token = row + len(part.rows), token + count
    return out, lengths


def mask_of(lengths: np.ndarray, width: int, left: bool) -> np.ndarray:
    """The B x ``width`` boolean mask of the real tokens of rows of ``lengths``, padded on the
    left or the right: from the lengths, never from the padding id."""
    column = np.arange(width)[None, :]
    return column >= (width - lengths)[:, None] if left else column < lengths[:, None]


def collate_batch(
    ids: np.ndarray,
    src: tuple[np.ndarray, np.ndarray],
    tgt: tuple[np.ndarray, np.ndarray] | None,
    rules: CollateRules,
    source_ids: np.ndarray | None = None,
) -> dict[str, Any]:
    """The batch as fairseq builds it, from padded ``(matrix, lengths)`` of each side: ``id``,
    ``nsentences``, ``ntokens`` (target tokens, or source tokens without a target),
    ``src_tokens``, ``src_lengths``, ``prev_output_tokens`` (the target with its last token,
    EOS, moved to the front), ``target``, and ``net_input`` holding the model's inputs;
    ``source`` (which source of a mix) when given. Beside fairseq's keys, ``src_mask`` and
    ``target_mask`` (True at real tokens; ``prev_output_tokens`` has the target's) so that no
    one masks by the padding id. Arrays are numpy (cheap to send from a worker);
    :func:`as_tensors` makes them tensors."""
    src_tokens, src_lengths = src
    batch: dict[str, Any] = {
        "id": np.asarray(ids, dtype=np.int64),
        "nsentences": len(src_lengths),
        "src_tokens": src_tokens,
        "src_lengths": src_lengths,
        "src_mask": mask_of(src_lengths, src_tokens.shape[1], rules.left_pad_source),
    }
    if tgt is not None:
        target, tgt_lengths = tgt
        batch["target_mask"] = mask_of(tgt_lengths, target.shape[1], False)
        previous = np.full_like(target, rules.pad_id)
        if target.shape[1]:
            previous[:, 0] = rules.eos_id
            previous[:, 1:] = target[:, :-1]
            previous[np.arange(target.shape[1])[None, :] >= tgt_lengths[:, None]] = rules.pad_id
        batch["target"] = target
        batch["prev_output_tokens"] = previous
        batch["ntokens"] = int(tgt_lengths.sum())
    else:
        batch["ntokens"] = int(src_lengths.sum())
    if source_ids is not None:
        batch["source"] = np.asarray(source_ids, dtype=np.int64)
    return batch


def as_tensors(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch with torch tensors (sharing the arrays' memory) and ``net_input``."""
    import torch

    out = {key: torch.from_numpy(value) if isinstance(value, np.ndarray) else value for key, value in batch.items()}
    out["net_input"] = {key: out[key] for key in MODEL_INPUTS if key in out}
    return out


def collate_pairs(
    ids: np.ndarray,
    sources: Sequence[np.ndarray],
    targets: Sequence[np.ndarray] | None,
    rules: CollateRules,
    source_ids: np.ndarray | None = None,
) -> dict[str, Any]:
    """:func:`collate_batch` of sequences given one by one (tests, small batches)."""

    def side(sequences: Sequence[np.ndarray], left: bool) -> tuple[np.ndarray, np.ndarray]:
        lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
        data = np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences]) if len(sequences) else np.zeros(0)
        starts = np.cumsum(lengths) - lengths
        return padded([Rows(np.arange(len(sequences)), data, starts, lengths)], len(sequences), rules.pad_id, left)

    src = side(sources, rules.left_pad_source)
    tgt = side(targets, False) if targets is not None else None
    return as_tensors(collate_batch(ids, src, tgt, rules, source_ids))
