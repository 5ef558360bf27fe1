"""Starting real gloo ranks as separate processes (like torchrun) and failing on a hang."""

from __future__ import annotations

import json
import os
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


def start_ranks(world_size: int, config: dict, out: Path) -> list[subprocess.Popen]:
    out.mkdir(parents=True, exist_ok=True)
    config = {**config, "out": str(out)}
    config_file = out / "config.json"
    config_file.write_text(json.dumps(config))
    port = free_port()
    processes = []
    for rank in range(world_size):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONPATH": str(Path(__file__).parent.parent),
        }
        processes.append(
            subprocess.Popen(
                [sys.executable, str(HARNESS), str(config_file)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    return processes


def kill(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
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
