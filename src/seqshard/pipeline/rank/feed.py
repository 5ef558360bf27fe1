"""How well one rank's readers keep its training loop fed: the share of the epoch's time the
consumer waited in ``next()`` (``stats()["data_wait"]``), the readers' own time per batch, and
one warning an epoch (rank 0) when the consumer waited more than ``WAIT_WARN_SHARE`` of the
time after ``WAIT_WARN_AFTER`` steps, naming what to change.

The loader times each ``next()`` with two clock reads; everything else here runs every
``WAIT_WARN_AFTER`` steps at most.
"""

from __future__ import annotations

import logging
import math
import time

from ...dist import cores_per_rank
from ...errors import option
from ...options import Workers

_LOG = logging.getLogger("seqshard")
WAIT_WARN_SHARE = 0.05
WAIT_WARN_AFTER = 50  # steps; the warning is judged every this many steps


class FeedMeter:
    """One epoch's waits and the readers' time (see the module docstring)."""

    def __init__(self, workers: Workers, rank: int):
        self.workers = workers
        self.rank = rank
        self.begin()

    def begin(self) -> None:
        """A new epoch (or the rest of one) starts now."""
        self.started = time.perf_counter()
        self.ended: float | None = None
        self.waited = 0.0  # seconds in next() waiting for a batch
        self.first = 0.0  # of which the first batch
        self.busy = 0.0  # seconds the readers spent making the batches handed out
        self.steps = 0
        self._warned = False

    def end(self) -> None:
        self.ended = time.perf_counter()

    @property
    def seconds(self) -> float:
        """The epoch's time so far (to its end, once it ended)."""
        return (self.ended if self.ended is not None else time.perf_counter()) - self.started

    def share(self) -> float:
        """The share of the epoch's time the consumer waited for batches."""
        seconds = self.seconds
        return self.waited / seconds if seconds > 0 else 0.0

    def judge(self) -> None:
        """Warn once an epoch (rank 0) when the consumer waited too long (called every
        WAIT_WARN_AFTER steps)."""
        if self._warned or self.rank != 0 or self.steps < WAIT_WARN_AFTER:
            return
        share = self.share()
        if share <= WAIT_WARN_SHARE:
            return
        self._warned = True
        _LOG.warning("%s", self.advice(share))

    def advice(self, share: float) -> str:
        """What the consumer's waits say to change."""
        steps = max(1, self.steps)
        step_ms = 1000 * max(0.0, self.seconds - self.waited) / steps  # the consumer's own time a step
        batch_ms = 1000 * self.busy / steps  # a reader's time to make one batch
        workers = self.workers.num_workers
        said = (
            f"seqshard: the training loop waited for batches {share:.0%} of the epoch's time over its first "
            f"{self.steps} steps ({step_ms:.1f} ms of its own a step; a reader takes {batch_ms:.1f} ms a batch). "
        )
        if workers == 0:
            return said + (
                f"Batches are made in the training process ({option('num_workers', 0)}): "
                f"{option('num_workers', 'auto')} moves them to worker processes."
            )
        needed = math.ceil(1.5 * batch_ms / step_ms) if step_ms > 0 else workers + 1
        cores = cores_per_rank()
        if needed > max(workers, cores):  # more workers would only share the same cores
            return said + (
                f"{workers} worker(s) cannot keep up, and the {needed} it would take are more than the {cores} "
                "cores this rank may use: cheaper work per sample in the workers (features made at pack time, a "
                "smaller sort window), or more CPU cores for each training process."
            )
        if needed > workers:
            return said + (
                f"{workers} worker(s) cannot keep up: {option('num_workers', needed)} or more (each makes a batch in "
                f"{batch_ms:.1f} ms, a step takes {step_ms:.1f} ms), or cheaper work per sample in the workers."
            )
        if self.first > 0.5 * self.waited and not self.workers.persistent_workers:
            return said + (
                f"Most of it was the first batch ({1000 * self.first:.0f} ms: starting the workers and reading the "
                f"first window): {option('persistent_workers', True)} keeps them and reads the next epoch ahead."
            )
        return said + (
            f"The workers keep up on average but not at every step: a larger "
            f"{option('prefetch_factor', 2 * self.workers.prefetch_factor)}."
        )
