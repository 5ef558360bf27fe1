"""Shards on object storage and the web (``http(s)://``, ``s3://``, ``gs://``, any fsspec URL).

A remote shard is read in large ranged requests (``chunk_bytes`` each), several fetched ahead
of the reader on a small thread pool, so latency is hidden and nothing is downloaded whole
before reading starts. A web server that ignores ``Range`` (``python -m http.server``, many
CDNs) answers the first such request with the whole file (HTTP 200); its body is not read, the
host is noted, and its shards are read front to back through one plain GET each
(:class:`RemoteStream`), which is how shards are read anyway; only starting inside a shard
then costs the download of the bytes before it.

Each request is retried on a 5xx, a timeout, a refused or dropped connection, a short body or a
stall, with bounded, jittered exponential backoff. ``remote_timeout`` bounds each wait on the
socket, and every request is watched for a stall (:mod:`.transfer`): fewer than
``remote_min_rate`` bytes a second over its last ``remote_timeout`` seconds, whatever its size.
Only an answer that says the object does not exist
(HTTP 404, S3's NoSuchKey) means a missing shard (:class:`NotOnServer`, not retried); fsspec's
http backend reports any failure to learn a size as FileNotFoundError, so its cause decides.
What still fails is a :class:`~seqshard.errors.ShardError` naming the URL and what happened
(status, timeout, connection, body length) with the advice that fits it, which ``skip_bad``
turns into a counted skip like any damaged shard.

With a :class:`~.cache.ShardCache` a shard is instead fetched whole into the local cache
(verified against its index's size and CRC) and read from there memory-mapped; the reader
starts fetching the next shard while it reads the current one.

The process-wide :class:`RemoteAccess` (options, cache) is set by the loader with :func:`use`
in the training process and in each worker. Credentials and endpoints come from fsspec's
backends (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...) or ``storage_options``; neither is
ever logged, and credentials in a URL (``user:password@``, signed query parameters) are
redacted wherever a URL is shown (:func:`seqshard.errors.redact`).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import logging
import os
import random
import subprocess
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO
from urllib.parse import urlsplit

from ...checks import parse_json
from ...errors import ConfigError, ShardError, counted, option, redact, redact_libraries
from ..prefetch import ReadAhead, read_ahead
from .fetching import (
    LISTING_BYTES,
    BodyError,
    HttpStream,
    RangesIgnored,
    Received,
    Refused,
    Rule,
    Stalled,
    http_bytes,
    http_range,
    http_size,
    redirect_guard,
)

if TYPE_CHECKING:
    from ..index import ShardIndex
    from .cache import ShardCache

_LOG = logging.getLogger("seqshard")

CHUNK_BYTES = 8 << 20
AHEAD = 4  # chunks fetched ahead of the reader
FETCH_THREADS = 8
INDEX_BYTES = LISTING_BYTES  # the most an index.json may hold (a folder of some 100,000 shards)


def is_remote(path: str) -> bool:
    """A URL that fsspec opens (``scheme://...``, not ``file://``), or a ``pipe:COMMAND``."""
    return is_pipe(path) or ("://" in path and not path.startswith("file://"))


def is_pipe(path: str) -> bool:
    """A ``pipe:COMMAND`` source (WebDataset's spelling): the shard is the command's output."""
    return path.startswith("pipe:")


def url_name(url: str) -> str:
    """The file name of a URL: the last segment of its path, without a query (a signature)."""
    return urlsplit(url).path.rstrip("/").rsplit("/", 1)[-1]


def has_query(url: str) -> bool:
    """Whether a URL carries a query (a signed URL): its folder's other objects are not
    reachable by swapping its file name, so no index.json is looked up for it."""
    return bool(urlsplit(url).query)


class NotOnServer(ShardError):
    """The store answered that the object does not exist (HTTP 404, S3's NoSuchKey)."""

    def __init__(self, url: str, offset: int | None = None, problem: str = "not found on the server (missing shard?)"):
        super().__init__(url, offset, problem)


class _Closed(Exception):
    """A read ahead whose reader closed the object meanwhile (nothing to retry)."""


@dataclass(frozen=True)
class Failure:
    """What a failed request met, in the terms that decide whether to retry and what to advise.
    ``kind``: missing, denied (401/403), rejected (other 4xx), server (5xx, 408, 429), timeout,
    stalled (its bytes stopped coming at the least rate), redirects (a redirect loop), refused (a
    redirect not followed), malformed (not HTTP: an endless header), connection (refused, reset,
    dropped), body (not the bytes asked for) or other; ``error`` is the exception that says so."""

    kind: str
    error: BaseException
    status: int | None = None

    @classmethod
    def of(cls, error: BaseException) -> Failure:
        if isinstance(error, FileNotFoundError):
            cause = error.__cause__
            status = None if cause is None else _status(cause)
            if cause is None or status == 404 or (status is None and not _network_error(cause)):
                return cls("missing", error, 404)
            error = cause  # fsspec's http size() reports any failure (a refused connection too) as not found
        if type(error).__name__ == "TooManyRedirects":  # aiohttp's, before its status (that of the last hop)
            return cls("redirects", error)
        if isinstance(error, Refused) or type(error).__name__ in _REFUSED_REDIRECTS:
            return cls("refused", error)
        if type(error).__name__ == "ClientResponseError" and type(error.__cause__).__module__.endswith(
            "http_exceptions"
        ):
            return cls("malformed", error)  # aiohttp's parser refused the headers: its 400 is not the server's
        status = _status(error)
        if status == 404:
            return cls("missing", error, status)
        if status in (401, 403) or isinstance(error, PermissionError):
            return cls("denied", error, status)
        if status is not None:
            return cls("rejected" if 400 <= status < 500 and status not in (408, 429) else "server", error, status)
        if isinstance(error, BodyError):
            return cls("body", error)
        if isinstance(error, Stalled):
            return cls("stalled", error)
        if isinstance(error, (TimeoutError, asyncio.TimeoutError)):
            return cls("timeout", error)
        return cls("connection" if _network_error(error) else "other", error)

    @property
    def retried(self) -> bool:
        return self.kind not in ("missing", "denied", "rejected", "redirects", "refused", "malformed")

    def gave_up(self, url: str, what: str, attempts: int, access: RemoteAccess) -> ShardError:
        """The error after the last of ``attempts``: what happened and what to do."""
        return ShardError(
            url,
            None,
            f"{what} failed after {counted(attempts, 'attempt')}: {_describe(self.error)}: "
            f"{self.advice(access)}; {option('skip_bad')} skips such shards (counted).",
        )

    def advice(self, access: RemoteAccess) -> str:
        """What happened and what to do, after the retries."""
        retries = option("remote_retries", max(8, 2 * access.retries))
        timeout = option("remote_timeout", max(120, round(2 * access.timeout_s)))
        if self.kind == "denied":
            return (
                f"the server refuses access (HTTP {self.status or 403}). Fix: check the credentials: "
                "storage_options, the backend's environment (AWS_ACCESS_KEY_ID, ...), the user:password in the URL, "
                "or a signed URL's expiry"
            )
        if self.kind == "rejected" and self.status == 416:
            return (
                "the server has fewer bytes than were asked for (HTTP 416): the shard is shorter than its index.json "
                "says. Fix: re-index the source and upload the new index.json (or put the shard back)"
            )
        if self.kind == "rejected":
            return f"the server rejects the request (HTTP {self.status}). Fix: check the URL and storage_options"
        if self.kind == "server":
            return (
                f"the server kept answering HTTP {self.status} (overloaded or restarting?). Fix: try again later, "
                f"or wait longer with {retries}"
            )
        if self.kind == "timeout":
            return f"no answer within {access.timeout_s:g} s. Fix: for a slow store or network raise {timeout}"
        if self.kind == "stalled":
            rate = option("remote_min_rate", max(1024, int(access.min_rate // 4)))
            return (
                f"its bytes came slower than remote_min_rate ({access.min_rate:g} bytes/s) over remote_timeout "
                f"({access.timeout_s:g} s): a stalled server or proxy. Fix: check the server; for a network that slow "
                f"lower {rate} or raise {timeout}"
            )
        if self.kind in ("redirects", "refused"):
            return (
                f"the server redirected the request again and again ({_redirects(self.error)}). Fix: check the URL "
                "(a redirect loop is the server's or proxy's configuration)"
                if self.kind == "redirects"
                else "redirects are followed to http(s) URLs only, and to a private, loopback or link-local address "
                "only from one of the same kind. Fix: if you trust where it leads, use that URL"
            )
        if self.kind == "malformed":
            return (
                "the server's answer breaks HTTP (a header too long or endless, bytes beyond its Content-Length). "
                "Fix: check the server or the proxy in between"
            )
        if self.kind == "connection":
            return (
                "the connection failed or dropped. Fix: check the host and port and that the server is up; a server "
                f"that restarts is waited for longer with {retries}"
            )
        if self.kind == "body":
            return (
                "the answers did not hold the bytes asked for (cut short by a flaky network or a proxy, or lengths "
                f"that disagree with the range). Fix: retry with {retries}"
            )
        return f"Fix: check the URL and storage_options; a flaky store may need {retries} or {timeout}"


_REFUSED_REDIRECTS = ("NonHttpUrlRedirectClientError", "InvalidUrlRedirectClientError")  # aiohttp's (file://, ...)


def _status(error: BaseException) -> int | None:
    """The HTTP status an error carries (aiohttp's ``status``, botocore's response), if any."""
    value = getattr(error, "status", None)
    if not isinstance(value, int):
        value = getattr(error, "code", None)  # urllib's spelling (aiohttp's is deprecated: asked only without status)
    if isinstance(value, int) and 100 <= value < 600:
        return value
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        value = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(value, int):
            return value
    return None


def _network_error(error: BaseException) -> bool:
    """A failure to get an answer: refused, reset or dropped connection, timeout."""
    return isinstance(error, (OSError, TimeoutError, asyncio.TimeoutError)) or type(error).__module__.startswith(
        "aiohttp"
    )


@dataclass
class RemoteAccess:
    """How a process reads shards, passed to every reader that opens one: for remote shards
    fsspec ``storage_options``, retries, request timeout, chunk size and read-ahead, and an
    optional local cache; for local ones the thread that reads ahead of them
    (:meth:`read_ahead`). ``expected`` maps a shard URL to its ``(bytes, checksum)`` from the
    index (the cache verifies against it); ``sizes`` holds the sizes the store reported for
    shards without an index entry."""

    storage_options: dict[str, Any] = field(default_factory=dict)
    retries: int = 4
    backoff_s: float = 0.5
    timeout_s: float = 60.0
    min_rate: float = 256 << 10
    chunk_bytes: int = CHUNK_BYTES
    ahead: int = AHEAD
    cache: ShardCache | None = None
    allow_pipes: bool = False
    expected: dict[str, tuple[int, str | None]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}  # no file systems or threads

    def read_ahead(self) -> ReadAhead:
        """This process's thread reading local shards ahead of their readers (one a process,
        whatever number of loaders it makes: each had left a thread and 8 MiB behind)."""
        return read_ahead()

    # -- file systems --------------------------------------------------------------------
    def filesystem(self, url: str) -> tuple[Any, str]:
        """fsspec's file system for ``url`` with this access's options, and the path in it."""
        return _filesystem(url, self.storage_options, self.timeout_s)

    @property
    def rule(self) -> Rule:
        """The stall rule every request is held to (:mod:`.transfer`)."""
        return Rule(self.timeout_s, self.min_rate)

    # -- requests with retries -----------------------------------------------------------
    def retrying(self, url: str, what: str, call: Any, abandoned: threading.Event | None = None) -> Any:
        """``call()``, retried with jittered exponential backoff on transient failures (see
        :class:`Failure`); an object the store says does not exist raises :class:`NotOnServer` at
        once, anything else in the end a ShardError saying what happened and what to do. No
        retry is made once ``abandoned`` is set (its reader closed: nobody waits for it)."""
        for attempt in range(self.retries + 1):
            try:
                return call()
            except (RangesIgnored, _Closed):
                raise
            except TypeError as error:  # options the backend does not take: no retry mends that
                raise ConfigError(f"{url}: {what} failed: {error}. Check storage_options.") from None
            except Exception as error:
                failure = Failure.of(error)
                if failure.kind == "missing":
                    raise NotOnServer(url) from None
                if attempt == self.retries or not failure.retried:
                    raise failure.gave_up(url, what, attempt + 1, self) from None
                abandoned = abandoned or threading.Event()
                if abandoned.is_set():
                    raise _Closed(url) from None
                wait = self.backoff_s * 2**attempt * random.uniform(0.5, 1.5)
                _LOG.info("%s: %s failed (%s); retrying in %.2f s", url, what, _describe(failure.error), wait)
                if abandoned.wait(wait):
                    raise _Closed(url) from None
        raise AssertionError("unreachable")

    def size(self, url: str) -> int:
        """The object's size: from the index when known, else asked of the store once (0 for
        a command's output, unknown until read)."""
        known = self.expected.get(url)
        if known is not None:
            return known[0]
        if is_pipe(url):
            return 0
        if url not in self.sizes:
            self.sizes[url] = self.server_size(url)
        return self.sizes[url]

    def server_size(self, url: str, abandoned: threading.Event | None = None) -> int:
        """The object's size as the store reports it now (NotOnServer when it has none)."""
        fs, path = self.filesystem(url)
        if _is_http(url):
            size = self.retrying(url, "asking its size", lambda: _http(self.rule, fs, http_size, url), abandoned)
        else:
            size = self.retrying(
                url, "asking its size", lambda: _call(self.rule, fs, "size", path, expected=0), abandoned
            )
        if size is None:
            raise _no_size(url)
        return int(size)

    def fetch(self, url: str, start: int, end: int, abandoned: threading.Event | None = None) -> FetchedRange:
        """Bytes ``[start, end)`` of ``url``; a short body is a failure (retried, until
        ``abandoned`` is set). RangesIgnored when the server answers with the whole object (the
        server is noted: :meth:`ranges`)."""
        fs, path = self.filesystem(url)

        def call() -> FetchedRange:
            if _is_http(url):
                pieces, ranged = _http(self.rule, fs, http_range, url, start, end)
            else:
                pieces, ranged = (
                    [_call(self.rule, fs, "cat_file", path, start=start, end=end, expected=end - start)],
                    True,
                )
            chunk = FetchedRange(pieces)
            if chunk.size != end - start:
                raise BodyError(f"short body: {chunk.size} of {end - start} bytes")
            if ranged:
                self._servers()[_host(url)] = True
            return chunk

        try:
            return self.retrying(url, f"reading bytes {start}-{end}", call, abandoned)
        except RangesIgnored:
            if self._servers().get(_host(url)) is not False:
                self._servers()[_host(url)] = False
                _LOG.info(
                    "%s ignores Range requests (it answers with the whole file): its shards are read front to back",
                    _host(url),
                )
            raise

    def ranges(self, url: str) -> bool | None:
        """Whether ``url``'s server answers ranged requests with the range: True for object
        stores, learnt from the first partial read for a web server (None until then)."""
        if not _is_http(url):
            return True
        return self._servers().get(_host(url))

    def _servers(self) -> dict[str, bool]:
        return self.__dict__.setdefault("_ranges", {})  # per process, learnt again in each worker

    def note_restart(self, url: str, skipped: int) -> None:
        """Say (once per server) that starting inside a shard on a server without ranges
        downloads the bytes before the start again."""
        hosts = self.__dict__.setdefault("_restarts", set())
        if _host(url) not in hosts:
            hosts.add(_host(url))
            _LOG.warning(
                "%s ignores Range requests, so starting inside a shard (split shards, a resumed epoch) downloads "
                "the shard's first bytes again (%d bytes of %s): serve the shards with a server that supports "
                "ranges, or pass cache_dir= to keep whole copies locally",
                _host(url),
                skipped,
                url,
            )

    def read_text(self, url: str) -> str | None:
        """A small text object (an index.json: at most INDEX_BYTES of UTF-8), or None when there
        is none."""
        fs, path = self.filesystem(url)

        def call() -> bytes:
            if _is_http(url):
                return _http(self.rule, fs, http_bytes, url, INDEX_BYTES)
            return _call(self.rule, fs, "cat_file", path, start=0, end=INDEX_BYTES + 1, expected=INDEX_BYTES)

        try:
            data = self.retrying(url, "reading", call)
        except NotOnServer:
            return None
        return _index_text(url, data)

    def glob(self, pattern: str) -> list[str]:
        """URLs matching a glob, where the store can list (not plain http)."""
        fs, path = self.filesystem(pattern)
        protocol = pattern.split("://", 1)[0]
        found = self.retrying(pattern, "listing", lambda: _call(self.rule, fs, "glob", path, expected=LISTING_BYTES))
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


# -- a store's file system and its requests, under the stall rule ---------------------------------


def _filesystem(url: str, storage_options: dict[str, Any], timeout_s: float) -> tuple[Any, str]:
    """fsspec's file system for ``url`` (one per process, protocol and options) and the path in it."""
    import fsspec

    protocol = url.split("://", 1)[0]
    options = dict(storage_options)
    # async file systems are not fork-safe: one per process
    key = (os.getpid(), protocol, repr(sorted(options.items())), timeout_s)
    with _SYSTEMS_LOCK:
        if key not in _SYSTEMS:
            if protocol in ("http", "https"):
                options["client_kwargs"] = _client_options(options.get("client_kwargs"), timeout_s)
            try:
                _SYSTEMS[key] = fsspec.filesystem(protocol, skip_instance_cache=True, **options)
                redact_libraries()  # the loggers its modules made on import
            except TypeError as error:
                raise ConfigError(f"storage_options do not suit {protocol}:// ({error}).") from None
            except (ImportError, ValueError) as error:
                raise ConfigError(
                    f"cannot read {protocol}:// URLs: {error}. Fix: pip install 'seqshard[remote]' "
                    "(aiohttp for http, s3fs for s3, gcsfs for gs)."
                ) from None
        fs = _SYSTEMS[key]
    return fs, fs._strip_protocol(url) if protocol not in ("http", "https") else url


def _call(rule: Rule, fs: Any, name: str, *args: Any, expected: int, **kwargs: Any) -> Any:
    """``fs.NAME(*args, **kwargs)``; where ``fs`` is asynchronous (s3fs, gcsfs) its coroutine
    ``_NAME`` under the stall ``rule``, given ``expected`` bytes (it does not report them)."""
    if getattr(fs, "async_impl", False):
        return rule.run(fs.loop, getattr(fs, "_" + name)(*args, **kwargs), None, expected)
    return getattr(fs, name)(*args, **kwargs)


def _http(rule: Rule, fs: Any, request: Any, *args: Any) -> Any:
    """The coroutine ``request(fs, *args, received)`` of :mod:`.transfer` under the stall ``rule``."""
    received = Received()
    return rule.run(fs.loop, request(fs, *args, received), received)


def _no_size(url: str) -> ShardError:
    """The error for an object whose size the server does not say."""
    return ShardError(
        url,
        None,
        "the server does not say its size (no Content-Length). Fix: index the folder (run "
        "`seqshard index` on a local copy and upload its index.json), which records every shard's size.",
    )


def _index_text(url: str, data: bytes) -> str:
    """``data`` read from ``url`` as an index.json's text; ShardError when it cannot be one."""
    if len(data) > INDEX_BYTES:
        raise ShardError(url, None, f"larger than the {INDEX_BYTES} bytes an index may hold: not an index.json")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ShardError(url, error.start, "not UTF-8 text: not an index.json written by seqshard") from None


def _quietly(function: Any, *args: Any) -> None:
    """Run ``function`` ignoring its failure."""
    with contextlib.suppress(Exception):  # the reader meets the same failure when it opens the shard, and reports it
        function(*args)


def _describe(error: BaseException) -> str:
    text = redact(str(error) or type(error).__name__)  # redacted before it is cut short
    return text if len(text) < 300 else text[:300] + "..."


def _host(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _is_http(url: str) -> bool:
    return url.startswith(("http://", "https://"))


def _redirects(error: BaseException) -> str:
    """The hops of a redirect loop, as the answers' Location headers name them."""
    hops = [str(getattr(answer, "url", "?")) for answer in getattr(error, "history", ())]
    shown = " -> ".join(redact(hop) for hop in hops[:4]) + (" -> ..." if len(hops) > 4 else "")
    return f"{len(hops)} redirects: {shown}" if hops else "too many redirects"


def _client_options(given: dict[str, Any] | None, timeout_s: float) -> dict[str, Any]:
    """aiohttp session options: the socket's timeout and the redirect guard, with the user's."""
    import aiohttp

    options = {"timeout": aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)}
    options.update(given or {})
    options["trace_configs"] = [*options.get("trace_configs", ()), redirect_guard()]
    return options


_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()
# File systems are kept for the life of the process, shared by its loaders: one made per loader
# and dropped was finalized in each forked worker (fsspec closes its session there, waiting 1 s
# on the parent's event loop), so every earlier loader delayed every worker's start by a second.
_SYSTEMS: dict[tuple[int, str, str], Any] = {}
_SYSTEMS_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """This process's fetch threads (made anew in a forked worker)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (os.getpid(), ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="seqshard-fetch"))
        return _POOL[1]


EARLY_SHARDS = 4  # shards whose first chunks are kept fetched ahead, per process
# first chunks of shards readers open next, and the event that says nobody will read them
_EARLY: OrderedDict[str, tuple[threading.Event, dict[int, Future]]] = OrderedDict()


def _early_chunks(access: RemoteAccess, url: str) -> None:
    size = access.expected.get(url, (None, None))[0]
    if url in _EARLY or size is None or (size > access.chunk_bytes and not access.ranges(url)):
        return  # a server not known to serve ranges is asked by one request first
    while len(_EARLY) >= EARLY_SHARDS:  # one a reader did not open after all (its epoch ended): let it go
        abandoned, chunks = _EARLY.popitem(last=False)[1]
        abandoned.set()
        for future in chunks.values():
            future.cancel()
    abandoned = threading.Event()
    _EARLY[url] = (
        abandoned,
        {
            k: _pool().submit(
                access.fetch, url, k * access.chunk_bytes, min(size, (k + 1) * access.chunk_bytes), abandoned
            )
            for k in range(min(access.ahead, -(-size // access.chunk_bytes)))
        },
    )


class FetchedRange:
    """A fetched range as the pieces the socket gave it in (most reads fall in one piece and
    are a view of it; one that spans two joins their parts)."""

    __slots__ = ("pieces", "size", "starts")

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces
        self.starts = [0, *itertools.accumulate(map(len, pieces))]
        self.size = self.starts[-1]

    def piece(self, at: int) -> tuple[int, memoryview]:
        """The piece holding byte ``at`` of the chunk: where it starts in the chunk, and a view."""
        index = bisect.bisect_right(self.starts, at) - 1
        return self.starts[index], memoryview(self.pieces[index])


class RemoteBytes:
    """A remote object read through ranged requests of ``chunk_bytes``, ``ahead`` of them in
    flight: the byte-source interface of the tar reader (seek, read, skip, close). On a server
    that ignores ranges it reads through a :class:`RemoteStream` instead."""

    def __init__(self, url: str, access: RemoteAccess):
        self.path = url
        self._access = access
        self.size = access.size(url)
        self._chunk = access.chunk_bytes
        self._abandoned, self._chunks = _EARLY.pop(url, None) or (threading.Event(), {})  # set when closed
        self._stream: RemoteStream | None = None  # reads on a server that ignores ranges
        self._pos = 0
        self._current: tuple[int, FetchedRange] = (-1, FetchedRange([]))  # the chunk read last
        self._base, self._view = 0, memoryview(b"")  # the piece read last: where it starts, a view
        # the index's size is used for planning reads; the server's is checked once, alongside
        # the first chunk, so that a shard replaced since it was indexed is not read as it
        self._checked: Future | None = None
        if url in access.expected:
            self._checked = _pool().submit(access.server_size, url, self._abandoned)

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
            self._chunks[number] = _pool().submit(self._access.fetch, self.path, start, end, self._abandoned)
        return self._chunks[number]

    def _data(self, number: int) -> FetchedRange:
        if number == self._current[0]:
            return self._current[1]
        last = (self.size - 1) // self._chunk
        depth = self._access.ahead if self._access.ranges(self.path) else 0  # one request learns a server's ways
        for ahead in range(number, min(last, number + depth) + 1):
            self._future(ahead)
        for old in [k for k in self._chunks if k < number]:
            self._chunks.pop(old).cancel()
        chunk = self._chunks[number].result()
        self._current = (number, chunk)
        return chunk

    def seek(self, position: int) -> None:
        self._pos = position

    def skip(self, size: int) -> None:
        self._pos += size

    def read(self, size: int) -> bytes | memoryview:
        try:
            return self._read(size)
        except ShardError:
            self.close()  # nobody will read the rest: stop its reads ahead and their retries
            raise

    def _read(self, size: int) -> bytes | memoryview:
        at = self._pos - self._base
        if at >= 0 and at + size <= len(self._view):  # most reads: within the piece read last
            self._pos += size
            return self._view[at : at + size]
        if self._checked is not None:
            self._check_size()
        end = min(self._pos + size, self.size)
        if end <= self._pos:
            return b""
        if self._stream is None and self._access.ranges(self.path) is not False:
            try:
                data = self._ranged(end)
                self._pos = end
                return data
            except RangesIgnored:
                pass
        if self._stream is None:
            self._cancel_chunks()
            self._stream = RemoteStream(self.path, self._access, self.size)
        data = self._stream.read_at(self._pos, end - self._pos)
        self._pos = end
        return data

    def _ranged(self, end: int) -> bytes | memoryview:
        parts, position = [], self._pos
        while position < end:
            number = position // self._chunk
            start, view = self._data(number).piece(position - number * self._chunk)
            self._base, self._view = number * self._chunk + start, view
            parts.append(view[position - self._base : end - self._base])
            position += len(parts[-1])
        return parts[0] if len(parts) == 1 else memoryview(b"".join(parts))

    def _cancel_chunks(self) -> None:
        for future in self._chunks.values():
            future.cancel()
        self._chunks = {}
        self._current, self._base, self._view = (-1, FetchedRange([])), 0, memoryview(b"")

    def close(self) -> None:
        self._abandoned.set()
        self._cancel_chunks()
        if self._stream is not None:
            self._stream.close()


class RemoteStream:
    """An object on a server that ignores ranges, read front to back through one GET,
    ``chunk_bytes`` at a time with the next chunk fetched ahead. Reading at an earlier position,
    or after a failure (retried like a ranged read), starts the GET again and discards the
    bytes before the position."""

    def __init__(self, url: str, access: RemoteAccess, size: int):
        self.path = url
        self.size = size
        self._access = access
        self._lock = threading.Lock()  # the GET is read by one thread at a time
        self._file: Any = None
        self._at = 0  # bytes of the current GET read so far
        self._closed = threading.Event()
        self._failed = False  # the last read of the GET failed (it is opened again, no restart to report)
        self._chunk: tuple[int, bytes] = (0, b"")
        self._ahead: tuple[int, Future] | None = None

    def read_at(self, position: int, size: int) -> bytes | memoryview:
        """Bytes ``[position, position + size)`` (fewer at the end of the object)."""
        end = min(position + size, self.size)
        parts = []
        while position < end:
            start, data = self._chunk
            if not start <= position < start + len(data):
                start, data = self._chunk = self._next(position)
            parts.append(memoryview(data)[position - start : min(end, start + len(data)) - start])
            position += len(parts[-1])
        return parts[0] if len(parts) == 1 else memoryview(b"".join(parts))

    def _next(self, position: int) -> tuple[int, bytes]:
        """The chunk holding ``position``: the one read ahead if it does, else one read now."""
        ahead, self._ahead = self._ahead, None
        start, data = position, b""
        if ahead is not None:
            try:
                start, data = ahead[0], ahead[1].result()
            except Exception:
                if ahead[0] == position:
                    raise  # the chunk needed failed after its retries
        if not start <= position < start + len(data):
            start, data = position, self._pull(position)
        if start + len(data) < self.size:
            self._ahead = (start + len(data), _pool().submit(self._pull, start + len(data)))
        return start, data

    def _pull(self, start: int) -> bytes:
        want = min(self._access.chunk_bytes, self.size - start)
        what = f"reading bytes {start}-{start + want}"
        return self._access.retrying(self.path, what, lambda: self._read(start, want), self._closed)

    def _read(self, start: int, want: int) -> bytes:
        with self._lock:
            if self._closed.is_set():
                raise _Closed(self.path)
            try:
                if self._file is None or self._at > start:
                    self._open()
                    if start and not self._failed:
                        self._access.note_restart(self.path, start)
                while self._at < start:  # a skip forward, or the bytes before a (re)start
                    skipped = len(self._file.read(min(self._access.chunk_bytes, start - self._at)))
                    if not skipped:
                        break
                    self._at += skipped
                data = self._file.read(want) if self._at == start else b""
                self._at += len(data)
                if len(data) != want:
                    raise BodyError(f"short body: it ended at byte {self._at} of {self.size}")
                self._failed = False
                return data
            except BaseException:
                self._failed = True
                self._drop()
                raise

    def _open(self) -> None:
        self._drop()
        fs, _ = self._access.filesystem(self.path)
        self._file = HttpStream(fs, self.path, self._access.rule, self._access.chunk_bytes)  # a plain GET
        self._file.open(self.size)
        self._at = 0

    def _drop(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead[1].cancel()
            self._ahead = None
        self._closed.set()
        with self._lock:
            self._drop()


def check_pipes_allowed(source: str, allowed: bool) -> None:
    if not allowed:
        raise ConfigError(
            f"{redact(source)[:120]!r} is a command; seqshard runs commands named by data only when asked: pass "
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


def load_remote_index(folder_url: str, access: RemoteAccess) -> ShardIndex | None:
    """The ``index.json`` of a remote folder, or None when it has none."""
    from ..index import INDEX_NAME, ShardIndex

    url = folder_url.rstrip("/") + "/" + INDEX_NAME
    text = access.read_text(url)
    if text is None:
        return None
    fix = "seqshard index on a local copy, then upload its index.json"
    data = parse_json(text, url, "run `seqshard index` on a local copy, then upload its index.json.")
    return ShardIndex.from_json(data, url, fix)
