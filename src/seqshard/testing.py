"""Checks for pipeline stages, for seqshard's tests and for stages of your own.

:func:`assert_resumes_everywhere` is the contract a stage must keep: for every position, a new
stage restored from the state saved there (through JSON) yields exactly the rest of an
uninterrupted run, also when its windows are restored from what they held, without reading them
again (``pipeline/workers/replay.py``). :class:`ListSource` is a resumable source of given items
to test with. :func:`collectives_made` counts the collectives a shard loader's ranks made (the
multi-rank tests hold them to a few an epoch). :func:`worker_setup` and :func:`batch_slots` give
what a shard loader's readers are built from and the shared memory their batches travel in.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from .pipeline.stages.base import Stage, State
from .pipeline.stages.held import Origin
from .pipeline.stages.sample import Sample
from .pipeline.workers.replay import attach


class ListSource(Stage[Any]):
    """A resumable stage yielding ``items`` in order (a test source for stages above a reader).
    A :class:`Sample` among them that says nothing of where it was read is given its place in
    the list as its origin (shard 0, its position), so windows can be restored from it."""

    def __init__(self, items: Sequence[Any]):
        super().__init__(None)
        self.items = list(items)
        self.position = 0
        for number, item in enumerate(self.items):
            if isinstance(item, Sample) and item.shard < 0 and not item.offsets:
                item.shard, item.ordinal, item.offsets = 0, number, (("list", number),)

    def fetcher(self) -> Stage[Any]:
        """A stage that gives the items again by their origins (:meth:`_Fetched.queue`)."""
        return _Fetched(self.items)

    def reset(self, state: State | None = None) -> None:
        super().reset(state)
        self.position = int(state["position"]) if state else 0

    def next(self) -> Any:
        if self.position >= len(self.items):
            raise StopIteration
        self.position += 1
        return self.items[self.position - 1]

    def get_state(self) -> State:
        return {"position": self.position}


class _Fetched(Stage[Any]):
    """Items of a list given again, in the order their origins are queued."""

    def __init__(self, items: list[Any]):
        super().__init__(None)
        self.items, self.queued = items, []

    def queue(self, origins: Sequence[Origin]) -> None:
        self.queued.extend(origins)

    def reset(self, state: State | None = None) -> None:
        super().reset(state)
        self.queued = []

    def next(self) -> Any:
        if not self.queued:
            raise StopIteration
        return self.items[self.queued.pop(0).ordinal]


def _identity(item: Any) -> Any:
    if hasattr(item, "samples"):  # a batch
        return [_identity(sample) for sample in item.samples]
    if isinstance(item, list):
        return [_identity(i) for i in item]
    return getattr(item, "key", item)


def assert_resumes_everywhere(make_stage: Callable[[], Stage], limit: int | None = None) -> list:
    """For every position k (or ``limit`` positions spread over the run), a new stage
    restored from the state saved after k items yields exactly the rest of the uninterrupted
    run; and again with its windows saved with what they hold and restored from it (where the
    stages under them can make their items again: ``pipeline/workers/replay.py``). Items are
    compared by key (batches by their samples' keys). Returns the keys."""
    full = [_identity(x) for x in make_stage()]
    positions = (
        range(len(full) + 1)
        if limit is None
        else sorted({*range(0, len(full) + 1, max(1, len(full) // limit)), len(full)})
    )

    def replayed() -> Stage:
        stage = make_stage()
        attach(stage, make_stage)
        return stage

    for make in (make_stage, replayed) if attach(make_stage(), make_stage) else (make_stage,):
        for k in positions:
            stage = make()
            head = [_identity(next(stage)) for _ in range(k)]
            state = json.loads(json.dumps(stage.state_dict()))
            restored = make()
            restored.load_state_dict(state)
            rest = [_identity(x) for x in restored]
            assert head + rest == full, f"resume after {k} items differs: {rest[:3]}... instead of {full[k : k + 3]}..."
    return full


def collectives_made(loader: Any) -> int:
    """How many collectives this process's rank has taken part in for ``loader`` (a shard
    loader: its epoch agreements, summaries, state gathers); 0 with one rank."""
    return loader.collectives.calls


def worker_setup(loader: Any) -> Any:
    """What a shard loader's readers are built from (``pipeline/workers/setup.py``: its table,
    options and fields): ``Reader(worker_setup(loader), rank, worker)`` is the reader a recipe
    gets, to test a recipe or stage of your own over real shards."""
    return loader._setup


def batch_slots(loader: Any) -> Any:
    """The shared memory a shard loader's workers write batches into
    (``pipeline/transport/slots.py``'s ``BatchSlots``); None without shared slots."""
    return loader._pool.runtime.slots
