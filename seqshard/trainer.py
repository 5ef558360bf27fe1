"""The example trainer: a small CTC model (convolutional subsampling + LSTM layers) trained
with DDP from seqshard loaders, with a dev set evaluated each epoch.

    torchrun --nproc_per_node 2 -m seqshard.trainer --config hyper-p.json --out exp/
    python -m seqshard.trainer                       # one process, a made-up corpus in train-out/

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
import contextlib
import hashlib
import json
import math
import os
import pickle
import re
import signal
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .checks import NumberError, check_number, read_number
from .config import apply_overrides, build_loaders, load_config, read_json
from .errors import ConfigError, SeqshardError, StateMismatchError, counted
from .formats.budgets import LengthBuckets
from .pipeline.stages.split import split_batch
from .pipeline.workers.setup import bucket_bounds
from .progress import Progress
from .text.tokenizers import Tokenizer, UnitsTokenizer, make_tokenizer
from .tools.calibrate import device_name, free_memory, peak_memory, reset_peak, synthetic_batch, within_memory

#: sections of a checkpoint's recorded settings whose change a resume refuses (the saved weights
#: cannot take it); changes of the others (schedule, run) are applied with a note
REFUSED_CHANGES = ("model", "tokenizer")


class SmallCTC(nn.Module):
    """Per-frame normalisation, two strided convolutions (4x fewer frames), LSTM layers, a
    linear output for CTC. Padding frames are zeroed before each convolution, so an utterance's
    outputs do not depend on how far its batch is padded (a batch run in parts gives the
    gradients of the whole)."""

    def __init__(self, dim: int, vocab: int, hidden: int = 256, layers: int = 2):
        super().__init__()
        self.normalise = nn.LayerNorm(dim)
        self.subsample = nn.Sequential(
            nn.Conv1d(dim, hidden, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv1d(hidden, hidden, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        self.lstm = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True)
        self.output = nn.Linear(hidden, vocab)

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.normalise(feats).transpose(1, 2)  # B x D x T
        for convolution, activation in zip(self.subsample[::2], self.subsample[1::2]):
            hidden = activation(convolution(hidden.masked_fill(~_mask(lengths, hidden.shape[2]), 0.0)))
            lengths = _strided(lengths)
        hidden, _ = self.lstm(hidden.transpose(1, 2))
        return self.output(hidden).log_softmax(-1), lengths

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """The frames of each utterance's output (what :meth:`forward` gives with its output),
        where ``lengths`` is: from lengths on the host, the CTC loss reads none from the GPU."""
        for _ in self.subsample[::2]:
            lengths = _strided(lengths)
        return lengths


def _strided(lengths: torch.Tensor) -> torch.Tensor:
    """Frames after a convolution of stride 2 (kernel 3, padding 1)."""
    return (lengths + 1) // 2


def _mask(lengths: torch.Tensor, frames: int) -> torch.Tensor:
    """B x 1 x frames: True on each utterance's frames, False on its padding."""
    return (torch.arange(frames, device=lengths.device) < lengths[:, None]).unsqueeze(1)


def timed(batches: Any) -> Iterator[tuple[Any, float]]:
    """Each batch of ``batches`` with the seconds spent waiting for it."""
    iterator = iter(batches)
    while True:
        started = time.perf_counter()
        batch = next(iterator, None)
        if batch is None:
            return
        yield batch, time.perf_counter() - started


class FeedMeter:
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


