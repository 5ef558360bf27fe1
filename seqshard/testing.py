"""Checks for pipeline stages, for seqshard's tests and for stages of your own.

:func:`assert_resumes_everywhere` is the contract a stage must keep: for every position, a new
stage restored from the state saved there (through JSON) yields exactly the rest of an
uninterrupted run. :class:`ListSource` is a resumable source of given items to test with.
:func:`collectives_made` counts the collectives a shard loader's ranks made (the multi-rank
tests hold them to a few an epoch).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from .pipeline.stages.base import Stage, State


class ListSource(Stage[Any]):
    """A resumable stage yielding ``items`` in order (a test source for stages above a reader)."""

    def __init__(self, items: Sequence[Any]):
        super().__init__(None)
        self.items = list(items)
        self.position = 0

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


def _identity(item: Any) -> Any:
    if hasattr(item, "samples"):  # a batch
        return [_identity(sample) for sample in item.samples]
    if isinstance(item, list):
        return [_identity(i) for i in item]
    return getattr(item, "key", item)


def assert_resumes_everywhere(make_stage: Callable[[], Stage], limit: int | None = None) -> list:
    """For every position k (or ``limit`` positions spread over the run), a new stage
    restored from the state saved after k items yields exactly the rest of the uninterrupted
    run. Items are compared by key (batches by their samples' keys). Returns the keys."""
    full = [_identity(x) for x in make_stage()]
    positions = (
        range(len(full) + 1)
        if limit is None
        else sorted({*range(0, len(full) + 1, max(1, len(full) // limit)), len(full)})
    )
    for k in positions:
        stage = make_stage()
        head = [_identity(next(stage)) for _ in range(k)]
        state = json.loads(json.dumps(stage.state_dict()))
        restored = make_stage()
        restored.load_state_dict(state)
        rest = [_identity(x) for x in restored]
        assert head + rest == full, f"resume after {k} items differs: {rest[:3]}... instead of {full[k : k + 3]}..."
    return full


def collectives_made(loader: Any) -> int:
    """How many collectives this process's rank has taken part in for ``loader`` (a shard
    loader: its epoch agreements, summaries, state gathers); 0 with one rank."""
    return loader.collectives.calls
