"""The per-folder shard index (``index.json``): what each shard holds and how to check it.

Per shard: name, utterance count, total frames, byte size, CRC-32, its first and last key
(what readers check a file against when they open and finish it: a shard replaced by a copy
of another is caught) and a histogram of utterance lengths (8 log-spaced bins per octave, so
percentiles are known to about 4% without storing every length). Dataset facts: feature
field, dim, dtype, frame shift, and how and when the folder was made. The loader plans from it
(balanced assignment, epoch length); ``verify`` checks shards against it. Fields added later
are optional: older readers ignore them and older indexes (without keys) load, unchecked.

Field sets: a shard's members are its main field set; ``seqshard add-field`` adds a field set
``NAME`` as a sidecar shard per shard, ``fields/NAME/data-00042.tar`` for ``data-00042.tar``
(in a sub-folder, so that no glob of the shards such as ``data-*.tar`` selects it), holding
the same keys in the same order. Folders made before that have ``data-00042.NAME.tar`` beside
the shard: still read, and moved by ``seqshard index --move-sidecars``. The index lists each
field set, with each sidecar's size, checksum and keys under its shard's entry (format
version 2; version 1 has no field sets).

Names read from data never point outside their folder: loading an index refuses a shard name
that is not a plain file name and a sidecar name other than the two layouts above
(:func:`check_name`); writers check the real path too (``files.inside``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..checks import number_problem, read_number, shown
from ..errors import SeqshardError
from .files import json_bytes, read_json, write_atomic, writing
from .inflation import inflation_limit
from .patterns import FIELD_SET_NAME, FIELDS_DIR, INDEX_NAME, INDEX_TABLE_NAME, shard_stem

if TYPE_CHECKING:
    from .index_table import ShardColumns

FORMAT = "seqshard-index"
VERSION = 2  # written only when the folder has field sets; version 1 otherwise
BINS_PER_OCTAVE = 8


def sidecar_name(shard_name: str, field_set: str) -> str:
    """The file of field set ``field_set`` of shard ``shard_name``, relative to the shard's
    folder: ``fields/NAME/STEM.tar``."""
    return f"{FIELDS_DIR}/{field_set}/{shard_stem(shard_name)}.tar"


def old_sidecar_name(shard_name: str, field_set: str) -> str:
    """Where ``add-field`` put that file before: ``STEM.NAME.tar`` beside the shard."""
    return f"{shard_stem(shard_name)}.{field_set}.tar"


def check_name(name: Any, where: str | Path, what: str, fix: str) -> str:
    """``name``, read from data (an index, a pack's plan), if it is a plain file name: a
    non-empty string without ``/``, ``\\`` or NUL, other than ``.`` and ``..``, so that it
    cannot point outside its folder. Else a SeqshardError naming ``where``, ``what`` and ``fix``."""
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise SeqshardError(
            f"{where}: {what} is named {name!r}, not a plain file name: it could point outside its folder. {fix}"
        )
    return name


def length_bin(frames: int) -> int:
    """Histogram bin of an utterance of ``frames`` frames (frames >= 1)."""
    return math.floor(math.log2(max(frames, 1)) * BINS_PER_OCTAVE + 1e-9)


def bin_bounds(index: int) -> tuple[float, float]:
    """Lengths covered by a bin: ``[low, high)``."""
    return bin_length(index), bin_length(index + 1)


def bin_length(position: Any) -> Any:
    """The length ``position`` bins up (a bin's low end at its index, its geometric middle,
    which stands for its utterances, at index + 0.5); elementwise over numpy arrays."""
    return 2 ** (position / BINS_PER_OCTAVE)


def merge_histograms(histograms: Iterable[dict[int, int]]) -> dict[int, int]:
    total: dict[int, int] = {}
    for histogram in histograms:
        for index, count in histogram.items():
            total[index] = total.get(index, 0) + count
    return dict(sorted(total.items()))


def histogram_percentile(histogram: dict[int, int], q: float) -> float:
    """Length at percentile ``q`` (0-100), interpolated geometrically inside its bin."""
    total = sum(histogram.values())
    if total == 0:
        return 0.0
    target = q / 100 * total
    seen = 0
    for index in sorted(histogram):
        count = histogram[index]
        if seen + count >= target:
            return bin_length(index + ((target - seen) / count if count else 0.0))
        seen += count
    return bin_bounds(max(histogram))[1]


@dataclass
class SidecarEntry:
    """The file of one field set of a shard (``name`` relative to the shard's folder)."""

    name: str
    bytes: int
    checksum: str
    first_key: str | None = None  # None in indexes written before keys were recorded
    last_key: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> SidecarEntry:
        """The entry read from an index (ValueError naming the field that is not what it must be)."""
        entry = _mapping(entry, "a sidecar")
        return cls(
            _text(entry, "name"),
            _count("bytes", entry.get("bytes"), MAX_BYTES),
            _text(entry, "checksum"),
            _text(entry, "first_key", optional=True),
            _text(entry, "last_key", optional=True),
        )


@dataclass
class FieldSet:
    """A field set added beside the shards: its member suffixes and where it came from."""

    fields: list[str]
    source: str = ""
    created: str = ""
    allow_missing: bool = False
    digest: str = ""  # of the source's kind and content: adding the same again changes nothing
    layout: dict[str, Any] = field(default_factory=dict)  # an array field's {"dtype", "shape"} (after its first axis)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FieldSet:
        """The field set read from an index (ValueError naming the field that is not what it must be)."""
        data = _mapping(data, "a field set")
        layout = _mapping(data.get("layout") or {}, "its layout")
        if layout:
            shape = layout.get("shape")
            if not isinstance(layout.get("dtype"), str) or not isinstance(shape, list):
                raise ValueError(f'its layout is {shown(layout)}, not {{"dtype": "NAME", "shape": [SIZE, ...]}}')
            for size in shape:
                read_number("a size in its layout's shape", size, whole=True, at_least=0, at_most=MAX_COUNT)
            try:
                np.dtype(layout["dtype"])
            except TypeError:
                raise ValueError(f"its layout's dtype is {shown(layout['dtype'])}, not a numpy dtype") from None
        return cls(
            _texts(data, "fields"),
            _text(data, "source", default=""),
            _text(data, "created", default=""),
            _flag(data, "allow_missing"),
            _text(data, "digest", default=""),
            dict(layout),
        )


@dataclass
class ShardEntry:
    """One shard of a folder."""

    name: str
    num_utts: int
    num_frames: int
    bytes: int
    checksum: str
    length_hist: dict[int, int] = field(default_factory=dict)
    min_frames: int | None = None  # exact, for percentiles clamped to the real range
    max_frames: int | None = None
    sidecars: dict[str, SidecarEntry] = field(default_factory=dict)  # field set -> its file
    first_key: str | None = None  # as stored (escaped keys escaped); None in older indexes
    last_key: str | None = None

    def to_json(self) -> dict[str, Any]:
        entry = asdict(self)
        entry["length_hist"] = {str(k): v for k, v in sorted(self.length_hist.items())}
        entry["sidecars"] = {name: car.to_json() for name, car in self.sidecars.items()}
        return {k: v for k, v in entry.items() if (v is not None and v != {}) or k == "length_hist"}

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> ShardEntry:
        """The entry read from an index or a pack journal: every number checked (a whole number,
        in range, and consistent: no more utterances than the shard's bytes can hold, frames
        between the shortest and longest length times the count); ValueError naming the field."""
        entry = _mapping(entry, "a shard entry")
        name = entry.get("name")
        size = _count("bytes", entry.get("bytes"), MAX_BYTES)
        most = min(MAX_LENGTH, max_samples(name if isinstance(name, str) else "", size))
        utts = _count("num_utts", entry.get("num_utts"), most)
        frames = _count("num_frames", entry.get("num_frames"))
        shortest, longest = (
            None if entry.get(f) is None else _count(f, entry[f], MAX_LENGTH) for f in ("min_frames", "max_frames")
        )
        histogram = {}
        for bin_, count in _mapping(entry.get("length_hist", {}), "its length_hist").items():
            if not isinstance(bin_, str) or not bin_.isdecimal() or int(bin_) > MAX_BIN:
                raise ValueError(f"length_hist has a bin {shown(bin_)}, not a number from 0 to {MAX_BIN}")
            histogram[int(bin_)] = _count(f"length_hist[{bin_!r}]", count, utts)
        measured = sum(histogram.values())  # the utterances whose length is known
        if measured > utts:
            raise ValueError(f"length_hist counts {measured} utterances where num_utts is {utts}")
        if (
            shortest is not None
            and longest is not None
            and not (shortest <= longest and measured * shortest <= frames <= measured * longest)
        ):
            raise ValueError(
                f"num_frames {frames}, min_frames {shortest} and max_frames {longest} do not fit {measured} utterances"
            )
        return cls(
            name=name,  # type: ignore[arg-type]  # checked by check_names
            num_utts=utts,
            num_frames=frames,
            bytes=size,
            checksum=_text(entry, "checksum"),
            length_hist=histogram,
            min_frames=shortest,
            max_frames=longest,
            sidecars={
                k: SidecarEntry.from_json(v) for k, v in _mapping(entry.get("sidecars", {}), "its sidecars").items()
            },
            first_key=_text(entry, "first_key", optional=True),
            last_key=_text(entry, "last_key", optional=True),
        )

    def check_names(self, where: str | Path, number: int, fix: str) -> None:
        """Refuse a name that could point outside the folder (see the module docstring):
        ``where`` is the index file, ``number`` the entry's position in it."""
        what = f"shard entry {number}"
        check_name(self.name, where, what, fix)
        for field_set, car in self.sidecars.items():
            if not FIELD_SET_NAME.fullmatch(field_set):
                raise SeqshardError(f"{where}: {what} ({self.name}) has a field set named {field_set!r}. {fix}")
            if car.name not in (sidecar_name(self.name, field_set), old_sidecar_name(self.name, field_set)):
                raise SeqshardError(
                    f"{where}: {what} ({self.name}) puts its field set {field_set!r} in {car.name!r}, not in "
                    f"{sidecar_name(self.name, field_set)!r} where add-field writes it. {fix}"
                )


MAX_BYTES = 1 << 56  # a size in bytes beyond this is not a file's
MAX_COUNT = 1 << 53  # counts of utterances and frames beyond this are not a dataset's
MAX_LENGTH = (1 << 31) - 1  # an utterance's length and a shard's utterance count are int32 wherever they are kept
MAX_BIN = 31 * BINS_PER_OCTAVE - 1  # the bin of a length of MAX_LENGTH frames


def max_samples(name: str, size: int) -> int:
    """The most samples a shard file ``name`` of ``size`` bytes can hold: each has a 512-byte
    tar header (a gzip'd shard inflates within the rule of ``inflation.py``)."""
    if name.endswith((".gz", ".tgz")):
        size = inflation_limit(size, capped=False)
    return size // 512


def _count(field: str, value: Any, at_most: int = MAX_COUNT) -> int:
    """A whole number from 0 to ``at_most`` read from an index (NumberError naming ``field``)."""
    if type(value) is int and 0 <= value <= at_most:  # nearly every number: checked without a call (500,000 shards)
        return value
    return int(read_number(field, value, whole=True, at_least=0, at_most=at_most))  # type: ignore[arg-type]


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} is {shown(value)}, not a JSON object")
    return value


def _text(data: dict[str, Any], field: str, optional: bool = False, default: str | None = None) -> Any:
    """``data[field]``, a string (None when ``optional`` and absent; ``default`` when given and absent)."""
    value = data.get(field, default)
    if isinstance(value, str) or (value is None and optional):
        return value
    raise ValueError(f"{field} is {shown(value)}, not a string")


def _texts(data: dict[str, Any], field: str) -> list[str]:
    value = data.get(field, [])
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"{field} is {shown(value)}, not a list of strings")
    return list(value)


