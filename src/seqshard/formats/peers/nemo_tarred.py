"""NeMo's tarred audio sets, read as they are: ``audio_0.tar`` ... beside their manifest.

NeMo's ``convert_to_tarred_audio_dataset.py`` writes, per shard ``N``, a tar ``audio_N.tar``
of audio files and the manifest entries of its files with ``"shard_id": N``, all in
``tarred_audio_manifest.json`` and, per shard, in ``sharded_manifests/manifest_N.json``. The
rules of NeMo's own reader (``LazyNeMoTarredIterator``) are followed:

- A tar's shard id is the number in its name (``audio[^/]*_(\\d+)[^/]*\\.tar``), and its entries
  are the manifest's of that ``shard_id`` (the sharded manifest when there is one).
- A member is found by its name: an entry's ``audio_filepath`` names it. A file that several
  entries cut (each its own ``offset`` and ``duration``) is stored once: the entries after the
  first name it with ``-subK`` before the extension (``a.wav``, ``a-sub1.wav``), and they are
  read, one sample each, in the order of their names.
- A member named twice in one tar would be read twice: the shard is refused.
- A member no entry names is passed over (a manifest filtered after tarring), said once.

Where NeMo would read a sample twice or from the wrong place, seqshard refuses, naming the
manifest's lines (a ShardError, with or without ``skip_bad``, as a list's repeated keys are):
an entry listed twice in a shard (NeMo makes a sample of every entry naming a member, so it
reads that one twice an epoch), two entries with one file id (``a.wav`` and ``a.flac``), an
entry of another shard in a sharded manifest, and two tars with one shard id in a folder.

A sample is an entry: key = its file name without extension (NeMo's ``file_id``: ``a``,
``a-sub1``), its member's bytes under the member's extension, ``txt``, ``segment.json`` for
an entry with ``offset``, and its other keys as ``NAME.json``. Planning, splitting, resuming
and counting treat a tar as one of seqshard's shards: :func:`nemo_index` gives a folder the
index its manifest implies (counts and lengths from the durations; ``seqshard index`` saves
it), and a sample's offset is its member's header offset plus its place among the member's
entries (headers are 512-byte aligned, so a member may have up to 511 entries).
"""

from __future__ import annotations

import json
import logging
import re
from array import array
from collections import Counter
from pathlib import Path
from typing import Any

from ...errors import InputError, ShardError, Where, counted
from ..index import ShardIndex
from ..index_entries import ShardEntry, length_bin
from ..inflation import MAX_LINE_BYTES, numbered_lines
from ..patterns import shards_in_folder
from ..tar import BLOCK, OverTar, TarRecord, TarStream
from .lists import SEGMENT_FIELD
from .nemo import SHARD_KEY, Entry, parse_entry

_LOG = logging.getLogger("seqshard")
TAR_NAME = re.compile(r"audio[^/]*_(\d+)[^/]*\.tar")  # NeMo's rule for a tar's shard id
TAR_NAME_ID = re.compile(r"^(audio[^/]*_)(\d+)([^/]*\.tar)$")  # the same, to name another shard's tar alike
SHARDED_ID = re.compile(r"manifest_(\d+)\.json")
TARRED_MANIFEST = "tarred_audio_manifest.json"
SHARDED_MANIFEST = "sharded_manifests/manifest_{}.json"
SUB_ENTRY = re.compile(r"(?P<stem>.+)-sub\d+(?P<ext>\.\w+)?")  # a further cut of one stored file
NEMO_FORMAT = "nemo-tarred"  # ``source["format"]`` of the index made for a tarred set
MAX_ENTRIES_PER_MEMBER = BLOCK - 1


def nemo_shard_of(path: str | Path) -> tuple[int, Path] | None:
    """``(shard id, manifest)`` of a tar of a NeMo tarred set: its sharded manifest, else the
    folder's ``tarred_audio_manifest.json``; None when ``path`` is not one."""
    path = Path(path)
    match = TAR_NAME.fullmatch(path.name)
    if match is None:
        return None
    shard = int(match[1])
    for manifest in (path.parent / SHARDED_MANIFEST.format(shard), path.parent / TARRED_MANIFEST):
        if manifest.is_file():
            return shard, manifest
    return None


