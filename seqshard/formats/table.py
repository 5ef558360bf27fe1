"""The shards a loader reads: each file, what its folder's index says of it, and the dataset's
facts (feature dim, frame shift, length histogram, field sets, missing shards).

Two selected files that are one shard (a folder copied beside the original and both
selected) are refused when the table is made: their samples would be read twice.
"""

from __future__ import annotations

import hashlib
import logging
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, ShardError, counted
from .index import ShardIndex, merge_histograms
from .patterns import Patterns, is_list_name, is_manifest_name
from .peers.lists import scan_list
from .peers.nemo import scan_manifest
from .peers.shar import is_shar_table
from .remote import access as remote
from .remote.access import RemoteAccess, is_pipe, is_remote
from .remote.selection import RemoteSelection, split_patterns
from .selection import MissingShard, ShardSelection, select_shards
from .shard_lengths import ShardLengths
from .streams import first_sample_fields, open_samples

_LOG = logging.getLogger("seqshard")
MAIN = ""  # the field set of the shard file itself (sidecar field sets have names)


@dataclass(frozen=True)
class ShardInfo:
    """A shard file and what its folder's index says of it (None when not indexed)."""

    path: str
    bytes: int
    num_utts: int | None = None
    num_frames: int | None = None
    escaped_keys: bool = False  # keys were percent-encoded at pack time (shown unescaped)
    sidecars: tuple[tuple[str, str], ...] = ()  # (field set, path) of its sidecar field files
    checksum: str | None = None  # from the index
    key_ranges: tuple[tuple[str, str, str], ...] = ()  # (field set, first key, last key) the index records

    def key_range(self, field_set: str) -> tuple[str, str] | None:
        """The first and last key of the file of ``field_set``, when the index records them
        (a reader checks the file against them)."""
        for name, first, last in self.key_ranges:
            if name == field_set:
                return first, last
        return None

    def file_of(self, field_set: str) -> str:
        """The file holding ``field_set`` of this shard (``MAIN``: the shard itself)."""
        if field_set == MAIN:
            return self.path
        for name, path in self.sidecars:
            if name == field_set:
                return path
        raise ConfigError(f"{self.path} has no field set {field_set!r} (add it with `seqshard add-field`).")


@dataclass
class SelectedFolder:
    """One folder of selected shards, local or remote: its name (a path or URL), its index,
    and its shards (paths or URLs), in pattern order."""

    name: str
    index: ShardIndex | None
    shards: list[str]


def select_folders(
    patterns: Patterns, access: RemoteAccess | None = None, skip_bad: bool = False
) -> tuple[list[SelectedFolder], list[MissingShard]]:
    """The shards of ``patterns``, local ones (see :func:`select_shards`) then remote ones
    (URLs, lists naming URLs: :mod:`.remote_selection`), grouped by folder; and the missing."""
    local, remote = split_patterns(patterns)
    selection = select_shards(local, skip_bad) if local else ShardSelection()
    folders = [
        SelectedFolder(str(folder), selection.indexes[folder], [str(p) for p in paths])
        for folder, paths in selection.folders.items()
    ]
    missing = selection.missing
    if remote:
        chosen = RemoteSelection(remote, access or RemoteAccess())
        by_folder: dict[str, list[str]] = {}
        for shard in chosen.shards:
            by_folder.setdefault(shard.folder, []).append(shard.url)
        folders += [SelectedFolder(name, chosen.indexes.get(name), urls) for name, urls in by_folder.items()]
        missing = missing + chosen.missing
    return folders, missing


