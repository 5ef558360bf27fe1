"""The trainer's set-up: the config (a file, or a made-up corpus's) read with ``--set``
applied, the loaders, tokenizer, model and optimizer made, a checkpoint restored."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checks import check_number
from ..errors import ConfigError, counted
from ..text.tokenizers import make_tokenizer
from ..tools.calibrate import device_name
from .config import apply_overrides, build_loaders, load_config, read_json
from .ctc_model import SmallCTC
from .train_checkpoint import changes_since, read_checkpoint, restore, run_settings
from .train_epoch import Run, StepRecords, say
from .train_memory import MemoryGuard, length_buckets
from .train_stops import together


def demo_config(folder: Path, num_utts: int) -> dict[str, Any]:
    """A made-up corpus (features drawn from the label characters), packed; its config."""
    from ..prep.pack import pack_data
    from .demo import corpus_option, make_corpus

    shards = folder / "shards"
    if not (shards / "pack_report.json").exists():
        make_corpus(folder / "kaldi", num_utts)
        make_corpus(folder / "dev", max(20, num_utts // 10), seed=1)
        pack_data(folder / "kaldi/feats.scp", folder / "kaldi/text", shards, utts_per_file=100, progress=False)
    option = {**corpus_option(folder, f"{shards}/data-*.tar"), "batch_frames": 20000, "num_workers": 2}
    return {"train": {"option": option}}


def init_distributed(cuda: bool) -> None:
    backend = "nccl" if cuda else "gloo"
    if "WORLD_SIZE" in os.environ:  # torchrun (or any launcher setting RANK, WORLD_SIZE, MASTER_*)
        dist.init_process_group(backend)
    else:  # one process, no launcher
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


CPU = torch.device("cpu")


def load_settings(args: argparse.Namespace, rank: int, device: torch.device = CPU) -> tuple[dict[str, Any], str]:
    """The config (a file, or the made-up corpus's, made by rank 0 on ``device``'s group) with
    ``--set`` overrides applied, checked as the file is; and how messages name it."""
    if args.config is not None:
        name = str(args.config)
        config = read_json(Path(args.config))
    else:
        name = "the made-up corpus's config"
        together(lambda: demo_config(args.out / "data", args.demo_utts) if rank == 0 else None, device)
        config = demo_config(args.out / "data", args.demo_utts)  # made by rank 0: paths only
    return apply_overrides(config, name, args.set), name + (" with --set" if args.set else "")


def input_dim(loader: Any, name: str) -> int:
    """The model's input size: the columns of the loader's ``feats``; ConfigError when its
    batches hold no feature vectors (audio read as waveforms)."""
    if loader.dim is None:
        raise ConfigError(
            f"{name}: the trainer's model reads feature vectors, and these batches hold none (shards of audio are "
            'batched as waveforms): set train.option.features to "fbank".'
        )
    return int(loader.dim)


def check_outputs(args: argparse.Namespace, rank: int) -> Any:
    """``--stop-after-steps`` and ``--out`` checked; ``--steps-file`` opened on rank 0 to append
    a line a step (None elsewhere, or without one). ConfigError naming what is wrong."""
    check_number("--stop-after-steps", args.stop_after_steps, whole=True, at_least=1, optional=True)
    if args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out} is a file: give a folder for the checkpoint (and the made-up corpus).")
    args.out.mkdir(parents=True, exist_ok=True)  # before the steps file, which may lie in it
    if args.steps_file is None or rank != 0:
        return None
    try:
        return args.steps_file.open("a", buffering=1)
    except OSError as error:
        raise ConfigError(
            f"--steps-file {args.steps_file} cannot be written ({error.strerror}): give a file."
        ) from None


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


def set_up(args: argparse.Namespace, cuda: bool) -> Run | None:
    """The run ``args`` ask for, from its checkpoint where ``--out`` holds one; None when that
    checkpoint's run is finished (said so)."""
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    steps_file = together(lambda: check_outputs(args, rank), device)
    checkpoint_path = args.out / "ckpt.pt"
    config, name = load_settings(args, rank, device)
    option = config["train"]["option"]
    if cuda and option.get("large_dataset"):  # shards: batches handed over on this GPU (unless the config says)
        option.setdefault("device", str(device))
    loader, dev = build_loaders(config, name=name)
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
    checkpoint = read_checkpoint(checkpoint_path, device) if checkpoint_path.exists() else None
    epoch, step = (checkpoint["epoch"], checkpoint["step"]) if checkpoint is not None else (0, 0)  # steps done
    if checkpoint is not None and epoch >= settings["epochs"]:
        say(
            f"{checkpoint_path} is the checkpoint of a finished run: all {counted(epoch, 'epoch')} done, "
            f"{counted(step, 'step')}; "
            f"nothing to train (set epochs above {epoch} to train on, or remove it to start afresh)"
        )
        return None
    changes = changes_since(checkpoint_path, checkpoint.get("settings"), recorded) if checkpoint is not None else None

    torch.manual_seed(int(option.get("seed", 0)))
    model = nn.parallel.DistributedDataParallel(
        SmallCTC(dim, tokenizer.vocab_size, settings["hidden"], settings["layers"]).to(device),
        device_ids=[device.index] if cuda else None,
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=settings["lr"])
    guard = MemoryGuard(length_buckets(loader))
    if checkpoint is not None:
        restore(checkpoint_path, checkpoint, model.module, optimizer, loader)
        guard.load(checkpoint.get("memory"))
        say(f"resumed from {checkpoint_path}: epoch {epoch}, after step {step}")
        if changes is not None:
            say(changes)
    else:
        say(f"training from scratch: {counted(settings['epochs'], 'epoch')}, checkpoints in {checkpoint_path}")
    records = StepRecords(steps_file)
    return Run(
        args, device, loader, dev, model, optimizer, guard, settings, recorded, checkpoint_path, epoch, step, records
    )
