"""The example trainer (examples/train_ddp.py -> seqshard.app.trainer) run for real: it learns,
it is killed with SIGKILL and resumed with the batches and losses of the uninterrupted run,
2 ranks under torchrun, launched by the README's Slurm script as written, are preempted (USR1
to the script, SIGTERM to every process of the job), the script ends with status 0 and requeues,
and the job resumes; it says when a run is finished.

The first run of each test is what a user runs (``python examples/train_ddp.py``, torchrun);
the others run the same script in processes forked from tests/gloo_ranks.py's server, which
has imported torch once (a fresh interpreter, and torchrun's own, cost 2-4 s of CPU each).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gloo_ranks import RankProcess, kill, start_script, wait_for
from seqshard.app.train_checkpoint import write_checkpoint
from seqshard.errors import OutputError

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "examples" / "train_ddp.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
SETTINGS = {
    "batch_frames": 3000,
    "epochs": 2,
    "save_every": 5,
    "log_every": 5,
    "hidden": 64,
    "layers": 1,
    "lr": 0.004,
    "warmup_steps": 10,
}
OPTIONS = ["--demo-utts", "160"] + [f"--set={k}={json.dumps(v)}" for k, v in SETTINGS.items()]
SAVED = re.compile(r"^epoch (\d+) step (\d+) checkpoint saved$")
LOGGED = re.compile(
    r"^epoch \d+ step \d+ loss \S+ \d+ utts/s \d+ frames/s data-wait \d+\.\d% peak-mem \d+ MiB largest( \d+:\d+x\d+)+$"
)
PREEMPTED = re.compile(r"^rank (\d+): SIGTERM: stopped after step (\d+), checkpoint saved$")
RESUMED = re.compile(r"^resumed from .*: epoch (\d+), after step (\d+)$")
FINISHED = re.compile(r"^finished: 2 epochs, (\d+) steps$")
DEV = re.compile(r"^epoch (\d+) dev loss (\S+)$")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), "PYTHONUNBUFFERED": "1"}


def command(*args: str, ranks: int = 1) -> list[str]:
    launcher = [sys.executable] if ranks == 1 else [str(TORCHRUN), "--standalone", "--nproc_per_node", str(ranks)]
    return [*launcher, str(SCRIPT), *OPTIONS, *args]


def run(*args: str, cwd: Path, ranks: int = 1) -> list[str]:
    done = subprocess.run(
        command(*args, ranks=ranks), cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=150
    )
    output = done.stdout.decode(errors="replace")
    assert done.returncode == 0, output[-4000:]
    return output.splitlines()


def forked(*args: str, cwd: Path, logs: Path, ranks: int | None = None) -> list[RankProcess]:
    """The example started as ``run`` starts it (``ranks``: as that many torchrun ranks), forked
    from the preloaded server; its rank 0's output in LOGS/rank0.log."""
    return start_script(SCRIPT, [*OPTIONS, *args], logs, world_size=ranks, cwd=cwd)


def run_forked(*args: str, cwd: Path, logs: Path, ranks: int | None = None) -> list[str]:
    """What ``run`` does, in forked processes: rank 0's output lines once every rank ended with 0."""
    processes = forked(*args, cwd=cwd, logs=logs, ranks=ranks)
    wait_for(processes, timeout=150)
    return processes[0].stdout.read().decode(errors="replace").splitlines()


def follow(process: RankProcess, stop: Callable[[str], bool], timeout: float = 150) -> list[str]:
    """The process's output lines as they come, up to the first for which ``stop`` is true (all
    of them, when the process ends before)."""
    lines: list[str] = []
    pending = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ended = process.poll() is not None
        *complete, pending = (pending + process.stdout.read()).split(b"\n")
        for raw in complete:
            lines.append(raw.decode(errors="replace"))
            if stop(lines[-1]):
                return lines
        if ended:
            return lines + ([pending.decode(errors="replace")] if pending else [])
        time.sleep(0.02)
    kill([process])
    pytest.fail(f"no line it waited for within {timeout} s:\n" + "\n".join(lines[-40:]))


