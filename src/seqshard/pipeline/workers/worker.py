"""What each reader runs: its pipeline, from shards to collated batches.

A :class:`ReaderRun` is one reader's part of one iteration: its pipeline, built for the
requested epoch and restored to the requested state (or, for a stream that goes on across
epochs, kept alive from the last one), and its batches as items. Each batch leaves as a
:class:`~.protocol.BatchItem` carrying the reader's number, the batch's sequence number, and
the pipeline's state right after it: the training process keeps the state of the last batch
it handed out, which is all it needs to resume. After an item is handed out, the run lets the
pipeline read ahead (``Stage.prepare``), so that no batch waits for a whole window; in a worker
process it also reads further ahead for half the time it last waited for the consumer
(``Stage.read_further``), so that the next window is read long before the current one runs out,
and once its reading is done, a persistent worker reads the next epoch's first window so (its
pipeline kept in ``runtime.live`` for that epoch's run). The objects alive when a worker
process starts serving are frozen out of the garbage collector's scans (``process._settle``).

Without worker processes, :func:`iterate_worker` runs reader 0 in the training process; with
them, each worker process runs its reader's runs (``process.py``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import SeqshardError
from ...formats.remote.access import RemoteAccess
from ..epoch_plan import Unit
from ..stages.base import Stage, State
from ..stages.batching import Batch
from ..stages.collate import Collator, aligned, array_bytes
from ..stages.mixing import per_source_counts
from ..stages.passes import Passes
from ..stages.reader import DAMAGED
from ..transport.slots import ALIGN
from ..transport.wire import BatchItem, EndItem, ErrorItem, Item, pack
from .recipe import Carry, Reader, default_recipe
from .replay import attach as attach_replay
from .runtime import WorkerRuntime
from .setup import WorkerSetup

WAITS_KEPT = 4  # a run reads ahead for half the shortest of its last waits for the consumer (not one long pause)


def build_pipeline(
    setup: WorkerSetup,
    worker: int,
    epoch: int,
    access: RemoteAccess | None = None,
    units: list[Unit] | None = None,
    carry: Carry | None = None,
    read_ahead: bool = True,
    reader: type[Reader] = Reader,
    replay: bool = False,
) -> Stage:
    """The pipeline of one reader for ``epoch``: the loader's recipe over its source (its units
    of the epoch, or a mix; see ``recipe.Reader.read``). With ``uneven="repeat"`` and one source,
    an endless stream of passes of the whole recipe instead, pass ``p`` over plan ``p``: no
    window, hence no batch, spans two passes (a reader holding less than a window still never
    batches an utterance twice). ``units`` and ``carry`` replace what the reader reads (an
    elastic resume); ``read_ahead=False`` reads only what the stages ask for; ``reader`` is the
    :class:`Reader` class the recipe gets (``planned.PlannedReader`` plans without reading);
    ``replay``: its windows are saved with what they hold and restored without reading them
    again, where they can be (``replay.py``)."""
    recipe = setup.options.pipeline.recipe or default_recipe

    def made(number: int, planned: list[Unit] | None, carried: Carry | None, before: int = 0) -> Stage:
        pipeline = recipe(reader(setup, worker, number, access, planned, carried, read_ahead, before))
        if replay:
            attach_replay(pipeline, lambda: recipe(reader(setup, worker, number, access, [], None, False, before)))
        return pipeline

    if setup.options.epochs.continues_stream:  # endless streams: seeds come from passes, not epoch labels
        if setup.mix is not None:
            return made(0, None, carry)
        first, carried = (carry or {}).get(0, (0, None))

        def one_pass(number: int) -> Stage:
            planned = carried if carried is not None and number == first else None
            before = passes.finished.get("batches", 0)  # bucket_sync's draws go on across passes
            return made(number, planned, None, before)

        passes = Passes(one_pass, first)
        return passes
    return made(epoch, units, None)


@dataclass
class Made:
    """A batch made by a reader's pipeline, with the pipeline's state and counters right after
    it (packed in a worker process) and the seconds it took."""

    batch: Batch
    state: State | bytes
    stats: dict[str, int] | bytes
    busy: float
    damaged: int


class ReaderRun:
    """One reader's part of one iteration (see the module docstring). ``spec`` is the
    reader's entry of the request: where it starts (``state``, ``seq``) and, after an elastic
    resume, the units it reads (``units``, ``carry``)."""

    def __init__(
        self,
        setup: WorkerSetup,
        runtime: WorkerRuntime,
        worker: int,
        epoch: int,
        spec: dict[str, Any],
        in_worker_process: bool = False,
    ):
        self.setup = setup
        self.runtime = runtime
        self.worker = worker
        self.epoch = epoch
        self.spec = spec
        self.in_worker_process = in_worker_process
        self.seq = spec["seq"]
        self.collator = setup.collator()
        units = None if spec.get("units") is None else [Unit.from_json(u) for u in spec["units"]]
        self.continuing = units is None and setup.options.epochs.continues_stream
        self.error: SeqshardError | None = None
        self.ended = False
        self.pipeline: Stage | None = None
        # seconds of spare time between batches: from a prepare() to the next make(), and what
        # that prepare spent reading further (spare time too)
        self._waits: deque[float] = deque(maxlen=WAITS_KEPT)
        self._prepared_at: float | None = None
        self._further = 0.0
        options = setup.options
        # whether the next epoch's first window is read (a persistent worker reads it in spare time)
        self._next_read = not (in_worker_process and options.workers.persistent_workers) or self.continuing
        try:
            pipeline = runtime.live.take(worker, spec["state"]) if self.continuing else None
            read = runtime.live.take_next(worker, epoch) if in_worker_process else None
            if pipeline is None and spec["state"] is None and units is None and spec.get("carry") is None:
                pipeline = read
            if pipeline is None:
                pipeline = build_pipeline(
                    setup, worker, epoch, runtime.access, units, carry_from_json(spec.get("carry")), replay=True
                )
                pipeline.reset(spec["state"])
            self.pipeline = pipeline
        except SeqshardError as error:
            self._stop(error)

    def make(self) -> Made | ErrorItem | EndItem:
        """The next batch, or the end (or error) item once there is none."""
        if self.error is not None or self.ended:
            return self._last()
        started = time.perf_counter()
        if self._prepared_at is not None:
            self._waits.append(started - self._prepared_at + self._further)
        try:
            batch = self.pipeline.next()  # type: ignore[union-attr]
        except StopIteration:
            self.ended = True
            return self._last()
        except SeqshardError as error:
            self._stop(error)
            return self._last()
        state, stats = self.pipeline.get_state(), self.pipeline.stats()  # type: ignore[union-attr]
        if self.continuing:
            self.runtime.live.keep(self.worker, state, self.pipeline)  # type: ignore[arg-type]
        damaged = sum(1 for name, count in stats.items() if count and name.startswith(DAMAGED))
        if self.in_worker_process:
            state, stats = pack(state), pack(stats)
        return Made(batch, state, stats, time.perf_counter() - started, damaged)

    def item(self, made: Made, iteration: int) -> BatchItem:
        """``made`` collated (into a slot when one is free) as the next item of this run."""
        started = time.perf_counter()
        batch = made.batch
        arrays, slot, places, state = _collate(
            batch, self.collator, self.runtime, self.worker, iteration, self.in_worker_process, made.state
        )
        self.seq += 1
        mix = self.setup.mix
        return BatchItem(
            self.worker,
            self.seq,
            arrays,
            state,
            made.stats,
            len(batch),
            sum(batch.lengths),
            batch.longest * len(batch),
            slot,
            places,
            per_source_counts(batch.samples, batch.lengths, len(mix.names)) if mix else None,
            made.busy + time.perf_counter() - started,
            made.damaged,
        )

    def prepare(self) -> None:
        """Let the pipeline read ahead, now that a batch is handed out: its share of the next
        windows, and in a worker process more for half the spare time the run had between its
        last batches (the shortest: the step's time less the reader's own, so the queue of
        batches stays full; what it read further counts as spare, or the half would shrink)."""
        if self.pipeline is not None and self.error is None and not self.ended:
            try:
                self.pipeline.prepare()
                if self.in_worker_process and len(self._waits) == WAITS_KEPT:
                    started = time.perf_counter()
                    until = started + min(self._waits) / 2
                    self.pipeline.read_further(until)
                    if not self._next_read and self.pipeline.reading_done():
                        self._next_read = self._read_next_epoch(until)
                    self._further = time.perf_counter() - started
            except SeqshardError as error:
                self._stop(error)
        self._prepared_at = time.perf_counter()

    def _read_next_epoch(self, until: float) -> bool:
        """Read the next epoch's first window until ``until``, its pipeline kept for that epoch's
        run from its beginning; True once it is read (or cannot be: that run meets the error)."""
        live = self.runtime.live
        try:
            pipeline = live.take_next(self.worker, self.epoch + 1)
            if pipeline is None:
                pipeline = build_pipeline(self.setup, self.worker, self.epoch + 1, self.runtime.access, replay=True)
                pipeline.reset(None)
            read = pipeline.read_further(until)
        except Exception:  # bad data or a user's transform, met again by the next epoch's own run
            return True
        live.keep_next(self.worker, self.epoch + 1, pipeline)
        return read

    def reading_done(self) -> bool:
        """Whether the pipeline has read all it will read this iteration and, in a persistent
        worker, the next epoch's first window was read in spare time (what the worker makes
        ahead of that epoch then costs no more than a batch of the current one)."""
        if self.pipeline is None or self.error is not None or self.ended:
            return True
        return self.pipeline.reading_done() and self._next_read

    def _stop(self, error: SeqshardError) -> None:
        if not self.in_worker_process:
            raise error
        self.error = error

    def _last(self) -> ErrorItem | EndItem:
        if self.error is not None:
            # sent as an item, so that the training process raises this error itself
            return ErrorItem(self.worker, self.seq, self.error)
        state, stats = self.pipeline.get_state(), self.pipeline.stats()  # type: ignore[union-attr]
        if self.in_worker_process:
            state, stats = pack(state), pack(stats)
        return EndItem(self.worker, self.seq, state, stats)


def iterate_worker(
    setup: WorkerSetup, runtime: WorkerRuntime, worker: int, epoch: int, iteration: int, spec: dict[str, Any]
) -> Iterator[Item]:
    """Reader ``worker``'s items in this process: batches, then an end marker (errors raise)."""
    run = ReaderRun(setup, runtime, worker, epoch, spec)
    while True:
        made = run.make()
        if not isinstance(made, Made):
            yield made
            return
        yield run.item(made, iteration)
        run.prepare()


