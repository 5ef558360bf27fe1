"""A folder's shards as arrays (:class:`ShardColumns`): what a loader needs of an index of
500,000 shards without an object, a dict and a check call a shard. Read from ``index.json``
with every number checked in bulk, or from the compact table ``index.npz`` beside it.

Why a second file: parsing an ``index.json`` of 5 x 10^5 entries takes ~9 s and ~550 MB on a
loaded 2-core machine (json's dicts, strings and ints, about 1 KB a shard) before a number is
checked, and a rank must start in at most 10 s and 1 GB. ``index.npz`` (an uncompressed numpy
archive, written with the index of every folder of :data:`TABLE_FROM` shards or more) holds
the same entries as arrays: numbers as int64 arrays, names, checksums and keys as one text
each with where each ends, histograms as one array of bins and one of counts. It records the
SHA-256 of the ``index.json`` written with it and is read only when that matches (an
``index.json`` edited or rewritten by another tool since makes it stale: ignored), and its
values pass the same rules as the JSON's (anything out of place, and ``index.json`` is read
instead, whose errors name the entry). ``index.json`` stays the format others read and write.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .index_entries import (
    MAX_BIN,
    MAX_BYTES,
    MAX_COUNT,
    MAX_LENGTH,
    ShardEntry,
    SidecarEntry,
    max_samples,
    old_sidecar_name,
    sidecar_name,
)
from .patterns import FIELD_SET_NAME

_LOG = logging.getLogger("seqshard")
TABLE_FROM = 1000  # shards in a folder from which its index gets a table
TABLE_FORMAT = 1
_BIN_OF = {str(b): b for b in range(MAX_BIN + 1)}  # a histogram's bins as seqshard writes them
_NUMBERS = ("num_utts", "num_frames", "bytes", "min_frames", "max_frames")  # int64 arrays; -1: not recorded
_TEXTS = ("checksum", "first_key", "last_key")
_CAR_TEXTS = ("name", "checksum", "first_key", "last_key")
_NO_CAR = {"bytes": 0}  # a shard without a sidecar of a field set
_HEADERS: dict[tuple[int, int], Any] = {}  # .npy header readers by version


@dataclass(frozen=True, eq=False)
class Texts:
    """Strings (or None) as one text and the character offset where each ends."""

    text: str
    ends: np.ndarray  # int64
    absent: np.ndarray | None = None  # bool: None there

    @classmethod
    def of(cls, values: Sequence[str | None]) -> Texts:
        absent = np.fromiter((value is None for value in values), bool, len(values)) if None in values else None
        strings = values if absent is None else [value or "" for value in values]
        ends = np.cumsum(np.fromiter(map(len, strings), np.int64, len(strings)))  # type: ignore[arg-type]
        return cls("".join(strings), ends, absent)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, row: int) -> str | None:
        if self.absent is not None and self.absent[row]:
            return None
        return self.text[int(self.ends[row - 1]) if row else 0 : int(self.ends[row])]

    def take(self, rows: np.ndarray) -> list[str | None]:
        """The strings of ``rows``: each cut out, or all made once when they are many."""
        if len(rows) * 8 < len(self):
            return [self[row] for row in rows.tolist()]
        every = self.tolist()
        return [every[row] for row in rows.tolist()]

    def tolist(self) -> list[str | None]:
        ends = self.ends.tolist()
        found = list(map(self.text.__getitem__, map(slice, [0, *ends[:-1]], ends)))
        if self.absent is not None:
            for row in np.flatnonzero(self.absent).tolist():
                found[row] = None
        return found

    def arrays(self, prefix: str) -> dict[str, np.ndarray]:
        arrays = {f"{prefix}.text": np.frombuffer(self.text.encode("utf-8"), np.uint8), f"{prefix}.ends": self.ends}
        return arrays | ({f"{prefix}.absent": self.absent} if self.absent is not None else {})

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], prefix: str, rows: int, optional: bool) -> Texts | None:
        """The texts stored under ``prefix``, or None when they are not what :meth:`arrays` writes."""
        try:
            text = arrays[f"{prefix}.text"].tobytes().decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            return None
        ends, absent = arrays.get(f"{prefix}.ends"), arrays.get(f"{prefix}.absent")
        if not _shaped(ends, np.int64, rows) or (absent is not None and not (optional and _shaped(absent, bool, rows))):
            return None
        steps = np.diff(ends, prepend=0)  # type: ignore[arg-type]
        if (rows and int(ends[-1]) != len(text)) or (not rows and text) or (steps < 0).any():  # type: ignore[index]
            return None
        return cls(text, ends, absent)  # type: ignore[arg-type]


@dataclass(frozen=True, eq=False)
class SidecarColumns:
    """One field set's sidecar of each shard (``present``: the shard lists one)."""

    present: np.ndarray  # bool
    bytes: np.ndarray  # int64, 0 where absent
    texts: dict[str, Texts]  # name, checksum, first_key, last_key

    def entry(self, row: int) -> SidecarEntry | None:
        if not self.present[row]:
            return None
        name, checksum, first, last = (self.texts[key][row] for key in _CAR_TEXTS)
        return SidecarEntry(name, int(self.bytes[row]), checksum, first, last)  # type: ignore[arg-type]


