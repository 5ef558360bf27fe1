"""The coordination pieces tested alone (as torchdata tests each node): the merged stream of
workers' batches, epoch rules, the saved state, the cursor of epochs, elastic remainders and the
shared-memory slots. End-to-end tests with real workers and gloo ranks stay in test_loader.py
and test_distributed.py."""

from __future__ import annotations

import gc
import json
import multiprocessing

import numpy as np
import pytest

from conftest import pack_small
from seqshard.dist import Collectives, DistContext
from seqshard.errors import ConfigError, SeqshardError, StateMismatchError
from seqshard.formats.remote.access import RemoteAccess
from seqshard.formats.table import ShardTable
from seqshard.options import LoaderOptions
from seqshard.pipeline.epoch_plan import planned_utts
from seqshard.pipeline.rank import checkpoint
from seqshard.pipeline.rank.cursor import EpochCursor
from seqshard.pipeline.rank.elastic import remainder_plan
from seqshard.pipeline.rank.epochs import EpochLength, EpochRules, HoursLimit, RepeatStream, StepLimit, StopTogether
from seqshard.pipeline.rank.merge import MergedStream, RankPosition
from seqshard.pipeline.transport.slots import BatchSlots
from seqshard.pipeline.transport.wire import BatchItem, EndItem
from seqshard.pipeline.workers.pool import WorkerPool
from seqshard.pipeline.workers.setup import make_setup
from seqshard.pipeline.workers.worker import build_pipeline

ONE = Collectives(DistContext())


def batch(worker: int, seq: int, size: int = 2) -> BatchItem:
    return BatchItem(worker, seq, {"keys": [f"w{worker}-{seq}"]}, {"at": seq}, {"n": seq}, size, size * 10, size * 12)


def workers(counts: list[int], after: list[int] | None = None):
    """take(worker) over each worker's batches (after the first ``after[w]``, as a restored
    worker regenerates them) then its end marker."""
    after = after or [0] * len(counts)
    queues = {
        w: [batch(w, s) for s in range(after[w] + 1, n + 1)] + [EndItem(w, n, {"at": "end"})]
        for w, n in enumerate(counts)
    }
    return lambda worker: queues[worker].pop(0)


def test_the_merged_stream_takes_workers_in_turn_and_skips_finished_ones():
    position = RankPosition.fresh(0, 2)
    stream = MergedStream(workers([3, 2]), position)
    taken = []
    while (item := stream.pull()) is not None:
        stream.emit(item)
        taken.append((item.worker, item.seq))
    assert taken == [(0, 1), (1, 1), (0, 2), (1, 2), (0, 3)]
    assert position.step == 5 and position.utts == 10 and position.frames == 100 and position.padded_frames == 120
    assert [w.low for w in position.workers] == [3, 2] and all(w.done for w in position.workers)


def test_a_restored_stream_goes_on_where_its_position_stands():
    position = RankPosition.fresh(0, 2)
    stream = MergedStream(workers([3, 3]), position)
    for _ in range(3):
        stream.emit(stream.pull())
    saved = json.loads(json.dumps(position.to_json()))
    assert [(w.low, w.pulled) for w in RankPosition.from_json(saved).workers] == [(2, 2), (1, 1)]
    restored = MergedStream(workers([3, 3], after=[2, 1]), RankPosition.from_json(saved))
    rest = []
    while (item := restored.pull()) is not None:
        restored.emit(item)
        rest.append((item.worker, item.seq))
    assert rest == [(1, 2), (0, 3), (1, 3)]
    broken = RankPosition.from_json(saved)
    broken.workers[0].pulled = 3  # pulled but neither handed out nor queued: not a position the loader saves
    with pytest.raises(SeqshardError, match="inconsistent"):
        MergedStream(workers([3, 3], after=[2, 1]), broken)