def _manifest_shard_ids(folder: Path) -> set[int]:
    """The shard ids a tarred set's manifests name: those of its sharded manifests' names,
    else of the entries of ``tarred_audio_manifest.json``."""
    sharded = [SHARDED_ID.fullmatch(p.name) for p in (folder / "sharded_manifests").glob("manifest_*.json")]
    if any(sharded):
        return {int(match[1]) for match in sharded if match}
    manifest = folder / TARRED_MANIFEST
    return set(MANIFESTS.shard_ids(manifest)) if manifest.is_file() else set()


def is_nemo_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a NeMo tarred set (its manifest and a tar of it)."""
    return (folder / TARRED_MANIFEST).is_file() or (folder / "sharded_manifests").is_dir()


def member_name(entry: Entry) -> str:
    """The tar member an entry names (``a-sub1.wav`` names ``a.wav``)."""
    name = entry.audio.rsplit("/", 1)[-1]
    match = SUB_ENTRY.fullmatch(name)
    return name if match is None else match["stem"] + (match["ext"] or "")


def entry_key(entry: Entry) -> str:
    """NeMo's ``file_id`` of an entry: its file name without the extension."""
    name = entry.audio.rsplit("/", 1)[-1]
    return name.rsplit(".", 1)[0] if "." in name[1:] else name


class _Manifests:
    """Where each shard's entries are in the manifest read last in this process: a tarred
    set's one manifest is scanned once, however many of its tars a reader opens, and holds
    a number per entry, not the entry."""

    def __init__(self) -> None:
        self._scanned: tuple[tuple[Path, int, int], dict[int, array]] | None = None

    def entries(self, manifest: Path, shard: int) -> list[Entry]:
        """The entries of ``shard`` in ``manifest``; ShardError for a bad line, an entry of
        another shard in a sharded manifest, or two entries that are one sample."""
        offsets = self._offsets(manifest)
        _refuse_other_shards(manifest, offsets)
        entries = []
        with open(manifest, "rb") as stream:
            for offset in offsets.get(shard, ()):
                stream.seek(offset)
                entries.append(_entry(stream.readline(MAX_LINE_BYTES + 1), manifest, offset)[0])
        _refuse_repeats(manifest, shard, offsets.get(shard, ()), entries)
        return entries

    def shard_ids(self, manifest: Path) -> list[int]:
        """The shard ids ``manifest``'s entries name."""
        return list(self._offsets(manifest))

    def _offsets(self, manifest: Path) -> dict[int, array]:
        stat = manifest.stat()
        key = (manifest, stat.st_mtime_ns, stat.st_size)
        if self._scanned is None or self._scanned[0] != key:
            self._scanned = key, self._scan(manifest)
        return self._scanned[1]

    @staticmethod
    def _scan(manifest: Path) -> dict[int, array]:
        offsets: dict[int, array] = {}
        for number, offset, line in numbered_lines(manifest):
            if not isinstance(line, bytes):
                raise ShardError(manifest, None, f"line {number}: {line}")
            if line.strip():
                offsets.setdefault(_entry(line, manifest, offset, number)[1], array("q")).append(offset)
        return offsets


def _entry(line: bytes, manifest: Path, offset: int, number: int | None = None) -> tuple[Entry, int]:
    """A tarred set's manifest line (line ``number``, at byte ``offset``) and its shard id;
    ShardError when it is not one."""
    place = f"line {number}: " if number else ""
    try:
        entry = parse_entry(line, Where(manifest))
    except InputError as error:
        raise ShardError(manifest, None if number else offset, place + error.problem) from None
    shard = entry.record.get(SHARD_KEY)
    if not isinstance(shard, int) or isinstance(shard, bool) or shard < 0:
        raise ShardError(
            manifest,
            None if number else offset,
            f'{place}the line has no "shard_id" number (0, 1, ...): not the manifest of a NeMo tarred set',
        )
    return entry, shard


def _line_number(manifest: Path, offset: int) -> int:
    """The number of the line that starts at byte ``offset`` (for messages)."""
    newlines = 0
    with open(manifest, "rb") as stream:
        while offset > 0 and (chunk := stream.read(min(offset, 1 << 20))):
            newlines += chunk.count(b"\n")
            offset -= len(chunk)
    return newlines + 1


