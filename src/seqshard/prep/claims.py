"""Claims on tasks, so that parts of one pack (``--num-parts``) share each wave's work.

Each part runs its own share of a wave first, then any task no live part has claimed, so that
parts started late, or never (an array job with a limit on running parts), cost no waiting: a
part that runs alone does every task. A claim is a file created exclusively
(``waves/claims/WAVE-TASK``) naming its holder (host, pid); its holder touches it every
:data:`HEARTBEAT_SECONDS` while it runs. A claim whose holder died (the same host, no such
process) or that was not touched for :data:`LEASE_SECONDS` is taken over. Tasks write their
output under temporary names and rename it, so a task run twice writes the same bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path

from ..errors import InputError, OutputError
from ..formats.files import inside, read_json, writing

HEARTBEAT_SECONDS = 30.0
LEASE_SECONDS = 600.0
CLAIMS_DIR = "claims"


class Claims:
    """This process's claims in a pack's waves folder (a context manager: the heartbeat runs
    while it is open)."""

    def __init__(self, folder: Path):
        self.folder = inside(folder, folder / CLAIMS_DIR)
        self.held: set[Path] = set()
        self._host = socket.gethostname()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Claims:
        with writing(self.folder):
            self.folder.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._beat, name="seqshard-claims", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for path in list(self.held):
            self.release(path.name)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            for path in list(self.held):
                with contextlib.suppress(OSError):
                    os.utime(path)

    def claim(self, name: str) -> bool:
        """Claim task ``name``; False when a live holder has it."""
        path = self.folder / name
        for _ in range(2):
            try:
                descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except FileExistsError:
                if not self._stale(path):
                    return False
                with contextlib.suppress(FileNotFoundError):
                    stolen = path.with_name(f".{name}.{os.getpid()}.stale")
                    os.rename(path, stolen)  # only one taker wins the rename
                    stolen.unlink()
                continue
            except OSError as error:
                raise OutputError.from_os_error(path, error) from None
            with os.fdopen(descriptor, "w") as stream:
                json.dump({"host": self._host, "pid": os.getpid(), "since": time.time()}, stream)
            self.held.add(path)
            return True
        return False

    def release(self, name: str) -> None:
        path = self.folder / name
        self.held.discard(path)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    def _stale(self, path: Path) -> bool:
        try:
            age = time.time() - path.stat().st_mtime
            holder = read_json(path, "", missing=None)  # a regular file of bounded size only
        except FileNotFoundError:
            return True
        except InputError:
            holder = {}
        if holder is None:  # gone since the stat
            return True
        if age > LEASE_SECONDS:
            return True
        if isinstance(holder, dict) and holder.get("host") == self._host and isinstance(holder.get("pid"), int):
            return not _alive(holder["pid"])
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
