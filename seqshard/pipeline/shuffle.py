"""Shuffling within a window of consecutive items.

The stage fills a window of ``window`` items, emits them in a seeded random order, then fills
the next. Its state is the source's state where the window began, the window's number and how
many of its items were emitted: a restore re-reads that one window (what was in flight) and
skips the emitted part. With shards that are random samples of the corpus (as ``pack``
writes them) and several shards read in turn, a window mixes utterances from the whole corpus.
"""

from __future__ import annotations

from typing import TypeVar

from ..errors import ConfigError
from .base import SEED_SHUFFLE, Stage, State, stage_rng

T = TypeVar("T")


class WindowShuffle(Stage[T]):
    """Emits each window of ``window`` items in the order drawn from (seed, *position, window)."""

    def __init__(self, source: Stage[T], window: int, seed: int, *position: int):
        super().__init__(source)
        if window < 1:
            raise ConfigError(f"shuffle window must be >= 1, got {window}.")
        self.window = window
        self.seed = seed
        self.position = position
        self._items: list[T | None] = []
        self._window_start: State | None = None
        self._window_number = -1
        self._emitted = 0

    def reset(self, state: State | None = None) -> None:
        self._started = True
        self._items, self._emitted = [], 0
        self._window_number, self._window_start = -1, None
        self.source.reset(None if state is None else state.get("source"))
        if state is not None and state.get("window", -1) >= 0:
            self._fill(int(state["window"]))
            self._emitted = int(state["emitted"])

    def _fill(self, number: int) -> None:
        self._window_start = self.source.get_state()
        self._window_number = number
        items: list[T] = []
        try:
            while len(items) < self.window:
                items.append(self.source.next())
        except StopIteration:
            pass
        order = stage_rng(self.seed, SEED_SHUFFLE, *self.position, number).permutation(len(items))
        self._items = [items[i] for i in order]
        self._emitted = 0

    def next(self) -> T:
        if self._emitted >= len(self._items):
            self._fill(self._window_number + 1)
            if not self._items:
                raise StopIteration
        item = self._items[self._emitted]
        self._items[self._emitted] = None  # the consumer holds it now
        self._emitted += 1
        return item  # type: ignore[return-value]

    def pending(self) -> list[T]:
        return [item for item in self._items[self._emitted :] if item is not None] + self.source.pending()

    def get_state(self) -> State:
        if self._window_start is None:
            return {"source": self.source.get_state(), "window": -1, "emitted": 0}
        return {"source": self._window_start, "window": self._window_number, "emitted": self._emitted}