def _refuse_other_shards(manifest: Path, offsets: dict[int, array]) -> None:
    """A sharded manifest (``sharded_manifests/manifest_N.json``) holds the entries of shard
    N only: ShardError naming the first entry of another shard."""
    sharded = SHARDED_ID.fullmatch(manifest.name) if manifest.parent.name == "sharded_manifests" else None
    others = [ids for ids in offsets if sharded is not None and ids != int(sharded[1])]
    if not others:
        return
    offset = min(offsets[ids][0] for ids in others)
    entry, other = _entry(_line_at(manifest, offset), manifest, offset)
    raise ShardError(
        manifest,
        None,
        f"line {_line_number(manifest, offset)} is an entry of shard {other} ({entry.audio!r}), but this sharded "
        f"manifest is the one of shard {sharded[1]}, whose tar's members it names. Fix: write it again with only the "
        f'entries of "shard_id": {sharded[1]} (they are in {TARRED_MANIFEST}), or remove the folder '
        f"sharded_manifests to read {TARRED_MANIFEST}",
    )


def _refuse_repeats(manifest: Path, shard: int, offsets: array | tuple, entries: list[Entry]) -> None:
    """ShardError naming two entries of ``shard`` that are one sample (the same file id: the
    same ``audio_filepath``, listed twice). NeMo's readers make a sample of every entry that
    names a member (its ``-subK`` cuts are the entries after the first), so NeMo would read
    such an entry twice each epoch; seqshard reads each sample once, and refuses."""
    first: dict[str, int] = {}
    for offset, entry in zip(offsets, entries):
        earlier = first.setdefault(entry_key(entry), offset)
        if earlier != offset:
            raise ShardError(
                manifest,
                None,
                f"lines {_line_number(manifest, earlier)} and {_line_number(manifest, offset)} are both sample "
                f"{entry_key(entry)!r} of shard {shard} ({entry.audio!r}): an entry listed twice would be read twice "
                "(NeMo makes a sample of each entry). Fix: remove the repeated entry (several cuts of one file are "
                "named NAME-sub1, NAME-sub2, ... after the first, as NeMo's tarring script names them)",
            )


def _line_at(manifest: Path, offset: int) -> bytes:
    with open(manifest, "rb") as stream:
        stream.seek(offset)
        return stream.readline(MAX_LINE_BYTES + 1)


MANIFESTS = _Manifests()