def demo_config(folder: Path, num_utts: int) -> dict[str, Any]:
    """A made-up corpus (features drawn from the label characters), packed; its config."""
    from .demo import make_corpus
    from .prep.pack import pack_data

    shards = folder / "shards"
    if not (shards / "pack_report.json").exists():
        make_corpus(folder / "kaldi", num_utts)
        make_corpus(folder / "dev", max(20, num_utts // 10), seed=1)
        pack_data(folder / "kaldi/feats.scp", folder / "kaldi/text", shards, utts_per_file=100, progress=False)
    option = {
        "large_dataset": True,
        "trset": f"{shards}/data-*.tar",
        "devset": str(folder / "dev"),
        "tokenizer": str(folder / "kaldi/units.txt"),
        "batch_frames": 20000,
        "num_workers": 2,
    }
    return {"train": {"option": option}}


def init_distributed(cuda: bool) -> None:
    backend = "nccl" if cuda else "gloo"
    if "WORLD_SIZE" in os.environ:  # torchrun (or any launcher setting RANK, WORLD_SIZE, MASTER_*)
        dist.init_process_group(backend)
    else:  # one process, no launcher
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


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


def load_settings(args: argparse.Namespace, rank: int) -> tuple[dict[str, Any], str]:
    """The config (a file, or the made-up corpus's) with ``--set`` overrides applied, checked
    as the file is; and how messages name it."""
    if args.config is not None:
        name = str(args.config)
        config = read_json(Path(args.config))
    else:
        name = "the made-up corpus's config"
        args.out.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            demo_config(args.out / "data", args.demo_utts)
        dist.barrier()
        config = demo_config(args.out / "data", args.demo_utts)  # made by rank 0: paths only
    return apply_overrides(config, name, args.set), name + (" with --set" if args.set else "")


def line(text: str) -> None:
    """Print ``text`` as one write (ranks share one output: two writes of theirs could interleave)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A short hash of which token has which id: a units file's units, ids and split, or a
    SentencePiece model's bytes (a tokenizer of the same size with other ids differs)."""
    if isinstance(tokenizer, UnitsTokenizer):
        content = json.dumps([sorted(tokenizer.ids.items()), tokenizer.split]).encode()
    else:
        content = Path(tokenizer.model).read_bytes()
    return hashlib.sha256(content).hexdigest()[:16]


def input_dim(loader: Any, name: str) -> int:
    """The model's input size: the columns of the loader's ``feats``; ConfigError when its
    batches hold no feature vectors (audio read as waveforms)."""
    if loader.dim is None:
        raise ConfigError(
            f"{name}: the trainer's model reads feature vectors, and these batches hold none (shards of audio are "
            'batched as waveforms): set train.option.features to "fbank".'
        )
    return int(loader.dim)


def run_settings(settings: dict[str, Any], dim: int | None, tokenizer: Tokenizer) -> dict[str, dict[str, Any]]:
    """What a checkpoint records of the run, by section (see :func:`changes_since`)."""
    return {
        "model": {
            "dim": dim,
            "vocab_size": tokenizer.vocab_size,
            "hidden": settings["hidden"],
            "layers": settings["layers"],
        },
        "tokenizer": {"tokenizer ids": tokenizer_fingerprint(tokenizer)},
        "schedule": {"lr": settings["lr"], "warmup_steps": settings["warmup_steps"]},
        "run": {key: settings[key] for key in ("epochs", "save_every", "log_every")},
    }


def changes_since(path: Path, saved: dict[str, Any] | None, current: dict[str, dict[str, Any]]) -> str | None:
    """A line naming the settings changed since the checkpoint at ``path`` was saved (they
    apply from the next step), None when none did; a change of model shape or tokenizer,
    which the saved weights cannot take, raises ConfigError."""
    if saved is None:
        return f"{path} records no settings (saved by an older trainer): changes since then are not checked"
    refused, applied = [], []
    for section, values in current.items():
        for key, value in values.items():
            before = saved.get(section, {}).get(key)
            if before != value:
                (refused if section in REFUSED_CHANGES else applied).append(f"{key} {before} -> {value}")
    if refused:
        tokenizer = " (and the tokenizer file it began with)" if saved.get("tokenizer") != current["tokenizer"] else ""
        raise ConfigError(
            f"{path} was trained with another model shape or tokenizer: {'; '.join(refused)}. Its weights cannot "
            f"take that: set them back as they were{tokenizer}, or give another --out to train afresh."
        )
    if not applied:
        return None
    return f"settings changed since the checkpoint, applied from the next step: {'; '.join(applied)}"


def check_outputs(args: argparse.Namespace, rank: int) -> Any:
    """``--stop-after-steps`` and ``--out`` checked; ``--steps-file`` opened on rank 0 to append
    a line a step (None elsewhere, or without one). ConfigError naming what is wrong."""
    check_number("--stop-after-steps", args.stop_after_steps, whole=True, at_least=1, optional=True)
    if args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out} is a file: give a folder for the checkpoint (and the made-up corpus).")
    if args.steps_file is None or rank != 0:
        return None
    try:
        return args.steps_file.open("a", buffering=1)
    except OSError as error:
        raise ConfigError(
            f"--steps-file {args.steps_file} cannot be written ({error.strerror}): give a file."
        ) from None


def said(error: BaseException) -> str:
    """What ``error`` says, short: its first two lines to the end of their first sentence, 200
    characters at most."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()][:2]
    text = " ".join(lines).split(". ")[0] if lines else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


CHECKPOINT_KEYS = ("model", "optimizer", "loader", "epoch", "step")


def read_checkpoint(path: Path, device: torch.device) -> dict[str, Any]:
    """The trainer's checkpoint at ``path``, tensors and plain values only (no code in it
    runs); ConfigError naming it and the fix when it is cut short, another program's, or its
    counters are not counts."""
    fix = f"move it away (mv {path} {path}.bad) to train afresh from step 0, or give another --out"
    if not path.is_file():
        raise ConfigError(f"{path} is not a regular file, so no checkpoint: {fix}.")
    try:
        checkpoint = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError:  # torch's weights-only reader refuses what is not a tensor or a plain value
        raise ConfigError(
            f"{path} holds other objects than tensors and plain values, not this trainer's: {fix}."
        ) from None
    except Exception as error:  # a cut zip (RuntimeError), an empty file (EOFError), ...
        raise ConfigError(f"{path} cannot be read as a checkpoint ({said(error)}; cut short?): {fix}.") from None
    missing = [key for key in CHECKPOINT_KEYS if not isinstance(checkpoint, dict) or key not in checkpoint]
    if missing:
        raise ConfigError(f"{path} is not a checkpoint of this trainer (it holds no {', '.join(missing)}): {fix}.")
    try:
        for key in ("epoch", "step"):
            read_number(key, checkpoint[key], whole=True, at_least=0, at_most=2**62)
    except NumberError as error:
        raise ConfigError(f"{path}: its {error}: {fix}.") from None
    if not isinstance(checkpoint["loader"], dict):
        raise ConfigError(f"{path}: its loader state is a {type(checkpoint['loader']).__name__}, not a dict: {fix}.")
    return checkpoint


def restore(path: Path, checkpoint: dict[str, Any], model: nn.Module, optimizer: Any, loader: Any) -> None:
    """The checkpoint's weights, optimizer state and, when it was saved inside the epoch it
    runs next, the loader's position; ConfigError when they do not fit this run (a checkpoint
    of an older trainer records no settings to compare)."""
    try:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ConfigError(
            f"{path} holds a model or optimizer state this run's model cannot take ({said(error)}): set the model "
            "settings (hidden, layers, the tokenizer) back as they were, or give another --out to train afresh."
        ) from None
    if checkpoint["loader"].get("epoch") == checkpoint["epoch"]:  # saved inside this epoch: go on at the next batch
        try:
            loader.load_state_dict(checkpoint["loader"])  # every rank's position
        except StateMismatchError as error:
            raise ConfigError(
                f"{path}: {error} (the example trainer: set the loader's settings back as they were, or give another "
                "--out to train afresh)"
            ) from None


def lr_schedule(step: int, warmup: int) -> float:
    """Linear warm-up, then inverse square root decay (a multiplier of the peak rate)."""
    step = max(step, 1)
    return min(step / max(1, warmup), math.sqrt(max(1, warmup) / step))


# -- memory: batches run in parts when a step runs out of memory ---------------------------------


def largest_part(lengths: torch.Tensor, parts: int) -> int:
    """Padded frames (samples x longest) of the largest of ``parts`` parts of a batch whose
    utterances have ``lengths`` (cut as :func:`seqshard.split_batch` cuts)."""
    return max(
        len(part["feat_lens"]) * int(part["feat_lens"].max()) for part in split_batch({"feat_lens": lengths}, parts)
    )


class MemoryGuard:
    """Per length bucket (cut at ``bounds``), the padded frames (batch size x longest length)
    above which a batch runs in parts: lowered when a step runs out of memory and kept in the
    checkpoint (``memory``), so that the rest of the run, resumed or not, splits such batches
    before they run out again. Also the largest batch seen per bucket, and how many times a
    step ran out of memory."""

    def __init__(self, bounds: Sequence[int] = ()):
        self.bounds = tuple(int(bound) for bound in bounds)
        self.bucket_of = LengthBuckets(self.bounds).bucket_of  # a batch's bucket by its longest length
        self.limits: dict[int, int] = {}
        self.largest: dict[int, tuple[int, int]] = {}  # bucket -> (samples, longest) of its largest batch
        self.out_of_memory = 0

    def parts_for(self, lengths: torch.Tensor, longest: int) -> int:
        """How many parts a batch of utterances of ``lengths``, the longest of ``longest`` frames,
        runs in: 1, or the fewest (doubling) whose largest is within its bucket's limit (the
        lengths are read only in a bucket that has one: after it ran out of memory)."""
        limit = self.limits.get(self.bucket_of(longest))
        parts = 1
        while limit is not None and parts < len(lengths) and largest_part(lengths, parts) > limit:
            parts *= 2
        return parts

    def lower(self, longest: int, padded: int) -> None:
        """A batch whose longest has ``longest`` frames ran (in parts) with ``padded`` frames at most."""
        bucket = self.bucket_of(longest)
        self.limits[bucket] = min(self.limits.get(bucket, padded), padded)

    def note(self, size: int, longest: int) -> None:
        bucket = self.bucket_of(longest)
        samples, frames = self.largest.get(bucket, (0, 0))
        if size * longest > samples * frames:
            self.largest[bucket] = (size, longest)

    def describe_largest(self) -> str:
        return " ".join(f"{bucket}:{size}x{longest}" for bucket, (size, longest) in sorted(self.largest.items()))

    def state(self, device: torch.device) -> dict[str, Any]:
        """What the checkpoint keeps: each bucket's limit, the lowest any rank found (a collective)."""
        unset = 2**62
        limits = torch.tensor([self.limits.get(b, unset) for b in range(len(self.bounds) + 1)], device=device)
        if dist.get_world_size() > 1:
            dist.all_reduce(limits, op=dist.ReduceOp.MIN)
        self.limits = {b: int(v) for b, v in enumerate(limits.tolist()) if v != unset}
        return {"bounds": list(self.bounds), "limits": {str(b): v for b, v in self.limits.items()}}

    def load(self, state: Any) -> None:
        """The limits of a checkpoint (none kept where its buckets are not these: they are
        learnt again at the first out-of-memory step)."""
        limits = state.get("limits") if isinstance(state, dict) and state.get("bounds") == list(self.bounds) else None
        if isinstance(limits, dict) and all(str(b).isdigit() and isinstance(v, int) for b, v in limits.items()):
            self.limits = {int(b): int(v) for b, v in limits.items()}


