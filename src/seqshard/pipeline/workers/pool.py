"""The readers of one rank: worker processes (``process.py``), or reader 0 in this process
without them; what they send is made tensors by the transport (``transport/delivery.py``).

Batches are taken one worker at a time, in the merged stream's turn (``rank/merge.py``): a
take reads that worker's next item, blocking until it comes; nothing of the loader's runs in
the training process between takes.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

from ...device import is_cuda
from ...formats.index_entries import bin_bounds
from ...formats.remote.access import RemoteAccess
from ..transport.delivery import Arrivals
from ..transport.slots import BatchSlots
from ..transport.wire import Take
from .process import WorkerLink
from .runtime import WorkerRuntime
from .setup import WorkerSetup
from .worker import iterate_worker

MAX_SLOT_BYTES = 64 << 20


class WorkerPool:
    """A rank's readers, as worker processes (or this process)."""

    def __init__(self, setup: WorkerSetup, access: RemoteAccess):
        options = setup.options.workers
        self.options = options
        self._context = multiprocessing.get_context(options.multiprocessing_context)
        self.runtime = WorkerRuntime(access, _slots(setup, self._context))
        self._setup = setup
        self._iteration = 0
        self._links: list[WorkerLink] = []
        self.arrivals = Arrivals(self.runtime.slots, options.pin_memory, is_cuda(options.device))

    def start(self, epoch: int, requests: list[dict[str, Any]]) -> Take:
        """Start an iteration (``requests``: where each reader starts); returns the function
        that takes a reader's next item."""
        self._iteration += 1
        iteration = self._iteration
        if self.options.num_workers == 0:
            items = iterate_worker(self._setup, self.runtime, 0, epoch, iteration, requests[0])
            return lambda worker: self.arrivals.receive(next(items))
        if self._links and not all(link.alive for link in self._links):  # a persistent worker died (its
            self.close()  # error was raised in the iteration it broke): the next one starts afresh
        if not self._links:
            ahead = self.options.prefetch_factor
            self._links = [
                WorkerLink(self._context, self._setup, self.runtime, worker, ahead, self.options.persistent_workers)
                for worker in range(self.options.num_workers)
            ]
        for link, spec in zip(self._links, requests):
            link.run(iteration, epoch, spec)
        return self.arrivals.taker([link.inbox for link in self._links], iteration, self.options.timeout)

    def finish(self) -> None:
        """An iteration ended (or was abandoned): workers that do not persist are stopped."""
        if not self.options.persistent_workers:
            self.close()

    def close(self) -> None:
        """Stop the worker processes (the next iteration starts them anew; a copy of the pool
        in a forked process stops none: ``WorkerLink.stop``)."""
        links, self._links = self._links, []
        for link in links:
            link.stop()

    def __del__(self) -> None:
        if getattr(self, "_links", None):
            self.close()


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
        longest = max((bin_bounds(k)[1] for k, _ in table.length_hist), default=2000)
        frames = int(batching.batch_size * longest) + 1  # type: ignore[operator]
    feature_bytes = frames * (setup.dim or 80) * itemsize
    if setup.decodes_audio and (setup.audio.features is None or options.audio.feature_device is not None):
        feature_bytes = frames * int(setup.audio.fbank.sample_rate) // 100 * 4  # float32 samples, 10 ms a frame
    slot_bytes = min(MAX_SLOT_BYTES, int(feature_bytes * 1.25) + (1 << 20))
    if workers.num_workers == 0:  # batches made in this process: a ring for what training still holds
        return BatchSlots(1, 4, slot_bytes, context, shared=False)
    # beyond the batches prefetched: those training holds, and pinned ones still being copied
    spare = 5 if workers.pin_memory or is_cuda(workers.device) else 3
    return BatchSlots(workers.num_workers, workers.prefetch_factor + spare, slot_bytes, context)
