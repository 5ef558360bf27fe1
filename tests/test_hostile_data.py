"""What hostile data can still cost once sizes are checked: time quadratic in the gzip members
of one field, memory a stream allocates for the size it is asked for, Python's own limits
(4300-digit integers, recursion) and the temporary arrays of a token index check. Each is a
named error or bounded work, never a traceback, a MemoryError or minutes per sample."""

import gzip
import json
import tarfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from seqshard.errors import ShardError
from seqshard.formats.fields import decode_field
from seqshard.formats.npy import decode_npy
from seqshard.formats.peers.lists import READ_ERROR_FIELD, ListSampleStream, scan_list
from seqshard.formats.peers.mmidx import check_sequences
from seqshard.formats.tar import SampleStream

MB = 1 << 20


def header(name: str, size: int, kind: bytes = tarfile.REGTYPE) -> bytes:
    """One tar header block declaring ``size`` bytes."""
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = size
    return info.tobuf(tarfile.USTAR_FORMAT)


def member(name: str, data: bytes, kind: bytes = tarfile.REGTYPE) -> bytes:
    return header(name, len(data), kind) + data + bytes(-len(data) % 512)


def pax(**records: str) -> bytes:
    """A pax extended header holding ``records`` (each record counts its own length)."""
    data = b""
    for key, value in records.items():
        body = f" {key}={value}\n".encode()
        length = len(body) + 1
        while len(str(length)) + len(body) != length:
            length = len(str(length)) + len(body)
        data += str(length).encode() + body
    return member("PaxHeader", data, tarfile.XHDTYPE)


END = bytes(1024)


def test_many_gzip_members_in_one_field_inflate_in_linear_time():
    many = gzip.compress(b"") * 100_000  # 2 MB: zlib copies the input left after each member
    start = time.perf_counter()
    assert decode_field("txt.gz", many) == ""
    assert time.perf_counter() - start < 5  # 0.2 s fed in pieces; fed whole 8 s (200,000 members: 40 s)
    assert decode_field("txt.gz", gzip.compress(b"two ") + gzip.compress(b"members")) == "two members"


def test_a_member_of_a_gzip_shard_is_read_as_its_bytes_arrive(tmp_path):
    path = tmp_path / "cut.tar.gz"
    path.write_bytes(gzip.compress(member("a.txt", b"first") + header("k.txt", 512 * MB) + b"ten bytes."))
    tracemalloc.start()
    try:
        with pytest.raises(ShardError, match=r"file ends inside member 'k\.txt' \(truncated shard\?\)"):
            list(SampleStream(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * MB  # GzipFile.read(n) allocates n bytes before it reads: 512 MB for ten bytes
    data = np.random.default_rng(0).bytes(3 * MB)  # three read pieces come back whole
    path.write_bytes(gzip.compress(member("k.bin", data) + member("k.txt", b"t") + END, 1))
    (sample,) = list(SampleStream(path))
    assert bytes(sample.fields["bin"]) == data and bytes(sample.fields["txt"]) == b"t"


def test_a_pax_size_of_thousands_of_digits_is_a_damaged_shard(tmp_path):
    path = tmp_path / "s.tar"
    path.write_bytes(member("a.txt", b"first") + pax(size="9" * 5000) + member("k.txt", b"x") + END)
    with pytest.raises(ShardError, match=r"s\.tar at byte 1024: malformed pax size '9999"):  # not int()'s ValueError
        list(SampleStream(path))


def npy_with_header(shape: tuple, payload: bytes) -> bytes:
    text = repr({"descr": "<f4", "fortran_order": False, "shape": shape}).encode()
    text += b" " * (-(len(text) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + payload


def test_an_npy_header_with_a_negative_dimension_is_refused():
    assert decode_npy(npy_with_header((2, 3), bytes(24))).shape == (2, 3)
    for shape in [(-1,), (2, -1), (-1, 3)]:  # numpy's header reader takes them; -1 read "all there is"
        with pytest.raises(ValueError, match="negative dimension"):
            decode_npy(npy_with_header(shape, bytes(24)))


def test_list_lines_beyond_pythons_limits_are_malformed_lines(tmp_path):
    lines = [
        b'{"key": "deep", "wav": "a.wav", "x": ' + b"[" * 100_000 + b"\n",  # RecursionError
        b'{"key": "digits", "wav": "a.wav", "start": 1' + b"0" * 5000 + b', "end": 2}\n',  # ValueError (4300 digits)
        b'{"key": "infinite", "wav": "a.wav", "start": 0, "end": 1e999}\n',  # OverflowError when cut
        b'{"key": "nan", "wav": "a.wav", "start": NaN, "end": 1}\n',
    ]
    path = tmp_path / "data.list"
    path.write_bytes(b"".join(lines))
    assert scan_list(path) == 4
    with ListSampleStream(path, read_data=False) as stream:
        problems = [stream.next_sample().fields.get(READ_ERROR_FIELD, b"") for _ in lines]
    assert [p.split(b"\t")[0] for p in problems] == [b"malformed_line"] * 4
    assert b"not JSON" in problems[0] and b"not JSON" in problems[1]
    assert b"finite numbers of seconds (found 0, inf)" in problems[2]
    json.loads(lines[3])  # NaN is JSON to Python, not a number of seconds
    assert b"found nan, 1" in problems[3]


def test_a_token_index_is_checked_in_bounded_memory():
    count = 4 << 20
    sizes = np.random.default_rng(0).integers(1, 1000, count).astype("<i4")
    pointers = np.zeros(count, np.int64)
    np.cumsum(sizes[:-1].astype(np.int64) * 2, out=pointers[1:])
    total = int(sizes.sum(dtype=np.int64)) * 2
    tracemalloc.start()
    try:
        check_sequences(sizes, pointers, 2, total, Path("d.idx"), Path("d.bin"))
        peak = tracemalloc.get_traced_memory()[1]
        pointers[3 << 20] += 2
        with pytest.raises(ShardError, match=f"sequence {3 << 20} starts at byte"):
            check_sequences(sizes, pointers, 2, total, Path("d.idx"), Path("d.bin"))
    finally:
        tracemalloc.stop()
    assert peak < 48 * MB  # a block at a time: whole, 24 bytes a sequence (24 GB for a billion)
