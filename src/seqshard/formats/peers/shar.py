"""Lhotse Shar folders, read as one dataset: one sample per cut.

A Shar folder (written by lhotse's ``SharWriter``) holds, per shard ``K`` (``.000000``, ...;
nothing when the writer did not shard), the cuts ``cuts.K.jsonl.gz`` (one cut's JSON a line)
and one file per field, named after the field: ``NAME.K.tar`` holds, per cut and in the cuts'
order, its data ``CUTID.EXT`` (``.npy``, ``.llc``, ``.flac``, ...; ``.nodata`` when the cut
has none) followed by its manifest ``CUTID.json`` (``.nometa``); ``NAME.K.jsonl.gz`` holds
``{"cut_id": ..., "NAME": value}`` lines. That is seqshard's sidecar design: shard ``K`` is a
shard whose main file is its cuts file and whose field sets are its field files, read in lock
step (the reader checks that they name the same cut, and that they end together).

A sample is a cut: key = cut id, field ``cut`` (the cut's JSON), ``txt`` (the texts of its
supervisions in time order, joined by spaces), and per field file ``NAME`` (its data: an
array, encoded audio or a JSON value) and ``NAME_meta`` (its lhotse manifest). ``.nodata``
and ``.nometa`` members are absent fields. A Shar folder has no ``index.json``:
:func:`shar_index` gathers the same facts from its cuts (counts, and lengths from the cut
durations in frames of the features' shift, else of 10 ms), so that planning, splitting,
resuming and counting treat its shards as seqshard's own.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from ...checks import NumberError, read_number
from ...errors import ConfigError, InputError, ShardError, Where, redact
from ...protocol import Closing
from ..fields import NODATA
from ..index import ShardIndex
from ..index_entries import MAX_LENGTH, FieldSet, ShardEntry, SidecarEntry, length_bin
from ..inflation import BoundedLines, InflationError
from ..patterns import SHAR_CUTS
from ..remote.access import is_remote
from ..tar import OverTar, TarRecord, TarStream
from .lists import READ_ERROR_FIELD, carried_problem

CUTS = "cuts"  # what lhotse calls the cuts "field"; their files name the shards
FEATURES = "features"  # the field lhotse keeps features in: a Shar folder's feature field
SHAR_FORMAT = "lhotse-shar"  # ``source["format"]`` of the index made for a Shar folder
CUT_SUFFIX = "cut.json"  # the member suffix a cut's JSON is read under (field ``cut``)
TEXT_SUFFIX = "txt"
META = "_meta"  # NAME_meta: the manifest of field NAME
JSONL_EXTENSIONS = (".jsonl.gz", ".jsonl")
FIELD_FILE = re.compile(r"(?P<field>[^.]+)(?P<id>(?:\.[^.]+)*?)\.(?:tar|tar\.gz|jsonl|jsonl\.gz)")
DEFAULT_SHIFT_MS = 10.0
MAX_CUT_SECONDS = MAX_LENGTH * DEFAULT_SHIFT_MS / 1000  # 248 days: a length in 10 ms frames fits int32
OUT_OF_STEP_FIX = "write the field again with lhotse's SharWriter, in the order of the cuts"


def shar_field_of(path: str) -> str | None:
    """The field a file of a Shar folder holds (:data:`CUTS` for its cuts), or None when it is
    not one: cuts files by their name, field files by theirs and a cuts file of their shard
    beside them."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    if SHAR_CUTS.fullmatch(name):
        return CUTS
    match = FIELD_FILE.fullmatch(name)
    if match is None or match["field"] == CUTS or is_remote(path):
        return None
    folder = Path(path).parent
    beside = any((folder / f"{CUTS}{match['id']}{extension}").is_file() for extension in JSONL_EXTENSIONS)
    return match["field"] if beside else None


def is_shar_table(paths: list[str]) -> bool:
    """Whether every shard of a table (by path) is a Shar folder's cuts file."""
    return bool(paths) and all(shar_field_of(path) == CUTS for path in paths)


def open_shar(
    path: str, field: str, start: int = 0, ordinal: int = 0, read_data: bool = True, read_ahead: bool = True
) -> CutStream | JsonlFieldStream | FieldTarStream:
    """A sample stream over a Shar file holding ``field`` (see :func:`shar_field_of`), from
    byte ``start`` (sample ``ordinal``)."""
    if is_remote(path):
        raise ConfigError(
            f"{redact(path)}: Lhotse Shar folders are read from local disk. Fix: copy the folder and read the copy."
        )
    if field == CUTS:
        return CutStream(path, start, ordinal, read_data)
    if path.endswith(JSONL_EXTENSIONS):
        return JsonlFieldStream(path, field, start, ordinal, read_data)
    return FieldTarStream(path, field, start, ordinal, read_data, read_ahead)


