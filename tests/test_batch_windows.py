"""Sort windows that follow the budget (issue 19, item 5): a window holds a number of batches,
so padding stays low at large budgets, with resume, seeds and a memory bound kept."""

import math
import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import assert_resumes_everywhere
from seqshard.errors import ConfigError, StateMismatchError
from seqshard.formats.index_entries import length_bin
from seqshard.options import Batching
from seqshard.pipeline.stages.base import Growth
from seqshard.pipeline.stages.batching import (
    BudgetWindow,
    FixedSize,
    LengthBudget,
    SortBatch,
    count_sorted_batches,
    cut_batches,
    window_limits,
    window_size,
)
from seqshard.pipeline.stages.sample import Sample
from seqshard.pipeline.stages.shuffle import WindowShuffle
from seqshard.pipeline.workers.recipe import SHUFFLE_GROWTH, sort_growth
from seqshard.testing import ListSource


def samples(lengths, keys=None):
    """Samples whose "feats" has the given lengths (a range: a length without data)."""
    keys = keys or [f"u{i:05d}" for i in range(len(lengths))]
    return [Sample(key, {"feats": range(int(length))}) for key, length in zip(keys, lengths)]


def read_lognormal(count, seed=0):
    """Frames of read speech: log-normal, median 7 s, clipped to 1-20 s (bench/common.py's law)."""
    return np.clip(np.random.default_rng(seed).lognormal(np.log(700), 0.55, count), 100, 2000).astype(int)


def first_window(stage_of):
    """How many samples the stage read to emit its first batch (its first window)."""
    source = ListSource(samples([10] * 50_000))
    next(stage_of(source))
    return source.position


@pytest.mark.parametrize(
    ("window", "cost", "read"),
    [
        (BudgetWindow(batches=4, min_samples=1), FixedSize(8), 32),  # 4 batches of 8
        (BudgetWindow(batches=4, min_samples=1), LengthBudget(100), 40),  # 4 budgets of 10 samples of 10
        (BudgetWindow(batches=4, min_samples=1), LengthBudget(100, quadratic=10.0), 20),  # 20 a sample
        (BudgetWindow(batches=4, min_samples=50), LengthBudget(100), 50),  # at least 50 samples
        (BudgetWindow(batches=4, min_samples=1, max_samples=20), LengthBudget(100), 20),  # the memory bound
        (BudgetWindow(), LengthBudget(1000), 6400),  # the default: 64 batches
        (BudgetWindow(), LengthBudget(100), 2000),  # ... of at least 2,000 samples
        (BudgetWindow(), LengthBudget(10_000_000), 16384),  # the default bound
        (None, LengthBudget(1000), 6400),  # None: the default window
        (300, LengthBudget(100), 300),  # a fixed window, whatever it holds
    ],
)
def test_a_window_holds_batches_not_samples(window, cost, read):
    assert first_window(lambda source: SortBatch(source, window, cost, 0)) == read


def test_a_window_grows_with_the_budget_and_its_samples_with_their_lengths():
    window = BudgetWindow(batches=8, min_samples=1)
    sizes = {
        budget: first_window(lambda source, budget=budget: SortBatch(source, window, LengthBudget(budget), 0))
        for budget in (100, 1000, 10_000)
    }
    assert sizes == {100: 80, 1000: 800, 10_000: 8000}


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=150),
    st.sampled_from([FixedSize(3), LengthBudget(400), LengthBudget(400, quadratic=100.0)]),
    st.integers(1, 6),
)
def test_every_full_window_makes_at_least_its_batches(lengths, cost, batches):
    """Batches hold at most the budget, padded: a window whose samples fill N budgets unpadded
    makes at least N batches (the last window, at the stream's end, may make fewer)."""
    stage = SortBatch(ListSource(samples(lengths)), BudgetWindow(batches, min_samples=1), cost, 0)
    per_window: dict[int, int] = {}
    for _ in stage:
        number = stage.get_state()["window"]
        per_window[number] = per_window.get(number, 0) + 1
    assert sum(per_window.values()) >= 1
    assert all(count >= batches for number, count in per_window.items() if number < max(per_window))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=200),
    st.sampled_from([FixedSize(3), LengthBudget(400), LengthBudget(400, quadratic=100.0)]),
    st.sampled_from([BudgetWindow(2, min_samples=1), BudgetWindow(3, min_samples=5, max_samples=40), 7]),
    st.sampled_from([None, Growth(1 / 8)]),
)
def test_the_counts_cut_windows_where_the_batcher_does(lengths, cost, window, grow):
    """The epoch's counts find each window's end by ``window_size`` (pipeline/rank/counts.py):
    the same samples, window by window, as the batching stage reads."""
    stage = SortBatch(ListSource(samples(lengths)), window, cost, 0, grow=grow)
    read: Counter = Counter()
    for batch in stage:
        read[stage.get_state()["window"]] += len(batch)
    shares, sizes = np.array([cost.share(n) for n in lengths]), []
    while sum(sizes) < len(lengths):
        limits = window_limits(window, cost, grow if grow and grow.scale(len(sizes)) < 1 else None, len(sizes))
        sizes.append(window_size(shares[sum(sizes) :], limits))
    assert [read[number] for number in range(len(sizes))] == sizes and sum(read.values()) == len(lengths)


