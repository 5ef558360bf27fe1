"""Each epoch's plan: which reader reads which part of which shard.

A reader is one (rank, worker process). Each epoch the shards are put in a seeded random
order and cut into equal-work pieces, first across ranks, then across each rank's workers.
Work is frames when every shard's index gives them (bytes otherwise). A shard that straddles
a cut is split at an utterance boundary (one reader takes utterances ``[0, k)``, the next
``[k, n)``), so the ranks' loads differ by at most about one utterance and no reader is idle
when there are fewer shards than readers. Shards without an index (their utterance count
unknown) cannot be cut by count: they are dealt whole to the least-loaded reader, or, when
there are fewer shards than readers, read by several readers that each keep every k-th
utterance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..formats.table import ShardTable
from ..options import Shuffling
from ..seeds import Seed, stage_rng


@dataclass(frozen=True)
class Unit:
    """Samples ``start, start+step, ... < stop`` (by position in the shard) of one shard.

    ``offsets``, when known, are the byte offsets of sample number ``at`` (<= the first sample
    kept) in the shard's field files (by field set): reading starts there instead of walking
    the files' headers from their beginning.
    """

    shard: int
    start: int = 0
    stop: int | None = None
    step: int = 1
    offsets: tuple[tuple[str, int], ...] | None = None
    at: int = 0

    def first(self) -> int:
        """Position of the first sample kept at or after ``at``."""
        if self.at <= self.start:
            return self.start
        return self.start + math.ceil((self.at - self.start) / self.step) * self.step

    def count(self, num_utts: int | None) -> int | None:
        """How many samples the unit yields, when the shard's size is known."""
        stop = num_utts if self.stop is None else min(self.stop, num_utts) if num_utts is not None else self.stop
        if stop is None:
            return None
        return max(0, math.ceil((stop - self.first()) / self.step))

    def to_json(self) -> list[Any]:
        offsets = None if self.offsets is None else [[name, offset] for name, offset in self.offsets]
        return [self.shard, self.start, self.stop, self.step, offsets, self.at]

    @classmethod
    def from_json(cls, data: Sequence[Any]) -> Unit:
        stop, offsets = data[2], data[4]
        return cls(
            int(data[0]),
            int(data[1]),
            None if stop is None else int(stop),
            int(data[3]),
            None if offsets is None else tuple((str(name), int(offset)) for name, offset in offsets),
            int(data[5]),
        )


@dataclass(frozen=True)
class _Piece:
    unit: Unit
    count: int | None
    weight: float

    def split(self, head_count: int) -> tuple[_Piece, _Piece]:
        assert self.count is not None and 0 < head_count < self.count
        share = head_count / self.count
        cut = self.unit.first() + head_count * self.unit.step
        return (
            _Piece(replace(self.unit, stop=cut), head_count, self.weight * share),
            _Piece(
                replace(self.unit, start=cut, offsets=None, at=0), self.count - head_count, self.weight * (1 - share)
            ),
        )


Plan = list[list[list[Unit]]]  # [rank][worker] -> units, in reading order


def plan_epoch(
    table: ShardTable,
    epoch: int,
    seed: int,
    world_size: int,
    num_workers: int,
    shuffle: bool = True,
    split_shards: bool = True,
) -> Plan:
    """Units for every (rank, worker) reader of ``epoch``; a pure function of its arguments.

    ``split_shards=False`` deals whole shards (as CAT and WebDataset do): no shard is read
    by two readers, at the price of ranks ending up to a shard apart.
    """
    order = list(range(len(table.shards)))
    if shuffle:
        order = [int(i) for i in stage_rng(seed, Seed.PLAN, epoch).permutation(len(order))]
    return spread_units(table, [Unit(i) for i in order], world_size, num_workers, split_shards)


