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
import heapq
import math
from collections import deque
from collections.abc import Iterable, Sequence
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

    The work is ``n log n`` however often keys repeat: a batch draws from a heap of each key's
    first copy left (not a scan past the copies of the keys it holds), and the batches left are
    counted over runs of one length (:class:`_Runs`), not sample by sample.
    """

    def __init__(self, lengths: Sequence[int], cost: BatchCost, keys: Sequence[str], order: list[int]):
        self.lengths = lengths
        self.cost = cost
        self.keys = keys
        self.order = order
        self.copies: dict[str, deque[int]] = {}  # each key's copies not yet placed: positions in order
        for position, index in enumerate(order):
            self.copies.setdefault(keys[index], deque()).append(position)
        self.with_copies: dict[int, set[str]] = {}  # copies left -> the keys with as many (none: no entry)
        for key, waiting in self.copies.items():
            self.with_copies.setdefault(len(waiting), set()).add(key)
        self.most_copies = max(self.with_copies)
        self.heads = [waiting[0] for waiting in self.copies.values()]  # each key's first copy left (and stale ones)
        heapq.heapify(self.heads)
        self.left = len(order)
        most = {length: _most_per_batch(cost, length) for length in {lengths[i] for i in order}}
        self.runs = _Runs([lengths[index] for index in order], most)
        # a lower bound of the batches left: each sample takes at least 1 / (the most samples
        # of its length a batch holds) of one
        self._share = {length: 1 / count for length, count in most.items()}
        self.lower = sum(self._share[lengths[index]] for index in order)

    def cut(self) -> list[list[int]]:
        batches = []
        while self.left:
            batches.append(self._next_batch())
        return batches

    def _next_batch(self) -> list[int]:
        batch: list[int] = []  # positions in order
        taken: set[str] = set()
        longest = 0
        keys_left = len(self.copies)

        def add(position: int) -> bool:
            nonlocal longest
            length = self.lengths[self.order[position]]
            if batch and not self.cost.fits(len(batch) + 1, max(longest, length)):
                return False
            batch.append(position)
            longest = max(longest, length)
            taken.add(self.keys[self.order[position]])
            return True

        for key in self._due_keys():
            add(self.copies[key][0])  # one that does not fit is due again for the next batch
        while self.heads and len(taken) < keys_left:
            position = self.heads[0]
            key = self.keys[self.order[position]]
            placed = key in taken or self.copies.get(key, (None,))[0] != position  # in this batch or before
            if not placed and not add(position):
                break
            heapq.heappop(self.heads)
        for position in batch:
            self._place(position)
        self.left -= len(batch)
        while self.most_copies > 1 and self.most_copies not in self.with_copies:
            self.most_copies -= 1
        return sorted(self.order[position] for position in batch)

    def _place(self, position: int) -> None:
        key = self.keys[self.order[position]]
        waiting = self.copies[key]
        waiting.popleft()
        count = len(waiting)
        had = self.with_copies[count + 1]
        had.discard(key)
        if not had:
            del self.with_copies[count + 1]
        if count:
            self.with_copies.setdefault(count, set()).add(key)
            heapq.heappush(self.heads, waiting[0])
        else:
            del self.copies[key]
        self.runs.take(position)
        self.lower -= self._share[self.lengths[self.order[position]]]

    def _due_keys(self) -> list[str]:
        """The keys that must go into the next batch for the batches left to hold every key's
        copies apart, earliest first."""
        if self.most_copies < 2 or self.most_copies + 1 < math.ceil(self.lower - 1e-6):
            return []  # fewer copies of any key than batches left, by far
        batches_left, last_size = self.runs.cut(self.cost)
        if batches_left < 2:
            return []
        first = {
            key: self.copies[key][0]
            for count, keys in self.with_copies.items()
            if count >= batches_left - 1
            for key in keys
        }
        must = [key for key in first if len(self.copies[key]) >= batches_left]
        tight = sorted((key for key in first if len(self.copies[key]) == batches_left - 1), key=first.__getitem__)
        return sorted(must + tight[: max(0, len(must) + len(tight) - last_size)], key=first.__getitem__)


class _Runs:
    """The samples not yet placed, as runs of one length along the order: the greedy batches of
    what is left (:func:`_cut_in_order`'s) counted a run at a time, not a sample at a time."""

    def __init__(self, lengths: Sequence[int], most: dict[int, int]):
        self.most = most  # the most samples of a length one batch holds
        self.run_of: list[int] = []
        self.lengths: list[int] = []  # a run's length
        self.counts: list[int] = []  # its samples not yet placed
        for length in lengths:
            if not self.lengths or self.lengths[-1] != length:
                self.lengths.append(length)
                self.counts.append(0)
            self.run_of.append(len(self.lengths) - 1)
            self.counts[-1] += 1
        self.alive = list(range(len(self.lengths)))

    def take(self, position: int) -> None:
        self.counts[self.run_of[position]] -= 1

    def cut(self, cost: BatchCost) -> tuple[int, int]:
        """How many greedy batches the samples left make, and the last one's size. Within a run
        a batch takes samples up to the most its longest allows (a cost that, at one length, only
        gets harder with more samples: every cost here)."""
        self.alive = [run for run in self.alive if self.counts[run]]
        batches = size = longest = 0
        for run in self.alive:
            left, length = self.counts[run], self.lengths[run]
            if size:
                most = self.most[max(longest, length)]
                if size < most:
                    took = min(left, most - size)
                    size, left, longest = size + took, left - took, max(longest, length)
                if left:
                    batches, size = batches + 1, 0
            if left:
                most = self.most[length]
                full = (left - 1) // most
                batches, size, longest = batches + full, left - full * most, length
        return batches + 1, size


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
    arranges_ahead = True

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
        if self.shuffle:
            order = stage_rng(self.seed, Seed.BATCH_ORDER, *self.position, number).permutation(len(batches))
            batches = [batches[i] for i in order]
        return batches

    def formed(self, items: int, outputs: list[Batch]) -> None:
        dropped = items - sum(len(batch) for batch in outputs)  # "drop": the samples over the budget
        if dropped:  # counted once: a restored window was counted when first formed
            self._counts["dropped.oversize"] = self._counts.get("dropped.oversize", 0) + dropped

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
