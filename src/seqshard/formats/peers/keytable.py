"""Kaldi table files (scp, text, utt2num_frames) held as compact arrays.

A corpus of 15 million utterances is 15 million lines in ``feats.scp`` and in ``text``; as
Python dicts of strings they would take several GB in every packing process. Here a line is
a row of numbers (key hash, file, line number, byte offset, and a sorted index for lookups),
36 bytes, shared by forked workers without copying; a line's text is re-read from the file
when it is needed.
"""

from __future__ import annotations

import os
import re
from array import array
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from ...checks import NumberError, read_digits, read_number
from ...errors import InputError, SkipCounter, Where
from ..files import NotAFileError, open_input
from ..index_entries import MAX_LENGTH, MAX_SECONDS  # utterance lengths are held as int32 (frames, or 10 ms of audio)
from ..keys import key_hash
from .kaldi import ASCII_WHITESPACE, iter_lines, long_line, parse_line

Parser = Callable[[bytes, Where, bool], tuple[str, str]]


class KeyTable:
    """One row per kept line of a set of Kaldi table files, in input order.

    ``values`` holds a number per row when the table was scanned with ``number=True``
    (with ``seconds=True``, a duration such as ``utt2dur``'s, in milliseconds)
    (``utt2num_frames``). Lines that fail to parse go to ``bad`` (raised or counted) and get
    no row; ``bad_lines`` counts them, and ``bad_key_hashes`` holds the key hashes of those whose
    key could be read (their key was dropped under the line's reason).
    """

    def __init__(
        self,
        files: Sequence[Path],
        hashes: np.ndarray,
        file_ids: np.ndarray,
        lines: np.ndarray,
        offsets: np.ndarray,
        values: np.ndarray | None = None,
        bad_lines: int = 0,
        parse: Parser = parse_line,
        bad_key_hashes: np.ndarray | None = None,
    ):
        self.files = [Path(f) for f in files]
        self.parse = parse
        self.hashes = hashes
        self.file_ids = file_ids
        self.lines = lines
        self.offsets = offsets
        self.values = values
        self.bad_lines = bad_lines
        self.bad_key_hashes = np.zeros(0, dtype=np.uint64) if bad_key_hashes is None else bad_key_hashes
        self._order = np.argsort(hashes, kind="stable").astype(np.int32 if len(hashes) < 2**31 else np.int64)
        self._sorted = hashes[self._order]
        self._files: dict[int, int] = {}  # file id -> descriptor

    @classmethod
    def scan(
        cls,
        files: Sequence[Path],
        bad: SkipCounter,
        needs_value: bool = True,
        check: Callable[[str, str, Where], None] | None = None,
        number: bool = False,
        progress: Callable[[int], None] | None = None,
        parse: Parser = parse_line,
        seconds: bool = False,
    ) -> KeyTable:
        """Read ``files`` line by line; ``parse(raw_line, where, needs_value)`` splits a line
        into ``(key, value)`` (Kaldi's ``KEY VALUE`` by default); ``check(key, value, where)``
        may raise InputError."""
        if len(files) > 65535:
            raise ValueError("at most 65535 table files")
        capacity = sum(_count_lines(Path(f)) for f in files)  # exact-size arrays: no regrowth
        columns = _Columns(capacity, number)
        bad_keys: list[int] = []
        counter = _Counter(bad)
        measure = (parse_milliseconds if seconds else parse_count) if number else None
        for file_id, path in enumerate(files):
            lines = table_lines(Path(path), counter, parse, needs_value, check, progress, bad_keys=bad_keys)
            for key, value, line_no, offset in lines:
                try:
                    count = measure(value, Where(path, line_no, key)) if measure else 0
                except InputError as error:
                    counter(error)
                    bad_keys.append(key_hash(key))
                    continue
                columns.add(key_hash(key), file_id, line_no, offset, count)
        return cls(
            files,
            *columns.finish(),
            bad_lines=counter.lines,
            parse=parse,
            bad_key_hashes=np.array(bad_keys, dtype=np.uint64),
        )

    def __len__(self) -> int:
        return len(self.lines)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_files"] = {}
        return state

    def where(self, row: int, key: str | None = None) -> Where:
        return Where(self.files[self.file_ids[row]], int(self.lines[row]), key)

    def record(self, row: int) -> tuple[str, str]:
        """``(key, value)`` of a row, re-read from its file (by ``pread``, not a memory map:
        a pack re-reads every line, and mapped pages would count in its memory)."""
        file_id = int(self.file_ids[row])
        descriptor = self._files.get(file_id)
        if descriptor is None:
            descriptor = self._files[file_id] = open_input(self.files[file_id])
        return self.parse(line_at(descriptor, int(self.offsets[row])), self.where(row), False)

    def find(self, key: str) -> tuple[int, str] | None:
        """``(row, value)`` of the first line with ``key``, or None."""
        row = int(self.lookup(np.array([key_hash(key)], dtype=np.uint64))[0])
        if row < 0:
            return None
        found, value = self.record(row)
        return (row, value) if found == key else None

    def lookup(self, hashes: np.ndarray) -> np.ndarray:
        """For each hash, the first row (in input order) with that key hash, else -1 (as the
        rows' integer type; computed in place: a pack looks up millions at once)."""
        if len(self._sorted) == 0:
            return np.full(len(hashes), -1, dtype=self._order.dtype)
        position = np.searchsorted(self._sorted, hashes)
        np.minimum(position, len(self._sorted) - 1, out=position)
        missing = self._sorted[position] != hashes
        rows = self._order[position]
        del position
        rows[missing] = -1
        return rows

    def repeated_rows(self) -> list[tuple[int, int]]:
        """``(row, first_row)`` for every row whose key appeared on an earlier row."""
        same = np.flatnonzero(self._sorted[1:] == self._sorted[:-1]) + 1
        firsts = np.searchsorted(self._sorted, self._sorted[same], side="left")
        pairs = []
        for position, first_position in zip(same, firsts):
            row, first = int(self._order[position]), int(self._order[first_position])
            if self.record(row)[0] == self.record(first)[0]:  # not a 64-bit hash collision
                pairs.append((row, first))
        return pairs

    def report_repeats(self, report: SkipCounter, reason: str, problem: str, fix: str) -> np.ndarray:
        """Report (raise or count) each row repeating an earlier key; ``problem`` may name the
        earlier row as ``{first}``. Returns a mask of the repeating rows."""
        repeated = np.zeros(len(self), dtype=bool)
        for row, first in self.repeated_rows():
            report(
                InputError(self.where(row, self.record(row)[0]), reason, problem.format(first=self.where(first)), fix)
            )
            repeated[row] = True
        return repeated

    def close(self) -> None:
        for descriptor in self._files.values():
            os.close(descriptor)
        self._files.clear()


