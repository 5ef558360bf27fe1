"""Each stage alone: the resume contract at every position, determinism, and its own job."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import assert_resumes_everywhere
from seqshard.errors import SkipCounter
from seqshard.formats.table import ShardTable
from seqshard.options import Limits as LengthLimits
from seqshard.pipeline.epoch_plan import Unit
from seqshard.pipeline.stages.base import Map, Stage
from seqshard.pipeline.stages.batching import FixedSize, LengthBudget, SortBatch, cut_batches
from seqshard.pipeline.stages.decode import Decoder
from seqshard.pipeline.stages.filters import length_filter
from seqshard.pipeline.stages.lengths import Length
from seqshard.pipeline.stages.passes import Passes
from seqshard.pipeline.stages.reader import ShardReader
from seqshard.pipeline.stages.sample import Sample
from seqshard.pipeline.stages.shuffle import WindowShuffle
from seqshard.testing import ListSource


def utt(key, frames, tokens=None):
    fields = {"feats": np.zeros((frames, 2), np.float32), "txt": "x"}
    if tokens is not None:
        fields["tokens"] = np.ones(tokens, np.int64)
    return Sample(key, fields)


def utterances(count=40, seed=0):
    rng = np.random.default_rng(seed)
    return [utt(f"u{i:03d}", int(rng.integers(1, 50)), int(rng.integers(0, 9))) for i in range(count)]


def test_reader_resumes_anywhere_with_interleaving_and_split_units(packed):
    table = ShardTable.from_patterns(packed.pattern)
    units = [Unit(3), Unit(0, 2, 7), Unit(4, 5), Unit(1, 1, None, 3)]
    for interleave in (1, 3):
        keys = assert_resumes_everywhere(lambda interleave=interleave: ShardReader(table, units, interleave))
        assert len(keys) == len(set(keys)) == 10 + 5 + 3 + 3
    one_at_a_time = [s.key for s in ShardReader(table, units, 1)]
    interleaved = [s.key for s in ShardReader(table, units, 3)]
    assert sorted(one_at_a_time) == sorted(interleaved) and one_at_a_time != interleaved


def test_passes_move_to_the_next_pass(packed):
    table = ShardTable.from_patterns(packed.pattern)
    reader = Passes(lambda p: ShardReader(table, [Unit(p % 5, 0, 2)], 2))
    keys = [next(reader).key for _ in range(6)]
    assert len(set(keys)) == 6  # passes 0, 1, 2 read shards 0, 1, 2
    assert_resumes_everywhere(lambda: _take(Passes(lambda p: ShardReader(table, [Unit(p % 5, 0, 3)], 2)), 11))


def _take(stage, count):
    class Head(Stage):
        def __init__(self):
            super().__init__(stage)
            self.n = 0

        def reset(self, state=None):
            super().reset(state)
            self.n = state["n"] if state else 0

        def next(self):
            if self.n >= count:
                raise StopIteration
            self.n += 1
            return self.source.next()

        def get_state(self):
            return {**super().get_state(), "n": self.n}

    return Head()


def test_decode_shuffle_filter_and_batch_resume_anywhere(packed):
    table = ShardTable.from_patterns(packed.pattern)

    def chain():
        stage = ShardReader(table, [Unit(i) for i in range(5)], 2)
        stage = Map(stage, Decoder(table, features="feats"))
        stage = length_filter(stage, LengthLimits(min_frames=10), Length())
        stage = WindowShuffle(stage, 7, 0, 1, 2)
        return SortBatch(stage, 9, LengthBudget(200), 0, 1, 2)

    batches = assert_resumes_everywhere(chain)
    keys = [k for batch in batches for k in batch]
    expected = [k for k, a in packed.data.arrays.items() if a.shape[0] >= 10]
    assert sorted(keys) == sorted(expected)


def test_window_shuffle_is_a_seeded_permutation_within_windows():
    utts = utterances(30)
    first = [u.key for u in WindowShuffle(ListSource(utts), 10, 5)]
    again = [u.key for u in WindowShuffle(ListSource(utts), 10, 5)]
    other = [u.key for u in WindowShuffle(ListSource(utts), 10, 6)]
    assert first == again != other
    for window in range(3):
        assert sorted(first[window * 10 : window * 10 + 10]) == [u.key for u in utts[window * 10 : window * 10 + 10]]
    assert first[:10] != [u.key for u in utts[:10]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 500), max_size=60), st.integers(1, 3000), st.sampled_from([None, 100.0, 1000.0]))
def test_dynamic_batches_never_exceed_the_budget(lengths, budget, quadratic):
    cost = LengthBudget(budget, quadratic)
    lengths = sorted(lengths)
    batches, oversize = cut_batches(lengths, cost)
    assert sorted([i for b in batches for i in b] + oversize) == list(range(len(lengths)))
    for batch in batches:
        assert cost.cost(len(batch), max(lengths[i] for i in batch)) <= budget
    for index in oversize:
        assert cost.cost(1, lengths[index]) > budget


def test_oversize_utterances_go_alone_or_are_counted():
    utts = utterances(20) + [utt("long", 500)]
    alone = list(SortBatch(ListSource(utts), 50, LengthBudget(100), 0))
    assert [[u.key for u in b.samples] for b in alone if any(u.key == "long" for u in b.samples)] == [["long"]]
    dropping = SortBatch(ListSource(utts), 50, LengthBudget(100), 0, oversize="drop")
    kept = [u.key for b in dropping for u in b.samples]
    assert "long" not in kept and len(kept) == 20 and dropping.stats()["dropped.oversize"] == 1


def test_sorting_keeps_padding_small_and_fixed_batches_have_their_size():
    rng = np.random.default_rng(1)
    utts = [utt(f"u{i}", int(rng.integers(100, 2000))) for i in range(2000)]
    stage = SortBatch(ListSource(utts), 2000, LengthBudget(20000), 0)
    list(stage)
    stats = stage.stats()
    assert 1 - stats["frames"] / stats["padded_frames"] < 0.03
    fixed = list(SortBatch(ListSource(utts), 500, FixedSize(32), 0))
    assert all(len(b) == 32 for b in fixed if len(b) != 500 % 32)


def test_filters_count_each_reason():
    utts = utterances(40)
    limits = LengthLimits(min_frames=5, max_frames=40, max_tokens=6, min_frames_per_token=2.0)
    stage = length_filter(ListSource(utts), limits, Length())
    kept = list(stage)
    assert all(limits.violation(len(u["feats"]), len(u["tokens"])) is None for u in kept)
    assert sum(stage.stats().values()) + len(kept) == 40 and stage.stats()["filtered.too_few_frames"] > 0


def test_map_counts_skipped_bad_items_and_raises_without_skip(packed):
    from seqshard.errors import InputError, Where

    def picky(utt):
        if utt.key.endswith("3"):
            raise InputError(Where("x"), "odd", "bad")
        return utt

    skipped = Map(ListSource(utterances(20)), picky, SkipCounter(True))
    assert len(list(skipped)) == 18 and skipped.stats() == {"dropped.odd": 2}
    with pytest.raises(InputError):
        list(Map(ListSource(utterances(20)), picky))


def test_a_stage_that_forgets_super_init_gets_a_clear_error():
    class Broken(Stage):
        def __init__(self):
            pass

        def next(self):
            return 1

    with pytest.raises(TypeError, match="must call super"):
        next(Broken())


@pytest.mark.parametrize("sets", [("",), ("", "ali")], ids=["one file", "a sidecar"])
def test_a_windows_record_survives_its_text_and_leaves_out_what_it_handed_out(sets):
    """A window's state holds its outputs by their samples' origins (issue 32, item 5): as
    compact text, trimmed at a save of the outputs already handed out; damaged text is named."""
    from seqshard.errors import SeqshardError
    from seqshard.pipeline.stages.batching import Batch
    from seqshard.pipeline.stages.held import Held

    rng = np.random.default_rng(3)
    samples = [
        Sample(
            f"u{i}",
            {},
            int(rng.integers(5)),
            int(rng.integers(900)),
            tuple((s, int(rng.integers(1 << 40))) for s in sets),
        )
        for i in range(300)
    ]
    batches = [Batch(samples[i : i + 7], list(range(i, i + len(samples[i : i + 7])))) for i in range(0, 300, 7)]
    held = Held.describe(batches, lambda b: b.samples, lambda b: b.lengths, ended=False)
    again = Held.decode(held.encode())
    for number in range(len(batches)):
        origins = [(s.shard, s.ordinal, s.offsets) for s in batches[number].samples]
        assert [tuple(o) for o in again.origins(number)] == origins and again.extra_of(number) == batches[
            number
        ].lengths
    rest = Held.decode(again.trimmed(30).encode())
    assert (rest.first, rest.outputs, rest.total) == (30, len(batches), 300)
    assert rest.origins(35) == again.origins(35) and len(rest.encode()) < len(again.encode()) / 2
    for damaged in ("", held.encode()[:-40], held.encode().replace('"v": 1', '"v": 9')):
        with pytest.raises(SeqshardError, match="window record cannot be read"):
            Held.decode(damaged)
    assert Held.describe([1, 2], None, None, ended=True) is None  # not samples read from shards


def test_bucket_sorted_batches_follow_the_shared_draws_and_resume_everywhere():
    """With bucket_sync each reader's k-th batch is of the bucket drawn for k (where its window
    has one): the same draws on every rank, whatever its samples; batches and states are the
    window's own, so a restore anywhere gives the rest."""
    from seqshard.formats.budgets import LengthBuckets
    from seqshard.pipeline.stages.buckets import BucketDraws, BucketSortBatch, bucket_weights

    buckets = LengthBuckets((12, 25, 38))
    cost = FixedSize(3)
    weights = bucket_weights([(k, 10) for k in range(20, 43)], buckets, cost)
    draws = BucketDraws(buckets, weights, 5, (0, 1))
    assert draws.draws(7, 9) == draws.draws(0, 20)[7:16]  # any run of outputs, the same draws

    def make(seed=0, before=0):
        return BucketSortBatch(
            ListSource(utterances(90, seed)), 24, cost, 5, 0, seed, 1, draws=draws, before=before, shuffle=True
        )

    def met(batches: list) -> float:
        found = [buckets.bucket_of(b.longest) for b in batches]
        return float(np.mean(np.array(found) == draws.draws(0, len(batches))))

    for seed in (0, 1):  # two ranks: other samples, the same draws
        assert_resumes_everywhere(lambda seed=seed: make(seed))
        batches = list(make(seed))
        unsynced = list(SortBatch(ListSource(utterances(90, seed)), 24, cost, 5, 0, seed, 1))
        assert met(batches) >= 0.5 > 0.3 >= met(unsynced), (met(batches), met(unsynced))  # windows of 8 batches
        assert sorted(s.key for b in batches for s in b.samples) == sorted(s.key for b in unsynced for s in b.samples)
    later = list(make(before=40))  # an endless stream's later pass: draws from output 40 on
    assert [buckets.bucket_of(b.longest) for b in later] != [buckets.bucket_of(b.longest) for b in list(make())]


def test_batches_go_out_in_the_draws_order_as_far_as_their_buckets_allow():
    from seqshard.pipeline.stages.buckets import in_draw_order

    batches = ["a0", "b1", "c1", "d3", "e3"]  # named by their buckets
    ordered = in_draw_order(batches, [0, 1, 1, 3, 3], [1, 3, 2, 1, 0])
    assert ordered == ["b1", "d3", "e3", "c1", "a0"]  # the 2 drawn gets the nearest left (3 over 0)