@dataclass(eq=False)
class ShardColumns:
    """The shard entries of an index as arrays; ``numbers[f][row]`` is entry ``row``'s ``f``
    (-1 for ``min_frames``/``max_frames`` not recorded); histograms as CSR: entry ``row``'s
    bins are ``bins[at[row]:at[row + 1]]`` with their ``counts``."""

    names: list[str]
    numbers: dict[str, np.ndarray]  # _NUMBERS, int64
    at: np.ndarray  # int64, rows + 1
    bins: np.ndarray  # int16
    counts: np.ndarray  # int32 (each at most a shard's count: MAX_LENGTH)
    texts: dict[str, Texts]  # _TEXTS
    sidecars: dict[str, SidecarColumns] = field(default_factory=dict)  # by field set
    _rows: dict[str, int] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.names)

    def __getstate__(self) -> dict[str, Any]:  # pickled to spawned workers: the names as one text
        return {**self.__dict__, "names": Texts.of(self.names), "_rows": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, names=state["names"].tolist())

    def row(self, name: str) -> int | None:
        """The row of shard ``name`` (the last of that name, as a dict of the entries has it)."""
        if self._rows is None:
            self._rows = dict(zip(self.names, range(len(self.names))))
        return self._rows.get(name)

    def rows(self) -> dict[str, int]:
        self.row("")
        return self._rows  # type: ignore[return-value]

    def histogram(self, row: int) -> dict[int, int]:
        start, stop = int(self.at[row]), int(self.at[row + 1])
        return dict(zip(self.bins[start:stop].tolist(), self.counts[start:stop].tolist()))

    def entry(self, row: int) -> ShardEntry:
        utts, frames, size, shortest, longest = (int(self.numbers[f][row]) for f in _NUMBERS)
        checksum, first, last = (self.texts[f][row] for f in _TEXTS)
        cars = {name: car.entry(row) for name, car in self.sidecars.items()}
        return ShardEntry(
            self.names[row], utts, frames, size, checksum,  # type: ignore[arg-type]
            self.histogram(row), None if shortest < 0 else shortest, None if longest < 0 else longest,
            {name: car for name, car in cars.items() if car is not None}, first, last,
        )  # fmt: skip

    def entries(self) -> list[ShardEntry]:
        return [self.entry(row) for row in range(len(self))]

    def sidecar_names(self) -> frozenset[str]:
        return frozenset(n for car in self.sidecars.values() for n in car.texts["name"].tolist() if n is not None)

    @classmethod
    def of(cls, entries: Sequence[ShardEntry]) -> ShardColumns:
        """The columns of checked entries (each histogram's bins in order)."""
        hists = [sorted(entry.length_hist.items()) for entry in entries]
        flat = list(itertools.chain.from_iterable(hists))
        numbers = {
            f: np.array([-1 if (v := getattr(entry, f)) is None else v for entry in entries], np.int64).reshape(-1)
            for f in _NUMBERS
        }
        sets = dict.fromkeys(name for entry in entries for name in entry.sidecars)
        cars = {}
        for name in sets:
            found = [entry.sidecars.get(name) for entry in entries]
            texts = {key: Texts.of([getattr(car, key, None) for car in found]) for key in _CAR_TEXTS}
            sizes = np.array([car.bytes if car else 0 for car in found], np.int64).reshape(-1)
            cars[name] = SidecarColumns(np.array([car is not None for car in found], bool).reshape(-1), sizes, texts)
        return cls(
            [entry.name for entry in entries],
            numbers,
            np.cumsum([0, *map(len, hists)], dtype=np.int64),
            np.array([b for b, _ in flat], np.int16).reshape(-1),
            np.array([c for _, c in flat], np.int32).reshape(-1),
            {f: Texts.of([getattr(entry, f) for entry in entries]) for f in _TEXTS},
            cars,
        )

    @classmethod
    def from_json(cls, entries: Any) -> ShardColumns | None:
        """The columns of an index's ``shards`` when every entry is as seqshard writes it and
        passes the rules of :meth:`ShardEntry.from_json` and ``check_names``, checked in bulk;
        None when any is not (the caller then reads them one by one, for the error)."""
        if not isinstance(entries, list) or not _all(entries, dict):
            return None
        names = _column(entries, "name")
        size = _ints(_column(entries, "bytes"), MAX_BYTES)
        utts = _ints(_column(entries, "num_utts"), MAX_LENGTH)
        frames = _ints(_column(entries, "num_frames"), MAX_COUNT)
        shortest, longest = (
            _ints(_column(entries, f), MAX_LENGTH, optional=True) for f in ("min_frames", "max_frames")
        )
        hists = _column(entries, "length_hist", {})
        texts = {f: _column(entries, f) for f in _TEXTS}
        if (
            any(a is None for a in (size, utts, frames, shortest, longest))
            or not _all(names, str)
            or not _all(hists, dict)
            or not _all(texts["checksum"], str)
            or not all(_all(texts[f], (str, type(None))) for f in ("first_key", "last_key"))
        ):
            return None
        at = np.cumsum([0, *map(len, hists)], dtype=np.int64)
        bins = np.fromiter(
            map(_BIN_OF.get, itertools.chain.from_iterable(hists), itertools.repeat(-1)), np.int16, int(at[-1])
        )
        counts = _ints(list(itertools.chain.from_iterable(map(dict.values, hists))), MAX_LENGTH)
        if counts is None or (bins < 0).any():
            return None
        counts = counts.astype(np.int32)
        numbers = dict(zip(_NUMBERS, (utts, frames, size, shortest, longest)))
        columns = cls(names, numbers, at, bins, counts, {f: Texts.of(v) for f, v in texts.items()})  # type: ignore[arg-type]
        cars = _column(entries, "sidecars", {})
        if not _all(cars, dict):
            return None
        if any(cars):
            found = _sidecar_columns(cars)
            if found is None:
                return None
            columns.sidecars = found
        return columns if _problem(columns) is None else None

    # -- the compact table ----------------------------------------------------------------
    def arrays(self) -> dict[str, np.ndarray]:
        """What the compact table stores (see the module docstring)."""
        arrays = Texts.of(self.names).arrays("name") | {f: self.numbers[f] for f in _NUMBERS}
        arrays |= {"hist.at": self.at, "hist.bins": self.bins, "hist.counts": self.counts}
        for f, texts in self.texts.items():
            arrays |= texts.arrays(f)
        for number, (name, car) in enumerate(self.sidecars.items()):
            arrays |= {f"car{number}.set": _text_array(name), f"car{number}.present": car.present}
            arrays |= {f"car{number}.bytes": car.bytes}
            for key in _CAR_TEXTS:
                arrays |= car.texts[key].arrays(f"car{number}.{key}")
        return arrays

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> ShardColumns | None:
        """The columns a compact table stores, checked; None when anything is not as written."""
        first = arrays.get("num_utts")
        if not isinstance(first, np.ndarray) or first.ndim != 1:
            return None
        rows = len(first)
        names = Texts.from_arrays(arrays, "name", rows, optional=False)
        texts = {f: Texts.from_arrays(arrays, f, rows, optional=f != "checksum") for f in _TEXTS}
        if names is None or any(t is None for t in texts.values()):
            return None
        cars = {}
        for number in itertools.count():
            if f"car{number}.set" not in arrays:
                break
            present, size = arrays.get(f"car{number}.present"), arrays.get(f"car{number}.bytes")
            car_texts = {
                key: Texts.from_arrays(arrays, f"car{number}.{key}", rows, optional=True) for key in _CAR_TEXTS
            }
            name = _text_of(arrays[f"car{number}.set"])
            if name is None or present is None or size is None or any(t is None for t in car_texts.values()):
                return None
            cars[name] = SidecarColumns(present, size, car_texts)  # type: ignore[arg-type]
        numbers = {f: arrays.get(f) for f in _NUMBERS}
        hist = [arrays.get(f"hist.{f}") for f in ("at", "bins", "counts")]
        if any(not isinstance(a, np.ndarray) for a in [*numbers.values(), *hist]):
            return None
        columns = cls(names.tolist(), numbers, *hist, texts, cars)  # type: ignore[arg-type]
        return columns if _problem(columns) is None else None


