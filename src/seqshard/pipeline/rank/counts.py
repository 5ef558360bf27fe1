"""How many batches an epoch holds on this rank (``loader.planned_batches()``, ``len(loader)``):
exact where the plan decides it, else bounds that hold, else an estimate that says so.

- Exact: ``epoch_steps``; fixed ``batch_size`` over indexed shards without length filters,
  ``skip_bad`` or copies of a mix (a sorted window of ``n`` samples gives ``ceil(n /
  batch_size)`` batches, and the plan gives every reader's ``n``); and any epoch of at most
  ``EXACT_UTTS`` samples whose batches are known before reading (member tables that keep
  each sample's length, nothing the plan cannot see: ``batch_plan.py``), walked batch by batch.
- Bounds: each reader's samples are known to its shards' index: how many, and their lengths
  to a histogram bin (8 per octave) within the shard's exact shortest and longest. A reader
  whose samples make one sort window (a small epoch) cuts them into greedy batches of its
  sorted lengths, and greedy batches of sorted lengths are never fewer when a sample is added
  or made longer: counted once on the samples certainly kept at their bins' low ends and once
  on those possibly kept at the high ends (length filters, ``oversize="drop"``), the real count
  lies between the two. A reader that reads part of a shard is given, for each bound, the
  part's most favourable samples.
- Estimate: a reader of several windows does not know which samples share a window (the
  shuffle decides): its windows are counted on ``DRAWS`` random orders of the same lengths,
  and the bounds are the extremes found, widened by their spread, said so in ``why``. A reader
  of more samples than its share of ``SIMULATED_SAMPLES`` (at least two windows) has its count
  scaled from that many.

Samples that ``skip_bad``, ``check_finite``, the label filters (``max_tokens``, frames per
token), ``transforms`` or a ``recipe`` drop (or change) as they are read are not foreseen: the bounds count them (the real count can only be lower), and
``why`` says so. Audio measured as it is read (fbank frames, speed perturbation) is allowed
the difference from the index's 10 ms frames (``AUDIO_SLACK`` frames, the speed factors).

- What a rank surely still makes (:func:`surely_left`, for the ranks' agreement on the end of
  an epoch: ``epochs.py``): a batch holds at most one batch's worth of unpadded shares, so the
  shares of the samples left, each at its bin's low end and the fewest that can be left,
  summed, are a lower bound of its batches whatever the windows and orders.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ...errors import SeqshardError
from ...formats.index_entries import MAX_LENGTH, bin_length
from ...options import BudgetWindow
from ...protocol import PlannedBatches
from ...seeds import Seed, stage_rng
from ..epoch_plan import Unit, plan_epoch, planned_utts, unit_counts
from ..stages.base import Growth
from ..stages.batching import BatchCost, BucketBudgets, count_sorted_batches, window_closes, window_limits, window_size
from ..workers.recipe import batch_cost, sort_growth, window_samples
from ..workers.setup import WorkerSetup
from .batch_plan import rest_of_epoch
from .merge import RankPosition

EXACT_UTTS = 20_000  # epochs up to this size are walked batch by batch when the plan knows them (exact)
SIMULATED_SAMPLES = 40_000  # lengths drawn and cut into windows, shared by the readers (at least 2 windows each)
DRAWS = 8  # random orders of a reader's lengths counted, for a reader of several windows
LARGE_DRAWS, LARGE = 2, 200_000  # fewer of them for a table of more utterances (each order is long)
AUDIO_SLACK = 3  # frames between an index's 10 ms frames of audio and the fbank frames the loader counts
ROWS = 16_384  # shards whose length bins are bounded at once (a few MB a bound)

Lengths = tuple[np.ndarray, np.ndarray]  # a multiset of lengths: (values ascending, how many of each)


def planned_batches(
    setup: WorkerSetup, epoch: int, start: RankPosition | None = None, estimate: bool = True
) -> PlannedBatches:
    """The batches of ``epoch`` on this rank, from ``start`` (a loaded position: its steps
    already taken, and after an elastic resume the units it gave this rank's readers) or from
    the epoch's beginning. ``estimate=False``: only a count known without walking a small
    epoch's batches (about 40 us an utterance here) or drawing orders of its lengths (tens of
    ms), else unknown: for a caller at every epoch's start."""
    done_steps = start.step if start is not None else 0
    resumed = start.plan_units() if start is not None else None
    options = setup.options
    grows = start is None or start.windows_grow  # False: an epoch resumed from a state saved before windows grew
    steps = options.epochs.epoch_steps
    if steps is not None:
        return PlannedBatches(steps, max(0, steps - done_steps))
    if options.epochs.continues_stream:
        return _stream_estimate(setup, done_steps) if estimate else _unknown("not estimated")
    if resumed is not None:
        return _elastic_rest(setup, resumed, done_steps, epoch, grows, estimate)
    exact = walked_count(setup, epoch, start) if estimate else None
    if exact is not None:
        return exact
    plan = plan_epoch(
        setup.table,
        epoch,
        options.shuffling.seed,
        setup.world_size,
        setup.readers_per_rank,
        options.shuffling.shuffle,
        options.shuffling.split_shards,
    )
    # with "join" each rank goes to its own end; else the ranks step together until the first runs out
    ranks = [setup.rank] if options.epochs.uneven == "join" else range(len(plan))
    found = [[_reader_batches(setup, units, (epoch, rank, reader), grows, estimate)
              for reader, units in enumerate(plan[rank])] for rank in ranks]  # fmt: skip
    if any(pair is None for rank in found for pair in rank):
        return _unknown(_unknown_why(setup))
    low = min(sum(pair[0] for pair in rank) for rank in found)  # type: ignore[index]
    high = min(sum(pair[1] for pair in rank) for rank in found)  # type: ignore[index]
    estimated = any(pair[2] for rank in found for pair in rank)  # type: ignore[index]
    return _planned(low, high, done_steps, *_why_not_exact(setup, estimated))


