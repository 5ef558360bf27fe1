"""The trainer's epochs: a step a batch (the learning rate a function of the step), a log line
every ``log_every`` steps with the data-wait fraction, a checkpoint every ``save_every``, the
dev set after each epoch; the run stops where ``--stop-after-steps`` or a preemption says and
skips what ``--skip-steps`` says."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import counted
from ..progress import Progress
from .train_checkpoint import write_checkpoint
from .train_memory import MemoryGuard, StepRunner, memory_line
from .train_stops import Preemption, SkipRanges, together


def line(text: str) -> None:
    """Print ``text`` as one write (ranks share one output: two writes of theirs could interleave)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def say(message: str) -> None:
    """Print ``message`` on rank 0."""
    if dist.get_rank() == 0:
        line(message)


def timed(batches: Any) -> Iterator[tuple[Any, float]]:
    """Each batch of ``batches`` with the seconds spent waiting for it."""
    iterator = iter(batches)
    while True:
        started = time.perf_counter()
        batch = next(iterator, None)
        if batch is None:
            return
        yield batch, time.perf_counter() - started


class LogLineMeter:
    """The steps since the last line: how long the loop waited for batches, against the time
    they took (measured when the line is made: its read waits for the device to finish them;
    time in :meth:`paused` blocks is no step's), and their utterances, frames and mean loss. The
    frames and losses stay on the device until the line: one read a line, none a step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.began = time.perf_counter()
        self.wait = 0.0
        self.utts = self.steps = 0
        self.losses: list[torch.Tensor] = []
        self.frames: list[torch.Tensor] = []

    def add(self, wait: float, utts: int, frames: torch.Tensor, loss: torch.Tensor) -> None:
        self.wait += wait
        self.utts += utts
        self.steps += 1
        self.frames.append(frames)
        self.losses.append(loss)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A block whose time is no step's (a checkpoint, the dev set): the device finishes
        the steps before it starts."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        try:
            yield
        finally:
            self.began += time.perf_counter() - started

    def line(self) -> str:
        loss = frames = 0.0
        if self.steps:
            sums = torch.stack([torch.stack(self.losses).double().sum(), torch.stack(self.frames).double().sum()])
            loss, frames = sums.tolist()
        seconds = max(time.perf_counter() - self.began, 1e-9)
        return (
            f"loss {loss / max(1, self.steps):.3f} {self.utts / seconds:.0f} utts/s {frames / seconds:.0f} "
            f"frames/s data-wait {self.wait / seconds:.1%}"
        )


class StepRecords:
    """``--steps-file``: a line a step (its batch's keys, loss and learning rate), written when
    the losses are read anyway (a log line, a checkpoint, the run's end): one read for all the
    steps since. Without a file it keeps nothing."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.pending: list[tuple[int, list[str], torch.Tensor, float]] = []

    def add(self, step: int, keys: Sequence[str], loss: torch.Tensor, rate: float) -> None:
        if self.file is not None:
            self.pending.append((step, list(keys), loss, rate))

    def write(self) -> None:
        if not self.pending:
            return
        losses = torch.stack([loss for _, _, loss, _ in self.pending]).tolist()
        for (step, keys, _, rate), loss in zip(self.pending, losses):
            self.file.write(json.dumps({"step": step, "keys": keys, "loss": loss, "lr": rate}) + "\n")
        self.pending.clear()


def lr_schedule(step: int, warmup: int) -> float:
    """Linear warm-up, then inverse square root decay (a multiplier of the peak rate)."""
    step = max(step, 1)
    return min(step / max(1, warmup), math.sqrt(max(1, warmup) / step))


def planned_utts(loader: Any) -> int | None:
    """The utterances the loader plans for the rest of the epoch it runs next, where it can
    tell without walking its plan (a shard loader counts them from the shards' index); else
    None: a progress bar without a total."""
    planned = getattr(loader, "planned_utts", None)
    return planned() if planned is not None else None


def evaluate(model: nn.Module, dev: Any, loss_of: Any, epoch: int, device: torch.device) -> float:
    """Mean dev loss per utterance over every rank's part of the dev set."""
    model.eval()
    dev.set_epoch(epoch)
    total = torch.zeros(2, dtype=torch.float64, device=device)  # loss x utterances, utterances: read once
    with torch.no_grad():
        for batch in dev:
            count = len(batch["keys"])
            total[0] += loss_of(model, batch).double() * count
            total[1] += count
    if dist.is_initialized():
        dist.all_reduce(total)
    loss, count = total.tolist()
    return loss / max(count, 1)


@dataclass
class Run:
    """A run of the trainer as set-up made it (``train_setup.set_up``), with the epoch it runs
    next and the optimizer steps done."""

    args: argparse.Namespace
    device: torch.device
    loader: Any
    dev: Any
    model: nn.parallel.DistributedDataParallel
    optimizer: Any
    guard: MemoryGuard
    settings: dict[str, Any]
    recorded: dict[str, dict[str, Any]]  # what the checkpoint records of the settings
    checkpoint_path: Path
    epoch: int
    step: int
    records: StepRecords

    def __post_init__(self) -> None:
        rank = dist.get_rank()
        self.meter = LogLineMeter(self.device)
        self.ctc = nn.CTCLoss(zero_infinity=True)
        self.runner = StepRunner(
            self.model, self.loss_of, self.guard, lambda text: line(f"rank {rank} step {self.step + 1}: {text}")
        )
        self.steps_this_run = 0

    def loss_of(self, module: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """The batch's loss; the CTC loss takes the lengths where the batch has them (on the
        host, it reads none from the GPU)."""
        lengths, device = batch["feat_lens"], self.device
        log_probs, _ = module(batch["feats"].to(device, non_blocking=True), lengths.to(device, non_blocking=True))
        targets = batch["labels"].to(device, non_blocking=True)
        return self.ctc(
            log_probs.transpose(0, 1), targets, self.model.module.output_lengths(lengths), batch["label_lens"]
        )

    def log(self) -> None:
        self.records.write()
        say(f"epoch {self.epoch} step {self.step} {self.meter.line()} {memory_line(self.guard, self.device)}")
        self.meter.reset()

    def run_epoch(self, skips: SkipRanges, preemption: Preemption) -> bool:
        """Train epoch ``self.epoch``, evaluate the dev set and save: True; False when the run
        stops inside the epoch (saved)."""
        self.loader.set_epoch(self.epoch)
        self.meter.reset()
        while True:  # an iteration of the epoch; again after a range of steps is skipped
            skips.check_epoch(self.step, self.epoch, self.settings["epochs"], self.device)
            self.step = skips.skip(self.step)
            self.model.train()
            with Progress(dist.get_rank() == 0, interval=30) as bars:
                advance = bars.bar(f"epoch {self.epoch}", planned_utts(self.loader), unit="utt", exact=False)
                for batch, waited in timed(self.loader):
                    self.train_step(batch, waited)
                    advance(len(batch["keys"]))
                    if self.stops(preemption):
                        return False
                    if skips.at(self.step + 1) is not None:
                        break  # the loader moves on from its state after this step
                else:
                    break  # the epoch's batches are done
            self.loader.load_state_dict(self.loader.state_dict())
        if self.meter.steps:
            self.log()
        if self.dev is not None:
            with self.meter.paused():
                loss = evaluate(self.model, self.dev, self.loss_of, self.epoch, self.device)
                say(f"epoch {self.epoch} dev loss {loss:.3f}")
        self.epoch += 1
        self.save_checkpoint(self.epoch)  # the epoch is done: a resume starts the next one
        say(f"epoch {self.epoch - 1} done at step {self.step}, checkpoint saved")
        return True

    def train_step(self, batch: dict[str, Any], waited: float) -> None:
        """One optimizer step on ``batch`` (``waited``: the seconds the loop waited for it)."""
        self.optimizer.zero_grad()
        loss = self.runner.backward(batch)
        rate = self.settings["lr"] * lr_schedule(self.step, self.settings["warmup_steps"])  # a function of the step
        for group in self.optimizer.param_groups:
            group["lr"] = rate
        self.optimizer.step()
        self.step += 1
        self.steps_this_run += 1
        self.meter.add(waited, len(batch["keys"]), batch["feat_lens"].sum(), loss)
        self.records.add(self.step, batch["keys"], loss, rate)

    def save_checkpoint(self, next_epoch: int) -> None:
        """The run's state saved (by rank 0; every rank calls it at the same step: the loader's
        and the memory guard's states are collectives); ``next_epoch``: the epoch a resume runs
        (the current one, or the next when it is done). One all-reduce a save besides: a
        checkpoint rank 0 cannot write stops every rank with a message."""
        self.records.write()
        with self.meter.paused():
            loader_state = self.loader.state_dict()
            memory = self.guard.state(self.device)

            def write() -> None:
                if dist.get_rank() == 0:
                    state = {"model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict()}
                    state |= {"settings": self.recorded, "loader": loader_state, "epoch": next_epoch}
                    write_checkpoint(self.checkpoint_path, state | {"step": self.step, "memory": memory})

            together(write, self.device, "save the checkpoint")

    def stops(self, preemption: Preemption) -> bool:
        """After a step: its log line and checkpoint when due; True when the run stops here
        (``--stop-after-steps``, or a signal the ranks agreed on), its checkpoint saved."""
        limit = self.args.stop_after_steps
        stopping = limit is not None and self.steps_this_run >= limit
        signalled = preemption.agreed()
        if self.step % self.settings["log_every"] == 0:
            self.log()
        if self.step % self.settings["save_every"] == 0 or stopping or signalled:
            self.save_checkpoint(self.epoch)
            say(f"epoch {self.epoch} step {self.step} checkpoint saved")
        if signalled:
            line(f"rank {dist.get_rank()}: {signalled}: stopped after step {self.step}, checkpoint saved")
        elif stopping:
            say(
                f"stopped after {counted(self.steps_this_run, 'step')} of this run (--stop-after-steps); run again to go on"
            )
        return bool(stopping or signalled)
