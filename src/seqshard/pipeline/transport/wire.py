"""What a reader sends the training process, and the pipe it travels on.

Items are typed and come in sequence per reader. Each batch carries the reader's pipeline
state right after it (the training process keeps the state of the last batch it handed out:
all it needs to resume), the reader's counters and the seconds the reader spent making it.
After its last batch a reader sends an :class:`EndItem`; a reader that hits an error sends an
:class:`ErrorItem`, so that the training process raises the error itself (with its type).

From a worker process, states and counters travel as pickled bytes (:func:`pack`) and stay so
in the training process until something reads them (:func:`unpack`): a state is read when a
position is saved or an iteration starts, counters when stats are asked for, not at every
batch. A state holds what its windows hold (tens of kB: ``stages/held.py``), so a batch's state
travels in the batch's shared slot, as its place there, and the training process keeps a view of
those bytes, not a copy (``slots.py``); the pipe carries a few hundred bytes a batch.

A message on a worker's items pipe is ``(iteration, fields, joined)`` pickled (:func:`encode`):
a batch's fields as a plain tuple (:meth:`BatchItem.wire`), or ``(iteration, item, None)`` for
an end or an error; ``Connection.send_bytes`` puts its length before it. The training process
reads it as ``delivery.Inbox`` says.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .slots import SharedMemoryError, shm_problem

State = dict[str, Any]


def pack(value: Any) -> bytes:
    """``value`` as the bytes a worker process sends (read back by :func:`unpack`)."""
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(value: Any) -> Any:
    """A state or counters as sent: bytes from a worker process (or a view of them in a batch's
    slot) are unpickled, the rest is returned as it is (made in this process)."""
    return value if value is None or isinstance(value, dict) else pickle.loads(value)


class BatchItem(NamedTuple):
    """One collated batch. Arrays in ``batch`` are numpy arrays, torch tensors, or (when
    ``slot`` is set) :class:`~.slots.SlotArray` places in that shared slot, under the names
    ``places`` lists. ``state`` and ``stats`` are dicts, or their :func:`pack`ed bytes from a
    worker process. A tuple: the training process makes one from what the pipe brings without
    a call of Python's (``delivery.Arrivals.taker``); the ``batch`` dict is changed in place."""

    worker: int
    seq: int
    batch: dict[str, Any]
    state: State | bytes
    stats: dict[str, int] | bytes
    size: int  # samples in the batch
    length: int  # their summed length (batching measure)
    padded: int  # size x longest
    slot: int | None = None
    places: tuple[str, ...] = ()  # the names of the arrays in the slot
    by_source: list[list[int]] | None = None  # [utterances, length] per source of a mix
    busy: float = 0.0  # seconds the reader spent making the batch
    damaged: int = 0  # damaged shards the reader has met (its counters say which)

    def wire(self) -> tuple[tuple, tuple[str, ...]]:
        """What crosses the pipe: the fields as a plain tuple, and the names of the lists of
        texts (keys, labels) sent as one text joined with NUL (one string to unpickle, not one
        per sample; split again where the item is made); slot places as plain tuples."""
        batch, joined = {}, []
        for name, value in self.batch.items():
            batch[name] = _wired(value)
            if type(batch[name]) is str:
                joined.append(name)
        return (*self[:2], batch, *self[3:]), tuple(joined)


BATCH, STATE, SLOT, PLACES = (BatchItem._fields.index(name) for name in ("batch", "state", "slot", "places"))


def _wired(value: Any) -> Any:
    if isinstance(value, tuple):  # a place in a slot (SlotArray)
        return tuple(value)
    if isinstance(value, list) and value:
        try:
            joined = "\0".join(value)
        except TypeError:  # not all texts
            return value
        if joined.count("\0") == len(value) - 1:  # no NUL of their own
            return joined
    return value


@dataclass
class EndItem:
    """The reader has sent its last batch; its final state and counters."""

    worker: int
    seq: int
    state: State | bytes
    stats: dict[str, int] | bytes = field(default_factory=dict)


@dataclass
class ErrorItem:
    """The reader stopped on an error, raised again by the training process."""

    worker: int
    seq: int
    error: BaseException


Item = BatchItem | EndItem | ErrorItem
Take = Callable[[int], Item]  # take(worker): that worker's next item, received


def encode(iteration: int, item: Item) -> bytes:
    """The message a worker process sends for ``item`` of ``iteration``. A batch that found no
    slot travels as torch tensors of its own, in shared memory torch allocates for them
    (SharedMemoryError where ``/dev/shm`` has no room)."""
    message = (iteration, *item.wire()) if isinstance(item, BatchItem) else (iteration, item, None)
    if not isinstance(item, BatchItem) or item.slot is not None:
        return pack(message)
    if not any(hasattr(value, "untyped_storage") for value in item.batch.values()):
        return pack(message)
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 (it registers the reductions: tensors moved to shared memory)

    try:
        return bytes(ForkingPickler.dumps(message))
    except (RuntimeError, OSError) as error:  # the tensors' shared memory could not be allocated
        raise SharedMemoryError(shm_problem("a batch too large for its slot (or with no slot free)", error)) from None
