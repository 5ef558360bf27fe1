"""``seqshard add-field``: a new field for packed shards, without repacking them.

For each shard of each indexed folder under ``DIR``, the field's values are looked up by key in
a source and written, in the shard's key order, to a sidecar field shard in the folder's
``fields/NAME/`` (``data-00042.tar`` -> ``fields/NAME/data-00042.tar``, members
``KEY.NAME.EXT``; no glob of the shards selects it). Sources: a Kaldi
scp (matrices or vectors, e.g. alignments: ``.npy``), a ``text``-style file (``KEY value...``:
``.txt``), or JSON lines (``{"key": ..., ...}``: the object without its key, ``.json``). A key
missing from the source is an error, or with ``allow_missing`` a ``KEY.NAME.nodata``
placeholder (the sample then has no such field). Like ``pack``: files appear under their
final name only when complete, a journal records finished sidecars so that a rerun continues,
and each folder's ``index.json`` is updated last.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import multiprocessing as mp
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, InputError, SeqshardError, SkipCounter, Where, option
from ..formats.files import inside, remove_stale_temporaries, writing
from ..formats.index import ShardIndex
from ..formats.index_entries import FieldSet, SidecarEntry, sidecar_name
from ..formats.keys import unescape_key
from ..formats.lock import FolderLocks, refuse_if_held
from ..formats.npy import decode_npy, npy_parts
from ..formats.pack_state import STATE_DIR, pack_root
from ..formats.patterns import FIELD_SET_NAME, FIELDS_DIR, old_layout_sidecar, shard_subfolders
from ..formats.peers.kaldi import MatrixReader, parse_location
from ..formats.peers.keytable import KeyTable
from ..formats.peers.nemo_tarred import is_nemo_folder
from ..formats.selection import is_sidecar
from ..formats.tar import SampleStream, ShardWriter, temporary_path
from ..progress import Progress
from .journal import Journal, finished_shards
from .pack import content_hash

_LOG = logging.getLogger("seqshard")
SOURCE_KINDS = ("scp", "text", "jsonl")
EXTENSIONS = {"scp": "npy", "text": "txt", "jsonl": "json"}


@dataclass
class AddFieldReport:
    """What ``add-field`` did; ``samples == filled + missing`` over every shard."""

    name: str
    folders: list[str]
    shards: int = 0
    written_now: int = 0
    samples: int = 0
    filled: int = 0
    missing: int = 0
    bytes: int = 0
    seconds: float = 0.0
    source_unused: int = 0  # source entries that no shard's key asked for

    def format_text(self) -> str:
        return "\n".join(
            [
                f"seqshard add-field {self.name} -> {', '.join(self.folders)}",
                f"  shards           : {self.shards} ({self.written_now} written by this run)",
                f"  samples          : {self.samples}: {self.filled} with the field, {self.missing} without",
                f"  source entries   : {self.source_unused} not used by any shard",
                f"  bytes            : {self.bytes / 1e6:.1f} MB in {self.seconds:.1f} s",
            ]
        )

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Task:
    """One sidecar to write: beside shard ``shard`` of folder ``folder``."""

    folder: Path
    group: str
    shard: str
    escaped_keys: bool
    record: dict[str, Any] | None = None


@dataclass(frozen=True)
class FieldSource:
    """Where the values come from, scanned once into a compact key table."""

    kind: str
    table: KeyTable
    identity: str  # the kind and the source files' content: a sidecar made from another is redone
    path_root: str | None = None
    allow_pipes: bool = False
    path_map: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    @classmethod
    def open(cls, files: Sequence[Path], kind: str | None, **options: Any) -> FieldSource:
        kind = kind or guess_kind(files[0])
        if kind not in SOURCE_KINDS:
            raise ConfigError(f"the source kind must be one of {', '.join(SOURCE_KINDS)}, got {kind!r}.")
        parse = _parse_json_line if kind == "jsonl" else None
        bad = SkipCounter(False)
        table = KeyTable.scan(files, bad, needs_value=kind != "text", **({"parse": parse} if parse else {}))
        table.report_repeats(bad, "duplicate_key", "the key was already given at {first}.", "remove the repeat.")
        digest = hashlib.blake2b(kind.encode(), digest_size=16)
        for path in files:
            digest.update(content_hash(path).encode())
        return cls(kind, table, digest.hexdigest(), **options)

    def member(self, key: str, reader: MatrixReader) -> tuple[str, list[Any]] | None:
        """The member (extension, buffers) holding ``key``'s value, or None when absent."""
        found = self.table.find(key)
        if found is None:
            return None
        row, value = found
        where = self.table.where(row, key)
        if self.kind == "text":
            return "txt", [value.encode("utf-8")]
        if self.kind == "jsonl":
            record = json.loads(value)
            del record["key"]
            return "json", [json.dumps(record, ensure_ascii=False).encode("utf-8")]
        root = Path(self.path_root) if self.path_root else None
        array = reader.read(parse_location(value, where, self.path_map, root), where, vectors=True)
        return "npy", list(npy_parts(array))


