"""Each shard's utterance lengths as its index records them (a histogram of 8 bins per octave
and the exact shortest and longest), kept as arrays for the whole table: what bounds on an
epoch's batch count need (``pipeline/rank/counts.py``), at a few bytes a bin, so that a table
of many shards stays cheap to hand to every worker."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from .index_entries import bin_bounds, length_bin

if TYPE_CHECKING:
    from .index_table import ShardColumns


@lru_cache(maxsize=1024)
def bin_range(index: int) -> tuple[int, int]:
    """The whole lengths (frames >= 1) that fall in histogram bin ``index``: ``(low, high)``,
    with ``low > high`` for a bin that holds none."""
    start, end = bin_bounds(index)
    low = max(1, int(start))
    while length_bin(low) < index:
        low += 1
    while low > 1 and length_bin(low - 1) >= index:
        low -= 1
    high = max(low, int(end) + 1)
    while length_bin(high) > index:
        high -= 1
    return low, high


@dataclass(frozen=True, eq=False)
class ShardLengths:
    """``counts[s, b]``: utterances of shard ``s`` in bin ``first + b``; ``shortest``/``longest``:
    its exact extremes (0 when not recorded); ``known[s]``: whether its index recorded them."""

    first: int
    counts: np.ndarray
    shortest: np.ndarray
    longest: np.ndarray
    known: np.ndarray

    @classmethod
    def of(cls, shards: Sequence[tuple[dict[int, int], int | None, int | None] | None]) -> ShardLengths:
        """From each shard's ``(histogram, shortest, longest)``, or None when it has no index entry."""
        bins = [b for shard in shards if shard for b in shard[0]]
        first, last = (min(bins), max(bins)) if bins else (0, -1)
        counts = np.zeros((len(shards), last - first + 1), dtype=np.int32)
        shortest = np.zeros(len(shards), dtype=np.int32)
        longest = np.zeros(len(shards), dtype=np.int32)
        known = np.zeros(len(shards), dtype=bool)
        for row, shard in enumerate(shards):
            if shard is None or not shard[0]:
                continue
            histogram, low, high = shard
            for index, count in histogram.items():
                counts[row, index - first] = count
            shortest[row], longest[row] = low or 0, high or 0
            known[row] = True
        return cls(first, counts, shortest, longest, known)

    @classmethod
    def of_rows(
        cls, parts: Sequence[tuple[ShardColumns | None, np.ndarray]]
    ) -> tuple[ShardLengths, tuple[tuple[int, int], ...]]:
        """The lengths of shards drawn from indexes, part by part: ``(columns, rows)``, each
        shard's row in that index (-1, or no columns: not indexed); and the histogram of them
        all, bin by bin (each bin any of them lists, in order), gathered in bulk."""
        total = sum(len(rows) for _, rows in parts)
        pieces, at = [], 0
        for columns, rows in parts:
            local = np.flatnonzero(rows >= 0)
            if columns is not None and len(local):
                sizes = np.diff(columns.at)[rows[local]]
                if len(local) == len(columns) and (rows == np.arange(len(rows))).all():  # the whole index, in order
                    flat = slice(None)
                else:
                    flat = np.repeat(columns.at[rows[local]] - np.cumsum(sizes) + sizes, sizes)
                    flat += np.arange(int(sizes.sum()))
                ends = [np.maximum(columns.numbers[f][rows[local]], 0) for f in ("min_frames", "max_frames")]
                pieces.append((at + local, sizes, columns.bins[flat].astype(np.int64), columns.counts[flat], ends))
            at += len(rows)
        bins = np.concatenate([p[2] for p in pieces]) if pieces else np.zeros(0, np.int64)
        first, last = (int(bins.min()), int(bins.max())) if len(bins) else (0, -1)
        counts = np.zeros((total, last - first + 1), dtype=np.int32)
        shortest, longest, known = np.zeros(total, np.int32), np.zeros(total, np.int32), np.zeros(total, bool)
        for shards, sizes, found, values, (low, high) in pieces:
            counts[np.repeat(shards, sizes), found - first] = values
            listed = sizes > 0
            known[shards[listed]] = True
            shortest[shards[listed]], longest[shards[listed]] = low[listed], high[listed]
        present = np.flatnonzero(np.bincount(bins - first, minlength=last - first + 1))  # bins listed, any count
        totals = counts.sum(axis=0, dtype=np.int64)
        histogram = tuple(zip((present + first).tolist(), totals[present].tolist()))
        return cls(first, counts, shortest, longest, known), histogram

    @classmethod
    def combine(cls, parts: Sequence[ShardLengths]) -> ShardLengths:
        """The lengths of several tables' shards, in order (the sources of a mix)."""
        firsts = [p.first for p in parts if p.counts.shape[1]]
        first = min(firsts, default=0)
        last = max((p.first + p.counts.shape[1] - 1 for p in parts if p.counts.shape[1]), default=-1)
        counts = np.zeros((sum(len(p.known) for p in parts), last - first + 1), dtype=np.int32)
        row = 0
        for part in parts:
            at = part.first - first
            counts[row : row + len(part.known), at : at + part.counts.shape[1]] = part.counts
            row += len(part.known)
        return cls(
            first,
            counts,
            np.concatenate([p.shortest for p in parts]),
            np.concatenate([p.longest for p in parts]),
            np.concatenate([p.known for p in parts]),
        )

    def ranges(self, shards: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """``(low, high, count)`` of each bin (a column) of each of ``shards`` (a row): the
        lengths its utterances there may have, within the shard's recorded shortest and
        longest, and how many (0 in a bin it does not hold); None when one of them has no
        recorded lengths."""
        if len(shards) and (shards.max() >= len(self.known) or not self.known[shards].all()):
            return None
        width = self.counts.shape[1]
        edges = np.array([bin_range(self.first + b) for b in range(width)], dtype=np.int64).reshape(-1, 2)
        low = np.broadcast_to(edges[:, 0], (len(shards), width))
        high = np.broadcast_to(edges[:, 1], (len(shards), width))
        shortest, longest = self.shortest[shards][:, None], self.longest[shards][:, None]
        low = np.where(shortest > 0, np.maximum(low, shortest), low)
        high = np.where(longest > 0, np.minimum(high, longest), high)
        return low, np.maximum(high, low), self.counts[shards]
