"""A local disk cache of remote shards (``cache_dir=``, ``cache_limit=``).

The cache lives in a folder of its own, ``DIR/seqshard-cache/`` (tagged with a
``CACHEDIR.TAG``, which backup tools skip), and only ever removes files it wrote there: cached
shards (``HASH-NAME``, the hash of the whole URL and the shard's file name), its markers, and
partial files of fetches that were killed. Other files in ``DIR`` or in its folder are never
touched, nor counted in the limit.

A shard is fetched whole into ``HASH-NAME.part-PID``, checked against its index's size and
CRC-32 while it is written, and renamed to ``HASH-NAME`` only then: a reader never sees a
half-written file. One process per machine fetches a given shard at a time (an ``flock`` on
``.locks/HASH-NAME``); the others wait for it and then read the file it wrote. Using a cached
file sets its access time, and the least recently used files are removed beyond the limit
(partial files being written count in it; those whose fetch died, their lock free, are
removed); a reader opens its copy before using it, so a copy removed while it is being read
stays readable until closed (its disk space is freed then). A limit below one shard's size is
an error.

A cached file is checked against the index's size every time it is used, and its CRC once:
``.locks/HASH-NAME.ok`` records the (inode, size, mtime) of the file whose CRC was checked, so
a file rewritten since (damaged, truncated, replaced) is checked again, and fetched again when
it no longer matches.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit

from ...errors import ConfigError, OutputError, ShardError
from ..files import crc32_of, inside, open_output, read_input

_LOG = logging.getLogger("seqshard")
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})
FOLDER = "seqshard-cache"  # the cache's own folder inside cache_dir
TAG = "CACHEDIR.TAG"
_TAG_TEXT = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This folder holds seqshard's cache of remote shards (cache_dir=); its files can be deleted.\n"
)
_CACHED = re.compile(r"[0-9a-f]{16}-[^/]+")  # the names of cached shards (and, with .part-PID, of partial ones)


def parse_bytes(text: str | int | float) -> int:
    """``"200GB"``, ``"1.5 TiB"``, ``10**9`` -> bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"cache_limit {text!r} is not a size: write e.g. '200GB', '500MiB' or a number of bytes.")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