def table_lines(
    path: Path,
    bad: Callable[[InputError], None],
    parse: Parser = parse_line,
    needs_value: bool = True,
    check: Callable[[str, str, Where], None] | None = None,
    progress: Callable[[int], None] | None = None,
    start: int = 0,
    end: int | None = None,
    first_line: int = 1,
    bad_keys: list[int] | None = None,
) -> Iterator[tuple[str, str, int, int]]:
    """``(key, value, line number, byte offset)`` of each good line of a table file (or of its
    lines starting in bytes ``[start, end)``, the first numbered ``first_line``);
    ``parse(raw_line, where, needs_value)`` splits a line into ``(key, value)``, ``check(key,
    value, where)`` may raise InputError. A bad line goes to ``bad`` (which raises or counts
    it), the hash of its key, when one was read, to ``bad_keys``."""
    for line_no, offset, raw in iter_lines(path, start, end, first_line):
        if progress is not None and isinstance(raw, bytes):
            progress(len(raw))
        where = Where(path, line_no)
        key = None
        try:
            if not isinstance(raw, bytes):
                raise long_line(where, raw)
            key, value = parse(raw, where, needs_value)
            if check is not None:
                check(key, value, Where(path, line_no, key))
        except InputError as error:
            bad(error)
            if key is not None and bad_keys is not None:
                bad_keys.append(key_hash(key))
            continue
        yield key, value, line_no, offset


