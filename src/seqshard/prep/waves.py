"""A pack as waves of small restartable tasks, run by any executor (``executors.py``).

1. *scan*: a task per chunk of the input tables (``chunks.py``, ``scan.py``) parses and checks
   its lines and keeps a row per line, by bucket of its key;
2. *bucket*: a task per bucket (``buckets.py``) joins its keys' rows (so repeated keys are found
   exactly), drops and counts, and orders each length group's utterances (a seeded permutation);
3. *write*: a task per run of shards (``layout.py``, ``write.py``) writes their utterances.

The driver holds a record per chunk, per bucket and per shard, never a row per utterance, and
hands tasks small picklable arguments. Each task records its completion (``rows.py``), so a
rerun after a crash, a lost worker or a lost node redoes only what did not finish, and the
output does not depend on what runs the tasks: one process, a pool, a cluster, or parts of an
array job (``--num-parts``, which share the work through claims: ``claims.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import SeqshardError, counted
from ..progress import Progress
from . import chunks as chunking
from .bucket_wave import BUCKETS, bucket_count, bucket_name, bucket_task
from .chunks import Chunk, line_chunks
from .claims import Claims
from .executors import Call, run_calls
from .job import PackJob, ShardTask
from .journal import finished_shards
from .layout import GroupOrder, WriteTask, write_task, write_tasks
from .owned import remove_tree
from .rows import WAVES_DIR, WaveFiles
from .scan_wave import SCAN, chunk_name, scan_task

_LOG = logging.getLogger("seqshard")
TABLES = ("utts", "labels", "lengths", "speakers")
WAIT_SECONDS = 2.0  # between looks at other parts' progress
RERUN = "run the same command again to redo only the unfinished tasks (with the same inputs and options)."


@dataclass
class Totals:
    """What the scan and bucket waves counted, for the report."""

    input_utts: int = 0
    num_labels: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    label_issues: dict[str, int] = field(default_factory=dict)
    frames_file_issues: dict[str, int] = field(default_factory=dict)
    first_empty: str = ""

    def add(self, counts: dict[str, dict[str, int]]) -> None:
        for name, found in counts.items():
            mine = getattr(self, name)
            for reason, count in found.items():
                mine[reason] = mine.get(reason, 0) + count


def plan_chunks(job: PackJob, progress: Callable[..., Callable[[int], None]]) -> list[Chunk]:
    """Every chunk of the job's tables, in input order (each table file read once to count lines)."""
    files = {table: list(job.table_files(table)) for table in TABLES}
    advance = progress("index inputs", sum(Path(f).stat().st_size for paths in files.values() for f in paths), "B")
    chunks: list[Chunk] = []
    for table, paths in files.items():
        chunks += line_chunks(table, paths, len(chunks), chunking.CHUNK_BYTES, advance)
    return chunks


def with_buckets(job: PackJob, chunks: Sequence[Chunk]) -> PackJob:
    """The job with its bucket count, from the number of utterance lines."""
    return replace(job, buckets=bucket_count(sum(c.lines for c in chunks if c.table == "utts")))


