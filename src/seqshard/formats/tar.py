"""POSIX tar shards: a crash-safe deterministic writer and a fast front-to-back reader.

A shard holds samples; a sample is a run of members ``KEY.FIELD`` sharing one key. Any tar
tool and WebDataset read these files. The reader is hand-written rather than built on
``tarfile``: on 3 GB of 80-dim features ``tarfile`` streamed 202 MB/s where a minimal reader
reached 674 MB/s (0.78x ``cat``), and the loader's throughput is bounded by this loop.

Plain shards are memory-mapped: a member's bytes are a view of the page cache, never copied
into new Python objects. Measured on 2.2 GB of shards with the loader's windows holding 5000
samples, per-member ``bytes`` objects read at 1.1-2.0 GB/s (every new object faults in fresh
pages) where views read at 8-9 GB/s. The next 64 MB of each shard are read ahead on a
background thread (``prefetch.py``), so that cold reads are large, sequential and overlap the
decoding.
"""

from __future__ import annotations

import gzip
import mmap
import os
import tarfile
import zlib
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import ShardError
from ..protocol import Closing
from .files import fsync_directory, inside, open_input, open_output, writing
from .keys import split_member_name
from .members import MemberTable, TableBuilder, has_table_format, table_path
from .prefetch import ReadAhead
from .remote.access import RemoteAccess, is_remote

BLOCK = 512
RECORD = 20 * BLOCK
_ZERO_BLOCK = bytes(BLOCK)
READ_AHEAD = 64 << 20  # bytes read ahead of the cursor (prefetch thread)
MAX_EXTENSION_BYTES = 1 << 20  # a pax or long-name header beyond this is damage, not a name
MAX_STREAMED_MEMBER = 1 << 30  # a member read from a stream of unknown length (.tar.gz, a pipe) is held whole
STREAM_PIECE = 1 << 20  # and read this much at a time: a stream's read(n) allocates n bytes before reading
MAP_CHUNK = 64 << 20  # bytes mapped at once

BytesLike = bytes | bytearray | memoryview


def temporary_path(path: Path) -> Path:
    """Hidden name a shard is written under until it is complete (``data-*.tar`` skips it)."""
    return path.with_name(f".{path.name}.partial")


