"""The shards a loader reads: each file, what its folder's index says of it, and the dataset's
facts (feature dim, frame shift, length histogram, field sets, missing shards).

Two selected files that are one shard (a folder copied beside the original and both
selected) are refused when the table is made: their samples would be read twice.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import numpy as np

from ..errors import ConfigError, ShardError, counted
from .index import ShardIndex
from .index_entries import merge_histograms
from .index_table import ShardColumns, Texts
from .patterns import LIST_SUFFIXES, Patterns, is_list_name, is_manifest_name
from .peers.lists import scan_list
from .peers.nemo import scan_manifest
from .peers.shar import is_shar_table
from .remote import access as remote
from .remote.access import RemoteAccess, is_pipe, is_remote
from .remote.url_selection import RemoteSelection, split_patterns
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
    and its shards (paths or URLs, and their file names), in pattern order."""

    name: str
    index: ShardIndex | None
    paths: Paths
    names: list[str]  # the file names (a URL's last part)

    @property
    def shards(self) -> list[str]:
        return list(self.paths)


def select_folders(
    patterns: Patterns, access: RemoteAccess | None = None, skip_bad: bool = False
) -> tuple[list[SelectedFolder], list[MissingShard]]:
    """The shards of ``patterns``, local ones (see :func:`select_shards`) then remote ones
    (URLs, lists naming URLs: :mod:`.remote_selection`), grouped by folder; and the missing."""
    local, remote = split_patterns(patterns)
    selection = select_shards(local, skip_bad) if local else ShardSelection()
    folders = [
        SelectedFolder(str(folder), selection.indexes[folder], Paths.in_folder(folder, names), names)
        for folder, names in selection.folders.items()
    ]
    missing = selection.missing
    if remote:
        chosen = RemoteSelection(remote, access or RemoteAccess())
        by_folder: dict[str, list[str]] = {}
        for shard in chosen.shards:
            by_folder.setdefault(shard.folder, []).append(shard.url)
        folders += [
            SelectedFolder(name, chosen.indexes.get(name), Paths.of(urls), [_name(url) for url in urls])
            for name, urls in by_folder.items()
        ]
        missing = missing + chosen.missing
    return folders, missing


class Paths(Sequence[str]):
    """Paths (or URLs) as a prefix and a name each: the shards of a local folder share its
    prefix, and their names are its index's (no string a path until one is asked for);
    pickled with the names as one text (:class:`~.index_table.Texts`)."""

    def __init__(self, prefixes: list[str], place: np.ndarray, names: list[str]):
        self.prefixes, self.place, self.names = prefixes, place, names

    @classmethod
    def of(cls, paths: Sequence[str]) -> Paths:
        return cls([""], np.zeros(len(paths), dtype=np.int32), list(paths))

    @classmethod
    def in_folder(cls, folder: Path, names: list[str]) -> Paths:
        """``str(folder / name)`` of each of ``names``."""
        base = str(folder)
        prefix = "" if base == "." else base if base.endswith("/") else base + "/"
        return cls([prefix], np.zeros(len(names), dtype=np.int32), names)

    @classmethod
    def concat(cls, parts: Sequence[Paths]) -> Paths:
        firsts = np.cumsum([0, *(len(p.prefixes) for p in parts)])
        return cls(
            [prefix for part in parts for prefix in part.prefixes],
            np.concatenate([part.place + first for part, first in zip(parts, firsts)]).astype(np.int32),
            [name for part in parts for name in part.names],
        )

    def __len__(self) -> int:
        return len(self.names)

    @overload
    def __getitem__(self, at: int) -> str: ...
    @overload
    def __getitem__(self, at: slice) -> list[str]: ...
    def __getitem__(self, at: int | slice) -> str | list[str]:
        if isinstance(at, slice):
            return [self[i] for i in range(*at.indices(len(self)))]
        return self.prefixes[self.place[at]] + self.names[at]

    def __iter__(self) -> Iterator[str]:
        if len(self.prefixes) == 1:
            return map(self.prefixes[0].__add__, self.names)
        return map(str.__add__, map(self.prefixes.__getitem__, self.place.tolist()), self.names)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "names": Texts.of(self.names)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, names=state["names"].tolist())


