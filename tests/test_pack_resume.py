"""A pack killed late continues its partial shards from their last checkpoint: the rerun reads
only what the killed run had not handled, leaves finished shards alone, and ends with the
bytes an uninterrupted pack writes."""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time

import kaldiio
import numpy as np
import pytest

from conftest import write_kaldi_dir
from seqshard import pack_data
from seqshard.formats.members import load_table

STATE = ".seqshard-pack"


def _wait_for(condition, process, what: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None, f"the pack ended before {what}: {process.stderr.read().decode()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _write_end(fifo) -> int | None:
    """The write end of ``fifo`` once a process reads it (kept open: the reader waits on)."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while no process reads it
    except OSError:
        return None


def _journal_lines(out) -> int:
    return sum(len(path.read_text().splitlines()) for path in (out / STATE).glob("journal-*.jsonl"))


def _handled(out) -> list[int]:
    found = []
    for path in (out / STATE).glob("partial-*.json"):
        with contextlib.suppress(ValueError):  # being replaced
            found.append(json.loads(path.read_text())["handled"])
    return found


def _same_as_an_uninterrupted_pack(data, out, clean, **options) -> None:
    assert pack_data(data.scp, data.text, clean, **options).packed == 16
    for shard in sorted(out.glob("data-*.tar")):
        assert shard.read_bytes() == (clean / shard.name).read_bytes()
        table, fresh = load_table(shard), load_table(clean / shard.name)  # lengths too: batches plan by them
        assert table.same_as(fresh) and np.array_equal(table.lengths, fresh.lengths)
    indexes = [json.loads((folder / "index.json").read_text())["shards"] for folder in (out, clean)]
    assert indexes[0] == indexes[1]


def test_a_pack_killed_late_continues_its_partial_shard_from_its_last_checkpoint(tmp_path):
    data = write_kaldi_dir(tmp_path / "d", speakers=4, per_speaker=4, dim=4, frames=(5, 20))  # 16 utterances
    # the last scp line reads its matrix through a FIFO: the pack stops there, late, every other utterance handled
    lines = data.scp.read_text().splitlines()
    last = lines[-1].split()[0]
    fifo = tmp_path / "last.fifo"
    os.mkfifo(fifo)
    data.scp.write_text("\n".join([*lines[:-1], f"{last} cat {fifo} |"]) + "\n")
    out = tmp_path / "out"
    options = dict(utts_per_file=4, allow_pipes=True, progress=False)
    script = (
        "import seqshard.prep.write as w\n"
        "w.CHECKPOINT_SHARE = w.CHECKPOINT_SECONDS = 0  # a checkpoint after every utterance\n"
        "from seqshard import pack_data\n"
        f"pack_data({str(data.scp)!r}, {str(data.text)!r}, {str(out)!r}, **{options!r})\n"
    )
    process = subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stderr=subprocess.PIPE)
    held = []
    try:
        _wait_for(lambda: held.append(_write_end(fifo)) or held[-1] is not None, process, "the last utterance")
        # 4 shards of 4: the 3 without the last utterance are finished, the 4th holds 3 of its 4
        _wait_for(lambda: _journal_lines(out) == 3 and _handled(out) == [3], process, "the checkpoint of 3")
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the whole job, as a scheduler kills it
        process.wait()
        for end in filter(None, held):
            os.close(end)
    (partial_file,) = out.glob(".data-*.tar.partial")
    finished = {path.name: path.stat().st_mtime_ns for path in out.glob("data-*.tar")}
    assert len(finished) == 3 and partial_file.name[1 : -len(".partial")] not in finished
    fifo.unlink()
    buffer = io.BytesIO()
    kaldiio.save_mat(buffer, data.arrays[last])
    fifo.write_bytes(buffer.getvalue())  # the same scp line now reads a file

    report = pack_data(data.scp, data.text, out, **options)

    assert report.complete and report.packed == 16 and report.shards_written_now == 1
    assert report.resumed_utts == 3  # read again: the one utterance the killed run had not handled
    assert {name: (out / name).stat().st_mtime_ns for name in finished} == finished  # not written again
    assert not list(out.glob(".*.partial")) and not list((out / STATE).glob("partial-*.json"))
    _same_as_an_uninterrupted_pack(data, out, tmp_path / "clean", **options)


def test_a_partial_shard_that_lost_its_checkpointed_bytes_is_written_again(tmp_path, monkeypatch):
    from seqshard.errors import InputError
    from seqshard.prep import write

    monkeypatch.setattr(write, "CHECKPOINT_SHARE", 0)
    monkeypatch.setattr(write, "CHECKPOINT_SECONDS", 0)
    data = write_kaldi_dir(tmp_path / "d", speakers=4, per_speaker=4, dim=4, frames=(5, 20))  # 16 utterances
    lines = data.scp.read_text().splitlines()
    last = lines[-1].split()[0]
    ark = tmp_path / "last.ark"  # the last utterance alone in an ark that goes missing in the first run
    with kaldiio.WriteHelper(f"ark,scp:{ark},{tmp_path / 'last.scp'}") as writer:
        writer(last, data.arrays[last])
    data.scp.write_text("\n".join([*lines[:-1], (tmp_path / "last.scp").read_text().strip()]) + "\n")
    ark.rename(tmp_path / "away.ark")
    out = tmp_path / "out"
    options = dict(utts_per_file=4, progress=False)
    with pytest.raises(InputError, match=r"last\.ark"):
        pack_data(data.scp, data.text, out, **options)
    (partial_file,) = out.glob(".data-*.tar.partial")  # kept: a checkpoint records 3 of its 4 utterances
    assert _handled(out) == [3]
    with open(partial_file, "r+b") as stream:  # but it lost bytes the checkpoint counts
        stream.truncate(stream.seek(0, os.SEEK_END) - 512)
    (tmp_path / "away.ark").rename(ark)

    report = pack_data(data.scp, data.text, out, **options)

    assert report.complete and report.packed == 16 and report.shards_written_now == 1
    assert report.resumed_utts == 0
    _same_as_an_uninterrupted_pack(data, out, tmp_path / "clean", **options)


def test_a_damaged_journal_is_passed_over_line_by_line_and_a_fifo_in_its_place_is_named(tmp_path):
    """A journal line of 70 MB is passed over (its shard written again) without being held; a
    FIFO named like a shard's checkpoint is passed over; one named like a journal held the
    rerun forever, and is now refused by name."""
    from seqshard.errors import SeqshardError

    data = write_kaldi_dir(tmp_path / "d", speakers=1, per_speaker=6, dim=2, frames=(2, 4))
    out = tmp_path / "out"
    first = pack_data(data.scp, data.text, out, utts_per_file=3, shuffle=False, progress=False)
    journal = next((out / ".seqshard-pack").glob("journal-*.jsonl"))
    lines = journal.read_bytes().splitlines(keepends=True)
    with open(journal, "wb") as damaged:
        damaged.write(lines[0] + b'{"name": "')
        damaged.seek(70 << 20, io.SEEK_CUR)
        damaged.write(b'"}\n' + b"".join(lines[2:]))  # in place of the second shard's line
    before = {p.name: p.read_bytes() for p in out.glob("*.tar")}
    os.mkfifo(out / ".seqshard-pack" / "partial-1.json")  # read as a shard's checkpoint: passed over
    again = pack_data(data.scp, data.text, out, utts_per_file=3, shuffle=False, progress=False)
    assert again.packed == first.packed == 6
    assert {p.name: p.read_bytes() for p in out.glob("*.tar")} == before
    os.mkfifo(out / ".seqshard-pack" / "journal-fifo.jsonl")
    with pytest.raises(SeqshardError, match=r"journal-fifo\.jsonl: not a regular file.* Fix: remove it"):
        pack_data(data.scp, data.text, out, utts_per_file=3, shuffle=False, progress=False)