def guess_kind(path: Path) -> str:
    """``scp`` for ``*.scp``, ``jsonl`` for ``*.jsonl``/``*.json``, else ``text``."""
    if path.suffix == ".scp":
        return "scp"
    if path.suffix in (".jsonl", ".json"):
        return "jsonl"
    return "text"


def _parse_json_line(raw: bytes, where: Where, needs_value: bool) -> tuple[str, str]:
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputError(where, "malformed_line", f"the line is not JSON ({error}).", skippable=False) from None
    if not isinstance(record, dict) or not isinstance(record.get("key"), str):
        raise InputError(where, "malformed_line", 'expected an object with a "key" string.', skippable=False)
    return record["key"], raw.decode("utf-8")


def add_field(
    root: str | Path,
    name: str,
    source: str | Path | Sequence[str | Path],
    *,
    kind: str | None = None,
    allow_missing: bool = False,
    overwrite: bool = False,
    jobs: int = 1,
    path_root: str | Path | None = None,
    path_map: Sequence[tuple[str, str]] = (),
    allow_pipes: bool = False,
    progress: bool = True,
) -> AddFieldReport:
    """Add field set ``name`` to every indexed folder of shards under ``root`` (see the module
    docstring). Returns what was done; raises InputError naming the shard and key that the
    source lacks, unless ``allow_missing``."""
    import time

    started = time.perf_counter()
    root = Path(root)
    if not FIELD_SET_NAME.fullmatch(name):
        raise ConfigError(f"field name {name!r}: use letters, digits and '_' (it becomes part of file names).")
    files = [Path(source)] if isinstance(source, (str, Path)) else [Path(s) for s in source]
    for path in files:
        if not path.is_file():
            raise ConfigError(f"{option('source', path)}: no such file (add-field reads it twice: a pipe will not do).")
    folders = _indexed_folders(root)
    try:
        field_source = FieldSource.open(
            files,
            kind,
            path_root=str(path_root) if path_root else None,
            allow_pipes=allow_pipes,
            path_map=tuple(path_map),
        )
        for folder in [*folders, root / STATE_DIR]:
            inside(root, folder)  # nothing is written through a link out of the folder
        with FolderLocks([root, *folders, *filter(None, [pack_root(root)])], f"seqshard add-field {name}"):
            indexes = {
                folder: index
                for folder in folders
                if not _already_added(folder, index := ShardIndex.load(folder), name, overwrite, field_source.identity)  # type: ignore[arg-type]
            }
            for folder in folders:  # what killed writers left (this one holds the folders alone)
                remove_stale_temporaries(folder, older_than=0)
                remove_stale_temporaries(inside(root, folder / FIELDS_DIR / name), older_than=0)
            if overwrite:
                _remove_field(root, indexes, name)
            report = _add(root, indexes, name, field_source, allow_missing, jobs, progress, files)
    except InputError as error:
        error.skippable = False  # add-field stops at bad input: there is nothing to skip to
        raise
    report.folders = [str(f) for f in folders]
    report.seconds = time.perf_counter() - started
    if report.source_unused:
        _LOG.warning("%d entries of %s match no shard's key", report.source_unused, ", ".join(map(str, files)))
    return report


