"""What a DataLoader worker sends the training process: typed items, in sequence per worker.

Each batch carries the worker's pipeline state right after it (the training process keeps
the state of the last batch it handed out: all it needs to resume) and the worker's counters.
After its last batch a worker sends an :class:`EndItem`; a worker that hits an error sends an
:class:`ErrorItem`, so that the training process raises the error itself (with its type).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

State = dict[str, Any]


@dataclass
class BatchItem:
    """One collated batch. Arrays in ``batch`` are numpy arrays, torch tensors, or (when
    ``slot`` is set) :class:`~.transfer.SlotArray` places in that shared slot."""

    worker: int
    seq: int
    batch: dict[str, Any]
    state: State
    stats: dict[str, int]
    size: int  # samples in the batch
    length: int  # their summed length (batching measure)
    padded: int  # size x longest
    bucket: int = 0
    slot: int | None = None
    by_source: list[list[int]] | None = None  # [utterances, length] per source of a mix


@dataclass
class EndItem:
    """The worker has sent its last batch; its final state and counters."""

    worker: int
    seq: int
    state: State
    stats: dict[str, int] = field(default_factory=dict)


@dataclass
class ErrorItem:
    """The worker stopped on an error, raised again by the training process."""

    worker: int
    seq: int
    error: BaseException


Item = BatchItem | EndItem | ErrorItem
