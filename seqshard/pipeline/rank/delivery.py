"""Where a rank hands its batches over: in host memory as the workers made them, or on the GPU
(``device="cuda"``: each batch copied on a side stream while the step before it runs,
``seqshard/device.py``), with audio features made there from the waveforms
(``feature_device``: ``features/on_device.py``).

It sits between the workers' items and the merged stream (``merge.py``): a batch copied ahead
is one the stream has not taken yet, so the saved position never counts it, and a resume
makes it again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ...device import CudaCopier, is_cuda, one_ahead, require_device
from ...features.audio import AudioOptions
from ...features.on_device import BatchFeatures
from ...options import LoaderOptions
from ..workers.protocol import BatchItem, Item

Receive = Callable[[Item], Item]


class Delivery:
    """How one loader's batches reach the training loop (see the module's text); ``audio``:
    the loader's audio options as parsed once (``WorkerSetup.audio``)."""

    def __init__(self, options: LoaderOptions, audio: AudioOptions):
        later = options.audio.feature_device is not None
        self.features = BatchFeatures(audio, options.collation.dtype) if later else None
        self.device = options.workers.device if is_cuda(options.workers.device) else None
        require_device(self.device)
        self.copier: CudaCopier | None = None  # made at the first iteration (it opens a CUDA stream)

    def items(self, items: Iterator[Item], receive: Receive) -> Iterator[Item]:
        """The workers' ``items`` received (``receive``: slots to tensors, errors raised) and
        delivered: their batches on the device, or with features made, as the options say."""
        received = map(receive, items)
        if self.device is not None:
            return self._on_device(received)
        if self.features is not None:
            return map(self._with_features, received)
        return received

    def _with_features(self, item: Item) -> Item:
        if isinstance(item, BatchItem):
            item.batch = self.features(item.batch, item.batch)  # type: ignore[misc]
        return item

    def _on_device(self, items: Iterator[Item]) -> Iterator[Item]:
        if self.copier is None:
            self.copier = CudaCopier(self.device, self.features)  # type: ignore[arg-type]
        copier = self.copier

        def start(item: BatchItem) -> tuple[BatchItem, Any]:
            started = copier.start(item.batch)
            item.batch = {}  # the host batch is the copier's until its copy has completed
            return item, started

        def finish(started: tuple[BatchItem, Any]) -> BatchItem:
            item, copy = started
            item.batch = copier.finish(copy)
            return item

        try:
            yield from one_ahead(items, start, finish, passes=lambda item: not isinstance(item, BatchItem))  # type: ignore[arg-type]
        finally:
            copier.close()