def _flag(data: dict[str, Any], field: str) -> bool:
    value = data.get(field, False)
    if not isinstance(value, bool):
        raise ValueError(f"{field} is {shown(value)}, not true or false")
    return value


@dataclass
class ShardIndex:
    """Everything ``index.json`` says about one folder of shards.

    An index loaded from a folder holds its entries as arrays (:attr:`columns`, what loaders
    read); ``shards``, the entries as objects, are made from them on first use and are then
    what the index holds (a tool changes them and saves)."""

    shards: list[ShardEntry]
    feature: dict[str, Any] = field(default_factory=dict)  # field, dim, dtype, frame_shift_ms
    created: str = ""
    created_by: str = ""
    source: dict[str, Any] = field(default_factory=dict)
    escaped_keys: bool = False  # keys were percent-encoded by `pack --escape-keys`
    fields: list[str] = field(default_factory=list)  # member suffixes of the shards, when known
    field_sets: dict[str, FieldSet] = field(default_factory=dict)  # sidecar field sets by name
    _by_name: dict[str, ShardEntry] = field(default_factory=dict, init=False, repr=False, compare=False)
    _columns: ShardColumns | None = field(default=None, init=False, repr=False, compare=False)

    def __getattr__(self, name: str) -> Any:
        if name == "shards" and self.__dict__.get("_columns") is not None:  # an index read as columns
            self.shards = self._columns.entries()  # type: ignore[union-attr]
            return self.shards
        raise AttributeError(name)

    @property
    def columns(self) -> ShardColumns:
        """The entries as arrays (made from ``shards`` on first use when the index was made of them)."""
        if self._columns is None:
            from .index_table import ShardColumns

            self._columns = ShardColumns.of(self.shards)
        return self._columns

    @property
    def _as_columns(self) -> bool:
        return "shards" not in self.__dict__

    @property
    def num_utts(self) -> int:
        return int(self.columns.numbers["num_utts"].sum()) if self._as_columns else sum(s.num_utts for s in self.shards)

    @property
    def num_frames(self) -> int:
        if self._as_columns:
            return int(self.columns.numbers["num_frames"].sum())
        return sum(s.num_frames for s in self.shards)

    @property
    def bytes(self) -> int:
        return int(self.columns.numbers["bytes"].sum()) if self._as_columns else sum(s.bytes for s in self.shards)

    def entry(self, name: str) -> ShardEntry | None:
        """The entry of shard ``name``, or None."""
        if self._as_columns:
            row = self.columns.row(name)
            return None if row is None else self.columns.entry(row)
        if len(self._by_name) != len(self.shards):
            self._by_name = {shard.name: shard for shard in self.shards}
        return self._by_name.get(name)

    def sidecar_names(self) -> frozenset[str]:
        """File names of every sidecar listed (they are field files, not shards)."""
        if self._as_columns:
            return self.columns.sidecar_names()
        return frozenset(car.name for shard in self.shards for car in shard.sidecars.values())

    def to_json(self) -> dict[str, Any]:
        return {**self._header(), "shards": [s.to_json() for s in self.shards]}

    def _header(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION if self.field_sets else 1,
            "created": self.created,
            "created_by": self.created_by,
            "feature": self.feature,
            "totals": {
                "num_shards": len(self.columns) if self._as_columns else len(self.shards),
                "num_utts": self.num_utts,
                "num_frames": self.num_frames,
                "bytes": self.bytes,
            },
            "source": self.source,
            "keys": {"escaped": self.escaped_keys},
            "fields": self.fields,
            **({"field_sets": {name: asdict(fs) for name, fs in self.field_sets.items()}} if self.field_sets else {}),
        }

    def save(self, folder: str | Path) -> Path:
        """Write ``folder/index.json`` atomically (temporary name, then rename), with its
        compact table ``index.npz`` when it lists :data:`~.index_table.TABLE_FROM` shards or
        more (``index_table.py``; a table left by an earlier index is removed otherwise)."""
        from .index_table import TABLE_FROM, ShardColumns, write_table

        path, table = Path(folder) / INDEX_NAME, Path(folder) / INDEX_TABLE_NAME
        data = self.to_json()
        text = json_bytes(data)
        if len(self.shards) >= TABLE_FROM:
            columns, header = ShardColumns.of(self.shards), self._header()
            digest = hashlib.sha256(text).hexdigest()
            write_atomic(table, lambda stream: write_table(stream, columns, header, digest))
        elif table.is_file() and not table.is_symlink():  # stale now (a link is left alone: stale too)
            with writing(table):
                table.unlink()
        write_atomic(path, lambda stream: stream.write(text))
        self._columns = None  # the entries may change after this: columns are made again from them
        return path

    @classmethod
    def load(cls, folder: str | Path) -> ShardIndex | None:
        """The index of ``folder``, or None when it has none: from its compact table when
        that goes with its index.json (``index_table.py``), else from the index.json."""
        from .index_table import json_digest, read_table

        path = Path(folder) / INDEX_NAME
        rebuild = f"seqshard index {folder}"
        if (Path(folder) / INDEX_TABLE_NAME).is_file() and (digest := json_digest(path)) is not None:
            found = read_table(Path(folder) / INDEX_TABLE_NAME, digest)
            if found is not None:
                header, columns = found
                return cls.from_json({**header, "shards": []}, path, rebuild)._as(columns)
        data = read_json(path, f"rebuild it with `{rebuild}`.", None)
        return None if data is None else cls.from_json(data, path, rebuild)

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str | Path, rebuild: str) -> ShardIndex:
        """The index parsed from ``data`` (read from ``where``; ``rebuild`` is the command
        that rebuilds it, for the message when it is not an index). Its entries are checked
        in bulk (``index_table.ShardColumns.from_json``), and one by one when that finds
        anything out of place, for the error that names the entry."""
        from .index_table import ShardColumns

        version = data.get("version", 0) if isinstance(data, dict) else None
        if (
            not isinstance(data, dict)
            or data.get("format") != FORMAT
            or number_problem(version, whole=True)
            or version > VERSION
        ):
            raise SeqshardError(f"{where}: not a seqshard index of version <= {VERSION}. Rebuild it with `{rebuild}`.")
        fix = f"The index was not written by seqshard, or was altered: rebuild it with `{rebuild}`."
        given = data.get("shards") if isinstance(data.get("shards"), list) else [None]
        columns = ShardColumns.from_json(given)
        shards = [] if columns is not None else _entries(given, where, fix)
        try:
            field_sets = {
                k: FieldSet.from_json(v) for k, v in _mapping(data.get("field_sets", {}), "field_sets").items()
            }
            feature = _feature_facts(_mapping(data.get("feature", {}), "feature"))
            keys = _mapping(data.get("keys", {}), "keys")
            escaped, fields = _flag(keys, "escaped"), _texts(data, "fields")
            source = _mapping(data.get("source", {}), "source")
        except ValueError as error:
            raise SeqshardError(f"{where}: {error}. {fix}") from None
        for name in field_sets:
            if not FIELD_SET_NAME.fullmatch(name):
                raise SeqshardError(f"{where}: a field set is named {name!r}. {fix}")
        index = cls(
            shards=shards,
            feature=feature,
            created=str(data.get("created", "")),
            created_by=str(data.get("created_by", "")),
            source=source,
            escaped_keys=escaped,
            fields=fields,
            field_sets=field_sets,
        )
        return index if columns is None else index._as(columns)

    def _as(self, columns: ShardColumns) -> ShardIndex:
        """This index with ``columns`` as its entries (made into ``shards`` on first use)."""
        self.__dict__.pop("shards", None)
        self._columns = columns
        return self


