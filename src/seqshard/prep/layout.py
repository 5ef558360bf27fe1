"""Which planned utterances each shard takes, and the write wave's tasks.

A length group's utterances are ordered by ``(major, minor)`` (``rows.py``): the buckets'
permutations one after another with shuffling on, input order without. Shard ``i`` of a group
takes the places ``[i * utts_per_file, (i + 1) * utts_per_file)`` of that order: prefix sums of
the buckets' counts say where each shard's utterances are, so the driver holds a count per
group and major, never a row per utterance. A write task reads its shards' rows, puts them in
input order and writes them in one sweep (``write.py``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .bucket_wave import BUCKETS, bucket_name
from .chunks import Chunk
from .job import PackJob, ShardTask
from .journal import Journal
from .rows import MINOR_BITS, PLANNED_ROW, TableLines, WaveFiles, order_of
from .write import Resume, ShardRows, write_shards


@dataclass(frozen=True)
class Slice:
    """Places ``[start, end)`` of the utterances of ``major`` in one group's order."""

    major: int
    start: int
    end: int


class GroupOrder:
    """One length group's order: how many utterances each major holds, and their prefix sums."""

    def __init__(self, counts: dict[int, int]):
        self.majors = np.array(sorted(counts), dtype=np.int64)
        self.counts = np.array([counts[m] for m in self.majors.tolist()], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)])

    @property
    def size(self) -> int:
        return int(self.starts[-1])

    def slices(self, start: int, end: int) -> list[Slice]:
        """The majors' pieces of places ``[start, end)``."""
        found = []
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        for index in range(max(first, 0), len(self.majors)):
            low, high = int(self.starts[index]), int(self.starts[index + 1])
            if low >= end:
                break
            if high > start:
                found.append(Slice(int(self.majors[index]), max(start, low) - low, min(end, high) - low))
        return found


def group_orders(records: Sequence[dict[str, Any]], num_groups: int) -> list[GroupOrder]:
    """Each group's order from the bucket records (``groups``: ``[[major, count], ...]`` per group)."""
    counts: list[dict[int, int]] = [{} for _ in range(num_groups)]
    for record in records:
        for number, pairs in enumerate(record["groups"]):
            for major, count in pairs:
                counts[number][major] = counts[number].get(major, 0) + count
    return [GroupOrder(c) for c in counts]


@dataclass(frozen=True)
class WriteTask:
    """Shards of one group that one task writes, and the slices of the group's order they take."""

    group: int
    shards: tuple[ShardTask, ...]
    slices: tuple[Slice, ...]

    @property
    def name(self) -> str:
        first, last = self.shards[0], self.shards[-1]
        named = f"shard {first.path.name}" if first is last else f"shards {first.path.name}..{last.path.name}"
        return named + (f" of {first.group}" if first.group else "")


def write_tasks(
    order: GroupOrder, group: int, shards: Sequence[ShardTask], utts_per_file: int, per_task: int
) -> list[WriteTask]:
    """The tasks that write ``shards`` (unfinished shards of one group), ``per_task`` at most each;
    a task takes consecutive shards only, so that its rows are few slices."""
    tasks: list[WriteTask] = []
    run: list[ShardTask] = []
    for shard in sorted(shards, key=lambda s: s.index):
        if run and (len(run) == per_task or shard.index != run[-1].index + 1):
            tasks.append(_task(order, group, run, utts_per_file))
            run = []
        run.append(shard)
    if run:
        tasks.append(_task(order, group, run, utts_per_file))
    return tasks


def _task(order: GroupOrder, group: int, run: list[ShardTask], utts_per_file: int) -> WriteTask:
    start, end = run[0].index * utts_per_file, min((run[-1].index + 1) * utts_per_file, order.size)
    return WriteTask(group, tuple(run), tuple(order.slices(start, end)))


def write_task(
    job: PackJob, task: WriteTask, dim: int, chunks: list[Chunk], progress: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """Write one task's shards; returns ``{"utts": handled, "resumed": utterances a killed run's
    partial files held}``."""
    files = WaveFiles.of(job)
    rows = np.concatenate([_slice_rows(files, job, task.group, piece) for piece in task.slices])
    ordinal_of = np.array([s.ordinal for s in task.shards], dtype=np.int64)
    places = np.arange(len(rows), dtype=np.int64)
    ordinals = ordinal_of[places // job.options.utts_per_file]
    order = np.lexsort((rows["line"], rows["chunk"]))  # input order: arks are read front to back
    journal = Journal(job.d_out, f"w{task.shards[0].ordinal}-{os.getpid()}")
    resume = Resume(job.d_out, task.shards, ())
    resumed = resume.utterances
    handled = 0

    def advance(count: int) -> None:
        nonlocal handled
        handled += count
        if progress is not None:
            progress(count)

    lines = TableLines(job, chunks)
    with contextlib.closing(lines):
        write_shards(ShardRows(rows[order], ordinals[order], lines), task.shards, job, dim, journal, advance, resume)
    return {"utts": handled, "resumed": resumed}


def _slice_rows(files: WaveFiles, job: PackJob, group: int, piece: Slice) -> np.ndarray:
    """The planned rows of one slice, in the group's order."""
    low, high = order_of(group, piece.major, 0), order_of(group, piece.major + 1, 0)
    buckets = [piece.major] if job.options.shuffle else range(job.buckets)
    parts = []
    for bucket in buckets:
        planned = files.rows(BUCKETS, bucket_name(bucket), PLANNED_ROW)
        first, last = np.searchsorted(planned["order"], [low, high])
        parts.append(np.array(planned[first:last]))
    rows = np.concatenate(parts) if parts else np.zeros(0, dtype=PLANNED_ROW)
    if len(parts) > 1:
        rows = rows[np.argsort(rows["order"] & np.uint64((1 << MINOR_BITS) - 1), kind="stable")]
    return rows[piece.start : piece.end]
