"""What a process holds while it reads for a loader: how it reads shards (remote access, the
cache, the read-ahead thread), the shared slots its batches travel in, and the pipelines it
keeps alive across epochs. Made in the training process and pickled to worker processes, which
then make their own threads and file systems (nothing open crosses a process boundary)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...formats.remote.access import RemoteAccess
from ..stages.base import Stage, State
from ..transport.slots import BatchSlots


class LivePipelines:
    """The pipeline of each reader whose stream goes on across epochs (``uneven="repeat"``,
    mixes), with its state after the last batch it made. When the next epoch starts from that
    state (no batch was made ahead and dropped: no worker processes), the pipeline continues as
    it is, instead of being rebuilt from the state, which re-reads its windows. Also a
    persistent worker's pipeline of the next epoch, whose first window it reads in spare time
    (``worker.ReaderRun.prepare``), for the run of that epoch from its beginning."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[State, Stage]] = {}
        self._next: dict[int, tuple[int, Stage]] = {}

    def keep(self, worker: int, state: State, pipeline: Stage) -> None:
        self._kept[worker] = (state, pipeline)

    def take(self, worker: int, state: State | None) -> Stage | None:
        """The kept pipeline of ``worker`` if it stands at ``state``, else None."""
        kept = self._kept.pop(worker, None)
        return kept[1] if kept is not None and state is not None and kept[0] == state else None

    def keep_next(self, worker: int, epoch: int, pipeline: Stage) -> None:
        self._next[worker] = (epoch, pipeline)

    def take_next(self, worker: int, epoch: int) -> Stage | None:
        """The kept pipeline of ``worker`` for ``epoch`` from its beginning, else None (a pipeline
        kept for another epoch is dropped)."""
        kept = self._next.pop(worker, None)
        return kept[1] if kept is not None and kept[0] == epoch else None


@dataclass
class WorkerRuntime:
    """A loader's per-process reading resources (see the module docstring)."""

    access: RemoteAccess
    slots: BatchSlots | None = None
    live: LivePipelines = field(default_factory=LivePipelines)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "live": LivePipelines()}  # open pipelines stay in their process
