"""What hostile data can still cost once sizes are checked: time quadratic in the gzip members
of one field, memory a stream allocates for the size it is asked for, Python's own limits
(4300-digit integers, recursion) and the temporary arrays of a token index check. Each is a
named error or bounded work, never a traceback, a MemoryError or minutes per sample."""

import contextlib
import gzip
import json
import os
import re
import tarfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import write_audio_dir, write_kaldi_dir
from seqshard.errors import InputError, ShardError
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


@contextlib.contextmanager
def never_waiting(fifo: Path):
    """Whatever opens ``fifo`` to read it gets an end of file at once (its write end is opened
    and closed whenever a reader has it open), so that code that would wait on it ends."""
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # fails while no one reads it
            except OSError:
                time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()


def _audio_inputs(root: Path, bad: str) -> dict[str, Callable[[bool], Any]]:
    """Each route that reads audio by path, over one good file and ``bad``; called with
    skip_bad, each returns the counts of what it dropped."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from seqshard import make_loader, pack_data

    good = write_audio_dir(root / "audio", utts=1)
    wav = good.root / "utt000.wav"
    (root / "wav.scp").write_text(f"a {wav}\nb {bad}\n")
    (root / "text").write_text("a x\nb y\n")
    (root / "m.json").write_text(
        "".join(json.dumps({"audio_filepath": p, "duration": 0.3, "text": "x"}) + "\n" for p in (str(wav), bad))
    )
    (root / "s.list").write_text(
        "".join(json.dumps({"key": k, "wav": p, "txt": "x"}) + "\n" for k, p in (("a", str(wav)), ("b", bad)))
    )
    audio = [{"bytes": None, "path": str(wav)}, {"bytes": None, "path": bad}]
    pq.write_table(pa.table({"id": ["a", "b"], "audio": audio, "text": ["x", "y"]}), root / "x.parquet")

    def pack(**source):
        return lambda skip: (
            pack_data(
                None, None, root / f"out-{len(list(root.iterdir()))}", skip_bad=skip, progress=False, **source
            ).dropped
        )

    def load(skip):
        loader = make_loader(root / "s.list", batch_size=2, num_workers=0, skip_bad=skip)
        assert sum(len(batch["keys"]) for batch in loader) == 1
        return loader.last_summary["ranks"][0]["dropped"]

    return {
        "pack wav.scp": lambda skip: pack_data(None, root / "text", root / f"out-w{skip}", wav_scp=root / "wav.scp", skip_bad=skip, progress=False).dropped,
        "pack a NeMo manifest": pack(manifest=root / "m.json"),
        "pack a Hugging Face cell's path": pack(hf=str(root / "x.parquet")),
        "load a list": load,
    }  # fmt: skip


@pytest.mark.parametrize(
    "route", ["pack wav.scp", "pack a NeMo manifest", "pack a Hugging Face cell's path", "load a list"]
)
@pytest.mark.parametrize("bad", ["/dev/zero", "fifo"])
def test_a_device_or_a_fifo_as_audio_is_refused_by_name_or_counted_never_read(tmp_path, route, bad):
    """/dev/zero was a bare MemoryError, even with skip_bad; a FIFO hung until killed."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    read = _audio_inputs(tmp_path, str(fifo) if bad == "fifo" else bad)[route]
    what = "a FIFO \\(named pipe\\)" if bad == "fifo" else "a character device"
    with never_waiting(fifo):
        with pytest.raises(InputError, match=rf"cannot be read( as audio: | \()it is {what}, not a regular file"):
            read(False)
        assert read(True) in ({"not_a_file": 1}, {"missing_audio": 1})


def test_a_fifo_is_read_as_audio_with_allow_pipes_and_a_commands_output_is_bounded(tmp_path, monkeypatch):
    from seqshard import pack_data
    from seqshard.formats import audio

    good = write_audio_dir(tmp_path / "audio", utts=1)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "wav.scp").write_text(f"a {fifo}\n")
    (tmp_path / "text").write_text("a x\n")

    def feed():
        with open(fifo, "wb") as stream:  # waits for the pack to open it
            stream.write((good.root / "utt000.wav").read_bytes())

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    report = pack_data(
        None, tmp_path / "text", tmp_path / "out", wav_scp=tmp_path / "wav.scp", allow_pipes=True, progress=False
    )
    feeder.join(timeout=60)
    assert report.packed == 1

    monkeypatch.setattr(audio, "MAX_AUDIO_FILE_BYTES", 1 << 20)
    (tmp_path / "wav.scp").write_text("a cat /dev/zero |\n")
    with pytest.raises(InputError, match=r"'cat /dev/zero' cannot be read as audio: its output is over 1048576 bytes"):
        pack_data(
            None, tmp_path / "text", tmp_path / "out2", wav_scp=tmp_path / "wav.scp", allow_pipes=True, progress=False
        )


@pytest.mark.parametrize("bad", ["/dev/zero", "fifo"])
def test_a_device_or_a_fifo_as_an_ark_or_a_frame_shift_is_refused_never_read(tmp_path, bad):
    from seqshard import ConfigError, pack_data

    data = write_kaldi_dir(tmp_path / "k", speakers=1, per_speaker=2, arks=1)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    target = str(fifo) if bad == "fifo" else bad
    lines = data.scp.read_text().splitlines()
    key, value = lines[0].split()
    lines[0] = f"{key} {target}:{value.rsplit(':', 1)[1]}"
    (tmp_path / "feats.scp").write_text("\n".join(lines) + "\n")
    with never_waiting(fifo):
        with pytest.raises(InputError, match=rf"cannot read ark '{re.escape(target)}': it is a"):
            pack_data(tmp_path / "feats.scp", data.text, tmp_path / "o1", progress=False)
        report = pack_data(tmp_path / "feats.scp", data.text, tmp_path / "o2", skip_bad=True, progress=False)
        assert report.dropped == {"not_a_file": 1} and report.packed == 1
        (data.root / "frame_shift").symlink_to(target)
        with pytest.raises(ConfigError, match=r"frame_shift: it is a .*Fix: make it a file holding the frame shift"):
            pack_data(data.scp, data.text, tmp_path / "o3", progress=False)


@pytest.mark.parametrize("kind", ["a FIFO", "a device", "a folder"])
@pytest.mark.parametrize("reader", ["cmvn", "fairseq dict", "units file", "trainer config"])
def test_a_small_file_read_whole_is_a_regular_file_or_a_named_error(tmp_path, kind, reader):
    """CMVN statistics, a fairseq dict.txt, a units file and the trainer's config were read
    whole with read_bytes/read_text: /dev/zero filled memory, a FIFO held the reader forever."""
    from seqshard.app.config import read_json
    from seqshard.errors import ConfigError
    from seqshard.features.frontend import Cmvn
    from seqshard.text.fairseq_dict import FairseqDictionary
    from seqshard.text.tokenizers import UnitsTokenizer

    path = {"a FIFO": tmp_path / "fifo", "a device": Path("/dev/zero"), "a folder": tmp_path}[kind]
    if kind == "a FIFO":
        os.mkfifo(path)
    read = {
        "cmvn": Cmvn.load,
        "fairseq dict": FairseqDictionary,
        "units file": UnitsTokenizer,
        "trainer config": read_json,
    }
    what = {"a FIFO": r"a FIFO \(named pipe\)", "a device": "a character device", "a folder": "a folder"}[kind]
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}.*it is {what}, not a regular file"):
        read[reader](Path(path))
