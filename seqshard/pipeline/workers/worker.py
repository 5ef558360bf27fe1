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
from ...formats.remote import RemoteAccess
from ..plan import Unit
from ..stages.base import Stage
from ..stages.batching import Batch, bucket_of
from ..stages.collate import Collator, array_bytes
from ..stages.mixing import per_source_counts
from ..stages.passes import Passes
from .protocol import BatchItem, EndItem, ErrorItem, Item
from .recipe import Carry, Reader, default_recipe
from .runtime import WorkerRuntime
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
    setup: WorkerSetup,
    worker: int,
    epoch: int,
    access: RemoteAccess | None = None,
    units: list[Unit] | None = None,
    carry: Carry | None = None,
    read_ahead: bool = True,
    reader: type[Reader] = Reader,
) -> Stage:
    """The pipeline of one reader for ``epoch``: the loader's recipe over its source (its units
    of the epoch, or a mix; see ``recipe.Reader.read``). With ``uneven="repeat"`` and one source,
    an endless stream of passes of the whole recipe instead, pass ``p`` over plan ``p``: no
    window, hence no batch, spans two passes (a reader holding less than a window still never
    batches an utterance twice). ``units`` and ``carry`` replace what the reader reads (an
    elastic resume); ``read_ahead=False`` reads only what the stages ask for; ``reader`` is the
    :class:`Reader` class the recipe gets (``planned.PlannedReader`` plans without reading)."""
    recipe = setup.options.pipeline.recipe or default_recipe
    if setup.options.epochs.continues_stream:  # endless streams: seeds come from passes, not epoch labels
        if setup.mix is not None:
            return recipe(reader(setup, worker, 0, access, None, carry, read_ahead))
        first, carried = (carry or {}).get(0, (0, None))

        def one_pass(number: int) -> Stage:
            planned = carried if carried is not None and number == first else None
            return recipe(reader(setup, worker, number, access, planned, None, read_ahead))

        return Passes(one_pass, first)
    return recipe(reader(setup, worker, epoch, access, units, None, read_ahead))


def iterate_worker(
    setup: WorkerSetup, runtime: WorkerRuntime, worker: int, request: dict[str, Any], in_worker_process: bool = False
) -> Iterator[Item]:
    """Items for the training process: batches, then an end marker (or an error)."""
    spec = request["workers"][worker]
    units = None if spec.get("units") is None else [Unit.from_json(u) for u in spec["units"]]
    carry = carry_from_json(spec.get("carry"))
    seq = spec["seq"]
    collator = setup.collator()
    continuing = units is None and setup.options.epochs.continues_stream
    try:
        pipeline = runtime.live.take(worker, spec["state"]) if continuing else None
        if pipeline is None:
            pipeline = build_pipeline(setup, worker, request["epoch"], runtime.access, units, carry)
            pipeline.reset(spec["state"])
        while True:
            try:
                batch = pipeline.next()
            except StopIteration:
                break
            seq += 1
            arrays, slot = _collate(batch, collator, runtime, worker, request["iteration"], in_worker_process)
            state = pipeline.get_state()
            if continuing:
                runtime.live.keep(worker, state, pipeline)
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
    batch: Batch, collator: Collator, runtime: WorkerRuntime, worker: int, iteration: int, in_worker_process: bool
) -> tuple[dict[str, Any], int | None]:
    """The batch's arrays and the slot holding them: they are collated into a slot when one
    is free and large enough (sent as places in it), else into new arrays (in a worker
    process torch tensors, which the DataLoader moves through shared memory of their own).
    Without worker processes slots still pay: their pages are reused, not faulted in anew."""
    columns = collator.layout(batch)
    arena = runtime.slots.acquire(worker, array_bytes(columns, ALIGN), iteration) if runtime.slots else None
    if arena is None:
        arrays = collator.fill(batch, columns)
        if not in_worker_process:
            return arrays, None
        import torch

        return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in arrays.items()}, None
    arrays = collator.fill(batch, columns, arena.allocate)
    return {k: arena.describe(v) if isinstance(v, np.ndarray) else v for k, v in arrays.items()}, arena.slot
