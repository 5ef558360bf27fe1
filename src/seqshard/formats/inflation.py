"""How far compressed data may inflate: one rule for gzip'd shard members, member tables
(``.npz``) and compressed line files (Lhotse Shar's ``cuts.*.jsonl.gz``); and how long a line
of any line file may be (those too, Kaldi tables, WeNet lists, NeMo manifests).

Compressed data of ``n`` bytes may inflate to :data:`MAX_INFLATION` times ``n`` (text and JSON
inflate 3-20x, arrays less), always to :data:`MIN_INFLATION_LIMIT`, never beyond
:data:`MAX_INFLATED_BYTES`; a line of a compressed line file is at most :data:`MAX_LINE_BYTES`
long, as is a line of a plain one. What would go beyond is refused before it is held, so a
small hostile file cannot fill memory: a size declared by a header is checked before anything
is allocated for it, and inflating stops at the limit.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from .files import open_input

MAX_INFLATION = 200  # a compressed item may inflate to this many times its size
MAX_INFLATED_BYTES = 1 << 30  # and never beyond this (an hour of 80-dim float32 features is 115 MB)
MIN_INFLATION_LIMIT = 1 << 20  # small items may always inflate this far (short repetitive text or JSON)
MAX_LINE_BYTES = 64 << 20  # a line of a line file (a Shar cut, a manifest entry: a few kB)
_PASS = 1 << 20  # a line beyond MAX_LINE_BYTES is passed over this many bytes at a time


class InflationError(ValueError):
    """Compressed data that would inflate beyond the limits."""


class LineTooLong(InflationError):
    """A line beyond :data:`MAX_LINE_BYTES`, passed over without being held: the next line
    can still be read (a caller may count this one as a bad line and go on)."""


def inflation_limit(compressed: int, capped: bool = True) -> int:
    """How many bytes ``compressed`` bytes may inflate to (see the module docstring);
    ``capped=False`` for a whole file read item by item (each item is capped on its own)."""
    limit = max(MIN_INFLATION_LIMIT, MAX_INFLATION * compressed)
    return min(MAX_INFLATED_BYTES, limit) if capped else limit


def limits_text() -> str:
    """The limits, as messages name them."""
    return (
        f"{MAX_INFLATION}x the compressed size, always {MIN_INFLATION_LIMIT} bytes, at most {MAX_INFLATED_BYTES} bytes"
    )


class BoundedLines:
    """The lines of a file, gzip'd or not (``compressed``; by default: named ``.gz``), from
    decompressed byte ``start``: each at most :data:`MAX_LINE_BYTES`, and a gzip'd file's
    together at most :data:`MAX_INFLATION` times its size (at least
    :data:`MIN_INFLATION_LIMIT`). :meth:`readline` raises InflationError before it holds more."""

    def __init__(self, path: str | Path, start: int = 0, compressed: bool | None = None):
        self.path = str(path)
        compressed = self.path.endswith(".gz") if compressed is None else compressed
        file = os.fdopen(open_input(path), "rb")  # a regular file: a FIFO or a device is refused
        self._stream: BinaryIO = gzip.GzipFile(fileobj=file, mode="rb") if compressed else file  # type: ignore[assignment]
        self._file = file
        self._allowed: int | None = None
        self.position = start  # decompressed bytes before the next line
        try:
            if compressed:
                self._allowed = inflation_limit(os.fstat(file.fileno()).st_size, capped=False)
            self._stream.seek(start)
        except BaseException:
            self.close()
            raise

    def readline(self) -> bytes:
        """The next line with its newline (the last may have none); ``b""`` at the end.
        LineTooLong for a line beyond :data:`MAX_LINE_BYTES`, once it is passed over."""
        room = MAX_LINE_BYTES if self._allowed is None else min(MAX_LINE_BYTES, self._allowed - self.position)
        line = self._stream.readline(max(room, 0) + 1)
        if len(line) > room:
            if room < MAX_LINE_BYTES:
                self._inflated_too_far()
            self.position += len(line)
            while not line.endswith(b"\n") and (line := self._stream.readline(_PASS)):
                self.position += len(line)
                if self._allowed is not None and self.position > self._allowed:
                    self._inflated_too_far()
            raise LineTooLong(f"a line is longer than {MAX_LINE_BYTES} bytes: a damaged or hostile file")
        self.position += len(line)
        return line

    def _inflated_too_far(self) -> None:
        raise InflationError(
            f"it inflates beyond {self._allowed} bytes ({MAX_INFLATION}x its size, at least "
            f"{MIN_INFLATION_LIMIT} bytes): a damaged or hostile file"
        )

    def close(self) -> None:
        self._stream.close()
        self._file.close()  # a GzipFile leaves the file it was given open


def numbered_lines(
    path: str | Path, start: int = 0, end: int | None = None, first_line: int = 1
) -> Iterator[tuple[int, int, bytes | LineTooLong]]:
    """``(line number, byte offset, line)`` for each line of a plain file (or of its lines
    starting in bytes ``[start, end)``, the first numbered ``first_line``), read by
    :class:`BoundedLines`: a line beyond :data:`MAX_LINE_BYTES` comes as its LineTooLong
    (passed over, never held), so that the caller can name or count it and go on."""
    lines = BoundedLines(path, start, compressed=False)
    try:
        number = first_line - 1
        while end is None or lines.position < end:
            number, offset = number + 1, lines.position
            try:
                line = lines.readline()
            except LineTooLong as error:
                yield number, offset, error
                continue
            if not line:
                return
            yield number, offset, line
    finally:
        lines.close()
