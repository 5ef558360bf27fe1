"""The trainer's checkpoint (``OUT/ckpt.pt``): what it records of the run, its save, its read
(tensors and plain values only: no code in it runs) and its restore, with the settings
changed since named."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checks import NumberError, read_number
from ..errors import ConfigError, StateMismatchError
from ..formats.files import open_output, writing
from ..text.tokenizers import Tokenizer, UnitsTokenizer

#: sections of a checkpoint's recorded settings whose change a resume refuses (the saved weights
#: cannot take it); changes of the others (schedule, run) are applied with a note
REFUSED_CHANGES = ("model", "tokenizer")

CHECKPOINT_KEYS = ("model", "optimizer", "loader", "epoch", "step")


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A short hash of which token has which id: a units file's units, ids and split, or a
    SentencePiece model's bytes (a tokenizer of the same size with other ids differs)."""
    if isinstance(tokenizer, UnitsTokenizer):
        content = json.dumps([sorted(tokenizer.ids.items()), tokenizer.split]).encode()
    else:
        content = Path(tokenizer.model).read_bytes()
    return hashlib.sha256(content).hexdigest()[:16]


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


def said(error: BaseException) -> str:
    """What ``error`` says, short: its first two lines to the end of their first sentence, 200
    characters at most."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()][:2]
    text = " ".join(lines).split(". ")[0] if lines else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


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


def write_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """``state`` saved at ``path``, under that name only once complete (rank 0 writes it); the
    temporary is a file of its own (a hard link or FIFO at its name is refused, not written)."""
    temporary = path.with_name(path.name + ".partial")
    with writing(temporary), os.fdopen(open_output(temporary), "wb") as stream:
        torch.save(state, stream)
    temporary.replace(path)