def walked_count(setup: WorkerSetup, epoch: int, start: RankPosition | None) -> PlannedBatches | None:
    """The exact count of a small epoch whose batches the plan knows (member tables with
    lengths, nothing the plan cannot see: ``batch_plan.py``), by walking them; else None."""
    if (setup.table.num_utts or math.inf) > EXACT_UTTS:
        return None
    position = start if start is not None else RankPosition.fresh(epoch, setup.readers_per_rank)
    try:
        rest = len(rest_of_epoch(setup, position))
    except SeqshardError:  # NotPlannable, or a table the plan cannot use: the bounds below
        return None
    return PlannedBatches(position.step + rest, rest)


def _elastic_rest(
    setup: WorkerSetup,
    resumed: list[list[Unit]],
    done_steps: int,
    epoch: int,
    grows: bool,
    estimate: bool,
) -> PlannedBatches:
    """The rest of an epoch resumed elastically: the batches of this rank's new units (each
    rank knows only its own share, so the step where ranks that stop together end is an
    estimate, at most this rank's count)."""
    found = [
        _reader_batches(setup, units, (epoch, setup.rank, reader, 1), grows, estimate)
        for reader, units in enumerate(resumed)
    ]
    if any(pair is None for pair in found):
        return _unknown(_unknown_why(setup))
    why, holds = _why_not_exact(setup, any(pair[2] for pair in found))  # type: ignore[index]
    low, high = (done_steps + sum(pair[end] for pair in found) for end in (0, 1))  # type: ignore[index]
    if setup.options.epochs.uneven != "join" and setup.world_size > 1:
        why = (
            why + "; " if why else ""
        ) + "after an elastic resume a rank knows only its own share of the epoch's rest"
        low, holds = done_steps, False  # the other ranks may run out first
    return _planned(low, high, done_steps, why, holds)


def _reader_batches(
    setup: WorkerSetup, units: Sequence[Unit], position: tuple[int, ...], grows: bool, estimate: bool
) -> tuple[int, int, bool] | None:
    """``(low, high, estimated)`` batches of the reader of ``units`` (its first sort windows
    growing, if ``grows``, as the size of its epoch has them: ``recipe.sort_growth``); None when
    its shards' index does not say enough (their sizes, or for budget batches their lengths), or
    when only an estimate would (``estimate=False``)."""
    count = planned_utts(setup.table, units)
    if count is None:
        return None
    options = setup.options
    grow = sort_growth(options.batching, setup.table.length_hist, count) if grows else None
    if not _why_not_exact(setup, False)[0]:  # fixed batch_size, nothing filtered: ceil(n / size) a window
        size = int(options.batching.batch_size)  # type: ignore[arg-type]
        batches = sum(math.ceil(n / size) for n in _fixed_size_windows(setup, count, size, grow))
        return batches, batches, False
    bracket = length_bounds(setup, units)
    if bracket is None:
        return None
    low, high = bracket
    cost = batch_cost(options.batching)
    shares = sum(cost.share(int(v)) * int(n) for v, n in zip(*high))  # at most those of all but the last sample
    if not window_closes(int(high[1].sum()) - 1, shares, window_limits(_sort_window(setup), cost, grow, 0)):
        return _count(_expand(low), cost), _count(_expand(high), cost), False
    if not estimate:
        return None
    return (*drawn_counts(setup, low, high, cost, position, grow), True)


