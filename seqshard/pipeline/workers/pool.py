"""The worker processes of one rank: the torch DataLoader that runs the readers (or, without
workers, runs them in this process), the channel that tells them where each iteration starts,
and the conversion of what they send into tensors (shared slots are received without a copy).
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Iterator
from typing import Any

from ...device import is_cuda
from ...formats.remote import RemoteAccess
from ..stages.collate import to_tensors
from .protocol import BatchItem, ErrorItem, Item
from .runtime import WorkerRuntime
from .setup import WorkerSetup
from .transfer import BatchSlots, current_stream_event
from .worker import IterationChannel

MAX_SLOT_BYTES = 64 << 20


class WorkerPool:
    """A rank's readers, as DataLoader worker processes (or this process)."""

    def __init__(self, setup: WorkerSetup, access: RemoteAccess):
        options = setup.options.workers
        self.options = options
        self._context = multiprocessing.get_context(options.multiprocessing_context)
        self.runtime = WorkerRuntime(access, _slots(setup, self._context))
        self._setup = setup
        self._channel = IterationChannel(self._context)
        self._iteration = 0
        self._dataloader: Any = None

    def items(self, epoch: int, requests: list[dict[str, Any]]) -> Iterator[Item]:
        """What the readers send for this iteration (``requests``: where each starts)."""
        self._iteration += 1
        self._channel.publish({"epoch": epoch, "iteration": self._iteration, "workers": requests})
        return iter(self._loader())

    def _loader(self) -> Any:
        if self._dataloader is None:
            import torch.utils.data

            from .dataset import ReaderDataset

            options, workers = self.options, self.options.num_workers
            self._dataloader = torch.utils.data.DataLoader(
                ReaderDataset(self._setup, self.runtime, self._channel),
                batch_size=None,
                num_workers=workers,
                collate_fn=_unchanged,
                pin_memory=False,  # batches are pinned as they are received (see receive)
                persistent_workers=options.persistent_workers and workers > 0,
                prefetch_factor=options.prefetch_factor if workers > 0 else None,
                multiprocessing_context=self._context if workers > 0 else None,
                timeout=options.timeout,
                worker_init_fn=leave_with_the_rank if workers > 0 else None,
            )
        return self._dataloader

    def receive(self, item: Item) -> Item:
        """Turn a worker's arrays into tensors (those in a shared slot are that memory, not a
        copy); raise the error a worker reported."""
        if isinstance(item, ErrorItem):
            # Raised without a reference cycle (error -> traceback -> this frame -> item -> error),
            # which would keep the DataLoader iterator alive until a garbage collection; one that
            # ran in a worker forked later stopped workers not its own ("Exception ignored ...
            # can only test a child process"). Freed with the error, the iterator stops its workers.
            error, item.error = item.error, None
            try:
                raise error
            finally:
                del error
        if not isinstance(item, BatchItem):
            return item
        on_device = is_cuda(self.options.device)  # copied on by seqshard/device.py, which waits for its copies
        pin = (self.options.pin_memory or on_device) and _cuda_available()
        batch = item.batch
        if item.slot is not None:
            places = {k: v for k, v in batch.items() if not isinstance(v, list)}
            fence = None if on_device else current_stream_event
            batch.update(self.runtime.slots.receive(item.slot, places, pin, fence))  # type: ignore[union-attr]
        else:
            batch = to_tensors(batch)
            if pin and not on_device:
                batch = {k: v.pin_memory() if hasattr(v, "pin_memory") else v for k, v in batch.items()}
        item.batch = batch
        return item

    def close(self) -> None:
        """Stop persistent workers (the next iteration starts them anew)."""
        self._dataloader = None


def _slots(setup: WorkerSetup, context: Any) -> BatchSlots | None:
    """Shared slots for workers' batches, sized for the largest batch the options allow
    (feature arrays, when features or audio are read, plus room for labels and other fields)."""
    table, options = setup.table, setup.options
    workers, batching = options.workers, options.batching
    if not workers.shared_slots:
        return None
    itemsize = 2 if options.collation.dtype == "float16" else 4
    if setup.fields.features is None and setup.fields.audio is None:  # labels only: no frames to hold
        frames = 0
    elif batching.batch_frames is not None:
        frames = batching.batch_frames
    elif batching.budgets is not None:
        frames = max(batching.budgets.budgets)
    else:
        longest = max((2 ** ((k + 1) / 8) for k, _ in table.length_hist), default=2000)
        frames = int(batching.batch_size * longest) + 1  # type: ignore[operator]
    feature_bytes = frames * (setup.dim or 80) * itemsize
    if setup.decodes_audio and (setup.audio.features is None or options.audio.feature_device is not None):
        feature_bytes = frames * int(setup.audio.fbank.sample_rate) // 100 * 4  # float32 samples, 10 ms a frame
    slot_bytes = min(MAX_SLOT_BYTES, int(feature_bytes * 1.25) + (1 << 20))
    if workers.num_workers == 0:  # batches made in this process: a ring for what training still holds
        return BatchSlots(1, 4, slot_bytes, context)
    # beyond the batches prefetched: those training holds, and pinned ones still being copied
    spare = 5 if workers.pin_memory or is_cuda(workers.device) else 3
    return BatchSlots(workers.num_workers, workers.prefetch_factor + spare, slot_bytes, context)


def leave_with_the_rank(worker: int) -> None:
    """A worker ignores the signals a scheduler sends a whole job before it stops it (SIGTERM,
    SIGUSR1; torchrun and Slurm signal every process): its rank decides when to stop (a trainer
    finishes its step and saves a checkpoint first), and a worker leaves when its rank does."""
    for number in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(number, signal.SIG_IGN)


def _unchanged(item: Any) -> Any:
    return item


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