def _add(
    root: Path,
    indexes: dict[Path, ShardIndex],
    name: str,
    field_source: FieldSource,
    allow_missing: bool,
    jobs: int,
    progress: bool,
    files: list[Path],
) -> AddFieldReport:
    """Write the sidecars still to write in these folders, then update their indexes."""
    tasks = [
        _Task(folder, "" if folder == root else folder.name, entry.name, index.escaped_keys)
        for folder, index in indexes.items()
        for entry in index.shards
    ]
    done = finished_shards(root, f"field-{name}")
    todo = []
    for task in tasks:
        record = done.get(_relative(task, name))
        task.record = record if record is not None and record.get("source") == field_source.identity else None
        if task.record is None:
            todo.append(task)
    report = AddFieldReport(name, [], shards=len(tasks), written_now=len(todo))
    with Progress(progress) as bars:
        advance = bars.bar(f"add-field {name}", len(todo), unit="shard")
        for task, record in zip(todo, _write_all(root, todo, name, field_source, allow_missing, jobs)):
            task.record = record
            advance(1)
    for task in tasks:
        record = task.record
        assert record is not None
        report.samples += record["num_utts"]
        report.missing += record["missing"]
        report.bytes += record["bytes"]
    report.filled = report.samples - report.missing
    report.source_unused = len(field_source.table) - report.filled if tasks else 0
    _update_indexes(indexes, tasks, name, field_source, allow_missing, files)
    return report


def _indexed_folders(root: Path) -> list[Path]:
    if not root.is_dir():
        raise ConfigError(f"{root} is not a folder.")
    folders = [f for f in [root, *shard_subfolders(root)] if (f / "index.json").is_file()]
    if not folders:
        refuse_if_held(root, "seqshard add-field")
        raise ConfigError(
            f"{root} and its sub-folders have no index.json: add-field needs the shards' index (run `seqshard index {root}`)."
        )
    tarred = next((folder for folder in folders if is_nemo_folder(folder)), None)
    if tarred is not None:  # its samples are manifest entries, not the tar's members
        raise ConfigError(
            f"{tarred} is a NeMo tarred set: its samples are its manifest's entries, and an entry's other keys are "
            "its fields (NAME.json). Fix: add the field to the entries of its manifests (tarred_audio_manifest.json, "
            "sharded_manifests/), then run `seqshard index` on it again."
        )
    return folders


def _already_added(folder: Path, index: ShardIndex, name: str, overwrite: bool, identity: str) -> bool:
    """Whether ``folder`` has this field set from this very source already (nothing to do);
    refuses a name its shards hold, or a field set of this name from another source."""
    from ..formats.fields import field_name

    if name in {field_name(suffix) for suffix in index.fields}:
        raise ConfigError(f"{folder}: the shards already hold a field {name!r}; choose another name.")
    existing = index.field_sets.get(name)
    if existing is None or overwrite:
        return False
    if existing.digest == identity:
        _LOG.info("%s already has field set %r from this source: nothing to do", folder, name)
        return True
    raise ConfigError(
        f"{folder} already has field set {name!r} (from {existing.source}); pass {option('overwrite')} to replace it."
    )


def _remove_field(root: Path, indexes: dict[Path, ShardIndex], name: str) -> None:
    """Delete field set ``name``'s sidecars (both layouts; the old one only on evidence, never a
    shard named ``STEM.NAME.tar``) and journals."""
    for folder, index in indexes.items():
        fields = folder / FIELDS_DIR / name
        if fields.is_dir():
            for path in inside(folder, fields).glob("*.tar"):
                path.unlink()
        for path in folder.glob(f"*.{name}.tar"):
            if old_layout_sidecar(path) is not None and is_sidecar(path, index):
                path.unlink()
    for journal in inside(root, root / STATE_DIR).glob(f"field-{name}-*.jsonl"):
        journal.unlink()


def _relative(task: _Task, name: str) -> str:
    sidecar = sidecar_name(task.shard, name)
    return f"{task.group}/{sidecar}" if task.group else sidecar


