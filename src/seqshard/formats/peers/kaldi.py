"""Kaldi inputs: table files (``feats.scp``, ``text``, ``utt2num_frames``) and ark matrices.

Decoding of matrices (FM/DM and the compressed CM/CM2/CM3 kinds) is kaldiio's; this module
adds what a packer of untrusted, hand-edited data dirs needs around it: line numbers in every
error, Kaldi's inclusive ``[r1:r2,c1:c2]`` ranges checked against the matrix (Kaldi fails on an
out-of-range column where kaldiio clips), a check that an scp offset really points at a value
in the ark (a shifted offset otherwise decodes garbage) and that the value ends where the ark's
next entry begins (a value whose bytes changed, e.g. by git's CR LF conversion, otherwise decodes
to finite garbage), header-only shape reads, and refusal of entries that would run code (kaldiio
unpickles ``PKL`` entries; pipes run shell commands).
"""

from __future__ import annotations

import logging
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ...checks import NumberError, read_digits
from ...errors import InputError, Where, option
from ..files import NotAFileError, open_input
from ..index_entries import MAX_BYTES, MAX_LENGTH
from ..inflation import LineTooLong, numbered_lines

_LOG = logging.getLogger("seqshard")
_MATRIX_TOKENS = {b"FM": 4, b"DM": 8, b"CM": 1, b"CM2": 2, b"CM3": 1}
_VECTOR_TOKENS = {b"FV", b"DV"}

# Kaldi splits table lines on ASCII whitespace only (a no-break space belongs to its token).
ASCII_WHITESPACE = " \t\n\r\v\f"
_ASCII_SPACE_RUN = re.compile(r"[ \t\n\r\v\f]+")
_ASCII_DIGITS = re.compile(r"[0-9]+")
# An ark entry: a key (no ASCII whitespace, no 0xFF; kaldiio also writes the control bytes Kaldi
# refuses, NUL included, and the scp line of such a key, dropped as a bad key, must not cost its
# neighbour in the ark), one space, then a binary value (``\0B``) or a text one (``[`` after
# optional spaces).
_ENTRY = re.compile(rb"([^\x09-\x0d\x20\xff]+) (?:\0B| *\[)")
_ENTRY_OR_TEXT_VECTOR = re.compile(rb"([^\x09-\x0d\x20\xff]+) (?:\0B| *\[| *-?[0-9])")
_MAX_KEY_BYTES = 4096
_GIT_HINT = (
    "a common cause is git's CR LF conversion (core.autocrlf, or `text=auto` in .gitattributes): "
    "mark arks binary in .gitattributes (`*.ark binary`, or `* binary`) and check them out again"
)


# ---------------------------------------------------------------------------------------
# table files


BOM = b"\xef\xbb\xbf"


def iter_lines(
    path: Path, start: int = 0, end: int | None = None, first_line: int = 1
) -> Iterator[tuple[int, int, bytes | LineTooLong]]:
    """``(line_number, byte_offset, raw_line)`` for each line of a file (1-based lines), or of
    the lines starting in bytes ``[start, end)`` (``first_line``: the number of the line at
    ``start``); a line beyond the line bound comes as its LineTooLong (``inflation.numbered_lines``)."""
    for number, offset, raw in numbered_lines(path, start, end, first_line):
        if number == 1 and isinstance(raw, bytes) and raw.startswith(BOM):
            _LOG.warning("%s starts with a UTF-8 byte order mark (an editor's); it is not part of the first key", path)
        yield number, offset, raw


def long_line(where: Where, error: LineTooLong) -> InputError:
    """The InputError (``malformed_line``) of a line beyond the line bound."""
    return InputError(where, "malformed_line", f"{error}.", "remove the line, or split it (one entry a line).")


def parse_line(raw: bytes, where: Where, needs_value: bool) -> tuple[str, str]:
    """Split a Kaldi table line into ``(key, value)`` as Kaldi does: at the first run of ASCII
    whitespace (space, tab, CR, LF, VT, FF; not a no-break space or other Unicode spaces). The
    value keeps its inner whitespace and loses only leading and trailing ASCII whitespace.

    Raises InputError (reason ``non_utf8`` or ``malformed_line``) naming the line.
    """
    if where.line == 1:
        raw = raw.removeprefix(BOM)
        _refuse_archive(raw, where)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputError(
            where,
            "non_utf8",
            f"the line is not valid UTF-8 (byte {error.start} of the line).",
            "convert the file to UTF-8 (e.g. `iconv -f GBK -t UTF-8`).",
        ) from None
    parts = _ASCII_SPACE_RUN.split(text.strip(ASCII_WHITESPACE), maxsplit=1)
    if not parts[0]:
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