class NemoTarStream(OverTar):
    """The samples of one tar of a NeMo tarred set (see the module docstring), from
    ``start`` (sample ``ordinal``): the interface of :class:`~.tar.SampleStream`."""

    def __init__(
        self,
        path: str | Path,
        shard: int,
        manifest: Path,
        start: int = 0,
        ordinal: int = 0,
        read_data: bool = True,
        read_ahead: bool = True,
    ):
        self.manifest = manifest
        self.ordinal = ordinal
        self._read_data = read_data
        self._by_member: dict[str, list[Entry]] = {}
        for entry in MANIFESTS.entries(manifest, shard):
            self._by_member.setdefault(member_name(entry), []).append(entry)
        for name, entries in self._by_member.items():
            entries.sort(key=lambda e: e.audio)  # NeMo's order of the cuts of one file
            if len(entries) > MAX_ENTRIES_PER_MEMBER:
                raise ShardError(
                    manifest,
                    None,
                    f"{len(entries)} entries cut member {name} of {path}; seqshard reads at most "
                    f"{MAX_ENTRIES_PER_MEMBER} cuts of one file (tar it again with --slice_with_offset)",
                )
        self._tar = TarStream(path, start - start % BLOCK, read_ahead=read_ahead and read_data)
        self._seen: set[str] = set()
        self._unlisted = 0
        self._pending: list[Entry] = []
        self._member: Any = None
        self._next = 0  # the place of the next sample among the member's entries
        if start % BLOCK:
            self._advance()
            self._next = start % BLOCK

    @property
    def resume_offset(self) -> int:
        if self._next < len(self._pending):
            return self._member.offset + self._next
        return self._tar.position

    def close(self) -> None:
        super().close()
        if self._unlisted:
            _LOG.warning(
                "%s: %s without an entry in %s passed over (a manifest filtered after tarring?)",
                self.path,
                counted(self._unlisted, "member"),
                self.manifest,
            )
            self._unlisted = 0

    def _advance(self) -> bool:
        """Read on to the next member some entry names; False at the end of the tar."""
        while (member := self._tar.next_member(self._read_data)) is not None:
            if member.name in self._seen:
                raise ShardError(
                    self.path,
                    member.offset,
                    f"member {member.name!r} is in the tar twice: its entries would be read twice. Fix: keep one copy",
                )
            self._seen.add(member.name)
            entries = self._by_member.get(member.name)
            if entries:
                self._member, self._pending, self._next = member, entries, 0
                return True
            self._unlisted += 1
        self._pending, self._next = [], 0
        return False

    def next_sample(self) -> TarRecord | None:
        if self._next >= len(self._pending) and not self._advance():
            return None
        entry, member = self._pending[self._next], self._member
        sample = TarRecord(entry_key(entry), self._fields(entry, member), member.offset + self._next, self.ordinal)
        self._next += 1
        self.ordinal += 1
        return sample

    def _fields(self, entry: Entry, member: Any) -> dict[str, bytes | memoryview]:
        """The sample's fields (named, with empty values, when its data is not read)."""
        extension = member.name.rsplit(".", 1)[-1].lower() if "." in member.name else "wav"
        fields: dict[str, Any] = {extension: member.data, "txt": entry.text}
        if entry.segment is not None:
            fields[SEGMENT_FIELD] = dict(zip(("start", "end"), entry.segment))
        fields.update((f"{name}.json", value) for name, value in entry.extra().items())
        if not self._read_data:
            return dict.fromkeys(fields, b"")
        return {
            name: value if name == extension else (value if name == "txt" else json.dumps(value)).encode("utf-8")
            for name, value in fields.items()
        }


def nemo_index(folder: Path) -> ShardIndex | None:
    """The index a NeMo tarred set's manifest implies for ``folder`` (its tars: entry counts,
    lengths in 10 ms frames from the durations), or None when ``folder`` holds none. A shard
    id the manifest names without its tar in the folder is listed too (named as the others
    are), so that the tar is a missing shard, never silently fewer samples."""
    if not folder.is_dir() or not is_nemo_folder(folder):
        return None
    tars: dict[int, tuple[Path, Path]] = {}
    for path in shards_in_folder(folder):
        found = nemo_shard_of(path)
        if found is not None and (other := tars.setdefault(found[0], (path, found[1]))[0]) != path:
            raise ShardError(
                folder,
                None,
                f"{other.name} and {path.name} are both the tar of shard {found[0]} (NeMo's rule: the number in "
                "the name), so the entries of that shard would be read from each. Fix: remove or rename one",
            )
    if not tars:
        return None
    some_tar = next(iter(tars.values()))[0]
    for shard in sorted(_manifest_shard_ids(folder) - set(tars)):
        path = folder / TAR_NAME_ID.sub(lambda m, n=shard: f"{m[1]}{n}{m[3]}", some_tar.name, count=1)
        manifest = folder / SHARDED_MANIFEST.format(shard)
        tars[shard] = path, manifest if manifest.is_file() else folder / TARRED_MANIFEST
    entries = []
    for shard, (path, manifest) in sorted(tars.items()):
        frames = [max(1, round(e.duration * 100)) for e in MANIFESTS.entries(manifest, shard)]
        entries.append(
            ShardEntry(
                path.name,
                len(frames),
                sum(frames),
                path.stat().st_size if path.is_file() else 0,
                "",
                dict(Counter(length_bin(f) for f in frames)),
                min(frames, default=None),
                max(frames, default=None),
            )
        )
    return ShardIndex(
        entries,
        feature={"field": "audio", "kind": "audio", "label_field": "txt", "frame_shift_ms": 10.0},
        created_by="NeMo convert_to_tarred_audio_dataset",
        source={"format": NEMO_FORMAT},
    )
