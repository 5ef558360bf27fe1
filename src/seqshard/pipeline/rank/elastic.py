"""Elastic resume: the rest of an epoch saved by one set of readers, for another.

From the saved positions of every old reader (rank x worker) this finds what it still held: the
batches pulled but not handed out, what sat in its windows (found by restoring the old pipeline,
which re-reads only those windows), the rest of each open shard piece (from its byte offset)
and the pieces not yet opened. Those units are then cut evenly across the new readers.

- An epoch that ends: each utterance not handed out before the save is read by exactly one new
  reader in the rest of the epoch.
- An endless stream (``uneven="repeat"``, every source of a mix): what was left of each
  source's current pass is read first, by exactly one new reader, then the stream goes on
  with the next passes planned for the new readers.

The batches differ from any uninterrupted run (other windows, other seeds).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ...dist import Collectives
from ...errors import StateMismatchError
from ...formats.remote.access import RemoteAccess
from ...formats.table import ShardTable
from ...options import LoaderOptions
from ..epoch_plan import Plan, Unit, spread_units
from ..stages.base import Stage, merge_counts
from ..stages.passes import Passes
from ..stages.reader import ShardReader
from ..stages.sample import Sample
from ..workers.setup import WorkerSetup, make_setup
from ..workers.worker import build_pipeline, carry_from_json, carry_to_json
from .merge import RankPosition, WorkerPosition

_LOG = logging.getLogger("seqshard")

Remainder = dict[int, tuple[int, list[Unit]]]  # source (0 for one) -> (its current pass, units left)


def reader_remainder(
    setup: WorkerSetup, access: RemoteAccess | None, worker: int, position: RankPosition, spot: WorkerPosition
) -> Remainder:
    """What one old reader had not handed out when its position was saved: the samples of its
    in-flight batches and windows (``pending()`` of every stage), then the rest of its units
    from where its shard reader stood; by source, with the pass it was in (0 for an epoch)."""
    carry = carry_from_json(position.carry[worker]) if position.carry is not None else None
    pipeline = build_pipeline(setup, worker, position.epoch, access, position.units_of(worker), carry, read_ahead=False)
    pipeline.reset(spot.state)
    held: list[Sample] = []
    for _ in range(spot.low + 1, spot.pulled + 1):  # batches taken ahead, not handed out
        held.extend(pipeline.next().samples)
    held.extend(pipeline.pending())
    remainder: Remainder = {}
    for source, (number, reader) in _readers(pipeline).items():
        singles = [
            Unit(s.shard, s.ordinal, s.ordinal + 1, 1, s.offsets or None, s.ordinal)
            for s in sorted(held, key=lambda s: (s.shard, s.ordinal))
            if s.stream == source
        ]
        remainder[source] = (number, singles + reader.remaining_units())
    return remainder


def _readers(pipeline: Stage) -> dict[int, tuple[int, ShardReader]]:
    """The shard reader of each source the pipeline reads (a source's current pass, for an
    endless stream), found by walking its stages down to the source."""
    stage = pipeline
    while stage.source is not None:
        stage = stage.source
    passes: list[Passes] = getattr(stage, "streams", None) or ([stage] if isinstance(stage, Passes) else [])
    bottoms = {number: p.current for number, p in enumerate(passes)} if passes else {0: (0, stage)}
    found = {}
    for source, (number, inner) in bottoms.items():
        while inner is not None and not isinstance(inner, ShardReader):
            inner = inner.source
        if inner is None:
            raise StateMismatchError("elastic resume needs the recipe to read through the built-in shard reader.")
        found[source] = (number, inner)
    return found


def remainder_plan(
    table: ShardTable,
    old_setups: list[WorkerSetup],
    positions: list[RankPosition],
    world_size: int,
    workers: int,
    access: RemoteAccess | None = None,
    rank: int = 0,
    gather: Callable[[Any], list[Any]] | None = None,
) -> dict[int, tuple[int, Plan]]:
    """The unread rest of the saved readers, by source, cut across ``world_size`` x ``workers``
    readers, each source with the pass the new readers start at (its latest among the old).

    Restoring the old readers re-reads their windows; with ``gather`` (an all-gather among the
    new ranks) each new rank restores only every ``world_size``-th old reader and the ranks
    share what they found, instead of each doing all the work.
    """
    if any(p.completed for p in positions) and not all(p.completed for p in positions):
        raise StateMismatchError("the saved ranks disagree on whether the epoch ended.")
    readers = [
        (setup, access, worker, position, spot)
        for setup, position in zip(old_setups, positions)
        for worker, spot in enumerate(position.workers)
    ]
    mine = range(rank, len(readers), world_size) if gather is not None else range(len(readers))
    found = {number: carry_to_json(reader_remainder(*readers[number])) for number in mine}
    if gather is not None:
        found = {number: part for parts in gather(found) for number, part in parts.items()}
    by_source: dict[int, tuple[int, list[Unit]]] = {}
    for number in range(len(readers)):
        for source, (at, units) in carry_from_json(found[number]).items():
            latest, gathered = by_source.get(source, (at, []))
            by_source[source] = (max(latest, at), gathered + units)
    return {
        source: (at, spread_units(table, units, world_size, workers))
        for source, (at, units) in sorted(by_source.items())
    }


def elastic_position(
    state: dict[str, Any], setup: WorkerSetup, access: RemoteAccess, collectives: Collectives
) -> RankPosition:
    """This rank's start after an elastic resume of ``state`` (saved by other ranks, workers or
    options, over the same shards): a fresh position whose units (or, for an endless stream,
    whose carried units of each source's pass) are its share of what the saved readers held."""
    saved = saved_options(state, setup.options)
    positions = saved_positions(state)
    epoch, world = positions[0].epoch, setup.world_size
    stream = setup.options.epochs.continues_stream
    if not stream and all(p.completed for p in positions):
        done = RankPosition.fresh(epoch, setup.readers_per_rank)
        done.completed = True
        return done
    old_world = state["identity"]["world_size"]
    old_setups = [
        make_setup(setup.table, saved, rank, old_world, setup.tokenizer, setup.override, setup.mix, access)
        for rank in range(old_world)
    ]
    gather = collectives.all_gather if collectives.context.distributed and collectives.ready() else None
    plans = remainder_plan(
        setup.table, old_setups, positions, world, setup.readers_per_rank, access, setup.rank, gather
    )
    _LOG.info(
        "elastic resume of epoch %d: %d saved readers' remainder spread over %d ranks x %d workers",
        epoch,
        sum(len(p.workers) for p in positions),
        world,
        setup.readers_per_rank,
    )
    if not stream:
        fresh = RankPosition.fresh(epoch, setup.readers_per_rank, plans[0][1][setup.rank])
    else:
        carry = [
            [
                [source, first, [u.to_json() for u in plan[setup.rank][worker]]]
                for source, (first, plan) in plans.items()
            ]
            for worker in range(setup.readers_per_rank)
        ]
        fresh = RankPosition.fresh(epoch, setup.readers_per_rank, carry=carry)
        fresh.completed = all(p.completed for p in positions)
    return _with_progress(fresh, positions, setup.rank)


def _with_progress(fresh: RankPosition, positions: list[RankPosition], rank: int) -> RankPosition:
    """``fresh`` at the saved epoch's step (the ranks' least), with what the saved ranks had done
    on the first rank: utterances (and those skipped unread), frames and per mixed source read, so that epoch lengths
    counted over all ranks (hours, a source's pass) go on where they stood; their counters
    (dropped, filtered, ...) and what they had taken from the plan, so that the first rank's
    summary counts the whole epoch's past and the ranks' summaries add up to the epoch."""
    fresh.step = min(p.step for p in positions)
    if rank == 0:
        fresh.before = merge_counts(*(p.counters() for p in positions))
        fresh.before_planned = sum(p.taken() for p in positions)
        fresh.utts = sum(p.utts for p in positions)
        fresh.skipped_batches = sum(p.skipped_batches for p in positions)
        fresh.skipped_utts = sum(p.skipped_utts for p in positions)
        fresh.frames = sum(p.frames for p in positions)
        fresh.padded_frames = sum(p.padded_frames for p in positions)
        for name in ("sources", "sources_all"):
            counts = [getattr(p, name) for p in positions if getattr(p, name)]
            setattr(
                fresh,
                name,
                [[sum(c[i][k] for c in counts) for k in (0, 1)] for i in range(len(counts[0]))] if counts else [],
            )
    return fresh


def saved_positions(state: dict[str, Any]) -> list[RankPosition]:
    """Every saved rank's position, in rank order (elastic resume needs them all)."""
    world_size = state["identity"]["world_size"]
    if sorted(state["ranks"], key=int) != [str(r) for r in range(world_size)]:
        raise StateMismatchError(
            "elastic resume needs the position of every saved rank: save with state_dict(gather=True)."
        )
    return [RankPosition.from_json(state["ranks"][str(r)]) for r in range(world_size)]


def saved_options(state: dict[str, Any], current: LoaderOptions) -> LoaderOptions:
    """The options the state was saved with (the current runtime-only ones). Transforms and
    recipes are saved by name: they must be the current ones (their code cannot be rebuilt from
    a name)."""
    options = dict(state["identity"]["options"])
    now = current.batch_defining()
    for name in ("transforms", "recipe"):
        if options.get(name) != now[name]:
            raise StateMismatchError(
                f"elastic resume needs the {name} the state was saved with ({options.get(name)!r}, now {now[name]!r})."
            )
        del options[name]
    return current.replace(**options)
