"""The example trainer: a small CTC model (convolutional subsampling + LSTM layers) trained
with DDP from seqshard loaders, with a dev set evaluated each epoch.

    torchrun --nproc_per_node 2 -m seqshard.app.trainer --config hyper-p.json --out exp/
    python -m seqshard.app.trainer                   # one process, a made-up corpus in train-out/

(``examples/train_ddp.py`` in a clone of the repository runs this module too.)

Checkpoints (``OUT/ckpt.pt``) hold the model, optimizer, loader state, epoch and step, and the
settings they were trained with (model shape, tokenizer fingerprint, learning rate schedule);
run the same command again after a crash and it goes on with exactly the next batch. A resume
with other settings names each change: a new learning rate or schedule is applied from the
next step, another model shape or tokenizer is refused.
Every ``log_every`` steps rank 0 prints loss, utterances/s, frames/s and the **data-wait
fraction**: the time spent waiting for the next batch over the step time, the number that says
whether the loader starves the model. Runs on CPU (gloo) or GPU (nccl), under torchrun or as
one process. A step does not wait for the GPU's bookkeeping: losses and frames are read once a
log line, DDP all-reduces the gradients during the backward pass (:class:`StepRunner`), the
ranks agree on a preemption without waiting (:class:`Preemption`), and the progress bar counts
planned utterances without walking the epoch's plan.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import SeqshardError, counted
from .train_epoch import say
from .train_memory import preflight
from .train_setup import init_distributed, set_up
from .train_stops import Preemption, SkipRanges, step_range


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--config", help="hyper-p.json (train.option); default: a made-up corpus in OUT/data")
    parser.add_argument("--out", type=Path, default=Path("train-out"), help="folder for checkpoints (and demo data)")
    parser.add_argument("--demo-utts", type=int, default=600, help="utterances of the made-up corpus")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override a train.option key")
    parser.add_argument(
        "--stop-after-steps", type=int, help="end this run after N steps, with a checkpoint; running again goes on"
    )
    parser.add_argument(
        "--steps-file", type=Path, help="write every step's batch keys, loss and learning rate here (JSON lines)"
    )
    parser.add_argument(
        "--no-preflight",
        dest="preflight",
        action="store_false",
        help="do not run a step on the shape of the epoch's heaviest batches before training",
    )
    parser.add_argument(
        "--skip-steps",
        type=step_range,
        action="append",
        default=[],
        metavar="A-B",
        help="skip the batches of steps A to B (counted from 1, within one epoch) without reading them: a loss "
        "spike's; give it again for more ranges",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the model trains (auto: cuda when there is a GPU); on cuda the loader hands batches over on it",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Train; then leave the process at once (see the comment at the end)."""
    args = parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        print("error: --device cuda, and torch finds no CUDA device here", file=sys.stderr)
        return 1
    torch.set_flush_denormal(True)  # on CPU, denormal values in a training LSTM slowed steps 5x
    preemption = Preemption()  # before the rendezvous, which may take long, and before any worker process starts
    init_distributed(cuda)
    try:
        preemption.connect()
        code = train(args, cuda, preemption)
        preemption.finish()
        dist.barrier()  # every rank is past its last collective
    except SeqshardError as error:
        print(f"error: {error}", file=sys.stderr)
        code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without tearing gloo down: destroying the process group, or the interpreter's own
    # teardown, aborted a rank now and then after training had finished ("terminate called
    # without an active exception", SIGABRT) on a loaded machine. Checkpoints and the steps
    # file are complete by now; worker processes notice their parent is gone and exit.
    os._exit(code)


def train(args: argparse.Namespace, cuda: bool, preemption: Preemption) -> int:
    """Set up (or resume), preflight, then the epochs to the last or to a stop."""
    run = set_up(args, cuda)
    if run is None:
        return 0
    if args.preflight:
        vocab_size = run.recorded["model"]["vocab_size"]
        preflight(run.loader, run.runner, run.loader.dim, vocab_size, run.device, say)
    skips = SkipRanges(args.skip_steps, run.loader, say)
    skips.note_done(run.step)
    while run.epoch < run.settings["epochs"]:
        if not run.run_epoch(skips, preemption):
            return 0
    say(f"finished: {counted(run.settings['epochs'], 'epoch')}, {counted(run.step, 'step')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