class Shards(Sequence["ShardInfo"]):
    """A table's shards as columns, so that a table of 500,000 shards holds no object a shard
    and pickles fast to spawned workers: paths, sizes, counts (-1: unknown) and whether keys
    are escaped, and for a shard an index lists, its folder's columns and row there (sidecars,
    checksum, key ranges come from there). ``shards[i]`` is shard ``i``'s :class:`ShardInfo`,
    made when asked for (the last ones asked for are kept)."""

    def __init__(
        self,
        paths: Paths,
        numbers: dict[str, np.ndarray],  # bytes, num_utts, num_frames (int64, -1 unknown)
        escaped: np.ndarray,  # bool
        listed: np.ndarray,  # bool: a list (a WeNet list, a manifest) read as a shard
        rows: np.ndarray,  # int64: the row in its folder's index, -1 when none
        folders: np.ndarray,  # int32: the folder in ``sources``, -1 when none
        sources: list[tuple[str, ShardColumns]],  # (folder as the paths spell it, its index's columns)
        given: dict[int, ShardInfo] | None = None,  # shards made as objects (ShardTable(...) of ShardInfo)
    ):
        self.paths, self.numbers, self.escaped, self.listed = paths, numbers, escaped, listed
        self.rows, self.folders, self.sources, self.given = rows, folders, sources, given or {}
        self._made: dict[int, ShardInfo] = {}
        self._fingerprint: str | None = None

    @classmethod
    def of(cls, infos: Sequence[ShardInfo]) -> Shards:
        numbers = {
            f: np.array([-1 if getattr(s, f) is None else getattr(s, f) for s in infos], np.int64).reshape(-1)
            for f in ("bytes", "num_utts", "num_frames")
        }
        none = np.full(len(infos), -1, np.int64)
        escaped = np.array([s.escaped_keys for s in infos], bool).reshape(-1)
        paths = Paths.of([s.path for s in infos])
        return cls(
            paths, numbers, escaped, _lists(paths.names), none, none.astype(np.int32), [], dict(enumerate(infos))
        )

    @classmethod
    def concat(cls, parts: Sequence[Shards]) -> Shards:
        """The shards of ``parts``, in order."""
        if len(parts) == 1:
            return parts[0]
        starts = np.cumsum([0, *map(len, parts)])
        firsts = np.cumsum([0, *(len(p.sources) for p in parts)])
        return cls(
            Paths.concat([part.paths for part in parts]),
            {f: np.concatenate([p.numbers[f] for p in parts]) for f in parts[0].numbers},
            np.concatenate([p.escaped for p in parts]),
            np.concatenate([p.listed for p in parts]),
            np.concatenate([p.rows for p in parts]),
            np.concatenate([np.where(p.folders < 0, -1, p.folders + first) for p, first in zip(parts, firsts)]),
            [source for part in parts for source in part.sources],
            {int(start) + i: info for part, start in zip(parts, starts) for i, info in part.given.items()},
        )

    def __len__(self) -> int:
        return len(self.paths)

    @overload
    def __getitem__(self, shard: int) -> ShardInfo: ...
    @overload
    def __getitem__(self, shard: slice) -> list[ShardInfo]: ...
    def __getitem__(self, shard: int | slice) -> ShardInfo | list[ShardInfo]:
        if isinstance(shard, slice):
            return [self[i] for i in range(*shard.indices(len(self)))]
        if shard < 0:
            shard += len(self)
        if not 0 <= shard < len(self):
            raise IndexError(shard)
        found = self.given.get(shard) or self._made.get(shard)
        if found is None:
            if len(self._made) >= 4096:
                self._made.clear()
            found = self._made[shard] = self._make(shard)
        return found

    def __iter__(self) -> Iterator[ShardInfo]:
        return map(self.__getitem__, range(len(self)))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_made": {}}

    def _make(self, shard: int) -> ShardInfo:
        size, utts, frames = (int(self.numbers[f][shard]) for f in ("bytes", "num_utts", "num_frames"))
        known = (None if utts < 0 else utts), (None if frames < 0 else frames)
        row = int(self.rows[shard])
        if row < 0:
            return ShardInfo(self.paths[shard], size, *known, bool(self.escaped[shard]))
        folder, columns = self.sources[int(self.folders[shard])]
        sidecars, ranges = [], [(MAIN, columns.texts["first_key"][row], columns.texts["last_key"][row])]
        for name, car in sorted(columns.sidecars.items()):
            if car.present[row]:
                sidecars.append((name, f"{folder}/{car.texts['name'][row]}"))
                ranges.append((name, car.texts["first_key"][row], car.texts["last_key"][row]))
        return ShardInfo(
            self.paths[shard],
            size,
            *known,
            bool(self.escaped[shard]),
            tuple(sidecars),
            columns.texts["checksum"][row],
            tuple((name, first, last) for name, first, last in ranges if first and last),  # type: ignore[misc]
        )

    def fingerprint(self) -> str:
        """The paths and sizes, hashed (once): see :meth:`ShardTable.fingerprint`."""
        if self._fingerprint is None:
            text = "".join(map("{}\0{}\n".format, self.paths, self.numbers["bytes"].tolist()))
            self._fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]
        return self._fingerprint

    def checksums(self, shards: np.ndarray) -> np.ndarray:
        """The checksums of ``shards``, when their index records them (else None), as an object
        array of this table's length (None elsewhere)."""
        found = np.full(len(self), None, dtype=object)
        chosen = np.zeros(len(self), dtype=bool)
        chosen[shards] = True
        for number, (_, columns) in enumerate(self.sources):
            at = np.flatnonzero((self.folders == number) & chosen)
            found[at] = columns.texts["checksum"].take(self.rows[at])
        for shard, info in self.given.items():
            found[shard] = info.checksum if chosen[shard] else None
        return found

    def lacking(self, field_set: str) -> str | None:
        """The path of the first shard without a sidecar of ``field_set``, or None."""
        has = np.zeros(len(self), bool)
        for number, (_, columns) in enumerate(self.sources):
            car = columns.sidecars.get(field_set)
            at = np.flatnonzero(self.folders == number)
            if car is not None:
                has[at] = car.present[self.rows[at]]
        for shard, info in self.given.items():
            has[shard] = field_set in dict(info.sidecars)
        missing = np.flatnonzero(~has)
        return self.paths[int(missing[0])] if len(missing) else None