def supervision_text(cut: dict) -> str | None:
    """The texts of a cut's supervisions in time order (by start; ties in their order), each
    stripped, joined by single spaces; None when none has text."""
    supervisions = sorted(cut.get("supervisions") or (), key=lambda s: float(s.get("start", 0)))
    texts = [s["text"].strip() for s in supervisions if isinstance(s.get("text"), str)]
    return " ".join(text for text in texts if text) or None


class _Line(NamedTuple):
    offset: int
    ordinal: int
    key: str
    record: dict
    text: bytes


class _JsonLines(Closing):
    """The JSON objects of a (gzip'd) JSON-lines file, one sample each, from byte ``start`` of
    its text: the interface of :class:`~.tar.SampleStream`. Offsets count decompressed bytes
    (resuming inside a gzip'd file re-reads its prefix, as for ``.tar.gz`` shards)."""

    key_name = "id"  # the record's key

    def __init__(self, path: str | Path, start: int = 0, ordinal: int = 0, read_data: bool = True):
        self.path = str(path)
        self.ordinal = ordinal
        self.ended_cleanly = False
        self._read_data = read_data
        try:
            self._lines = BoundedLines(path, start)
        except (FileNotFoundError, PermissionError, IsADirectoryError) as error:
            raise ShardError(path, None, f"cannot open: {error.strerror or error}") from None
        except (OSError, EOFError, zlib.error) as error:
            raise ShardError(path, start, f"cannot be read up to here ({error}): a truncated or damaged file") from None

    @property
    def resume_offset(self) -> int:
        return self._lines.position

    def close(self) -> None:
        self._lines.close()

    def next_line(self) -> _Line | None:
        """The next line's object with its key, or None at the end; ShardError for a line that
        cannot be read or is not an object with a key (the file is damaged from there)."""
        offset = self._lines.position
        try:
            text = self._lines.readline()
        except InflationError as error:
            raise ShardError(self.path, offset, f"line {self.ordinal + 1} is not read: {error}") from None
        except (OSError, EOFError, zlib.error) as error:
            raise ShardError(
                self.path, offset, f"cannot be read from here ({error}): a truncated or damaged file"
            ) from None
        if not text:
            self.ended_cleanly = True
            return None
        try:
            record = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError):
            record = None
        key = record.get(self.key_name) if isinstance(record, dict) else None
        if not isinstance(key, str) or not key:
            raise ShardError(
                self.path,
                offset,
                f'line {self.ordinal + 1} is not a JSON object with an "{self.key_name}" string ({text[:60]!r}): '
                "not a Lhotse Shar file, or damaged",
            )
        self.ordinal += 1
        return _Line(offset, self.ordinal - 1, key, record, text.rstrip(b"\n"))  # type: ignore[arg-type]

    def next_sample(self) -> TarRecord | None:
        line = self.next_line()
        if line is None:
            return None
        return TarRecord(line.key, self._fields(line) if self._read_data else {}, line.offset, line.ordinal)

    def _fields(self, line: _Line) -> dict[str, bytes | memoryview]:
        raise NotImplementedError


class CutStream(_JsonLines):
    """A Shar cuts file: per cut its JSON (``cut.json``) and its supervisions' text (``txt``)."""

    def _fields(self, line: _Line) -> dict[str, bytes | memoryview]:
        fields: dict[str, bytes | memoryview] = {CUT_SUFFIX: line.text}
        try:
            cut_duration(line.record)
        except NumberError as error:  # the index gave it a frame (skip_bad): counted when decoded
            problem = f"cut {line.key!r} (line {line.ordinal + 1} of {self.path}): {error}."
            fields[READ_ERROR_FIELD] = carried_problem(
                InputError(Where(self.path), "bad_duration", problem, "correct the cut, or leave it out.")
            )
        try:
            text = supervision_text(line.record)
        except (AttributeError, TypeError, ValueError):
            raise ShardError(
                self.path, line.offset, f"cut {line.key!r} (line {line.ordinal + 1}) has malformed supervisions"
            ) from None
        if text is not None:
            fields[TEXT_SUFFIX] = text.encode("utf-8")
        return fields


class JsonlFieldStream(_JsonLines):
    """A Shar field file ``NAME.K.jsonl.gz``: per cut ``{"cut_id": ..., "NAME": value}``, its
    value as field ``NAME`` (absent when the line has none)."""

    key_name = "cut_id"
    out_of_step_fix = OUT_OF_STEP_FIX  # what the reader says when the file's cuts are not the cuts file's

    def __init__(self, path: str | Path, field: str, start: int = 0, ordinal: int = 0, read_data: bool = True):
        super().__init__(path, start, ordinal, read_data)
        self.field = field

    def _fields(self, line: _Line) -> dict[str, bytes | memoryview]:
        if self.field not in line.record:
            return {f"{self.field}.{NODATA}": b""}
        return {f"{self.field}.json": json.dumps(line.record[self.field]).encode("utf-8")}


