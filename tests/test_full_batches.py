"""Mixed windows hold copies of a small source's utterances: they go to different batches and
still leave every batch of a fixed size full (issue 17, item 5)."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import assert_resumes_everywhere, write_kaldi_dir
from seqshard import make_loader, mux, pack_data
from seqshard.pipeline.stages.batching import FixedSize, LengthBudget, SortBatch, cut_batches
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