def padding(stage):
    list(stage)
    stats = stage.stats()
    return 1 - stats["frames"] / stats["padded_frames"]


def test_padding_stays_low_at_a_large_budget():
    """Batches of 1,200 s of read speech: a window of 2,000 samples makes ~12 of them, each
    spanning a wide range of lengths; the default window makes 64 (lhotse's
    DynamicBucketingSampler with 30 buckets pads 3.6% of these, bench/padding.py)."""
    lengths = read_lognormal(30_000)
    budget = LengthBudget(120_000)  # 1,200 s of 10 ms frames
    fixed = padding(SortBatch(ListSource(samples(lengths)), 2000, budget, 0))
    following = padding(SortBatch(ListSource(samples(lengths)), None, budget, 0))
    assert fixed > 0.06
    assert following < 0.025


def test_a_small_budget_keeps_the_windows_it_had():
    """Below ~64 batches in 2,000 samples the window stays 2,000 samples: the same batches."""
    lengths = read_lognormal(5000, seed=1)
    budget = LengthBudget(10_000)  # 100 s: ~14 utterances a batch, ~140 batches in 2,000

    def keys(window):
        return [[s.key for s in batch.samples] for batch in SortBatch(ListSource(samples(lengths)), window, budget, 7)]

    assert keys(None) == keys(2000)


@pytest.mark.parametrize("cost", [FixedSize(4), LengthBudget(150), LengthBudget(150, quadratic=40.0)])
def test_budget_windows_resume_everywhere(cost):
    rng = np.random.default_rng(4)
    lengths = rng.integers(5, 60, 70)

    def make():
        return SortBatch(ListSource(samples(lengths)), BudgetWindow(3, min_samples=2, max_samples=30), cost, 5, 1, 2)

    batches = assert_resumes_everywhere(make)
    assert sorted(k for batch in batches for k in batch) == [f"u{i:05d}" for i in range(70)]


def test_budget_windows_keep_copies_apart_and_resume():
    """A window of a mixed stream holds several passes of a small source (issue 17, item 5)."""
    rng = np.random.default_rng(3)
    length_of = {f"k{i}": int(rng.integers(1, 15)) for i in range(9)}
    keys = [key for _ in range(4) for key in rng.permutation(list(length_of))]

    def make():
        stream = samples([length_of[key] for key in keys], keys)
        return SortBatch(ListSource(stream), BudgetWindow(4, min_samples=1), FixedSize(4), 0, 1)

    batches = assert_resumes_everywhere(make)
    assert sorted(k for batch in batches for k in batch) == sorted(keys)
    assert all(len(set(batch)) == len(batch) for batch in batches)
    assert [len(batch) for batch in batches] == [4] * 9  # windows of 16: 4 full batches each


def test_budget_windows_are_a_function_of_the_seed():
    lengths = read_lognormal(3000, seed=2)

    def order(seed):
        stage = SortBatch(ListSource(samples(lengths)), BudgetWindow(16, min_samples=1), LengthBudget(20_000), seed)
        return [[s.key for s in batch.samples] for batch in stage]

    first, again, other = order(1), order(1), order(2)
    assert first == again != other
    assert sorted(map(sorted, first)) == sorted(map(sorted, other))  # the same batches, in another order


@pytest.mark.parametrize(
    "window", [dict(batches=0), dict(min_samples=0), dict(min_samples=100, max_samples=50), dict(batches=1.5)]
)
def test_impossible_windows_are_refused(window):
    with pytest.raises(ConfigError, match="sort window"):
        BudgetWindow(**window)


def test_the_loaders_default_window_follows_the_budget_and_len_stays_exact(tmp_path):
    """make_loader's default sort_window is the budget window: batch_size=3 sorts windows of
    2,000 samples (64 batches of 3 is fewer), after an epoch's first windows of 1/4 and 1/2 of
    that in whole batches (an epoch of 2 to 4 full windows starts from 1/4); so 4,500 utterances
    make windows of 501, 1,002, 2,000 and 997 samples, 167 + 334 + 667 + 333 batches, and len()
    counts them so."""
    from conftest import pack_small
    from seqshard import make_loader

    packed = pack_small(tmp_path, utts_per_file=1500, speakers=45, per_speaker=100, dim=2, frames=(2, 6))
    loader = make_loader(packed.pattern, batch_size=3, num_workers=0, split_shards=False)
    assert loader.planned_batches().exact and len(loader) == 1501
    batches = list(loader)
    assert len(batches) == 1501 and sum(len(b["keys"]) for b in batches) == 4500
    assert sorted(len(b["keys"]) for b in batches)[:3] == [1, 2, 3]  # the full windows leave a batch of 2 and 1