class FieldTarStream(OverTar):
    """A Shar field file ``NAME.K.tar``: per cut its data member ``CUTID.EXT`` then its
    manifest ``CUTID.json`` (or ``.nodata`` then ``.nometa``), as one sample ``CUTID`` with
    fields ``NAME.EXT`` and ``NAME_meta.json`` (``.nodata`` for absent ones). The interface of
    :class:`~.tar.SampleStream`; offsets are those of the data members' headers."""

    out_of_step_fix = OUT_OF_STEP_FIX  # what the reader says when the file's cuts are not the cuts file's

    def __init__(
        self,
        path: str | Path,
        field: str,
        start: int = 0,
        ordinal: int = 0,
        read_data: bool = True,
        read_ahead: bool = True,
    ):
        self._tar = TarStream(path, start, read_ahead=read_ahead and read_data)
        self.field = field
        self.ordinal = ordinal
        self._read_data = read_data

    def next_sample(self) -> TarRecord | None:
        data = self._tar.next_member(self._read_data)
        if data is None:
            return None
        key, dot, extension = data.name.rpartition(".")
        meta = self._tar.next_member(self._read_data)
        if not dot or not key or meta is None or meta.name not in (f"{key}.json", f"{key}.nometa"):
            after = "the end of the file" if meta is None else repr(meta.name)
            raise ShardError(
                self.path,
                data.offset,
                f"member {data.name!r} is followed by {after}, not by its manifest {key or data.name}.json (or "
                ".nometa): not a Lhotse Shar field file, or damaged",
            )
        meta_suffix = f"{self.field}{META}.{'json' if meta.name.endswith('.json') else NODATA}"
        fields = {f"{self.field}.{extension}": data.data, meta_suffix: meta.data}
        self.ordinal += 1
        return TarRecord(key, fields, data.offset, self.ordinal - 1)


def shar_index(folder: Path, skip_bad: bool = False) -> ShardIndex | None:
    """What a Shar folder holds, as the index of a folder of shards (its cuts files), or None
    when ``folder`` holds no Shar cuts. ConfigError when a shard lacks a field file that the
    others have (naming both); ShardError for a cuts file that cannot be read, or a cut whose
    duration is not one (:func:`cut_duration`): with ``skip_bad`` such a cut is one frame long
    here, and the reader counts it (:class:`CutStream`)."""
    if not folder.is_dir():
        return None
    listed = os.listdir(folder)
    if "\0cuts" not in "\0" + "\0".join(listed):  # no name starts as a cuts file does: one look, not one a name
        return None
    names = sorted(name for name in listed if not name.startswith("."))
    cuts: dict[str, str] = {}
    for name in names:
        match = SHAR_CUTS.fullmatch(name)
        if match is not None and cuts.setdefault(match["id"], name) != name:
            raise ConfigError(f"{folder}: {cuts[match['id']]} and {name} are both its cuts of one shard: keep one.")
    if not cuts:
        return None
    files = _field_files(folder, names, cuts)
    facts = {shard: _cut_facts(folder / name, skip_bad) for shard, name in cuts.items()}
    features = next((manifest for _, _, manifest in facts.values() if manifest is not None), None)
    shift = features[0] * 1000 if features else DEFAULT_SHIFT_MS
    entries = []
    for shard, name in cuts.items():
        durations, offsets, _ = facts[shard]
        frames = [max(1, round(seconds * 1000 / shift)) for seconds in durations]
        longest = max(range(len(frames)), key=frames.__getitem__, default=None)
        if longest is not None and frames[longest] > MAX_LENGTH:
            raise ShardError(
                folder / name,
                offsets[longest],
                f"cut {longest + 1} lasts {durations[longest]} s, {frames[longest]} frames of {shift} ms: beyond "
                f"{MAX_LENGTH} frames (a damaged duration or frame_shift?). Fix: correct the cut, or leave it out.",
            )
        entries.append(
            ShardEntry(
                name,
                len(frames),
                sum(frames),
                (folder / name).stat().st_size,
                "",
                dict(Counter(length_bin(f) for f in frames)),
                min(frames, default=None),
                max(frames, default=None),
                {
                    field: SidecarEntry(by_shard[shard], (folder / by_shard[shard]).stat().st_size, "")
                    for field, by_shard in files.items()
                },
            )
        )
    return ShardIndex(
        entries,
        feature={
            "field": FEATURES if FEATURES in files else None,
            "dim": features[1] if features and FEATURES in files else None,
            "frame_shift_ms": shift,
        },
        created_by="lhotse SharWriter",
        source={"format": SHAR_FORMAT},
        fields=[CUT_SUFFIX, TEXT_SUFFIX],
        field_sets={
            field: FieldSet(_suffixes(folder, field, list(by_shard.values())), SHAR_FORMAT)
            for field, by_shard in files.items()
        },
    )


