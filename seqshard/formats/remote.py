"""Shards on object storage and the web (``http(s)://``, ``s3://``, ``gs://``, any fsspec URL).

A remote shard is read in large ranged requests (``chunk_bytes`` each), several fetched ahead
of the reader on a small thread pool, so latency is hidden and nothing is downloaded whole
before reading starts. Each request is retried on a 5xx, a timeout, a dropped connection or a
short body, with bounded, jittered exponential backoff; a missing object (404) is not retried.
What still fails is a :class:`~seqshard.errors.ShardError` naming the URL and the byte range,
which ``skip_bad`` turns into a counted skip like any damaged shard.

With a :class:`~.cache.ShardCache` a shard is instead fetched whole into the local cache
(verified against its index's size and CRC) and read from there memory-mapped; the reader
starts fetching the next shard while it reads the current one.

The process-wide :class:`RemoteAccess` (options, cache) is set by the loader with :func:`use`
in the training process and in each worker. Credentials and endpoints come from fsspec's
backends (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...) or ``storage_options``; neither is
ever logged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import subprocess
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

from ..errors import ConfigError, ShardError, option

if TYPE_CHECKING:
    from .cache import ShardCache
    from .index import ShardIndex

_LOG = logging.getLogger("seqshard")

CHUNK_BYTES = 8 << 20
AHEAD = 4  # chunks fetched ahead of the reader
FETCH_THREADS = 8
NOT_RETRIED = {400, 401, 403, 404, 405, 410, 416}  # HTTP statuses a retry cannot fix


def is_remote(path: str) -> bool:
    """A URL that fsspec opens (``scheme://...``, not ``file://``), or a ``pipe:COMMAND``."""
    return is_pipe(path) or ("://" in path and not path.startswith("file://"))


def is_pipe(path: str) -> bool:
    """A ``pipe:COMMAND`` source (WebDataset's spelling): the shard is the command's output."""
    return path.startswith("pipe:")


@dataclass
class RemoteAccess:
    """How remote shards are read: fsspec ``storage_options``, retries, request timeout,
    chunk size and read-ahead, and an optional local cache. ``expected`` maps a shard URL to
    its ``(bytes, checksum)`` from the index (the cache verifies against it)."""

    storage_options: dict[str, Any] = field(default_factory=dict)
    retries: int = 4
    backoff_s: float = 0.5
    timeout_s: float = 60.0
    chunk_bytes: int = CHUNK_BYTES
    ahead: int = AHEAD
    cache: ShardCache | None = None
    allow_pipes: bool = False
    expected: dict[str, tuple[int, str | None]] = field(default_factory=dict)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}  # no file systems or threads

    # -- file systems --------------------------------------------------------------------
    def filesystem(self, url: str) -> tuple[Any, str]:
        """fsspec's file system for ``url`` (one per protocol, made once) and the path in it."""
        import fsspec

        protocol = url.split("://", 1)[0]
        systems = self.__dict__.setdefault("_systems", {})
        key = (os.getpid(), protocol)  # async file systems are not fork-safe: one per process
        if key not in systems:
            options = dict(self.storage_options)
            if protocol in ("http", "https"):
                options.setdefault("client_kwargs", {"timeout": _aiohttp_timeout(self.timeout_s)})
            try:
                systems[key] = fsspec.filesystem(protocol, skip_instance_cache=True, **options)
            except TypeError as error:
                raise ConfigError(f"storage_options do not suit {protocol}:// ({error}).") from None
            except (ImportError, ValueError) as error:
                raise ConfigError(
                    f"cannot read {protocol}:// URLs: {error}. Fix: pip install 'seqshard[remote]' "
                    "(aiohttp for http, s3fs for s3, gcsfs for gs)."
                ) from None
        fs = systems[key]
        return fs, fs._strip_protocol(url) if protocol not in ("http", "https") else url

    # -- requests with retries -----------------------------------------------------------
    def retrying(self, url: str, what: str, call: Any) -> Any:
        """``call()``, retried with jittered exponential backoff on transient failures;
        FileNotFoundError is raised as is; anything else in the end as a ShardError."""
        for attempt in range(self.retries + 1):
            try:
                return call()
            except FileNotFoundError:
                raise
            except TypeError as error:  # options the backend does not take: no retry mends that
                raise ConfigError(f"{url}: {what} failed: {error}. Check storage_options.") from None
            except Exception as error:
                status = getattr(error, "status", None) or getattr(error, "code", None)
                if status == 404:
                    raise FileNotFoundError(url) from error
                last = attempt == self.retries or status in NOT_RETRIED
                if last:
                    raise ShardError(
                        url,
                        None,
                        f"{what} failed after {attempt + 1} attempt(s): {_describe(error)}. Fix: check the host, port "
                        f"and path, and the credentials; a slow or flaky store may need {option('remote_retries', 8)} "
                        f"or {option('remote_timeout', 120)}; {option('skip_bad')} skips such shards (counted).",
                    ) from None
                wait = self.backoff_s * 2**attempt * random.uniform(0.5, 1.5)
                _LOG.info("%s: %s failed (%s); retrying in %.2f s", url, what, _describe(error), wait)
                time.sleep(wait)
        raise AssertionError("unreachable")

    def size(self, url: str) -> int:
        """The object's size: from the index when known, else asked of the store (0 for a
        command's output, unknown until read)."""
        known = self.expected.get(url)
        if known is not None:
            return known[0]
        if is_pipe(url):
            return 0
        return self.server_size(url)

    def server_size(self, url: str) -> int:
        """The object's size as the store reports it now."""
        fs, path = self.filesystem(url)
        try:
            return int(self.retrying(url, "asking its size", lambda: fs.size(path)))
        except FileNotFoundError:
            raise ShardError(url, None, "not found on the server (missing shard?)") from None

    def fetch(self, url: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``url``; a short body is a failure (retried)."""
        fs, path = self.filesystem(url)

        def call() -> bytes:
            data = fs.cat_file(path, start=start, end=end)
            if len(data) != end - start:
                raise OSError(f"short body: {len(data)} of {end - start} bytes")
            return data

        try:
            return self.retrying(url, f"reading bytes {start}-{end}", call)
        except FileNotFoundError:
            raise ShardError(url, start, "not found on the server (missing shard?)") from None

    def read_text(self, url: str) -> str | None:
        """A small text object (an index.json), or None when there is none."""
        fs, path = self.filesystem(url)
        try:
            return self.retrying(url, "reading", lambda: fs.cat_file(path)).decode("utf-8")
        except FileNotFoundError:
            return None

    def glob(self, pattern: str) -> list[str]:
        """URLs matching a glob, where the store can list (not plain http)."""
        fs, path = self.filesystem(pattern)
        protocol = pattern.split("://", 1)[0]
        found = self.retrying(pattern, "listing", lambda: fs.glob(path))
        return sorted(m if "://" in m else f"{protocol}://{m}" for m in found)

    # -- reading -------------------------------------------------------------------------
    def cached_copy(self, url: str) -> BinaryIO | None:
        """The cached copy of ``url`` (fetched now if needed), open and marked in use; None
        without a cache."""
        if self.cache is None or is_pipe(url):
            return None
        return self.cache.open(url, self.expected.get(url), lambda: RemoteBytes(url, self), self.chunk_bytes)

    def open_bytes(self, url: str) -> Any:
        """A byte source over ``url`` read from the network: a command's output, or ranged
        reads (a cached copy is read by the tar reader as a local file: :meth:`cached_copy`)."""
        if is_pipe(url):
            check_pipes_allowed(url, self.allow_pipes)
            return PipeBytes(url)
        return RemoteBytes(url, self)

    def prefetch(self, url: str) -> None:
        """Start fetching ``url`` in the background (the next shard a reader will open)."""
        if is_pipe(url):
            return
        if self.cache is not None:
            _pool().submit(_quietly, lambda: self.cached_copy(url).close())
        else:
            _early_chunks(self, url)


def _quietly(function: Any, *args: Any) -> None:
    """Run ``function`` ignoring its failure."""
    with contextlib.suppress(Exception):  # the reader meets the same failure when it opens the shard, and reports it
        function(*args)


def _describe(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return text if len(text) < 300 else text[:300] + "..."


def _aiohttp_timeout(seconds: float) -> Any:
    import aiohttp

    return aiohttp.ClientTimeout(total=None, sock_connect=seconds, sock_read=seconds)


_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """This process's fetch threads (made anew in a forked worker)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (os.getpid(), ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="seqshard-fetch"))
        return _POOL[1]


EARLY_SHARDS = 4  # shards whose first chunks are kept fetched ahead, per process
_EARLY: OrderedDict[str, dict[int, Future]] = OrderedDict()  # first chunks of shards readers open next


def _early_chunks(access: RemoteAccess, url: str) -> None:
    size = access.expected.get(url, (None, None))[0]
    if url in _EARLY or size is None:
        return
    while len(_EARLY) >= EARLY_SHARDS:  # one a reader did not open after all (its epoch ended): let it go
        for future in _EARLY.popitem(last=False)[1].values():
            future.cancel()
    _EARLY[url] = {
        k: _pool().submit(access.fetch, url, k * access.chunk_bytes, min(size, (k + 1) * access.chunk_bytes))
        for k in range(min(access.ahead, -(-size // access.chunk_bytes)))
    }


class RemoteBytes:
    """A remote object read through ranged requests of ``chunk_bytes``, ``ahead`` of them in
    flight: the byte-source interface of the tar reader (seek, read, skip, close)."""

    def __init__(self, url: str, access: RemoteAccess):
        self.path = url
        self._access = access
        self.size = access.size(url)
        self._chunk = access.chunk_bytes
        self._chunks: dict[int, Future] = _EARLY.pop(url, {})
        self._pos = 0
        # the index's size is used for planning reads; the server's is checked once, alongside
        # the first chunk, so that a shard replaced since it was indexed is not read as it
        self._checked: Future | None = _pool().submit(access.server_size, url) if url in access.expected else None

    def _check_size(self) -> None:
        checked, self._checked = self._checked, None
        if checked is not None and checked.result() != self.size:
            raise ShardError(
                self.path,
                None,
                f"the server has {checked.result()} bytes, its index.json says {self.size}: the shard changed since "
                "it was indexed. Fix: re-index the source and upload the new index.json (or put the shard back).",
            )

    def _future(self, number: int) -> Future:
        if number not in self._chunks:
            start = number * self._chunk
            end = min(self.size, start + self._chunk)
            self._chunks[number] = _pool().submit(self._access.fetch, self.path, start, end)
        return self._chunks[number]

    def _data(self, number: int) -> bytes:
        last = (self.size - 1) // self._chunk
        for ahead in range(number, min(last, number + self._access.ahead) + 1):
            self._future(ahead)
        for old in [k for k in self._chunks if k < number]:
            self._chunks.pop(old).cancel()
        return self._chunks[number].result()

    def seek(self, position: int) -> None:
        self._pos = position

    def skip(self, size: int) -> None:
        self._pos += size

    def read(self, size: int) -> bytes | memoryview:
        if self._checked is not None:
            self._check_size()
        end = min(self._pos + size, self.size)
        if end <= self._pos:
            return b""
        first, last = self._pos // self._chunk, (end - 1) // self._chunk
        if first == last:
            data = memoryview(self._data(first))[self._pos - first * self._chunk : end - first * self._chunk]
        else:
            parts = []
            for number in range(first, last + 1):
                chunk = self._data(number)
                base = number * self._chunk
                parts.append(chunk[max(self._pos, base) - base : min(end, base + len(chunk)) - base])
            data = memoryview(b"".join(parts))
        self._pos = end
        return data

    def close(self) -> None:
        for future in self._chunks.values():
            future.cancel()
        self._chunks = {}


def check_pipes_allowed(source: str, allowed: bool) -> None:
    if not allowed:
        raise ConfigError(
            f"{source[:120]!r} is a command; seqshard runs commands named by data only when asked: pass "
            f"{option('allow_pipes')} if you trust it."
        )


class PipeBytes:
    """The output of ``pipe:COMMAND`` (run by the shell), read front to back; seeking back
    runs the command again."""

    def __init__(self, source: str):
        self.path = source
        self._command = source[len("pipe:") :]
        self._process: subprocess.Popen | None = None
        self._pos = 0
        self._start()

    def _start(self) -> None:
        self.close()
        self._process = subprocess.Popen(self._command, shell=True, stdout=subprocess.PIPE)
        self._pos = 0

    def read(self, size: int) -> bytes:
        assert self._process is not None and self._process.stdout is not None
        data = self._process.stdout.read(size)
        self._pos += len(data)
        if len(data) < size:
            status = self._process.wait()
            if status != 0:
                raise ShardError(self.path, self._pos, f"the command exited with status {status}")
        return data

    def skip(self, size: int) -> None:
        while size > 0:
            data = self.read(min(size, CHUNK_BYTES))
            if not data:
                return
            size -= len(data)

    def seek(self, position: int) -> None:
        if position < self._pos:
            self._start()
        self.skip(position - self._pos)

    def close(self) -> None:
        if self._process is not None:
            if self._process.poll() is None:
                self._process.kill()
            self._process.wait()
            if self._process.stdout is not None:
                self._process.stdout.close()
            self._process = None


_CURRENT = RemoteAccess()


def use(access: RemoteAccess) -> None:
    """Make ``access`` the way this process reads remote shards."""
    global _CURRENT
    _CURRENT = access


def current() -> RemoteAccess:
    return _CURRENT


def load_remote_index(folder_url: str) -> ShardIndex | None:
    """The ``index.json`` of a remote folder, or None when it has none."""
    from .index import INDEX_NAME, ShardIndex

    url = folder_url.rstrip("/") + "/" + INDEX_NAME
    text = current().read_text(url)
    if text is None:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ShardError(url, None, f"not valid JSON: {error}") from None
    return ShardIndex.from_json(data, url, "seqshard index on a local copy, then upload its index.json")
