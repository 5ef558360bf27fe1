"""Bucket sync without communication (``bucket_sync=True``): each reader hands out, as its
k-th batch, one of the length bucket drawn for k from a seed every rank shares, so that at each
step the ranks' batches are of one bucket (their readers take turns alike) and no rank waits at
the gradient all-reduce for another's much longer batch. As lhotse's ``sync_buckets``, the draw
needs no collective; unlike it, no batch waits in a queue: a sorted window's batches are only
handed out in another order (:class:`BucketSortBatch`), so the batches, their count and the
saved state are those of the window, and a restore re-reads the window as before.

The draws (:class:`BucketDraws`) follow each bucket's expected share of the batches (from the
index's length histogram), spread evenly: any run of outputs holds each bucket about its share,
in a random order within blocks of ``BLOCK_PER_BUCKET`` per bucket. A window whose batches
match the draws of its outputs bucket for bucket hands each out where drawn; a window with more
of one bucket and fewer of another than drawn (its lengths' own spread) gives the draws it
cannot meet the nearest buckets it has left. At an epoch's end, when a rank's reader has run out
before the others', the ranks' turns differ and so do their buckets.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ...formats.budgets import LengthBuckets
from ...formats.index_entries import bin_length
from ...seeds import Seed, stage_rng
from .base import State
from .batching import Batch, BatchCost, SortBatch

BLOCK_PER_BUCKET = 4  # draws are stratified in blocks of this many per bucket
GOLDEN = (math.sqrt(5) - 1) / 2  # spreads the draws' quantiles evenly over any run of outputs


@dataclass(frozen=True)
class BucketDraws:
    """The bucket every rank's reader ``position`` hands out at each of its outputs: ``buckets``
    of lengths, ``weights`` their expected shares of the batches."""

    buckets: LengthBuckets
    weights: tuple[float, ...]
    seed: int
    position: tuple[int, ...]

    def draws(self, start: int, count: int) -> list[int]:
        """The buckets of outputs ``start .. start + count - 1``."""
        if count <= 0:
            return []
        size = BLOCK_PER_BUCKET * len(self.weights)
        first, last = start // size, (start + count - 1) // size
        found = np.concatenate([self._block(number, size) for number in range(first, last + 1)])
        return [int(b) for b in found[start - first * size : start - first * size + count]]

    def _block(self, number: int, size: int) -> np.ndarray:
        """Block ``number``'s buckets: the weights' quantiles at evenly spread points, shuffled."""
        rng = stage_rng(self.seed, Seed.BUCKET_ORDER, *self.position, number)
        cumulative = np.cumsum(self.weights[:-1]) / sum(self.weights)
        points = (np.arange(number * size, (number + 1) * size) * GOLDEN + 0.5) % 1.0
        return rng.permutation(np.searchsorted(cumulative, points, side="right"))


def bucket_weights(histogram: Iterable[tuple[int, int]], buckets: LengthBuckets, cost: BatchCost) -> tuple[float, ...]:
    """Each bucket's expected share of the batches: the unpadded shares of a batch of the
    index's lengths (``histogram``: (bin, count) pairs of ``formats/index.py``) that fall in it."""
    weights = [0.0] * (len(buckets.bounds) + 1)
    for key, count in histogram:
        length = max(1, math.floor(bin_length(key + 0.5)))
        weights[buckets.bucket_of(length)] += cost.share(length) * count
    total = sum(weights)
    return tuple(w / total for w in weights) if total > 0 else tuple(1.0 for _ in weights)


def in_draw_order(batches: list[Batch], buckets: Sequence[int], wanted: Sequence[int]) -> list[Batch]:
    """``batches`` (of ``buckets``) in an order whose j-th is of bucket ``wanted[j]`` for as
    many j as they allow (in their own order within a bucket); the draws left get the batches
    left, nearest bucket to nearest bucket."""
    waiting: dict[int, deque[int]] = defaultdict(deque)
    for index, bucket in enumerate(buckets):
        waiting[bucket].append(index)
    order: list[int | None] = [None] * len(batches)
    unmet = []
    for place, bucket in enumerate(wanted):
        if waiting[bucket]:
            order[place] = waiting[bucket].popleft()
        else:
            unmet.append(place)
    rest = sorted((index for queue in waiting.values() for index in queue), key=lambda i: (buckets[i], i))
    for place, index in zip(sorted(unmet, key=lambda p: (wanted[p], p)), rest):
        order[place] = index
    return [batches[index] for index in order]  # type: ignore[index]


class BucketSortBatch(SortBatch):
    """:class:`SortBatch` whose windows' batches go out in the order of ``draws`` (see the
    module docstring); ``before``: the batches this reader handed out before this stage's first
    (earlier passes of an endless stream), so that the draws go on where they stood."""

    arranges_ahead = False  # a window's order follows the batches handed out before it

    def __init__(self, *args, draws: BucketDraws, before: int = 0, **options):
        super().__init__(*args, **options)
        self.draws = draws
        self.before = before
        self._restored = 0  # outputs of the window a restore re-reads that were handed out before

    def reset(self, state: State | None = None) -> None:
        self._restored = int(state.get("emitted", 0)) if state else 0
        super().reset(state)
        self._restored = 0

    def arrange(self, items: list, number: int, fresh: bool) -> list[Batch]:
        batches = super().arrange(items, number, fresh)
        start = self.before + self._counts.get("batches", 0) - self._restored  # this window's first output
        found = [self.draws.buckets.bucket_of(b.longest) for b in batches]
        return in_draw_order(batches, found, self.draws.draws(start, len(batches)))
