"""Sorting and batching: fixed-size or dynamic batches cut from a length-sorted window.

The stage takes ``window`` utterances, sorts them by length, cuts batches along that order
(so an utterance is padded only up to its neighbours' lengths) and, when shuffling, emits the
window's batches in a seeded random order. What a batch may hold is a small strategy object
(:class:`BatchCost`): a fixed count, or a budget of padded frames where cost may grow with the
square of the length (attention).

State: the source's state where the window began, the window's number and how many of its
batches were emitted; a restore re-reads the window and skips those.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from .base import SEED_BATCH_ORDER, Stage, State, merge_counts, stage_rng
from .decode import Utterance


class BatchCost:
    """What a batch may hold: ``fits(count, longest)`` says whether ``count`` utterances
    padded to ``longest`` frames are within the budget."""

    def fits(self, count: int, longest: int) -> bool:
        raise NotImplementedError

    def describe(self) -> dict:
        raise NotImplementedError


@dataclass(frozen=True)
class FixedSize(BatchCost):
    """At most ``size`` utterances per batch."""

    size: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.size}.")

    def fits(self, count: int, longest: int) -> bool:
        return count <= self.size

    def describe(self) -> dict:
        return {"batch_size": self.size}


@dataclass(frozen=True)
class FrameBudget(BatchCost):
    """Padded cost ``count * (longest + longest**2 / quadratic_frames)`` at most
    ``max_frames``; without ``quadratic_frames`` the cost is the padded frames ``B x T``."""

    max_frames: int
    quadratic_frames: float | None = None

    def __post_init__(self) -> None:
        if self.max_frames < 1:
            raise ConfigError(f"batch_frames must be >= 1, got {self.max_frames}.")
        if self.quadratic_frames is not None and self.quadratic_frames <= 0:
            raise ConfigError(f"quadratic_frames must be > 0, got {self.quadratic_frames}.")

    def cost(self, count: int, longest: int) -> float:
        per_item = longest if self.quadratic_frames is None else longest + longest * longest / self.quadratic_frames
        return count * per_item

    def fits(self, count: int, longest: int) -> bool:
        return self.cost(count, longest) <= self.max_frames

    def describe(self) -> dict:
        return {"batch_frames": self.max_frames, "quadratic_frames": self.quadratic_frames}


def cut_batches(lengths: Sequence[int], cost: BatchCost) -> tuple[list[list[int]], list[int]]:
    """Batches of indices into ``lengths`` (which must be sorted ascending), and the indices
    of utterances that do not fit even alone."""
    batches: list[list[int]] = []
    oversize: list[int] = []
    current: list[int] = []
    for index, length in enumerate(lengths):
        if not cost.fits(1, length):
            oversize.append(index)
            continue
        if current and not cost.fits(len(current) + 1, length):
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches, oversize


class SortBatch(Stage[list[Utterance]]):
    """Length-sorted batches from windows of ``window`` utterances.

    ``oversize="alone"`` puts an utterance that exceeds the budget on its own in a batch;
    ``"drop"`` counts it under ``dropped.oversize``. ``bucket_bounds`` (ascending frame
    counts) tag each batch with the length bucket of its longest utterance.
    """

    def __init__(
        self,
        source: Stage[Utterance],
        window: int,
        cost: BatchCost,
        seed: int,
        *position: int,
        shuffle: bool = True,
        oversize: str = "alone",
        bucket_bounds: Sequence[int] = (),
    ):
        super().__init__(source)
        if window < 1:
            raise ConfigError(f"sort window must be >= 1, got {window}.")
        if oversize not in ("alone", "drop"):
            raise ConfigError(f"oversize must be 'alone' or 'drop', got {oversize!r}.")
        self.window = window
        self.cost = cost
        self.seed = seed
        self.position = position
        self.shuffle = shuffle
        self.oversize = oversize
        self.bucket_bounds = list(bucket_bounds)
        self._batches: list[list[Utterance]] = []
        self._window_start: State | None = None
        self._window_number = -1
        self._emitted = 0
        self._counts: dict[str, int] = {}

    def reset(self, state: State | None = None) -> None:
        self._started = True
        self._batches, self._emitted = [], 0
        self._window_number, self._window_start = -1, None
        self.source.reset(None if state is None else state.get("source"))
        self._counts = dict(state.get("counts", {})) if state else {}
        if state is not None and state.get("window", -1) >= 0:
            self._fill(int(state["window"]), count=False)
            self._emitted = int(state["emitted"])

    def _fill(self, number: int, count: bool = True) -> None:
        self._window_start = self.source.get_state()
        self._window_number = number
        utts: list[Utterance] = []
        try:
            while len(utts) < self.window:
                utts.append(self.source.next())
        except StopIteration:
            pass
        utts.sort(key=lambda u: (u.num_frames, u.key))
        indices, oversize = cut_batches([u.num_frames for u in utts], self.cost)
        batches = [[utts[i] for i in batch] for batch in indices]
        if self.oversize == "alone":
            batches.extend([utts[i]] for i in oversize)
        elif count and oversize:
            self._counts["dropped.oversize"] = self._counts.get("dropped.oversize", 0) + len(oversize)
        if self.shuffle:
            order = stage_rng(self.seed, SEED_BATCH_ORDER, *self.position, number).permutation(len(batches))
            batches = [batches[i] for i in order]
        self._batches = batches
        self._emitted = 0

    def next(self) -> list[Utterance]:
        if self._emitted >= len(self._batches):
            self._fill(self._window_number + 1)
            if not self._batches:
                raise StopIteration
        batch = self._batches[self._emitted]
        self._batches[self._emitted] = []
        self._emitted += 1
        longest = max(u.num_frames for u in batch)
        frames = sum(u.num_frames for u in batch)
        for name, value in (
            ("batches", 1),
            ("utts_batched", len(batch)),
            ("frames", frames),
            ("padded_frames", longest * len(batch)),
        ):
            self._counts[name] = self._counts.get(name, 0) + value
        return batch

    def pending(self) -> list[Utterance]:
        return [utt for batch in self._batches[self._emitted :] for utt in batch] + self.source.pending()

    def bucket_of(self, batch: Sequence[Utterance]) -> int:
        """Length bucket of a batch: how many bounds its longest utterance reaches."""
        return bisect.bisect_right(self.bucket_bounds, max(u.num_frames for u in batch))

    def get_state(self) -> State:
        start = self._window_start if self._window_start is not None else self.source.get_state()
        return {"source": start, "window": self._window_number, "emitted": self._emitted, "counts": dict(self._counts)}

    def stats(self) -> dict[str, int]:
        return merge_counts(super().stats(), self._counts)
