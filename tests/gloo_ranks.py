"""Starting real gloo ranks as separate processes (like torchrun) and failing on a hang."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HARNESS = Path(__file__).parent / "ddp_harness.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_ranks(world_size: int, config: dict, out: Path) -> list[RankProcess]:
    out.mkdir(parents=True, exist_ok=True)
    config = {**config, "out": str(out)}
    config_file = out / "config.json"
    config_file.write_text(json.dumps(config))
    return start_script(HARNESS, [str(config_file)], out, world_size)


def start_script(
    script: Path, args: list[str], out: Path, world_size: int | None = None, cwd: Path | None = None, stderr_apart=False
) -> list[RankProcess]:
    """``script`` run as ``python script *args`` would, in ``cwd``: as ``world_size`` gloo ranks
    with the environment torchrun gives them (RANK, WORLD_SIZE, LOCAL_*, MASTER_*), or as one process
    with none of it (``world_size`` None, like a run without a launcher). Rank r's output goes to
    OUT/rank<r>.log, its stderr to OUT/rank<r>.err when ``stderr_apart``."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    processes = []
    for rank in range(world_size or 1):
        env = {"PYTHONPATH": str(Path(__file__).parent.parent / "src")}
        if world_size is not None:
            env.update(
                RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
            )
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        errors = out / f"rank{rank}.err" if stderr_apart else None
        processes.append(RankProcess(str(script), args, env, out / f"rank{rank}.log", cwd, errors))
    return processes


class RankProcess:
    """One rank (or one process without a launcher), forked from a server process that has imported torch and seqshard once
    (multiprocessing's forkserver), instead of a new interpreter importing them again (about
    3 s of CPU a rank on the test machines). Like ``subprocess.Popen``: ``pid`` (the leader of
    a session of its own), ``poll()``, ``wait()``, ``returncode``, ``stdout`` (its output)."""

    def __init__(
        self, script: str, args: list[str], env: dict, log: Path, cwd: Path | None = None, errors: Path | None = None
    ):
        self._log = log
        log.touch()  # readable at once, before the process has started
        run = (script, args, env, str(log), cwd and str(cwd), errors and str(errors))
        self._process = _forkserver().Process(target=_run_script, args=run)
        self._process.start()
        self.pid = self._process.pid
        self._stdout = None

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int | None:
        self._process.join(timeout)
        return self._process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[bytes, None]:
        """Wait for the end (``subprocess.TimeoutExpired`` after ``timeout`` seconds) and give its output."""
        if self.wait(timeout) is None:
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
        return self.stdout.read(), None

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    @property
    def stdout(self):
        if self._stdout is None:
            self._stdout = open(self._log, "rb")  # noqa: SIM115 (read by the tests like a pipe)
        return self._stdout


# torch._dynamo: what DistributedDataParallel imports when a model is wrapped (1.5-2.5 s of CPU
# a rank); seqshard.app.trainer: what examples/train_ddp.py runs.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "seqshard",
    "seqshard.loader",
    "seqshard.pipeline.rank.shard_loader",
    "seqshard.app.trainer",
]


def _forkserver():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)  # read when the server starts (once per test process)
    return context


def _run_script(script: str, args: list[str], env: dict, log: str, cwd: str | None, errors: str | None) -> None:
    """A rank's process: a session of its own (killed as a group), the rank's environment and
    working folder, its output to ``log`` (stderr to ``errors`` when given), then the script
    as ``python script *args`` runs it."""
    os.setsid()
    multiprocessing.set_start_method("fork", force=True)  # its DataLoader workers as a torchrun rank's: forked
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    sys.stdout.flush()
    sys.stderr.flush()
    output = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(output, 1)
    os.dup2(output if errors is None else os.open(errors, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    sys.stdout.reconfigure(line_buffering=True)  # lines reach the log as printed, as with PYTHONUNBUFFERED
    sys.stderr.reconfigure(line_buffering=True)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def kill(processes: list[RankProcess]) -> None:
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.killpg(process.pid, signal.SIGKILL)
    for process in processes:
        process.wait()


def run_ranks(world_size: int, config: dict, out: Path, timeout: float = 120) -> list[dict]:
    """Run a job to the end; a job still running after ``timeout`` seconds fails the test."""
    wait_for(start_ranks(world_size, config, out), timeout)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


def wait_for(processes: list[RankProcess], timeout: float = 120) -> None:
    """Wait for every process to end with 0; one failing, or still running after ``timeout``
    seconds, fails the test (with the end of the output)."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    if any(p.poll() is None for p in processes):
        kill(processes)
        logs = "\n".join(p.stdout.read().decode(errors="replace")[-8000:] for p in processes)
        pytest.fail(f"distributed job hung (still running after {timeout} s):\n{logs}")
    for rank, process in enumerate(processes):
        if process.returncode != 0:
            pytest.fail(
                f"rank {rank} failed with {process.returncode}:\n{process.stdout.read().decode(errors='replace')[-4000:]}"
            )