def length_buckets(loader: Any) -> tuple[int, ...]:
    """The bounds of the loader's length buckets: its budgets', else ``num_buckets`` of equal
    mass from the shards' length histogram, else one bucket."""
    options, table = getattr(loader, "options", None), getattr(loader, "table", None)
    if options is None:  # a map-style or token loader: one bucket
        return ()
    if options.batching.budgets is not None:
        return options.batching.budgets.bounds
    if table is not None and table.length_hist:
        return bucket_bounds(table, options.batching.num_buckets)
    return ()


def budgets_elsewhere(loader: Any, device: torch.device) -> str | None:
    """A line when the loader's budgets (``seqshard calibrate``) were found on another device
    than ``device`` (another kind, or another GPU model): its batches may not fit there."""
    batching = getattr(getattr(loader, "options", None), "batching", None)
    budgets = getattr(batching, "budgets", None)
    if budgets is None or budgets.device is None:
        return None
    here = device_name(str(device))
    if re.sub(r"^cuda:\d+", "cuda", budgets.device) == re.sub(r"^cuda:\d+", "cuda", here):
        return None
    return (
        f"note: the budgets were calibrated on {budgets.device} and this run trains on {here}: batches may not fit "
        f"(or leave memory unused); calibrate again here (`seqshard calibrate ... --device {device.type}`)"
    )