def source_plan(
    table: ShardTable,
    start: int,
    stop: int,
    source: int,
    number: int,
    shuffling: Shuffling,
    world_size: int,
    num_workers: int,
) -> Plan:
    """Pass ``number`` of the mixed source whose shards are ``[start, stop)`` of ``table``:
    those shards in an order of their own, spread over every reader like an epoch's plan."""
    order = np.arange(start, stop)
    if shuffling.shuffle:
        order = start + stage_rng(shuffling.seed, Seed.PLAN, Seed.MIX_PASS, source, number).permutation(stop - start)
    units = [Unit(int(i)) for i in order]
    return spread_units(table, units, world_size, num_workers, shuffling.split_shards)


def spread_units(
    table: ShardTable, units: Sequence[Unit], world_size: int, num_workers: int, split_shards: bool = True
) -> Plan:
    """``units`` (in reading order) in equal work for ``world_size`` x ``num_workers`` readers:
    cut at utterance boundaries when every shard is indexed and ``split_shards``, else dealt
    whole to the least-loaded reader (see the module docstring)."""
    if world_size < 1 or num_workers < 1:
        raise ConfigError(f"world_size and num_workers must be >= 1 (got {world_size}, {num_workers}).")
    weights = table.weights()
    pieces = []
    for unit in units:
        size = table.shards[unit.shard].num_utts
        count = unit.count(size)
        share = count / size if count is not None and size else 1.0
        pieces.append(_Piece(unit, count, weights[unit.shard] * share))
    if table.indexed and split_shards:
        ranks = _cut(pieces, world_size)
        return [[[p.unit for p in worker] for worker in _cut(rank, num_workers)] for rank in ranks]
    ranks = _deal(pieces, world_size, world_size * num_workers)
    return [[[p.unit for p in worker] for worker in _deal(rank, num_workers, num_workers)] for rank in ranks]


def _cut(pieces: Sequence[_Piece], parts: int) -> list[list[_Piece]]:
    """Cut a sequence into ``parts`` runs of equal weight, splitting pieces at utterances."""
    out: list[list[_Piece]] = [[] for _ in range(parts)]
    total = sum(p.weight for p in pieces)
    part, done = 0, 0.0
    for piece in pieces:
        while True:
            boundary = total * (part + 1) / parts
            if part == parts - 1 or done + piece.weight <= boundary + 1e-9:
                out[part].append(piece)
                done += piece.weight
                break
            assert piece.count is not None
            head_count = round((boundary - done) / piece.weight * piece.count) if piece.weight else 0
            if head_count >= piece.count:
                out[part].append(piece)
                done += piece.weight
                break
            if head_count > 0:
                head, piece = piece.split(head_count)
                out[part].append(head)
                done += head.weight
            part += 1
    return out


def _deal(pieces: Sequence[_Piece], parts: int, readers: int) -> list[list[_Piece]]:
    """Whole shards to the least-loaded part, in order; with fewer shards than ``readers``
    each shard becomes k strided units (each reader keeps every k-th utterance)."""
    if pieces and len(pieces) < readers:
        ways = math.ceil(readers / len(pieces))
        pieces = [
            _Piece(
                replace(p.unit, start=p.unit.first() + r * p.unit.step, step=p.unit.step * ways), None, p.weight / ways
            )
            for p in pieces
            for r in range(ways)
        ]
    out: list[list[_Piece]] = [[] for _ in range(parts)]
    loads = [0.0] * parts
    for piece in pieces:
        target = min(range(parts), key=lambda k: (loads[k], k))
        out[target].append(piece)
        loads[target] += piece.weight
    return out


def planned_utts(table: ShardTable, units: Sequence[Unit], counted: Mapping[int, int] | None = None) -> int | None:
    """Utterances a reader's units hold, when the size of every shard they read is known
    (from the index, or ``counted``: shard number -> samples counted on disk)."""
    counted = counted or {}
    sizes = [s.num_utts if s.num_utts is not None else counted.get(i) for i, s in enumerate(table.shards)]
    counts = [u.count(sizes[u.shard]) for u in units]
    return None if any(c is None for c in counts) else sum(counts)  # type: ignore[arg-type]