def _write_all(
    root: Path, tasks: list[_Task], name: str, source: FieldSource, allow_missing: bool, jobs: int
) -> list[dict[str, Any]]:
    """Write every task's sidecar (in ``jobs`` processes) and return their journal records."""
    args = [(root, task, name, source, allow_missing) for task in tasks]
    if jobs <= 1 or len(tasks) <= 1:
        return [_write_sidecar(*a) for a in args]
    context = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with context.Pool(min(jobs, len(tasks))) as pool:
        return pool.starmap(_write_sidecar, args)


def _write_sidecar(root: Path, task: _Task, name: str, source: FieldSource, allow_missing: bool) -> dict[str, Any]:
    """Write the sidecar of one shard, journal it and return its record."""
    shard = task.folder / task.shard
    target = inside(task.folder, task.folder / sidecar_name(task.shard, name))
    temporary_path(target).unlink(missing_ok=True)
    writer = ShardWriter(target, task.folder)
    missing = 0
    first_key = last_key = None  # as stored, what readers check the sidecar against
    layout: dict[str, Any] = {}  # of the first array written: batches of samples without one take it
    try:
        with MatrixReader(allow_pipes=source.allow_pipes) as reader, SampleStream(shard, read_data=False) as stream:
            for sample in stream:
                first_key, last_key = first_key or sample.key, sample.key
                key = unescape_key(sample.key) if task.escaped_keys else sample.key
                member = source.member(key, reader)
                if member is None:
                    if not allow_missing:
                        raise InputError(
                            Where(shard, None, key),
                            "missing_value",
                            f"the source ({', '.join(map(str, source.table.files))}) has no value for this key.",
                            f"add it, or pass {option('allow_missing')} to leave the field out of such samples.",
                            skippable=False,
                        )
                    missing += 1
                    writer.add(sample.key, [(f"{name}.nodata", [b""])])
                    continue
                extension, buffers = member
                if extension == "npy" and not layout:
                    array = decode_npy(b"".join(bytes(b) for b in buffers))
                    layout = {"dtype": str(array.dtype), "shape": list(array.shape[1:])}
                writer.add(sample.key, [(f"{name}.{extension}", buffers)])
            if not stream.ended_cleanly:
                raise SeqshardError(f"{shard}: the shard ends without the tar end marker; verify it first.")
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    record = {
        "group": task.group,
        "name": sidecar_name(task.shard, name),
        "shard": task.shard,
        "bytes": writer.size,
        "checksum": f"crc32:{writer.crc32:08x}",
        "first_key": first_key,
        "last_key": last_key,
        "num_utts": writer.num_samples,
        "missing": missing,
        "source": source.identity,
        "layout": layout,
    }
    Journal(root, f"{os.getpid()}", kind=f"field-{name}").append(record)
    return record


def _update_indexes(
    indexes: dict[Path, ShardIndex | None],
    tasks: list[_Task],
    name: str,
    source: FieldSource,
    allow_missing: bool,
    files: list[Path],
) -> None:
    """Record the field set and each shard's sidecar in every folder's index (last)."""
    records = {(task.folder, task.shard): task.record for task in tasks}
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    for folder, index in indexes.items():
        assert index is not None
        extension = EXTENSIONS[source.kind]
        layout = next((t.record["layout"] for t in tasks if t.record and t.record.get("layout")), {})
        index.field_sets[name] = FieldSet(
            [f"{name}.{extension}"], ", ".join(str(f) for f in files), created, allow_missing, source.identity, layout
        )
        for entry in index.shards:
            record = records[(folder, entry.name)]
            assert record is not None
            if record["num_utts"] != entry.num_utts:
                raise SeqshardError(
                    f"{folder / entry.name}: its sidecar {record['name']} holds {record['num_utts']} samples where "
                    f"the index says {entry.num_utts}; verify the shard."
                )
            entry.sidecars[name] = SidecarEntry(
                sidecar_name(entry.name, name),
                record["bytes"],
                record["checksum"],
                record.get("first_key"),
                record.get("last_key"),
            )
        with writing(folder):
            index.save(folder)
