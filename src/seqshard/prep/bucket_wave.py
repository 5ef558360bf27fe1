"""The bucket wave: a task per bucket gathers the scan rows of its keys from every chunk (each
key's lines of every table meet in one bucket), and decides each utterance's fate: a repeated
key, no label, a length that cannot be read, outside every length group, or kept; then orders
each length group's kept utterances (``rows.py``): a seeded permutation of the bucket with
shuffling on, input order without.

A task holds its bucket's rows only: about :data:`BUCKET_ROWS` utterances and their labels
(~100 bytes each, ~50 MB), whatever the corpus's size.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InputError, SkipCounter, Where
from ..seeds import Seed, stage_rng
from .chunks import Chunk
from .job import PackJob, PackOptions
from .rows import BAD, PLANNED_ROW, SCAN_ROW, TableLines, WaveFiles, order_of
from .scan_wave import SCAN, chunk_name

_LOG = logging.getLogger("seqshard")
BUCKETS = "buckets"
BUCKET_ROWS = 1 << 19  # utterances a bucket holds on average
FIRST_PLANNED = 8  # a bucket's first planned utterances named in its record (the dataset's dim is read from one)
OUTSIDE_LOG_LIMIT = 20  # utterances outside every length group named at INFO level, per bucket


def bucket_count(utterances: int, per_bucket: int | None = None) -> int:
    """How many buckets a pack of ``utterances`` hashes its keys into (``per_bucket``: on
    average, :data:`BUCKET_ROWS` by default)."""
    return max(1, -(-utterances // (per_bucket or BUCKET_ROWS)))


def bucket_name(bucket: int) -> str:
    return f"b{bucket:06d}"


def bucket_task(
    job: PackJob, bucket: int, chunks: list[Chunk], progress: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """Plan one bucket (unless a finished run of this task left its record); returns the
    record: ``{"groups": [[[major, count], ...] per group], "counts": {counter: {reason: n}},
    "first": [[chunk, line, offset], ...], "digest"}``."""
    files = WaveFiles.of(job)
    name = bucket_name(bucket)
    done = files.done(BUCKETS, name)
    if done is not None:
        return done
    rows = {table: _gather(files, chunks, table, bucket) for table in ("utts", "labels", "lengths", "speakers")}
    with contextlib.closing(TableLines(job, chunks)) as lines:
        planner = _Planner(job, bucket, lines)
        planned = planner.plan(rows)
    planned.sort(order="order", kind="stable")
    major = (planned["order"] >> np.uint64(32)) & np.uint64((1 << 24) - 1)
    group = planned["order"] >> np.uint64(56)
    groups = []
    for number in range(max(1, len(job.options.groups))):
        majors, counts = np.unique(major[group == number], return_counts=True)
        groups.append([[int(m), int(c)] for m, c in zip(majors, counts)])
    first = planned[np.lexsort((planned["line"], planned["chunk"]))[:FIRST_PLANNED]]
    record = {
        "groups": groups,
        "counts": {name: dict(counter.counts) for name, counter in planner.counters.items()},
        "first": [[int(r["chunk"]), int(r["line"]), int(r["offset"])] for r in first],
        "digest": hashlib.blake2b(memoryview(np.ascontiguousarray(planned)), digest_size=16).hexdigest(),
    }
    files.finish(BUCKETS, name, record, {"": planned})
    if progress is not None:
        progress(1)
    return record


def _gather(files: WaveFiles, chunks: list[Chunk], table: str, bucket: int) -> np.ndarray:
    """The scan rows of ``table`` in ``bucket``, from every chunk, in input order."""
    parts = []
    for chunk in chunks:
        path = files.path(SCAN, chunk_name(chunk), f".{table}.npy")
        if not path.exists():
            continue  # this chunk's table has no such rows (a text file has no utterances)
        starts = files.rows(SCAN, f"{chunk_name(chunk)}.{table}.starts", np.dtype("<i8"))
        scanned = files.rows(SCAN, f"{chunk_name(chunk)}.{table}", SCAN_ROW)
        parts.append(np.array(scanned[starts[bucket] : starts[bucket + 1]]))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=SCAN_ROW)


@dataclass
class _Repeat:
    row: int  # the repeating row (its index in the rows given)
    first: int  # the row that gave the key first


class _Planner:
    """The decisions of one bucket, counted as the pack's report counts them."""

    def __init__(self, job: PackJob, bucket: int, lines: TableLines):
        self.job, self.bucket, self.lines = job, bucket, lines
        skip = job.options.skip_bad
        self.counters = {
            "dropped": SkipCounter(skip),
            "label_issues": SkipCounter(skip),
        }

    def where(self, rows: np.ndarray, index: int, key: str | None = None) -> Where:
        return self.lines.where(int(rows["chunk"][index]), int(rows["line"][index]), key)

    def key(self, table: str, rows: np.ndarray, index: int) -> str:
        return self.lines.record(table, int(rows["chunk"][index]), int(rows["offset"][index]))[0]

    def plan(self, rows: dict[str, np.ndarray]) -> np.ndarray:
        drops = self.counters["dropped"]
        utts = rows["utts"]
        bad_hashes = utts["hash"][utts["flags"] & BAD != 0]
        utts = utts[utts["flags"] & BAD == 0]
        keep = np.ones(len(utts), dtype=bool)
        for repeat in self.repeats("utts", utts):
            drops(
                InputError(
                    self.where(utts, repeat.row, self.key("utts", utts, repeat.row)),
                    "duplicate_key",
                    f"the key was already given at {self.where(utts, repeat.first)} (skipping keeps that first entry).",
                    "remove duplicate entries (utils/fix_data_dir.sh).",
                )
            )
            keep[repeat.row] = False
        label_of = self.labels(rows["labels"], utts, keep, bad_hashes)
        lengths = self.lengths(utts, keep, rows["lengths"])
        speaker_of = self.speakers(utts, keep, rows["speakers"])
        self.statistics(utts, keep, speaker_of, rows["speakers"])
        return planned_rows(
            self.job.options, self.bucket, utts, keep, label_of, lengths, speaker_of, rows["labels"], rows["speakers"]
        )

    def repeats(self, table: str, rows: np.ndarray) -> Iterator[_Repeat]:
        """Each row whose key an earlier row gave (a 64-bit hash collision is no repeat)."""
        order = np.argsort(rows["hash"], kind="stable")
        hashes = rows["hash"][order]
        same = np.flatnonzero(hashes[1:] == hashes[:-1]) + 1
        firsts = np.searchsorted(hashes, hashes[same], side="left")
        for position, first_position in zip(same, firsts):
            row, first = int(order[position]), int(order[first_position])
            if self.key(table, rows, row) == self.key(table, rows, first):
                yield _Repeat(row, first)

    def labels(self, labels: np.ndarray, utts: np.ndarray, keep: np.ndarray, bad_hashes: np.ndarray) -> np.ndarray:
        """Each utterance's label row (-1: none; the utterance is dropped), after the label
        issues: repeated labels, and labels of no utterance."""
        issues, kind = self.counters["label_issues"], self.job.source.kind
        repeated = np.zeros(len(labels), dtype=bool)
        for repeat in self.repeats("labels", labels):
            issues(
                InputError(
                    self.where(labels, repeat.row, self.key("labels", labels, repeat.row)),
                    "duplicate_label",
                    f"the key already has a label at {self.where(labels, repeat.first)} (skipping keeps that first label).",
                    "remove duplicate lines from the text files.",
                )
            )
            repeated[repeat.row] = True
        label_of = first_rows(labels["hash"], utts["hash"])
        for row in np.flatnonzero(keep & (label_of < 0)):
            self.counters["dropped"](
                InputError(
                    self.where(utts, int(row), self.key("utts", utts, int(row))),
                    "no_label",
                    f"the utterance has {kind} but no label in the text files.",
                    "add its label.",
                )
            )
            keep[row] = False
        used = np.zeros(len(labels), dtype=bool)
        used[label_of[keep]] = True
        of_bad = first_rows(labels["hash"], bad_hashes)
        used[of_bad[of_bad >= 0]] = True  # the utterance was dropped under its line's reason already
        unused = np.flatnonzero(~used & ~repeated)
        for number, row in enumerate(unused):
            more = f" ({len(unused) - 1} more labels have the same problem)" if number == 0 and len(unused) > 1 else ""
            issues(
                InputError(
                    self.where(labels, int(row), self.key("labels", labels, int(row))),
                    "no_features",
                    f"the label has no {kind} in the input files{more}.",
                    f"add its {kind}.",
                )
            )
        return label_of

    def lengths(self, utts: np.ndarray, keep: np.ndarray, given: np.ndarray) -> np.ndarray:
        """Each utterance's length (-1: not needed, no length groups): from a length file, the
        scan, or read now; unreadable, zero-length and outside every group are dropped."""
        groups = self.job.options.groups
        if not groups:
            return np.full(len(utts), -1, dtype=np.int64)
        lengths = utts["length"].astype(np.int64)
        from_files = first_rows(given["hash"], utts["hash"])
        lengths[from_files >= 0] = given["value"][from_files[from_files >= 0]]
        missing = np.flatnonzero(keep & (lengths < 0))
        if len(missing):
            self.read_lengths(utts, missing, keep, lengths)
        drops = self.counters["dropped"]
        for row in np.flatnonzero(keep & (lengths == 0)):
            drops(
                InputError(
                    self.where(utts, int(row), self.key("utts", utts, int(row))),
                    "zero_length",
                    "the utterance has no length (0 frames).",
                    "remove it.",
                )
            )
            keep[row] = False
        outside = keep & (group_of(lengths, groups) < 0)
        self.log_outside(utts, lengths, np.flatnonzero(outside))
        drops.counts["outside_groups"] = drops.counts.get("outside_groups", 0) + int(outside.sum())
        keep &= ~outside
        return lengths

    def read_lengths(self, utts: np.ndarray, rows: np.ndarray, keep: np.ndarray, lengths: np.ndarray) -> None:
        source = self.job.source
        with source.measurer() as measurer:
            for row in map(int, rows):
                key, value = self.lines.record("utts", int(utts["chunk"][row]), int(utts["offset"][row]))
                try:
                    lengths[row] = source.length(measurer, key, value, self.where(utts, row, key))
                except InputError as error:
                    self.counters["dropped"](error)
                    keep[row] = False

    def log_outside(self, utts: np.ndarray, lengths: np.ndarray, rows: np.ndarray) -> None:
        """Name, at INFO level, the first utterances dropped as outside every length group."""
        if not len(rows) or not _LOG.isEnabledFor(logging.INFO):
            return
        specs = ", ".join(f"[{g.low}, {g.high})" for g in self.job.options.groups)
        for row in map(int, rows[:OUTSIDE_LOG_LIMIT]):
            _LOG.info(
                "dropped (outside_groups): %s: %d frames, outside every length group (%s)",
                self.where(utts, row, self.key("utts", utts, row)),
                int(lengths[row]),
                specs,
            )
        if len(rows) > OUTSIDE_LOG_LIMIT:
            _LOG.info(
                "dropped (outside_groups): %d more utterances outside every length group", len(rows) - OUTSIDE_LOG_LIMIT
            )

    def speakers(self, utts: np.ndarray, keep: np.ndarray, speakers: np.ndarray) -> np.ndarray:
        """Each utterance's utt2spk row (-1: no utt2spk); a repeated utterance there stops the
        pack (ids would be guessed), one missing is dropped as ``no_speaker``."""
        if self.job.utt2spk is None:
            return np.full(len(utts), -1, dtype=np.int64)
        for repeat in self.repeats("speakers", speakers):
            raise InputError(
                self.where(speakers, repeat.row, self.key("speakers", speakers, repeat.row)),
                "duplicate_key",
                f"the utterance was already given at {self.where(speakers, repeat.first)}.",
                "remove the repeat.",
                skippable=False,
            )
        speaker_of = first_rows(speakers["hash"], utts["hash"])
        for row in np.flatnonzero(keep & (speaker_of < 0)):
            self.counters["dropped"](
                InputError(
                    self.where(utts, int(row), self.key("utts", utts, int(row))),
                    "no_speaker",
                    f"the utterance has no speaker in {self.job.utt2spk}.",
                    "add its line to utt2spk (utils/fix_data_dir.sh keeps the files of a data dir in step).",
                )
            )
            keep[row] = False
        return speaker_of

    def statistics(self, utts: np.ndarray, keep: np.ndarray, speaker_of: np.ndarray, speakers: np.ndarray) -> None:
        """Drop (``no_cmvn``) the utterances whose speaker has no statistics in cmvn.scp."""
        known = self.job.speakers()
        if known is None or self.job.cmvn_scp is None:
            return
        try:
            for row in map(int, np.flatnonzero(keep)):
                key = self.key("utts", utts, row)
                speaker = key
                if speaker_of[row] >= 0:
                    at = int(speaker_of[row])
                    speaker = self.lines.record("speakers", int(speakers["chunk"][at]), int(speakers["offset"][at]))[1]
                if not known.has_statistics(speaker):
                    self.counters["dropped"](known.missing(speaker, self.where(utts, row, key)))
                    keep[row] = False
        finally:
            known.close()


