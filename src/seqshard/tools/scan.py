"""Reading a whole shard to describe it: counts, frames, checksum, damage."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ShardError
from ..formats.audio import audio_seconds
from ..formats.fields import AUDIO_EXTENSIONS
from ..formats.files import crc32_of
from ..formats.index_entries import ShardEntry, length_bin
from ..formats.members import MemberTable, TableBuilder, has_table_format
from ..formats.npy import decode_npy
from ..formats.peers.lists import SEGMENT_FIELD
from ..formats.peers.nemo_tarred import nemo_shard_of
from ..formats.peers.shar import shar_field_of
from ..formats.remote import access as remote
from ..formats.streams import open_samples
from ..formats.tar import SampleStream


@dataclass
class ShardScan:
    """A shard as found on disk; ``problems`` is empty when it reads cleanly."""

    entry: ShardEntry
    feature_field: str | None = None
    dim: int | None = None
    dtype: str | None = None
    problems: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # in file order
    fields: list[str] = field(default_factory=list)  # member suffixes seen, in first-seen order
    audio: bool = False  # lengths are audio durations in 10 ms frames
    table: MemberTable | None = None  # of a local tar read to its end marker, from its headers


def file_crc32(path: str | Path, access: remote.RemoteAccess | None = None) -> tuple[int, int]:
    """``(crc32, size)`` of a file (or a remote shard), read sequentially in large chunks."""
    if remote.is_remote(str(path)):
        source = remote.RemoteBytes(str(path), access or remote.RemoteAccess())
        try:
            return crc32_of(source.read)
        finally:
            source.close()
    with open(path, "rb", buffering=0) as stream:
        return crc32_of(stream.read)


def scan_shard(
    path: str | Path, feature_field: str | None = None, access: remote.RemoteAccess | None = None
) -> ShardScan:
    """Read every member of ``path`` (a shard, local or a URL, or a raw list and its audio);
    lengths come from the first ``.npy`` field found, else the first audio field (or
    ``feature_field``). Damage is reported in ``problems``, never raised. The headers are
    parsed (a member table is not trusted), and a local tar's member table made from them."""
    name = str(path).rstrip("/").rsplit("/", 1)[-1]
    access = access or remote.RemoteAccess()
    try:
        crc, size = file_crc32(path, access)
    except ShardError as error:  # a remote shard that cannot be fetched
        return ShardScan(ShardEntry(name, 0, 0, 0, ""), feature_field, problems=[str(error)])
    scan = ShardScan(ShardEntry(name, 0, 0, size, f"crc32:{crc:08x}"), feature_field)
    keys_seen: set[str] = set()
    foreign = shar_field_of(str(path)) is not None or nemo_shard_of(path) is not None  # samples are not member runs
    table = TableBuilder() if has_table_format(str(path)) and not foreign else None
    try:
        with SampleStream(path, where=True) if table is not None else open_samples(path, access=access) as stream:
            while (sample := stream.next_sample()) is not None:
                length = _describe_sample(scan, sample.key, sample.fields)
                if table is not None:
                    assert sample.members is not None
                    table.add_sample(sample.key, sample.offset, sample.members, length)
                scan.entry.num_utts += 1
                if sample.key in keys_seen:
                    scan.problems.append(f"key {sample.key!r} appears in two separate runs of members")
                keys_seen.add(sample.key)
                scan.keys.append(sample.key)
                scan.fields.extend(suffix for suffix in sample.fields if suffix not in scan.fields)
            if not stream.ended_cleanly:
                scan.problems.append("the tar end marker is missing (shard cut short?)")
            elif table is not None:
                scan.table = table.finish(path, stream.resume_offset)
    except ShardError as error:
        scan.problems.append(str(error))
    if scan.keys:  # what a reader checks the file against
        scan.entry.first_key, scan.entry.last_key = scan.keys[0], scan.keys[-1]
    return scan


def _describe_sample(scan: ShardScan, key: str, fields: dict[str, bytes | memoryview]) -> int | None:
    """Count the sample into ``scan``; its length, when known."""
    if scan.feature_field is None:
        scan.feature_field = next((name for name in fields if name.endswith("npy")), None) or next(
            (name for name in fields if name in AUDIO_EXTENSIONS), None
        )
    if scan.feature_field in AUDIO_EXTENSIONS:  # each sample's audio, whatever its format (wav, flac, ...)
        data = next((fields[name] for name in fields if name in AUDIO_EXTENSIONS), None)
    else:
        data = fields.get(scan.feature_field) if scan.feature_field else None
    if data is None and scan.feature_field is not None:
        scan.problems.append(f"{key}: no {scan.feature_field} member, so its length is unknown")
    frames = None
    if data is not None:
        try:
            frames = _frames(scan, data, fields.get(SEGMENT_FIELD))
        except ValueError as error:
            scan.problems.append(f"{key}.{scan.feature_field}: {error}")
            return None
        if frames is not None:
            entry = scan.entry
            entry.min_frames = frames if entry.min_frames is None else min(entry.min_frames, frames)
            entry.max_frames = frames if entry.max_frames is None else max(entry.max_frames, frames)
            scan.entry.num_frames += frames
            bin_ = length_bin(frames)
            scan.entry.length_hist[bin_] = scan.entry.length_hist.get(bin_, 0) + 1
    if "txt" in fields:
        try:
            str(fields["txt"], "utf-8")
        except UnicodeDecodeError:
            scan.problems.append(f"{key}.txt: not valid UTF-8")
    return frames


def _frames(scan: ShardScan, data: bytes | memoryview, segment: bytes | memoryview | None) -> int | None:
    """The sample's length: rows of its feature array, or its audio's duration in 10 ms
    frames (from the audio header; a raw list's ``start``/``end`` when cut)."""
    if scan.feature_field in AUDIO_EXTENSIONS:
        seconds = audio_seconds(data)
        if segment is not None:
            cut = json.loads(bytes(segment))
            seconds = (seconds if cut["end"] < 0 else min(cut["end"], seconds)) - cut["start"]
        scan.audio = True
        return round(seconds * 100)
    array = decode_npy(data)
    if array.ndim == 2 and scan.dim is None:
        scan.dim, scan.dtype = int(array.shape[1]), str(array.dtype)
    return int(array.shape[0]) if array.ndim >= 1 else None
