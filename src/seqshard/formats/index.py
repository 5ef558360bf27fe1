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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checks import number_problem, read_number
from ..errors import SeqshardError
from .files import json_bytes, read_json, write_atomic, writing
from .index_entries import (
    MAX_DIM,
    FieldSet,
    ShardEntry,
    as_mapping,
    flag_field,
    text_field,
    texts_field,
)
from .patterns import FIELD_SET_NAME, INDEX_NAME, INDEX_TABLE_NAME

if TYPE_CHECKING:
    from .index_table import ShardColumns

FORMAT = "seqshard-index"
VERSION = 2  # written only when the folder has field sets; version 1 otherwise


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
                k: FieldSet.from_json(v) for k, v in as_mapping(data.get("field_sets", {}), "field_sets").items()
            }
            feature = _feature_facts(as_mapping(data.get("feature", {}), "feature"))
            keys = as_mapping(data.get("keys", {}), "keys")
            escaped, fields = flag_field(keys, "escaped"), texts_field(data, "fields")
            source = as_mapping(data.get("source", {}), "source")
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
    rules = {"dim": dict(whole=True, at_least=1, at_most=MAX_DIM), "frame_shift_ms": dict(above=0, at_most=1e6)}
    for name, rule in rules.items():
        if name in feature:
            checked[name] = read_number(f"feature {name}", feature[name], optional=True, **rule)  # type: ignore[arg-type]
    for name in ("field", "dtype", "kind"):
        text_field(feature, name, optional=True)
    return checked
