"""fairseq's batch for token pairs (``LanguagePairDataset.collater``), built for a group of
batches at once from memory-mapped token arrays: each side of the group is one flat buffer
(every batch's padded matrix back to back), filled by one gather per source with indices built
for all the group's tokens together, so the numpy calls per batch are a handful of views and
no Python loop runs per sentence."""

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


@dataclass(frozen=True)
class Side:
    """One side (source or target) of a group of batches, laid out in one flat buffer: batch k's
    ``counts[k] x widths[k]`` matrix from cell ``at[k]``; ``first[r]``: the cell of row r's first
    token; ``mask``: True at real tokens."""

    cells: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    widths: list[int]
    at: list[int]
    first: np.ndarray


def place(parts: Sequence[Rows], counts: np.ndarray, pad_id: int, left: bool) -> Side:
    """The rows in ``parts`` (rows numbered through the group, batch after batch; ``counts``
    rows each) padded into one matrix per batch, on the left or the right.

    All the rows' tokens are placed at once: one flat index of where each token comes from (its
    row's start plus its place in the row) and one of the cell it goes to, built for all parts
    together, then one gather from each part's ``data`` straight into the cells. The work
    follows the tokens, and the numpy calls do not grow with the rows or the batches."""
    many = len(parts) > 1
    rows = np.concatenate([part.rows for part in parts]) if many else parts[0].rows
    stored = (np.concatenate([part.lengths for part in parts]) if many else parts[0].lengths).astype(np.int64)
    prefixed = np.concatenate([np.full(len(part.rows), part.prefix is not None) for part in parts])
    total_rows = int(counts.sum())
    lengths = np.zeros(total_rows, dtype=np.int64)
    lengths[rows] = stored + prefixed
    row_at = np.cumsum(counts) - counts
    widths = np.zeros(len(counts), dtype=np.int64)
    filled = counts > 0
    if total_rows:
        widths[filled] = np.maximum.reduceat(lengths, row_at[filled])
    sizes = counts * widths
    at = np.cumsum(sizes) - sizes
    batch = np.repeat(np.arange(len(counts)), counts)
    width = widths[batch]
    first = at[batch] + (np.arange(total_rows) - row_at[batch]) * width + (width - lengths if left else 0)
    cells = np.full(int(sizes.sum()), pad_id, dtype=np.int64)
    padding = width - lengths  # each row is its padding and its tokens (or the other way round): one run each
    runs = np.stack([padding, lengths] if left else [lengths, padding], axis=1).reshape(-1)
    mask = np.repeat(np.tile(np.array([not left, left]), total_rows), runs)
    before = np.cumsum(stored) - stored  # tokens of the rows before it, in the parts' order
    token = np.arange(int(stored.sum()))
    source = np.repeat(np.concatenate([part.starts for part in parts]) - before, stored) + token
    target = np.repeat(first[rows] + prefixed - before, stored) + token
    token_at = 0
    for part in parts:
        count = int(part.lengths.sum())
        if count:
            cells[target[token_at : token_at + count]] = part.data.take(source[token_at : token_at + count])
        if part.prefix is not None:
            cells[first[part.rows]] = part.prefix
        token_at += count
    return Side(cells, mask, lengths, widths.tolist(), at.tolist(), first)


def shifted(target: Side, eos_id: int, pad_id: int) -> np.ndarray:
    """fairseq's ``prev_output_tokens`` of every target row (padded on the right): EOS, then
    the row but its last token; padding where the target has padding."""
    previous = np.empty_like(target.cells)
    previous[1:] = target.cells[:-1]  # each real cell but a row's first takes the one before it
    np.copyto(previous, pad_id, where=~target.mask)
    previous[target.first[target.lengths > 0]] = eos_id
    return previous


def collate_group(
    counts: np.ndarray,
    ids: np.ndarray,
    src: Sequence[Rows],
    tgt: Sequence[Rows] | None,
    rules: CollateRules,
    source_ids: np.ndarray | None = None,
) -> list[dict[str, Any]]:
    """Batches as fairseq builds them, ``counts[k]`` rows each, from the rows of all of them
    (``ids``, the ``src`` and ``tgt`` parts, ``source_ids`` numbered through the group): ``id``,
    ``nsentences``, ``ntokens`` (target tokens, or source tokens without a target),
    ``src_tokens``, ``src_lengths``, ``prev_output_tokens`` (the target with its last token,
    EOS, moved to the front), ``target``, and ``net_input`` holding the model's inputs;
    ``source`` (which source of a mix) when given. Beside fairseq's keys, ``src_mask`` and
    ``target_mask`` (True at real tokens; ``prev_output_tokens`` has the target's) so that no
    one masks by the padding id. Arrays are numpy views of one buffer per kind for the group
    (cheap to send from a worker); :func:`as_tensors` makes them tensors."""
    counts = np.asarray(counts, dtype=np.int64)
    source = place(src, counts, rules.pad_id, rules.left_pad_source)
    target = place(tgt, counts, rules.pad_id, False) if tgt is not None else None
    previous = shifted(target, rules.eos_id, rules.pad_id) if target is not None else None
    ids = np.asarray(ids, dtype=np.int64)
    sources = np.asarray(source_ids, dtype=np.int64) if source_ids is not None else None
    summed = np.concatenate([[0], np.cumsum((target if target is not None else source).lengths)])
    ntokens = (summed[np.cumsum(counts)] - summed[np.cumsum(counts) - counts]).tolist()
    batches = []
    row = 0
    for number, count in enumerate(counts.tolist()):
        rows = slice(row, row + count)
        cells = slice(source.at[number], source.at[number] + count * source.widths[number])
        shape = (count, source.widths[number])
        batch: dict[str, Any] = {
            "id": ids[rows],
            "nsentences": count,
            "src_tokens": source.cells[cells].reshape(shape),
            "src_lengths": source.lengths[rows],
            "src_mask": source.mask[cells].reshape(shape),
        }
        if target is not None and previous is not None:
            cells = slice(target.at[number], target.at[number] + count * target.widths[number])
            shape = (count, target.widths[number])
            batch["target_mask"] = target.mask[cells].reshape(shape)
            batch["target"] = target.cells[cells].reshape(shape)
            batch["prev_output_tokens"] = previous[cells].reshape(shape)
        batch["ntokens"] = ntokens[number]
        if sources is not None:
            batch["source"] = sources[rows]
        batches.append(batch)
        row += count
    return batches


def as_tensors(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch with torch tensors (sharing the arrays' memory) and ``net_input``."""
    import torch

    out = {key: torch.from_numpy(value) if isinstance(value, np.ndarray) else value for key, value in batch.items()}
    return with_net_input(out)


def with_net_input(batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` with ``net_input``: its model inputs (fairseq's layout), the same tensors."""
    batch["net_input"] = {key: batch[key] for key in MODEL_INPUTS if key in batch}
    return batch


def collate_pairs(
    ids: np.ndarray,
    sources: Sequence[np.ndarray],
    targets: Sequence[np.ndarray] | None,
    rules: CollateRules,
    source_ids: np.ndarray | None = None,
) -> dict[str, Any]:
    """One batch (:func:`collate_group`) of sequences given one by one (tests, small batches)."""

    def side(sequences: Sequence[np.ndarray]) -> list[Rows]:
        lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
        data = np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences]) if len(sequences) else np.zeros(0)
        return [Rows(np.arange(len(sequences)), data, np.cumsum(lengths) - lengths, lengths)]

    tgt = side(targets) if targets is not None else None
    return as_tensors(collate_group(np.array([len(sources)]), ids, side(sources), tgt, rules, source_ids)[0])