def run_rules(rules: EpochRules, counts: list[int]) -> tuple[list[int], RankPosition]:
    """The batches a loader with ``rules`` hands out over workers of ``counts`` batches (one
    process: its agreements cost nothing), and its position after them."""
    position = RankPosition.fresh(0, len(counts))
    stream = MergedStream(workers(counts), position)
    rules.start(position, None)
    seen = []
    while True:
        if rules.due(position):
            rules.agree(position, stream, lambda held: None, 0, lambda summed: None)
        if rules.over(position):
            break
        item = stream.next()
        if item is None and rules.ran_out(position, None, 0):
            break
        stream.emit(item)
        seen.append(item.seq)
    return seen, position


def test_epoch_rules_cut_by_steps_or_hours_and_end_with_the_data():
    seen, position = run_rules(EpochRules(RepeatStream(), StepLimit(2), ONE), [3])
    assert seen == [1, 2] and position.ends == "length"
    seen, position = run_rules(EpochRules(RepeatStream(), HoursLimit(30 * 0.01 / 3600, 10.0), ONE), [3])
    assert seen == [1, 2] and position.frames == 40  # 20 frames a batch: reached at the second, checked each step
    seen, position = run_rules(EpochRules(StopTogether(), EpochLength(), ONE), [3])
    assert seen == [1, 2, 3] and not position.ends  # the data ends it
    with pytest.raises(ConfigError, match="ran out in uneven='repeat'"):
        run_rules(EpochRules(RepeatStream(), EpochLength(), ONE), [3])


def test_the_cursor_runs_the_next_epoch_unless_one_is_chosen():
    cursor = EpochCursor(lambda e: RankPosition.fresh(e, 1), continues_stream=False)
    assert cursor.start().epoch == 0
    cursor.position.completed = True
    assert cursor.start().epoch == 1  # iterated again after a finished epoch
    cursor.start()  # abandoned, not finished: the same epoch again
    assert cursor.epoch == 1
    cursor.position.completed = True
    cursor.set_epoch(1)
    assert cursor.start().epoch == 1 and not cursor.position.completed  # set_epoch wins
    done = RankPosition.fresh(4, 1)
    done.completed = True
    cursor.load(done)
    assert cursor.start().epoch == 5  # a state saved at an epoch's end goes on with the next
    cursor.load(done)
    cursor.set_epoch(4)
    assert cursor.start().completed  # ... unless that epoch is asked for: it holds nothing more


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    packed = pack_small(tmp_path_factory.mktemp("pieces"), utts_per_file=10, speakers=4, per_speaker=7)
    return ShardTable.from_patterns(packed.pattern)


def test_states_name_what_differs_and_refuse_what_does_not_fit(table):
    options = LoaderOptions(batch_size=4, num_workers=0)
    setup = make_setup(table, options, 0, 1, None, None)
    identity = checkpoint.identity(table, options, 1)
    position = RankPosition.fresh(2, 1)
    state = json.loads(json.dumps(checkpoint.state(position, identity, ONE, gather=True)))
    assert checkpoint.restore(state, identity, setup, None, ONE, strict=True).epoch == 2
    other = checkpoint.identity(table, options.replace(seed=9), 1)
    assert checkpoint.differences(state["identity"], other) == ["option seed was 0, now 9"]
    with pytest.raises(StateMismatchError, match="option seed was 0, now 9"):
        checkpoint.restore(state, other, setup, None, ONE, strict=True)
    with pytest.raises(StateMismatchError, match="version"):
        checkpoint.check_state({**state, "seqshard_loader_state": 1})
    assert checkpoint.check_ranks_agree(identity, ONE)