def saved_at_least(step: int) -> Callable[[str], bool]:
    return lambda line: bool((m := SAVED.match(line)) and int(m[2]) >= step)


def records(path: Path) -> dict[int, dict]:
    """step -> {keys, loss}; a step recorded twice (done again after a resume) keeps its last."""
    found = {}
    for line in path.read_text().splitlines():
        item = json.loads(line)
        found[item["step"]] = item
    return found


def assert_same_steps(resumed: dict[int, dict], reference: dict[int, dict]) -> None:
    assert sorted(resumed) == sorted(reference)
    for step, item in reference.items():
        assert resumed[step]["keys"] == item["keys"], step
        assert resumed[step]["loss"] == pytest.approx(item["loss"], rel=1e-5), step


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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_learns_is_killed_resumes_exactly_and_says_when_finished(tmp_path: Path):
    # the uninterrupted run; it makes the corpus in train-out/data under its working folder
    reference = run("--steps-file", str(tmp_path / "reference.jsonl"), cwd=tmp_path)
    assert_ignored_by_git(
        [p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file() and "jsonl" not in p.name]
    )
    expected = records(tmp_path / "reference.jsonl")
    total = int(next(m for m in map(FINISHED.match, reference) if m)[1])
    assert total == len(expected) > 20
    assert any(LOGGED.match(line) for line in reference), reference
    dev = [float(m[2]) for m in map(DEV.match, reference) if m]
    assert len(dev) == 2 and dev[1] < dev[0]  # the dev set, evaluated each epoch
    losses = [expected[s]["loss"] for s in sorted(expected)]
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses  # features come from the labels: it learns

    # the same run killed with SIGKILL after its second checkpoint
    out = [
        "--out",
        str(tmp_path / "run"),
        "--steps-file",
        str(tmp_path / "run" / "steps.jsonl"),
    ]  # in --out, not yet made
    [process] = forked(*out, cwd=tmp_path, logs=tmp_path / "killed")
    killed = follow(process, saved_at_least(10))
    kill([process])
    killed += process.stdout.read().decode(errors="replace").splitlines()
    assert process.returncode == -signal.SIGKILL, killed
    assert not any(FINISHED.match(line) for line in killed), killed

    # the resume goes on with the batches (and losses) of the uninterrupted run
    lines = run_forked(*out, cwd=tmp_path, logs=tmp_path / "resumed")
    _, step = resumed_at(lines)
    assert step >= 10, lines
    assert_same_steps(records(tmp_path / "run" / "steps.jsonl"), expected)
    assert FINISHED.match(lines[-1]) and int(FINISHED.match(lines[-1])[1]) == total, lines

    # run again once finished: it says so and exits 0
    again = run_forked(*out, cwd=tmp_path, logs=tmp_path / "again")
    assert any("is the checkpoint of a finished run: all 2 epochs done" in line for line in again), again
    assert not any(RESUMED.match(line) or SAVED.match(line) for line in again), again


def resumed_at(lines: list[str]) -> tuple[int, int]:
    found = [m for m in map(RESUMED.match, lines) if m]
    assert len(found) == 1, lines
    return int(found[0][1]), int(found[0][2])


FENCE = re.compile(r"^```bash\n(.*?)^```$", re.MULTILINE | re.DOTALL)
LAUNCH = ("--nproc_per_node 8 ", "examples/train_ddp.py --config hyper-p.json --out exp/ctc")