# -- the rules of index entries, checked on the columns in bulk ------------------------------------


def _problem(columns: ShardColumns) -> str | None:
    """What breaks the rules of an index entry (``ShardEntry.from_json``, ``check_names``),
    in bulk; None when nothing does."""
    rows = len(columns.names)
    utts, frames, size, shortest, longest = (columns.numbers[f] for f in _NUMBERS)
    if any(not _shaped(columns.numbers[f], np.int64, rows) for f in _NUMBERS):
        return "numbers"
    if (utts < 0).any() or (frames < 0).any() or (size < 0).any() or (shortest < -1).any() or (longest < -1).any():
        return "a negative number"
    if (size > MAX_BYTES).any() or (frames > MAX_COUNT).any() or (np.maximum(shortest, longest) > MAX_LENGTH).any():
        return "a number out of range"
    most = np.minimum(size // 512, MAX_LENGTH)
    joined = "\0".join(columns.names)
    gzipped = ".gz\0" in joined + "\0" or ".tgz\0" in joined + "\0"
    for row in (r for r, name in enumerate(columns.names) if gzipped and name.endswith((".gz", ".tgz"))):
        most[row] = min(MAX_LENGTH, max_samples(columns.names[row], int(size[row])))
    if (utts > most).any():
        return "more utterances than the bytes hold"
    hist = _histogram_problem(columns, utts)
    if hist is not None:
        return hist
    measured = np.diff(np.concatenate([[0], np.cumsum(columns.counts)])[columns.at])
    both = (shortest >= 0) & (longest >= 0)
    fits = (shortest <= longest) & (measured * shortest <= frames) & (frames <= measured * longest)
    if (measured > utts).any() or (both & ~fits).any():
        return "lengths that do not fit"
    if any(len(texts) != rows for texts in columns.texts.values()) or columns.texts["checksum"].absent is not None:
        return "texts"
    return _names_problem(columns.names, joined) or _sidecars_problem(columns)


def _histogram_problem(columns: ShardColumns, utts: np.ndarray) -> str | None:
    rows = len(columns.names)
    if not _shaped(columns.at, np.int64, rows + 1) or columns.at[0] != 0 or (np.diff(columns.at) < 0).any():
        return "histogram rows"
    if not _shaped(columns.bins, np.int16, int(columns.at[-1])) or not _shaped(
        columns.counts, np.int32, len(columns.bins)
    ):
        return "histogram arrays"
    if len(columns.counts) * MAX_LENGTH >= 2**62:
        return "too many bins"
    if ((columns.bins < 0) | (columns.bins > MAX_BIN)).any() or (columns.counts < 0).any():
        return "a histogram bin or count out of range"
    if (columns.counts > np.repeat(utts, np.diff(columns.at))).any():
        return "a histogram count above its shard's"
    return None


def _sidecars_problem(columns: ShardColumns) -> str | None:
    rows = len(columns.names)
    for name, car in columns.sidecars.items():
        if not FIELD_SET_NAME.fullmatch(name) or not _shaped(car.present, bool, rows):
            return "a field set"
        if not _shaped(car.bytes, np.int64, rows) or (car.bytes < 0).any() or (car.bytes > MAX_BYTES).any():
            return "a sidecar's bytes"
        if any(len(car.texts[key]) != rows for key in _CAR_TEXTS):
            return "a sidecar's texts"
        for key in ("name", "checksum"):
            absent = car.texts[key].absent
            if absent is not None and (absent & car.present).any():
                return "a sidecar without a name or checksum"
        given = car.texts["name"].tolist()
        for row in np.flatnonzero(car.present).tolist():
            shard = columns.names[row]
            if given[row] not in (sidecar_name(shard, name), old_sidecar_name(shard, name)):
                return "a sidecar's name"
    return None


def _column(entries: list[dict[str, Any]], key: str, default: Any = None) -> list[Any]:
    return list(map(dict.get, entries, itertools.repeat(key), itertools.repeat(default)))


def _all(values: Iterable[Any], kinds: type | tuple[type, ...]) -> bool:
    """Whether every value's type is one of ``kinds`` exactly (a bool is no int)."""
    allowed = set(kinds) if isinstance(kinds, tuple) else {kinds}
    return set(map(type, values)) <= allowed


def _ints(values: list[Any], at_most: int, optional: bool = False) -> np.ndarray | None:
    """Whole numbers from 0 to ``at_most`` (None as -1 when ``optional``) as int64, or None."""
    if not _all(values, (int, type(None)) if optional else int):
        return None
    if optional:
        values = [-1 if value is None else value for value in values]
    try:
        array = np.array(values, np.int64).reshape(-1)
    except OverflowError:
        return None
    if array.size and (array.min() < (-1 if optional else 0) or array.max() > at_most):
        return None
    return array


def _shaped(array: Any, dtype: Any, rows: int) -> bool:
    return isinstance(array, np.ndarray) and array.dtype == dtype and array.shape == (rows,)


def _names_problem(names: list[str], joined: str) -> str | None:
    """Whether a name is not a plain file name (``index.check_name``), in bulk (``joined``:
    the names joined by NUL)."""
    if "/" in joined or "\\" in joined or joined.count("\0") != max(0, len(names) - 1):
        return "a name with / or \\ or NUL"
    if not {"", ".", ".."}.isdisjoint(names):
        return "a name that is a folder"
    return None


def _sidecar_columns(cars: list[dict[str, Any]]) -> dict[str, SidecarColumns] | None:
    """Each field set's sidecars of the entries' ``sidecars``, checked as
    ``SidecarEntry.from_json`` checks them; None when one is not as written."""
    found = {}
    for name in dict.fromkeys(itertools.chain.from_iterable(cars)):
        given = [car.get(name, _NO_CAR) for car in cars]
        if not _all(given, dict):
            return None
        present = np.fromiter((car is not _NO_CAR for car in given), bool, len(given))
        size = _ints(_column(given, "bytes"), MAX_BYTES)
        texts = {key: _column(given, key) for key in _CAR_TEXTS}
        if size is None or not _all(texts["name"], (str, type(None))) or not _all(texts["checksum"], (str, type(None))):
            return None
        if not all(_all(texts[key], (str, type(None))) for key in ("first_key", "last_key")):
            return None
        if any(texts["name"][row] is None or texts["checksum"][row] is None for row in np.flatnonzero(present)):
            return None
        found[name] = SidecarColumns(present, size, {key: Texts.of(values) for key, values in texts.items()})
    return found


def _text_array(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8)


def _text_of(array: np.ndarray) -> str | None:
    try:
        return array.tobytes().decode("utf-8") if array.dtype == np.uint8 and array.ndim == 1 else None
    except UnicodeDecodeError:
        return None


def json_digest(path: Path) -> str | None:
    """The SHA-256 of the file at ``path`` (read in pieces), or None when it cannot be read."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as stream:
            while piece := stream.read(1 << 20):
                digest.update(piece)
    except OSError:
        return None
    return digest.hexdigest()


def write_table(stream: BinaryIO, columns: ShardColumns, header: dict[str, Any], digest: str) -> None:
    """The compact table of ``columns``, with the index's other facts (``header``) and the
    SHA-256 of the ``index.json`` it goes with."""
    facts = {"format": TABLE_FORMAT, "index_sha256": digest, "header": header}
    np.savez(stream, facts=_text_array(json.dumps(facts, ensure_ascii=False)), **columns.arrays())


def read_table(path: Path, digest: str) -> tuple[dict[str, Any], ShardColumns] | None:
    """The index facts and columns of the compact table at ``path`` when it goes with the
    ``index.json`` of SHA-256 ``digest`` and holds what :func:`write_table` writes; else None."""
    arrays = _stored_arrays(path)
    facts = _text_of(arrays.pop("facts", np.zeros(0, np.int8))) if arrays is not None else None
    try:
        facts = json.loads(facts) if facts is not None else None
    except ValueError:
        facts = None
    if not isinstance(facts, dict) or facts.get("format") != TABLE_FORMAT or not isinstance(facts.get("header"), dict):
        return None
    if facts.get("index_sha256") != digest:
        _LOG.info("%s was written with another index.json: read index.json", path)
        return None
    columns = ShardColumns.from_arrays(arrays)  # type: ignore[arg-type]
    if columns is None:
        _LOG.info("%s does not hold what seqshard writes: read index.json", path)
        return None
    return facts["header"], columns


def _stored_arrays(path: Path) -> dict[str, np.ndarray] | None:
    """The arrays of the numpy archive at ``path`` when every member is stored uncompressed and
    holds the bytes its header declares (so that reading it takes no more than the file's
    size); None when it is not such an archive."""
    from numpy.lib import format as npy

    _HEADERS.update({(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0})
    arrays = {}
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.compress_type != zipfile.ZIP_STORED or not info.filename.endswith(".npy"):
                    return None
                with archive.open(info) as member:
                    header = _HEADERS.get(npy.read_magic(member))
                    if header is None:
                        return None
                    shape, fortran, dtype = header(member)
                    if dtype.hasobject or fortran or len(shape) != 1:
                        return None
                    size = shape[0] * dtype.itemsize
                    if size != info.file_size - member.tell():
                        return None
                    arrays[info.filename[: -len(".npy")]] = np.frombuffer(member.read(size), dtype)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError):
        return None
    return arrays