Certain = tuple[Lengths, int]  # the samples certainly kept (at their bins' low ends), and all the units hold


def certain_lengths(setup: WorkerSetup, units: Sequence[Unit]) -> Certain | None:
    """The samples of ``units`` that are certainly kept (length filters, ``oversize="drop"``),
    each at its bin's low end, and how many samples the units hold; None when their shards'
    index does not say."""
    bracket = length_bounds(setup, units, high=False)
    count = planned_utts(setup.table, units)
    return None if bracket is None or count is None else (bracket[0], count)


def surely_left(setup: WorkerSetup, certain: Certain, remaining: int) -> int:
    """A lower bound of the batches that ``remaining`` samples not yet taken from units whose
    certainly kept samples are ``certain`` still make: the shares of the fewest certainly kept
    samples that can be among them, each its shortest, summed (a batch holds at most 1)."""
    lengths, count = certain
    kept = remaining - (count - int(lengths[1].sum()))
    if kept <= 0:
        return 0
    values, counts = _kept(lengths[0][None, :], lengths[1][None, :], np.array([kept]))  # ascending: merged
    share = _least_share(batch_cost(setup.options.batching))
    shares = sum(share(int(v)) * int(n) for v, n in zip(values, counts) if n)
    return max(0, math.floor(shares - 1e-6))


def unforeseen(setup: WorkerSetup) -> list[str]:
    """What may drop (or change) samples as they are read, unforeseen by the index: the label
    filters, ``skip_bad``, ``check_finite``, ``transforms`` and a ``recipe`` of the user's."""
    options = setup.options
    named = (
        ("the label filters", options.limits.count_tokens),
        ("skip_bad", options.bad_data.skip_bad),
        ("check_finite", options.bad_data.check_finite),
        ("transforms", bool(options.pipeline.transforms)),
        ("a recipe of your own", options.pipeline.recipe is not None),
    )
    return [name for name, on in named if on]


def _least_share(cost: BatchCost):
    """A sample's share of a batch, at least (a batch's shares sum to at most 1): the cost's
    own, and with per-bucket budgets against the largest (a short sample may share a batch of
    a longer bucket)."""
    if isinstance(cost, BucketBudgets):
        most = max(cost.budgets.budgets)
        return lambda length: min(1.0, length / most)
    return cost.share


