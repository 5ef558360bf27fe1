"""A rank's batches known before reading (``loader.heaviest_batches``, ``loader.skip_batches``).

Each reader's planned pipeline (``planned.py``: the loader's recipe over keys and
lengths from member tables) gives the batches that reader will make and its state after each;
:class:`PlannedStream` takes them in the merged stream's turn (it is a
:class:`~.merge.MergedStream` whose workers are planned pipelines), so the rank's batches come in
the order the loader hands them out and its position moves as the loader's would. How an epoch
ends follows the loader's rules: with ``uneven="stop"`` at the step where the first rank runs
out (every rank's readers are planned), with ``"join"`` at this rank's end, and at
``epoch_steps`` when given.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..transport.wire import BatchItem, EndItem, Item
from ..workers.recipe import batch_cost
from ..workers.setup import WorkerSetup
from .merge import MergedStream, RankPosition
from .planned import NotPlannable, planned_pipeline, planned_setup


@dataclass(frozen=True)
class PlannedBatch:
    """A batch the loader will hand out: its ``step`` in the epoch (1 for the first),
    ``size`` (samples), ``longest`` length (its padded length), ``frames`` (its lengths summed),
    length ``bucket`` (of the loader's ``budgets``; 0 without) and
    ``cost`` (the loader's batch cost: padded length, or the quadratic cost with
    ``quadratic_frames``)."""

    step: int
    size: int
    longest: int
    frames: int
    bucket: int
    cost: float

    @property
    def padded(self) -> int:
        return self.size * self.longest


class PlannedStream(MergedStream):
    """The merged stream of a rank whose workers are planned pipelines restored from
    ``position`` (which it moves, as the loader's stream does)."""

    def __init__(self, setup: WorkerSetup, position: RankPosition):
        self._setup = setup
        self._pipelines: dict[int, tuple[Any, list[int]]] = {}  # worker -> (pipeline, [its last seq])
        super().__init__(self._planned_item, position)

    def _planned_item(self, worker: int) -> Item:
        if worker not in self._pipelines:
            pipeline = planned_pipeline(self._setup, worker, self.position.epoch)
            pipeline.reset(self.position.workers[worker].state)
            self._pipelines[worker] = (pipeline, [self.position.workers[worker].low])
        pipeline, seq = self._pipelines[worker]
        try:
            batch = pipeline.next()
        except StopIteration:
            return EndItem(worker, seq[0], pipeline.get_state(), pipeline.stats())
        seq[0] += 1
        return BatchItem(
            worker,
            seq[0],
            {},
            pipeline.get_state(),
            pipeline.stats(),
            len(batch),
            sum(batch.lengths),
            batch.longest * len(batch),
        )  # budgets' buckets are found in _walk


def _refuse_elastic(position: RankPosition) -> None:
    if position.plan is not None or position.carry is not None:
        raise NotPlannable(
            "the batches cannot be known without reading the samples: after an elastic resume (another world "
            "size or worker count) the readers' units are no epoch's plan."
        )


def _walk(setup: WorkerSetup, start: RankPosition, limit: int | None, cost: Callable[[int, int], float]):
    """The batches from ``start`` on (at most ``limit``), and the position after them."""
    position = copy.deepcopy(start)
    stream = PlannedStream(setup, position)
    budgets = setup.options.batching.budgets
    found: list[PlannedBatch] = []
    while limit is None or len(found) < limit:
        item = stream.next()
        if item is None:
            break
        stream.emit(item)
        longest = item.padded // item.size
        bucket = budgets.bucket_of(longest) if budgets is not None else 0
        found.append(PlannedBatch(position.step, item.size, longest, item.length, bucket, cost(item.size, longest)))
    return found, position


def batch_cost_of(setup: WorkerSetup) -> Callable[[int, int], float]:
    """The loader's cost of a batch of ``size`` samples padded to ``longest`` (a fixed-size
    loader: its padded length)."""
    cost = getattr(batch_cost(setup.options.batching), "cost", None)  # a budget's; a fixed size has none
    return cost if cost is not None else lambda size, longest: float(size * longest)


def rest_of_epoch(setup: WorkerSetup, start: RankPosition) -> list[PlannedBatch]:
    """The batches the loader hands out on this rank from ``start`` (where its next iteration
    begins) to the end of the epoch; NotPlannable says why when they cannot be known."""
    planned = planned_setup(setup)
    _refuse_elastic(start)
    cost = batch_cost_of(setup)
    epochs = setup.options.epochs
    limit = None if epochs.epoch_steps is None else max(0, epochs.epoch_steps - start.step)
    mine, _ = _walk(planned, start, limit, cost)
    if epochs.uneven != "stop" or setup.world_size == 1 or epochs.continues_stream:
        return mine
    end = start.step + len(mine)  # the ranks stop at the first one's end
    for rank in range(setup.world_size):
        if rank != setup.rank:
            fresh = RankPosition.fresh(start.epoch, setup.readers_per_rank)
            theirs, _ = _walk(dataclasses.replace(planned, rank=rank), fresh, end, cost)
            end = min(end, len(theirs))
    return [batch for batch in mine if batch.step <= end]


def skip(setup: WorkerSetup, start: RankPosition, count: int) -> RankPosition:
    """``start`` moved ``count`` batches on (fewer at the epoch's end) without reading them:
    each reader's state after its last batch skipped, the steps counted, and the batches and
    utterances skipped (not as handed out)."""
    planned = planned_setup(setup)
    _refuse_elastic(start)
    steps = setup.options.epochs.epoch_steps
    limit = count if steps is None else max(0, min(count, steps - start.step))
    skipped, position = _walk(planned, start, limit, lambda size, longest: 0.0)
    for name in ("utts", "frames", "padded_frames", "sources", "sources_all"):  # nothing was handed out
        setattr(position, name, copy.deepcopy(getattr(start, name)))
    position.skipped_batches += len(skipped)
    position.skipped_utts += sum(batch.size for batch in skipped)
    return position
