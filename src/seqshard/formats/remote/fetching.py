"""Remote requests watched for stalls; http(s) requests made with aiohttp directly.

**The stall rule** (README, Remote shards), for every request that runs on fsspec's event loop
(http, s3fs, gcsfs): a timer on the loop notes the bytes of the answer received so far every
eighth of ``remote_timeout`` (nothing runs on the path of the bytes themselves). Once its body
has begun, a request that has received fewer than ``remote_min_rate`` bytes a second over the
last ``remote_timeout`` seconds has stalled, whatever its size; before that, its connection and
headers may take twice ``remote_timeout`` (a wait of ``remote_timeout`` for any byte is the
socket's timeout, aiohttp's ``sock_read``). A stalled request is cancelled and raises
:class:`Stalled`, which the caller retries. Where a library does not say how many bytes have
come (s3fs, gcsfs), a request is instead held to twice ``remote_timeout`` plus the bytes it may
bring at ``remote_min_rate`` (a range: its size; a size or a listing: ``LISTING_BYTES``).

**http(s) requests** (a size, a range, a small object whole, a stream) are made here rather than
through fsspec's file methods, so that their bytes are counted as they come and an answer is
bounded by what was asked: a Content-Length other than the range's, or a body longer than the
bound, fails without being read; a 200 answer to a ranged request is not read
(:class:`RangesIgnored`); aiohttp bounds the headers (8,190 bytes a line).
Redirects: aiohttp follows only http(s) ones; :func:`redirect_guard` refuses one that leads from
one kind of host to a non-public host of another kind (a public server to ``10.0.0.5``, a local
one to the cloud's metadata address ``169.254.169.254``): :class:`Refused`.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ...errors import redact

LISTING_BYTES = 64 << 20  # what a size, a listing or an index.json is given time for (some 100,000 names)
_WATCHES = 8  # progress notes per window
_PIECE = 4 << 20  # the most a socket read of an answer takes at once


class Stalled(Exception):
    """A request whose bytes stopped coming at ``min_rate`` (see the module docstring). Not a
    TimeoutError, which fsspec would turn into its own."""

    def __init__(self, received: int | None, seconds: float, rule: Rule, recent: int = 0):
        if received is None:
            text = f"stalled: not complete within {seconds:.1f} s (its library does not report bytes as they come)"
        elif not received:
            text = f"stalled: nothing of the answer's body came in {seconds:.1f} s"
        else:
            text = (
                f"stalled: {received} bytes received in {seconds:.1f} s, {recent} of them in the last {rule.window:g} s "
                f"(the least is {rule.min_rate:g} bytes/s over {rule.window:g} s)"
            )
        super().__init__(text)


class Refused(Exception):
    """A redirect that is not followed (to a non-public host of another kind)."""


class BodyError(OSError):
    """An answer whose body is not as long as asked for, or says it will not be."""


class RangesIgnored(Exception):
    """The server answered a ranged request with the whole object (HTTP 200)."""


@dataclass(frozen=True)
class Rule:
    """The stall rule's terms: ``window`` seconds (``remote_timeout``), ``min_rate`` bytes/s."""

    window: float
    min_rate: float

    def run(self, loop: Any, work: Awaitable, count: Callable[[], int] | None = None, expected: int = 0) -> Any:
        """The result of the coroutine ``work`` run on ``loop`` (fsspec's) under this rule, from
        another thread; ``count()`` says the bytes received so far (None: unknown, then the
        request may take ``2 * window + expected / min_rate`` seconds)."""
        from fsspec.asyn import sync

        return sync(loop, _watched, work, self, count, expected)


async def _watched(work: Awaitable, rule: Rule, count: Callable[[], int] | None, expected: int) -> Any:
    watch = _Watch(rule, count, expected)
    try:
        return await work
    except asyncio.CancelledError:
        if watch.stalled is None:
            raise
        if hasattr(watch.task, "uncancel"):  # Python >= 3.11: the cancellation was the watch's, not the caller's
            watch.task.uncancel()
        raise watch.stalled from None
    finally:
        watch.handle.cancel()


