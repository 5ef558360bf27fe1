"""Writing planned shards: a write task's shards in one forward pass over their utterances.

A sweep keeps its shards (at most ``max_open``) open and reads their utterances in input order
(so the arks are read front to back), appending each to its shard. Reads are forward-only;
writes go to many files, each written sequentially. A shard is committed (fsync,
renamed to its final name, journaled) as soon as its last planned utterance is handled; one
whose utterances were all dropped while writing is journaled as empty and never gets a file.

Every shard of a sweep receives utterances from the whole scp, so its shards finish together at
its end. So that a killed run does not lose the sweep, its open shards are checkpointed every
``CHECKPOINT_SHARE`` of it (at most every ``CHECKPOINT_SECONDS``): each partial file is
fsync'd and its state recorded (``journal.save_partial``), and a rerun continues each from
there (:class:`Resume`).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError, ShardError, SkipCounter
from ..formats.files import writing
from ..formats.index_entries import length_bin
from ..formats.tar import ShardWriter, WrittenPart, temporary_path
from .inputs import LABEL_MEMBER
from .job import PackJob, ShardTask
from .journal import Journal, forget_partial, partial_states, save_partial
from .rows import TableLines

_LOG = logging.getLogger("seqshard")
DEFAULT_MAX_OPEN = 256
CHECKPOINT_SHARE = 0.02  # of a sweep's utterances handled between checkpoints of its open shards
CHECKPOINT_SECONDS = 0.5  # and at least this long between them


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
    already: int = 0  # planned utterances still to pass over: the partial file holds them
    recorded: bool = False  # a checkpoint of it is on disk: its partial file is kept for a rerun

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

    def state(self) -> dict[str, Any]:
        """How far the shard got, for a rerun to continue it (:meth:`resume`)."""
        written = self.writer.written()
        return {
            "group": self.task.group,
            "name": self.task.path.name,
            "handled": self.task.num_planned - self.remaining,
            "bytes": written.size,
            "crc32": written.crc32,
            "samples": written.samples,
            "lengths": base64.b64encode(written.lengths).decode("ascii"),  # int64 each, for the member table
            "num_frames": self.num_frames,
            "min_frames": self.min_frames,
            "max_frames": self.max_frames,
            "length_hist": {str(k): v for k, v in self.length_hist.items()},
            "audio_stored": dict(self.audio_stored),
            "skipped": dict(self.skipped),
            "members": list(self.members),
            "first_key": self.first_key,
            "last_key": self.last_key,
        }

    @classmethod
    def resume(cls, task: ShardTask, root: Path, state: dict[str, Any]) -> _OpenShard:
        """The shard as a checkpoint left it (ShardError when its partial file disagrees)."""
        lengths = base64.b64decode(state["lengths"], validate=True)
        if len(lengths) != 8 * state["samples"]:
            raise ValueError(f"{len(lengths) // 8} lengths for {state['samples']} samples")
        writer = ShardWriter(task.path, root, WrittenPart(state["bytes"], state["crc32"], state["samples"], lengths))
        return cls(
            task,
            writer,
            task.num_planned - state["handled"],
            state["num_frames"],
            state["min_frames"],
            state["max_frames"],
            {int(k): v for k, v in state["length_hist"].items()},
            dict(state["audio_stored"]),
            dict(state["skipped"]),
            dict.fromkeys(state["members"]),
            state["first_key"],
            state["last_key"],
            already=state["handled"],
            recorded=True,
        )

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


class Resume:
    """Where a rerun continues: the recorded states of the shards it writes (see
    ``journal.partial_states``), each trusted only while its partial file holds what it
    recorded; made in the parent before any job starts. Partial files without a usable state,
    and states of shards finished since, are removed."""

    def __init__(self, d_out: Path, tasks: Sequence[ShardTask], done: Collection[int]):
        self.d_out = Path(d_out)
        states = partial_states(d_out)
        self.states: dict[int, dict[str, Any]] = {}
        for task in tasks:
            state = states.pop(task.ordinal, None)
            partial = temporary_path(task.path)
            if _matches(state, task) and partial.is_file() and partial.stat().st_size >= state["bytes"]:  # type: ignore[index]
                self.states[task.ordinal] = state  # type: ignore[assignment]
            else:
                partial.unlink(missing_ok=True)
                forget_partial(d_out, task.ordinal)
        for ordinal in states:
            if ordinal in done:
                forget_partial(d_out, ordinal)

    @property
    def utterances(self) -> int:
        """Utterances the recorded states hold (already handled)."""
        return sum(state["handled"] for state in self.states.values())

    def open(self, task: ShardTask) -> _OpenShard:
        """The shard, continued from its state when it has one that its partial file holds."""
        state = self.states.pop(task.ordinal, None)
        if state is not None:
            try:
                return _OpenShard.resume(task, self.d_out, state)
            except (ShardError, KeyError, TypeError, ValueError, AttributeError) as error:
                _LOG.warning("%s: starting the shard over (its checkpoint does not fit: %s)", task.path, error)
        forget_partial(self.d_out, task.ordinal)
        return _OpenShard(task, ShardWriter(task.path, self.d_out), task.num_planned)


def _matches(state: dict[str, Any] | None, task: ShardTask) -> bool:
    return (
        isinstance(state, dict)
        and state.get("group") == task.group
        and state.get("name") == task.path.name
        and isinstance(state.get("bytes"), int)
        and 0 <= state.get("handled", -1) <= task.num_planned
    )


def write_shards(
    planned: ShardRows,
    tasks: Sequence[ShardTask],
    job: PackJob,
    dim: int,
    journal: Journal,
    advance: Callable[[int], None],
    resume: Resume | None = None,
) -> None:
    """Write ``tasks`` (shards of ``planned`` rows) in one sweep, continuing those that
    ``resume`` holds states of."""
    todo = sorted(tasks, key=lambda t: t.ordinal)
    resume = resume or Resume(journal.root, todo, ())
    _write_sweep(planned, todo, job, dim, journal, advance, resume)


class _Committer:
    """Commits finished shards on a background thread: fsync waits for the disk, and reading
    the next utterances should not wait with it. Journal lines follow their commits."""

    def __init__(self, journal: Journal, dim: int, dtype: str):
        self._journal = journal
        self._dim = dim
        self._dtype = dtype
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="seqshard-commit")
        self._checkpoints = ThreadPoolExecutor(max_workers=1, thread_name_prefix="seqshard-checkpoint")
        self._checkpoint: Future | None = None
        self._latest: list[tuple[int, dict[str, Any], Path]] | None = None  # the snapshot still to record
        self._draining = False
        self._slot = threading.Lock()  # guards the two above
        self.checkpointed: set[int] = set()  # ordinals of shards with a recorded state
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
        forget_partial(self._journal.root, shard.task.ordinal)

    def checkpoint(self, shards: Sequence[_OpenShard]) -> None:
        """Record how far ``shards`` got, on a thread of its own (the fsyncs wait for the
        disk, the reading does not): their state now replaces any snapshot still waiting, and
        the newest snapshot is always recorded."""
        snapshot = [(shard.task.ordinal, shard.state(), shard.writer.temp_path) for shard in shards]
        with self._slot:
            self._latest = snapshot
            if self._draining:
                return
            self._draining = True
        if self._checkpoint is not None:
            self._checkpoint.result()  # the previous drain ended: raise its failure, if any
        self._checkpoint = self._checkpoints.submit(self._drain)

    def _drain(self) -> None:
        while True:
            with self._slot:
                snapshot, self._latest = self._latest, None
                if snapshot is None:
                    self._draining = False
                    return
            self._save_states(snapshot)

    def _save_states(self, taken: list[tuple[int, dict[str, Any], Path]]) -> None:
        for ordinal, state, partial in taken:
            try:
                descriptor = os.open(partial, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # finished (renamed) since: nothing to continue
            try:
                with writing(partial):
                    os.fsync(descriptor)  # the bytes the state counts are on disk before the state is
            finally:
                os.close(descriptor)
            save_partial(self._journal.root, ordinal, state)
            self.checkpointed.add(ordinal)

    def finish(self) -> None:
        """Wait for every commit and checkpoint; raise the first failure."""
        self._checkpoints.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        for future in [*self._pending, *filter(None, [self._checkpoint])]:
            future.result()


def _write_sweep(
    planned: ShardRows,
    sweep: Sequence[ShardTask],
    job: PackJob,
    dim: int,
    journal: Journal,
    advance: Callable[[int], None],
    resume: Resume,
) -> None:
    options = job.options
    by_ordinal = {task.ordinal: task for task in sweep}
    skip = SkipCounter(options.skip_bad)
    open_shards: dict[int, _OpenShard] = {}
    committer = _Committer(journal, dim, options.dtype)
    every = max(1, int(len(planned.rows) * CHECKPOINT_SHARE))
    since, last = 0, time.monotonic()
    speakers = job.speakers()
    try:
        with job.source.reader(dim) as reader, contextlib.closing(planned.lines) as lines:
            for row, ordinal in zip(planned.rows, planned.ordinals.tolist()):
                shard = open_shards.get(ordinal)
                if shard is None:
                    shard = open_shards[ordinal] = resume.open(by_ordinal[ordinal])
                if shard.already:  # held by the partial file a killed run left
                    shard.already -= 1
                    advance(1)
                    if not shard.already and not shard.remaining:  # it was whole: killed before its commit
                        committer.submit(open_shards.pop(ordinal))
                    continue
                utterance = lines.utterance(row)
                try:
                    members, length, stored = reader.read(utterance)
                    if speakers is not None:
                        members += speakers.members(lines.speaker(row, utterance.key), utterance.where, dim)
                except InputError as error:
                    skip(error)
                    shard.skipped[error.reason] = shard.skipped.get(error.reason, 0) + 1
                else:
                    if stored:
                        shard.audio_stored[stored] = shard.audio_stored.get(stored, 0) + 1
                    members.append((LABEL_MEMBER, [lines.label(row, utterance.key).encode("utf-8")]))
                    shard_key = options.shard_key(utterance.key)
                    shard.writer.add(shard_key, members, length)
                    shard.members.update(dict.fromkeys(name for name, _ in members))
                    shard.count(shard_key, length)
                shard.remaining -= 1
                if shard.remaining == 0:
                    committer.submit(open_shards.pop(ordinal))
                advance(1)
                since += 1
                if since >= every and time.monotonic() - last >= CHECKPOINT_SECONDS:
                    committer.checkpoint([s for s in open_shards.values() if not s.already])
                    since, last = 0, time.monotonic()
    finally:
        if speakers is not None:
            speakers.close()
        try:
            committer.finish()
        finally:
            for shard in open_shards.values():  # a rerun continues a checkpointed partial file; the others go
                keep = shard.recorded or shard.task.ordinal in committer.checkpointed
                shard.writer.close() if keep else shard.writer.abort()


@dataclass
class ShardRows:
    """The planned rows of some shards in input order, the ordinal of each one's shard, and
    the tables to re-read their lines from."""

    rows: np.ndarray
    ordinals: np.ndarray
    lines: TableLines