def is_shar_folder(folder: Path) -> bool:
    """Whether ``folder`` holds the cuts of a Lhotse Shar folder."""
    return folder.is_dir() and any(SHAR_CUTS.fullmatch(path.name) for path in folder.iterdir())


def is_shar_index(index: ShardIndex | None) -> bool:
    """Whether ``index`` was made by :func:`shar_index`."""
    return index is not None and index.source.get("format") == SHAR_FORMAT


def _field_files(folder: Path, names: list[str], cuts: dict[str, str]) -> dict[str, dict[str, str]]:
    """field -> shard -> its file: every field file of every shard, or ConfigError."""
    files: dict[str, dict[str, str]] = {}
    for name in names:
        match = FIELD_FILE.fullmatch(name)
        if match is None or match["field"] == CUTS or match["id"] not in cuts:
            continue
        first = files.setdefault(match["field"], {}).setdefault(match["id"], name)
        if first != name:
            raise ConfigError(
                f"{folder}: {first} and {name} both hold field {match['field']!r} of one shard: keep one."
            )
    for field, by_shard in files.items():
        other_shard, other = next(iter(by_shard.items()))
        for shard, name in cuts.items():
            if shard not in by_shard:
                expected = f"{field}{shard}{other[len(field) + len(other_shard) :]}"
                raise ConfigError(
                    f"{folder / name} has no field file {expected} beside it, where the other shards have one "
                    f"({folder / other}). Fix: restore it; or, to read the folder without field {field!r}, move all "
                    f"of its {field}.* files out of the folder."
                )
    return files


def cut_duration(cut: dict) -> float:
    """A cut's duration (seconds); NumberError unless it is a number >= 0 and at most
    :data:`MAX_CUT_SECONDS`."""
    return float(read_number("its duration (seconds)", cut.get("duration"), at_least=0, at_most=MAX_CUT_SECONDS))  # type: ignore[arg-type]


def _cut_facts(path: Path, skip_bad: bool) -> tuple[list[float], list[int], tuple[float, int] | None]:
    """The duration of every cut of a cuts file (seconds) and the offset of its line, and the
    frame shift (seconds) and dimension of the first features manifest of its cuts; ShardError
    naming the cut and the field when one is not a number of its kind (a duration:
    :func:`cut_duration`, 0 with ``skip_bad``; a frame shift: > 0; a dimension: a whole number
    >= 1)."""
    durations, offsets, features = [], [], None
    with CutStream(path, read_data=False) as stream:
        while (line := stream.next_line()) is not None:
            manifest = line.record.get(FEATURES)
            try:
                try:
                    durations.append(cut_duration(line.record))
                except NumberError:
                    if not skip_bad:
                        raise
                    durations.append(0.0)  # the reader counts the cut
                if (
                    features is None
                    and isinstance(manifest, dict)
                    and {"frame_shift", "num_features"} <= manifest.keys()
                ):
                    shift = read_number(
                        "its features' frame_shift (seconds)", manifest["frame_shift"], above=0, at_most=60
                    )
                    dim = read_number(
                        "its features' num_features", manifest["num_features"], whole=True, at_least=1, at_most=1 << 20
                    )
                    features = (float(shift), int(dim))  # type: ignore[arg-type]
            except NumberError as error:
                raise ShardError(
                    path,
                    line.offset,
                    f"cut {line.key!r} (line {line.ordinal + 1}): {error}. Fix: correct the cut, or leave it out.",
                ) from None
            offsets.append(line.offset)
    return durations, offsets, features


def _suffixes(folder: Path, field: str, names: list[str]) -> list[str]:
    """The member suffixes a field's records have: those of the first cut that has data (its
    extension, and the manifest), or ``NAME.nodata`` when no cut has."""
    if names[0].endswith(JSONL_EXTENSIONS):
        return [f"{field}.json"]
    for name in names:
        with FieldTarStream(folder / name, field, read_data=False, read_ahead=False) as stream:
            while (record := stream.next_sample()) is not None:
                if not next(iter(record.fields)).endswith(f".{NODATA}"):
                    return list(record.fields)
    return [f"{field}.{NODATA}"]