# The first line of an ark read as a table file: a key, then a binary value (its type), a wav
# file or a text matrix.
_ARCHIVE_START = re.compile(rb"([^\x00-\x20\x7f\xff]+) (?:\0B(\x04|[A-Z0-9]*)|(RIFF)[\s\S]{4}WAVE| *(\[)[ \t\r\n]*$)")
_ARCHIVE_KINDS = {  # what the values are, and the Kaldi tool that copies them, writing an scp
    b"FV": ("vectors", "copy-vector"),
    b"DV": ("vectors", "copy-vector"),
    b"\x04": ("integer vectors", "copy-int-vector"),
    b"RIFF": ("WAV files (wav-in-ark)", "wav-copy"),
    b"[": ("text matrices", "copy-feats"),
}


# A Kaldi object written without a key (compute-cmvn-stats' global statistics, copy-matrix's
# output): a binary value, or a text matrix (`[` alone on its first line) or vector.
_KEYLESS_START = re.compile(rb"(?:\0B(\x04|[A-Z0-9]+)| *(\[)[ \t\r\n]*$| *(\[)( +-?[0-9][0-9.eE+-]*)+ +\][ \t\r\n]*$)")


def _refuse_archive(raw: bytes, where: Where) -> None:
    """Refuse an ark, or a Kaldi object written without a key, given where a table file (scp,
    text) is expected, saying what it holds and what to give instead (else its binary values
    read as non-UTF-8 text)."""
    keyless = _KEYLESS_START.match(raw)
    if keyless is not None:
        token, text_matrix, _, _ = keyless.groups()
        if token is not None:
            what = {b"FV": "vector", b"DV": "vector", b"\x04": "integer vector"}.get(token, "matrix")
        else:
            what = "text matrix" if text_matrix else "text vector"
        raise InputError(
            where,
            "not_a_table",
            f"the file is one Kaldi {what} written without a key (as compute-cmvn-stats writes global "
            "statistics, e.g. global_cmvn.ark), not a table file of `KEY VALUE` lines.",
            "give the table file itself (a feats.scp: `KEY ark:OFFSET` lines; a text: `KEY words` lines); for "
            "global CMVN statistics of the packed features, run `seqshard cmvn` on the shards.",
            skippable=False,  # the whole file is of the wrong kind, not one bad line
        )
    match = _ARCHIVE_START.match(raw)
    if match is None:
        return
    kind = next(group for group in match.groups()[1:] if group is not None)
    what, tool = _ARCHIVE_KINDS.get(kind, ("matrices", "copy-feats"))
    path = Path(where.path)
    scp = path.with_suffix(".scp")
    write_one = f"`{tool} ark:{path} ark,scp:{path.with_name(path.stem + '_copy.ark')},{scp}` (Kaldi) writes one"
    raise InputError(
        where,
        "not_a_table",
        f"the file is a Kaldi archive (ark) of {what}, not a table file of `KEY VALUE` lines (it starts with the "
        f"key {match.group(1)[:80].decode('utf-8', 'replace')!r} and its value).",
        f"pack reads an ark through the scp written with it (`KEY {path}:OFFSET` lines): give "
        + (f"{scp} (beside it) if it is that one." if scp.is_file() else f"that scp; {write_one}."),
        skippable=False,  # the whole file is of the wrong kind, not one bad line
    )


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
    text = text.strip(ASCII_WHITESPACE)
    if text in ("", ":"):
        return None
    first, sep, last = (part.strip(ASCII_WHITESPACE) for part in text.partition(":"))
    if not _ASCII_DIGITS.fullmatch(first) or (sep and not _ASCII_DIGITS.fullmatch(last)):
        raise InputError(where, "malformed_line", f"bad range {text!r} in the scp entry.")
    try:
        low, high = (read_digits("a row or column of the range", n, MAX_LENGTH) for n in (first, last or first))
    except NumberError as error:
        raise InputError(
            where, "bad_range", f"{error}: no matrix is that large.", "fix the range in the scp."
        ) from None
    if high < low:
        raise InputError(where, "malformed_line", f"empty or negative range {text!r} in the scp entry.")
    return low, high


