"""An epoch of token batches: which sentences, cut into which batches, dealt to which rank.

Everything is a pure function of (seed, epoch, world size), computed the same on every rank,
so a rank's state is the number of batches it has taken.

1. The epoch's sentences: every sentence of each source, once (no shares); for a mix, a virtual epoch of
   ``virtual_size`` sentences, each source's count its share (largest remainder), its
   sentences drawn without repetition until the source is used up, then again (seed 05).
2. Filter: a pair longer than ``max_positions`` on either side, or that cannot fit
   ``max_tokens`` alone, is dropped and counted.
3. Sort by the longer side, then target, then source length; cut greedily into batches whose
   count x longest side stays within ``max_tokens`` (so B x max source length and B x max
   target length both do) and within ``max_sentences``.
4. Deal: batch j (short to long) goes to rank j mod W, so every rank gets its share of every
   length range; the last K mod W batches are left out so that every rank takes the same
   number of steps (their sentences are counted as ``left``). Each rank's batches are then
   shuffled (seed, epoch, rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..checks import check_fields
from ..seeds import Seed, stage_rng
from .pairs import OpenPair


@dataclass(frozen=True)
class BatchRules:
    """How sentences become batches (the options of ``make_token_loader`` that shape them)."""

    max_tokens: int = 4096
    max_sentences: int | None = None
    max_positions: int = 1024
    shuffle: bool = True
    seed: int = 0
    virtual_size: int | None = None

    def __post_init__(self) -> None:
        check_fields(self)  # numpy's numbers as Python's: the rules go into JSON states


@dataclass
class EpochPlan:
    """The epoch's sentences (``source``, ``index`` into it, lengths), its batches (``order``
    cut at ``bounds``) and each rank's batch numbers in the order it takes them: arrays only
    (int32 indices and lengths where they fit)."""

    source: np.ndarray
    index: np.ndarray
    src_len: np.ndarray
    tgt_len: np.ndarray | None
    order: np.ndarray
    bounds: np.ndarray
    ranks: list[np.ndarray]
    dropped: dict[str, int] = field(default_factory=dict)
    left: int = 0
    read: Any = None  # the pairs the epoch reads (``sources.EpochPairs``), set by the batching

    def batch(self, number: int) -> np.ndarray:
        """Positions (into ``source``/``index``) of batch ``number``."""
        return self.order[self.bounds[number] : self.bounds[number + 1]]

    @property
    def num_batches(self) -> int:
        return len(self.bounds) - 1


def plan_epoch(
    pairs: list[OpenPair], shares: np.ndarray | None, rules: BatchRules, epoch: int, world_size: int
) -> EpochPlan:
    """The plan of ``epoch`` for ``world_size`` ranks (see the module docstring)."""
    source, index, ranges = _sentences(pairs, shares, rules, epoch)
    whole = shares is None and len(pairs) == 1
    src_len = _lengths([p.src_sizes for p in pairs], index, ranges, whole)
    tgt_len = _lengths([p.tgt_sizes for p in pairs], index, ranges, whole) if pairs[0].tgt_sizes is not None else None
    longest = src_len if tgt_len is None else np.maximum(src_len, tgt_len)
    dropped = {
        "too_long": int(np.count_nonzero(longest > rules.max_positions)),
        "over_max_tokens": int(np.count_nonzero((longest <= rules.max_positions) & (longest > rules.max_tokens))),
    }
    keys = [longest] if tgt_len is None else [src_len, tgt_len, longest]  # by the longer side, then target, source
    if any(dropped.values()):
        keep = np.flatnonzero(longest <= min(rules.max_positions, rules.max_tokens))
        order, lengths = lexsorted([key[keep] for key in keys], keep)
    else:  # nothing dropped: the keys as they are, no copy
        order, lengths = lexsorted(keys)
    bounds = cut_batches(lengths, rules.max_tokens, rules.max_sentences)
    usable = (len(bounds) - 1) // world_size * world_size
    left = int(bounds[-1] - bounds[usable])
    ranks = []
    for rank in range(world_size):
        numbers = np.arange(rank, usable, world_size)
        if rules.shuffle:
            numbers = stage_rng(rules.seed, Seed.TOKEN_BATCH_ORDER, epoch, rank).permutation(numbers)
        ranks.append(numbers)
    return EpochPlan(
        source, index, src_len, tgt_len, order, bounds, ranks, {k: v for k, v in dropped.items() if v}, left
    )


def _sentences(
    pairs: list[OpenPair], shares: np.ndarray | None, rules: BatchRules, epoch: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each sentence's source and index in it, and where each source's run of them starts
    (the sentences of source n are ``ranges[n]:ranges[n + 1]``)."""
    sizes = np.array([len(p) for p in pairs], dtype=np.int64)
    if shares is None:  # every source read whole, in order
        ranges = np.concatenate([[0], np.cumsum(sizes)])
        dtype = index_dtype(int(sizes.max()))
        index = np.concatenate([np.arange(size, dtype=dtype) for size in sizes])
        return np.repeat(np.arange(len(pairs), dtype=np.int16), sizes), index, ranges
    total = rules.virtual_size or int(sizes.sum())
    counts = largest_remainder(shares, total)
    dtype = index_dtype(int(sizes.max()))
    indices = []
    for number, (count, size) in enumerate(zip(counts, sizes)):
        rng = stage_rng(rules.seed, Seed.TOKEN_VIRTUAL, epoch, number)
        whole, rest = divmod(int(count), int(size))
        chosen = [rng.permutation(size) for _ in range(whole)] + [rng.permutation(size)[:rest]]
        indices.append(np.concatenate(chosen).astype(dtype))
    source = np.repeat(np.arange(len(pairs), dtype=np.int16), counts)
    return source, np.concatenate(indices), np.concatenate([[0], np.cumsum(counts)])