def carry_to_json(carry: Carry | None) -> list | None:
    return (
        None
        if carry is None
        else [[source, first, [u.to_json() for u in units]] for source, (first, units) in carry.items()]
    )


def carry_from_json(data: list | None) -> Carry | None:
    if data is None:
        return None
    return {int(source): (int(first), [Unit.from_json(u) for u in units]) for source, first, units in data}


def _collate(
    batch: Batch,
    collator: Collator,
    runtime: WorkerRuntime,
    worker: int,
    iteration: int,
    in_worker_process: bool,
    state: State | bytes,
) -> tuple[dict[str, Any], int | None, tuple[str, ...], State | bytes | tuple[int, int]]:
    """The batch's arrays, the slot holding them, their names there and the state: they are
    collated into a slot when one is free and large enough (sent as places in it; a packed
    state goes there too, as its place: it holds what the windows hold, tens of kB), else into
    new arrays (in a worker process torch tensors, which travel through shared memory of their
    own). Without worker processes slots still pay: their pages are reused, not faulted in anew."""
    columns = collator.layout(batch)
    packed = len(state) if isinstance(state, bytes) else 0
    needed = array_bytes(columns, ALIGN) + aligned(packed, ALIGN)
    arena = runtime.slots.acquire(worker, needed, iteration) if runtime.slots else None
    if arena is None:
        arrays = collator.fill(batch, columns)
        if not in_worker_process:
            return arrays, None, (), state
        import torch

        tensors = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in arrays.items()}
        return tensors, None, (), state
    arrays = collator.fill(batch, columns, arena.allocate)
    places = tuple(k for k, v in arrays.items() if isinstance(v, np.ndarray))
    described = {k: arena.describe(v) if isinstance(v, np.ndarray) else v for k, v in arrays.items()}
    return described, arena.slot, places, arena.put(state) if packed else state
