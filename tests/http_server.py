"""A threaded HTTP server over a folder, started by tests and benchmarks on loopback, with
ranged reads (or none, as plain web servers) and injectable faults (per file: 500s, 404s,
truncated or dropped bodies, delays). Stopping it closes its open connections too, as a
server that goes down does."""

from __future__ import annotations

import contextlib
import re
import socket
import sys
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class ShardServer:
    """``with ShardServer(root) as server: server.url`` serves ``root``.

    ``faults[name]`` is a list of actions used up by successive GETs of that file
    (``head_faults[name]`` by its HEADs): a status such as ``"500"``, ``"404"`` or ``"403"``,
    ``"truncate"`` (half the body, then the connection closes), ``"short"`` (a whole answer of
    half the bytes asked for), ``"slow:S"`` (wait S seconds first), ``"trickle:S"`` (the body one
    byte every S seconds), ``"rate:B"`` (the body at B bytes a second), ``"trickle-headers:S"``
    (the status line and headers one byte every S seconds), ``"endless-header"`` (a header line
    that never ends), ``"chunked"`` (an endless chunked body instead of the one asked for),
    ``"length:N"`` (the body asked for under a Content-Length of N, then the connection closes),
    ``"huge"`` (a 200 answer of 10**12 bytes, whatever the range: zeros until the client leaves),
    ``"redirect"`` (answered with a redirect to itself, forever: a redirect loop),
    ``"redirect:URL"`` (a redirect to URL). ``latency`` delays every request.
    ``requests`` logs (method, path, range).
    ``ranges=False`` ignores Range headers (200 with the whole file, as ``python -m http.server``).
    """

    def __init__(self, root: str | Path, latency: float = 0.0, port: int = 0, ranges: bool = True):
        self.root = Path(root)
        self.latency = latency
        self.ranges = ranges
        self.connections: set[socket.socket] = set()
        self.faults: dict[str, list[str]] = defaultdict(list)
        self.head_faults: dict[str, list[str]] = defaultdict(list)
        self.requests: list[tuple[str, str, str | None]] = []
        self.missing: set[str] = set()  # names answered with 404 every time
        self._lock = threading.Lock()
        self._stopped = threading.Event()  # set when the server stops (ends trickling answers)
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self._server.daemon_threads = True
        self._server.handle_error = self._client_left  # type: ignore[method-assign]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _client_left(self, request: object, address: object) -> None:
        """A client that left mid-answer (it gave up on a stalled or refused one) is no error."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            ThreadingHTTPServer.handle_error(self._server, request, address)

    def gets(self, name: str) -> int:
        """How many GETs reached the server for a file name."""
        return sum(1 for method, path, _ in self.requests if method == "GET" and path.endswith("/" + name))

    def __enter__(self) -> ShardServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped.set()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            for connection in self.connections:  # kept-alive connections end with the server
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with server._lock:
                    server.connections.add(self.connection)

            def finish(self) -> None:
                with server._lock:
                    server.connections.discard(self.connection)
                super().finish()

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                time.sleep(server.latency)
                path = self.path.split("?", 1)[0]
                name = Path(path).name
                with server._lock:
                    server.requests.append((self.command, path, self.headers.get("Range")))
                    faults = server.faults[name] if body else server.head_faults[name]
                    action = faults.pop(0) if faults else ""
                file = server.root / path.lstrip("/")
                if action.startswith("slow:"):
                    time.sleep(float(action.split(":", 1)[1]))
                if action.startswith("redirect"):
                    if action == "redirect":
                        server.faults[name].insert(0, "redirect")  # every hop redirects again
                    self.send_response(302)
                    self.send_header("Location", action.partition(":")[2] or self.path)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if action in ("endless-header", "huge") or action.startswith("trickle-headers:"):
                    return self._hostile(action, file)
                if action.isdigit() and action != "404":
                    return self._status(int(action))
                if action == "404" or Path(path).name in server.missing or not file.is_file():
                    return self._status(404)
                size = file.stat().st_size
                start, end, status = 0, size, 200
                match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
                if match and server.ranges:
                    start = int(match.group(1))
                    end = min(size, int(match.group(2)) + 1) if match.group(2) else size
                    status = 206
                if action == "short":
                    end = start + (end - start) // 2
                with open(file, "rb") as stream:
                    stream.seek(start)
                    part = stream.read(end - start) if body else b""
                if action == "chunked":
                    return self._chunked(status)
                self.send_response(status)
                length = action.partition(":")[2] if action.startswith("length:") else str(end - start)
                self.send_header("Content-Length", length)
                if server.ranges:
                    self.send_header("Accept-Ranges", "bytes")
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
                self.end_headers()
                if not body:
                    return
                if action.startswith("trickle:"):
                    for byte in part:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        if server._stopped.wait(float(action.split(":", 1)[1])):
                            return
                    return
                if action.startswith("rate:"):
                    step = max(1, int(float(action.split(":", 1)[1]) / 20))  # 20 pieces a second
                    for at in range(0, len(part), step):
                        self.wfile.write(part[at : at + step])
                        self.wfile.flush()
                        if server._stopped.wait(0.05):
                            return
                    return
                if action.startswith("length:"):
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.wfile.write(part)
                        self.wfile.flush()
                        self.connection.shutdown(2)
                    return
                if action == "truncate":
                    self.wfile.write(part[: len(part) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(part)

            def _hostile(self, action: str, file: Path) -> None:
                """Answers no honest server gives (see the class docstring)."""
                self.close_connection = True
                with contextlib.suppress(OSError):
                    if action.startswith("trickle-headers:"):
                        size = file.stat().st_size
                        head = f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n".encode()
                        for byte in head:
                            self.wfile.write(bytes([byte]))
                            self.wfile.flush()
                            if server._stopped.wait(float(action.split(":", 1)[1])):
                                return
                        if self.command == "GET":
                            self.wfile.write(file.read_bytes())
                        return
                    if action == "huge":
                        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000000\r\n\r\n")
                    else:
                        self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Filler: ")
                    while not server._stopped.is_set():
                        self.wfile.write(b"0" * 65536 if action == "huge" else b"a" * 65536)

            def _chunked(self, status: int) -> None:
                """An endless chunked body, until the client leaves or the server stops."""
                self.send_response(status)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.close_connection = True
                with contextlib.suppress(OSError):
                    while not server._stopped.is_set():
                        self.wfile.write(b"10000\r\n" + b"a" * 65536 + b"\r\n")

            def _status(self, code: int) -> None:
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

        return Handler


def serve_forever(root: str, latency: float, port_queue) -> None:
    """Run a server in this process (a benchmark's child) and report its port."""
    with ShardServer(root, latency) as server:
        port_queue.put(server._server.server_address[1])
        threading.Event().wait()
