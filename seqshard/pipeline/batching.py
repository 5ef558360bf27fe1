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
from .base import SEED_BATCH_ORDER, Stage, State, WindowStage, merge_counts, stage_rng
from .decode import Utterance


class BatchCost:
    """What a batch may hold: ``fits(count, longest)`` says whether ``count`` utterances
    padded to ``longest`` frames are within the budget."""

    def fits(self, count: int, longest: int) -> bool:
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


def bucket_of(batch: Sequence[Utterance], bounds: Sequence[int]) -> int:
    """Length bucket of a batch: how many of the ascending ``bounds`` its longest utterance reaches."""
    return bisect.bisect_right(bounds, max(u.num_frames for u in batch))


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


class SortBatch(WindowStage[list[Utterance]]):
    """Length-sorted batches from windows of ``window`` utterances.

    ``oversize="alone"`` puts an utterance that exceeds the budget on its own in a batch;
    ``"drop"`` counts it under ``dropped.oversize``.
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
    ):
        super().__init__(source, window, "sort window")
        if oversize not in ("alone", "drop"):
            raise ConfigError(f"oversize must be 'alone' or 'drop', got {oversize!r}.")
        self.cost = cost
        self.seed = seed
        self.position = position
        self.shuffle = shuffle
        self.oversize = oversize
        self._counts: dict[str, int] = {}

    def reset(self, state: State | None = None) -> None:
        self._counts = dict(state.get("counts", {})) if state else {}
        super().reset(state)

    def arrange(self, items: list[Utterance], number: int, fresh: bool) -> list[list[Utterance]]:
        items.sort(key=lambda u: (u.num_frames, u.key))
        indices, oversize = cut_batches([u.num_frames for u in items], self.cost)
        batches = [[items[i] for i in batch] for batch in indices]
        if self.oversize == "alone":
            batches.extend([items[i]] for i in oversize)
        elif fresh and oversize:  # a restored window was counted when first formed
            self._counts["dropped.oversize"] = self._counts.get("dropped.oversize", 0) + len(oversize)
        if self.shuffle:
            order = stage_rng(self.seed, SEED_BATCH_ORDER, *self.position, number).permutation(len(batches))
            batches = [batches[i] for i in order]
        return batches

    def held(self, output: list[Utterance]) -> list[Utterance]:
        return output

    def next(self) -> list[Utterance]:
        batch = super().next()
        longest = max(u.num_frames for u in batch)
        for name, value in (
            ("batches", 1),
            ("utts_batched", len(batch)),
            ("frames", sum(u.num_frames for u in batch)),
            ("padded_frames", longest * len(batch)),
        ):
            self._counts[name] = self._counts.get(name, 0) + value
        return batch

    def get_state(self) -> State:
        return {**super().get_state(), "counts": dict(self._counts)}

    def stats(self) -> dict[str, int]:
        return merge_counts(super().stats(), self._counts)
