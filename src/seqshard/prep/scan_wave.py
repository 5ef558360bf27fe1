"""The scan wave: a task per chunk of the pack's tables (``chunks.py``) reads its lines once,
parses and checks them, and keeps one row per line (``rows.py``), sorted by the bucket of its
key: the bucket wave then finds all the lines of one key in one bucket.

The tables: ``utts`` (the source's lines, one per utterance: feats.scp, wav.scp, segments,
manifests, a dataset's rows), ``labels`` (text files; the source's own lines when the texts are
inside it), ``lengths`` (``utt2num_frames``, ``utt2dur``) and ``speakers`` (``utt2spk``).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..errors import InputError, SkipCounter, Where
from ..formats.keys import key_hash
from ..formats.peers.kaldi import parse_line
from ..formats.peers.keytable import parse_count, parse_milliseconds, table_lines
from .chunks import Chunk
from .inputs import ArkPositions
from .job import PackJob
from .rows import BAD, SCAN_ROW, WaveFiles

SCAN = "scan"
AUDIO_SHIFT_MS = 10


def chunk_name(chunk: Chunk) -> str:
    return f"c{chunk.number:06d}"


def bucket_of(hashes: np.ndarray, seed: int, buckets: int) -> np.ndarray:
    """Each key hash's bucket: the hash mixed with the seed (splitmix64's finalizer), modulo
    ``buckets``; so another seed deals the keys to other buckets."""
    with np.errstate(over="ignore"):
        mixed = hashes ^ np.uint64((seed * 0x9E3779B97F4A7C15) % 2**64)
        mixed = (mixed ^ (mixed >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        mixed = (mixed ^ (mixed >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        mixed ^= mixed >> np.uint64(31)
    return (mixed % np.uint64(buckets)).astype(np.int64)


def scan_task(job: PackJob, chunk: Chunk, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Scan one chunk (unless a finished run of this task left its record): returns the record,
    ``{"lines", "rows": {table: count}, "counts": {counter: {reason: count}}, "bytes"}``."""
    files = WaveFiles.of(job)
    name = chunk_name(chunk)
    done = files.done(SCAN, name)
    if done is not None:
        return done
    scanner = _Scanner(job, chunk, progress)
    outputs = scanner.run()
    arrays: dict[str, np.ndarray] = {}
    for table, rows in outputs.items():
        buckets = bucket_of(rows["hash"], job.options.seed, job.buckets)
        order = np.argsort(buckets, kind="stable")  # input order within a bucket
        arrays[table] = rows[order]
        arrays[f"{table}.starts"] = np.searchsorted(buckets[order], np.arange(job.buckets + 1)).astype(np.int64)
    record = {
        "lines": scanner.lines,
        "rows": {table: len(rows) for table, rows in outputs.items()},
        "counts": {name: dict(counter.counts) for name, counter in scanner.counters.items()},
        "bytes": chunk.end - chunk.start,
        "first_empty": scanner.first_empty,
    }
    files.finish(SCAN, name, record, arrays)
    return record


class _Rows:
    """Scan rows gathered in compact arrays (no Python object per line)."""

    def __init__(self) -> None:
        self.hashes, self.lines, self.offsets, self.values = array("Q"), array("Q"), array("q"), array("q")

    def add(self, key: str, line: int, offset: int, value: int = -1) -> None:
        self.hashes.append(key_hash(key))
        self.lines.append(line)
        self.offsets.append(offset)
        self.values.append(value)

    def finish(self, chunk: int, bad_hashes: list[int] = ()) -> np.ndarray:  # type: ignore[assignment]
        """The rows; ``bad_hashes``: rows of dropped lines whose key was read (``BAD``), so that
        their labels are not reported unused."""
        rows = np.zeros(len(self.hashes) + len(bad_hashes), dtype=SCAN_ROW)
        good = len(self.hashes)
        for name, column in (("hash", self.hashes), ("line", self.lines), ("offset", self.offsets)):
            rows[name][:good] = np.frombuffer(column, dtype=rows.dtype[name]) if good else 0
        rows["value"][:good] = np.frombuffer(self.values, dtype=np.int64) if good else 0
        rows["hash"][good:] = np.array(bad_hashes, dtype=np.uint64)
        rows["offset"][good:] = rows["value"][good:] = -1
        rows["flags"][good:] = BAD
        rows["length"] = -1
        rows["chunk"] = chunk
        return rows