def parse_location(
    value: str, where: Where, path_map: tuple[tuple[str, str], ...] = (), root: Path | None = None
) -> ArkLocation:
    """Parse an scp value such as ``feats/raw.1.ark:1234[0:99,0:39]``.

    ``path_map`` rewrites path prefixes (``/old/mfcc`` -> ``/new/mfcc``) for data dirs moved
    from another machine; relative paths are taken against ``root`` (default: the cwd, as
    Kaldi does).
    """
    value = value.strip(ASCII_WHITESPACE)
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
    if sep and _ASCII_DIGITS.fullmatch(tail):
        try:
            path, offset = head, read_digits("its byte offset", tail, MAX_BYTES)
        except NumberError as error:
            raise InputError(where, "bad_offset", f"{error}: no ark is that large.", _OFFSET_FIX) from None
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
    ``damaged_value`` (the value does not end where the ark's next entry begins),
    ``unreadable`` (a value that cannot be decoded), ``not_a_matrix`` or ``bad_range``.
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
                stream = os.fdopen(open_input(path), "rb", buffering=1 << 20)  # kept open in the cache
            except NotAFileError as error:
                raise InputError(
                    where,
                    "not_a_file",
                    f"cannot read ark {path!r}: {error.strerror}.",
                    "name the ark file itself (an ark is read at offsets: write a pipe's output to a file first).",
                ) from None
            except OSError as error:
                raise InputError(
                    where,
                    "missing_ark",
                    f"cannot open ark {path!r}: {error.strerror}.",
                    "check the path (relative paths are taken from the current directory; use "
                    f"{option('path_root', 'DIR')} or {option('path_map', _PATH_MAP_EXAMPLE)} for data dirs made elsewhere).",
                ) from None
            if len(self._files) >= self._max_open:
                oldest = next(iter(self._files))
                self._files.pop(oldest).close()
        self._files[path] = stream  # most recently used last
        return stream

    def _seek_value(self, location: ArkLocation, where: Where, vectors: bool = False) -> tuple[BinaryIO, bytes]:
        """Position at the value and return its first bytes after checking what they are
        (a matrix, or with ``vectors`` also a vector)."""
        stream = self._open(location.path, where)
        offset = location.offset or 0
        if offset:
            stream.seek(offset - 1)
            before = stream.read(1)
            if before != b" ":
                raise _bad_offset(location, where, "it does not follow a key (`KEY ` precedes every value in an ark)")
        else:
            stream.seek(0)
        head = stream.read(8)
        if not head:
            raise _bad_offset(location, where, "it is at or past the end of the ark")
        stream.seek(offset)
        if head.startswith(b"\0B"):
            token = head[2:].split(b" ", 1)[0]
            if token in _MATRIX_TOKENS or (vectors and (token in _VECTOR_TOKENS or head[2:3] == b"\4")):
                return stream, head
            if token in _VECTOR_TOKENS or head[2:3] == b"\4":
                raise InputError(
                    where,
                    "not_a_matrix",
                    "the entry is a vector, not a feature matrix.",
                    "give the feats.scp of a feature matrix ark.",
                )
            raise _bad_offset(location, where, f"unknown binary type {token!r}")
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
        text = head.lstrip(b" ")
        if text.startswith(b"[") or (vectors and text[:1] in b"-0123456789" and text[:1]):
            return stream, head  # a text matrix, or a text vector (`copy-int-vector ark,t`)
        raise _bad_offset(
            location, where, f"it points at neither a binary nor a text {'value' if vectors else 'matrix'}"
        )

    def read(
        self, location: ArkLocation, where: Where, successor: tuple[int, str] | None = None, vectors: bool = False
    ) -> np.ndarray:
        """The matrix at ``location`` (ranges applied) as a 2-D array; with ``vectors`` a
        vector (alignments, i-vectors) is read too, as a 1-D array.

        ``successor`` is ``(value offset, key)`` of the next value that the scp lists in the
        same ark, when known. The value must end where the ark's next entry begins: exactly at
        that successor's key, or at entries the scp does not list that lead exactly to it; with
        no successor, at the end of the ark or at a plausible next entry (``KEY `` + a value).
        """
        if location.is_pipe:
            return self._read_pipe(location, where)
        stream, head = self._seek_value(location, where, vectors)
        start = location.offset or 0
        if head.startswith(b"\0B"):
            _check_declared_size(stream, start, location, where)
        from kaldiio.matio import read_kaldi

        try:
            array = read_kaldi(stream)
        except Exception as error:  # kaldiio raises assorted types on damaged values
            raise _undecodable(stream, start, head, location, where, error) from None
        _check_end(stream, stream.tell(), location, where, successor, vectors)
        if vectors and isinstance(array, np.ndarray) and array.ndim == 1 and location.rows is None:
            return array
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
        _check_declared_size(stream, location.offset or 0, location, where)
        token = head[2:].split(b" ", 1)[0]
        stream.seek((location.offset or 0) + 3 + len(token))
        if token in (b"FM", b"DM"):
            raw = stream.read(10)
            if len(raw) < 10 or raw[0] != 4 or raw[5] != 4:
                raise _bad_offset(location, where, "the matrix header is damaged")
            rows, cols = struct.unpack("<i", raw[1:5])[0], struct.unpack("<i", raw[6:10])[0]
        else:
            raw = stream.read(16)
            if len(raw) < 16:
                raise _bad_offset(location, where, "the matrix header is truncated")
            rows, cols = struct.unpack("<ii", raw[8:16])
        if rows < 0 or cols < 0:
            raise _bad_offset(location, where, "the matrix header is damaged")
        return _ranged_shape(rows, cols, location, where)

    def _read_pipe(self, location: ArkLocation, where: Where) -> np.ndarray:
        if not self._allow_pipes:
            raise InputError(
                where,
                "pipe_refused",
                f"the entry is a shell command ({location.path!r}); seqshard does not run commands found in data.",
                f"run the command yourself (e.g. copy-feats) or pass {option('allow_pipes')}.",
            )
        import kaldiio

        try:
            array = kaldiio.load_mat(location.path)
        except Exception as error:
            raise InputError(where, "unreadable", f"the command {location.path!r} failed ({error}).") from None
        return np.asarray(array)


# -- a value against its ark: where it may start and end, and the errors saying it does not --------------


def _bad_offset(location: ArkLocation, where: Where, why: str) -> InputError:
    return InputError(
        where,
        "bad_offset",
        f"byte offset {location.offset} in {location.path!r} is not the start of a value: {why}.",
        _OFFSET_FIX,
    )


_OFFSET_FIX = (
    "the scp does not match the ark (damaged or re-written ark, or an offset off by a few bytes); "
    f"regenerate the scp with the ark. If the ark went through git, {_GIT_HINT}."
)


def _damaged(location: ArkLocation, where: Where, why: str) -> InputError:
    return InputError(
        where,
        "damaged_value",
        f"the value at byte {location.offset or 0} of ark {location.path!r} was changed after it was written: {why}.",
        f"regenerate the ark and its scp; {_GIT_HINT}.",
    )


def _check_declared_size(stream: BinaryIO, start: int, location: ArkLocation, where: Where) -> None:
    """Refuse a binary value whose header declares more bytes than the ark holds after its
    start, before anything is allocated for it (kaldiio reads the declared size at once)."""
    declared = _value_size(stream, start)
    size = os.fstat(stream.fileno()).st_size
    stream.seek(start)
    if declared is not None and start + declared > size:
        raise _damaged(
            location,
            where,
            f"its header declares {declared} bytes, so it would end at byte {start + declared}, past the "
            f"end of the ark (byte {size}): bytes were removed from it, the ark is truncated, or the header "
            "is damaged",
        )


def _undecodable(
    stream: BinaryIO, start: int, head: bytes, location: ArkLocation, where: Where, error: Exception
) -> InputError:
    """The error for a value kaldiio cannot decode: ``damaged_value`` when it shows how a
    text value was changed (CR bytes in it), else ``unreadable``."""
    if not head.startswith(b"\0B"):
        stopped = stream.tell()
        stream.seek(start)
        if b"\r" in stream.read(max(stopped - start, 0)):
            return _damaged(location, where, "the text matrix holds CR bytes (its line ends were converted to CR LF)")
    return InputError(
        where,
        "unreadable",
        f"the matrix at {location.path}:{location.offset} cannot be decoded ({type(error).__name__}: {error}).",
        f"the ark is damaged; regenerate it. If it went through git, {_GIT_HINT}.",
    )


def _check_end(
    stream: BinaryIO,
    end: int,
    location: ArkLocation,
    where: Where,
    successor: tuple[int, str] | None,
    vectors: bool = False,
) -> None:
    """Refuse a value that does not end where the ark's next entry begins (see ``read``)."""
    if successor is None:
        size = os.fstat(stream.fileno()).st_size
        if end == size or _entry_at(stream, end, vectors) is not None:
            return
        stream.seek(end)
        raise _damaged(
            location,
            where,
            f"it ends at byte {end}, followed by {size - end} bytes that are neither the end of the ark nor "
            f"a next entry (`KEY ` and a value), starting {stream.read(16)!r}",
        )
    next_offset, next_key = successor
    key = next_key.encode("utf-8")
    stream.seek(end)
    if stream.read(len(key) + 1) == key + b" ":
        return  # the next listed entry's key starts where this value ends (the common case)
    position = end
    while True:
        value_start = _entry_at(stream, position, vectors)
        if value_start == next_offset:
            return  # the ark's key of the next listed entry differs from the scp's (renamed keys)
        if value_start is None or value_start > next_offset:
            break
        # an entry in the ark that the scp does not list (a subset of the ark): step over it
        skipped = _value_size(stream, value_start)
        if skipped is None:
            break
        position = value_start + skipped
    stream.seek(end)
    found = stream.read(min(len(key) + 8, 40))
    raise _damaged(
        location,
        where,
        f"it ends at byte {end}, where the ark should hold the key of the next entry that the scp lists "
        f"({next_key!r}, expected at byte {next_offset - len(key) - 1} before its value at byte {next_offset}); "
        f"the ark holds {found!r} there",
    )


class _Spelled(str):
    """An example option value: the command line shows ``str``, Python messages ``repr``."""

    def __new__(cls, text: str, python: str) -> _Spelled:
        spelled = super().__new__(cls, text)
        spelled.python = python
        return spelled

    def __repr__(self) -> str:
        return self.python


_PATH_MAP_EXAMPLE = _Spelled("OLD=NEW", "{'OLD': 'NEW'}")


def _value_size(stream: BinaryIO, start: int) -> int | None:
    """Bytes of the value at ``start`` as its header declares them (binary), or up to its
    closing ``]`` and line end (text); None when no well-formed value starts there."""
    stream.seek(start)
    head = stream.read(32)
    if head.startswith(b"\0B"):
        if head[2:3] == b"\4":  # int32 vector: each element is "\4" + 4 bytes
            count = struct.unpack("<i", head[3:7])[0] if len(head) >= 7 else -1
            return 7 + 5 * count if count >= 0 else None
        token = head[2:].partition(b" ")[0]
        body = 3 + len(token)
        try:
            if token in (b"FM", b"DM", b"FV", b"DV"):
                item = 4 if token[0:1] == b"F" else 8
                if token.endswith(b"M"):
                    marker1, rows, marker2, cols = struct.unpack("<cici", head[body : body + 10])
                    if marker1 != b"\4" or marker2 != b"\4" or rows < 0 or cols < 0:
                        return None
                    return body + 10 + rows * cols * item
                marker1, count = struct.unpack("<ci", head[body : body + 5])
                return body + 5 + count * item if marker1 == b"\4" and count >= 0 else None
            if token in (b"CM", b"CM2", b"CM3"):
                _, _, rows, cols = struct.unpack("<ffii", head[body : body + 16])
                if rows < 0 or cols < 0:
                    return None
                data = {b"CM": 8 * cols + rows * cols, b"CM2": 2 * rows * cols, b"CM3": rows * cols}[token]
                return body + 16 + data
        except struct.error:  # the header is cut short by the end of the ark
            return None
        return None
    stripped = head.lstrip(b" ")
    if not stripped.startswith(b"["):
        return None
    stream.seek(start)
    position = start
    while chunk := stream.read(1 << 16):
        close = chunk.find(b"]")
        if close >= 0:
            after = position + close + 1
            stream.seek(after)
            return after - start + (stream.read(1) == b"\n")
        position += len(chunk)
    return None


def _entry_at(stream: BinaryIO, position: int, vectors: bool = False) -> int | None:
    """The value offset of the ark entry (``KEY `` and a value) at ``position``, else None
    (with ``vectors``, a text vector's first number counts as a value)."""
    stream.seek(position)
    match = (_ENTRY_OR_TEXT_VECTOR if vectors else _ENTRY).match(stream.read(_MAX_KEY_BYTES))
    return position + len(match.group(1)) + 1 if match else None


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