class ShardCache:
    """Remote shards kept in ``DIR/seqshard-cache/`` (``root``), at most ``limit`` bytes
    (None: no limit)."""

    def __init__(self, cache_dir: str | Path, limit: str | int | None = None):
        self.root = Path(cache_dir) / FOLDER
        self.limit = None if limit is None else parse_bytes(limit)
        try:
            if self.root.is_dir() and not (self.root / TAG).is_file() and _foreign(self.root):
                raise ConfigError(
                    f"cache_dir: {self.root} holds files that seqshard's cache did not write (it has no {TAG}); "
                    "choose another cache_dir, or move that folder away."
                )
            inside(cache_dir, self.root / ".locks")  # neither folder a link out of cache_dir
            (self.root / ".locks").mkdir(parents=True, exist_ok=True)
            if not (self.root / TAG).is_file():
                _write_text(self.root / TAG, _TAG_TEXT)
        except OSError as error:
            raise ConfigError(f"cache_dir {self.root} cannot be created: {error.strerror}.") from None

    def path_for(self, url: str) -> Path:
        """Where ``url`` is cached: its file name (without a query) after a hash of the whole URL."""
        digest = hashlib.blake2b(url.encode(), digest_size=8).hexdigest()
        return self.root / f"{digest}-{urlsplit(url).path.rstrip('/').rsplit('/', 1)[-1]}"

    def open(
        self, url: str, expected: tuple[int, str | None] | None, open_source: Callable[[], Any], chunk_bytes: int
    ) -> BinaryIO:
        """The local copy of ``url``, open for reading (fetched, once per machine at a time,
        when absent or damaged). Once open it stays readable even if evicted meanwhile.
        ``expected``: its (bytes, checksum) from the index, if known; ``open_source()`` gives a
        byte source over the remote object (``read(n)``, ``close()``)."""
        if expected is not None and self.limit is not None and expected[0] > self.limit:
            raise ConfigError(
                f"cache_limit is {self.limit} bytes but {url} alone is {expected[0]}: raise cache_limit above the "
                "size of a few shards (each reader holds one open and fetches the next)."
            )
        final = self.path_for(url)
        opened = self._open_usable(final, expected)
        if opened is None:
            with self._locked(final.name):
                opened = self._open_usable(final, expected)  # did another process fetch it meanwhile?
                if opened is None:
                    if final.exists():
                        _LOG.warning("%s: the cached copy %s is damaged (size or CRC); fetching it again", url, final)
                        final.unlink(missing_ok=True)  # an evicting process may have removed it meanwhile
                    for stale in self.root.glob(final.name + ".part-*"):  # left by a killed process
                        stale.unlink(missing_ok=True)
                    opened = self._fetch(url, final, open_source(), chunk_bytes, expected)
        self._touch(final)
        return opened

    def _open_usable(self, path: Path, expected: tuple[int, str | None] | None) -> BinaryIO | None:
        """``path`` opened, if it is there and matches the index; else None. Every check reads
        the open file, never the name again: another thread or process may remove or replace
        the name meanwhile (a damaged copy being fetched again), and the open file stays whole."""
        try:
            file = open(path, "rb")  # noqa: SIM115 (returned open)
        except FileNotFoundError:
            return None
        if not self._usable(file, path.name, expected):
            file.close()
            return None
        return file

    def _usable(self, file: BinaryIO, name: str, expected: tuple[int, str | None] | None) -> bool:
        info = os.fstat(file.fileno())
        if info.st_nlink == 0:  # removed since it was opened (evicted, or found damaged)
            return False
        if expected is None:
            return True
        size, checksum = expected
        if info.st_size != size:
            return False
        if checksum is None:
            return True
        mark = f"{info.st_ino} {info.st_size} {info.st_mtime_ns} {checksum}"
        marker = self.root / ".locks" / f"{name}.ok"
        with contextlib.suppress(OSError):
            if read_input(marker, 4096) == mark.encode():  # a regular file only: a FIFO there would hold us
                return True
        file.seek(0)
        if f"crc32:{crc32_of(file.read)[0]:08x}" != checksum:
            return False
        file.seek(0)
        _write_marker(marker, mark)
        return True

    def _touch(self, path: Path) -> Path:
        with contextlib.suppress(OSError):
            os.utime(path, ns=(time.time_ns(), path.stat().st_mtime_ns))  # the access time orders eviction
        return path

    @contextlib.contextmanager
    def _locked(self, name: str) -> Iterator[None]:
        with os.fdopen(open_output(self.root / ".locks" / name, append=True)) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _fetch(
        self, url: str, final: Path, source: Any, chunk_bytes: int, expected: tuple[int, str | None] | None
    ) -> BinaryIO:
        """Fetch ``url`` into ``final`` (checked against ``expected``) and return it open."""
        partial = final.with_name(f"{final.name}.part-{os.getpid()}")
        crc = 0
        try:
            with os.fdopen(open_output(partial), "wb") as out:
                while True:
                    data = source.read(chunk_bytes)
                    if not data:
                        break
                    out.write(data)
                    crc = zlib.crc32(data, crc)
            if expected is not None and expected[1] is not None and f"crc32:{crc:08x}" != expected[1]:
                raise ShardError(
                    url,
                    None,
                    f"the fetched copy has CRC crc32:{crc:08x}, its index says {expected[1]} (changed on the server?)",
                )
            info = partial.stat()  # the same inode, size and mtime once renamed
            with self._locked(".evict"):  # make room, appear, and be opened before anyone can evict it
                self._make_room(info.st_size, fetching=partial)
                os.replace(partial, final)
                opened = open(final, "rb")  # noqa: SIM115 (returned open)
            if expected is not None and expected[1] is not None:
                marker = self.root / ".locks" / f"{final.name}.ok"
                _write_marker(marker, f"{info.st_ino} {info.st_size} {info.st_mtime_ns} {expected[1]}")
            return opened
        except OSError as error:
            raise ShardError(url, None, f"cannot write the cache file {partial}: {error.strerror or error}") from None
        finally:
            source.close()
            partial.unlink(missing_ok=True)

    def _make_room(self, room: int, fetching: Path) -> None:
        """Remove partial files whose fetch died, then (under a limit) the least recently used
        cached shards until ``room`` more bytes fit, counting the partial files of fetches under
        way (``fetching`` is this one's)."""
        cached, total = [], room
        for path in self.root.iterdir():
            name, _, pid = path.name.partition(".part-")
            if not _CACHED.fullmatch(name) or path == fetching:
                continue  # not the cache's own file (its markers and locks are in .locks/)
            try:
                info = path.stat()
            except FileNotFoundError:
                continue
            if not pid:
                cached.append((info.st_atime_ns, info.st_size, path))
                total += info.st_size
            elif self._being_fetched(name):
                total += info.st_size
            else:  # left by a fetch that was killed before it could remove it
                path.unlink(missing_ok=True)
        if self.limit is None:
            return
        for _, size, path in sorted(cached):
            if total <= self.limit:
                break
            path.unlink(missing_ok=True)  # a reader that has it open keeps reading it until it closes
            (self.root / ".locks" / f"{path.name}.ok").unlink(missing_ok=True)
            total -= size

    def _being_fetched(self, name: str) -> bool:
        """Whether a process (this one included) holds the fetch lock of ``name``."""
        with os.fdopen(open_output(self.root / ".locks" / name, append=True)) as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(lock, fcntl.LOCK_UN)
            return False


def _foreign(folder: Path) -> bool:
    """Whether a folder holds entries that a cache being set up beside it would not have made."""
    return any(path.name not in (TAG, ".locks") for path in folder.iterdir())


def _write_text(path: Path, text: str) -> None:
    """A small file of the cache's own, never written through a link at its name."""
    with os.fdopen(open_output(path), "w") as file:
        file.write(text)


def _write_marker(path: Path, text: str) -> None:
    """A marker that spares a cached shard its CRC check; one that cannot be written (a link,
    a FIFO at its name, a full disk) is passed over: the shard is checked again next time."""
    with contextlib.suppress(OSError, OutputError):
        _write_text(path, text)