class _Scanner:
    """The scan of one chunk: which lines of which tables it keeps, and what it counts."""

    def __init__(self, job: PackJob, chunk: Chunk, progress: Callable[[int], None] | None):
        self.job, self.chunk, self.progress = job, chunk, progress
        self.path = job.table_files(chunk.table)[chunk.file]
        skip = job.options.skip_bad
        self.counters = {
            "dropped": SkipCounter(skip),
            "label_issues": SkipCounter(skip),
            "frames_file_issues": SkipCounter(skip, done="line ignored, length read from the input"),
        }
        self.lines = 0
        self.first_empty = ""  # where the first empty label is

    def _lines(
        self, bad: Callable[[InputError], None], parse: Any, needs_value: bool, check: Any, **kw: Any
    ) -> Iterator:
        chunk = self.chunk
        return table_lines(
            self.path, bad, parse, needs_value, check, self.progress, chunk.start, chunk.end, chunk.first_line, **kw
        )

    def run(self) -> dict[str, np.ndarray]:
        table = self.chunk.table
        if table == "utts":
            outputs = {"utts": self._utterances()}
            if self.job.source.texts_inside:
                outputs["labels"] = self._labels(self.job.source.parse_label)
            return outputs
        if table == "labels":
            return {"labels": self._labels(parse_line)}
        if table == "lengths":
            return {"lengths": self._lengths()}
        return {"speakers": self._speakers()}

    def _counting(self, counter: Callable[[InputError], None]) -> Callable[[InputError], None]:
        def bad(error: InputError) -> None:
            self.lines += 1
            counter(error)

        return bad

    def _utterances(self) -> np.ndarray:
        """The source's lines: checked, each value's successor in its ark (within the chunk),
        and the length when the plan needs it and no length file may give it."""
        source, drops = self.job.source, self.counters["dropped"]
        rows, bad_keys, positions = _Rows(), [], ArkPositions()
        measured: list[tuple[str, str, int]] = []  # lines whose length the scan reads

        def check(key: str, value: str, where: Where) -> None:
            positions.add(source.check(key, value, where))  # the last check: a row follows each call

        lines = self._lines(self._counting(drops), source.parse, True, check, bad_keys=bad_keys)
        for key, value, line, offset in lines:
            self.lines += 1
            rows.add(key, line, offset)
            if self.job.lengths_at_scan:
                measured.append((key, value, line))
        found = rows.finish(self.chunk.number, bad_keys)
        good = found[: len(rows.hashes)]  # a view: the bad rows follow
        following = positions.next_rows(len(good))
        good["value"][following >= 0] = good["offset"][following[following >= 0]]
        if measured:
            good["length"] = self._measure(measured, drops)
            unreadable = good["length"] == -2  # dropped and counted; a bad row (its label is not unused)
            good["flags"][unreadable] = BAD
            good["length"][unreadable] = -1
        return found

    def _measure(self, lines: list[tuple[str, str, int]], drops: SkipCounter) -> np.ndarray:
        """Lengths of ``lines`` (-2: unreadable, dropped)."""
        lengths = np.full(len(lines), -1, dtype=np.int64)
        source = self.job.source
        with source.measurer() as measurer:
            for number, (key, value, line) in enumerate(lines):
                try:
                    lengths[number] = source.length(measurer, key, value, Where(self.path, line, key))
                except InputError as error:
                    drops(error)
                    lengths[number] = -2
        return lengths

    def _labels(self, parse: Any) -> np.ndarray:
        """Label lines; empty ones are kept (a silent recording may have none) and counted."""
        rows = _Rows()
        issues = self.counters["label_issues"]
        own_lines = self.chunk.table == "labels"  # else the lines are counted as utterances
        for key, value, line, offset in self._lines(
            self._counting(issues) if own_lines else issues, parse, False, None
        ):
            self.lines += own_lines
            if not value:
                issues.counts["empty_label"] = issues.counts.get("empty_label", 0) + 1
                self.first_empty = self.first_empty or str(Where(self.path, line))
            rows.add(key, line, offset)
        return rows.finish(self.chunk.number)

    def _lengths(self) -> np.ndarray:
        rows = _Rows()
        measure = parse_milliseconds if self.job.seconds else parse_count
        issues = self.counters["frames_file_issues"]
        for key, value, line, offset in self._lines(self._counting(issues), parse_line, True, None):
            self.lines += 1
            try:
                count = measure(value, Where(self.path, line, key))
            except InputError as error:
                issues(error)
                continue
            rows.add(key, line, offset, round(count / AUDIO_SHIFT_MS) if self.job.seconds else count)
        return rows.finish(self.chunk.number)

    def _speakers(self) -> np.ndarray:
        """utt2spk: a malformed line stops the pack whatever ``skip_bad`` says (ids would be guessed)."""
        rows = _Rows()

        def one_word(key: str, value: str, where: Where) -> None:
            if len(value.split()) != 1:
                raise InputError(
                    where, "malformed_line", f"expected 'UTTERANCE SPEAKER', found a speaker of {value!r}."
                )

        for key, _, line, offset in self._lines(SkipCounter(False), parse_line, True, one_word):
            self.lines += 1
            rows.add(key, line, offset)
        return rows.finish(self.chunk.number)