def _member_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info.tobuf(tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


def _padding(size: int) -> bytes:
    return _ZERO_BLOCK[: -size % BLOCK]


@dataclass(frozen=True)
class WrittenPart:
    """The first ``size`` bytes of a shard being written: ``samples`` whole samples, CRC-32
    ``crc32``, and the samples' lengths for the member table (int64 bytes; empty: unknown)."""

    size: int
    crc32: int
    samples: int
    lengths: bytes = b""


class ShardWriter:
    """Writes one shard under a temporary name; :meth:`commit` makes it visible.

    Members are written in the order given, with fixed mtime/owner/mode, so that packing the
    same input again gives byte-identical shards. The CRC-32 of every byte written is kept
    for the index, and where each member lies for the shard's member table (``members.py``),
    written once the shard has its final name. A crash leaves only the hidden
    ``.NAME.partial`` file behind.
    """

    def __init__(self, path: str | Path, root: str | Path | None = None, resume: WrittenPart | None = None):
        """Write ``path`` (and its member table), refusing a link that leads out of ``root``,
        the folder being written (default: the shard's own). ``resume``: continue the partial
        file a killed run left, after the part it had made durable (ShardError when the file
        does not hold it)."""
        self.path = Path(path)
        self.root = self.path.parent if root is None else Path(root)
        self.temp_path = inside(self.root, temporary_path(self.path))
        if has_table_format(str(self.path)):
            inside(self.root, table_path(self.path))
        with writing(self.temp_path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.crc32 = 0
        self.size = 0
        self.num_samples = 0
        self._table = TableBuilder()
        if resume is None:
            self._fd: int | None = open_output(self.temp_path)
        else:
            self._fd = open_output(self.temp_path, append=True)
            try:
                self._continue(resume)
            except BaseException:
                self.abort()
                raise

    def _continue(self, part: WrittenPart) -> None:
        """Cut the partial file back to ``part`` and take up its samples, sizes and CRC."""
        assert self._fd is not None
        if os.fstat(self._fd).st_size < part.size:
            raise ShardError(self.temp_path, None, f"holds fewer than the {part.size} bytes recorded")
        os.ftruncate(self._fd, part.size)
        with (
            SampleStream(self.temp_path, read_data=False, read_ahead=False, where=True) as stream,
            open(self.temp_path, "rb", buffering=0) as reader,
        ):
            lengths = array("q", part.lengths)
            while (sample := stream.next_sample()) is not None:
                assert sample.members is not None
                headers = [os.pread(reader.fileno(), data - at, at) for _, at, data, _ in sample.members]
                length = lengths[self.num_samples] if self.num_samples < len(lengths) else None
                self._table.add_sample(sample.key, sample.offset, sample.members, length, headers)
                self.num_samples += 1
            end = stream.resume_offset
        if self.num_samples != part.samples or end != part.size:
            raise ShardError(self.temp_path, end, f"holds {self.num_samples} samples, not the {part.samples} recorded")
        self.size, self.crc32 = part.size, part.crc32

    def written(self) -> WrittenPart:
        """What is written so far (durable once the partial file is fsync'd)."""
        return WrittenPart(self.size, self.crc32, self.num_samples, self._table.lengths_bytes())

    def add(self, key: str, fields: Sequence[tuple[str, Sequence[BytesLike]]], length: int | None = None) -> None:
        """Append one sample: ``fields`` is ``[(field_name, [buffer, ...]), ...]``; its
        ``length`` (frames, or 10 ms of audio) goes into the member table when given."""
        buffers: list[BytesLike] = []
        members = []
        headers = []
        start = at = self.size
        for name, parts in fields:
            size = sum(len(part) for part in parts)
            header = _member_header(f"{key}.{name}", size)
            members.append((name, at, at + len(header), size))
            headers.append(header)
            buffers.append(header)
            buffers.extend(parts)
            buffers.append(_padding(size))
            at += len(header) + size + (-size % BLOCK)
        self._write(buffers)
        if members:
            self._table.add_sample(key, start, members, length, headers)
        self.num_samples += 1

    def _write(self, buffers: list[BytesLike]) -> None:
        assert self._fd is not None, "shard already committed or aborted"
        for buffer in buffers:
            self.crc32 = zlib.crc32(buffer, self.crc32)
        total = sum(len(buffer) for buffer in buffers)
        with writing(self.temp_path):
            written = os.writev(self._fd, buffers)
            while written < total:  # rare short write: finish it buffer by buffer
                remaining = memoryview(b"".join(bytes(b) for b in buffers))[written:]
                written += os.write(self._fd, remaining)
        self.size += total

    def commit(self) -> None:
        """Finish the archive, flush it to disk and rename it to its final name.

        On failure (a full disk, say) the partial file is removed and OutputError raised.
        """
        try:
            samples_end = self.size
            end = 2 * BLOCK
            end += -(self.size + end) % RECORD
            self._write([bytes(end)])
            assert self._fd is not None
            with writing(self.temp_path):
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None
                os.replace(self.temp_path, self.path)
                fsync_directory(self.path.parent)
        except BaseException:
            self.abort()
            raise
        if has_table_format(str(self.path)):
            self._table.finish(self.path, samples_end).save(self.path, self.root)

    def close(self) -> None:
        """Stop writing, keeping the partial file (a rerun may continue it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def abort(self) -> None:
        """Drop the partial file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.temp_path.unlink(missing_ok=True)


@dataclass(slots=True)
class Member:
    """A regular file in a tar: its name, where its first header starts, and its bytes
    (a memoryview of the mapped file for plain shards, bytes for gzip'd ones), and where they
    start and how many there are (also when they were not read)."""

    name: str
    offset: int
    data: bytes | memoryview
    data_at: int = 0
    size: int = 0


def _octal(field_bytes: bytes, path: str | Path, offset: int) -> int:
    if field_bytes and field_bytes[0] & 0x80:  # GNU base-256 for large numbers
        value = int.from_bytes(field_bytes[1:], "big")
        return -value if field_bytes[0] & 0x40 else value
    text = field_bytes.split(b"\0", 1)[0]
    try:
        return int(text, 8) if text.strip() else 0
    except ValueError:
        raise ShardError(path, offset, f"tar header has a malformed number {text!r}") from None


def _cstring(field_bytes: bytes) -> str:
    return field_bytes.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _parse_pax(data: bytes, path: str, offset: int) -> dict[str, str]:
    records: dict[str, str] = {}
    pos = 0
    try:
        while pos < len(data):
            space = data.index(b" ", pos)
            length = int(data[pos:space])
            if length <= space - pos:
                raise ValueError(f"record length {length}")
            key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
            records[key.decode("utf-8")] = value.decode("utf-8", "surrogateescape")
            pos += length
    except (ValueError, UnicodeDecodeError) as error:
        raise ShardError(path, offset, f"malformed pax extended header ({error})") from None
    size = records.get("size", "0")
    if not (size.isascii() and size.isdigit() and len(size) <= 20):  # int() refuses over 4300 digits
        raise ShardError(path, offset, f"malformed pax size {size[:40]!r}")
    return records


class MappedBytes:
    """A file read through read-only memory maps of ``MAP_CHUNK`` bytes: reads are views,
    not copies. A chunk is unmapped when the last view into it is gone, so the mapped pages
    a reader keeps are those its buffered samples use."""

    def __init__(self, path: str, ahead: ReadAhead | None = None, file: BinaryIO | None = None):
        self.path = path
        self._ahead = ahead
        self._file = file or os.fdopen(open_input(path), "rb")  # open until close(): chunks are mapped from it
        self.size = os.fstat(self._file.fileno()).st_size
        self._chunk = memoryview(b"")
        self._chunk_start = self._chunk_end = 0
        self._pos = 0
        self._advised = 0

    def _map(self, start: int, end: int) -> None:
        base = start - start % mmap.ALLOCATIONGRANULARITY
        length = min(self.size, max(end, base + MAP_CHUNK)) - base
        chunk = mmap.mmap(self._file.fileno(), length, access=mmap.ACCESS_READ, offset=base)
        if hasattr(mmap, "MADV_SEQUENTIAL"):
            chunk.madvise(mmap.MADV_SEQUENTIAL)
        self._chunk, self._chunk_start, self._chunk_end = memoryview(chunk), base, base + length

    def seek(self, position: int) -> None:
        self._pos = position
        self._advised = max(self._advised, position)

    def read(self, size: int) -> memoryview:
        end = min(self._pos + size, self.size)
        if end <= self._pos:
            return memoryview(b"")
        view = self.view(self._pos, end)
        self._pos = end
        return view

    def view(self, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` (inside the file) as a view, reading ahead of ``end``."""
        if start < self._chunk_start or end > self._chunk_end:
            self._map(start, end)
        if self._ahead is not None and end + READ_AHEAD // 2 > self._advised and self._advised < self.size:
            self._ahead.submit(self._file.fileno(), self._advised, min(READ_AHEAD, self.size - self._advised))
            self._advised += READ_AHEAD
        return self._chunk[start - self._chunk_start : end - self._chunk_start]

    def skip(self, size: int) -> None:
        self._pos += size

    def close(self) -> None:
        self._chunk = memoryview(b"")
        self._file.close()


class _StreamedBytes:
    """A file read through a buffered (or gzip) stream: reads are new bytes objects."""

    def __init__(self, stream: BinaryIO):
        self._stream = stream

    def seek(self, position: int) -> None:
        self._stream.seek(position)

    def read(self, size: int) -> bytes:
        return self._stream.read(size)

    def skip(self, size: int) -> None:
        self._stream.seek(size, 1)

    def close(self) -> None:
        self._stream.close()


class TarStream(Closing):
    """Reads a tar file front to back from ``start`` (a header offset), member by member.

    ``position`` is always the offset of the next header to be read, so a reader can save
    it and come back to the same place. ``.gz``/``.tgz`` files are decompressed on the fly
    (offsets then count decompressed bytes and restarting mid-file re-reads its prefix).
    Plain shards are memory-mapped and read ahead on a background thread unless
    ``read_ahead=False`` (for walks over headers only).
    """

    def __init__(self, path: str | Path, start: int = 0, read_ahead: bool = True, access: RemoteAccess | None = None):
        self.path = str(path)
        self._source = _open_for_reading(self.path, read_ahead, access)
        self.position = 0
        self.ended_cleanly = False  # True once the end-of-archive block has been read
        if start:
            self._source.seek(start)
            self.position = start

    def close(self) -> None:
        self._source.close()

    def seek(self, position: int) -> None:
        """Go on from the header at ``position`` (for reading out of order)."""
        self._source.seek(position)
        self.position = position
        self.ended_cleanly = False

    def __iter__(self) -> Iterator[Member]:
        while (member := self.next_member()) is not None:
            yield member

    def _read_exact(self, size: int, what: str) -> bytes | memoryview:
        if getattr(self._source, "size", None) is None:  # a stream: memory grows with the bytes that arrive
            data = _read_in_pieces(self._source, size)
        else:
            data = self._source.read(size)
        if len(data) != size:
            raise ShardError(self.path, self.position, f"file ends inside {what} (truncated shard?)")
        self.position += size
        return data

    def next_member(self, read_data: bool = True) -> Member | None:
        """The next regular file, or None at the end of the archive.

        With ``read_data=False`` the member's bytes are skipped (``data`` is empty).
        """
        start = self.position
        long_name: str | None = None
        pax: dict[str, str] = {}
        while True:
            header_at = self.position
            header = bytes(self._source.read(BLOCK))
            if header == _ZERO_BLOCK:
                self.ended_cleanly = True
                return None
            if not header:
                return None
            if len(header) < BLOCK:
                raise ShardError(self.path, header_at, "file ends inside a tar header (truncated shard?)")
            self.position += BLOCK
            _check_header(header, self.path, header_at)
            size = _octal(header[124:136], self.path, header_at)
            kind = header[156:157]
            if "size" in pax:
                size = int(pax["size"])
            extension = kind in (b"x", b"g", b"L", b"K")
            self._check_declared(size, header_at, "a tar extension header" if extension else "a member")
            if extension:
                data = bytes(self._read_exact(size, "a tar extension header"))
                self._skip(-size % BLOCK)
                if kind == b"x":
                    pax.update(_parse_pax(data, self.path, header_at))
                elif kind == b"L":
                    long_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
                continue
            if kind not in (b"0", b"\0", b"7"):  # directories, links, devices: no sample data
                self._skip(size + (-size % BLOCK))
                start, long_name, pax = self.position, None, {}
                continue
            name = pax.get("path") or long_name or _ustar_name(header)
            data_at = self.position
            if read_data:
                data = self._read_exact(size, f"member {name!r}")
                self._skip(-size % BLOCK)
            else:
                data = b""
                self._skip(size + (-size % BLOCK))
            return Member(name, start, data, data_at, size)

    def _check_declared(self, size: int, header_at: int, what: str) -> None:
        """A declared size must fit the bytes that exist (where the file's length is known) and
        the limit of its kind (extension headers; members of a stream, which are held whole),
        before anything is read or allocated for it."""
        total = getattr(self._source, "size", None)
        if size < 0:
            raise ShardError(self.path, header_at, f"tar header declares a negative size ({size}): a damaged shard")
        if total is not None and self.position + size > total:
            raise ShardError(
                self.path,
                header_at,
                f"tar header declares {what} of {size} bytes but the file has {max(total - self.position, 0)} left "
                "(truncated or damaged shard?)",
            )
        limit = MAX_EXTENSION_BYTES if what != "a member" else MAX_STREAMED_MEMBER if total is None else None
        if limit is not None and size > limit:
            raise ShardError(
                self.path, header_at, f"tar header declares {what} of {size} bytes, beyond {limit} (a damaged shard?)"
            )

    def _skip(self, size: int) -> None:
        if size:
            self._source.skip(size)
            self.position += size


def _read_in_pieces(source: Any, size: int) -> bytes:
    """Up to ``size`` bytes of a stream of unknown length, read ``STREAM_PIECE`` at a time."""
    pieces = []
    while size > 0 and (piece := source.read(min(size, STREAM_PIECE))):
        pieces.append(piece)
        size -= len(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _ustar_name(header: bytes) -> str:
    name = _cstring(header[0:100])
    if header[345] and header[257:262] == b"ustar":
        prefix = _cstring(header[345:500])
        if prefix:
            name = f"{prefix}/{name}"
    return name


def _check_header(header: bytes, path: str, offset: int) -> None:
    field = header[148:156]
    stored = _octal(field, path, offset)
    # The checksum is the sum of the header's bytes (its own field counted as spaces). The low
    # half of adler32 is 1 + that sum modulo 65521, computed in C: 0.2 us against 3.7 us for
    # sum() on 512 bytes, the largest cost of reading a member. A sum off by a multiple of
    # 65521 needs many bytes changed at once; a mismatch modulo 65521 is checked exactly below.
    if ((zlib.adler32(header) & 0xFFFF) - 1 - sum(field) + 8 * 32 - stored) % 65521 == 0:
        return
    unsigned = sum(header) - sum(field) + 8 * 32
    if stored != unsigned:
        signed = unsigned - 2 * sum(b for b in header[:148] + header[156:] if b > 127)
        if stored != signed:
            raise ShardError(path, offset, "tar header checksum mismatch (damaged shard?)")


class _FileOver:
    """A byte source seen as a readable file (for gzip over a remote shard)."""

    def __init__(self, source: Any):
        self._source = source
        self._pos = 0

    def read(self, size: int = -1) -> bytes:
        data = bytes(self._source.read(size if size >= 0 else 1 << 62))
        self._pos += len(data)
        return data

    def seek(self, position: int, whence: int = 0) -> int:
        self._pos = position if whence == 0 else self._pos + position
        self._source.seek(self._pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        self._source.close()


def _open_for_reading(path: str, read_ahead: bool, access: RemoteAccess | None) -> Any:
    """A byte source over ``path``: a mapped local file (read ahead by ``access``'s thread), a
    cached copy of a remote shard, ranged reads or a command's output; gzip streams of them."""
    if is_remote(path):
        if access is None:
            raise ShardError(path, None, "a remote shard needs the loader's remote access to be read (no access given)")
        compressed = path.endswith((".gz", ".tgz"))
        cached = access.cached_copy(path)
        if cached is not None:  # read like a local shard
            if compressed:
                return _StreamedBytes(gzip.GzipFile(fileobj=cached, mode="rb"))  # type: ignore[arg-type]
            return MappedBytes(cached.name, access.read_ahead() if read_ahead else None, file=cached)
        source = access.open_bytes(path)
        if compressed:
            return _StreamedBytes(gzip.GzipFile(fileobj=_FileOver(source), mode="rb"))  # type: ignore[arg-type]
        return source
    try:
        if path.endswith((".gz", ".tgz")):
            os.close(open_input(path))  # a regular file (a FIFO or a device would hang or never end)
            return _StreamedBytes(gzip.open(path, "rb"))  # type: ignore[arg-type]
        return MappedBytes(path, access.read_ahead() if read_ahead and access is not None else None)
    except OSError as error:
        raise ShardError(path, None, f"cannot open shard: {error.strerror}") from error


@dataclass
class TarRecord:
    """Members sharing one key, in file order: ``fields`` maps ``FIELD`` to its bytes (the
    loader's stages work on :class:`seqshard.pipeline.stages.sample.Sample`, made from it)."""

    key: str
    fields: dict[str, bytes | memoryview] = field(default_factory=dict)
    offset: int = 0
    ordinal: int = 0
    members: list[tuple[str, int, int, int]] | None = None  # (suffix, header at, data at, size), when asked


class OverTar(Closing):
    """What the sample streams read through a :class:`TarStream` (``_tar``) share: the tar's
    path, whether its end marker was reached, where the next sample starts, closing it."""

    _tar: TarStream

    @property
    def path(self) -> str:
        return self._tar.path

    @property
    def ended_cleanly(self) -> bool:
        """Whether the tar end marker was reached (False for a shard cut at a member boundary)."""
        return self._tar.ended_cleanly

    @property
    def resume_offset(self) -> int:
        return self._tar.position

    def close(self) -> None:
        self._tar.close()


class SampleStream(OverTar):
    """Groups a :class:`TarStream`'s members into samples by key.

    ``resume_offset`` is where the next sample's first member starts and ``ordinal`` its
    index in the shard; passing both back as ``start``/``ordinal`` continues from there.
    Members whose names have no ``KEY.FIELD`` form (e.g. a ``README``) are passed over.
    ``read_data=False`` walks the headers only (the samples' fields are empty);
    ``where=True`` says where each sample's members lie (``TarRecord.members``).
    """

    def __init__(
        self,
        path: str | Path,
        start: int = 0,
        ordinal: int = 0,
        read_data: bool = True,
        read_ahead: bool = True,
        access: RemoteAccess | None = None,
        where: bool = False,
    ):
        self._tar = TarStream(path, start, read_ahead=read_ahead and read_data, access=access)
        self._read_data = read_data
        self._where = where
        self._pending: Member | None = None
        self.ordinal = ordinal

    @property
    def resume_offset(self) -> int:
        return self._pending.offset if self._pending is not None else self._tar.position

    def seek(self, offset: int, ordinal: int) -> None:
        """Go on from the sample whose first member's header is at ``offset`` (number
        ``ordinal`` of the shard): samples read out of order, each by its headers."""
        self._pending = None
        self._tar.seek(offset)
        self.ordinal = ordinal

    def __iter__(self) -> Iterator[TarRecord]:
        while (sample := self.next_sample()) is not None:
            yield sample

    def _next_split_member(self) -> tuple[Member, str, str] | None:
        while True:
            member = self._pending or self._tar.next_member(self._read_data)
            self._pending = None
            if member is None:
                return None
            split = split_member_name(member.name)
            if split is not None:
                return member, split[0], split[1]

    def next_sample(self) -> TarRecord | None:
        """The next sample, or None at the end of the shard."""
        first = self._next_split_member()
        if first is None:
            return None
        member, key, name = first
        sample = TarRecord(key, {name: member.data}, member.offset, self.ordinal)
        if self._where:
            sample.members = [(name, member.offset, member.data_at, member.size)]
        while True:
            following = self._tar.next_member(self._read_data)
            if following is None:
                break
            split = split_member_name(following.name)
            if split is None:
                continue
            if split[0] != key:
                self._pending = following
                break
            sample.fields[split[1]] = following.data
            if sample.members is not None:
                sample.members.append((split[1], following.offset, following.data_at, following.size))
        self.ordinal += 1
        return sample


def member_table(path: str | Path) -> MemberTable:
    """The member table of the local tar ``path``, from its headers (see ``members.py``);
    ShardError when it cannot be read to its end-of-archive block."""
    builder = TableBuilder()
    with SampleStream(path, read_data=False, read_ahead=False, where=True) as stream:
        while (sample := stream.next_sample()) is not None:
            assert sample.members is not None
            builder.add_sample(sample.key, sample.offset, sample.members)
        if not stream.ended_cleanly:
            raise ShardError(path, stream.resume_offset, "the shard ends without the tar end marker (cut short?)")
        end = stream.resume_offset
    return builder.finish(path, end)
