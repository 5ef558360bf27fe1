"""How many batches an epoch holds on this rank: exact where the plan decides it, else an
estimate from the shards' index (``loader.planned_batches()``, ``len(loader)``).

Exact: ``epoch_steps``; fixed ``batch_size`` over indexed shards without length filters,
``skip_bad`` or copies of a mix (a sorted window of ``n`` samples gives ``ceil(n / batch_size)``
batches, and the plan gives every reader's ``n``). Otherwise the batches of each reader are
counted on lengths drawn from the index's histogram (8 bins per octave), once with every
length at its bin's low end and once at its high end: the count lies between the two, and the
estimate is their middle with half their spread as its error.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ...formats.index import BINS_PER_OCTAVE, bin_bounds
from ...formats.table import ShardTable
from ...options import Batching, BudgetWindow
from ...protocol import PlannedBatches
from ...seeds import Seed, stage_rng
from ..plan import Unit, plan_epoch, planned_utts
from ..stages.batching import count_sorted_batches, whole_batches
from ..workers.recipe import SORT_GROWTH, batch_cost
from ..workers.setup import WorkerSetup
from .merge import RankPosition

SIMULATED_SAMPLES = 40_000  # lengths drawn and cut into windows per loader (the rest is scaled from them)


def planned_batches(setup: WorkerSetup, epoch: int, start: RankPosition | None = None) -> PlannedBatches:
    """The batches of ``epoch`` on this rank, from ``start`` (a loaded position: its steps
    already taken, and after an elastic resume the units it gave this rank's readers) or from
    the epoch's beginning."""
    done_steps = start.step if start is not None else 0
    resumed = start.plan_units() if start is not None else None
    grow = setup.options.batching.grow_windows and (start is None or start.windows_grow)
    options = setup.options
    steps = options.epochs.epoch_steps
    if steps is not None:
        return PlannedBatches(steps, max(0, steps - done_steps))
    if options.epochs.continues_stream:
        return _stream_estimate(setup, done_steps)
    if resumed is not None:
        return _elastic_rest(setup, resumed, done_steps)
    plan = plan_epoch(
        setup.table,
        epoch,
        options.shuffling.seed,
        setup.world_size,
        setup.readers_per_rank,
        options.shuffling.shuffle,
        options.shuffling.split_shards,
    )
    utts = [[planned_utts(setup.table, units) for units in rank] for rank in plan]
    if any(n is None for rank in utts for n in rank):
        return _unknown("some shards have no index.json (run `seqshard index` on their folders)")
    why = _why_not_exact(setup)
    per_rank = [[pair for n in rank for pair in _reader_batches(setup, int(n), grow)] for rank in utts]  # type: ignore[arg-type]
    lows = [sum(low for low, _ in rank) for rank in per_rank]
    highs = [sum(high for _, high in rank) for rank in per_rank]
    if options.epochs.uneven == "join":
        low, high = lows[setup.rank], highs[setup.rank]
    else:  # the ranks step together until the first runs out
        low, high = min(lows), min(highs)
    return _planned(low, high, done_steps, why)


def _elastic_rest(setup: WorkerSetup, resumed: list[list[Unit]], done_steps: int) -> PlannedBatches:
    """The rest of an epoch resumed elastically: the batches of this rank's new units (each
    rank knows only its own share, so the step where ranks that stop together end is an
    estimate, at most this rank's count)."""
    utts = [planned_utts(setup.table, units) for units in resumed]
    if any(n is None for n in utts):
        return _unknown("some shards have no index.json (run `seqshard index` on their folders)")
    grow = setup.options.batching.grow_windows
    pairs = [pair for n in utts for pair in _reader_batches(setup, int(n), grow)]  # type: ignore[arg-type]
    why = _why_not_exact(setup)
    if not why and setup.options.epochs.uneven != "join" and setup.world_size > 1:
        why = "after an elastic resume a rank knows only its own share of the epoch's rest"
    low, high = (done_steps + sum(pair[end] for pair in pairs) for end in (0, 1))
    return _planned(low, high, done_steps, why)


def _reader_batches(setup: WorkerSetup, count: int, grow: bool) -> list[tuple[int, int]]:
    """(low, high) batches of a reader of ``count`` samples (one pair per window; a stream's
    first windows grow, ``SORT_GROWTH``)."""
    batching = setup.options.batching
    full = _window_samples(setup)
    sizes: list[int] = []
    while count > 0:
        growing = grow and SORT_GROWTH.scale(len(sizes)) < 1
        sizes.append(min(count, _window_samples(setup, len(sizes)) if growing else full))
        count -= sizes[-1]
    if batching.batch_size is not None:
        return [(math.ceil(n / batching.batch_size),) * 2 for n in sizes]
    low, high = _per_sample_batches(setup)
    return [(round(n * low), round(n * high)) for n in sizes]


def _window_samples(setup: WorkerSetup, number: int | None = None) -> int:
    """Samples of a full sort window, or of a stream's window ``number`` (``SORT_GROWTH``):
    the option's number, or what the default budget window reads at the index's mean share of
    a batch per sample (exact for ``batch_size``)."""
    batching = setup.options.batching
    cost = batch_cost(batching)
    if batching.sort_window is not None:
        full = batching.sort_window
        return full if number is None else whole_batches(SORT_GROWTH.items(full, number), cost, full)
    window = BudgetWindow() if number is None else BudgetWindow().scaled(SORT_GROWTH.scale(number))
    histogram = dict(setup.table.length_hist)
    if batching.batch_size is not None or not histogram:
        samples = window.samples(cost.share(1))
        return samples if number is None else whole_batches(samples, cost, BudgetWindow().samples(cost.share(1)))
    shares = sum(
        cost.share(max(1, math.floor(math.sqrt(bin_bounds(b)[0] * bin_bounds(b)[1])))) * n for b, n in histogram.items()
    )
    return window.samples(shares / sum(histogram.values()))


def _per_sample_batches(setup: WorkerSetup) -> tuple[float, float]:
    """Batches per sample of budget batches, on lengths drawn from the index's histogram at
    their bins' low and high ends (the table's histogram, one draw per loader: drawn once and
    kept, as an iteration asks for it at its start)."""
    options = setup.options
    return _drawn_batches_per_sample(setup.table, options.batching, options.shuffling.seed, _window_samples(setup))


@lru_cache(maxsize=4)
def _drawn_batches_per_sample(table: ShardTable, batching: Batching, seed: int, window: int) -> tuple[float, float]:
    histogram = dict(table.length_hist)
    if not histogram:
        return math.nan, math.nan
    windows = max(2, SIMULATED_SAMPLES // window)
    bins = np.fromiter(histogram, dtype=np.int64)
    mass = np.fromiter(histogram.values(), dtype=np.float64)
    rng = stage_rng(seed, Seed.ESTIMATE)
    drawn = rng.choice(bins, size=window * windows, p=mass / mass.sum())
    cost = batch_cost(batching)
    found = []
    for end in (0, 1):
        lengths = np.maximum(1, np.floor(2.0 ** ((drawn + end) / BINS_PER_OCTAVE))).astype(np.int64)  # bin_bounds
        batches = 0
        for part in np.split(lengths, windows):
            batches += count_sorted_batches(
                np.sort(part).tolist(), cost
            )  # oversize ones alone (or dropped: an estimate)
        found.append(batches / len(drawn))
    return found[0], found[1]


def _stream_estimate(setup: WorkerSetup, done_steps: int) -> PlannedBatches:
    """Steps of an endless stream's epoch cut by hours or by one source's pass: the frames (or
    utterances) an epoch reads over every rank, at the frames (utterances) per batch drawn."""
    options, table = setup.options, setup.table
    low, high = _per_sample_batches(setup)
    histogram = dict(table.length_hist)
    if math.isnan(low) or not histogram:
        return _unknown("the shards' index.json has no length histogram")
    mean = sum(math.sqrt(bin_bounds(b)[0] * bin_bounds(b)[1]) * n for b, n in histogram.items()) / sum(
        histogram.values()
    )
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


def _why_not_exact(setup: WorkerSetup) -> str:
    options = setup.options
    if options.batching.batch_size is None:
        return "batch_frames batches hold as many samples as their lengths allow"
    if options.limits.active:
        return "length filters drop samples the index cannot count"
    if options.bad_data.skip_bad:
        return "skip_bad drops bad samples only found while reading"
    if options.batching.bucket_sync:
        return "bucket_sync holds batches back to match the ranks' buckets"
    return ""


def _planned(low: int, high: int, done_steps: int, why: str) -> PlannedBatches:
    total = round((low + high) / 2)
    error = (high - low) / 2 / total if total else 0.0
    return PlannedBatches(total, max(0, total - done_steps), exact=not why, error=error, why=why)


def _unknown(why: str) -> PlannedBatches:
    return PlannedBatches(0, 0, exact=False, error=math.inf, why=why)
