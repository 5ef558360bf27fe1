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

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, overload

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


class Plan(Sequence[list[list[Unit]]]):
    """An epoch's plan: ``plan[rank][worker]`` is that reader's units, in reading order. The
    ranks' shares are cut at once, in bulk; a rank's units are made when it is first asked for,
    so that a rank of a table of 500,000 shards makes its own, not every rank's."""

    def __init__(self, ranks: Sequence[Sequence[_Piece | range]], piece_of: Callable[[int], _Piece], workers: int):
        self._ranks, self._piece_of, self._workers = ranks, piece_of, workers
        self._made: dict[int, list[list[Unit]]] = {}

    @classmethod
    def of(cls, readers: list[list[list[Unit]]]) -> Plan:
        """A plan of units made already (``readers[rank][worker]``)."""
        plan = cls([[] for _ in readers], lambda _: None, len(readers[0]) if readers else 0)  # type: ignore[arg-type, return-value]
        plan._made = dict(enumerate(readers))
        return plan

    def __len__(self) -> int:
        return len(self._ranks)

    @overload
    def __getitem__(self, rank: int) -> list[list[Unit]]: ...
    @overload
    def __getitem__(self, rank: slice) -> list[list[list[Unit]]]: ...
    def __getitem__(self, rank: int | slice) -> list[list[Unit]] | list[list[list[Unit]]]:
        if isinstance(rank, slice):
            return [self[r] for r in range(*rank.indices(len(self)))]
        rank = range(len(self))[rank]  # IndexError as a list gives
        if rank not in self._made:
            pieces = [
                p
                for item in self._ranks[rank]
                for p in (map(self._piece_of, item) if isinstance(item, range) else (item,))
            ]
            self._made[rank] = [[p.unit for p in worker] for worker in _cut(pieces, self._workers)]
        return self._made[rank]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (Plan, list)) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"Plan({list(self)!r})"


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
    order = np.arange(len(table.shards))
    if shuffle:
        order = stage_rng(seed, Seed.PLAN, epoch).permutation(len(order))
    return spread_shards(table, order, world_size, num_workers, split_shards)


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
    return spread_shards(table, order, world_size, num_workers, shuffling.split_shards)


def spread_shards(
    table: ShardTable, order: np.ndarray, world_size: int, num_workers: int, split_shards: bool = True
) -> Plan:
    """The whole shards ``order`` (in reading order) spread as :func:`spread_units` spreads
    them, the ranks' cuts made in bulk (the same plan, without an object a shard)."""
    if world_size < 1 or num_workers < 1:
        raise ConfigError(f"world_size and num_workers must be >= 1 (got {world_size}, {num_workers}).")
    if not (table.indexed and split_shards):
        return spread_units(table, [Unit(i) for i in order.tolist()], world_size, num_workers, split_shards)
    shards, counts, weights = order.tolist(), table.sizes()[order].tolist(), table.weights()[order].tolist()

    def piece_of(at: int) -> _Piece:  # a whole shard: its count, its weight (as spread_units makes it)
        return _Piece(Unit(shards[at]), counts[at], weights[at] * 1.0)

    return Plan(_cut_whole(weights, piece_of, world_size), piece_of, num_workers)


def spread_units(
    table: ShardTable, units: Sequence[Unit], world_size: int, num_workers: int, split_shards: bool = True
) -> Plan:
    """``units`` (in reading order) in equal work for ``world_size`` x ``num_workers`` readers:
    cut at utterance boundaries when every shard is indexed and ``split_shards``, else dealt
    whole to the least-loaded reader (see the module docstring)."""
    if world_size < 1 or num_workers < 1:
        raise ConfigError(f"world_size and num_workers must be >= 1 (got {world_size}, {num_workers}).")
    weights, sizes = table.weights().tolist(), table.sizes()
    pieces = []
    for unit in units:
        size = int(sizes[unit.shard])
        size = None if size < 0 else size
        count = unit.count(size)
        share = count / size if count is not None and size else 1.0
        pieces.append(_Piece(unit, count, weights[unit.shard] * share))
    if table.indexed and split_shards:
        ranks = _cut(pieces, world_size)
        return Plan.of([[[p.unit for p in worker] for worker in _cut(rank, num_workers)] for rank in ranks])
    ranks = _deal(pieces, world_size, world_size * num_workers)
    return Plan.of([[[p.unit for p in worker] for worker in _deal(rank, num_workers, num_workers)] for rank in ranks])


def _cut_whole(weights: list[float], piece_of: Callable[[int], _Piece], parts: int) -> list[list[_Piece | range]]:
    """:func:`_cut` of whole pieces ``0 .. len(weights)`` (``piece_of`` makes one), in bulk:
    the runs of pieces that fit a part whole are found on running sums (``numpy.cumsum`` adds
    in order, as ``_cut`` does), the pieces cut between parts as ``_cut`` cuts them. Each part
    as runs of whole pieces (ranges) and pieces cut."""
    out: list[list[_Piece | range]] = [[] for _ in range(parts)]
    total = sum(weights)
    array = np.asarray(weights, dtype=np.float64)
    part, done, at, piece = 0, 0.0, 0, None  # piece: what is left of piece ``at`` once cut (None: all of it)
    while at < len(weights):
        if part == parts - 1:
            out[part] += ([piece] if piece is not None else []) + [range(at + (piece is not None), len(weights))]
            break
        boundary = total * (part + 1) / parts
        if piece is None:
            sums = np.cumsum(np.concatenate(([done], array[at:])))
            fit = int(np.searchsorted(sums[1:], boundary + 1e-9, side="right"))
            if fit:
                out[part].append(range(at, at + fit))
                done, at = float(sums[fit]), at + fit
                if at == len(weights):
                    break
            piece = piece_of(at)
        elif done + piece.weight <= boundary + 1e-9:
            out[part].append(piece)
            done, at, piece = done + piece.weight, at + 1, None
            continue
        assert piece.count is not None
        head_count = round((boundary - done) / piece.weight * piece.count) if piece.weight else 0
        if head_count >= piece.count:
            out[part].append(piece)
            done, at, piece = done + piece.weight, at + 1, None
            continue
        if head_count > 0:
            head, piece = piece.split(head_count)
            out[part].append(head)
            done += head.weight
        part += 1
    return out


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
    """Whole shards to the least-loaded part (the first of the least), in order; with fewer
    shards than ``readers`` each shard becomes k strided units (each reader keeps every k-th
    utterance)."""
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
    loads = [(0.0, k) for k in range(parts)]  # a heap: (load, part)
    for piece in pieces:
        load, target = heapq.heappop(loads)
        out[target].append(piece)
        heapq.heappush(loads, (load + piece.weight, target))
    return out


def planned_utts(table: ShardTable, units: Sequence[Unit], counted: Mapping[int, int] | None = None) -> int | None:
    """Utterances a reader's units hold, when the size of every shard they read is known
    (from the index, or ``counted``: shard number -> samples counted on disk)."""
    counted = counted or {}
    sizes = table.sizes()
    total = 0
    for unit in units:
        size = int(sizes[unit.shard])
        count = unit.count(size if size >= 0 else counted.get(unit.shard))
        if count is None:
            return None
        total += count
    return total
