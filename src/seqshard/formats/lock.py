"""One writer at a time in a dataset folder: a lock file, ``FOLDER/.seqshard.lock``.

Writers of a dataset folder (``pack``, ``add-field``, ``index``; ``binarize`` per output prefix)
hold an ``fcntl.flock`` on a lock file in it while they write, and record in the file who they
are (pid, host, command, since). A second writer is refused with a message naming the first,
before it has read or written anything, so neither loses the other's work. The lock is the
kernel's: it goes with its process however that ends (SIGKILL included), so a killed run never
leaves a folder locked, and the file left behind is harmless. The lock file is a regular file
of its own: a hard link to another file (or a FIFO, a device) at its name is refused, not written. Parts of one pack
(``--num-parts``) share the lock with each other and exclude every other writer.

On a file system without locks (some network file systems) the writer goes on without one
and says so.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from ..errors import SeqshardError
from .files import inside, open_own, writing

_LOG = logging.getLogger("seqshard")
LOCK_NAME = ".seqshard.lock"
SHARED_PATIENCE = 10.0  # seconds a part waits for another part that holds the lock alone while it claims the folder
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class FolderBusyError(SeqshardError):
    """Another process is writing the folder."""


class FolderLock:
    """The lock of ``folder`` (file ``name`` in it), held by ``command`` (e.g. ``seqshard
    add-field``). ``shared``: taken alone when no one holds it (:attr:`alone`), else shared with
    other shared holders; :meth:`share` lets them in."""

    def __init__(self, folder: str | Path, command: str, *, shared: bool = False, name: str = LOCK_NAME):
        self.folder = Path(folder)
        self.path = inside(self.folder, self.folder / name)
        self.command = command
        self.shared = shared
        self.alone = False
        self._fd: int | None = None

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.release()

    def acquire(self) -> None:
        with writing(self.path):
            self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            fd = open_own(self.path, os.O_RDWR)  # a fresh file, or one no other name shares
            try:
                self.alone = self._try(fd, fcntl.LOCK_EX)
                if not self.alone and not (self.shared and self._wait_shared(fd)):
                    raise FolderBusyError(
                        f"{self.folder} is being written by another process ({_holder(fd)}), so {self.command} does "
                        "not start: two writers would lose each other's work. Fix: wait for it to finish (or stop "
                        "it), then run this again."
                    )
            except _Unlockable:
                _LOG.warning("%s: the file system has no locks; make sure no other seqshard writes it", self.folder)
                self.alone = True
                os.close(fd)
                return
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the holder removed the file as we opened it: lock the one there now
        self._fd = fd
        if self.alone:  # parts sharing the lock leave the first one's record
            self._record()

    def _wait_shared(self, fd: int) -> bool:
        """Take the lock shared, waiting a little for a part that holds it alone to share it."""
        deadline = time.monotonic() + SHARED_PATIENCE
        while not self._try(fd, fcntl.LOCK_SH):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    @staticmethod
    def _try(fd: int, kind: int) -> bool:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as error:
            if error.errno in _NO_LOCKS:
                raise _Unlockable from None
            raise
        return True

    def share(self) -> None:
        """Let other shared holders in (a part of a pack, once it has claimed the folder)."""
        if self._fd is not None and self.shared and self.alone:
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            self.alone = False

    def _record(self) -> None:
        assert self._fd is not None
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": self.command,
            "since": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        with contextlib.suppress(OSError):  # the record only names the holder; the lock is the flock
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, (json.dumps(record) + "\n").encode(), 0)

    def release(self) -> None:
        """Drop the lock; the last holder removes the file (under the lock, so that no one
        locks a removed file: :meth:`acquire` checks that the file it locked is still there)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError, _Unlockable):
            if self.alone or self._try(self._fd, fcntl.LOCK_EX):
                self.path.unlink()
        os.close(self._fd)  # closing drops the flock (forked children holding it keep it until they end)
        self._fd = None


class _Unlockable(Exception):
    """The file system does not lock."""


def _same_file(fd: int, path: Path) -> bool:
    try:
        there = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    here = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _holder(fd: int) -> str:
    """Who holds the lock, as its file records it."""
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        return f"pid {record['pid']} on host {record['host']}, {record['command']}, since {record['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its record is not written yet"


class FolderLocks:
    """The locks of several folders, taken in order (a parent before its sub-folders) and
    released together."""

    def __init__(self, folders: Sequence[str | Path], command: str):
        unique = sorted({os.path.realpath(f): Path(f) for f in folders}.items())
        self.locks = [FolderLock(folder, command) for _, folder in unique]

    def __enter__(self) -> FolderLocks:
        taken = []
        try:
            for lock in self.locks:
                lock.acquire()
                taken.append(lock)
        except BaseException:
            for lock in taken:
                lock.release()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for lock in self.locks:
            lock.release()


def refuse_if_held(folder: Path, command: str) -> None:
    """FolderBusyError naming the writer that holds ``folder``'s lock, if one does; nothing is
    created where no writer has been (called before saying a folder holds nothing to work on:
    a pack that has not written its first shard yet is the likelier cause)."""
    if (folder / LOCK_NAME).is_file():
        with FolderLock(folder, command):
            pass
