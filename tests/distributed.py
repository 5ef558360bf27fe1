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
    port = free_port()
    processes = []
    for rank in range(world_size):
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONPATH": str(Path(__file__).parent.parent),
        }
        processes.append(RankProcess(str(HARNESS), str(config_file), env, out / f"rank{rank}.log"))
    return processes


class RankProcess:
    """One rank, forked from a server process that has imported torch and seqshard once
    (multiprocessing's forkserver), instead of a new interpreter importing them again (about
    3 s of CPU a rank on the test machines). Like ``subprocess.Popen``: ``pid`` (the leader of
    a session of its own), ``poll()``, ``wait()``, ``returncode``, ``stdout`` (its output)."""

    def __init__(self, harness: str, config_file: str, env: dict, log: Path):
        self._log = log
        self._process = _forkserver().Process(target=_run_harness, args=(harness, config_file, env, str(log)))
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


_PRELOAD = ["torch", "torch.distributed", "seqshard", "seqshard.loader", "seqshard.pipeline.rank.loader"]


def _forkserver():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)  # read when the server starts (once per test process)
    return context


def _run_harness(harness: str, config_file: str, env: dict, log: str) -> None:
    """A rank's process: a session of its own (killed as a group), the rank's environment, its
    output to ``log``, then the harness as a script."""
    os.setsid()
    multiprocessing.set_start_method("fork", force=True)  # its DataLoader workers as a torchrun rank's: forked
    os.environ.update(env)
    output = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(output, 1)
    os.dup2(output, 2)
    sys.argv = [harness, config_file]
    runpy.run_path(harness, run_name="__main__")


def kill(processes: list[RankProcess]) -> None:
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.killpg(process.pid, signal.SIGKILL)
    for process in processes:
        process.wait()


def run_ranks(world_size: int, config: dict, out: Path, timeout: float = 120) -> list[dict]:
    """Run a job to the end; a job still running after ``timeout`` seconds fails the test."""
    processes = start_ranks(world_size, config, out)
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    if any(p.poll() is None for p in processes):
        kill(processes)
        logs = "\n".join(p.stdout.read().decode(errors="replace")[-3000:] for p in processes)
        pytest.fail(f"distributed job hung (still running after {timeout} s):\n{logs}")
    for rank, process in enumerate(processes):
        if process.returncode != 0:
            pytest.fail(
                f"rank {rank} failed with {process.returncode}:\n{process.stdout.read().decode(errors='replace')[-4000:]}"
            )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