class _Gathered:
    """Shards and dataset facts collected folder by folder (local or remote) for a table."""

    def __init__(self, access: RemoteAccess) -> None:
        self.access = access
        self.shards: list[ShardInfo] = []
        self.dims: dict[int, str] = {}
        self.histograms: list[dict[int, int]] = []
        self.lengths: list[tuple[dict[int, int], int | None, int | None] | None] = []  # each shard's, in order
        self.shift = 10.0
        self.field_sets: dict[str, dict[str, None]] = {}
        self.layouts: dict[str, tuple[str, tuple[int, ...]]] = {}  # an added array field's dtype and shape

    def add_folder(self, folder: str, index: ShardIndex | None, paths: list[str]) -> None:
        if index is not None and index.feature.get("dim"):
            self.dims.setdefault(int(index.feature["dim"]), folder)
            self.shift = float(index.feature.get("frame_shift_ms") or self.shift)
        escaped = index is not None and index.escaped_keys
        main_fields = index.fields if index and index.fields else first_sample_fields(paths[0], self.access)
        for name, suffixes in [(MAIN, main_fields)] + [
            (name, fs.fields) for name, fs in (index.field_sets.items() if index else [])
        ]:
            self.field_sets.setdefault(name, {}).update(dict.fromkeys(suffixes))
        for name, fs in index.field_sets.items() if index else []:
            if fs.layout.get("dtype"):
                self.layouts.setdefault(name, (str(fs.layout["dtype"]), tuple(int(n) for n in fs.layout["shape"])))
        unindexed = [p for p in paths if not is_list_name(p) and (index is None or index.entry(_name(p)) is None)]
        if index is not None and unindexed:
            _LOG.warning(
                "%s: %s not in its index.json, read without its facts (a copy, or added after the index? run "
                "`seqshard index` on the folder)",
                folder,
                counted(len(unindexed), "selected shard", "is"),
            )
        access = self.access
        for path in paths:
            entry = index.entry(_name(path)) if index else None
            self.lengths.append((entry.length_hist, entry.min_frames, entry.max_frames) if entry else None)
            if is_list_name(path):  # a raw list, read as a shard of its lines
                scan = scan_manifest if is_manifest_name(path) else scan_list
                self.shards.append(ShardInfo(path, Path(path).stat().st_size, scan(Path(path))))
            elif entry is None:
                size = access.size(path) if remote.is_remote(path) else Path(path).stat().st_size
                self.shards.append(ShardInfo(path, size, escaped_keys=escaped))
            else:
                cars = sorted(entry.sidecars.items())
                sidecars = tuple((name, f"{folder}/{car.name}") for name, car in cars)
                ranges = [(MAIN, entry.first_key, entry.last_key)]
                ranges += [(name, car.first_key, car.last_key) for name, car in cars]
                self.shards.append(
                    ShardInfo(
                        path,
                        entry.bytes,
                        entry.num_utts,
                        entry.num_frames,
                        escaped,
                        sidecars,
                        entry.checksum,
                        tuple((name, first, last) for name, first, last in ranges if first and last),
                    )
                )
                self.histograms.append(entry.length_hist)
                if remote.is_remote(path):  # what the cache checks its copies against
                    access.expected[path] = (entry.bytes, entry.checksum)
                    for car in entry.sidecars.values():
                        access.expected[f"{folder}/{car.name}"] = (car.bytes, car.checksum)


def _name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _refuse_copies(shards: Sequence[ShardInfo], access: RemoteAccess) -> None:
    """Refuse two selected files that are one shard (a copied folder selected with its
    original): their samples would be read twice each epoch. Only files of equal size are
    compared, by their index's CRC-32 when every one of them is indexed, else by their first
    sample (key and bytes, one small read each)."""
    by_size: dict[int, list[ShardInfo]] = {}
    for shard in shards:
        if not is_list_name(shard.path):
            by_size.setdefault(shard.bytes, []).append(shard)
    for group in (g for g in by_size.values() if len(g) > 1):
        indexed = all(shard.checksum for shard in group)
        seen: dict[Any, str] = {}
        for shard in group:
            mark = shard.checksum if indexed else _first_sample_mark(shard.path, access)
            if mark is None:
                continue
            first = seen.setdefault(mark, shard.path)
            if first != shard.path:
                raise ConfigError(
                    f"{first} and {shard.path} are copies of one shard (the same size and "
                    f"{'CRC-32' if indexed else 'first sample'}): its samples would be read twice each epoch. "
                    "Fix: select one of them (leave the copy's folder or file out of the patterns)."
                )


def _first_sample_mark(path: str, access: RemoteAccess) -> tuple[str, int] | None:
    """The first sample's key and the CRC-32 of its members, or None when it cannot be read
    (the reader reports the damage)."""
    try:
        with open_samples(path, read_ahead=False, access=access) as stream:
            sample = stream.next_sample()
            if sample is None:
                return None
            crc = 0
            for suffix, data in sample.fields.items():
                crc = zlib.crc32(data, zlib.crc32(suffix.encode("utf-8"), crc))
            return sample.key, crc
    except ShardError:
        return None