def test_a_sorted_window_cut_by_binary_searches_gives_the_batches_a_test_per_sample_gives():
    """A full window's arrangement took 14 ms (4,096 samples) to 100 ms (16,384), all at one batch:
    tuples sorted, then a cost test per sample. Sorted by its keys, then its lengths, and cut by
    a binary search per batch, it gives the same batches, copies of a key and oversize ones too."""
    draw = random.Random(1)
    for _ in range(300):
        count = draw.randint(0, 300)
        lengths = sorted(draw.randint(1, 400) for _ in range(count))
        keys = [f"k{draw.randint(0, count if draw.random() < 0.8 else count // 4)}" for _ in range(count)]
        cost = draw.choice(
            [FixedSize(draw.randint(1, 9)), LengthBudget(draw.randint(50, 2000)), LengthBudget(900, 300.0)]
        )
        for known in (keys, None):
            assert cut_batches(lengths, cost, known, ascending=True) == cut_batches(lengths, cost, known)
        items = [(length, Sample(key, {})) for length, key in zip(lengths, keys)]
        draw.shuffle(items)
        stage = SortBatch(ListSource([]), 100, cost, 0, shuffle=False)
        measured = sorted((length, sample.key, i) for i, (length, sample) in enumerate(items))  # as it was sorted
        indices, alone = cut_batches([m[0] for m in measured], cost, [m[1] for m in measured])
        expected = [[items[measured[i][2]][1].key for i in batch] for batch in indices + [[i] for i in alone]]
        assert [[s.key for s in batch.samples] for batch in stage.arrange(items, 0, True)] == expected


def test_counting_sorted_batches_gives_what_cutting_them_gives():
    draw = random.Random(0)
    for _ in range(2000):
        lengths = sorted(draw.randint(1, 3000) for _ in range(draw.randint(0, 200)))
        cost = draw.choice(
            [FixedSize(draw.randint(1, 50)), LengthBudget(draw.randint(1, 20000)), LengthBudget(9000, 1000.0)]
        )
        cut, alone = cut_batches(lengths, cost)
        assert count_sorted_batches(lengths, cost) == len(cut) + len(alone), (lengths, cost)


def loader_windows(lengths, budget):
    """The shuffle and sort stages the loader's recipe builds for one reader of ``lengths``
    (read in a random order) at ``budget`` frames, their windows growing as it grows them."""
    histogram = Counter(map(length_bin, lengths.tolist()))  # the index's
    growth = sort_growth(Batching(batch_frames=budget), histogram, len(lengths))
    shuffled = WindowShuffle(ListSource(samples(lengths)), 3000, 0, grow=SHUFFLE_GROWTH)
    return SortBatch(shuffled, None, LengthBudget(budget), 0, grow=growth)


def lhotse_padding(lengths, seconds):
    from lhotse import CutSet
    from lhotse.dataset import DynamicBucketingSampler
    from lhotse.testing.dummies import dummy_cut

    cuts = CutSet.from_cuts(dummy_cut(i, duration=n / 100) for i, n in enumerate(lengths.tolist()))
    sampler = DynamicBucketingSampler(cuts, max_duration=seconds, num_buckets=30, shuffle=True, seed=0)
    batches = [[int(n * 100 + 0.5) for n in (cut.duration for cut in batch)] for batch in sampler]
    return 1 - sum(map(sum, batches)) / sum(len(b) * max(b) for b in batches)


@pytest.mark.slow  # lhotse takes seconds to import
@pytest.mark.parametrize(("utts", "seconds"), [(10_000, 600), (20_000, 1200)])
def test_a_short_epoch_pads_no_more_than_lhotse(utts, seconds):
    """Sort windows grew from 1/16 of a full one in every epoch: an epoch of one or two full
    windows was then mostly small windows, whose few batches each span a wide range of
    lengths: 10,000 utterances padded 4.3 / 6.6% at 600 / 1,200 s, 20,000 4.2% at 1,200 s,
    against lhotse's DynamicBucketingSampler's 3.6% (bench/padding.py). Growth now follows the
    epoch's size."""
    import warnings

    lengths = read_lognormal(utts, seed=utts)
    ours = padding(loader_windows(lengths, seconds * 100))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an eager CutSet: fine for metadata
        theirs = lhotse_padding(lengths, seconds)
    assert ours <= theirs, (ours, theirs)


