"""Writing planned shards: one forward pass over the scp per sweep of open shards.

A sweep keeps up to ``max_open`` shards open and reads, in scp order (so the arks are read
front to back), only the utterances planned for them, appending each to its shard. Reads are
forward-only; writes go to many files, each written sequentially. A shard is committed (fsync,
renamed to its final name, journaled) as soon as its last planned utterance is handled; one
whose utterances were all dropped while writing is journaled as empty and never gets a file.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ..errors import InputError, SkipCounter
from ..formats.files import writing
from ..formats.index import length_bin
from ..formats.tar import ShardWriter, temporary_path
from .journal import Journal
from .plan import PackOptions, PackPlan, ShardTask
from .sources import LABEL_MEMBER

DEFAULT_MAX_OPEN = 256


@dataclass
class _OpenShard:
    task: ShardTask
    writer: ShardWriter
    remaining: int
    num_frames: int = 0
    min_frames: int = 0  # 0 while the shard holds no utterance
    max_frames: int = 0
    length_hist: dict[int, int] = field(default_factory=dict)
    audio_stored: dict[str, int] = field(default_factory=dict)  # utterances by how their audio was stored
    skipped: dict[str, int] = field(default_factory=dict)
    members: dict[str, None] = field(default_factory=dict)  # member suffixes written, in first-seen order
    first_key: str = ""  # as written (escaped), what readers check the file against
    last_key: str = ""

    def count(self, key: str, frames: int) -> None:
        """Account for utterance ``key`` (as written) of ``frames`` frames just added to the shard."""
        first = self.max_frames == 0  # zero-length matrices are refused, so no utterance yet
        self.first_key = self.first_key or key
        self.last_key = key
        self.min_frames = frames if first else min(self.min_frames, frames)
        self.max_frames = max(self.max_frames, frames)
        self.num_frames += frames
        bin_ = length_bin(frames)
        self.length_hist[bin_] = self.length_hist.get(bin_, 0) + 1

    def record(self, dim: int, dtype: str) -> dict:
        return {
            "group": self.task.group,
            "name": self.task.path.name,
            "num_utts": self.writer.num_samples,
            "num_frames": self.num_frames,
            "min_frames": self.min_frames,
            "max_frames": self.max_frames,
            "bytes": self.writer.size,
            "checksum": f"crc32:{self.writer.crc32:08x}",
            "length_hist": {str(k): v for k, v in sorted(self.length_hist.items())},
            "dim": dim,
            "dtype": dtype,
            "skipped": self.skipped,
            "members": list(self.members),
            **({"first_key": self.first_key, "last_key": self.last_key} if self.first_key else {}),
        }


def remove_partials(tasks: Sequence[ShardTask]) -> None:
    """Delete what a killed run left of these shards (hidden ``.NAME.partial`` files)."""
    for task in tasks:
        temporary_path(task.path).unlink(missing_ok=True)


def write_shards(
    plan: PackPlan,
    tasks: Sequence[ShardTask],
    options: PackOptions,
    dim: int,
    journal: Journal,
    advance: Callable[[int], None],
    max_open: int = DEFAULT_MAX_OPEN,
) -> None:
    """Write ``tasks`` (shards of ``plan``), ``max_open`` at a time."""
    todo = sorted(tasks, key=lambda t: t.ordinal)
    for start in range(0, len(todo), max_open):
        _write_sweep(plan, todo[start : start + max_open], options, dim, journal, advance)


class _Committer:
    """Commits finished shards on a background thread: fsync waits for the disk, and reading
    the next utterances should not wait with it. Journal lines follow their commits."""

    def __init__(self, journal: Journal, dim: int, dtype: str):
        self._journal = journal
        self._dim = dim
        self._dtype = dtype
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="seqshard-commit")
        self._lock = threading.Lock()
        self._pending: list[Future] = []

    def submit(self, shard: _OpenShard) -> None:
        for future in self._pending:
            if future.done():
                future.result()  # a failed commit stops the pack now
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._pool.submit(self._commit, shard))

    def _commit(self, shard: _OpenShard) -> None:
        if shard.writer.num_samples:
            shard.writer.commit()
        else:  # every planned utterance was dropped: an empty shard never gets its final name
            shard.writer.abort()
            with writing(shard.task.path):
                shard.task.path.unlink(missing_ok=True)  # nor keeps an earlier run's file
        record = shard.record(self._dim, self._dtype)
        if shard.audio_stored:
            record["audio_stored"] = dict(sorted(shard.audio_stored.items()))
        with self._lock:
            self._journal.append(record)

    def finish(self) -> None:
        """Wait for every commit; raise the first failure."""
        self._pool.shutdown(wait=True)
        for future in self._pending:
            future.result()


def _write_sweep(
    plan: PackPlan,
    sweep: Sequence[ShardTask],
    options: PackOptions,
    dim: int,
    journal: Journal,
    advance: Callable[[int], None],
) -> None:
    by_ordinal = {task.ordinal: task for task in sweep}
    rows = np.flatnonzero(np.isin(plan.shard_of_row, np.fromiter(by_ordinal, dtype=np.int64)))
    skip = SkipCounter(options.skip_bad)
    open_shards: dict[int, _OpenShard] = {}
    committer = _Committer(journal, dim, options.dtype)
    try:
        with plan.source.reader(plan, dim) as reader:
            for row in rows:
                ordinal = int(plan.shard_of_row[row])
                shard = open_shards.get(ordinal)
                if shard is None:
                    task = by_ordinal[ordinal]
                    shard = open_shards[ordinal] = _OpenShard(task, ShardWriter(task.path), task.num_planned)
                key, value = plan.scp.record(int(row))
                where = plan.scp.where(int(row), key)
                try:
                    members, length, stored = reader.read(int(row), key, value, where)
                    if plan.speakers is not None:
                        members += plan.speakers.members(key, where, dim)
                except InputError as error:
                    skip(error)
                    shard.skipped[error.reason] = shard.skipped.get(error.reason, 0) + 1
                else:
                    if stored:
                        shard.audio_stored[stored] = shard.audio_stored.get(stored, 0) + 1
                    members.append((LABEL_MEMBER, [_label(plan, int(row), key).encode("utf-8")]))
                    shard_key = options.shard_key(key)
                    shard.writer.add(shard_key, members, length)
                    shard.members.update(dict.fromkeys(name for name, _ in members))
                    shard.count(shard_key, length)
                shard.remaining -= 1
                if shard.remaining == 0:
                    committer.submit(open_shards.pop(ordinal))
                advance(1)
    finally:
        for shard in open_shards.values():
            shard.writer.abort()
        committer.finish()


def _label(plan: PackPlan, row: int, key: str) -> str:
    label_key, label = plan.labels.record(int(plan.label_rows[row]))
    if label_key != key:
        raise RuntimeError(f"64-bit key hash collision between {key!r} and {label_key!r}; please report this.")
    return label
