"""Which epoch a rank's next iteration runs, and where in it it starts.

An iteration starts a fresh epoch, a position loaded from a state, or (streams that go on
across epochs) the position the last epoch ended at. As with a torch DataLoader, code that never
calls ``set_epoch`` still trains on new orders: an iteration after a finished epoch runs the
next epoch, unless ``set_epoch`` chose one since; a state saved after an epoch's last batch
resumes into the next epoch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .merge import RankPosition

_LOG = logging.getLogger("seqshard")


class EpochCursor:
    """The epoch of the next iteration and the position it starts from (see the module
    docstring). ``fresh(epoch)`` makes the position of an epoch's start."""

    def __init__(self, fresh: Callable[[int], RankPosition], continues_stream: bool):
        self._fresh = fresh
        self._continues = continues_stream
        self.epoch = 0
        self.position = fresh(0)  # the position of the current (or last) iteration
        self.resume: RankPosition | None = None  # a loaded position, until an iteration starts from it
        self._chosen = False  # set_epoch was called since the last iteration started

    def set_epoch(self, epoch: int) -> None:
        if self.resume is not None and self.resume.epoch != epoch and not self._continues:
            _LOG.warning(
                "the loaded state is for epoch %d; set_epoch(%d) starts epoch %d from its beginning",
                self.resume.epoch,
                epoch,
                epoch,
            )
            self.resume = None
        self.epoch = epoch
        self._chosen = True

    def load(self, position: RankPosition) -> None:
        """Start the next iteration from ``position`` (a state's)."""
        self.resume = position
        self.position = RankPosition.from_json(position.to_json())
        self.epoch = position.epoch
        self._chosen = False

    def start(self) -> RankPosition:
        """The position the next iteration starts from (it becomes :attr:`position`)."""
        self.position, self.epoch = self._next()
        self.resume, self._chosen = None, False
        return self.position

    def peek(self) -> RankPosition:
        """The position the next iteration will start from, leaving the cursor as it is."""
        return self._next()[0]

    def _next(self) -> tuple[RankPosition, int]:
        """The next iteration's position and epoch."""
        resumed, epoch = self.resume, self.epoch
        last = resumed or self.position
        if not self._chosen and last.completed and last.epoch == epoch:
            epoch += 1  # iterating again after a finished epoch runs the next one
        if resumed is not None and resumed.epoch == epoch:
            return resumed, epoch
        if self._continues:
            return last.continuing(epoch), epoch
        return self._fresh(epoch), epoch