class Waves:
    """One run of a pack's waves: this part's share (all of it with one part) on ``executor``."""

    def __init__(
        self,
        job: PackJob,
        chunks: list[Chunk],
        executor: Any,
        bars: Progress,
        part: int = 0,
        num_parts: int = 1,
        shards_per_task: int = 256,
    ):
        self.job, self.chunks, self.executor, self.bars = job, chunks, executor, bars
        self.part, self.num_parts = part, num_parts
        self.shards_per_task = shards_per_task
        self.width = executor_width(executor)
        self.files = WaveFiles.of(job)
        self.live = getattr(executor, "live_progress", False)
        self.resumed = 0  # utterances the partial files of a killed run held (continued, not read again)
        self.written: list[ShardTask] = []  # the shards of the write tasks this run ran
        for folder in self.files.folder.parent.glob(f"{WAVES_DIR}-*"):  # of other inputs: no shard was written
            if folder != self.files.folder:
                remove_tree(folder)

    def _run(
        self, wave: str, calls: list[Call], finished: Callable[[Call], bool], done: Callable[[Call, Any], None]
    ) -> None:
        """Run the unfinished ``calls`` of a wave: all of them, or with parts this part's share
        first, then what no live part holds, then wait for the rest."""
        todo = [call for call in calls if not finished(call)]
        if self.num_parts == 1:
            run_calls(self.executor, todo, wave, done, RERUN)
            return
        mine = [c for n, c in enumerate(todo) if n % self.num_parts == self.part]
        ordered = mine + [c for c in todo if c not in mine]
        with Claims(self.files.folder) as claims:
            while ordered:
                claimed = []
                for call in ordered:  # a few at a time, so that parts started since can share the rest
                    if len(claimed) == self.width:
                        break
                    if not finished(call) and claims.claim(f"{wave}-{call.key}"):
                        claimed.append(call)
                try:
                    run_calls(self.executor, claimed, wave, done, RERUN)
                finally:
                    for call in claimed:
                        claims.release(f"{wave}-{call.key}")
                ordered = [c for c in ordered if not finished(c)]
                if ordered and not claimed:
                    _LOG.info("waiting for %s that other parts run (%s)", counted(len(ordered), "task"), wave)
                    time.sleep(WAIT_SECONDS)

    def scan(self) -> list[dict[str, Any]]:
        advance = self.bars.bar("scan", sum(c.end - c.start for c in self.chunks), "B")
        calls = [
            Call(chunk_name(c), f"chunk {c.number} ({self.job.table_files(c.table)[c.file]}, bytes {c.start}-{c.end})",
                 scan_task, (self.job, c), {"progress": advance} if self.live else {})
            for c in self.chunks
        ]  # fmt: skip

        def done(call: Call, record: dict[str, Any]) -> None:
            if not self.live:
                advance(record.get("bytes", 0))

        self._run(SCAN, calls, lambda call: self.files.done(SCAN, call.key) is not None, done)
        return [self._record(SCAN, chunk_name(c)) for c in self.chunks]

    def buckets(self) -> list[dict[str, Any]]:
        advance = self.bars.bar("buckets", self.job.buckets, "bucket")
        calls = [
            Call(bucket_name(b), f"bucket {b}", bucket_task, (self.job, b, self.chunks),
                 {"progress": advance} if self.live else {})
            for b in range(self.job.buckets)
        ]  # fmt: skip

        def done(call: Call, record: dict[str, Any]) -> None:
            if not self.live:
                advance(1)

        self._run(BUCKETS, calls, lambda call: self.files.done(BUCKETS, call.key) is not None, done)
        return [self._record(BUCKETS, bucket_name(b)) for b in range(self.job.buckets)]

    def write(self, shards: Sequence[ShardTask], orders: list[GroupOrder], dim: int) -> None:
        """Write the unfinished ``shards``."""
        names = [s.group for s in shards]
        groups = [g.name for g in self.job.options.groups] or [""]
        tasks: list[WriteTask] = []
        spread = self.width * self.num_parts  # several tasks a worker, so that none waits for one long one
        per_task = self.shards_per_task
        if spread > 1:
            per_task = max(1, min(per_task, -(-len(shards) // (4 * spread))))
        for number, group in enumerate(groups):
            mine = [s for s, name in zip(shards, names) if name == group]
            tasks += write_tasks(orders[number], number, mine, self.job.options.utts_per_file, per_task)
        if not tasks:
            return
        workers = f" ({self.width} workers)" if self.width > 1 else ""
        advance = self.bars.bar(f"pack{workers}", sum(s.num_planned for s in shards), "utt")
        calls = [
            Call(f"w{task.shards[0].ordinal}", task.name, write_task, (self.job, task, dim, self.chunks),
                 {"progress": advance} if self.live else {})
            for task in tasks
        ]  # fmt: skip
        by_key = {call.key: task for call, task in zip(calls, tasks)}

        def finished(call: Call) -> bool:
            records = finished_shards(self.job.d_out)
            return all(_relative(s) in records for s in by_key[call.key].shards)

        def done(call: Call, record: dict[str, Any]) -> None:
            self.resumed += record.get("resumed", 0)
            self.written += by_key[call.key].shards
            if not self.live:
                advance(record.get("utts", 0))

        self._run("write", calls, finished if self.num_parts > 1 else lambda call: False, done)

    def _record(self, wave: str, name: str) -> dict[str, Any]:
        record = self.files.done(wave, name)
        if record is None:
            raise SeqshardError(f"the {wave} task {name} ended without its record; {RERUN}")
        return record


def executor_width(executor: Any) -> int:
    """How many tasks ``executor`` runs at once, as far as it says (1 in this process; a pool's
    workers; 8 for a cluster that does not say)."""
    if getattr(executor, "live_progress", False):
        return 1
    return int(getattr(executor, "_max_workers", 0) or 8)


def _relative(task: ShardTask) -> str:
    return f"{task.group}/{task.path.name}" if task.group else task.path.name


def totals_of(scans: Sequence[dict[str, Any]], buckets: Sequence[dict[str, Any]], chunks: Sequence[Chunk]) -> Totals:
    """What the waves counted (``input_utts``: every line of the utterance tables)."""
    totals = Totals()
    for chunk, record in zip(chunks, scans):
        if chunk.table == "utts":
            totals.input_utts += record["lines"]
        if chunk.table == "labels" or (chunk.table == "utts" and "labels" in record["rows"]):
            totals.num_labels += record["lines"]  # a source's own lines are its labels' lines too
        totals.add(record["counts"])
        totals.first_empty = totals.first_empty or record.get("first_empty", "")
    for record in buckets:
        totals.add(record["counts"])
    return totals