def _entries(given: list[Any], where: str | Path, fix: str) -> list[ShardEntry]:
    """The entries of an index's ``shards``, one by one: SeqshardError naming the first that
    breaks a rule (its number, its name, the field) and ``fix``."""
    shards = []
    for number, entry in enumerate(given):
        try:
            shards.append(ShardEntry.from_json(entry))
        except ValueError as error:
            name = f" ({entry['name']})" if isinstance(entry, dict) and isinstance(entry.get("name"), str) else ""
            raise SeqshardError(f"{where}: shard entry {number}{name}: {error}. {fix}") from None
        shards[-1].check_names(where, number, fix)
    return shards


def _feature_facts(feature: dict[str, Any]) -> dict[str, Any]:
    """An index's ``feature`` facts with the numbers loaders use checked: ``dim`` (a whole
    number >= 1) and ``frame_shift_ms`` (a number > 0), each or None; names are strings."""
    checked = dict(feature)
    rules = {"dim": dict(whole=True, at_least=1, at_most=MAX_COUNT), "frame_shift_ms": dict(above=0, at_most=1e6)}
    for name, rule in rules.items():
        if name in feature:
            checked[name] = read_number(f"feature {name}", feature[name], optional=True, **rule)  # type: ignore[arg-type]
    for name in ("field", "dtype", "kind"):
        _text(feature, name, optional=True)
    return checked
