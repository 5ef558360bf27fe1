"""Elastic resume: the rest of an epoch saved by one set of readers, for another.

From the saved positions of every old reader (rank x worker) this finds what the epoch still
holds: the batches pulled but not handed out, what sat in the reader's windows (found by
restoring the old pipeline, which re-reads only those windows), the rest of each open shard
piece (from its byte offset) and the pieces not yet opened. Those units are then cut evenly
across the new readers. Guarantee: each utterance not handed out before the save is read by
exactly one new reader in the rest of the epoch; the batches differ from any uninterrupted
run (other windows, other seeds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..errors import StateMismatchError
from .merge import RankPosition, WorkerPosition
from .shards import Plan, ShardTable, Unit, _cut, _deal, _Piece
from .worker import WorkerSetup, build_pipeline


def reader_remainder(setup: WorkerSetup, worker: int, position: RankPosition, spot: WorkerPosition) -> list[Unit]:
    """What one old reader had not handed out when its position was saved."""
    from .reader import ShardReader

    pipeline = build_pipeline(setup, worker, position.epoch, position.units_of(worker), read_ahead=False)
    pipeline.reset(spot.state)
    emitted = set(spot.emitted_above)
    held = []
    for seq in range(spot.low + 1, spot.pulled + 1):
        batch = pipeline.next()
        if seq not in emitted:
            held.extend(batch)
    held.extend(pipeline.pending())
    stage = pipeline
    while not isinstance(stage, ShardReader):
        stage = stage.source
    singles = [
        Unit(u.shard, u.ordinal, u.ordinal + 1, 1, u.offset, u.ordinal)
        for u in sorted(held, key=lambda u: (u.shard, u.offset))
    ]
    return singles + stage.remaining_units()


def remainder_plan(
    table: ShardTable,
    old_setups: list[WorkerSetup],
    positions: list[RankPosition],
    world_size: int,
    workers: int,
    rank: int = 0,
    gather: Callable[[Any], list[Any]] | None = None,
) -> Plan:
    """The unread rest of the saved epoch, cut across ``world_size`` x ``workers`` readers.

    Restoring the old readers re-reads their windows; with ``gather`` (an all-gather among the
    new ranks) each new rank restores only every ``world_size``-th old reader and the ranks
    share what they found, instead of each doing all the work.
    """
    if any(p.completed for p in positions) and not all(p.completed for p in positions):
        raise StateMismatchError("the saved ranks disagree on whether the epoch ended.")
    readers = [
        (setup, worker, position, spot)
        for setup, position in zip(old_setups, positions)
        for worker, spot in enumerate(position.workers)
    ]
    mine = range(rank, len(readers), world_size) if gather is not None else range(len(readers))
    found = {number: [u.to_json() for u in reader_remainder(*readers[number])] for number in mine}
    if gather is not None:
        found = {number: units for part in gather(found) for number, units in part.items()}
    units = [Unit.from_json(u) for number in range(len(readers)) for u in found[number]]
    weights = table.weights()
    pieces = []
    for unit in units:
        shard = table.shards[unit.shard]
        count = unit.count(shard.num_utts)
        share = count / shard.num_utts if count is not None and shard.num_utts else 1.0
        pieces.append(_Piece(unit, count, weights[unit.shard] * share))
    if table.indexed:
        return [[[p.unit for p in w] for w in _cut(rank_pieces, workers)] for rank_pieces in _cut(pieces, world_size)]
    return [
        [[p.unit for p in w] for w in _deal(rank_pieces, workers, workers)]
        for rank_pieces in _deal(pieces, world_size, world_size * workers)
    ]


def planned_setups(setup: WorkerSetup, world_size: int, config) -> list[WorkerSetup]:
    """The old readers' setups (one per old rank), for rebuilding their pipelines."""
    return [replace(setup, config=config, rank=rank, world_size=world_size) for rank in range(world_size)]