class _Watch:
    """The stall rule for the request of the task running now: a timer on its event loop that
    notes ``count()`` every eighth of a window and cancels the task once it has stalled."""

    def __init__(self, rule: Rule, count: Callable[[], int] | None, expected: int):
        self.loop = asyncio.get_running_loop()
        self.task: Any = asyncio.current_task()
        self.rule, self.count, self.expected = rule, count, expected
        self.started = self.loop.time()
        self.first = count() if count is not None else 0  # a stream's bytes before this read
        self.notes: deque[tuple[float, int]] = deque([(self.started, self.first)])
        self.stalled: Stalled | None = None
        self.handle = self.loop.call_later(rule.window / _WATCHES, self.check)

    def check(self) -> None:
        self.stalled = self._judge(self.loop.time())
        if self.stalled is not None:
            self.task.cancel()
        else:
            self.handle = self.loop.call_later(self.rule.window / _WATCHES, self.check)

    def _judge(self, now: float) -> Stalled | None:
        rule, took = self.rule, now - self.started
        if self.count is None:  # bytes not reported: the whole request is held to its size
            return Stalled(None, took, rule) if took >= 2 * rule.window + self.expected / rule.min_rate else None
        got = self.count()
        if got == self.first:  # nothing yet: the socket's timeout, and two windows for the headers
            self.notes = deque([(now, got)])
            return Stalled(0, took, rule) if took >= 2 * rule.window else None
        self.notes.append((now, got))
        while len(self.notes) > 1 and self.notes[1][0] <= now - rule.window:
            self.notes.popleft()
        since, before = self.notes[0]
        if now - since >= rule.window and got - before < rule.min_rate * rule.window:
            return Stalled(got - self.first, took, rule, got - before)
        return None


class Received:
    """The bytes an aiohttp answer's body has brought so far (0 until its headers came)."""

    def __init__(self) -> None:
        self.body: Any = None  # the answer's StreamReader

    def __call__(self) -> int:
        return 0 if self.body is None else self.body.total_bytes


async def _answer(fs: Any, method: str, url: str, received: Received, headers: dict[str, str], bufsize: int) -> Any:
    """aiohttp's answer to ``method url`` through fsspec's session and request options (its
    body not read yet); FileNotFoundError for a 404, ClientResponseError for another failure."""
    session = await fs.set_session()
    options = dict(fs.kwargs)
    headers = {**(options.pop("headers", None) or {}), "Accept-Encoding": "identity", **headers}
    options["read_bufsize"] = max(bufsize, 1 << 16)  # a whole chunk buffered without pausing the socket
    response = await session.request(method, fs.encode_url(url), headers=headers, **options)
    try:
        _read_in_large_pieces(response, bufsize)
        received.body = response.content
        if response.status == 404:
            raise FileNotFoundError(url)
        response.raise_for_status()
    except BaseException:
        response.close()
        raise
    return response


def _read_in_large_pieces(response: Any, size: int) -> None:
    """Let the socket hand over up to ``size`` bytes (at most 4 MiB) a read, where it is
    asyncio's own (uvloop's and TLS ones are left as they are). Its default, 256 KiB, woke the
    event loop some 60 times for a chunk of 8 MB; each time it waited for the GIL while the
    reader parsed, so chunks came slower than fetching alone (issue 30 item 21)."""
    transport = getattr(response.connection, "transport", None)
    if isinstance(getattr(transport, "max_size", None), int):
        transport.max_size = max(transport.max_size, min(size, _PIECE))


async def _body(response: Any, most: int, exact: bool = False) -> list[bytes]:
    """An answer's body, at most ``most`` bytes (the rest is not read), as the pieces the
    socket gave (not joined: a copy of every byte saved); with ``exact``, BodyError unless it is
    ``most`` bytes long, raised before the body is read when its length says so."""
    length = response.content_length
    if exact and length is not None and length != most:
        raise BodyError(f"the answer says it holds {length} bytes where {most} were asked for (Content-Length)")
    parts, got = [], 0
    if length is not None and length <= most:  # aiohttp stops at it: wait for all of it, then take it
        await response.content.wait_eof()
        while True:
            block, _ = await response.content.readchunk()  # one buffered piece as it is
            if not block:
                return parts
            parts.append(block)
    limit = most + 1 if exact else most  # with exact, one byte more tells a body longer than asked
    while got < limit:
        block = await response.content.read(limit - got)
        if not block:
            break
        parts.append(block)
        got += len(block)
    if got > most:
        raise BodyError(f"the answer brings more than the {most} bytes asked for (it has no Content-Length)")
    return parts


async def http_range(fs: Any, url: str, start: int, end: int, received: Received) -> tuple[list[bytes], bool]:
    """Bytes ``[start, end)`` (in pieces) and whether the answer was a range (206); a whole
    object (200) raises RangesIgnored without its body being read, unless the whole object was
    asked for."""
    range_ = {"Range": f"bytes={start}-{end - 1}"}
    async with await _answer(fs, "GET", url, received, range_, end - start) as response:
        if response.status != 206 and (start > 0 or response.content_length != end):
            raise RangesIgnored(url)
        return await _body(response, end - start, exact=True), response.status == 206


