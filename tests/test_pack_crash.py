"""A pack killed with SIGKILL and run again finishes with every utterance in exactly one shard."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import read_shards, write_kaldi_dir
from seqshard import pack_data
from seqshard.formats.tar import SampleStream


@pytest.mark.slow
@pytest.mark.parametrize("jobs", [1, 2])
def test_sigkill_then_rerun_finishes_with_nothing_lost_or_doubled(tmp_path, jobs):
    data = write_kaldi_dir(tmp_path / "d", speakers=20, per_speaker=40, dim=40, frames=(80, 240), compression_method=1)
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "seqshard",
        "pack",
        "--scp",
        str(data.scp),
        "--text",
        str(data.text),
        "--out",
        str(out),
        "--utts-per-file",
        "10",
        "--max-open",
        "3",
        "--jobs",
        str(jobs),
        "--quiet",
    ]
    process = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while len(list(out.glob("data-*.tar"))) < 4 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    os.killpg(process.pid, signal.SIGKILL)  # the whole job, as a scheduler kills it
    process.wait()
    finished_before = list(out.glob("data-*.tar"))
    assert process.returncode == -signal.SIGKILL, process.stderr.read().decode()
    assert 4 <= len(finished_before) < 80 and not (out / "pack_report.json").exists()
    for shard in finished_before:  # anything under a final name is whole
        with SampleStream(shard) as stream:
            assert len(list(stream)) == 10 and stream.ended_cleanly

    rerun = subprocess.run(command[:-3] + ["--jobs", "1", "--quiet"], capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert "80/80 done" in rerun.stdout and "written by this run" in rerun.stdout
    found = read_shards(sorted(out.glob("data-*.tar")))
    assert sorted(found) == sorted(data.keys)
    assert not list(out.glob(".*.partial"))
    pack_data(data.scp, data.text, tmp_path / "clean", utts_per_file=10, progress=False)
    for shard in sorted(out.glob("data-*.tar")):
        assert shard.read_bytes() == (tmp_path / "clean" / shard.name).read_bytes()
