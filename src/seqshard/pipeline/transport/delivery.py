"""The training process's side of the transport: what the workers send made items whose arrays
are tensors (:class:`Arrivals`), and where a rank hands its batches over (:class:`Delivery`):
in host memory as the workers made them, or on the GPU (``device="cuda"``: each batch copied on
a side stream while the step before it runs, ``seqshard/device.py``), with audio features made
there from the waveforms (``feature_device``: ``features/on_device.py``).

A batch in a shared slot is received as tensors that are that memory (``slots.py``: no copy);
one that came without a slot as the tensors it came as, or its numpy arrays as tensors. With
``pin_memory`` (or ``device="cuda"``) on a CUDA machine they are pinned.

:class:`Delivery` wraps the workers' ``take`` that the merged stream (``rank/merge.py``) calls:
a batch copied ahead is one the stream has not taken yet, so the saved position never counts
it, and a resume makes it again.
"""

from __future__ import annotations

import functools
from typing import Any

from ...device import CudaCopier, is_cuda, require_device
from ...features.frontend import AudioOptions
from ...features.on_device import BatchFeatures
from ...options import LoaderOptions
from ..stages.collate import to_tensors
from .slots import BatchSlots, current_stream_event
from .wire import BATCH, PLACES, SLOT, STATE, BatchItem, EndItem, ErrorItem, Inbox, Item, Take


class Arrivals:
    """What a rank's readers send, made items whose arrays are tensors (see the module's
    text). ``slots``: the ring their batches travel in (None: none); ``on_device``: batches
    are copied on to the GPU by ``seqshard/device.py``, which waits for its own copies."""

    def __init__(self, slots: BatchSlots | None, pin_memory: bool, on_device: bool):
        self.slots = slots
        self._pin_memory = pin_memory
        self._on_device = on_device
        self._pin: bool | None = None  # decided at the first batch (CUDA is asked for once workers exist)

    def taker(self, inboxes: list[Inbox], iteration: int, timeout: float) -> Take:
        """The take of ``iteration``: a worker's next message (``Inbox.take``) made an item, a
        batch's arrays tensors; an error a worker reported is raised. The work of each batch,
        kept to a few calls."""
        slots, pin, other = self.slots, self.pins(), self.receive
        fence = None if self._on_device else current_stream_event

        def take(worker: int) -> Item:
            fields, joined = inboxes[worker].take(iteration, timeout)
            if joined is None:  # not a batch
                return other(fields)
            slot = fields[SLOT]
            if slot is None:
                item = made(fields, joined)
                self._tensors(item.batch, pin)
                return item
            state = slots.receive(slot, fields[BATCH], pin, fence, fields[PLACES], fields[STATE])  # type: ignore[union-attr]
            return made((*fields[:STATE], state, *fields[STATE + 1 :]), joined)

        return take

    def receive(self, item: Item) -> Item:
        """Turn an item's arrays into tensors (those in a shared slot are that memory, not a
        copy); raise the error a worker reported."""
        if isinstance(item, ErrorItem):
            # Raised without a reference cycle (error -> traceback -> this frame -> item -> error),
            # which would keep the iteration alive until a garbage collection (one that ran in a
            # worker forked later stopped workers not its own). Freed with the error, the
            # iteration ends and stops its workers.
            error, item.error = item.error, None
            try:
                raise error
            finally:
                del error
        if not isinstance(item, BatchItem):
            return item
        pin = self.pins()
        if item.slot is None:
            self._tensors(item.batch, pin)
            return item
        fence = None if self._on_device else current_stream_event
        state = self.slots.receive(item.slot, item.batch, pin, fence, item.places, item.state)  # type: ignore[union-attr]
        return item if state is item.state else item._replace(state=state)

    def pins(self) -> bool:
        """Whether batches are handed over in pinned memory (decided at the first batch: CUDA
        is asked for once workers exist)."""
        if self._pin is None:
            self._pin = (self._pin_memory or self._on_device) and _cuda_available()
        return self._pin

    def _tensors(self, batch: dict[str, Any], pin: bool) -> None:
        """A batch that came without a slot: its arrays as tensors (pinned with ``pin``), in place."""
        for name, value in to_tensors(batch).items():
            batch[name] = value.pin_memory() if pin and not self._on_device and hasattr(value, "pin_memory") else value