def planned_rows(
    options: PackOptions,
    bucket: int,
    utts: np.ndarray,
    keep: np.ndarray,
    label_of: np.ndarray,
    lengths: np.ndarray,
    speaker_of: np.ndarray,
    labels: np.ndarray,
    speakers: np.ndarray,
) -> np.ndarray:
    """The kept utterances as planned rows, each with its place in its group's order."""
    group = group_of(lengths, options.groups) if options.groups else np.zeros(len(utts), dtype=np.int64)
    parts = []
    for number in range(max(1, len(options.groups))):
        rows = np.flatnonzero(keep & (group == number))
        planned = np.zeros(len(rows), dtype=PLANNED_ROW)
        for field in ("chunk", "line", "offset"):
            planned[field] = utts[field][rows]
        planned["successor"] = utts["value"][rows]
        planned["length"] = lengths[rows]
        planned["label_chunk"] = labels["chunk"][label_of[rows]]
        planned["label_offset"] = labels["offset"][label_of[rows]]
        has_speaker = speaker_of[rows] >= 0
        planned["speaker_offset"] = -1
        planned["speaker_chunk"][has_speaker] = speakers["chunk"][speaker_of[rows][has_speaker]]
        planned["speaker_offset"][has_speaker] = speakers["offset"][speaker_of[rows][has_speaker]]
        if options.shuffle:
            bounds = (options.groups[number].low, options.groups[number].high) if options.groups else ()
            minor = stage_rng(options.seed, Seed.PACK_BUCKET, bucket, *bounds).permutation(len(rows))
            planned["order"] = order_of(number, bucket, minor)
        else:
            planned["order"] = order_of(number, planned["chunk"], planned["line"])
        parts.append(planned)
    return np.concatenate(parts)


def first_rows(hashes: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """For each of ``wanted``, the first row (in input order) of ``hashes`` equal to it, else -1."""
    if not len(hashes):
        return np.full(len(wanted), -1, dtype=np.int64)
    order = np.argsort(hashes, kind="stable")
    position = np.minimum(np.searchsorted(hashes[order], wanted), len(order) - 1)
    rows = order[position].astype(np.int64)
    rows[hashes[rows] != wanted] = -1
    return rows


def group_of(lengths: np.ndarray, groups: Any) -> np.ndarray:
    """Each length's group number (-1: outside every group)."""
    found = np.full(len(lengths), -1, dtype=np.int64)
    for number, group in enumerate(groups):
        found[(lengths >= group.low) & (lengths < group.high)] = number
    return found
