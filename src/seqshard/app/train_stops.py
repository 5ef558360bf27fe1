"""Where a run stops or skips: a scheduler's signal, agreed across the ranks (``Preemption``),
``--skip-steps`` (``SkipRanges``), and an error on one rank that stops them all (``together``)."""

from __future__ import annotations

import argparse
import signal
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..errors import ConfigError, SeqshardError, counted


class Preemption:
    """SIGTERM or SIGUSR1 (what a scheduler such as Slurm sends before it stops a job): the
    step under way finishes and the ranks agree to stop after the same step; the trainer saves
    its checkpoint and exits 0. They agree through an all-reduce of one number, on a gloo group
    of its own, begun at each step and read at the next: no rank waits for it (it ran while the
    step did) and no GPU takes part, so a signal stops the run one step later than it would with
    a blocking collective a step."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.received = 0
        self.group: Any = None
        self.exchange: tuple[Any, Any] | None = None  # the all-reduce under way and the host array it fills
        for number in self.SIGNALS:
            signal.signal(number, self._note)

    def _note(self, number: int, frame: Any) -> None:
        self.received = number

    def connect(self) -> None:
        """Make the group the ranks agree on (every rank at once: a collective), with more than one."""
        if dist.get_world_size() > 1:
            self.group = dist.new_group(backend="gloo")

    def agreed(self) -> str | None:
        """The signal's name when any rank had received one by its previous call (every rank
        gets the same answer at the same call), else None; an exchange for the next call begun."""
        if self.group is None:
            return signal.Signals(self.received).name if self.received else None
        found = self.finish()
        if not found:
            import numpy as np

            flag = np.array([self.received], dtype=np.int64)  # host memory: read without a tensor read
            work = dist.all_reduce(torch.from_numpy(flag), op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            self.exchange = work, flag
        return signal.Signals(found).name if found else None

    def finish(self) -> int:
        """Wait for the exchange under way (before the run ends): the signal it found, or 0."""
        if self.exchange is None:
            return 0
        work, flag = self.exchange
        self.exchange = None
        work.wait()
        return int(flag[0])


def step_range(text: str) -> tuple[int, int]:
    """``A-B`` (steps counted from 1, both included) for ``--skip-steps``."""
    first, _, last = text.partition("-")
    try:
        low, high = int(first), int(last or first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A-B (steps, e.g. 1200-1350), got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected 1 <= A <= B, got {text!r}")
    return low, high


class SkipRanges:
    """``--skip-steps``: ranges of steps (counted from 1, both ends included) whose batches
    the loader skips unread (``skip_batches``), counted as steps (the learning rate follows);
    ranges that overlap or touch are joined. A range skips within one epoch: one that goes
    past its epoch's end is refused before anything of that epoch is skipped or trained."""

    def __init__(self, ranges: Sequence[tuple[int, int]], loader: Any, say: Any) -> None:
        self.ranges: list[tuple[int, int]] = []
        for low, high in sorted(ranges):
            if self.ranges and low <= self.ranges[-1][1] + 1:
                before, after = self.ranges.pop()
                low, high = before, max(after, high)
            self.ranges.append((low, high))
        self.loader, self.say = loader, say
        if self.ranges and not hasattr(loader, "skip_batches"):
            raise ConfigError("--skip-steps needs a loader that can skip batches unread (a shard loader).")

    def at(self, step: int) -> tuple[int, int] | None:
        """The range that holds ``step``, or None."""
        return next((r for r in self.ranges if r[0] <= step <= r[1]), None)

    def note_done(self, step: int) -> None:
        """Say which ranges a resumed run has already passed (``step`` steps done)."""
        for low, high in self.ranges:
            if high <= step:
                self.say(f"--skip-steps {low}-{high}: those steps are done (resumed after step {step}), none to skip")

    def check_epoch(self, step: int, epoch: int, epochs: int, device: torch.device) -> None:
        """ConfigError when a range goes past the end of the epoch the loader runs next (from
        after ``step``): the same on every rank (a collective; the epoch's end is the first
        rank's)."""
        if not any(high > step for _, high in self.ranges):
            return
        self.loader.skip_batches(0)  # NotPlannable (a ConfigError saying why) before any step of this epoch
        last = torch.tensor([step + self.loader.planned_batches().remaining], dtype=torch.int64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(last, op=dist.ReduceOp.MIN)
        end = int(last.item())
        for low, high in self.ranges:
            first = max(low, step + 1)
            if first <= end < high:
                if epoch + 1 >= epochs:
                    why, fix = "the run's last epoch: the range covers the rest of the run", f"give {first}-{end}"
                else:
                    why = "a range skips batches of one epoch"
                    fix = f"give {first}-{end}, and the next epoch's steps (from {end + 1}) in another --skip-steps"
                raise ConfigError(
                    f"--skip-steps {low}-{high} goes past the end of epoch {epoch}, at step {end} ({why}): {fix}."
                )

    def skip(self, step: int) -> int:
        """Skip the batches of the range that holds step ``step + 1`` (none: nothing); the
        steps done after it."""
        found = self.at(step + 1)
        if found is None:
            return step
        skipped = self.loader.skip_batches(found[1] - step)
        if skipped:
            self.say(
                f"skipped steps {step + 1}-{step + skipped} (--skip-steps): {counted(skipped, 'step')}, batches not read"
            )
        return step + skipped


T = TypeVar("T")


def together(work: Callable[[], T], device: torch.device, what: str = "set up") -> T:
    """``work()`` on every rank, then one all-reduce: where it failed on some rank (a
    SeqshardError, e.g. a file only rank 0 writes), every rank stops with a message, the
    others naming that rank, instead of dying later in a collective whose peer has gone."""
    failure: SeqshardError | None = None
    try:
        result = work()
    except SeqshardError as error:
        failure = error
    failed = torch.tensor([0 if failure is None else dist.get_rank() + 1], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failure is not None:
        raise failure
    if failed.item():
        raise ConfigError(f"rank {int(failed.item()) - 1} could not {what} (its error says why); this rank stops too.")
    return result
