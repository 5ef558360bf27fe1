"""Sorting and batching: fixed-size or dynamic batches cut from a length-sorted window.

The stage reads a window of samples, sorts them by length (a :class:`~.lengths.Length`
measure: frames of a feature field, tokens, ...), cuts batches along that order (so a sample
is padded only up to its neighbours' lengths) and, when shuffling, emits the window's batches
in a seeded random order. What a batch may hold is a small strategy object
(:class:`BatchCost`): a fixed count, or a budget of padded length where cost may grow with
the square of the length (attention). A window of a mixed stream can hold copies of one
utterance: they go to different batches, and batches stay full (:func:`cut_batches`).

A window holds a number of batches, not of samples (:class:`BudgetWindow`): a batch spans
about 1/N of the window's lengths when the window makes N batches, so padding follows N. A
fixed count of samples makes few batches of a large budget (2,000 samples: ~12 batches of
1,200 s), each spanning a wide range of lengths; a fixed count of samples is still accepted.

State: the source's state where the window began, the window's number and how many of its
batches were emitted; a restore re-reads the window and skips those.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, deque
from collections.abc import Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...checks import check_rule
from ...errors import ConfigError
from ...formats.budgets import Budgets
from ...options import BudgetWindow
from ...seeds import Seed, stage_rng
from .base import Growth, Stage, State, Window, WindowStage, merge_counts
from .lengths import Length, Measure
from .sample import Sample

FRAMES = Length()  # frames of the "feats" field


class BatchCost:
    """What a batch may hold: ``fits(count, longest)`` says whether ``count`` samples padded
    to length ``longest`` are within the budget; ``monotone``: it never fits again once more
    samples or a longer one do not (a batch's end along ascending lengths is then found by a
    binary search, :func:`cut_sorted`)."""

    monotone = False

    def fits(self, count: int, longest: int) -> bool:
        raise NotImplementedError

    def share(self, length: int) -> float:
        """The part of one batch a sample of ``length`` takes, unpadded (1: a batch of its own)."""
        raise NotImplementedError


@dataclass(frozen=True)
class FixedSize(BatchCost):
    """At most ``size`` samples per batch."""

    size: int
    monotone = True

    def __post_init__(self) -> None:
        check_rule("batch_size", self.size)

    def fits(self, count: int, longest: int) -> bool:
        return count <= self.size

    def share(self, length: int) -> float:
        return 1 / self.size


@dataclass(frozen=True)
class LengthBudget(BatchCost):
    """Padded cost ``count * (longest + longest**2 / quadratic)`` at most ``budget``; without
    ``quadratic`` the cost is the padded length ``B x T`` (in the measure's unit)."""

    budget: int
    quadratic: float | None = None
    monotone = True

    def __post_init__(self) -> None:
        check_rule("batch_frames", self.budget)
        check_rule("quadratic_frames", self.quadratic, optional=True)

    def cost(self, count: int, longest: int) -> float:
        per_item = longest if self.quadratic is None else longest + longest * longest / self.quadratic
        return count * per_item

    def fits(self, count: int, longest: int) -> bool:
        return self.cost(count, longest) <= self.budget

    def share(self, length: int) -> float:
        return min(1.0, self.cost(1, length) / self.budget)  # an oversize sample goes alone (or is dropped)


@dataclass(frozen=True)
class BucketBudgets(BatchCost):
    """A budget of padded length per length bucket (``seqshard calibrate``'s): a batch of
    ``count`` samples whose longest falls in bucket ``b`` costs ``count x longest`` of bucket
    ``b``'s budget."""

    budgets: Budgets

    def cost(self, count: int, longest: int) -> float:
        return count * longest

    def fits(self, count: int, longest: int) -> bool:
        return count * longest <= self.budgets.budget_of(longest)

    def share(self, length: int) -> float:
        return min(1.0, length / self.budgets.budget_of(length))


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


def whole_batches(count: int, cost: BatchCost, most: int) -> int:
    """``count`` samples rounded up to whole batches of a fixed size (at most ``most``); as they
    are for a budget."""
    if not isinstance(cost, FixedSize):
        return count
    return min(most, -(-count // cost.size) * cost.size)


def window_limits(
    window: BudgetWindow | int, cost: BatchCost, grow: Growth | None, number: int
) -> tuple[int, int, float]:
    """Sort window ``number``'s most samples, and the samples and batches (unpadded shares,
    summed) that close it before that (see :class:`BudgetWindow`; a fixed window is full at its
    size). With ``grow`` (a stream's first windows), a growing window is that share of a full
    one and holds whole batches of a fixed size."""
    share = 1.0 if grow is None else grow.scale(number)
    if not isinstance(window, BudgetWindow):
        if share >= 1:
            return window, window, 0.0
        most = whole_batches(grow.items(window, number), cost, window)  # type: ignore[union-attr]
        return most, most, 0.0
    scaled = window.scaled(share)
    most, least = scaled.max_samples, scaled.min_samples
    if share < 1:
        most, least = whole_batches(most, cost, window.max_samples), whole_batches(least, cost, window.min_samples)
    return most, least, scaled.batches * (1 - 1e-9)  # shares summed in floating point


def window_closes(count: Any, weight: Any, limits: tuple[int, int, float]) -> Any:
    """Whether a sort window of ``limits`` closes at ``count`` samples whose shares sum to ``weight`` (or arrays)."""
    most, least, enough = limits
    return (count >= most) | ((count >= least) & (weight >= enough))


def window_size(shares: np.ndarray, limits: tuple[int, int, float]) -> int:
    """How many samples of a stream (``shares``: each one's share of a batch) a window of ``limits`` takes."""
    filled = np.cumsum(shares[: limits[0]])
    closed = np.flatnonzero(window_closes(np.arange(1, len(filled) + 1), filled, limits))
    return int(closed[0]) + 1 if len(closed) else len(filled)


def cut_batches(
    lengths: Sequence[int], cost: BatchCost, keys: Sequence[str] | None = None, ascending: bool = False
) -> tuple[list[list[int]], list[int]]:
    """Batches of indices into ``lengths`` (sorted ascending, or in ascending runs; ``ascending``:
    sorted, which a monotone cost cuts by binary searches), and the indices of samples that do
    not fit even alone. With ``keys``, no batch holds one key twice, and copies of a key still
    leave every batch but the last full (see :class:`_CopiesApart`) whenever the copies allow it."""
    if ascending and cost.monotone:
        spans, fitting = cut_sorted(lengths, cost)
        if keys is None or len(set(keys[:fitting])) == fitting:
            return [list(range(start, stop)) for start, stop in spans], list(range(fitting, len(lengths)))
    fitting = [index for index, length in enumerate(lengths) if cost.fits(1, length)]
    oversize = [index for index, length in enumerate(lengths) if not cost.fits(1, length)]
    if keys is None or len({keys[index] for index in fitting}) == len(fitting):
        return _cut_in_order(lengths, cost, fitting), oversize
    return _CopiesApart(lengths, cost, keys, fitting).cut(), oversize


def count_sorted_batches(lengths: Sequence[int], cost: BatchCost) -> int:
    """``len(batches) + len(oversize)`` of :func:`cut_batches` on ascending ``lengths``
    (:func:`cut_sorted`'s spans)."""
    spans, fitting = cut_sorted(lengths, cost)
    return len(spans) + len(lengths) - fitting


def cut_sorted(lengths: Sequence[int], cost: BatchCost) -> tuple[list[tuple[int, int]], int]:
    """The greedy batches of ascending ``lengths`` as ``(start, stop)`` spans, and where the
    samples that fit no batch begin; found by a binary search per batch, not a test per sample:
    a batch from ``start`` ends before the first ``j`` where ``j - start + 1`` samples padded to
    ``lengths[j]`` do not fit, and fitting only gets harder along them (a monotone cost)."""
    fitting = bisect.bisect_left(range(len(lengths)), True, key=lambda j: not cost.fits(1, lengths[j]))
    spans: list[tuple[int, int]] = []
    start = 0
    while start < fitting:
        stop = start + 1
        stop += bisect.bisect_left(range(stop, fitting), True, key=lambda j: not cost.fits(j - start + 1, lengths[j]))
        spans.append((start, stop))
        start = stop
    return spans, fitting


def _cut_in_order(lengths: Sequence[int], cost: BatchCost, order: Iterable[int]) -> list[list[int]]:
    """Greedy batches along ``order``: each takes the next sample while the cost allows."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index in order:
        if current and not cost.fits(len(current) + 1, max(longest, lengths[index])):
            batches.append(current)
            current, longest = [], 0
        current.append(index)
        longest = max(longest, lengths[index])
    if current:
        batches.append(current)
    return batches


class _CopiesApart:
    """Batches along ``order`` with no key twice in one (a window of a mixed stream can hold
    several passes of a small source, and copies of one utterance sort next to each other).

    Each batch takes the shortest samples left whose keys it does not hold yet: a copy waits
    for the next batch and another sample takes its place. A key's copies need as many
    batches as there are copies, so a key with as many copies left as batches left goes into
    the current batch whatever its length, and so do enough keys with one copy fewer for the
    last batch to hold the rest of them. Copies never pile up at the end as a run of short
    batches: with a fixed batch size every batch but the last is full whenever any
    arrangement allows it (no key with more copies than batches).
    """

    def __init__(self, lengths: Sequence[int], cost: BatchCost, keys: Sequence[str], order: list[int]):
        self.lengths = lengths
        self.cost = cost
        self.keys = keys
        self.order = order
        self.copies: dict[str, deque[int]] = {}  # each key's copies not yet placed, in order
        for index in order:
            self.copies.setdefault(keys[index], deque()).append(index)
        self.keys_with = Counter(map(len, self.copies.values()))  # copies left -> keys with as many
        self.most_copies = max(self.keys_with)
        self.placed = [False] * len(lengths)
        self.front = 0  # order[:front] is placed
        self.left = len(order)
        # a lower bound of the batches left: each sample takes at least 1 / (the most samples
        # of its length a batch holds) of one
        self._share = {length: 1 / _most_per_batch(cost, length) for length in {lengths[i] for i in order}}
        self.lower = sum(self._share[lengths[index]] for index in order)

    def cut(self) -> list[list[int]]:
        batches = []
        while self.left:
            while self.placed[self.order[self.front]]:
                self.front += 1
            batches.append(self._next_batch())
        return batches

    def _next_batch(self) -> list[int]:
        batch: list[int] = []
        taken: set[str] = set()
        longest = 0
        keys_left = len(self.copies)

        def add(index: int) -> bool:
            nonlocal longest
            if batch and not self.cost.fits(len(batch) + 1, max(longest, self.lengths[index])):
                return False
            batch.append(index)
            longest = max(longest, self.lengths[index])
            taken.add(self.keys[index])
            return True

        for key in self._due_keys():
            add(self.copies[key][0])  # one that does not fit is due again for the next batch
        for index in self._unplaced(taken):
            if len(taken) == keys_left or not add(index):
                break
        for index in batch:
            key = self.keys[index]
            self.copies[key].popleft()
            count = len(self.copies[key])
            self.keys_with[count + 1] -= 1
            self.keys_with[count] += 1
            if not count:
                del self.copies[key]
            self.placed[index] = True
            self.lower -= self._share[self.lengths[index]]
        self.left -= len(batch)
        while self.most_copies > 1 and not self.keys_with[self.most_copies]:
            self.most_copies -= 1
        return sorted(batch)

    def _unplaced(self, taken: Container[str] = ()) -> Iterator[int]:
        """The samples not yet placed whose keys are not ``taken``, in order."""
        for position in range(self.front, len(self.order)):
            index = self.order[position]
            if not self.placed[index] and self.keys[index] not in taken:
                yield index

    def _due_keys(self) -> list[str]:
        """The keys that must go into the next batch for the batches left to hold every key's
        copies apart, earliest first."""
        if self.most_copies < 2 or self.most_copies + 1 < math.ceil(self.lower - 1e-6):
            return []  # fewer copies of any key than batches left, by far
        rest = [self.lengths[index] for index in self._unplaced()]
        cut = _cut_in_order(rest, self.cost, range(len(rest)))
        batches_left, last_size = len(cut), len(cut[-1])
        if batches_left < 2:
            return []
        first = {key: waiting[0] for key, waiting in self.copies.items()}
        must = [key for key, waiting in self.copies.items() if len(waiting) >= batches_left]
        tight = sorted((key for key, waiting in self.copies.items() if len(waiting) == batches_left - 1), key=first.get)
        return sorted(must + tight[: max(0, len(must) + len(tight) - last_size)], key=first.get)


def _most_per_batch(cost: BatchCost, length: int) -> int:
    """The most samples of ``length`` one batch can hold."""
    count = 1
    while cost.fits(count * 2, length):
        count *= 2
    step = count // 2
    while step:
        if cost.fits(count + step, length):
            count += step
        step //= 2
    return count


class SortBatch(WindowStage[Batch]):
    """Length-sorted batches from windows of ``window``: a :class:`BudgetWindow` (``None``:
    the default one) or a fixed number of samples; with ``grow``, a stream's first windows are
    that share of a full one (its samples, batches and bounds), doubling, in whole batches of a
    fixed size.

    ``oversize="alone"`` puts a sample that exceeds the budget on its own in a batch;
    ``"drop"`` counts it under ``dropped.oversize``. Counters: ``batches``, ``utts_batched``,
    ``frames`` and ``padded_frames`` (in the measure's unit).
    """

    legacy_growth = Growth(1 / 16)  # every stream's, before growth followed the epoch's size

    def __init__(
        self,
        source: Stage[Sample],
        window: int | BudgetWindow | None,
        cost: BatchCost,
        seed: int,
        *position: int,
        length: Measure = FRAMES,
        shuffle: bool = True,
        oversize: str = "alone",
        grow: Growth | None = None,
    ):
        budget = BudgetWindow() if window is None else window
        fixed = not isinstance(budget, BudgetWindow)
        super().__init__(source, budget if fixed else budget.max_samples, "sort window", grow)
        self.budget = None if fixed else budget
        if oversize not in ("alone", "drop"):
            raise ConfigError(f"oversize must be 'alone' or 'drop', got {oversize!r}.")
        self.cost = cost
        self.length = length
        self.seed = seed
        self.position = position
        self.shuffle = shuffle
        self.oversize = oversize
        self._counts: dict[str, int] = {}
        self._shares: dict[int, float] = {}  # a sample's share of a batch by its length

    def reset(self, state: State | None = None) -> None:
        self._counts = dict(state.get("counts", {})) if state else {}
        super().reset(state)

    def limits(self, number: int) -> tuple[int, int, float]:
        """Window ``number``'s limits (:func:`window_limits`)."""
        grow = self.growth if self.scale(number) < 1 else None
        return window_limits(self.window if self.budget is None else self.budget, self.cost, grow, number)

    def capacity(self, number: int) -> int:
        return self.limits(number)[0]

    def add(self, window: Window, sample: Sample) -> bool:
        if window.limit is None:
            window.limit = self.limits(window.number)
        length = self.length(sample)
        if (share := self._shares.get(length)) is None:
            share = self._shares[length] = self.cost.share(length)
        window.items.append((length, sample))
        window.weight += share
        window.full = window_closes(len(window.items), window.weight, window.limit)
        return window.full

    def unwrap(self, item: tuple[int, Sample]) -> Sample:
        return item[1]

    def arrange(self, items: list[tuple[int, Sample]], number: int, fresh: bool) -> list[Batch]:
        lengths = [length for length, _ in items]
        keys = [sample.key for _, sample in items]
        order = sorted(range(len(items)), key=keys.__getitem__)
        order.sort(key=lengths.__getitem__)  # stable: by length, then key, then place in the window
        lengths = [lengths[i] for i in order]
        samples = [items[i][1] for i in order]
        # A window of a mixed stream can hold several passes of a small source: copies of one
        # utterance sort next to each other, and cut_batches keeps them in different batches.
        indices, oversize = cut_batches(lengths, self.cost, [keys[i] for i in order], ascending=True)
        batches = [Batch([samples[i] for i in batch], [lengths[i] for i in batch]) for batch in indices]
        if self.oversize == "alone":
            batches.extend(Batch([samples[i]], [lengths[i]]) for i in oversize)
        elif fresh and oversize:  # a restored window was counted when first formed
            self._counts["dropped.oversize"] = self._counts.get("dropped.oversize", 0) + len(oversize)
        if self.shuffle:
            order = stage_rng(self.seed, Seed.BATCH_ORDER, *self.position, number).permutation(len(batches))
            batches = [batches[i] for i in order]
        return batches

    def held(self, output: Batch) -> list[Sample]:
        return output.samples

    def numbers(self, output: Batch) -> list[int]:
        return output.lengths

    def rebuild(self, items: list[Sample], numbers: list[int] | None) -> Batch:
        return Batch(items, numbers or [])

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