def made(fields: tuple, joined: tuple[str, ...]) -> BatchItem:
    """The item :meth:`BatchItem.wire` sent (made in C from its fields; its joined texts split)."""
    item = _new_item(fields)
    batch = item.batch
    for name in joined:
        batch[name] = batch[name].split("\0")
    return item


_new_item = functools.partial(tuple.__new__, BatchItem)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


class Delivery:
    """How one loader's batches reach the training loop (see the module's text); ``audio``:
    the loader's audio options as parsed once (``WorkerSetup.audio``)."""

    def __init__(self, options: LoaderOptions, audio: AudioOptions):
        later = options.audio.feature_device is not None
        self.features = BatchFeatures(audio, options.collation.dtype) if later else None
        self.device = options.workers.device if is_cuda(options.workers.device) else None
        require_device(self.device)
        self.copier: CudaCopier | None = None  # made at the first iteration (it opens a CUDA stream)
        self._ahead: CopiesAhead | None = None

    def take(self, take: Take, workers: int) -> Take:
        """The ``workers`` readers' ``take`` with its batches delivered: on the device, or with
        features made, as the options say."""
        if self.device is not None:
            if self.copier is None:
                self.copier = CudaCopier(self.device, self.features)
            self._ahead = CopiesAhead(take, self.copier, workers)
            return self._ahead.take
        if self.features is not None:
            return lambda worker: self._with_features(take(worker))
        return take

    def finish(self) -> None:
        """The iteration ended: batches copied ahead are dropped, running copies waited for."""
        if self._ahead is not None:
            self._ahead = None
            self.copier.close()  # type: ignore[union-attr]

    def _with_features(self, item: Item) -> Item:
        if isinstance(item, BatchItem):
            return item._replace(batch=self.features(item.batch, item.batch))  # type: ignore[misc]
        return item


class CopiesAhead:
    """A take whose batches are copied to the device one turn ahead: before worker w's batch is
    handed over, the next batch in the merged stream's turn (the next worker after w that has
    not sent its end) is taken and its copy started, so that copy runs while the step on w's
    batch does. The first batch is handed over at once. What a worker sends other than a batch
    (its end, an error raised by taking it) is kept and given at that worker's next take."""

    def __init__(self, take: Take, copier: CudaCopier, workers: int):
        self._take, self._copier, self._workers = take, copier, workers
        self._ahead: dict[int, tuple[str, Any]] = {}  # worker -> ("copy", started) / ("item", item) / ("error", e)
        self._ended: set[int] = set()
        self._first = True

    def take(self, worker: int) -> Item:
        kind, value = self._ahead.pop(worker, None) or self._started(worker)
        if kind == "error":
            raise value
        item = value if kind == "item" else self._finished(value)
        if self._first:
            self._first = False
        else:
            self._start_next(worker)
        return item

    def _started(self, worker: int) -> tuple[str, Any]:
        try:
            item = self._take(worker)
        except Exception as error:  # raised at that worker's turn, not before the batch in hand
            return "error", error
        if isinstance(item, EndItem):
            self._ended.add(worker)
        if not isinstance(item, BatchItem):
            return "item", item
        started = self._copier.start(item.batch)
        # the host batch is the copier's until its copy has completed
        return "copy", (item._replace(batch={}), started)

    def _finished(self, value: tuple[BatchItem, Any]) -> BatchItem:
        item, started = value
        return item._replace(batch=self._copier.finish(started))

    def _start_next(self, worker: int) -> None:
        turns = ((worker + step) % self._workers for step in range(1, self._workers + 1))
        after = next((other for other in turns if other not in self._ended), None)
        if after is not None and after not in self._ahead:
            self._ahead[after] = self._started(after)