def _fixed_size_windows(setup: WorkerSetup, count: int, size: int, grow: Growth | None) -> list[int]:
    """The samples of each sort window of a reader of ``count`` samples in batches of ``size``
    (a window closes at its most samples, or at its least once they fill its batches)."""
    window, cost = _sort_window(setup), batch_cost(setup.options.batching)
    sizes: list[int] = []
    while count > 0:
        limits = window_limits(window, cost, grow, len(sizes))
        taken = window_size(np.full(min(count, limits[0]), 1 / size), limits)
        repeat = 1 if grow is not None and grow.scale(len(sizes)) < 1 else max(1, count // taken)  # grown: alike
        sizes += [taken] * repeat
        count -= taken * repeat
    return sizes


def _sort_window(setup: WorkerSetup) -> BudgetWindow | int:
    return setup.options.batching.sort_window or BudgetWindow()


def length_bounds(setup: WorkerSetup, units: Sequence[Unit], high: bool = True) -> tuple[Lengths, Lengths] | None:
    """The reader's lengths for each bound: those certainly kept at their lowest, and those
    possibly kept at their highest (see the module docstring; ``high=False``: the first
    alone, the second empty)."""
    table, options = setup.table, setup.options
    shortest, longest = options.limits.min_frames or 1, options.limits.max_frames or math.inf
    cost = batch_cost(options.batching)
    if options.batching.oversize == "drop":  # kept only when it fits a batch alone
        longest = min(longest, longest_fitting(cost))
    sizes = table.sizes()
    shards, taken = unit_counts(table, units)
    read = taken > 0
    shards, wanted = shards[read], taken[read]
    if (sizes[shards] < 0).any():
        return None
    low_parts, high_parts = [], []
    for at in range(0, len(shards), ROWS):  # each shard's bins a row, in bulk, so many rows at a time
        part, asked = shards[at : at + ROWS], wanted[at : at + ROWS]
        found = table.lengths.ranges(part)
        if found is None:
            return None
        lows, highs, counts = _measured(setup, *found)
        counts = counts.astype(np.int64)
        certain = np.where((lows >= shortest) & (highs <= longest), counts, 0)
        sure = np.maximum(0, asked - (sizes[part] - certain.sum(axis=1)))  # kept, whichever are read
        low_parts.append(_kept(lows, certain, sure))
        if high:
            possible = np.where((highs >= shortest) & (lows <= longest), counts, 0)
            capped = (np.minimum(highs, longest) if math.isfinite(longest) else highs).astype(np.int64)
            high_parts.append(_kept(capped[:, ::-1], possible[:, ::-1], asked))
    return _merged(low_parts), _merged(high_parts)


def _kept(values: np.ndarray, counts: np.ndarray, wanted: np.ndarray) -> Lengths:
    """Of each row's lengths ``values`` (ascending, or descending: in the order they are
    taken) with their ``counts``, the first ``wanted`` of that row, all rows together."""
    before = np.cumsum(counts, axis=1) - counts
    kept = np.clip(wanted[:, None] - before, 0, counts)
    return values[kept > 0], kept[kept > 0]


def _measured(setup: WorkerSetup, low: np.ndarray, high: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, ...]:
    """The index's length bounds in the batching measure: audio is measured as it is read
    (fbank frames, speed perturbation), a few frames off the index's 10 ms frames."""
    if setup.fields.audio is None or (setup.fields.features is not None and setup.audio.features != "fbank"):
        return low, high, counts
    factors = setup.audio.speed_perturb or (1.0,)
    low = np.maximum(1, np.floor(low / max(factors)) - AUDIO_SLACK).astype(np.int64)  # faster: fewer frames
    high = (np.ceil(high / min(factors)) + AUDIO_SLACK).astype(np.int64)
    return low, high, counts


def longest_fitting(cost: BatchCost) -> float:
    """The longest length that fits a batch alone (infinite for a fixed batch size)."""
    low, high = 0, 1
    while cost.fits(1, high):
        if high > MAX_LENGTH:  # any length an index can record fits
            return math.inf
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if cost.fits(1, middle) else (low, middle)
    return low


def _merged(parts: Sequence[Lengths]) -> Lengths:
    if not parts:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    values = np.concatenate([p[0] for p in parts])
    counts = np.concatenate([p[1] for p in parts])
    unique, inverse = np.unique(values, return_inverse=True)
    summed = np.bincount(inverse, weights=counts, minlength=len(unique)).astype(np.int64)
    return unique[summed > 0], summed[summed > 0]


def _expand(lengths: Lengths) -> np.ndarray:
    return np.repeat(*lengths)


def _count(sorted_lengths: np.ndarray, cost: BatchCost) -> int:
    return count_sorted_batches(sorted_lengths.tolist(), cost)  # oversize ones alone (or dropped: not there)


def drawn_counts(
    setup: WorkerSetup, low: Lengths, high: Lengths, cost: BatchCost, position: tuple[int, ...], grow: Growth | None
) -> tuple[int, int]:
    """Bounds for a reader of several windows, from ``DRAWS`` random orders of its lengths at
    each end (``LARGE_DRAWS`` for a large table): the extremes found, widened by their spread
    and one batch."""
    found: list[list[float]] = [[], []]
    draws = DRAWS if (setup.table.num_utts or 0) <= LARGE else LARGE_DRAWS
    cap = max(
        2 * (window_samples(setup.options.batching, setup.table.length_hist) or 0),
        SIMULATED_SAMPLES // (setup.world_size * setup.readers_per_rank),
    )
    for end, (values, counts) in enumerate((low, high)):
        total = int(counts.sum())
        shares = np.array([cost.share(int(v)) for v in values])
        for draw in range(draws):
            rng = stage_rng(setup.options.shuffling.seed, Seed.ESTIMATE, *position, end, draw)
            if total <= cap:
                drawn = rng.permutation(np.repeat(np.arange(len(values)), counts))
            else:
                drawn = rng.choice(len(values), size=cap, p=counts / total)
            batches = _windows_batches(values[drawn], shares[drawn], setup, cost, grow)
            found[end].append(batches * total / max(1, len(drawn)))
    spread = [max(f) - min(f) for f in found]
    return max(0, math.floor(min(found[0]) - spread[0]) - 1), math.ceil(max(found[1]) + spread[1]) + 1


def _windows_batches(
    stream: np.ndarray, shares: np.ndarray, setup: WorkerSetup, cost: BatchCost, grow: Growth | None
) -> int:
    """Batches of the lengths ``stream`` (each taking ``shares`` of a batch) cut into sort
    windows as the batching stage cuts them (``window_size``)."""
    batches, at, number = 0, 0, 0
    while at < len(stream):
        end = at + window_size(shares[at:], window_limits(_sort_window(setup), cost, grow, number))
        batches += _count(np.sort(stream[at:end]), cost)
        at, number = end, number + 1
    return batches


def _stream_estimate(setup: WorkerSetup, done_steps: int) -> PlannedBatches:
    """Steps of an endless stream's epoch cut by hours or by one source's pass: the frames (or
    utterances) an epoch reads over every rank, at the frames (utterances) per batch drawn."""
    options, table = setup.options, setup.table
    low, high = _per_sample_batches(setup)
    histogram = dict(table.length_hist)
    if math.isnan(low) or not histogram:
        return _unknown("the shards' index.json has no length histogram")
    mean = sum(bin_length(b + 0.5) * n for b, n in histogram.items()) / sum(histogram.values())
    if options.epochs.epoch_hours is not None:
        samples = options.epochs.epoch_hours * 3.6e6 / table.frame_shift_ms / mean
    else:
        assert setup.mix is not None and options.epochs.epoch_source is not None
        source, size = setup.mix.epoch_source(options.epochs.epoch_source)
        samples = size / setup.mix.shares[source]
    per_rank = samples / setup.world_size
    return _planned(
        round(per_rank * low), round(per_rank * high), done_steps, "an endless stream's epoch is cut by length"
    )


def _per_sample_batches(setup: WorkerSetup) -> tuple[float, float]:
    """Batches per sample of budget batches, on lengths drawn from the index's histogram at
    their bins' low and high ends (the table's histogram, one draw per loader)."""
    histogram = dict(setup.table.length_hist)
    if not histogram:
        return math.nan, math.nan
    cost = batch_cost(setup.options.batching)
    window = window_samples(setup.options.batching, histogram) or BudgetWindow().max_samples  # not empty here
    windows = max(2, SIMULATED_SAMPLES // window)
    bins = np.fromiter(histogram, dtype=np.int64)
    mass = np.fromiter(histogram.values(), dtype=np.float64)
    drawn = stage_rng(setup.options.shuffling.seed, Seed.ESTIMATE).choice(
        bins, size=window * windows, p=mass / mass.sum()
    )
    found = []
    for end in (0, 1):
        lengths = np.maximum(1, np.floor(bin_length(drawn + end))).astype(np.int64)  # low or high ends
        found.append(sum(_count(np.sort(part), cost) for part in np.split(lengths, windows)) / len(drawn))
    return found[0], found[1]


def _why_not_exact(setup: WorkerSetup, estimated: bool) -> tuple[str, bool]:
    """Why the count is not exact ("" when the plan decides it), and whether its bounds hold
    whatever the reading finds (no estimate, nothing dropped that the index cannot foresee)."""
    options, limits = setup.options, setup.options.limits
    reasons = []
    if options.batching.batch_size is None:
        reasons.append("batch_frames batches hold as many samples as their lengths allow")
    if limits.min_frames is not None or limits.max_frames is not None:
        reasons.append("length filters drop samples the index knows only to a histogram bin")
    if estimated:
        reasons.append(f"readers of several sort windows: bounds estimated over {DRAWS} random orders of their lengths")
    dropping = unforeseen(setup)
    if dropping:
        reasons.append(f"what {' and '.join(dropping)} hold back as they read is not foreseen: fewer batches then")
    return "; ".join(reasons), not estimated and not dropping


def _unknown_why(setup: WorkerSetup) -> str:
    if not setup.table.indexed:
        return "some shards have no index.json (run `seqshard index` on their folders)"
    return "the lengths of some samples are not recorded (lists and manifests, or an index.json without them)"


def _planned(low: int, high: int, done_steps: int, why: str, holds: bool = False) -> PlannedBatches:
    """An estimate between ``low`` and ``high``; exact when they meet and ``holds`` (the bounds
    hold whatever the reading finds)."""
    if low == high and (holds or not why):
        return PlannedBatches(low, max(0, low - done_steps))
    total = round((low + high) / 2)
    error = max(total - low, high - total) / total if total else 0.0
    return PlannedBatches(total, max(0, total - done_steps), exact=False, error=error, why=why, low=low, high=high)


def _unknown(why: str) -> PlannedBatches:
    return PlannedBatches(0, 0, exact=False, error=math.inf, why=why)
