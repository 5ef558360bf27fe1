"""The torch IterableDataset the DataLoader runs: each worker iterates its reader pipeline.

A module of its own so that the class is importable by name (spawned workers unpickle it) while
``seqshard.pipeline`` itself does not import torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.utils.data

from .runtime import WorkerRuntime
from .setup import WorkerSetup
from .worker import IterationChannel, iterate_worker


class ReaderDataset(torch.utils.data.IterableDataset):
    """Yields the items of the calling worker's reader (worker 0 without worker processes)."""

    def __init__(self, setup: WorkerSetup, runtime: WorkerRuntime, channel: IterationChannel):
        self.setup = setup
        self.runtime = runtime
        self.channel = channel

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        return iterate_worker(self.setup, self.runtime, worker, self.channel.read(), in_worker_process=info is not None)
