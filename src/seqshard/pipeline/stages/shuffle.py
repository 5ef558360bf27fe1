"""Shuffling within a window of consecutive items.

The stage fills a window of ``window`` items, emits them in a seeded random order, then fills
the next. Its state is the source's state where the window began, the window's number and how
many of its items were emitted: a restore re-reads that one window (what was in flight) and
skips the emitted part. With shards that are random samples of the corpus (as ``pack``
writes them) and several shards read in turn, a window mixes utterances from the whole corpus.
"""

from __future__ import annotations

from typing import TypeVar

from ...seeds import Seed, stage_rng
from .base import Growth, Stage, WindowStage

T = TypeVar("T")


class WindowShuffle(WindowStage[T]):
    """Emits each window of ``window`` items in the order drawn from (seed, *position, window);
    with ``grow``, a stream's first windows are that share of ``window``, doubling."""

    arranges_ahead = True

    def __init__(self, source: Stage[T], window: int, seed: int, *position: int, grow: Growth | None = None):
        super().__init__(source, window, "shuffle window", grow)
        self.seed = seed
        self.position = position

    def arrange(self, items: list[T], number: int, fresh: bool) -> list[T]:
        order = stage_rng(self.seed, Seed.SHUFFLE, *self.position, number).permutation(len(items))
        return [items[i] for i in order]