class _Gathered:
    """Shards and dataset facts collected folder by folder (local or remote) for a table."""

    def __init__(self, access: RemoteAccess) -> None:
        self.access = access
        self.parts: list[Shards] = []
        self.dims: dict[int, str] = {}
        self.shift = 10.0
        self.field_sets: dict[str, dict[str, None]] = {}
        self.layouts: dict[str, tuple[str, tuple[int, ...]]] = {}  # an added array field's dtype and shape
        self.lengths: list[tuple[ShardColumns | None, np.ndarray]] = []  # each part's index and rows

    def add_folder(self, folder: SelectedFolder) -> None:
        index, paths = folder.index, folder.paths
        if index is not None and index.feature.get("dim"):
            self.dims.setdefault(int(index.feature["dim"]), folder.name)
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
        names = folder.names
        lists = _lists(names)
        columns = index.columns if index is not None else None
        if columns is not None and names == columns.names:  # the index's own order: nearly always
            rows = np.arange(len(paths), dtype=np.int64)
            rows[lists] = -1
            if paths.names is names:  # a local folder's: the index's strings, not a copy of each
                paths = Paths(paths.prefixes, paths.place, columns.names)
        elif columns is not None:
            found = columns.rows()
            rows = np.fromiter(map(found.get, names, itertools.repeat(-1)), np.int64, len(paths))
            rows[lists] = -1
        else:
            rows = np.full(len(paths), -1, np.int64)
        unindexed = np.flatnonzero((rows < 0) & ~lists)
        if index is not None and len(unindexed):
            _LOG.warning(
                "%s: %s not in its index.json, read without its facts (a copy, or added after the index? run "
                "`seqshard index` on the folder)",
                folder.name,
                counted(len(unindexed), "selected shard", "is"),
            )
        numbers = {f: np.full(len(paths), -1, np.int64) for f in ("bytes", "num_utts", "num_frames")}
        indexed = rows >= 0
        if columns is not None:
            for f in numbers:
                numbers[f][indexed] = columns.numbers[f][rows[indexed]]
        for shard in np.flatnonzero(lists).tolist():  # a raw list, read as a shard of its lines
            path = paths[shard]
            scan = scan_manifest if is_manifest_name(path) else scan_list
            numbers["bytes"][shard], numbers["num_utts"][shard] = Path(path).stat().st_size, scan(Path(path))
        for shard in unindexed.tolist():
            path = paths[shard]
            numbers["bytes"][shard] = self.access.size(path) if remote.is_remote(path) else Path(path).stat().st_size
        if columns is not None and remote.is_remote(folder.name):  # what the cache checks its copies against
            for shard in np.flatnonzero(indexed).tolist():
                entry = columns.entry(int(rows[shard]))
                self.access.expected[paths[shard]] = (entry.bytes, entry.checksum)
                for car in entry.sidecars.values():
                    self.access.expected[f"{folder.name}/{car.name}"] = (car.bytes, car.checksum)
        sources = [(folder.name, columns)] if columns is not None else []
        where = np.where(indexed, 0, -1).astype(np.int32)
        self.parts.append(Shards(paths, numbers, ~lists & escaped, lists, rows, where, sources))
        self.lengths.append((columns, rows))