@dataclass(frozen=True)
class ShardTable:
    """The shards a loader reads, with dataset facts gathered from their indexes."""

    shards: tuple[ShardInfo, ...]
    dim: int | None = None
    frame_shift_ms: float = 10.0
    length_hist: tuple[tuple[int, int], ...] = ()
    missing: tuple[MissingShard, ...] = ()  # selected but not on disk (see formats/selection.py)
    field_sets: tuple[tuple[str, tuple[str, ...]], ...] = ()  # set -> member suffixes, from the indexes
    shar: bool = False  # the shards are Lhotse Shar folders' (read whole by default, as lhotse reads them)
    layouts: tuple[tuple[str, str, tuple[int, ...]], ...] = ()  # added array fields: (set, dtype, shape after T)
    lengths: ShardLengths = field(default_factory=lambda: ShardLengths.of([]), compare=False)  # each shard's

    @classmethod
    def from_patterns(
        cls, patterns: Patterns, access: RemoteAccess | None = None, skip_bad: bool = False
    ) -> ShardTable:
        """Expand brace/glob ``patterns`` (local paths, URLs, lists) and read each folder's
        ``index.json``; remote sizes and index facts go into ``access`` (the cache checks its
        copies against them). Local shards come first, then remote ones, each in pattern order.
        ``skip_bad``: a bad sample that a folder's facts show is left to the reader to count."""
        access = access or RemoteAccess()
        folders, missing = select_folders(patterns, access, skip_bad)
        gathered = _Gathered(access)
        for folder in folders:
            gathered.add_folder(folder.name, folder.index, folder.shards)
        if len(gathered.dims) > 1:
            raise ConfigError(
                f"the shards mix feature dimensions: {', '.join(f'{d} in {f}' for d, f in gathered.dims.items())}."
            )
        _refuse_copies(gathered.shards, access)
        histogram = merge_histograms(gathered.histograms)
        return cls(
            tuple(gathered.shards),
            next(iter(gathered.dims), None),
            gathered.shift,
            tuple(histogram.items()),
            tuple(missing),
            tuple((name, tuple(suffixes)) for name, suffixes in gathered.field_sets.items()),
            is_shar_table([shard.path for shard in gathered.shards]),
            tuple((name, dtype, shape) for name, (dtype, shape) in gathered.layouts.items()),
            ShardLengths.of(gathered.lengths),
        )

    @classmethod
    def combine(cls, tables: Sequence[ShardTable], names: Sequence[str]) -> ShardTable:
        """One table of the shards of ``tables`` (the sources of a mix), in order."""
        dims = {t.dim: name for t, name in zip(tables, names) if t.dim is not None}
        if len(dims) > 1:
            raise ConfigError(
                f"the mixed sources have different feature dimensions: {', '.join(f'{d} in {n}' for d, n in dims.items())}."
            )
        shifts = {t.frame_shift_ms for t in tables if t.dim is not None}
        if len(shifts) > 1:
            raise ConfigError(f"the mixed sources have different frame shifts: {sorted(shifts)} ms.")
        field_sets: dict[str, dict[str, None]] = {}
        for table in tables:
            for name, suffixes in table.field_sets:
                field_sets.setdefault(name, {}).update(dict.fromkeys(suffixes))
        return cls(
            tuple(shard for t in tables for shard in t.shards),
            next(iter(dims), None),
            next(iter(shifts), 10.0),
            tuple(merge_histograms(dict(t.length_hist) for t in tables).items()),
            tuple(m for t in tables for m in t.missing),
            tuple((name, tuple(suffixes)) for name, suffixes in field_sets.items()),
            all(t.shar for t in tables),
            tuple(dict((layout[0], layout) for t in tables for layout in t.layouts).values()),
            ShardLengths.combine([t.lengths for t in tables]),
        )

    @property
    def indexed(self) -> bool:
        return all(s.num_utts is not None for s in self.shards)

    @property
    def num_utts(self) -> int | None:
        return sum(s.num_utts for s in self.shards) if self.indexed else None  # type: ignore[misc]

    def fingerprint(self) -> str:
        """Identifies the shard list (names and sizes) for checking a saved loader state."""
        digest = hashlib.sha256()
        for shard in self.shards:
            digest.update(f"{shard.path}\0{shard.bytes}\n".encode())
        return digest.hexdigest()[:16]

    def weights(self) -> list[float]:
        """Work per shard: frames when every shard's are known, bytes otherwise."""
        if self.indexed and all(s.num_frames for s in self.shards):
            return [float(s.num_frames) for s in self.shards]  # type: ignore[arg-type]
        return [float(s.bytes) for s in self.shards]


def size_problem(path: str, indexed_bytes: int) -> str | None:
    """What is wrong when the local shard ``path`` does not have the size its index records
    (cut short or replaced since it was indexed); None when it has, or cannot be looked at
    here (a URL, a pipe, a file that opening will name)."""
    if is_remote(path) or is_pipe(path):
        return None
    try:
        size = os.stat(path).st_size
    except OSError:
        return None
    if size == indexed_bytes:
        return None
    return f"the file has {size} bytes where its index.json says {indexed_bytes}: it was cut short or replaced since it was indexed"
