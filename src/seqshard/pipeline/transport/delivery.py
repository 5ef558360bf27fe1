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
import os
import select
import struct
from collections.abc import Callable
from os import read, write
from pickle import loads
from typing import Any

from ...device import CudaCopier, is_cuda, require_device
from ...features.frontend import AudioOptions
from ...features.on_device import BatchFeatures
from ...options import LoaderOptions
from ..stages.collate import to_tensors
from .slots import BatchSlots, current_stream_event
from .wire import BATCH, PLACES, SLOT, STATE, BatchItem, EndItem, ErrorItem, Item, Take


class Inbox:
    """The training process's end of one worker's items pipe, and of the credits pipe back
    (one byte for each item taken: a worker sends while it has credits). Messages are
    ``Connection.send_bytes``'s (a 4-byte length, then the bytes), read from the pipe's
    descriptor: one read brings what has come, often more than one message, kept in ``buffer``
    for the next takes (``Connection.recv_bytes`` reads each length and each message apart).
    ``gone()`` says why the pipe closed (the worker's exit)."""

    def __init__(self, worker: int, items: Any, credits: Any, gone: Callable[[], str]):
        self.worker = worker
        self.items_fd = items.fileno()
        self.credit_fd = credits.fileno()
        os.set_blocking(self.credit_fd, False)
        self.buffer = bytearray()  # what came on the items pipe and was not taken yet
        self.gone = gone

    def wait(self, timeout: float) -> bytes:
        """What has come on the items pipe, waiting for it at most ``timeout`` seconds (a take
        without a timeout reads the pipe itself: the read blocks, nothing polls)."""
        try:
            if not select.select([self.items_fd], [], [], timeout)[0]:
                raise TimeoutError
            data = os.read(self.items_fd, 1 << 16)
            if not data:
                raise EOFError("the worker's pipe closed")
        except TimeoutError:
            raise RuntimeError(
                f"seqshard worker {self.worker} sent no batch for {timeout} s (the loader's timeout option): "
                "a slow disk or server, or a stuck transform?"
            ) from None
        except (EOFError, OSError):
            raise RuntimeError(self.gone()) from None
        return data


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
        """The take of ``iteration``: a worker's next message of ``iteration`` (those of an
        abandoned iteration still in the pipe are dropped; waiting at most ``timeout`` seconds, 0:
        no limit) made an item, a batch's arrays tensors, and one credit sent back; an error a
        worker reported is raised. The work of each batch, in one function with a few calls of C."""
        slots, pin, other, split = self.slots, self.pins(), self.receive, str.split
        fence = None if self._on_device else current_stream_event
        receive = slots.receive if slots is not None else None

        def take(worker: int) -> Item:
            inbox = inboxes[worker]
            buffer = inbox.buffer
            while True:
                size = len(buffer)
                if size >= 4:
                    end = 4 + _length(buffer)[0]
                    if size >= end:
                        sent, fields, joined = loads(buffer[4:end])
                        del buffer[:end]
                        if sent == iteration:
                            break
                        continue
                if timeout:
                    buffer += inbox.wait(timeout)
                    continue
                try:
                    data = read(inbox.items_fd, 1 << 16)  # blocks until the worker sends
                except OSError:
                    data = b""
                if not data:
                    raise RuntimeError(inbox.gone())
                buffer += data
            try:  # noqa: SIM105 (contextlib.suppress costs three calls a batch)
                write(inbox.credit_fd, b"\1")
            except BlockingIOError:  # the pipe is full of credits the worker has not needed yet
                pass
            if joined is None:  # not a batch
                return other(fields)
            slot = fields[SLOT]
            if slot is None:
                item = _new_item(fields)
                self._tensors(item.batch, pin)
            else:
                state = receive(slot, fields[BATCH], pin, fence, fields[PLACES], fields[STATE])  # type: ignore[misc]
                item = _new_item((*fields[:STATE], state, *fields[STATE + 1 :]))
            batch = item.batch
            for name in joined:
                batch[name] = split(batch[name], "\0")
            return item

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


_new_item = functools.partial(tuple.__new__, BatchItem)  # an item from its fields, made in C
_length = struct.Struct(">i").unpack_from  # a message's length, before it (Connection.send_bytes)


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