def _name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _lists(names: list[str]) -> np.ndarray:
    """Which of ``names`` are lists read as shards (:func:`~.patterns.is_list_name`)."""
    if not any(suffix in "\0".join(names) for suffix in LIST_SUFFIXES):
        return np.zeros(len(names), bool)
    return np.fromiter(map(is_list_name, names), bool, len(names))


def _refuse_copies(shards: Shards, access: RemoteAccess) -> None:
    """Refuse two selected files that are one shard (a copied folder selected with its
    original): their samples would be read twice each epoch. Only files of equal size are
    compared, by their index's CRC-32 when every one of them is indexed, else by their first
    sample (key and bytes, one small read each)."""
    sizes = shards.numbers["bytes"]
    candidates = np.flatnonzero(~shards.listed)
    _, inverse, counts = np.unique(sizes[candidates], return_inverse=True, return_counts=True)
    shared = counts[inverse] > 1
    if not shared.any():
        return
    checksums = shards.checksums(candidates[shared])
    order = np.argsort(inverse[shared], kind="stable")
    groups = np.split(candidates[shared][order], np.flatnonzero(np.diff(inverse[shared][order])) + 1)
    for group in sorted(groups, key=lambda g: int(g[0])):  # in the order their first shard comes
        marks = checksums[group].tolist()
        indexed = all(marks)
        if indexed and len(set(marks)) == len(marks):
            continue  # no two alike
        members = group.tolist()
        seen: dict[Any, str] = {}
        for shard in members:
            path = shards.paths[shard]
            mark = checksums[shard] if indexed else _first_sample_mark(path, access)
            if mark is None:
                continue
            first = seen.setdefault(mark, path)
            if first != path:
                raise ConfigError(
                    f"{first} and {path} are copies of one shard (the same size and "
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
    """The shards a loader reads, with dataset facts gathered from their indexes. ``shards``
    may be given as :class:`ShardInfo` objects (made into :class:`Shards`)."""

    shards: Shards
    dim: int | None = None
    frame_shift_ms: float = 10.0
    length_hist: tuple[tuple[int, int], ...] = ()
    missing: tuple[MissingShard, ...] = ()  # selected but not on disk (see formats/selection.py)
    field_sets: tuple[tuple[str, tuple[str, ...]], ...] = ()  # set -> member suffixes, from the indexes
    shar: bool = False  # the shards are Lhotse Shar folders' (read whole by default, as lhotse reads them)
    layouts: tuple[tuple[str, str, tuple[int, ...]], ...] = ()  # added array fields: (set, dtype, shape after T)
    lengths: ShardLengths = field(default_factory=lambda: ShardLengths.of([]), compare=False)  # each shard's

    def __post_init__(self) -> None:
        if not isinstance(self.shards, Shards):
            object.__setattr__(self, "shards", Shards.of(tuple(self.shards)))

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
            gathered.add_folder(folder)
        if len(gathered.dims) > 1:
            raise ConfigError(
                f"the shards mix feature dimensions: {', '.join(f'{d} in {f}' for d, f in gathered.dims.items())}."
            )
        shards = Shards.concat(gathered.parts) if gathered.parts else Shards.of(())
        _refuse_copies(shards, access)
        lengths, histogram = ShardLengths.of_rows(gathered.lengths)
        return cls(
            shards,
            next(iter(gathered.dims), None),
            gathered.shift,
            histogram,
            tuple(missing),
            tuple((name, tuple(suffixes)) for name, suffixes in gathered.field_sets.items()),
            is_shar_table(shards.paths),  # type: ignore[arg-type]
            tuple((name, dtype, shape) for name, (dtype, shape) in gathered.layouts.items()),
            lengths,
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
            Shards.concat([t.shards for t in tables]),
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
        return bool((self.shards.numbers["num_utts"] >= 0).all())

    @property
    def num_utts(self) -> int | None:
        return int(self.shards.numbers["num_utts"].sum()) if self.indexed else None

    def sizes(self) -> np.ndarray:
        """Each shard's utterances (int64; -1 where its index does not say)."""
        return self.shards.numbers["num_utts"]

    def fingerprint(self) -> str:
        """Identifies the shard list (names and sizes) for checking a saved loader state."""
        return self.shards.fingerprint()

    def weights(self) -> np.ndarray:
        """Work per shard: frames when every shard's are known, bytes otherwise."""
        frames = self.shards.numbers["num_frames"]
        if self.indexed and (frames != 0).all() and (frames >= 0).all():
            return frames.astype(np.float64)
        return self.shards.numbers["bytes"].astype(np.float64)


REPLACED = (  # what a reader and `seqshard verify` say of a file whose keys are not those its index records
    "the file was replaced (by a copy of another shard?). Fix: restore it; if it was replaced on purpose, "
    "rebuild the index with `seqshard index`"
)


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
