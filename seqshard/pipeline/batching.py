"""Sorting and batching: fixed-size or dynamic batches cut from a length-sorted window.

The stage takes ``window`` samples, sorts them by length (a :class:`~.lengths.Length`
measure: frames of a feature field, tokens, ...), cuts batches along that order (so a sample
is padded only up to its neighbours' lengths) and, when shuffling, emits the window's batches
in a seeded random order. What a batch may hold is a small strategy object
(:class:`BatchCost`): a fixed count, or a budget of padded length where cost may grow with
the square of the length (attention).

State: the source's state where the window began, the window's number and how many of its
batches were emitted; a restore re-reads the window and skips those.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from .base import SEED_BATCH_ORDER, Stage, State, WindowStage, merge_counts, stage_rng
from .lengths import Length, Measure
from .sample import Sample

FRAMES = Length()  # frames of the "feats" field


class BatchCost:
    """What a batch may hold: ``fits(count, longest)`` says whether ``count`` samples padded
    to length ``longest`` are within the budget."""

    def fits(self, count: int, longest: int) -> bool:
        raise NotImplementedError


@dataclass(frozen=True)
class FixedSize(BatchCost):
    """At most ``size`` samples per batch."""

    size: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.size}.")

    def fits(self, count: int, longest: int) -> bool:
        return count <= self.size


@dataclass(frozen=True)
class LengthBudget(BatchCost):
    """Padded cost ``count * (longest + longest**2 / quadratic)`` at most ``budget``; without
    ``quadratic`` the cost is the padded length ``B x T`` (in the measure's unit)."""

    budget: int
    quadratic: float | None = None

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ConfigError(f"batch_frames must be >= 1, got {self.budget}.")
        if self.quadratic is not None and self.quadratic <= 0:
            raise ConfigError(f"quadratic_frames must be > 0, got {self.quadratic}.")

    def cost(self, count: int, longest: int) -> float:
        per_item = longest if self.quadratic is None else longest + longest * longest / self.quadratic
        return count * per_item

    def fits(self, count: int, longest: int) -> bool:
        return self.cost(count, longest) <= self.budget


@dataclass
class Batch:
    """Samples batched together, with their lengths by the batching measure."""

    samples: list[Sample]
    lengths: list[int]

    @property
    def longest(self) -> int:
        return max(self.lengths)

    def __len__(self) -> int:
        return len(self.samples)


def bucket_of(batch: Batch, bounds: Sequence[int]) -> int:
    """Length bucket of a batch: how many of the ascending ``bounds`` its longest sample reaches."""
    return bisect.bisect_right(bounds, batch.longest)


def cut_batches(
    lengths: Sequence[int], cost: BatchCost, keys: Sequence[str] | None = None
) -> tuple[list[list[int]], list[int]]:
    """Batches of indices into ``lengths`` (sorted ascending, or in ascending runs), and the
    indices of samples that do not fit even alone. With ``keys``, no batch holds one key
    twice: a copy of a key already in the batch waits for the next one."""
    batches: list[list[int]] = []
    oversize: list[int] = []
    current: list[int] = []
    taken: set[str] = set()
    waiting: list[int] = []  # copies of a key already in the current batch
    longest = 0

    def close() -> None:
        nonlocal current, taken, waiting, longest
        batches.append(current)
        current, taken, longest = [], set(), 0
        again, waiting = waiting, []
        for index in again:
            place(index)

    def place(index: int) -> None:
        nonlocal longest
        if keys is not None and keys[index] in taken:
            waiting.append(index)
            return
        if current and not cost.fits(len(current) + 1, max(longest, lengths[index])):
            close()
            place(index)
            return
        current.append(index)
        longest = max(longest, lengths[index])
        if keys is not None:
            taken.add(keys[index])

    for index, length in enumerate(lengths):
        if not cost.fits(1, length):
            oversize.append(index)
            continue
        place(index)
    while current or waiting:
        if current:
            close()
        else:
            again, waiting = waiting, []
            for index in again:
                place(index)
    return batches, oversize


class SortBatch(WindowStage[Batch]):
    """Length-sorted batches from windows of ``window`` samples.

    ``oversize="alone"`` puts a sample that exceeds the budget on its own in a batch;
    ``"drop"`` counts it under ``dropped.oversize``. Counters: ``batches``, ``utts_batched``,
    ``frames`` and ``padded_frames`` (in the measure's unit).
    """

    def __init__(
        self,
        source: Stage[Sample],
        window: int,
        cost: BatchCost,
        seed: int,
        *position: int,
        length: Measure = FRAMES,
        shuffle: bool = True,
        oversize: str = "alone",
    ):
        super().__init__(source, window, "sort window")
        if oversize not in ("alone", "drop"):
            raise ConfigError(f"oversize must be 'alone' or 'drop', got {oversize!r}.")
        self.cost = cost
        self.length = length
        self.seed = seed
        self.position = position
        self.shuffle = shuffle
        self.oversize = oversize
        self._counts: dict[str, int] = {}

    def reset(self, state: State | None = None) -> None:
        self._counts = dict(state.get("counts", {})) if state else {}
        super().reset(state)

    def arrange(self, items: list[Sample], number: int, fresh: bool) -> list[Batch]:
        measured = sorted(((self.length(s), s.key, i) for i, s in enumerate(items)))
        lengths = [length for length, _, _ in measured]
        # A window of a mixed stream can hold several passes of a small source: copies of one
        # utterance sort next to each other, and cut_batches keeps them in different batches.
        indices, oversize = cut_batches(lengths, self.cost, [key for _, key, _ in measured])
        batches = [Batch([items[measured[i][2]] for i in batch], [lengths[i] for i in batch]) for batch in indices]
        if self.oversize == "alone":
            batches.extend(Batch([items[measured[i][2]]], [lengths[i]]) for i in oversize)
        elif fresh and oversize:  # a restored window was counted when first formed
            self._counts["dropped.oversize"] = self._counts.get("dropped.oversize", 0) + len(oversize)
        if self.shuffle:
            order = stage_rng(self.seed, SEED_BATCH_ORDER, *self.position, number).permutation(len(batches))
            batches = [batches[i] for i in order]
        return batches

    def held(self, output: Batch) -> list[Sample]:
        return output.samples

    def next(self) -> Batch:
        batch = super().next()
        for name, value in (
            ("batches", 1),
            ("utts_batched", len(batch)),
            ("frames", sum(batch.lengths)),
            ("padded_frames", batch.longest * len(batch)),
        ):
            self._counts[name] = self._counts.get(name, 0) + value
        return batch

    def get_state(self) -> State:
        return {**super().get_state(), "counts": dict(self._counts)}

    def stats(self) -> dict[str, int]:
        return merge_counts(super().stats(), self._counts)
