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
from typing import Any

from ...errors import StateMismatchError
from ...formats.table import ShardTable
from ..plan import Plan, Unit, spread_units
from ..stages.reader import ShardReader
from ..workers.setup import WorkerSetup
from ..workers.worker import build_pipeline
from .merge import RankPosition, WorkerPosition


def reader_remainder(setup: WorkerSetup, worker: int, position: RankPosition, spot: WorkerPosition) -> list[Unit]:
    """What one old reader had not handed out when its position was saved: the samples of
    its in-flight batches and windows (``pending()`` of every stage), then the rest of its
    units from where its shard reader stood."""
    pipeline = build_pipeline(setup, worker, position.epoch, position.units_of(worker), read_ahead=False)
    pipeline.reset(spot.state)
    emitted = set(spot.emitted_above)
    held = []
    for seq in range(spot.low + 1, spot.pulled + 1):
        batch = pipeline.next()
        if seq not in emitted:
            held.extend(batch.samples)
    held.extend(pipeline.pending())
    stage = pipeline
    while not isinstance(stage, ShardReader):
        if stage.source is None:
            raise StateMismatchError("elastic resume needs the recipe to read through the built-in shard reader.")
        stage = stage.source
    singles = [
        Unit(s.shard, s.ordinal, s.ordinal + 1, 1, s.offsets or None, s.ordinal)
        for s in sorted(held, key=lambda s: (s.shard, s.ordinal))
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
    return spread_units(table, units, world_size, workers)
