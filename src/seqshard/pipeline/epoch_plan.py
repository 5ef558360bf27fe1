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


class _Pieces:
    """Pieces as columns (a unit's fields, its count and weight), each one made a
    :class:`_Piece` only when it is cut: what a plan of 500,000 shards is cut from."""

    FIELDS = ("shard", "start", "stop", "step", "at", "count")  # int64; stop -1: None

    def __init__(self, columns: dict[str, np.ndarray], weights: list[float]):
        self.columns, self.weights = columns, weights

    @classmethod
    def whole(cls, shards: np.ndarray, counts: np.ndarray, weights: list[float]) -> _Pieces:
        """Whole shards, as ``Unit(shard)`` reads them."""
        zeros = np.zeros(len(shards), dtype=np.int64)
        columns = dict(zip(cls.FIELDS, (shards, zeros, zeros - 1, zeros + 1, zeros, counts)))
        return cls({k: v.astype(np.int64) for k, v in columns.items()}, [w * 1.0 for w in weights])

    def piece(self, row: int) -> _Piece:
        shard, start, stop, step, at, count = (int(self.columns[f][row]) for f in self.FIELDS)
        return _Piece(Unit(shard, start, None if stop < 0 else stop, step, None, at), count, self.weights[row])

    def take(self, items: Sequence[_Piece | range]) -> _Pieces:
        """The pieces of ``items`` (runs of these pieces, whole; pieces cut from them), in order."""
        parts, weights = [], []
        for item in items:
            if isinstance(item, range):
                parts.append({f: self.columns[f][item.start : item.stop] for f in self.FIELDS})
                weights += self.weights[item.start : item.stop]
            else:
                unit = item.unit
                values = (
                    unit.shard,
                    unit.start,
                    -1 if unit.stop is None else unit.stop,
                    unit.step,
                    unit.at,
                    item.count,
                )
                parts.append({f: np.array([v], dtype=np.int64) for f, v in zip(self.FIELDS, values)})
                weights.append(item.weight)
        if not parts:
            return _Pieces({f: np.zeros(0, dtype=np.int64) for f in self.FIELDS}, [])
        return _Pieces({f: np.concatenate([part[f] for part in parts]) for f in self.FIELDS}, weights)


class Units(Sequence[Unit]):
    """A reader's units of a plan, as columns: a :class:`Unit` is made when asked for (a rank
    counting every rank's batches makes none); their shards and counts in bulk
    (:func:`unit_counts`)."""

    def __init__(self, pieces: _Pieces):
        self.pieces = pieces

    def __len__(self) -> int:
        return len(self.pieces.weights)

    @overload
    def __getitem__(self, at: int) -> Unit: ...
    @overload
    def __getitem__(self, at: slice) -> list[Unit]: ...
    def __getitem__(self, at: int | slice) -> Unit | list[Unit]:
        if isinstance(at, slice):
            return [self[i] for i in range(*at.indices(len(self)))]
        return self.pieces.piece(range(len(self))[at]).unit

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (Units, list)) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(list(self))


class Plan(Sequence[list[Units]]):
    """An epoch's plan: ``plan[rank][worker]`` is that reader's units, in reading order. The
    ranks' shares are cut at once, in bulk, and a rank's readers' when it is first asked for."""

    def __init__(self, pieces: _Pieces | None, ranks: list[list[_Piece | range]], workers: int):
        self._pieces, self._ranks, self._workers = pieces, ranks, workers
        self._made: dict[int, list[Any]] = {}

    @classmethod
    def of(cls, readers: list[list[list[Unit]]]) -> Plan:
        """A plan of units made already (``readers[rank][worker]``)."""
        plan = cls(None, [[] for _ in readers], len(readers[0]) if readers else 0)
        plan._made = dict(enumerate(readers))
        return plan

    def __len__(self) -> int:
        return len(self._ranks)

    @overload
    def __getitem__(self, rank: int) -> list[Units]: ...
    @overload
    def __getitem__(self, rank: slice) -> list[list[Units]]: ...
    def __getitem__(self, rank: int | slice) -> list[Units] | list[list[Units]]:
        if isinstance(rank, slice):
            return [self[r] for r in range(*rank.indices(len(self)))]
        rank = range(len(self))[rank]  # IndexError as a list gives
        if rank not in self._made:
            assert self._pieces is not None
            pieces = self._pieces.take(self._ranks[rank])
            workers = _cut_whole(pieces.weights, pieces.piece, self._workers)
            self._made[rank] = [Units(pieces.take(items)) for items in workers]
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
    pieces = _Pieces.whole(order, table.sizes()[order], table.weights()[order].tolist())
    return Plan(pieces, _cut_whole(pieces.weights, pieces.piece, world_size), num_workers)


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
            fit, done = _fitting(array, at, done, boundary + 1e-9, 2 * len(weights) // parts + 64)
            if fit:
                out[part].append(range(at, at + fit))
                at += fit
                if at == len(weights):
                    break
            piece = piece_of(at)
        elif done + piece.weight <= boundary + 1e-9:
            out[part].append(piece)
            done, at, piece = done + piece.weight, at + 1, None
            continue
        head, rest = _split_for(piece, boundary - done)
        if head is not None:
            out[part].append(head)
            done += head.weight
        if rest is None:
            at, piece = at + 1, None
            continue
        piece = rest
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
            head, rest = _split_for(piece, boundary - done)
            if head is not None:
                out[part].append(head)
                done += head.weight
            if rest is None:
                break
            piece = rest
            part += 1
    return out


def _split_for(piece: _Piece, room: float) -> tuple[_Piece | None, _Piece | None]:
    """``piece`` cut where ``room`` of its weight is used up, at an utterance: the head that
    fits (None: none of it) and the rest (None: all of it fits)."""
    assert piece.count is not None
    head_count = round(room / piece.weight * piece.count) if piece.weight else 0
    if head_count >= piece.count:
        return piece, None
    if head_count > 0:
        return piece.split(head_count)
    return None, piece


def _fitting(weights: np.ndarray, at: int, done: float, bound: float, chunk: int) -> tuple[int, float]:
    """How many of ``weights[at:]`` added one by one to ``done`` stay ``<= bound``, and the
    sum then: running sums of ``chunk`` weights at a time (``numpy.cumsum`` adds in order)."""
    fit = 0
    while at + fit < len(weights):
        sums = np.cumsum(np.concatenate(([done], weights[at + fit : at + fit + chunk])))
        more = int(np.searchsorted(sums[1:], bound, side="right"))
        fit, done = fit + more, float(sums[more])
        if more < len(sums) - 1:
            break
    return fit, done


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


def unit_counts(table: ShardTable, units: Sequence[Unit]) -> tuple[np.ndarray, np.ndarray]:
    """Each unit's shard and the samples it yields (-1 where its shard's size is unknown),
    in bulk for a plan's :class:`Units`."""
    if isinstance(units, Units):
        return units.pieces.columns["shard"], units.pieces.columns["count"]
    sizes = table.sizes()
    counts = [unit.count(int(sizes[unit.shard]) if sizes[unit.shard] >= 0 else None) for unit in units]
    shards = np.array([unit.shard for unit in units], dtype=np.int64)
    return shards, np.array([-1 if count is None else count for count in counts], dtype=np.int64)


def planned_utts(table: ShardTable, units: Sequence[Unit], counted: Mapping[int, int] | None = None) -> int | None:
    """Utterances a reader's units hold, when the size of every shard they read is known
    (from the index, or ``counted``: shard number -> samples counted on disk)."""
    if isinstance(units, Units):
        return int(units.pieces.columns["count"].sum())  # a plan's: of shards whose sizes are known
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
