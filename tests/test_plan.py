"""Epoch plans: no utterance read twice or missed across (rank, worker), balanced loads."""

from hypothesis import given, settings
from hypothesis import strategies as st

from seqshard.formats.table import ShardInfo, ShardTable
from seqshard.pipeline.epoch_plan import plan_epoch, planned_utts


def coverage(sizes, plan):
    seen = {}
    for rank in plan:
        for worker in rank:
            for unit in worker:
                size = sizes[unit.shard]
                for ordinal in range(unit.start, size if unit.stop is None else min(unit.stop, size), unit.step):
                    seen[(unit.shard, ordinal)] = seen.get((unit.shard, ordinal), 0) + 1
    return seen


def table_of(sizes, indexed):
    return ShardTable(
        tuple(
            ShardInfo(f"s{i}", 1000 * n + 1, n if indexed else None, 7 * n if indexed else None)
            for i, n in enumerate(sizes)
        )
    )


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=12),
    st.integers(1, 5),
    st.integers(1, 4),
    st.booleans(),
    st.booleans(),
    st.integers(0, 3),
)
def test_every_utterance_is_planned_exactly_once(sizes, world_size, workers, indexed, split, epoch):
    table = table_of(sizes, indexed)
    plan = plan_epoch(table, epoch, 7, world_size, workers, True, split)
    assert len(plan) == world_size and all(len(rank) == workers for rank in plan)
    seen = coverage(sizes, plan)
    assert len(seen) == sum(sizes) and set(seen.values()) <= {1}


def test_split_plans_balance_ranks_to_about_one_utterance():
    table = table_of([2000] * 75 + [1234], indexed=True)
    for world_size in (8, 13):
        plan = plan_epoch(table, 3, 0, world_size, 4)
        per_rank = [sum(planned_utts(table, w) for w in rank) for rank in plan]
        assert max(per_rank) - min(per_rank) <= 2


def test_plans_change_with_the_epoch_and_not_with_the_machine():
    table = table_of([10] * 20, indexed=True)
    assert plan_epoch(table, 0, 1, 2, 2) == plan_epoch(table, 0, 1, 2, 2)
    assert plan_epoch(table, 0, 1, 2, 2) != plan_epoch(table, 1, 1, 2, 2)
    assert plan_epoch(table, 0, 1, 2, 2, shuffle=False) == plan_epoch(table, 5, 1, 2, 2, shuffle=False)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 60), st.integers(0, 9)), min_size=1, max_size=40),
    st.integers(1, 9),
    st.integers(1, 4),
    st.integers(0, 3),
)
def test_plans_cut_in_bulk_are_the_plans_cut_unit_by_unit(shards, world_size, workers, epoch):
    """An epoch's plan is cut on running sums of its shards' weights, each rank's readers when
    asked for (a table of 5e5 shards makes no object a shard): the same units as cutting
    unit by unit, which is how resumed remainders are still cut."""
    import pickle

    from seqshard.pipeline.epoch_plan import Unit, spread_shards, spread_units
    from seqshard.seeds import Seed, stage_rng

    table = ShardTable(tuple(ShardInfo(f"s{i}", 1000 * n + 1, n, n * f) for i, (n, f) in enumerate(shards)))
    order = stage_rng(7, Seed.PLAN, epoch).permutation(len(shards))
    bulk = spread_shards(table, order, world_size, workers)
    assert bulk == spread_units(table, [Unit(int(i)) for i in order], world_size, workers)
    assert bulk == plan_epoch(table, epoch, 7, world_size, workers)
    reader = bulk[world_size - 1][workers - 1]
    assert (
        list(pickle.loads(pickle.dumps(reader))) == list(reader) == reader[:] == [reader[i] for i in range(len(reader))]
    )
    assert planned_utts(table, reader) == sum(unit.count(shards[unit.shard][0]) for unit in reader)
