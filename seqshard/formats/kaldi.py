"""Kaldi inputs: table files (``feats.scp``, ``text``, ``utt2num_frames``) and ark matrices.

Decoding of matrices (FM/DM and the compressed CM/CM2/CM3 kinds) is kaldiio's; this module
adds what a packer of untrusted, hand-edited data dirs needs around it: line numbers in every
error, Kaldi's inclusive ``[r1:r2,c1:c2]`` ranges checked against the matrix (Kaldi fails on an
out-of-range column where kaldiio clips), a check that an scp offset really points at a value
in the ark (a shifted offset otherwise decodes garbage), header-only shape reads, and refusal
of entries that would run code (kaldiio unpickles ``PKL`` entries; pipes run shell commands).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ..errors import InputError, Where

_MATRIX_TOKENS = {b"FM": 4, b"DM": 8, b"CM": 1, b"CM2": 2, b"CM3": 1}
_VECTOR_TOKENS = {b"FV", b"DV"}


# ---------------------------------------------------------------------------------------
# table files


def iter_lines(path: Path) -> Iterator[tuple[int, int, bytes]]:
    """``(line_number, byte_offset, raw_line)`` for each line of a file (1-based lines)."""
    offset = 0
    with open(path, "rb") as stream:
        for number, raw in enumerate(stream, start=1):
            yield number, offset, raw
            offset += len(raw)


def parse_line(raw: bytes, where: Where, needs_value: bool) -> tuple[str, str]:
    """Split a Kaldi table line into ``(key, value)`` as Kaldi does (first whitespace run).

    Raises InputError (reason ``non_utf8`` or ``malformed_line``) naming the line.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputError(
            where,
            "non_utf8",
            f"the line is not valid UTF-8 (byte {error.start} of the line).",
            "convert the file to UTF-8 (e.g. `iconv -f GBK -t UTF-8`).",
        ) from None
    parts = text.strip().split(maxsplit=1)
    if not parts:
        raise InputError(where, "malformed_line", "the line is empty.", "remove blank lines.")
    key = parts[0]
    value = parts[1] if len(parts) > 1 else ""
    if needs_value and not value:
        raise InputError(
            Where(where.path, where.line, key),
            "malformed_line",
            "the line has a key but nothing after it.",
            "each line must be `KEY VALUE`.",
        )
    return key, value


# ---------------------------------------------------------------------------------------
# locations of matrices


@dataclass(frozen=True)
class ArkLocation:
    """Where an scp entry's matrix is: a file and byte offset, Kaldi ranges, or a pipe."""

    path: str
    offset: int | None = None
    rows: tuple[int, int] | None = None  # inclusive, as Kaldi writes them; None = all
    cols: tuple[int, int] | None = None
    is_pipe: bool = False


def _parse_range(text: str, where: Where) -> tuple[int, int] | None:
    text = text.strip()
    if text in ("", ":"):
        return None
    first, sep, last = text.partition(":")
    try:
        bounds = (int(first), int(last)) if sep else (int(first), int(first))
    except ValueError:
        raise InputError(where, "malformed_line", f"bad range {text!r} in the scp entry.") from None
    if bounds[0] < 0 or bounds[1] < bounds[0]:
        raise InputError(where, "malformed_line", f"empty or negative range {text!r} in the scp entry.")
    return bounds


def parse_location(
    value: str, where: Where, path_map: tuple[tuple[str, str], ...] = (), root: Path | None = None
) -> ArkLocation:
    """Parse an scp value such as ``feats/raw.1.ark:1234[0:99,0:39]``.

    ``path_map`` rewrites path prefixes (``/old/mfcc`` -> ``/new/mfcc``) for data dirs moved
    from another machine; relative paths are taken against ``root`` (default: the cwd, as
    Kaldi does).
    """
    value = value.strip()
    if value.endswith("|") or value.startswith("|"):
        return ArkLocation(value, is_pipe=True)
    rows = cols = None
    if value.endswith("]") and "[" in value:
        value, _, spec = value[:-1].rpartition("[")
        row_text, _, col_text = spec.partition(",")
        rows = _parse_range(row_text, where)
        cols = _parse_range(col_text, where)
    path, offset = value, None
    head, sep, tail = value.rpartition(":")
    if sep and tail.isdigit():
        path, offset = head, int(tail)
    for old, new in path_map:
        if path.startswith(old):
            path = new + path[len(old) :]
            break
    if root is not None and not Path(path).is_absolute():
        path = str(root / path)
    return ArkLocation(path, offset, rows, cols)