class _Counter:
    """Hands bad lines on to ``bad`` and counts them."""

    def __init__(self, bad: Callable[[InputError], None]):
        self.bad = bad
        self.lines = 0

    def __call__(self, error: InputError) -> None:
        self.bad(error)
        self.lines += 1


class _Columns:
    """Rows gathered in small Python arrays and moved into exact-size numpy arrays."""

    BATCH = 1 << 16

    def __init__(self, capacity: int, number: bool):
        self.hashes = np.empty(capacity, dtype=np.uint64)
        self.file_ids = np.empty(capacity, dtype=np.uint16)
        self.lines = np.empty(capacity, dtype=np.uint32)
        self.offsets = np.empty(capacity, dtype=np.int64)
        self.values = np.empty(capacity, dtype=np.int64) if number else None
        self.size = 0
        self._pending: tuple[array, ...] = self._empty()

    @staticmethod
    def _empty() -> tuple[array, ...]:
        return array("Q"), array("H"), array("I"), array("q"), array("q")

    def add(self, key_hash_: int, file_id: int, line: int, offset: int, value: int) -> None:
        for column, item in zip(self._pending, (key_hash_, file_id, line, offset, value)):
            column.append(item)
        if len(self._pending[0]) >= self.BATCH:
            self._flush()

    def _flush(self) -> None:
        count = len(self._pending[0])
        targets = (self.hashes, self.file_ids, self.lines, self.offsets, self.values)
        for target, column in zip(targets, self._pending):
            if target is not None:
                target[self.size : self.size + count] = np.frombuffer(column, dtype=target.dtype)
        self.size += count
        self._pending = self._empty()

    def finish(self) -> tuple[np.ndarray, ...]:
        self._flush()
        columns = (self.hashes, self.file_ids, self.lines, self.offsets)
        values = self.values[: self.size] if self.values is not None else None
        return (*(c[: self.size] for c in columns), values)


def line_at(descriptor: int, start: int, piece: int = 512) -> bytes:
    """The line starting at byte ``start`` of a file, without its newline."""
    pieces = []
    while True:
        chunk = os.pread(descriptor, piece, start)
        end = chunk.find(b"\n")
        if end >= 0 or len(chunk) < piece:
            pieces.append(chunk[:end] if end >= 0 else chunk)
            return b"".join(pieces)
        pieces.append(chunk)
        start += piece
        piece = min(piece * 2, 1 << 20)


def _count_lines(path: Path) -> int:
    lines = 0
    last = b"\n"
    try:
        descriptor = open_input(path)
    except NotAFileError as error:  # the one check of each table file: it is counted before it is read
        raise InputError(
            Where(path),
            "not_a_file",
            f"cannot be read as a table: {error.strerror}.",
            "give a regular file (seqshard reads a table more than once: write a pipe's output to a file first).",
            skippable=False,
        ) from None
    with os.fdopen(descriptor, "rb", buffering=0) as stream:
        while chunk := stream.read(8 << 20):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    return lines + (last != b"\n")


def parse_count(value: str, where: Where) -> int:
    """A count as Kaldi writes it: ASCII digits (``int`` would also take ``1_000``, Unicode
    digits and Unicode spaces, and refuse more than 4300 digits), at most an utterance's
    length."""
    text = value.strip(ASCII_WHITESPACE)
    try:
        return read_digits("the count", text.removeprefix("+"), MAX_LENGTH)
    except NumberError as error:
        raise InputError(where, "malformed_line", f"{error}.") from None


_SECONDS = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")


def parse_milliseconds(value: str, where: Where) -> int:
    """A duration in seconds as Kaldi writes it (``utt2dur``), in whole milliseconds."""
    text = value.strip(ASCII_WHITESPACE)
    if not _SECONDS.fullmatch(text):
        raise InputError(where, "malformed_line", f"expected a duration in seconds, found {value!r}.")
    try:
        return round(float(read_number("the duration (seconds)", float(text), at_most=MAX_SECONDS)) * 1000)  # type: ignore[arg-type]
    except NumberError as error:
        raise InputError(where, "malformed_line", f"{error}.") from None