@pytest.mark.parametrize(
    ("windows", "growth"),
    [(0.9, Growth(1 / 2)), (1.99, Growth(1 / 2)), (2.0, Growth(1 / 4)), (3.99, Growth(1 / 4)),
     (4.0, Growth(1 / 16)), (400, Growth(1 / 16))],
)  # fmt: skip
def test_an_epoch_of_few_windows_grows_in_few_steps(windows, growth):
    """An epoch of W full windows grows from 1/16 of one, doubling, when W >= 4; from 1/4 when
    2 <= W < 4, from 1/2 when W < 2 (each small window pads about as much in all as a full one:
    fewer of them)."""
    batching = Batching(batch_size=4, sort_window=1000)
    assert sort_growth(batching, {}, round(windows * 1000)) == growth
    assert sort_growth(batching, {}, None) == Growth(1 / 16)  # an epoch of unknown size
    assert sort_growth(Batching(batch_size=4, grow_windows=False), {}, 10**6) is None
    lengths = {length_bin(700): 100}  # 64 batches of 1,200 s hold 64 x 1,200 / 7 = 10,971 samples of 7 s
    assert sort_growth(Batching(batch_frames=120_000), lengths, 21_000) == Growth(1 / 2)
    assert sort_growth(Batching(batch_frames=120_000), lengths, 23_000) == Growth(1 / 4)


def growing_sort(lengths, growth):
    return SortBatch(ListSource(samples(lengths)), BudgetWindow(8, min_samples=1), LengthBudget(200), 3, grow=growth)


def test_a_state_keeps_the_growth_of_its_windows():
    """A restore re-reads the window in flight: it must have the limits it had, whatever growth
    the rebuilt stage is given (an epoch's size decides it now); a state saved when every stream
    grew from 1/16 (its "grow" only True) goes on with that."""
    lengths = read_lognormal(600, seed=3) // 20
    assert_resumes_everywhere(lambda: growing_sort(lengths, Growth(1 / 16, 4)), limit=20)
    full = [[s.key for s in b.samples] for b in growing_sort(lengths, Growth(1 / 16))]
    for saved in ([1 / 16, 2.0], True):
        stage = growing_sort(lengths, Growth(1 / 16))
        head = [[s.key for s in next(stage).samples] for _ in range(6)]
        state = stage.get_state()
        assert state["grow"] == [1 / 16, 2.0] and state["emitted"] > 0 and stage.scale(state["window"]) < 1
        rebuilt = growing_sort(lengths, Growth(1 / 4, 4))
        rebuilt.reset({**state, "grow": saved})
        assert head + [[s.key for s in b.samples] for b in rebuilt] == full
    for damaged in (3, [2.0, 2.0], [0.5, 1.0], "[0.5, 2]", [0.5]):
        with pytest.raises(StateMismatchError, match="the state is damaged"):
            growing_sort(lengths, Growth(1 / 4, 4)).reset({**state, "grow": damaged})


@pytest.mark.parametrize("oversize", ["alone", "drop"])
def test_windows_arranged_ahead_give_the_same_batches_states_and_counts(oversize):
    """A reader reads the next window a share per output and arranges it, a piece per output,
    over the current window's last outputs (``prepare``), or in its spare time
    (``read_further``): a window's boundary then arranges nothing, and the batches, the state
    after each and the counters are those of a reader that reads and arranges at the boundary."""
    lengths = np.random.default_rng(8).integers(1, 90, 700)

    def make():
        shuffle = WindowShuffle(ListSource(samples(lengths)), 150, 3, 1, grow=Growth(0.25))
        return SortBatch(
            shuffle, BudgetWindow(6, min_samples=20), LengthBudget(80), 3, 1, oversize=oversize, grow=Growth(0.25)
        )

    def run(stage, ahead):
        arranged, arrange = [], stage.arrange
        stage.arrange = lambda *args: arranged.append(1) or arrange(*args)
        found, at_boundaries = [], []
        while True:
            before = len(arranged)
            try:
                batch = stage.next()
            except StopIteration:
                return found, at_boundaries
            at_boundaries.append(len(arranged) - before)
            found.append(([s.key for s in batch.samples], stage.get_state(), stage.stats()))
            if ahead:
                stage.prepare()
            if ahead == "spare":
                stage.read_further(math.inf)

    at_boundary, arranged_then = run(make(), ahead=None)
    assert sum(arranged_then) > 5
    for ahead in ("prepare", "spare"):
        found, arranged_at_boundaries = run(make(), ahead)
        assert found == at_boundary
        assert sum(arranged_at_boundaries[1:]) == 0  # all but the first window's, ahead
    dropped = at_boundary[-1][2].get("dropped.oversize", 0)
    assert dropped == (0 if oversize == "alone" else sum(lengths > 80))
