"""The plan rows a pack's waves hand each other, and where they keep them.

A row is a few numbers that say where a line is (its chunk, line number and byte offset), never
the line's text: a task re-reads a line when it needs it. Each task writes its rows to one
``.npy`` file in ``OUT/.seqshard-pack/waves/`` under a temporary name, then a JSON record of
what it did (``*.done.json``) that marks it finished: a rerun, another part or another worker
skips a task whose record is there, and reads the rows by memory map.

- scan rows (``scan/CHUNK.npy``): one per table line that parsed (and one, flagged ``BAD``,
  per line that did not but whose key was read), sorted by bucket.
- planned rows (``buckets/BUCKET.npy``): one per utterance kept, sorted by ``order``: its
  length group, then ``major`` (its bucket, or without shuffling its chunk), then ``minor``
  (its place in the bucket's seeded permutation, or its line).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import SeqshardError, Where
from ..formats.files import inside, open_input, read_json, write_atomic, write_json_atomic, writing
from ..formats.pack_state import STATE_DIR
from ..formats.peers.kaldi import parse_line, parse_location
from ..formats.peers.keytable import line_at
from .inputs import Utterance

if TYPE_CHECKING:
    from .chunks import Chunk
    from .job import PackJob

WAVES_DIR = "waves"
BAD = 1  # a scan row flag: the line was dropped (its key was read)

SCAN_ROW = np.dtype(
    [
        ("hash", "<u8"),  # the key's hash (formats.keys.key_hash)
        ("chunk", "<u4"),
        ("line", "<u8"),
        ("offset", "<i8"),  # of the line in its file
        ("value", "<i8"),  # a length file's number; the byte offset of a feature row's successor (-1: none)
        ("length", "<i4"),  # an utterance's length when the scan read it (-1: not read)
        ("flags", "u1"),
    ]
)
PLANNED_ROW = np.dtype(
    [
        ("order", "<u8"),  # group << 56 | major << 32 | minor
        ("chunk", "<u4"),
        ("line", "<u8"),
        ("offset", "<i8"),
        ("successor", "<i8"),
        ("length", "<i4"),  # frames (10 ms for audio); -1 not known
        ("label_chunk", "<u4"),
        ("label_offset", "<i8"),
        ("speaker_chunk", "<u4"),
        ("speaker_offset", "<i8"),  # -1: no utt2spk
    ]
)
MAJOR_BITS, MINOR_BITS = 24, 32


def order_of(group: int, major: np.ndarray | int, minor: np.ndarray | int) -> np.ndarray:
    """The sort key of planned rows (see the module docstring)."""
    return (
        (np.uint64(group) << np.uint64(MAJOR_BITS + MINOR_BITS))
        | (np.asarray(major, dtype=np.uint64) << np.uint64(MINOR_BITS))
        | np.asarray(minor, dtype=np.uint64)
    )


class WaveFiles:
    """The waves' folder of the pack in ``d_out``: each task's rows and record. ``run`` names
    what the pack is made from (inputs and options), so that no task of other inputs is taken
    as finished."""

    def __init__(self, d_out: str | Path, run: str):
        self.root = Path(d_out)
        self.folder = inside(self.root, self.root / STATE_DIR / f"{WAVES_DIR}-{run}")

    @classmethod
    def of(cls, job: PackJob) -> WaveFiles:
        return cls(job.d_out, job.run)

    def path(self, wave: str, name: str, suffix: str) -> Path:
        return self.folder / wave / f"{name}{suffix}"

    def done(self, wave: str, name: str) -> dict[str, Any] | None:
        """The record of a finished task, or None (never run, or killed before its end)."""
        path = self.path(wave, name, ".done.json")
        return read_json(path, "delete it (seqshard did not write it so); the task is run again.", None, kind=dict)

    def finish(self, wave: str, name: str, record: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        """Keep a task's ``arrays`` (``NAME.KEY.npy``; ``NAME.npy`` for key "") and then its
        ``record``: the task is finished."""
        folder = self.folder / wave
        with writing(folder):
            folder.mkdir(parents=True, exist_ok=True)
        for key, array in arrays.items():
            contiguous = np.ascontiguousarray(array)
            write_atomic(
                self.path(wave, f"{name}.{key}" if key else name, ".npy"),
                lambda stream, contiguous=contiguous: np.lib.format.write_array(stream, contiguous, allow_pickle=False),
                self.root,
            )
        write_json_atomic(self.path(wave, name, ".done.json"), record, self.root)

    def rows(self, wave: str, name: str, dtype: np.dtype) -> np.ndarray:
        """A finished task's rows, mapped (read only); checked against ``dtype``."""
        path = self.path(wave, name, ".npy")
        try:
            rows = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as error:
            raise SeqshardError(
                f"{path}: unreadable ({str(error)[:200]}). Fix: delete it and its .done.json; the task is run again."
            ) from None
        if rows.dtype != dtype or rows.ndim != 1:
            raise SeqshardError(
                f"{path}: not rows of this version of seqshard ({rows.dtype}). Fix: delete it and its .done.json."
            )
        return rows


class TableLines:
    """The lines of a pack's tables, re-read by chunk and byte offset (their files kept open)."""

    def __init__(self, job: PackJob, chunks: Sequence[Chunk]):
        self.job = job
        self._paths = {chunk.number: Path(job.table_files(chunk.table)[chunk.file]) for chunk in chunks}
        self._descriptors: dict[Path, int] = {}

    def path(self, chunk: int) -> Path:
        return self._paths[chunk]

    def where(self, chunk: int, line: int, key: str | None = None) -> Where:
        return Where(self.path(chunk), line, key)

    def record(self, table: str, chunk: int, offset: int, line: int | None = None) -> tuple[str, str]:
        """``(key, value)`` of the line of ``table`` at ``offset`` of ``chunk``'s file."""
        path = self.path(chunk)
        descriptor = self._descriptors.get(path)
        if descriptor is None:
            descriptor = self._descriptors[path] = open_input(path)
        source = self.job.source
        parse = source.parse if table == "utts" else parse_line
        if table == "labels" and source.texts_inside:
            parse = source.parse_label
        return parse(line_at(descriptor, offset), Where(path, 1 if offset == 0 else line), table != "labels")

    def utterance(self, row: Any) -> Utterance:
        """A planned row's utterance: its line, length and successor (see ``Utterance``)."""
        chunk, line = int(row["chunk"]), int(row["line"])
        key, value = self.record("utts", chunk, int(row["offset"]), line)
        where = self.where(chunk, line, key)
        successor = None
        if row["successor"] >= 0:  # the next value the scp lists in the same ark
            next_key, next_value = self.record("utts", chunk, int(row["successor"]))
            offset = parse_location(next_value, where).offset  # paths need no mapping here
            successor = None if offset is None else (offset, next_key)
        return Utterance(key, value, where, int(row["length"]), successor)

    def label(self, row: Any, key: str) -> str:
        label_key, label = self.record("labels", int(row["label_chunk"]), int(row["label_offset"]))
        if label_key != key:
            raise RuntimeError(f"64-bit key hash collision between {key!r} and {label_key!r}; please report this.")
        return label

    def speaker(self, row: Any, key: str) -> str:
        """The utterance's speaker (its key without utt2spk, as apply-cmvn takes it)."""
        if row["speaker_offset"] < 0:
            return key
        return self.record("speakers", int(row["speaker_chunk"]), int(row["speaker_offset"]))[1]

    def close(self) -> None:
        for descriptor in self._descriptors.values():
            os.close(descriptor)
        self._descriptors.clear()
