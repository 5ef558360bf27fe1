"""Mixed windows hold copies of a small source's utterances: they go to different batches and
still leave every batch of a fixed size full (issue 17, item 5)."""

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import assert_resumes_everywhere, write_kaldi_dir
from seqshard import make_loader, mux, pack_data
from seqshard.pipeline.stages.batching import (
    FixedSize,
    LengthBudget,
    SortBatch,
    _cut_in_order,
    _most_per_batch,
    cut_batches,
)
from seqshard.pipeline.stages.sample import Sample
from seqshard.testing import ListSource


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two packed corpora of 40 and 20 utterances."""
    root = tmp_path_factory.mktemp("full")
    for name, speakers in (("a", 8), ("b", 4)):
        data = write_kaldi_dir(root / f"kaldi-{name}", speakers=speakers, per_speaker=5, prefix=name)
        pack_data(data.scp, data.text, root / name, utts_per_file=7, progress=False)
    return [str(root / name) for name in "ab"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_mixed_epoch_of_fixed_batches_delivers_every_sample(sources, num_workers):
    """A reader's window of 400 holds ~10 copies of each of its share of b's 20 utterances;
    100 steps span 1.25 to 2.5 windows of each reader. Every batch holds 10 utterances."""
    loader = make_loader(
        mux(sources, weights=[3, 1]), batch_size=10, epoch_steps=100, sort_window=400, num_workers=num_workers
    )
    batches = [batch["keys"] for batch in loader]
    assert Counter(map(len, batches)) == {10: 100}
    assert all(len(set(keys)) == 10 for keys in batches)


def _window(keys_and_lengths):
    lengths = sorted(length for _, length in keys_and_lengths)
    order = sorted(keys_and_lengths, key=lambda item: (item[1], item[0]))
    return lengths, [key for key, _ in order]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 15), st.integers(1, 4)), min_size=1, max_size=25),
    st.integers(1, 8),
)
def test_copies_go_to_different_batches_and_fixed_batches_stay_full(utterances, size):
    """``utterances``: (key, copies); the window holds every copy, sorted by length."""
    items = {f"k{key}": copies for key, copies in utterances}
    length_of = {key: 1 + number % 7 for number, key in enumerate(items)}
    lengths, keys = _window([(key, length_of[key]) for key, copies in items.items() for _ in range(copies)])
    batches, oversize = cut_batches(lengths, FixedSize(size), keys)
    assert not oversize and sorted(i for batch in batches for i in batch) == list(range(len(keys)))
    assert all(len({keys[i] for i in batch}) == len(batch) <= size for batch in batches)
    needed = -(-len(keys) // size)
    last = len(keys) - (needed - 1) * size
    copies = Counter(keys)
    if max(copies.values()) <= needed and list(copies.values()).count(needed) <= last:  # some arrangement exists
        assert [len(batch) for batch in batches] == [size] * (needed - 1) + [last]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 15), st.integers(1, 60)), min_size=1, max_size=40),
    st.integers(1, 300),
    st.sampled_from([None, 50.0]),
)
def test_budget_batches_with_copies_keep_their_budget(utterances, budget, quadratic):
    lengths_of = {f"k{key}": length for key, length in utterances}
    lengths, keys = _window([(f"k{key}", lengths_of[f"k{key}"]) for key, _ in utterances])
    cost = LengthBudget(budget, quadratic)
    batches, oversize = cut_batches(lengths, cost, keys)
    assert sorted([i for batch in batches for i in batch] + oversize) == list(range(len(keys)))
    for batch in batches:
        assert len({keys[i] for i in batch}) == len(batch)
        assert cost.fits(len(batch), max(lengths[i] for i in batch))


def test_copies_at_the_long_end_of_a_window_do_not_pile_up():
    """Sorted by length, 6 copies of the longest utterance come last: cut in order, they would
    leave 5 batches of one sample at the end of the window."""
    lengths, keys = _window([(f"u{i}", i) for i in range(1, 55)] + [("long", 99)] * 6)
    batches, _ = cut_batches(lengths, FixedSize(10), keys)
    assert [len(batch) for batch in batches] == [10] * 6
    assert all(len({keys[i] for i in batch}) == 10 for batch in batches)


@pytest.mark.parametrize("cost", [FixedSize(4), LengthBudget(60)])
def test_sort_batch_with_copies_resumes_everywhere(cost):
    rng = np.random.default_rng(3)
    lengths = {f"u{i}": int(rng.integers(1, 15)) for i in range(9)}
    stream = [key for _ in range(4) for key in rng.permutation(list(lengths))]  # four passes of a small source

    def make():
        samples = [Sample(key, {"feats": np.zeros((lengths[key], 1), np.float32)}) for key in stream]
        return SortBatch(ListSource(samples), 16, cost, 0, 1)

    batches = assert_resumes_everywhere(make)
    assert sorted(k for batch in batches for k in batch) == sorted(stream)
    assert all(len(set(batch)) == len(batch) for batch in batches)


def _fits(cost, lengths, batch):
    return len(batch) == 1 or cost.fits(len(batch), max(lengths[i] for i in batch))


def _copies_apart_by_hand(lengths, cost, keys):
    """What the batcher that keeps copies apart makes, worked out afresh for every batch from
    the samples left (a reference: quadratic, and plain)."""
    left = [i for i, length in enumerate(lengths) if cost.fits(1, length)]
    lower = sum(1 / _most_per_batch(cost, lengths[i]) for i in left)
    batches = []
    while left:
        copies = Counter(keys[i] for i in left)
        first = {}
        for i in left:
            first.setdefault(keys[i], i)
        due = []
        if max(copies.values()) >= 2 and max(copies.values()) + 1 >= math.ceil(lower - 1e-6):
            cut = _cut_in_order(lengths, cost, left)
            if len(cut) >= 2:
                must = [key for key in copies if copies[key] >= len(cut)]
                tight = sorted((key for key in copies if copies[key] == len(cut) - 1), key=first.get)
                due = sorted(must + tight[: max(0, len(must) + len(tight) - len(cut[-1]))], key=first.get)
        batch = []
        for key in due:  # one that does not fit waits for the next batch
            if _fits(cost, lengths, batch + [first[key]]):
                batch.append(first[key])
        for i in left:  # then each key's first copy left, in order, while they fit
            if first[keys[i]] != i or i in batch:
                continue
            if len(batch) == len(copies) or not _fits(cost, lengths, batch + [i]):
                break
            batch.append(i)
        left = [i for i in left if i not in batch]
        lower -= sum(1 / _most_per_batch(cost, lengths[i]) for i in batch)
        batches.append(sorted(batch))
    return batches


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 9), st.integers(1, 12), st.integers(1, 30)), min_size=1, max_size=30),
    st.sampled_from([FixedSize(1), FixedSize(3), FixedSize(8), LengthBudget(60), LengthBudget(200, 50.0)]),
    st.booleans(),
)
def test_copies_apart_makes_the_batches_worked_out_afresh_for_each(utterances, cost, ascending):
    """``utterances``: (key, copies, length); sorted by length or in the order drawn."""
    stream = [(f"k{key}", length) for key, copies, length in utterances for _ in range(copies)]
    if ascending:
        stream.sort(key=lambda item: (item[1], item[0]))
    lengths, keys = [length for _, length in stream], [key for key, _ in stream]
    batches, oversize = cut_batches(lengths, cost, keys, ascending=ascending)
    assert batches == _copies_apart_by_hand(lengths, cost, keys)
    assert oversize == [i for i, length in enumerate(lengths) if not cost.fits(1, length)]


def test_many_copies_of_few_keys_are_batched_in_few_steps():
    """A folder that repeats one shard's 8 keys: each key 400 times in a window, batches of
    one copy of each. The batcher tried each sample against the cost once per batch
    (650,000 tests here); now a few per batch (9,400)."""
    tests = []

    class Counted(LengthBudget):
        def fits(self, count, longest):
            tests.append(1)
            return super().fits(count, longest)

    lengths, keys = _window([(f"u{k}", 5 + 2 * k) for k in range(8) for _ in range(400)])
    batches, _ = cut_batches(lengths, Counted(20_000), keys, ascending=True)
    assert len(batches) == 400 and all(sorted(keys[i] for i in batch) == sorted(set(keys)) for batch in batches)
    assert len(tests) < 20 * len(lengths)
