"""Several shard sets feeding one loader: ``make_loader(seqshard.mux([...], weights=[...]))``.

Each leaf source of the mux is an endless stream of passes over its own shards (each pass a
new plan of that source's shards over the readers, and new shuffles), read by every reader
through the usual stages up to the shuffle window; the :class:`Mix` stage then takes the
next sample from the source that :func:`seqshard.mix.next_block` names, and batching sorts
and cuts the mixed stream. The stream goes on across epochs (an epoch is ``epoch_steps``,
``epoch_hours`` or, with ``epoch_source``, one pass's worth of one source's utterances).

State: the block number, how many samples each source has given, and each source's stream
state (its pass number and position): a resume continues exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import ConfigError
from ...formats.patterns import Patterns
from ...formats.table import ShardTable
from ...mix import Mux, flatten, next_block
from ...seeds import Seed, stage_rng
from ..plan import Plan, Unit, spread_units
from .base import Stage, State, merge_counts
from .sample import Sample


@dataclass(frozen=True)
class MixSetup:
    """The leaf sources of a mux in one shard table: names, shard ranges, shares, sizes."""

    names: tuple[str, ...]
    ranges: tuple[tuple[int, int], ...]  # [start, stop) in the combined table's shards
    shares: tuple[float, ...]
    sizes: tuple[int | None, ...]  # utterances per source (from the indexes), None if unknown

    def source_of(self, spec: int | str) -> int:
        """The index of the source named ``spec`` (its position or its pattern text)."""
        if isinstance(spec, int) and 0 <= spec < len(self.names):
            return spec
        if spec in self.names:
            return self.names.index(spec)  # type: ignore[arg-type]
        raise ConfigError(
            f"epoch_source {spec!r} is not one of the mixed sources: {list(self.names)} (or their positions)."
        )


def mixed_table(mix: Mux) -> tuple[ShardTable, MixSetup]:
    """The combined shard table of the mux's leaves, and where each leaf's shards are."""
    tables: dict[int, ShardTable] = {}

    def table_of(leaf: Patterns) -> ShardTable:
        if id(leaf) not in tables:
            tables[id(leaf)] = ShardTable.from_patterns(leaf)
        return tables[id(leaf)]

    def size_of(leaf: Patterns) -> float:
        utts = table_of(leaf).num_utts
        if utts is None and mix_uses_sizes(mix):
            raise ConfigError(
                f"temperature mixing needs each source's size, and {leaf!r} has shards without an index: "
                "run `seqshard index` on its folder, or give weights."
            )
        return float(utts or 0)

    leaves, shares = flatten(mix, size_of)
    names = tuple(_name(leaf) for leaf in leaves)
    if len(set(names)) < len(names):
        raise ConfigError(f"a source appears twice in the mux: {list(names)}.")
    leaf_tables = [table_of(leaf) for leaf in leaves]
    ranges, start = [], 0
    for table in leaf_tables:
        ranges.append((start, start + len(table.shards)))
        start += len(table.shards)
    combined = ShardTable.combine(leaf_tables, names)
    return combined, MixSetup(
        names, tuple(ranges), tuple(float(s) for s in shares), tuple(t.num_utts for t in leaf_tables)
    )


def mix_uses_sizes(mix: Mux) -> bool:
    return mix.weights is None or any(isinstance(s, Mux) and mix_uses_sizes(s) for s in mix.sources)


def _name(leaf: Any) -> str:
    if isinstance(leaf, (list, tuple)):
        return ",".join(map(str, leaf))
    return str(leaf)


def source_plan(table: ShardTable, mix: MixSetup, source: int, number: int, config: Any, world_size: int) -> Plan:
    """Pass ``number`` of ``source``: its shards in a seeded order, spread over all readers
    (``config``: the loader's options; ``world_size`` ranks of ``max(1, num_workers)`` readers)."""
    start, stop = mix.ranges[source]
    order = np.arange(start, stop)
    if config.shuffle:
        order = start + stage_rng(config.seed, Seed.PLAN, Seed.MIX_PASS, source, number).permutation(stop - start)
    units = [Unit(int(i)) for i in order]
    return spread_units(table, units, world_size, max(1, config.num_workers), config.split_shards)


class Mix(Stage[Sample]):
    """Takes each sample from the source :func:`seqshard.mix.next_block` names; tags it with
    its source (``sample.stream``). Counters ``mix.<source>`` count the samples taken."""

    def __init__(self, streams: Sequence[Stage[Sample]], shares: Sequence[float], seed: int, *position: int):
        super().__init__(None)
        self.streams = list(streams)
        self.shares = np.asarray(shares, dtype=np.float64)
        self.seed = seed
        self.position = position
        self._block = -1
        self._picks: list[int] = []  # plain lists: next() is per sample
        self._offset = 0
        self._counts = [0] * len(streams)  # samples taken per source
        self._at_block = list(self._counts)  # the counts when the current block began

    def reset(self, state: State | None = None) -> None:
        super().reset(state)
        state = state or {}
        self._block = int(state.get("block", -1))
        self._offset = int(state.get("offset", 0))
        self._counts = [int(c) for c in state.get("counts", [0] * len(self.streams))]
        self._at_block = [int(c) for c in state.get("at_block", self._counts)]
        self._picks = self._block_picks() if self._block >= 0 else []
        streams = state.get("streams") or [None] * len(self.streams)
        for stream, stream_state in zip(self.streams, streams):
            stream.reset(stream_state)

    def _block_picks(self) -> list[int]:
        return next_block(self.shares, np.asarray(self._at_block), self.seed, self._block, *self.position).tolist()

    def next(self) -> Sample:
        if self._offset >= len(self._picks):
            self._block += 1
            self._at_block = list(self._counts)
            self._picks = self._block_picks()
            self._offset = 0
        source = self._picks[self._offset]
        sample = self.streams[source].next()  # endless: a StopIteration here is a real end
        self._offset += 1
        self._counts[source] += 1
        sample.stream = source
        return sample

    def get_state(self) -> State:
        return {
            "block": self._block,
            "offset": self._offset,
            "counts": list(self._counts),
            "at_block": list(self._at_block),
            "streams": [stream.get_state() for stream in self.streams],
        }

    def stats(self) -> dict[str, int]:
        counts = {f"mix.{i}": c for i, c in enumerate(self._counts)}
        return merge_counts(counts, *(stream.stats() for stream in self.streams))

    def pending(self) -> list[Any]:
        return [item for stream in self.streams for item in stream.pending()]


def per_source_counts(samples: Sequence[Sample], lengths: Sequence[int], sources: int) -> list[list[int]]:
    """[utterances, summed length] per source of a batch's samples."""
    counts = [[0, 0] for _ in range(sources)]
    for sample, length in zip(samples, lengths):
        counts[sample.stream][0] += 1
        counts[sample.stream][1] += int(length)
    return counts
