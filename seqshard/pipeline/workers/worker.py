"""What runs in each DataLoader worker: its reader pipeline, from shards to collated batches.

Each batch leaves the worker as a :class:`~.protocol.BatchItem` carrying the worker's number,
the batch's sequence number, and the pipeline's state right after it: the training process
keeps the state of the last batch it handed out, which is all it needs to resume. The worker
learns where to start (epoch, state) from an :class:`IterationChannel`, shared memory the
training process writes before each ``iter()`` (it also reaches workers that persist across
epochs).
"""

from __future__ import annotations

import json
import multiprocessing as mp
from collections.abc import Iterator
from typing import Any

import numpy as np

from ...errors import ConfigError, SeqshardError
from ...formats import remote
from ..plan import Unit
from ..stages.base import Stage
from ..stages.batching import Batch, bucket_of
from ..stages.collate import Collator, array_bytes
from ..stages.mixing import Mix, per_source_counts, source_plan
from ..stages.passes import Passes
from ..stages.sample import Sample
from .protocol import BatchItem, EndItem, ErrorItem, Item
from .recipe import Reader, default_recipe
from .setup import WorkerSetup
from .transfer import ALIGN

CHANNEL_BYTES = 4 << 20


class IterationChannel:
    """Shared memory holding the JSON request of the current ``iter()``."""

    def __init__(self, context: Any = None, capacity: int = CHANNEL_BYTES):
        context = context or mp.get_context()
        self._length = context.Value("q", 0, lock=False)
        self._data = context.Array("c", capacity, lock=False)
        self._capacity = capacity

    def publish(self, request: dict[str, Any]) -> None:
        data = json.dumps(request).encode()
        if len(data) > self._capacity:
            raise ConfigError(
                f"the loader's per-iteration request is {len(data)} bytes, over {self._capacity}; please report this."
            )
        self._data[: len(data)] = data
        self._length.value = len(data)

    def read(self) -> dict[str, Any]:
        return json.loads(bytes(self._data[: self._length.value]))


def build_pipeline(
    setup: WorkerSetup, worker: int, epoch: int, units: list[Unit] | None = None, read_ahead: bool = True
) -> Stage:
    """The pipeline of one reader for ``epoch``: the loader's recipe over its planned units.

    With ``uneven="repeat"`` an endless stream of passes instead, pass ``p`` being the
    pipeline of plan ``p`` (the epoch label does not matter: the stream goes on across
    epochs). ``units`` replaces the reader's planned units for this epoch (an elastic
    resume); ``read_ahead=False`` reads only what the stages ask for.
    """
    if setup.mix is not None:
        return mixed_pipeline(setup, worker, read_ahead)
    recipe = setup.config.recipe or default_recipe
    if setup.config.uneven == "repeat":
        return Passes(lambda number: recipe(Reader(setup, worker, number, setup.units(number, worker), read_ahead)))
    planned = units if units is not None else setup.units(epoch, worker)
    return recipe(Reader(setup, worker, epoch, planned, read_ahead))


def mixed_pipeline(setup: WorkerSetup, worker: int, read_ahead: bool = True) -> Stage:
    """One reader's pipeline over a mix: per source, endless passes of read -> labels ->
    audio -> transforms -> length filter -> shuffle; then :class:`~.mixing.Mix`; then batching."""
    mix = setup.mix
    assert mix is not None

    def source_stream(source: int) -> Stage[Sample]:
        def one_pass(number: int) -> Stage[Sample]:
            plan = source_plan(setup.table, mix, source, number, setup.config, setup.world_size)
            reader = Reader(setup, worker, number, plan[setup.rank][worker], read_ahead, stream=source)
            return reader.shuffle(reader.filter_lengths(reader.transforms(reader.audio(reader.labels(reader.read())))))

        return Passes(one_pass)

    streams = [source_stream(source) for source in range(len(mix.names))]
    batcher = Reader(setup, worker, 0, [], read_ahead)
    return batcher.batch(Mix(streams, mix.shares, setup.config.seed, setup.rank, worker))


def iterate_worker(
    setup: WorkerSetup, worker: int, request: dict[str, Any], in_worker_process: bool = False
) -> Iterator[Item]:
    """Items for the training process: batches, then an end marker (or an error)."""
    remote.use(setup.remote)
    spec = request["workers"][worker]
    units = None if spec.get("units") is None else [Unit.from_json(u) for u in spec["units"]]
    seq = spec["seq"]
    collator = setup.collator()
    continuing = units is None and (setup.mix is not None or setup.config.uneven == "repeat")
    try:
        pipeline = setup.live.take(worker, spec["state"]) if continuing else None
        if pipeline is None:
            pipeline = build_pipeline(setup, worker, request["epoch"], units)
            pipeline.reset(spec["state"])
        while True:
            try:
                batch = pipeline.next()
            except StopIteration:
                break
            seq += 1
            arrays, slot = _collate(batch, collator, setup, worker, request["iteration"], in_worker_process)
            state = pipeline.get_state()
            if continuing:
                setup.live.keep(worker, state, pipeline)
            yield BatchItem(
                worker,
                seq,
                arrays,
                state,
                pipeline.stats(),
                len(batch),
                sum(batch.lengths),
                batch.longest * len(batch),
                bucket_of(batch, setup.bucket_bounds),
                slot,
                per_source_counts(batch.samples, batch.lengths, len(setup.mix.names)) if setup.mix else None,
            )
    except SeqshardError as error:
        if not in_worker_process:
            raise
        # sent as an item, so that the training process raises this error itself, not
        # torch's RuntimeError("Caught ... in DataLoader worker process") around its text
        yield ErrorItem(worker, seq, error)
        return
    yield EndItem(worker, seq, pipeline.get_state(), pipeline.stats())


def _collate(
    batch: Batch, collator: Collator, setup: WorkerSetup, worker: int, iteration: int, in_worker_process: bool
) -> tuple[dict[str, Any], int | None]:
    """The batch's arrays and the slot holding them: they are collated into a slot when one
    is free and large enough (sent as places in it), else into new arrays (in a worker
    process torch tensors, which the DataLoader moves through shared memory of their own).
    Without worker processes slots still pay: their pages are reused, not faulted in anew."""
    columns = collator.layout(batch)
    arena = setup.slots.acquire(worker, array_bytes(columns, ALIGN), iteration) if setup.slots else None
    if arena is None:
        arrays = collator.fill(batch, columns)
        if not in_worker_process:
            return arrays, None
        import torch

        return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in arrays.items()}, None
    arrays = collator.fill(batch, columns, arena.allocate)
    return {k: arena.describe(v) if isinstance(v, np.ndarray) else v for k, v in arrays.items()}, arena.slot