# ---------------------------------------------------------------------------------------
# reading matrices


class MatrixReader:
    """Reads feature matrices from arks, keeping recently used ark files open.

    Every problem becomes an InputError naming ``where`` (the scp file, line and key):
    reason ``missing_ark``, ``bad_offset`` (the offset does not point at a value),
    ``unreadable`` (a damaged value), ``not_a_matrix`` or ``bad_range``.
    """

    def __init__(self, max_open: int = 16, allow_pipes: bool = False):
        self._files: dict[str, BinaryIO] = {}
        self._max_open = max_open
        self._allow_pipes = allow_pipes

    def close(self) -> None:
        for stream in self._files.values():
            stream.close()
        self._files.clear()

    def __enter__(self) -> MatrixReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self, path: str, where: Where) -> BinaryIO:
        stream = self._files.pop(path, None)
        if stream is None:
            try:
                stream = open(path, "rb", buffering=1 << 20)  # noqa: SIM115 (kept open in the cache)
            except OSError as error:
                raise InputError(
                    where,
                    "missing_ark",
                    f"cannot open ark {path!r}: {error.strerror}.",
                    "check the path (relative paths are taken from the current directory; "
                    "use --path-root or --path-map for data dirs made elsewhere).",
                ) from None
            if len(self._files) >= self._max_open:
                oldest = next(iter(self._files))
                self._files.pop(oldest).close()
        self._files[path] = stream  # most recently used last
        return stream

    def _seek_value(self, location: ArkLocation, where: Where) -> tuple[BinaryIO, bytes]:
        """Position at the value and return its first bytes after checking what they are."""
        stream = self._open(location.path, where)
        offset = location.offset or 0
        if offset:
            stream.seek(offset - 1)
            before = stream.read(1)
            if before != b" ":
                raise self._bad_offset(
                    location, where, "it does not follow a key (`KEY ` precedes every value in an ark)"
                )
        else:
            stream.seek(0)
        head = stream.read(8)
        if not head:
            raise self._bad_offset(location, where, "it is at or past the end of the ark")
        stream.seek(offset)
        if head.startswith(b"\0B"):
            token = head[2:].split(b" ", 1)[0]
            if token in _MATRIX_TOKENS:
                return stream, head
            if token in _VECTOR_TOKENS or head[2:3] == b"\4":
                raise InputError(
                    where,
                    "not_a_matrix",
                    "the entry is a vector, not a feature matrix.",
                    "give the feats.scp of a feature matrix ark.",
                )
            raise self._bad_offset(location, where, f"unknown binary type {token!r}")
        for marker, what in (
            (b"PKL", "a pickled Python object (kaldiio extension); seqshard never unpickles data"),
            (b"NPY", "a kaldiio NPY entry"),
            (b"AUDIO", "audio"),
            (b"RIFF", "a wav file"),
            (b"fLaC", "a flac file"),
        ):
            if head.startswith(marker):
                raise InputError(
                    where,
                    "not_a_matrix",
                    f"the entry is {what}, not a Kaldi feature matrix.",
                    "give the feats.scp of a Kaldi matrix ark.",
                )
        if head.lstrip(b" ").startswith(b"["):
            return stream, head
        raise self._bad_offset(location, where, "it points at neither a binary nor a text matrix")

    @staticmethod
    def _bad_offset(location: ArkLocation, where: Where, why: str) -> InputError:
        return InputError(
            where,
            "bad_offset",
            f"byte offset {location.offset} in {location.path!r} is not the start of a value: {why}.",
            "the scp does not match the ark (damaged or re-written ark, or an offset off by a few bytes); regenerate the scp with the ark.",
        )

    def read(self, location: ArkLocation, where: Where) -> np.ndarray:
        """The matrix at ``location`` (ranges applied) as a 2-D array."""
        if location.is_pipe:
            return self._read_pipe(location, where)
        stream, _ = self._seek_value(location, where)
        from kaldiio.matio import read_kaldi

        try:
            array = read_kaldi(stream)
        except Exception as error:  # kaldiio raises assorted types on damaged values
            raise InputError(
                where,
                "unreadable",
                f"the matrix at {location.path}:{location.offset} cannot be decoded ({type(error).__name__}: {error}).",
                "the ark is damaged; regenerate it.",
            ) from None
        if not isinstance(array, np.ndarray) or array.ndim != 2:
            raise InputError(where, "not_a_matrix", "the entry is not a 2-D matrix.")
        return _apply_ranges(array, location, where)

    def shape(self, location: ArkLocation, where: Where) -> tuple[int, int]:
        """Rows and columns of the matrix at ``location``, from its header when binary."""
        if location.is_pipe:
            return self._read_pipe(location, where).shape  # type: ignore[return-value]
        stream, head = self._seek_value(location, where)
        if not head.startswith(b"\0B"):
            return self.read(location, where).shape  # type: ignore[return-value]
        token = head[2:].split(b" ", 1)[0]
        stream.seek((location.offset or 0) + 3 + len(token))
        if token in (b"FM", b"DM"):
            raw = stream.read(10)
            if len(raw) < 10 or raw[0] != 4 or raw[5] != 4:
                raise self._bad_offset(location, where, "the matrix header is damaged")
            rows, cols = struct.unpack("<i", raw[1:5])[0], struct.unpack("<i", raw[6:10])[0]
        else:
            raw = stream.read(16)
            if len(raw) < 16:
                raise self._bad_offset(location, where, "the matrix header is truncated")
            rows, cols = struct.unpack("<ii", raw[8:16])
        if rows < 0 or cols < 0:
            raise self._bad_offset(location, where, "the matrix header is damaged")
        return _ranged_shape(rows, cols, location, where)

    def _read_pipe(self, location: ArkLocation, where: Where) -> np.ndarray:
        if not self._allow_pipes:
            raise InputError(
                where,
                "pipe_refused",
                f"the entry is a shell command ({location.path!r}); seqshard does not run commands found in data.",
                "run the command yourself (e.g. copy-feats) or pass --allow-pipes / allow_pipes=True.",
            )
        import kaldiio

        try:
            array = kaldiio.load_mat(location.path)
        except Exception as error:
            raise InputError(where, "unreadable", f"the command {location.path!r} failed ({error}).") from None
        return np.asarray(array)


def _ranged_shape(rows: int, cols: int, location: ArkLocation, where: Where) -> tuple[int, int]:
    for name, bounds, size in (("row", location.rows, rows), ("column", location.cols, cols)):
        if bounds is not None and bounds[1] >= size:
            raise InputError(
                where,
                "bad_range",
                f"{name} range {bounds[0]}:{bounds[1]} (inclusive, as in Kaldi) is outside the {rows}x{cols} matrix.",
                "fix the range in the scp.",
            )
    if location.rows is not None:
        rows = location.rows[1] - location.rows[0] + 1
    if location.cols is not None:
        cols = location.cols[1] - location.cols[0] + 1
    return rows, cols


def _apply_ranges(array: np.ndarray, location: ArkLocation, where: Where) -> np.ndarray:
    _ranged_shape(array.shape[0], array.shape[1], location, where)
    if location.rows is not None:
        array = array[location.rows[0] : location.rows[1] + 1]
    if location.cols is not None:
        array = array[:, location.cols[0] : location.cols[1] + 1]
    return array
