"""One writer at a time in a dataset folder: a second writer, started while the first (a real
process, held up reading a FIFO) writes, is refused with the first one's pid and host, and
neither loses work; parts of one pack share the folder."""

import io
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import kaldiio
import numpy as np
import pytest

from conftest import write_kaldi_dir
from seqshard import ShardIndex, add_field, pack_data
from seqshard.formats.lock import FolderBusyError
from seqshard.tools.reindex import rebuild_index


def _start(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)


def _hold_reader(fifo, process, seconds: float = 60.0) -> int:
    """Once ``process`` reads ``fifo``, the write end of it (kept open: the reader waits on)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # fails while no process reads it
        except OSError:
            assert process.poll() is None, process.stderr.read().decode()
            assert time.monotonic() < deadline, "the first writer never reached the FIFO"
            time.sleep(0.01)


def _feed(held: int, payload: bytes, process) -> None:
    """Let ``process`` read ``payload`` and go on; it must end well."""
    os.write(held, payload)
    os.close(held)
    assert process.wait(timeout=60) == 0, process.stderr.read().decode()


def _matrix_bytes(array) -> bytes:
    buffer = io.BytesIO()
    kaldiio.save_mat(buffer, array)
    return buffer.getvalue()


def test_a_second_add_field_is_refused_naming_the_first_and_both_field_sets_are_kept(tmp_path, packed):
    shards = tmp_path / "shards"
    shutil.copytree(packed.out, shards)
    keys = packed.data.keys
    first = ShardIndex.load(shards).shards[0].first_key  # the first value the first run reads
    ark = tmp_path / "ali.ark"
    fifo = tmp_path / "first.fifo"
    os.mkfifo(fifo)
    with kaldiio.WriteHelper(f"ark,scp:{ark},{tmp_path / 'ark.scp'}") as writer:
        for number, key in enumerate(keys):
            writer(key, np.full(3, number, dtype=np.int32))
    lines = [
        line if not line.startswith(f"{first} ") else f"{first} cat {fifo} |"
        for line in (tmp_path / "ark.scp").read_text().splitlines()
    ]
    (tmp_path / "ali.scp").write_text("\n".join(lines) + "\n")
    (tmp_path / "spk").write_text("".join(f"{key} {packed.data.speaker_of[key]}\n" for key in keys))

    ali = _start(
        f"from seqshard import add_field; add_field({str(shards)!r}, 'ali', {str(tmp_path / 'ali.scp')!r}, allow_pipes=True, progress=False)"
    )
    held = _hold_reader(fifo, ali)
    with pytest.raises(
        FolderBusyError,
        match=rf"being written by another process \(pid {ali.pid} on host {socket.gethostname()}, seqshard add-field ali, since .*wait for it to finish",
    ):
        add_field(shards, "spk", tmp_path / "spk", progress=False)
    _feed(held, _matrix_bytes(np.full(3, keys.index(first), dtype=np.int32)), ali)

    add_field(shards, "spk", tmp_path / "spk", progress=False)
    index = ShardIndex.load(shards)
    assert set(index.field_sets) == {"ali", "spk"}
    assert all(set(entry.sidecars) == {"ali", "spk"} for entry in index.shards)
    assert not (shards / ".seqshard.lock").exists()  # the last writer leaves no lock file


def test_a_second_pack_is_refused_while_parts_of_one_pack_share_the_folder(tmp_path):
    data = write_kaldi_dir(tmp_path / "d")  # 48 utterances in shards of 10 (no shuffle): the last in shard 4
    lines = data.scp.read_text().splitlines()
    last = lines[-1].split()[0]
    fifo = tmp_path / "last.fifo"
    os.mkfifo(fifo)
    data.scp.write_text("\n".join([*lines[:-1], f"{last} cat {fifo} |"]) + "\n")
    out = tmp_path / "out"
    options = dict(utts_per_file=10, shuffle=False, allow_pipes=True, progress=False)
    part0 = _start(
        f"from seqshard import pack_data; pack_data({str(data.scp)!r}, {str(data.text)!r}, {str(out)!r}, num_parts=2, part=0, **{options!r})"
    )
    held = _hold_reader(fifo, part0)  # part 0 writes shard 4 and waits for the FIFO

    with pytest.raises(FolderBusyError, match=rf"pid {part0.pid} on host .*seqshard pack \(part 0 of 2\)"):
        pack_data(data.scp, data.text, out, **options)
    with pytest.raises(FolderBusyError, match=rf"pid {part0.pid} .*seqshard index does not start"):
        rebuild_index(out, progress=False)
    part1 = _start(  # shares the folder: writes what part 0 does not hold, then waits for shard 4
        f"from seqshard import pack_data; pack_data({str(data.scp)!r}, {str(data.text)!r}, {str(out)!r}, num_parts=2, part=1, **{options!r})"
    )
    _feed(held, _matrix_bytes(data.arrays[last]), part0)
    assert part1.wait(timeout=60) == 0, part1.stderr.read().decode()

    index = ShardIndex.load(out)  # the last part to finish indexed all five
    assert [entry.num_utts for entry in index.shards] == [10, 10, 10, 10, 8]
    assert not (out / ".seqshard.lock").exists()


def test_what_a_killed_writer_left_neither_blocks_nor_stays(tmp_path, packed):
    shards = tmp_path / "shards"
    shutil.copytree(packed.out, shards)
    (shards / ".seqshard.lock").write_text('{"pid": 1, "host": "gone", "command": "seqshard index"}\n')  # no flock
    left = [shards / ".members/.data-00001.tar.npz.x1y2z3.partial", shards / ".index.json.a1b2c3.partial"]
    for path in left:
        path.write_bytes(b"half")

    rebuild_index(shards, progress=False)

    assert not any(path.exists() for path in left) and not (shards / ".seqshard.lock").exists()


def test_binarize_holds_its_output_prefix_and_not_the_folder(tmp_path):
    from seqshard.formats.lock import FolderLock
    from seqshard.prep.binarize import binarize

    (tmp_path / "units").write_text("<unk> 0\nA 1\nB 2\n")
    (tmp_path / "lines.txt").write_text("A B\nB A A\n")
    options = dict(append_eos=False, progress=False)
    with FolderLock(tmp_path, "seqshard binarize", name=".train.lock"):  # another process binarizing train
        with pytest.raises(FolderBusyError, match=r"seqshard binarize, since .*so seqshard binarize does not start"):
            binarize(tmp_path / "lines.txt", tmp_path / "train", tmp_path / "units", **options)
        assert binarize(tmp_path / "lines.txt", tmp_path / "valid", tmp_path / "units", **options).sequences == 2
    assert not (tmp_path / "train.bin").exists() and not (tmp_path / ".valid.lock").exists()


def _first_from_a_fifo(tmp_path, **sizes):
    """A Kaldi dir whose first utterance is piped from a FIFO (a pack reading it waits there);
    the dir, its scp's lines as written, and the FIFO."""
    data = write_kaldi_dir(tmp_path / "d", **sizes)
    lines = data.scp.read_text().splitlines()
    fifo = tmp_path / "first.fifo"
    os.mkfifo(fifo)
    data.scp.write_text("\n".join([f"{lines[0].split()[0]} cat {fifo} |", *lines[1:]]) + "\n")
    return data, lines, fifo