class StepRunner:
    """A training step's forward and backward passes under DDP. A batch runs in the parts its
    bucket's limit (:class:`MemoryGuard`) says: all but the last under ``no_sync`` (their
    gradients add up on this rank), the last with DDP's all-reduce, which sends each bucket of
    gradients as the backward pass fills it. When memory runs out before DDP's forward of the
    last part has armed its all-reduce, the batch runs again in twice as many parts; after it
    (in the loss or that backward pass, when buckets may have gone and the other ranks wait for
    the rest), the gradients DDP has not taken yet are computed again in smaller parts apart
    from DDP and handed to its hooks, so that the all-reduce ends as it would have: with the
    whole batch's gradients on every rank, and no rank but this one learns of it. Either way the
    bucket's limit is lowered; never a batch skipped. ``loss_of(model, batch)``: the batch's
    mean loss through ``model`` (the DDP module, or the model it wraps)."""

    def __init__(self, model: nn.Module, loss_of: Any, guard: MemoryGuard, report: Any):
        self.model, self.loss_of, self.guard, self.report = model, loss_of, guard, report
        self.module = getattr(model, "module", model)  # the model DDP wraps
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.taken: set[int] = set()  # ids of the parameters whose gradient this backward pass has accumulated
        self.armed = False  # DDP's forward has armed its all-reduce for the backward pass to come
        for param in self.params:
            param.register_post_accumulate_grad_hook(lambda p: self.taken.add(id(p)))
        model.register_forward_hook(self._forwarded)

    def _forwarded(self, model: nn.Module, inputs: Any, output: Any) -> None:
        self.armed = torch.is_grad_enabled() and getattr(model, "require_backward_grad_sync", False)

    def backward(self, batch: dict[str, Any], sync: bool = True) -> torch.Tensor:
        """The batch's loss (on the device, not read) and its gradients in the parameters:
        averaged over the ranks by DDP, or (``sync`` False: the preflight) this rank's alone."""
        size, longest = batch["feats"].shape[:2]  # the padded batch's shape: its lengths are not read
        parts = self.guard.parts_for(batch["feat_lens"], longest)
        ran_out = False
        while (loss := self._attempt(batch, parts, sync, longest)) is None:
            if parts >= size:
                raise torch.OutOfMemoryError(f"one utterance of {longest} frames does not fit in memory")
            self.model.zero_grad(set_to_none=True)
            free_memory()
            parts, ran_out = min(parts * 2, size), True
            self._ran_out(size, longest, f"running it in {parts} parts")
        if ran_out:
            self.guard.lower(longest, largest_part(batch["feat_lens"], parts))
        self.guard.note(size, longest)
        return loss

    def _attempt(self, batch: dict[str, Any], parts: int, sync: bool, longest: int) -> torch.Tensor | None:
        """The batch run in ``parts``: its loss, or None when memory ran out before DDP's
        all-reduce was armed (the gradients so far are to be dropped)."""
        pieces = split_batch(batch, parts) if parts > 1 else [batch]
        size, total = len(batch["keys"]), None
        for number, piece in enumerate(pieces, 1):
            synced = sync and number == len(pieces)
            self.taken.clear()
            self.armed = False
            with contextlib.nullcontext() if synced else getattr(self.model, "no_sync", contextlib.nullcontext)():
                fitted, loss = within_memory(self._piece, piece, size)
            if not fitted and not self.armed:
                return None
            if not fitted:
                loss = self._hand_over(piece, size, longest)
            total = loss if total is None else total + loss
        return total

    def _piece(self, piece: dict[str, Any], size: int) -> torch.Tensor:
        loss = self.loss_of(self.model, piece) * (len(piece["keys"]) / size)
        loss.backward()
        return loss.detach()

    def _hand_over(self, piece: dict[str, Any], size: int, longest: int) -> torch.Tensor:
        """Memory ran out with DDP's all-reduce armed: the gradients of ``piece`` for the
        parameters DDP has not taken, computed again in 2, 4, ... parts through the wrapped
        model (``torch.autograd.grad`` runs none of DDP's hooks), then accumulated as the
        backward pass would have, which runs DDP's hooks: the buckets it owes go out. The
        piece's loss."""
        waiting = [p for p in self.params if id(p) not in self.taken]
        count = len(piece["keys"])
        parts = min(2, count)
        while not (found := within_memory(self._gradients, piece, size, parts, waiting))[0]:
            if parts >= count:
                raise torch.OutOfMemoryError(f"one utterance of {longest} frames does not fit in memory")
            parts = min(parts * 2, count)
        loss, gradients = found[1]
        if waiting:
            torch.autograd.backward(waiting, gradients)
        self._ran_out(len(piece["keys"]), longest, f"its gradients computed again in {parts} parts")
        self.guard.lower(longest, largest_part(piece["feat_lens"], parts))
        return loss

    def _gradients(
        self, piece: dict[str, Any], size: int, parts: int, params: list[nn.Parameter]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The loss of ``piece`` and its gradients for ``params``, in ``parts``, apart from DDP."""
        loss, sums = None, None
        for part in split_batch(piece, parts) if parts > 1 else [piece]:
            value = self.loss_of(self.module, part) * (len(part["keys"]) / size)
            found = torch.autograd.grad(value, params, materialize_grads=True) if params else ()
            sums = list(found) if sums is None else [total.add_(more) for total, more in zip(sums, found)]
            loss = value.detach() if loss is None else loss + value.detach()
        return loss, sums  # type: ignore[return-value]

    def _ran_out(self, size: int, longest: int, then: str) -> None:
        self.guard.out_of_memory += 1
        self.report(f"out of memory on a batch of {size} x {longest} frames: {then}")


# -- preemption and skipped steps -----------------------------------------------------------------


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


def preflight(loader: Any, runner: StepRunner, dim: int, vocab_size: int, device: torch.device, say: Any) -> None:
    """One step (forward and backward, no update) on a synthetic batch of the shape of the
    epoch's heaviest batch by padded frames and of its longest, so that a batch that does not
    fit shows now, not hours into the run (it runs in parts, and its bucket's limit is lowered)."""
    try:
        planned = loader.heaviest_batches(2**31 - 1, by="padded")
    except (AttributeError, ConfigError) as error:  # a map-style loader has no plan; a plan may be refused
        say(
            f"preflight skipped: {error if isinstance(error, ConfigError) else 'the loader has no plan of its batches'}"
        )
        return
    if not planned:
        return
    shapes = dict.fromkeys((b.size, b.longest) for b in (planned[0], max(planned, key=lambda b: b.longest)))
    before = runner.guard.out_of_memory
    for size, longest in shapes:
        runner.backward(synthetic_batch(size, longest, dim, vocab_size, device), sync=False)  # ranks apart: no update
        runner.model.zero_grad(set_to_none=True)
    shown = ", ".join(f"{size} x {longest}" for size, longest in shapes)
    verdict = "fit" if runner.guard.out_of_memory == before else "ran out of memory: such batches run in parts"
    say(f"preflight: the epoch's heaviest batches ({shown} frames) {verdict}")


def train(args: argparse.Namespace, cuda: bool, preemption: Preemption) -> int:
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    def say(message: str) -> None:
        if rank == 0:
            line(message)

    steps_file = check_outputs(args, rank)
    checkpoint_path = args.out / "ckpt.pt"
    config, name = load_settings(args, rank)
    option = config["train"]["option"]
    if cuda and option.get("large_dataset"):  # shards: batches handed over on this GPU (unless the config says)
        option.setdefault("device", str(device))
    loader, dev = build_loaders(config, name=name)
    guard = MemoryGuard(length_buckets(loader))
    elsewhere = budgets_elsewhere(loader, device)
    if elsewhere is not None:
        say(elsewhere)
    loaded = load_config(config, name=name)
    settings = loaded.trainer
    if loaded.data["tokenizer"] is None:
        raise ConfigError(f"{name}: the trainer needs train.option.tokenizer (its CTC targets are token ids).")
    tokenizer = make_tokenizer(loaded.data["tokenizer"], loaded.loader.get("split"))
    dim = input_dim(loader, name)
    recorded = run_settings(settings, dim, tokenizer)
    checkpoint, epoch, step, changes = None, 0, 0, None  # epoch: the one to run next; step: optimizer steps done
    if checkpoint_path.exists():
        checkpoint = read_checkpoint(checkpoint_path, device)
        epoch, step = checkpoint["epoch"], checkpoint["step"]
        if epoch >= settings["epochs"]:
            say(
                f"{checkpoint_path} is the checkpoint of a finished run: all {counted(epoch, 'epoch')} done, "
                f"{counted(step, 'step')}; "
                f"nothing to train (set epochs above {epoch} to train on, or remove it to start afresh)"
            )
            return 0
        changes = changes_since(checkpoint_path, checkpoint.get("settings"), recorded)
    args.out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(int(config["train"]["option"].get("seed", 0)))
    model = nn.parallel.DistributedDataParallel(
        SmallCTC(dim, tokenizer.vocab_size, settings["hidden"], settings["layers"]).to(device),
        device_ids=[device.index] if cuda else None,
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=settings["lr"])
    if checkpoint is not None:
        restore(checkpoint_path, checkpoint, model.module, optimizer, loader)
    ctc = nn.CTCLoss(zero_infinity=True)

    if checkpoint is not None:
        say(f"resumed from {checkpoint_path}: epoch {epoch}, after step {step}")
        if changes is not None:
            say(changes)
    else:
        say(f"training from scratch: {counted(settings['epochs'], 'epoch')}, checkpoints in {checkpoint_path}")

    def loss_of(module: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """The batch's loss; the CTC loss takes the lengths where the batch has them (on the
        host, it reads none from the GPU)."""
        lengths = batch["feat_lens"]
        log_probs, _ = module(batch["feats"].to(device, non_blocking=True), lengths.to(device, non_blocking=True))
        targets = batch["labels"].to(device, non_blocking=True)
        return ctc(log_probs.transpose(0, 1), targets, model.module.output_lengths(lengths), batch["label_lens"])

    meter, records = FeedMeter(device), StepRecords(steps_file)

    def save(next_epoch: int) -> None:
        """``next_epoch``: the epoch a resume runs (the current one, or the next when it is done)."""
        records.write()
        with meter.paused():
            loader_state = loader.state_dict()  # a collective: every rank calls it at the same step
            memory = guard.state(device)  # a collective too
            if rank == 0:
                temporary = checkpoint_path.with_name(checkpoint_path.name + ".partial")
                state = {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "settings": recorded,
                    "loader": loader_state,
                    "epoch": next_epoch,
                    "step": step,
                    "memory": memory,
                }
                torch.save(state, temporary)
                temporary.replace(checkpoint_path)

    def log() -> None:
        records.write()
        say(f"epoch {epoch} step {step} {meter.line()} {memory_line(guard, device)}")
        meter.reset()

    runner = StepRunner(model, loss_of, guard, lambda text: line(f"rank {rank} step {step + 1}: {text}"))
    if checkpoint is not None:
        guard.load(checkpoint.get("memory"))
    if args.preflight:
        preflight(loader, runner, loader.dim, tokenizer.vocab_size, device, say)
    skips = SkipRanges(args.skip_steps, loader, say)
    skips.note_done(step)
    steps_this_run = 0
    while epoch < settings["epochs"]:
        loader.set_epoch(epoch)
        meter.reset()
        while True:  # an iteration of the epoch; again after a range of steps is skipped
            skips.check_epoch(step, epoch, settings["epochs"], device)
            step = skips.skip(step)
            skipping = False
            model.train()
            with Progress(rank == 0, interval=30) as bars:
                advance = bars.bar(f"epoch {epoch}", planned_utts(loader), unit="utt", exact=False)
                for batch, waited in timed(loader):
                    optimizer.zero_grad()
                    loss = runner.backward(batch)
                    rate = settings["lr"] * lr_schedule(step, settings["warmup_steps"])  # a function of the step
                    for group in optimizer.param_groups:
                        group["lr"] = rate
                    optimizer.step()
                    step += 1
                    steps_this_run += 1
                    meter.add(waited, len(batch["keys"]), batch["feat_lens"].sum(), loss)
                    advance(len(batch["keys"]))
                    records.add(step, batch["keys"], loss, rate)
                    stopping = args.stop_after_steps is not None and steps_this_run >= args.stop_after_steps
                    signalled = preemption.agreed()
                    if step % settings["log_every"] == 0:
                        log()
                    if step % settings["save_every"] == 0 or stopping or signalled:
                        save(epoch)
                        say(f"epoch {epoch} step {step} checkpoint saved")
                    if signalled:
                        line(f"rank {rank}: {signalled}: stopped after step {step}, checkpoint saved")
                        return 0
                    if stopping:
                        say(
                            f"stopped after {counted(steps_this_run, 'step')} of this run (--stop-after-steps); run again to go on"
                        )
                        return 0
                    if skips.at(step + 1) is not None:
                        skipping = True  # the loader moves on from its state after this step
                        break
            if not skipping:
                break
            loader.load_state_dict(loader.state_dict())
        if meter.steps:
            log()
        if dev is not None:
            with meter.paused():
                say(f"epoch {epoch} dev loss {evaluate(model, dev, loss_of, epoch, device):.3f}")
        epoch += 1
        save(epoch)  # the epoch is done: a resume starts the next one
        say(f"epoch {epoch - 1} done at step {step}, checkpoint saved")
    say(f"finished: {counted(settings['epochs'], 'epoch')}, {counted(step, 'step')}")
    return 0


def planned_utts(loader: Any) -> int | None:
    """The utterances the loader plans for the rest of the epoch it runs next, where it can
    tell without walking its plan (a shard loader counts them from the shards' index); else
    None: a progress bar without a total."""
    planned = getattr(loader, "planned_utts", None)
    return planned() if planned is not None else None


def memory_line(guard: MemoryGuard, device: torch.device) -> str:
    """The peak memory since the last line (CUDA's allocations; on CPU the process's peak RSS)
    and the largest batch so far per length bucket (``bucket:samples x longest``)."""
    peak = peak_memory(device)
    reset_peak(device)
    line = f"peak-mem {peak / 2**20:.0f} MiB largest {guard.describe_largest() or '-'}"
    return line + (f" out-of-memory {guard.out_of_memory}" if guard.out_of_memory else "")


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


if __name__ == "__main__":
    sys.exit(main())