def test_a_bucket_sync_state_of_the_training_processs_queues_is_refused_and_an_old_one_without_is_read(table):
    """Version 3 kept bucket sync's batches in queues of the training process: such a state does
    not fit readers that order their own batches; other version 3 states (their queues empty)
    are read."""
    options = LoaderOptions(batch_size=4, num_workers=0, bucket_sync=True)
    setup = make_setup(table, options, 0, 1, None, None)
    identity = checkpoint.identity(table, options, 1)
    old = json.loads(json.dumps(checkpoint.state(RankPosition.fresh(1, 1), identity, ONE, gather=True)))
    old["seqshard_loader_state"] = 3
    old["ranks"]["0"]["queues"] = [[[0, 1]], [], []]
    old["ranks"]["0"]["workers"][0]["emitted_above"] = []
    for strict in (True, False):
        with pytest.raises(StateMismatchError, match=r"bucket_sync .* held batches back in the training process"):
            checkpoint.restore(old, identity, setup, None, ONE, strict=strict)
    plain = LoaderOptions(batch_size=4, num_workers=0)
    old["identity"] = checkpoint.identity(table, plain, 1)
    old["ranks"]["0"]["queues"] = []
    restored = checkpoint.restore(old, old["identity"], make_setup(table, plain, 0, 1, None, None), None, ONE, True)
    assert restored.epoch == 1 and restored.held == []


@pytest.mark.parametrize("taken", [0, 1, 3])
def test_elastic_remainders_and_what_was_handed_out_make_the_epoch_once(table, taken):
    options = LoaderOptions(batch_size=2, num_workers=2, shuffle_window=4, sort_window=4)
    old = [make_setup(table, options, rank, 2, None, None) for rank in range(2)]
    handed: list[str] = []
    positions = []
    for setup in old:
        position = RankPosition.fresh(0, 2)
        for worker, spot in enumerate(position.workers):
            pipeline = build_pipeline(setup, worker, 0)
            pipeline.reset()
            for seq in range(1, taken + 1):
                handed += [s.key for s in pipeline.next().samples]
                spot.low = spot.pulled = seq
                spot.state = pipeline.get_state()
        positions.append(position)
    ((_, (_, plan)),) = remainder_plan(table, old, positions, 3, 1).items()  # to 3 ranks of 1 worker
    left = []
    for rank in plan:
        for units in rank:
            reader = build_pipeline(
                make_setup(table, options.replace(num_workers=1), 0, 3, None, None), 0, 0, units=units
            )
            reader.reset()
            left += [s.key for b in reader for s in b.samples]
    everything = sum(planned_utts(table, [u]) for rank in plan for units in rank for u in units)
    assert everything == len(left)
    assert sorted(handed + left) == sorted(k for k in _all_keys(table))


def _all_keys(table):
    from seqshard.formats.tar import SampleStream

    for shard in table.shards:
        with SampleStream(shard.path) as stream:
            yield from (sample.key for sample in stream)


def test_slots_hand_batches_over_as_shared_memory_and_free_them_with_the_last_view():
    slots = BatchSlots(1, 2, 1 << 12, multiprocessing.get_context())
    arena = slots.acquire(0, 400, iteration=1)
    array = arena.allocate((10, 4), np.dtype(np.float32))
    array[:] = np.arange(40).reshape(10, 4)
    place = arena.describe(array)
    assert slots.acquire(0, 1 << 13, iteration=1) is None  # larger than a slot
    second = slots.acquire(0, 10, iteration=1)
    assert second is not None and slots.acquire(0, 10, iteration=1) is None  # both slots held
    arrays = {"x": place}
    slots.receive(arena.slot, arrays, pin=False)
    (tensor,) = arrays.values()
    del arrays
    assert tensor.numpy().tolist() == np.arange(40).reshape(10, 4).tolist()
    assert slots.acquire(0, 10, iteration=1) is None  # a slot leased to training is not reused
    del tensor
    gc.collect()
    assert slots.acquire(0, 10, iteration=1) is not None  # freed with its last view


def test_a_labels_only_loader_keeps_no_room_for_frames_in_its_slots(table):
    sizes = {}
    for fields in (None, ["txt"]):
        setup = make_setup(table, LoaderOptions(batch_size=4, num_workers=0, fields=fields), 0, 1, None, None)
        sizes[str(fields)] = WorkerPool(setup, RemoteAccess()).runtime.slots.slot_bytes
    assert sizes["['txt']"] == 1 << 20 < sizes["None"]  # room for labels only, not for 4 utterances of frames
