"""What a loader reads: the shard table of its patterns, or of the sources of a mix, checked by
the one rule for shards that should be there and are not (local files and URLs alike).

A mix (:func:`seqshard.mux`) puts every leaf source's shards in one combined table;
:class:`MixSetup` says where each source's shards are in it, its share of the stream and its
size. Missing shards are an error naming them, or with ``skip_bad`` a logged skip within
``max_bad_shards`` (the same budget damaged shards are counted against as they are read).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, ShardError, counted, listed
from ..formats.patterns import Patterns
from ..formats.remote.access import RemoteAccess
from ..formats.selection import missing_error
from ..formats.table import ShardTable
from ..mix import Mux, flatten
from ..options import BadData, LoaderOptions

_LOG = logging.getLogger("seqshard")


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

    def epoch_source(self, spec: int | str) -> tuple[int, int]:
        """(source, utterances) of ``epoch_source=spec``: one pass's worth of that source; an
        error when it cannot end an epoch (unknown size, no utterances, weight 0)."""
        source = self.source_of(spec)
        size, name = self.sizes[source], self.names[source]
        if size is None:
            raise ConfigError(
                f"epoch_source {name!r} has shards without an index, so its size is unknown: "
                "run `seqshard index` on its folder."
            )
        if not size or not self.shares[source]:
            problem = (
                "holds no utterances, so every epoch would be empty"
                if not size
                else "has weight 0 in the mux, so none of it is read and an epoch would never end"
            )
            raise ConfigError(
                f"epoch_source {name!r} {problem}: choose a source the mux reads, or give epoch_steps or epoch_hours."
            )
        return source, size


def check_epoch_source(mix: MixSetup, spec: int | str | None) -> None:
    """Refuse an ``epoch_source`` that cannot end an epoch of ``mix`` now (the loader, and
    ``seqshard config`` before it), not after an endless epoch."""
    if spec is not None:
        mix.epoch_source(spec)


def open_sources(
    patterns: Patterns | Mux, options: LoaderOptions, access: RemoteAccess
) -> tuple[ShardTable, MixSetup | None]:
    """The table of what ``patterns`` (or a mux of them) select, with the missing-shard rule
    applied; the mix's set-up when it is one."""
    if isinstance(patterns, Mux):
        table, mix = mixed_table(patterns, access, options.bad_data.skip_bad)
        check_epoch_source(mix, options.epochs.epoch_source)
    else:
        table, mix = ShardTable.from_patterns(patterns, access, options.bad_data.skip_bad), None
    check_missing(table, options.bad_data)
    return table, mix


def check_missing(table: ShardTable, bad_data: BadData) -> None:
    """Selected shards that are not there: an error naming them, or (``skip_bad``) a warning
    within the ``max_bad_shards`` budget."""
    if table.missing:
        if not bad_data.skip_bad:
            raise missing_error(table.missing)
        total = len(table.shards) + len(table.missing)
        budget = bad_data.shard_budget(total)
        shown = listed([f"{m.path} ({m.why})" for m in table.missing], "; ")
        if len(table.missing) > budget:
            raise ShardError(
                "the selected shards",
                None,
                f"{bad_data.over_budget(0, len(table.missing), total)} Missing: {shown}.",
            )
        _LOG.warning(
            "%s missing and not read (skip_bad): %s",
            counted(len(table.missing), "selected shard", "is"),
            shown,
        )
    if not table.shards:
        raise ConfigError("none of the selected shards exists (all are missing).")


def mixed_table(mix: Mux, access: RemoteAccess, skip_bad: bool = False) -> tuple[ShardTable, MixSetup]:
    """The combined shard table of the mux's leaves, and where each leaf's shards are."""
    tables: dict[int, ShardTable] = {}

    def table_of(leaf: Patterns) -> ShardTable:
        if id(leaf) not in tables:
            tables[id(leaf)] = ShardTable.from_patterns(leaf, access, skip_bad)
        return tables[id(leaf)]

    def size_of(leaf: Patterns) -> float:
        utts = table_of(leaf).num_utts
        if utts is None and _uses_sizes(mix):
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


def _uses_sizes(mix: Mux) -> bool:
    return mix.weights is None or any(isinstance(s, Mux) and _uses_sizes(s) for s in mix.sources)


def _name(leaf: Any) -> str:
    if isinstance(leaf, (list, tuple)):
        return ",".join(map(str, leaf))
    return str(leaf)
