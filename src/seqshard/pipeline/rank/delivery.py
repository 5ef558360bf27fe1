"""Where a rank hands its batches over: in host memory as the workers made them, or on the GPU
(``device="cuda"``: each batch copied on a side stream while the step before it runs,
``seqshard/device.py``), with audio features made there from the waveforms
(``feature_device``: ``features/on_device.py``).

It wraps the workers' ``take`` that the merged stream (``merge.py``) calls: a batch copied
ahead is one the stream has not taken yet, so the saved position never counts it, and a resume
makes it again.
"""

from __future__ import annotations

from typing import Any

from ...device import CudaCopier, is_cuda, require_device
from ...features.frontend import AudioOptions
from ...features.on_device import BatchFeatures
from ...options import LoaderOptions
from ..workers.wire import BatchItem, EndItem, Item, Take


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