def slurm_script(folder: Path, *args: str) -> Path:
    """The README's Slurm script as written, with 2 ranks training the example's made-up corpus
    (``args``) instead of 8 a config, and a ``scontrol`` that records its arguments."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    [script] = [block for block in FENCE.findall(readme) if "#SBATCH" in block]
    assert all(part in script for part in LAUNCH), script
    command = " ".join(shlex.quote(str(a)) for a in [SCRIPT, *OPTIONS, *args])
    path = folder / "job.sh"
    path.write_text(script.replace(LAUNCH[0], "--nproc_per_node 2 ").replace(LAUNCH[1], command))
    (folder / "bin").mkdir(exist_ok=True)
    (folder / "bin" / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {shlex.quote(str(folder / "scontrol.log"))}\n')
    (folder / "bin" / "scontrol").chmod(0o755)
    return path


def job(script: Path, stop: Callable[[str], bool], signal_job: Callable[[int], None]) -> tuple[int, list[str]]:
    """Run ``script`` as Slurm runs a batch job; once a line satisfies ``stop``, ``signal_job``
    (the script's pid); its exit status and output lines."""
    env = {**ENV, "PATH": f"{script.parent / 'bin'}:{TORCHRUN.parent}:{os.environ['PATH']}", "SLURM_JOB_ID": "7"}
    process = subprocess.Popen(
        ["bash", str(script)], cwd=script.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    assert process.stdout is not None
    lines = []
    for raw in process.stdout:
        lines.append(raw.decode(errors="replace").rstrip("\n"))
        if stop(lines[-1]):
            signal_job(process.pid)
            break
    lines += process.stdout.read().decode(errors="replace").splitlines()
    return process.wait(timeout=90), lines


def every_process_of(pid: int) -> list[int]:
    """``pid`` and its descendants (a preempted Slurm job's processes are all signalled)."""
    table = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    children: dict[int, list[int]] = {}
    for child, parent in (map(int, line.split()) for line in table.splitlines()):
        children.setdefault(parent, []).append(child)
    found = [pid]
    for process in found:
        found += children.get(process, [])
    return found


def preempted(lines: list[str], out: Path) -> int:
    """The step at which both ranks stopped, with a checkpoint of it and no traceback."""
    stopped = {int(m[1]): int(m[2]) for m in map(PREEMPTED.match, lines) if m}
    assert sorted(stopped) == [0, 1] and len(set(stopped.values())) == 1, lines  # both ranks, at one step
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == stopped[0] and not FINISHED.match(lines[-1])
    assert not any(text in line for line in lines for text in ("Traceback", "SignalException", "Unable to shut")), lines
    return stopped[0]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_the_readme_slurm_script_is_preempted_ends_with_0_requeues_and_resumes_exactly(tmp_path: Path):
    ref = ["--out", str(tmp_path / "ref"), "--steps-file", str(tmp_path / "ref.jsonl")]
    reference = run_forked(*ref, cwd=tmp_path, logs=tmp_path / "ref-logs", ranks=2)
    assert FINISHED.match(reference[-1]), reference
    out = tmp_path / "run"
    script = slurm_script(tmp_path, "--out", out, "--steps-file", tmp_path / "run.jsonl")
    requeued = tmp_path / "scontrol.log"

    # USR1 to the batch script before the time limit (--signal=B:USR1), after a checkpoint
    code, lines = job(script, saved_at_least(5), lambda pid: os.kill(pid, signal.SIGUSR1))
    assert code == 0, lines
    first = preempted(lines, out)
    assert requeued.read_text() == "requeue 7\n"

    # the requeued job resumes; preempted by another job: SIGTERM to every process of the job
    def preempt(pid: int) -> None:
        for process in every_process_of(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(process, signal.SIGTERM)

    code, lines = job(script, saved_at_least(first + 5), preempt)
    assert code == 0, lines
    assert resumed_at(lines)[1] == first and preempted(lines, out) > first
    assert requeued.read_text() == "requeue 7\n" * 2

    # running on to the end (forked ranks: 2 torchrun launches fewer) gives the batches and losses of the uninterrupted run
    lines = run_forked(
        "--out", str(out), "--steps-file", str(tmp_path / "run.jsonl"), cwd=tmp_path, logs=tmp_path / "end", ranks=2
    )
    assert FINISHED.match(lines[-1]), lines
    assert_same_steps(records(tmp_path / "run.jsonl"), records(tmp_path / "ref.jsonl"))  # rank 0's batches and losses


PROBE = ROOT / "tests" / "trainer_probe.py"
PROBED = {
    **SETTINGS,
    "batch_frames": 1500,
    "epochs": 1,
    "save_every": 8,
    "log_every": 4,
    "hidden": 32,
    "num_workers": 0,
}
STOPPED = re.compile(r"^rank (\d+): SIGTERM: stopped after step (\d+), checkpoint saved$", re.MULTILINE)


def probed(out: Path, events: dict, cwd: Path) -> tuple[list[dict], list[dict]]:
    """2 ranks of the example trainer under tests/trainer_probe.py (``events`` happen): each
    rank's record of each step; rank r's output in OUT/rank<r>.log, rank 0's steps file in OUT."""
    settings = [f"--set={k}={json.dumps(v)}" for k, v in PROBED.items()]
    args = ["--demo-utts", "160", *settings, "--out", str(out / "run"), "--steps-file", str(out / "steps.jsonl")]
    wait_for(start_script(PROBE, ["train", str(out), json.dumps(events), "--", *args], out, 2, cwd=cwd), 150)
    return tuple([json.loads(line) for line in (out / f"probe{r}.jsonl").read_text().splitlines()] for r in (0, 1))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_a_step_waits_for_no_read_ddp_averages_in_backward_and_memory_running_out_changes_no_update(tmp_path):
    reference = probed(tmp_path / "reference", {}, tmp_path)
    for rank, windows in enumerate(reference):
        assert len(windows) >= 12
        for window in windows:  # what happens from a step's update to the next's (step 0: before the first)
            step, logs = window["step"], window["step"] % PROBED["log_every"] == 0
            assert window["plan"] == 0, window  # no walk of the epoch's plan (for a progress bar)
            assert not any("float" in call["dtype"] for call in window["all_reduce"]), window  # no gradients of ours
            if step == 0 or logs:  # the line reads the losses; a checkpoint (a multiple of 4 too) reads and meets
                continue
            assert window["reads"] == [], (rank, window)  # nothing read from the device: no wait for it
            assert window["buckets"] >= 1, window  # DDP all-reduced the gradients, during the backward pass
            assert window["all_reduce"] == [{"dtype": "torch.int64", "size": 1, "async": True}], window  # the flag
        assert any(window["reads"] for window in windows if window["step"] % PROBED["log_every"] == 0)

    # memory runs out on rank 1 in step 3's backward pass (DDP has its output layer's and LSTM's
    # gradients by then), and rank 1 receives SIGTERM after step 10
    out = tmp_path / "run"
    probed(out, {"oom": [1, 3], "signal": [1, 10]}, tmp_path)
    logs = [(out / f"rank{rank}.log").read_text() for rank in (0, 1)]
    assert "rank 1 step 3: out of memory on a batch of " in logs[1], logs[1]
    stopped = [int(m[2]) for log in logs for m in STOPPED.finditer(log)]
    assert len(stopped) == 2 and stopped[0] == stopped[1] in (10, 11), logs  # both ranks, at one step
    expected = {step: item for step, item in records(tmp_path / "reference" / "steps.jsonl").items()}
    found = records(out / "steps.jsonl")
    assert sorted(found) == list(range(1, stopped[0] + 1))
    assert_same_steps(found, {step: expected[step] for step in found})  # the updates of the run without either


def test_a_checkpoint_is_never_written_through_a_hard_link_to_another_file(tmp_path: Path):
    """A stale ``ckpt.pt.partial`` that is another name of the user's file is refused (it was
    overwritten with the checkpoint), and a later save in a clean folder still works."""
    users = tmp_path / "users-file"
    users.write_bytes(b"the user's data")
    os.link(users, tmp_path / "ckpt.pt.partial")
    with pytest.raises(OutputError, match=r"ckpt\.pt\.partial: is a file with 2 names"):
        write_checkpoint(tmp_path / "ckpt.pt", {"step": 1})
    assert users.read_bytes() == b"the user's data" and not (tmp_path / "ckpt.pt").exists()
    (tmp_path / "ckpt.pt.partial").unlink()
    write_checkpoint(tmp_path / "ckpt.pt", {"step": 2})
    assert torch.load(tmp_path / "ckpt.pt")["step"] == 2 and not (tmp_path / "ckpt.pt.partial").exists()