def test_index_and_add_field_name_a_pack_that_has_not_written_a_shard_yet(tmp_path):
    """Before its first shard a running pack's folder holds no shards: the other writers name
    the pack rather than saying there is nothing to index."""
    data, _, fifo = _first_from_a_fifo(tmp_path, speakers=1, per_speaker=3)
    out = tmp_path / "out"
    pack = _start(
        f"from seqshard import pack_data; pack_data({str(data.scp)!r}, {str(data.text)!r}, {str(out)!r}, allow_pipes=True, progress=False)"
    )
    held = _hold_reader(fifo, pack)
    with pytest.raises(FolderBusyError, match=rf"pid {pack.pid} .*seqshard pack.*seqshard index does not start"):
        rebuild_index(out, progress=False)
    with pytest.raises(FolderBusyError, match=rf"pid {pack.pid} .*seqshard add-field does not start"):
        add_field(out, "more", data.text, progress=False)
    pack.kill()
    pack.wait(timeout=60)
    os.close(held)
    assert not list(out.glob("*.tar")), "the pack was stopped before its first shard"


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def test_a_killed_pack_driver_takes_its_pool_workers_and_the_lock_with_it(tmp_path):
    """SIGKILL to `pack --jobs 2`: its pool workers went on under pid 1 holding the folder's
    lock (inherited), and the rerun was refused naming the dead driver."""
    data, lines, fifo = _first_from_a_fifo(tmp_path, speakers=2, per_speaker=6)
    out = tmp_path / "out"
    code = f"from seqshard import pack_data; pack_data({str(data.scp)!r}, {str(data.text)!r}, {str(out)!r}, jobs=2, allow_pipes=True, progress=False)"
    driver = _start(code)
    held = _hold_reader(fifo, driver)  # a pool worker reads the FIFO
    workers = _children(driver.pid)
    assert workers, "the driver has no pool workers"
    driver.kill()
    driver.wait(timeout=30)
    os.close(held)  # the worker's read ends (an empty matrix: its task fails, nobody waits for it)
    deadline = time.monotonic() + 30
    while any(
        Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text() for pid in workers
    ):
        assert time.monotonic() < deadline, f"pool workers {workers} outlived their driver"
        time.sleep(0.1)
    data.scp.write_text("\n".join(lines) + "\n")  # the rerun, as the README advises after a crash
    report = pack_data(data.scp, data.text, out, progress=False)
    assert report.packed == len(lines)