async def http_bytes(fs: Any, url: str, most: int, received: Received) -> bytes:
    """A small object (an index.json) whole, or its first ``most + 1`` bytes when it is larger
    (a ranged request, which a server that ignores ranges answers with all of it: the rest is
    not read)."""
    async with await _answer(fs, "GET", url, received, {"Range": f"bytes=0-{most}"}, most) as response:
        return b"".join(await _body(response, most + 1))


async def http_size(fs: Any, url: str, received: Received) -> int | None:
    """An object's size: a HEAD's Content-Length, else (no length, or HEAD refused, as by a URL
    signed for GET) a GET of its first byte, whose Content-Range (or length) says it; the GET's
    body is not read."""
    import aiohttp

    try:
        async with await _answer(fs, "HEAD", url, received, {}, 0) as response:
            if response.content_length is not None:
                return response.content_length
    except aiohttp.ClientResponseError:
        pass
    async with await _answer(fs, "GET", url, received, {"Range": "bytes=0-0"}, 1) as response:
        total = response.headers.get("Content-Range", "").rpartition("/")[2]
        if response.status == 206 and total.isdigit():
            return int(total)
        return response.content_length if response.status == 200 else None


class HttpStream:
    """One plain GET of an http object, read front to back (a server that ignores ranges):
    opened and each read run under the stall rule on fsspec's loop."""

    def __init__(self, fs: Any, url: str, rule: Rule, bufsize: int):
        self._fs, self._url, self._rule = fs, url, rule
        self._received = Received()
        self._response: Any = None
        self._bufsize = bufsize

    def open(self, size: int) -> None:
        """Send the GET of an object of ``size`` bytes (BodyError when the answer says another)."""
        self._response = self._rule.run(self._fs.loop, self._open(size), self._received)

    async def _open(self, size: int) -> Any:
        response = await _answer(self._fs, "GET", self._url, self._received, {}, self._bufsize)
        if response.content_length not in (None, size):
            response.close()
            raise BodyError(f"the answer says it holds {response.content_length} bytes where {size} were expected")
        return response

    def read(self, size: int) -> bytes:
        """Up to ``size`` bytes, fewer only at the end of the body."""
        return self._rule.run(self._fs.loop, self._read(size), self._received)

    async def _read(self, size: int) -> bytes:
        parts, got = [], 0
        while got < size:
            block = await self._response.content.read(size - got)
            if not block:
                break
            parts.append(block)
            got += len(block)
        return b"".join(parts)

    def close(self) -> None:
        response, self._response = self._response, None
        if response is not None and not self._fs.loop.is_closed():
            self._fs.loop.call_soon_threadsafe(response.close)


def redirect_guard() -> Any:
    """An aiohttp trace that refuses a redirect to a non-public host of another kind than the
    request's first host (:class:`Refused`; see the module docstring)."""
    import aiohttp

    guard = aiohttp.TraceConfig()

    async def started(session: Any, context: Any, params: Any) -> None:
        context.origin = params.url

    async def redirected(session: Any, context: Any, params: Any) -> None:
        from yarl import URL

        location = params.response.headers.get("Location")
        try:
            target = params.url.join(URL(location)) if location else None
        except ValueError:
            return  # aiohttp names it
        if target is None or target.scheme not in ("http", "https") or not target.host:
            return  # aiohttp refuses other schemes (file://) itself
        kind, first = await _host_kind(target.host), await _host_kind(context.origin.host or "")
        if kind != "public" and kind != first:
            raise Refused(
                f"the server redirected to {redact(str(target))}, a {kind} address, from a {first} one: not followed"
            )

    guard.on_request_start.append(started)
    guard.on_request_redirect.append(redirected)
    return guard


async def _host_kind(host: str) -> str:
    """public, private, loopback or link-local: the least public kind among a host's addresses."""
    try:
        addresses = [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        try:
            found = await asyncio.get_running_loop().getaddrinfo(host, None)
        except OSError:
            return "public"  # the connection fails on its own
        addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in found]
    kinds = {_address_kind(address) for address in addresses}
    return next((kind for kind in ("link-local", "loopback", "private") if kind in kinds), "public")


def _address_kind(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    return "public" if address.is_global else "private"
