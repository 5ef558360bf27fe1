"""Member tables: where every sample's members lie in a tar shard, so that a reader slices its
memory map instead of parsing a 512-byte header per member in Python.

A table is a small ``.npz`` beside its tar, ``FOLDER/.members/NAME.tar.npz`` (hidden: no glob
of the shards selects it, and the tar itself is untouched, so ``tar``, WebDataset and wids
read it as before). The packer and ``add-field`` write it with each shard and sidecar;
``seqshard index`` builds it for shards other tools wrote. It holds, as arrays: each sample's
key and resume offset (where its first header starts), each member's header offset, data
offset, size and suffix, the file's size, a CRC-32 of the header bytes of every block of
``CHECK_EVERY`` samples, and (when its writer knew them) each sample's length in the index's
unit (frames of the feature field, or 10 ms of audio): what lets a loader plan an epoch's
batches without reading a sample (``loader.heaviest_batches``, ``loader.skip_batches``).

A reader trusts a table only as far as it checks it against the file: the file's size when it
opens it, before it hands out a block's first sample the block's header bytes (their CRC-32)
and what they say of each member (name, size, place: :meth:`MemberTable.headers_agree`), and
the end-of-archive block. A table that disagrees (damaged, edited, or the shard changed after
it was written) is not used from there on: the shard is read by its headers (``sliced.py``). A
table that is not consistent in itself cannot be read (ShardError naming the shard). A shard
without a table is read by parsing its headers, as before.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import tempfile
import zipfile
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ShardError
from .files import default_file_mode, inside, open_input, writing
from .inflation import MIN_INFLATION_LIMIT, InflationError, inflation_limit, limits_text
from .npy import npy_header_size, npy_layout

TABLE_DIR = ".members"
VERSION = 1
CHECK_EVERY = 64  # samples whose header bytes are checked at once
REBUILD = "Fix: if the shard is right (`seqshard verify`), rebuild its table with `seqshard index` on its folder."
_SEPARATOR = b"\0"  # between keys, and between suffixes: tar names hold no NUL


def table_path(shard: str | Path) -> Path:
    """Where the member table of ``shard`` (a local tar file) lives."""
    shard = Path(shard)
    return shard.parent / TABLE_DIR / f"{shard.name}.npz"


def has_table_format(shard: str) -> bool:
    """Whether a shard of this name can have a member table (local, uncompressed tars)."""
    return shard.endswith(".tar") and "://" not in shard


@dataclass(frozen=True, eq=False)
class MemberTable:
    """One shard's member table (see the module docstring). Sample ``i``'s members are
    ``first_member[i]`` to ``first_member[i + 1]``; ``sample_offsets[-1]`` is where reading
    stops (the end-of-archive block)."""

    file_size: int
    keys: tuple[str, ...]
    sample_offsets: np.ndarray  # int64, one per sample and one for the end
    first_member: np.ndarray  # int64, one per sample and one for the end
    header_offsets: np.ndarray  # int64 per member: its first header (a pax header, when it has one)
    data_offsets: np.ndarray  # int64 per member
    sizes: np.ndarray  # int64 per member
    suffix_ids: np.ndarray  # int32 per member: its suffix in ``suffixes``
    suffixes: tuple[str, ...]
    header_crcs: np.ndarray  # uint32 per block of CHECK_EVERY samples
    lengths: np.ndarray | None = None  # int64 per sample, when its writer knew them (see the module docstring)

    @property
    def num_samples(self) -> int:
        return len(self.keys)

    @property
    def end(self) -> int:
        return int(self.sample_offsets[-1])

    def block_crc(self, block: int, data: memoryview, base: int = 0) -> int:
        """CRC-32 of the header bytes of block ``block``'s members (one after the other), read
        from ``data`` (bytes of the file from offset ``base``)."""
        first, last = self.block_members(block)[2:]
        crc = 0
        for start, end in zip(
            (self.header_offsets[first:last] - base).tolist(), (self.data_offsets[first:last] - base).tolist()
        ):
            crc = zlib.crc32(data[start:end], crc)  # a C call per member: cheaper than gathering them
        return crc

    def block_members(self, block: int) -> tuple[int, int, int, int]:
        """``(first sample, end sample, first member, end member)`` of block ``block``."""
        low, high = block * CHECK_EVERY, min((block + 1) * CHECK_EVERY, self.num_samples)
        return low, high, int(self.first_member[low]), int(self.first_member[high])

    def headers_agree(self, block: int, data: memoryview, base: int = 0) -> bool:
        """Whether the tar headers of block ``block``'s members, read from ``data`` (bytes of
        the file from offset ``base``, a header's), say what the table says: each member's
        name (``KEY.SUFFIX``) and size, a regular file, one after the other as a walk over the
        headers finds them (to the next block's first header, or the end). Checked at once for
        the whole block in numpy. False also where this check cannot tell: a block with pax or
        GNU long-name headers, a ustar name prefix, entries between members, or a size written
        otherwise than in 11 octal digits (a walk over the headers must tell)."""
        if not self._plain_blocks[block]:
            return False
        low, high, first, last = self.block_members(block)
        sizes = self.sizes[first:last]
        blocks = np.frombuffer(data[: len(data) - len(data) % _HEADER], dtype=np.uint8).reshape(-1, _HEADER)
        headers = blocks[(self.header_offsets[first:last] - base) // _HEADER]  # tar headers start at multiples of 512
        size_end, kind = headers[:, 135], headers[:, 156]
        if (
            not np.array_equal(headers[:, 124:135], ((sizes[:, None] >> _OCTAL_SHIFTS) & 7 | 48).astype(np.uint8))
            or not np.all((size_end == 0) | (size_end == 32))
            or not np.all((kind == 48) | (kind == 0) | (kind == 55))  # a regular file: "0", NUL (old tars), "7"
            or np.any(headers[:, 345])  # a ustar name prefix
        ):
            return False
        counts = np.diff(self.first_member[low : high + 1]).tolist()
        keys = [key for key, count in zip(self.keys[low:high], counts) for _ in range(count)]
        suffixes = [self.suffixes[i] for i in self.suffix_ids[first:last].tolist()]
        # one encoding for the block (tar names hold no NUL), not one a member
        joined = "\0".join([f"{key}.{suffix}" for key, suffix in zip(keys, suffixes)])
        names = joined.encode("utf-8", "surrogateescape").split(b"\0")
        if max(map(len, names)) > _NAME_BYTES:
            return False
        expected = np.array(names, dtype=f"S{_NAME_BYTES}").view(np.uint8).reshape(-1, _NAME_BYTES)  # NUL-padded
        return bool(np.array_equal(headers[:, :_NAME_BYTES], expected))

    @functools.cached_property
    def _plain_blocks(self) -> np.ndarray:
        """Per block, whether the table puts each of its members right after one 512-byte
        header, each sample at its first member's header (the first at byte 0) and each
        member's header where the one before it ends (padded to 512 bytes), and no member at
        8 GiB or more: the layout :meth:`headers_agree` checks in numpy (computed once, for
        every block at once)."""
        if not self.num_samples:
            return np.zeros(0, dtype=bool)
        ends = self.data_offsets + self.sizes + (-self.sizes % _HEADER)
        following = np.append(self.header_offsets[1:], self.end)
        members = (self.data_offsets - self.header_offsets == _HEADER) & (ends == following) & (self.sizes < 8**11)
        samples = self.sample_offsets[:-1] == self.header_offsets[self.first_member[:-1]]
        samples[0] &= self.sample_offsets[0] == 0  # else what precedes the first sample is walked over
        firsts = self.first_member[::CHECK_EVERY][: len(self.header_crcs)]
        return np.logical_and.reduceat(members, firsts) & np.logical_and.reduceat(
            samples, np.arange(0, self.num_samples, CHECK_EVERY)
        )

    def block_span(self, block: int) -> tuple[int, int]:
        """The bytes from the first header to the last data byte of block ``block``."""
        low, _, first, last = self.block_members(block)
        if first == last:
            return int(self.sample_offsets[low]), int(self.sample_offsets[low])
        return int(self.header_offsets[first]), int(self.data_offsets[last - 1] + self.sizes[last - 1])

    def same_as(self, other: MemberTable) -> bool:
        """Whether both describe the same bytes the same way (lengths describe the data, and a
        table made from headers alone has none: they are not compared)."""
        return (
            self.file_size == other.file_size
            and self.keys == other.keys
            and self.suffixes == other.suffixes
            and all(np.array_equal(getattr(self, name), getattr(other, name)) for name in _ARRAYS)
        )

    def save(self, shard: str | Path, root: str | Path | None = None) -> Path:
        """Write the table of ``shard`` atomically (a temporary name, then a rename), inside
        ``root``, the folder being written (default: the shard's own; see ``files.inside``)."""
        path = inside(Path(shard).parent if root is None else root, table_path(shard))
        with writing(path):
            path.parent.mkdir(exist_ok=True)
            descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
            try:
                with os.fdopen(descriptor, "wb") as stream:
                    np.savez(
                        stream,
                        version=np.array(VERSION),
                        file_size=np.array(self.file_size, dtype=np.int64),
                        keys=_join(self.keys),
                        suffixes=_join(self.suffixes),
                        **{name: getattr(self, name) for name in _ARRAYS},
                        **({"lengths": self.lengths} if self.lengths is not None else {}),
                    )
                    os.fchmod(stream.fileno(), default_file_mode())
                    stream.flush()
                    os.fsync(stream.fileno())
                os.replace(temporary, path)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
        return path


_HEADER = 512  # a tar header; headers_agree reads its name (bytes 0-99), size (124-135: 11 octal
_NAME_BYTES = 100  # digits, then NUL or space), type flag (156) and name prefix (345-499)
_OCTAL_SHIFTS = np.arange(30, -1, -3, dtype=np.int64)  # of the 11 octal digits of a size, first to last

_ARRAYS = (
    "sample_offsets",
    "first_member",
    "header_offsets",
    "data_offsets",
    "sizes",
    "suffix_ids",
    "header_crcs",
)


def _join(names: Sequence[str]) -> np.ndarray:
    blob = _SEPARATOR.join(name.encode("utf-8", "surrogateescape") for name in names)
    return np.frombuffer(blob, dtype=np.uint8)


def _split(blob: np.ndarray, count: int) -> tuple[str, ...]:
    if count == 0:
        return ()
    return tuple(blob.tobytes().decode("utf-8", "surrogateescape").split("\0"))


def load_table(shard: str | Path) -> MemberTable | None:
    """The member table of ``shard``, None when it has none; a table that cannot be read, or
    is not consistent in itself, raises ShardError naming the shard."""
    path = table_path(shard)
    try:
        arrays = _read_arrays(path, os.stat(shard).st_size)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as error:
        raise ShardError(shard, None, f"its member table {path} cannot be read ({error}). {REBUILD}") from None
    try:
        if int(arrays["version"]) != VERSION:
            raise ValueError(f"version {int(arrays['version'])}, not {VERSION}")
        offsets = arrays["sample_offsets"].astype(np.int64, copy=False)
        first = arrays["first_member"].astype(np.int64, copy=False)
        members = len(arrays["sizes"])
        suffixes = _split(arrays["suffixes"], int(arrays["suffix_ids"].max(initial=-1)) + 1)
        table = MemberTable(
            int(arrays["file_size"]),
            _split(arrays["keys"], len(offsets) - 1),
            offsets,
            first,
            arrays["header_offsets"].astype(np.int64, copy=False),
            arrays["data_offsets"].astype(np.int64, copy=False),
            arrays["sizes"].astype(np.int64, copy=False),
            arrays["suffix_ids"].astype(np.int32, copy=False),
            suffixes,
            arrays["header_crcs"].astype(np.uint32, copy=False),
            arrays["lengths"].astype(np.int64, copy=False) if "lengths" in arrays else None,
        )
        _check_consistent(table, members)
    except (KeyError, ValueError, TypeError) as error:
        raise ShardError(shard, None, f"its member table {path} is damaged ({error}). {REBUILD}") from None
    return table


_BLOBS = ("keys", "suffixes")  # names joined by NUL, as uint8
_MAX_HEADER = 4096  # bytes of an array's .npy header (numpy writes 128)
_NUMBERS = ("version", "file_size")  # one integer each
_OPTIONAL = ("lengths",)  # arrays a table may lack (written before they were)


def _read_arrays(path: Path, shard_bytes: int) -> dict[str, np.ndarray]:
    """The arrays of the table ``path`` (an ``.npz``) of a shard of ``shard_bytes`` bytes, each
    checked before anything is allocated for it: a whole-number array (bytes for names, one
    number for version and size) whose declared size is what its zip entry holds, an entry
    inflating within the rule of ``inflation.py``, and no array larger than the shard itself
    (a table holds a few numbers per 512-byte tar header). ValueError naming what is wrong."""
    arrays = {}
    # a regular file only: a FIFO or a device at its name held the reader (NotAFileError says what it is)
    with os.fdopen(open_input(path), "rb") as file, zipfile.ZipFile(file) as archive:
        entries = {info.filename: info for info in archive.infolist()}
        for name in (*_NUMBERS, *_BLOBS, *_ARRAYS, *_OPTIONAL):
            info = entries.get(f"{name}.npy")
            if info is None and name in _OPTIONAL:
                continue
            if info is None:
                raise KeyError(f"it has no array {name!r}")
            if info.compress_type != zipfile.ZIP_STORED and info.file_size > inflation_limit(info.compress_size):
                raise InflationError(
                    f"array {name!r} of {info.compress_size} compressed bytes declares {info.file_size} ({limits_text()})"
                )
            with archive.open(info) as stream:
                start = stream.read(12)
                size = npy_header_size(start)
                if size > _MAX_HEADER:
                    raise ValueError(f"array {name!r} has a header of {size} bytes")
                header = start[:size] if size <= len(start) else start + stream.read(size - len(start))
                shape, dtype, _, declared = npy_layout(header)
                count = math.prod(shape)
                if (
                    dtype.kind not in "iu"
                    or (name in _NUMBERS and shape != ())
                    or (name not in _NUMBERS and len(shape) != 1)
                ):
                    raise ValueError(f"array {name!r} is {dtype} of shape {shape}, not the whole numbers of a table")
                if declared != info.file_size - size or declared > max(MIN_INFLATION_LIMIT, shard_bytes):
                    raise InflationError(
                        f"array {name!r} declares {declared} bytes where its entry holds {info.file_size - size} "
                        f"and the shard {shard_bytes}"
                    )
                arrays[name] = np.frombuffer(stream.read(declared), dtype=dtype, count=count).reshape(shape)
    return arrays


def _check_consistent(table: MemberTable, members: int) -> None:
    """Raise ValueError unless the table's arrays fit together and inside the file."""
    samples = table.num_samples
    if len(table.sample_offsets) != samples + 1 or len(table.first_member) != samples + 1:
        raise ValueError("its keys and sample offsets differ in number")
    if not (len(table.header_offsets) == len(table.data_offsets) == len(table.suffix_ids) == members):
        raise ValueError("its member arrays differ in length")
    if len(table.header_crcs) != -(-samples // CHECK_EVERY):
        raise ValueError("it has the wrong number of header checksums")
    if samples and (table.first_member[0] != 0 or table.first_member[-1] != members):
        raise ValueError("its samples do not cover its members")
    if np.any(np.diff(table.first_member) < 1) or np.any(np.diff(table.sample_offsets) <= 0):
        raise ValueError("its samples are not in file order")
    data_ends = table.data_offsets + table.sizes
    if members and (
        np.any(table.sizes < 0)
        or np.any(table.header_offsets[1:] < data_ends[:-1])
        or np.any(table.data_offsets - table.header_offsets < 512)
        or table.header_offsets[0] < 0
        or data_ends[-1] > table.end
    ):
        raise ValueError("its members overlap or lie outside the file")
    if table.end + 512 > table.file_size:
        raise ValueError("it ends outside the file")
    if np.any(table.suffix_ids < 0) or np.any(table.suffix_ids >= len(table.suffixes)):
        raise ValueError("it names member suffixes it does not have")
    if table.lengths is not None and (len(table.lengths) != samples or np.any(table.lengths < 0)):
        raise ValueError("its sample lengths are not one whole number >= 0 per sample")


class TableBuilder:
    """Collects a shard's members in file order (from its writer, or from reading its headers);
    :meth:`finish` gives the table. Held in compact arrays (about 85 bytes per sample of two
    members): a pack keeps hundreds of shards open at once. A writer hands over each sample's
    header bytes as it writes them, so that their checksums need no second read of the file."""

    def __init__(self) -> None:
        self._keys = bytearray()  # each key followed by the separator
        self._num_keys = 0
        self._sample_offsets = array("q")
        self._member_counts = array("I")
        self._header_offsets = array("q")
        self._header_lengths = array("I")
        self._sizes = array("q")
        self._suffix_ids = array("i")
        self._suffixes: dict[str, int] = {}
        self._crcs: array | None = array("I")  # per block of CHECK_EVERY samples; None: read them from the file
        self._lengths = array("q")  # -1: not known

    def add_sample(
        self,
        key: str,
        offset: int,
        members: Sequence[tuple[str, int, int, int]],
        length: int | None = None,
        headers: Sequence[bytes] | None = None,
    ) -> None:
        """Sample ``key`` whose first header is at ``offset``, with ``members`` as
        ``(suffix, header offset, data offset, size)``, in file order, its ``length`` when
        known (the table keeps lengths only when every sample's is), and ``headers``: each
        member's header bytes (from its header offset to its data offset), when at hand."""
        if self._crcs is not None:
            if headers is None:
                self._crcs = None
            else:
                if self._num_keys % CHECK_EVERY == 0:
                    self._crcs.append(0)
                crc = self._crcs[-1]
                for header in headers:
                    crc = zlib.crc32(header, crc)
                self._crcs[-1] = crc
        self._keys += key.encode("utf-8", "surrogateescape") + _SEPARATOR
        self._num_keys += 1
        self._lengths.append(-1 if length is None else int(length))
        self._sample_offsets.append(offset)
        self._member_counts.append(len(members))
        for suffix, header_at, data_at, size in members:
            self._header_offsets.append(header_at)
            self._header_lengths.append(data_at - header_at)
            self._sizes.append(size)
            self._suffix_ids.append(self._suffixes.setdefault(suffix, len(self._suffixes)))

    def lengths_bytes(self) -> bytes:
        """The samples' lengths so far, as int64 bytes (-1: not known)."""
        return self._lengths.tobytes()

    def finish(self, path: str | Path, end: int) -> MemberTable:
        """The table of the tar ``path``, whose samples end at ``end`` (its end marker)."""
        header_offsets = np.array(self._header_offsets, dtype=np.int64)
        first_member = np.zeros(self._num_keys + 1, dtype=np.int64)
        np.cumsum(np.array(self._member_counts, dtype=np.int64), out=first_member[1:])
        blocks = -(-self._num_keys // CHECK_EVERY)
        crcs = np.array(self._crcs if self._crcs is not None else np.zeros(blocks), dtype=np.uint32)
        table = MemberTable(
            os.stat(path).st_size,
            _split(np.frombuffer(self._keys[:-1], dtype=np.uint8), self._num_keys),
            np.append(np.array(self._sample_offsets, dtype=np.int64), end),
            first_member,
            header_offsets,
            header_offsets + np.array(self._header_lengths, dtype=np.int64),
            np.array(self._sizes, dtype=np.int64),
            np.array(self._suffix_ids, dtype=np.int32),
            tuple(self._suffixes),
            crcs,
            np.array(self._lengths, dtype=np.int64) if self._lengths and min(self._lengths) >= 0 else None,
        )
        if self._crcs is None and blocks:
            with open(path, "rb") as stream, mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                data = memoryview(mapped)
                for block in range(blocks):
                    table.header_crcs[block] = table.block_crc(block, data)
                data.release()
        return table
