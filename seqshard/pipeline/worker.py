"""What runs in each DataLoader worker: its reader pipeline, from shards to padded batches.

Each batch leaves the worker as an item carrying the worker's number, the batch's sequence
number, and the pipeline's state right after it: the training process keeps the state of the
last batch it handed out, which is all it needs to resume. The worker learns where to start
(epoch, state) from an :class:`IterationChannel`, shared memory the training process writes
before each ``iter()`` (it also reaches workers that persist across epochs).
"""

from __future__ import annotations

import json
import multiprocessing as mp
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ..errors import ConfigError, SeqshardError, SkipCounter
from ..formats.index import bin_bounds, histogram_percentile
from .base import Map, Stage
from .batching import SortBatch, bucket_of
from .collate import collate_arrays, padded_shape
from .config import LoaderConfig
from .decode import Decoder
from .filters import LengthFilter
from .labels import Labeler, LabelOverride, Labels, Tokenizer
from .passes import Passes
from .shards import ShardTable, Unit, plan_epoch
from .shuffle import WindowShuffle
from .transfer import BatchSlots

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


@dataclass
class WorkerSetup:
    """Everything a worker needs to build its pipeline (pickled to spawned workers)."""

    table: ShardTable
    config: LoaderConfig
    rank: int
    world_size: int
    tokenizer: Tokenizer | None
    override: LabelOverride | None
    bucket_bounds: tuple[int, ...]
    slots: BatchSlots | None = None

    @property
    def readers_per_rank(self) -> int:
        return max(1, self.config.num_workers)

    def units(self, plan_epoch_number: int, worker: int) -> list[Unit]:
        config = self.config
        return _cached_plan(
            self.table,
            plan_epoch_number,
            config.seed,
            self.world_size,
            self.readers_per_rank,
            config.shuffle,
            config.split_shards,
        )[self.rank][worker]


@lru_cache(maxsize=2)
def _cached_plan(
    table: ShardTable, epoch: int, seed: int, world_size: int, workers: int, shuffle: bool, split_shards: bool
):
    return plan_epoch(table, epoch, seed, world_size, workers, shuffle, split_shards)


def bucket_bounds(table: ShardTable, count: int) -> tuple[int, ...]:
    """Frame counts cutting the dataset's lengths into ``count`` buckets of equal mass."""
    histogram = dict(table.length_hist)
    if not histogram:
        raise ConfigError(
            "bucket_sync needs length histograms from the shards' index.json (run `seqshard index` on foreign shards)."
        )
    bounds = sorted({round(histogram_percentile(histogram, 100 * k / count)) for k in range(1, count)})
    return tuple(b for b in bounds if b > bin_bounds(min(histogram))[0])


def build_pipeline(
    setup: WorkerSetup, worker: int, epoch: int, units: list[Unit] | None = None, read_ahead: bool = True
) -> Stage:
    """The stages of one reader for ``epoch``; with ``uneven="repeat"`` an endless stream of
    passes instead, pass ``p`` being the pipeline of plan ``p`` (the epoch label does not
    matter: the stream goes on across epochs).

    ``units`` replaces the reader's planned units for this epoch (an elastic resume);
    ``read_ahead=False`` reads only what the stages ask for.
    """
    if setup.config.uneven == "repeat":
        return Passes(lambda number: reader_pipeline(setup, worker, number, setup.units(number, worker), read_ahead))
    planned = units if units is not None else setup.units(epoch, worker)
    return reader_pipeline(setup, worker, epoch, planned, read_ahead)


def reader_pipeline(
    setup: WorkerSetup, worker: int, epoch: int, units: list[Unit], read_ahead: bool = True
) -> SortBatch:
    """read ``units`` -> decode -> label -> filter -> shuffle -> sort/batch, seeded by
    (seed, epoch, rank, worker)."""
    from .reader import ShardReader

    config = setup.config
    skip = SkipCounter(True) if config.skip_bad else None
    stage: Stage = ShardReader(setup.table, units, config.interleave, skip, read_ahead)
    stage = Map(stage, Decoder(setup.table, config.feature_field), skip)
    if setup.tokenizer is not None or setup.override is not None or config.strip_spaces:
        stage = Labels(stage, Labeler(setup.tokenizer, setup.override, config.strip_spaces), skip)
    if config.limits().active:
        stage = LengthFilter(stage, config.limits())
    if config.shuffle:
        stage = WindowShuffle(stage, config.shuffle_window, config.seed, epoch, setup.rank, worker)
    return SortBatch(
        stage,
        config.sort_window,
        config.cost(),
        config.seed,
        epoch,
        setup.rank,
        worker,
        shuffle=config.shuffle,
        oversize=config.oversize,
    )


def iterate_worker(setup: WorkerSetup, worker: int, request: dict[str, Any], in_worker_process: bool = False):
    """Items for the training process: batches, then one end marker."""
    spec = request["workers"][worker]
    units = None if spec.get("units") is None else [Unit.from_json(u) for u in spec["units"]]
    seq = spec["seq"]
    try:
        pipeline = build_pipeline(setup, worker, request["epoch"], units)
        pipeline.reset(spec["state"])
        while True:
            try:
                batch = pipeline.next()
            except StopIteration:
                break
            seq += 1
            payload = _payload(batch, setup, worker, request["iteration"], in_worker_process)
            yield {
                "worker": worker,
                "seq": seq,
                "batch": payload,
                "frames": int(payload["feat_lens"].sum()),
                "padded": len(batch) * int(payload["feat_lens"].max()),
                "bucket": bucket_of(batch, setup.bucket_bounds),
                "state": pipeline.get_state(),
                "stats": pipeline.stats(),
            }
    except SeqshardError as error:
        if not in_worker_process:
            raise
        # sent as an item, so that the training process raises this error itself, not
        # torch's RuntimeError("Caught ... in DataLoader worker process") around its text
        yield {"worker": worker, "seq": seq, "batch": None, "error": error}
        return
    yield {
        "worker": worker,
        "seq": seq,
        "batch": None,
        "end": True,
        "state": pipeline.get_state(),
        "stats": pipeline.stats(),
    }


def _payload(batch, setup: WorkerSetup, worker: int, iteration: int, in_worker_process: bool) -> dict[str, Any]:
    """Padded arrays; in a worker process the features go into a shared slot when one fits,
    else into a torch tensor (which the DataLoader moves through shared memory)."""
    config = setup.config
    if not in_worker_process:
        return collate_arrays(batch, config.pad_label, config.dtype)
    shape = padded_shape(batch)
    taken = setup.slots.acquire(worker, shape[0] * shape[1] * shape[2], iteration) if setup.slots is not None else None
    if taken is None:
        import torch

        payload = collate_arrays(batch, config.pad_label, config.dtype)
        payload["feats"] = torch.from_numpy(payload["feats"])
        return payload
    slot, flat = taken
    payload = collate_arrays(batch, config.pad_label, config.dtype, flat.reshape(shape))
    payload["feats"] = ("slot", slot, shape)
    return payload