def index_dtype(count: int) -> np.dtype:
    """int32 for indices below ``count`` where they fit (half the memory of int64)."""
    return np.dtype(np.int32 if count <= np.iinfo(np.int32).max else np.int64)


def _lengths(sizes: list[np.ndarray], index: np.ndarray, ranges: np.ndarray, whole: bool) -> np.ndarray:
    """The int32 lengths of the epoch's sentences, one gather per source's run of them;
    ``whole``: one source read whole, in order (its sizes as they are, not copied)."""
    if whole:
        return np.asarray(sizes[0], dtype=np.int32)
    lengths = np.empty(len(index), dtype=np.int32)
    for number, these in enumerate(sizes):
        run = slice(ranges[number], ranges[number + 1])
        lengths[run] = these[index[run]]
    return lengths


def largest_remainder(shares: np.ndarray, total: int) -> np.ndarray:
    """``shares x total`` rounded to whole numbers that sum to ``total``."""
    exact = shares * total
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


def lexsorted(keys: list[np.ndarray], positions: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``positions[o]`` and ``keys[-1][o]`` for ``o = np.lexsort(keys)`` (the last key sorts
    first, ties keep their order; ``positions`` default to 0, 1, ...), for non-negative integer
    keys: each key and position packed into one uint64 (the keys' bits above the position's,
    so that no two are equal and ties keep their order), sorted in place by numpy's
    vectorised quicksort: one sort of one array, no sort per key and no gather after it.
    Results are int32 where they fit; keys too wide to pack go to ``np.lexsort``."""
    count = len(keys[0])
    top = count - 1 if positions is None else (int(positions.max()) if count else 0)
    widths = [int(key.max()).bit_length() if count else 0 for key in keys]
    shift = max(top, 0).bit_length()
    if shift + sum(widths) > 64 or (count and min(int(key.min()) for key in keys) < 0):
        order = np.lexsort(keys)
        return (order if positions is None else positions[order]).astype(index_dtype(top + 1)), keys[-1][order]
    packed = np.zeros(count, dtype=np.uint64)
    for key, width in zip(reversed(keys), reversed(widths)):  # most significant first
        packed <<= np.uint64(width)
        np.bitwise_or(packed, key, out=packed, dtype=np.uint64, casting="unsafe")
    packed <<= np.uint64(shift)
    np.bitwise_or(
        packed, np.arange(count) if positions is None else positions, out=packed, dtype=np.uint64, casting="unsafe"
    )
    packed.sort()
    order = (packed & np.uint64((1 << shift) - 1)).astype(index_dtype(top + 1))
    packed >>= np.uint64(shift + sum(widths[:-1]))
    return order, packed.astype(keys[-1].dtype)


def cut_batches(lengths: np.ndarray, max_tokens: int, max_sentences: int | None = None) -> np.ndarray:
    """Bounds of greedy batches over ascending ``lengths``: each batch as long as its count
    times its longest (last) length stays within ``max_tokens``.

    Within a run of one length L the greedy batches are ``max_tokens // L`` sentences each (at
    most ``max_sentences``): they are laid out at once, and only a batch that reaches into the
    next lengths is measured, so the loop turns about twice per distinct length, not once per
    batch."""
    total = len(lengths)
    cap_sentences = max_sentences or max_tokens
    run_ends = np.append(np.flatnonzero(np.diff(lengths)) + 1, total)
    pieces = [np.zeros(1, dtype=np.int64)]
    start = 0
    while start < total:
        size = min(max_tokens // max(int(lengths[start]), 1), cap_sentences)
        run_end = int(run_ends[np.searchsorted(run_ends, start, side="right")])
        whole = (run_end - start) // size if size else 0
        if whole:  # batches of ``size`` sentences of this one length
            pieces.append(start + size * np.arange(1, whole + 1, dtype=np.int64))
            start += size * whole
            continue
        window = lengths[start : start + size]
        cost = np.arange(1, len(window) + 1) * window
        start += max(int(np.searchsorted(cost, max_tokens, side="right")), 1)
        pieces.append(np.array([start], dtype=np.int64))
    return np.concatenate(pieces)
