"""examples/train_ddp.py run for real: stopped, killed with SIGKILL, resumed, and rerun once finished."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "examples" / "train_ddp.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
OPTIONS = ["--demo-utts", "160", "--batch-frames", "4000", "--save-every", "5", "--workers", "1", "--epochs", "2"]
STEP = re.compile(r"^epoch (\d+) step (\d+) loss (\S+) ")
RESUMED = re.compile(r"^resumed from .*: epoch (\d+), after step (\d+)$")
FINISHED = re.compile(r"^finished: 2 epochs, (\d+) steps$")
EPOCH_DONE = re.compile(r"^epoch (\d+) done at step (\d+), checkpoint saved$")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def command(*args: str, ranks: int = 1) -> list[str]:
    launcher = [sys.executable] if ranks == 1 else [str(TORCHRUN), "--standalone", "--nproc_per_node", str(ranks)]
    return [*launcher, str(SCRIPT), *OPTIONS, *args]


def run(*args: str, cwd: Path, ranks: int = 1) -> list[str]:
    done = subprocess.run(
        command(*args, ranks=ranks), cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120
    )
    output = done.stdout.decode(errors="replace")
    assert done.returncode == 0, output[-4000:]
    return output.splitlines()


def steps(lines: list[str]) -> dict[int, tuple[int, str]]:
    """step -> (epoch, loss) of the lines printed at checkpoints."""
    return {int(m[2]): (int(m[1]), m[3]) for m in map(STEP.match, lines) if m}


def checkpoints(lines: list[str]) -> dict[int, int]:
    """step -> the epoch a resume from the checkpoint saved at that step runs."""
    saved = {}
    for line in lines:
        if m := STEP.match(line):
            saved[int(m[2])] = int(m[1])
        elif m := EPOCH_DONE.match(line):
            saved[int(m[2])] = int(m[1]) + 1
    return saved


def resumed_at(lines: list[str]) -> tuple[int, int]:
    found = [m for m in map(RESUMED.match, lines) if m]
    assert len(found) == 1, lines
    return int(found[0][1]), int(found[0][2])


def assert_ignored_by_git(written: list[Path]) -> None:
    """What the example writes into a working folder (the repository, when run from there)
    is ignored by git."""
    assert written and all(p.parts[0] == "train-out" for p in written), written
    if not (ROOT / ".git").exists():
        return  # not a git checkout: nothing to ignore
    paths = "\n".join(map(str, written)) + "\n"
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", "--verbose", "--non-matching", "--stdin"],
        cwd=ROOT,
        input=paths.encode(),
        capture_output=True,
    )
    not_ignored = [line for line in done.stdout.decode().splitlines() if line.startswith("::")]
    assert done.returncode in (0, 1) and not not_ignored, (done.stdout.decode(), done.stderr.decode())


def assert_finished_rerun(cwd: Path, *args: str, ranks: int = 1) -> None:
    lines = run(*args, cwd=cwd, ranks=ranks)
    assert any("is the checkpoint of a finished run: all 2 epochs done" in line for line in lines), lines
    assert not any(RESUMED.match(line) or STEP.match(line) for line in lines), lines


@pytest.mark.timeout(200)
def test_kill_resume_and_rerun(tmp_path: Path):
    # the uninterrupted run; it makes the demo corpus in train-out/data under its working folder
    reference = run(cwd=tmp_path)
    assert (tmp_path / "train-out/ckpt.pt").exists() and (tmp_path / "train-out/data/shards").is_dir()
    assert_ignored_by_git([p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()])
    total = int(next(m for m in map(FINISHED.match, reference) if m)[1])
    expected = steps(reference)
    assert total > 20 and len(expected) >= 4, reference
    data = ["--shards", str(tmp_path / "train-out/data/shards/data-*.tar")]
    data += ["--units", str(tmp_path / "train-out/data/kaldi/units.txt"), "--out", str(tmp_path / "run")]

    # the same run killed with SIGKILL after its first checkpoint
    process = subprocess.Popen(
        command(*data), cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    killed: list[str] = []
    assert process.stdout is not None
    for raw in process.stdout:
        killed.append(raw.decode(errors="replace").rstrip("\n"))
        if STEP.match(killed[-1]):
            os.killpg(process.pid, signal.SIGKILL)
            break
    killed += process.stdout.read().decode(errors="replace").splitlines()
    assert process.wait() == -signal.SIGKILL, killed
    printed = sorted(steps(killed))
    assert printed and printed[0] == 5 and not any(FINISHED.match(line) for line in killed), killed

    # the resume goes on from the last checkpoint, with the steps (and losses) of the uninterrupted run
    lines = run(*data, cwd=tmp_path)
    epoch, step = resumed_at(lines)
    assert step >= printed[-1] and checkpoints(reference).get(step) == epoch, (killed, lines, reference)
    after = steps(lines)
    assert after and min(after) > step and after == {s: expected[s] for s in expected if s > step}, (lines, reference)
    assert FINISHED.match(lines[-1]) and int(FINISHED.match(lines[-1])[1]) == total, lines

    # run again once finished: it says so and exits 0
    assert_finished_rerun(tmp_path, *data)


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_two_ranks_stop_and_resume(tmp_path: Path):
    first = run("--stop-after-steps", "7", cwd=tmp_path, ranks=2)
    assert sorted(steps(first)) == [5, 7] and first[-1].startswith("stopped after 7 steps"), first
    lines = run(cwd=tmp_path, ranks=2)
    assert resumed_at(lines) == (0, 7), lines
    assert min(steps(lines)) == 10 and FINISHED.match(lines[-1]), lines  # the step counter went on from 7
