"""Loaders from a CAT-style ``hyper-p.json``: ``build_loaders("hyper-p.json")``.

Seed 01's users switch to shards with three keys under ``train.option``: ``large_dataset``
(true: shards; false: the map-style loader over ``feats.scp``), ``tokenizer`` and ``trset``
(a shard pattern, a list of them, or a mix). A dev set (``devset``) is a Kaldi data dir (or
``{"feats": ..., "text": ...}``), read the ordinary way in file order, or shards read with
``shuffle=False``. Every :func:`seqshard.make_loader` option is a key of ``train.option``
under its own name, and the example trainer's settings are keys too (:data:`TRAINER_KEYS`).
Anything else in ``train.option`` is an error naming the key and the keys allowed; the other
top-level sections of a CAT file (``data``, ``tokenizer``, ``inference``, ...) are not read.

``seqshard config --explain hyper-p.json`` prints the resolved settings and their defaults.
"""

from __future__ import annotations

import difflib
import json
import logging
import re
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .mix import mux
from .pipeline.config import LoaderConfig

_LOG = logging.getLogger("seqshard")

#: seqshard's own keys of ``train.option``: (default, allowed JSON types, meaning)
DATA_KEYS: dict[str, tuple[Any, tuple[str, ...], str]] = {
    "large_dataset": (False, ("bool",), "true: stream shards (make_loader); false: map-style over feats.scp"),
    "trset": (MISSING, ("str", "list", "dict"), "shard pattern(s) or mix (large_dataset), else a Kaldi data dir"),
    "devset": (None, ("str", "dict", "None"), "dev set: a Kaldi data dir, {feats, text}, or shards"),
    "tokenizer": (None, ("str", "None"), "SentencePiece .model or units file"),
    "labels": (None, ("str", "list", "None"), "Kaldi text file(s) replacing the shards' labels"),
    "dev_batch_size": (16, ("int",), "utterances per dev batch"),
}
#: the example trainer's keys (seqshard.trainer)
TRAINER_KEYS: dict[str, tuple[Any, tuple[str, ...], str]] = {
    "epochs": (2, ("int",), "epochs to train"),
    "lr": (1e-3, ("float",), "Adam learning rate (peak of the warm-up schedule)"),
    "warmup_steps": (50, ("int",), "steps of linear learning-rate warm-up"),
    "save_every": (50, ("int",), "steps between checkpoints"),
    "log_every": (10, ("int",), "steps between log lines (loss, utts/s, frames/s, data-wait)"),
    "hidden": (256, ("int",), "model width"),
    "layers": (2, ("int",), "LSTM layers of the model"),
}
NOT_FROM_FILES = ("recipe", "transforms")
MAP_STYLE_KEYS = (
    "batch_size",
    "shuffle",
    "seed",
    "num_workers",
    "split",
    "strip_spaces",
)  # large_dataset: false  # Python objects: give them to make_loader directly


@dataclass
class TrainConfig:
    """``train.option`` of a config, checked: data keys, loader options given, trainer settings."""

    source: str
    data: dict[str, Any]
    loader: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)
    given: set[str] = field(default_factory=set)


def loader_keys() -> dict[str, tuple[Any, str]]:
    """make_loader options settable from a file: name -> (default, type annotation)."""
    keys = {}
    for item in fields(LoaderConfig):
        if item.name in NOT_FROM_FILES:
            continue
        default = item.default if item.default is not MISSING else None
        keys[item.name] = (default, str(item.type))
    return keys


def load_config(source: str | Path | dict[str, Any]) -> TrainConfig:
    """Read and check ``train.option`` of a hyper-p.json file (or the same as a dict)."""
    where = "the config" if isinstance(source, dict) else str(source)
    document = source if isinstance(source, dict) else _read_json(Path(source))
    if not isinstance(document, dict) or not isinstance(document.get("train"), dict):
        raise ConfigError(f'{where}: no \'train\' section (expected {{"train": {{"option": {{...}}}}}}).')
    train = document["train"]
    unknown = set(train) - {"bin", "option"}
    if unknown:
        raise ConfigError(f"{where}: train.{sorted(unknown)[0]} is not a key of 'train' (allowed: bin, option).")
    option = train.get("option")
    if not isinstance(option, dict):
        raise ConfigError(f"{where}: train.option must be an object of settings, got {option!r}.")
    loaders = loader_keys()
    allowed = [*DATA_KEYS, *TRAINER_KEYS, *loaders]
    config = TrainConfig(where, {}, given=set(option))
    for key, value in option.items():
        if key in NOT_FROM_FILES:
            raise ConfigError(f"{where}: train.option.{key} is a Python object; give it to make_loader directly.")
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=3)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(
                f"{where}: train.option.{key} is not a setting.{hint} Allowed: {', '.join(sorted(allowed))}."
            )
        if key in DATA_KEYS:
            _check_type(where, key, value, DATA_KEYS[key][1])
        elif key in TRAINER_KEYS:
            _check_type(where, key, value, TRAINER_KEYS[key][1])
        else:
            _check_type(where, key, value, _json_types(loaders[key][1]))
    for key, (default, _, _) in DATA_KEYS.items():
        if default is MISSING and key not in option:
            raise ConfigError(f"{where}: train.option.{key} is required ({DATA_KEYS[key][2]}).")
        config.data[key] = option.get(key, default)
    config.trainer = {key: option.get(key, default) for key, (default, _, _) in TRAINER_KEYS.items()}
    for key, value in config.trainer.items():
        if (value <= 0 and key != "warmup_steps") or value < 0:
            raise ConfigError(f"{where}: train.option.{key} must be > 0, got {value}.")
    if config.data["dev_batch_size"] < 1:
        raise ConfigError(f"{where}: train.option.dev_batch_size must be >= 1, got {config.data['dev_batch_size']}.")
    config.loader = {key: option[key] for key in loaders if key in option}
    for key in ("fields", "speed_perturb", "noise_snr"):
        if isinstance(config.loader.get(key), list):
            config.loader[key] = tuple(config.loader[key])
    if config.data["large_dataset"]:
        options = dict(config.loader)
        if "batch_size" not in options and "batch_frames" not in options:
            options["batch_frames"] = 20000  # make_loader's default
        if isinstance(config.data["trset"], dict):  # a mix: make_loader runs it as an endless stream
            _patterns(where, config.data["trset"])
            if all(options.get(n) is None for n in ("epoch_steps", "epoch_hours", "epoch_source")):
                raise ConfigError(
                    f"{where}: train.option.trset is a mix, which never runs out: give epoch_steps, epoch_hours or "
                    "epoch_source (one pass's worth of one source)."
                )
            options["uneven"] = "repeat"
        try:
            LoaderConfig(**options)
        except ConfigError as error:
            raise ConfigError(f"{where}: train.option: {error}") from None
    else:
        unused = sorted(set(config.loader) - set(MAP_STYLE_KEYS))
        if unused:
            state = "false" if "large_dataset" in option else "not set (false)"
            raise ConfigError(
                f"{where}: train.option.{unused[0]} is for shards, and large_dataset is {state}: the map-style loader "
                f"over feats.scp takes only {', '.join(MAP_STYLE_KEYS)}. Set large_dataset: true to read shards."
            )
    return config


def build_loaders(
    source: str | Path | dict[str, Any], rank: int | None = None, world_size: int | None = None
) -> tuple[Any, Any]:
    """(train loader, dev loader or None) from a hyper-p.json file or dict."""
    config = load_config(source)
    data = config.data
    if data["large_dataset"]:
        from .loader import make_loader

        train = make_loader(
            _patterns(config.source, data["trset"]),
            data["tokenizer"],
            labels=data["labels"],
            rank=rank,
            world_size=world_size,
            **config.loader,
        )
    else:
        feats, text = _kaldi_dir(config.source, "trset", data["trset"])
        train = MapStyleLoader(
            feats,
            text,
            data["tokenizer"],
            batch_size=int(config.loader.get("batch_size") or 16),
            shuffle=bool(config.loader.get("shuffle", True)),
            seed=int(config.loader.get("seed", 0)),
            num_workers=int(config.loader.get("num_workers", 2)),
            rank=rank,
            world_size=world_size,
            split=config.loader.get("split"),
            strip_spaces=bool(config.loader.get("strip_spaces", False)),
        )
    return train, _dev_loader(config, rank, world_size)


def _dev_loader(config: TrainConfig, rank: int | None, world_size: int | None) -> Any:
    devset = config.data["devset"]
    if devset is None:
        return None
    if (
        not isinstance(devset, dict)
        and "://" not in devset
        and not Path(devset).exists()
        and not any(c in devset for c in "*?[{")
    ):
        raise ConfigError(
            f"{config.source}: train.option.devset = {devset!r} does not exist (from {Path.cwd()}): a Kaldi data dir "
            'with feats.scp, {"feats": ..., "text": ...}, or shards.'
        )
    if isinstance(devset, dict) or (Path(devset) / "feats.scp").is_file():
        feats, text = _kaldi_dir(config.source, "devset", devset)
        return MapStyleLoader(
            feats,
            text,
            config.data["tokenizer"],
            batch_size=config.data["dev_batch_size"],
            shuffle=False,
            num_workers=0,
            rank=rank,
            world_size=world_size,
            split=config.loader.get("split"),
            strip_spaces=bool(config.loader.get("strip_spaces", False)),
        )
    from .loader import make_loader

    shared = {k: v for k, v in config.loader.items() if k in ("split", "strip_spaces", "pad_label", "dtype")}
    return make_loader(
        devset,
        config.data["tokenizer"],
        rank=rank,
        world_size=world_size,
        batch_size=config.data["dev_batch_size"],
        shuffle=False,
        uneven="join",  # every rank reads all of its part, without talking
        num_workers=0,
        **shared,
    )


def _patterns(where: str, trset: Any) -> Any:
    """A pattern, a list of patterns, or a mix: {"mux": [...], "weights": [...]} or
    {"mux": [...], "temperature": T} (sources may be mixes themselves)."""
    if isinstance(trset, (str, list)):
        return trset
    if set(trset) - {"mux", "weights", "temperature"} or "mux" not in trset:
        raise ConfigError(
            f'{where}: train.option.trset as an object is a mix: {{"mux": [sources], "weights": [...]}} or '
            f'{{"mux": [sources], "temperature": T}}; got keys {sorted(trset)}.'
        )
    sources = [s if isinstance(s, str) else _patterns(where, s) for s in trset["mux"]]
    return mux(sources, weights=trset.get("weights"), temperature=trset.get("temperature"))


def _kaldi_dir(where: str, key: str, value: Any) -> tuple[str, str | None]:
    """(feats.scp, text) of a Kaldi data dir, or of {"feats": ..., "text": ...}."""
    if isinstance(value, dict):
        extra = set(value) - {"feats", "text"}
        if extra or "feats" not in value:
            raise ConfigError(
                f"{where}: train.option.{key} as an object needs 'feats' (and 'text'); got {sorted(value)}."
            )
        return value["feats"], value.get("text")
    if not isinstance(value, str) or not (Path(value) / "feats.scp").is_file():
        raise ConfigError(
            f"{where}: train.option.{key} = {value!r} is not a Kaldi data dir with feats.scp (with large_dataset "
            'false, trset is a data dir or {"feats": ..., "text": ...}).'
        )
    text = Path(value) / "text"
    return str(Path(value) / "feats.scp"), str(text) if text.is_file() else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file.") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}:{error.lineno}: not valid JSON ({error.msg}).") from None


def _json_types(annotation: str) -> tuple[str, ...]:
    """The JSON kinds a dataclass annotation accepts (``int | None`` -> int, None)."""
    while "[" in annotation:
        annotation = re.sub(r"\[[^\[\]]*\]", "", annotation)
    kinds = []
    for token in (t.strip() for t in annotation.split("|")):
        kinds.append({"tuple": "list", "Any": "any"}.get(token, token))
    return tuple(kinds)


def _check_type(where: str, key: str, value: Any, kinds: tuple[str, ...]) -> None:
    checks = {
        "bool": lambda v: isinstance(v, bool),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "None": lambda v: v is None,
        "dict": lambda v: isinstance(v, dict),
        "list": lambda v: isinstance(v, list),
        "any": lambda v: True,
    }
    if not any(checks.get(kind, lambda v: False)(value) for kind in kinds):
        names = {"None": "null", "dict": "an object", "list": "a list", "str": "a string", "int": "a whole number",
                 "float": "a number", "bool": "true or false", "any": "anything"}  # fmt: skip
        allowed = " or ".join(names.get(kind, kind) for kind in kinds)
        raise ConfigError(f"{where}: train.option.{key} must be {allowed}, got {json.dumps(value)}.")


def explain(source: str | Path | dict[str, Any]) -> str:
    """The resolved settings of a config, each marked as set or default."""
    config = load_config(source)
    lines = [f"{config.source}: train.option resolved", ""]

    def row(key: str, value: Any, note: str = "") -> None:
        mark = "set" if key in config.given else "default"
        lines.append(f"  {key:22s} {json.dumps(value, default=str):40s} ({mark}){'  ' + note if note else ''}")

    lines.append("data")
    for key, (_, _, meaning) in DATA_KEYS.items():
        row(key, config.data[key], meaning)
    kind = "make_loader (shards)" if config.data["large_dataset"] else "map-style loader over feats.scp"
    lines += ["", f"loader: {kind}"]
    for key, (default, _) in loader_keys().items():
        value = config.loader.get(key, default)
        if key == "batch_frames" and "batch_size" not in config.loader and value is None:
            value = 20000 if config.data["large_dataset"] else None
        note = "not used (shards only)" if not config.data["large_dataset"] and key not in MAP_STYLE_KEYS else ""
        row(key, value, note)
    lines += ["", "trainer (seqshard.trainer)"]
    for key, (_, _, meaning) in TRAINER_KEYS.items():
        row(key, config.trainer[key], meaning)
    return "\n".join(lines)


class MapStyleLoader:
    """The ordinary loader over ``feats.scp`` (``large_dataset: false``): shuffled per epoch
    (or in file order), split over ranks by torch's DistributedSampler (which repeats a few
    utterances so every rank has as many), batches of ``batch_size`` in make_loader's format.
    Its state is the epoch only: a resume restarts the epoch."""

    def __init__(
        self,
        feats: str,
        text: str | None,
        tokenizer: Any,
        *,
        batch_size: int,
        shuffle: bool,
        num_workers: int,
        rank: int | None,
        world_size: int | None,
        seed: int = 0,
        split: str | None = None,
        strip_spaces: bool = False,
    ):
        import torch.utils.data

        from .dist import discover
        from .scp_dataset import ScpDataset, collate

        context = discover(rank, world_size)
        self.dataset = ScpDataset(feats, text, tokenizer, split=split, strip_spaces=strip_spaces)
        self.tokenizer = self.dataset.labeler.tokenizer
        self.sampler = torch.utils.data.DistributedSampler(
            self.dataset, context.world_size, context.rank, shuffle=shuffle, seed=seed
        )
        self._loader = torch.utils.data.DataLoader(
            self.dataset, batch_size=batch_size, sampler=self.sampler, num_workers=num_workers, collate_fn=collate
        )
        self._epoch = 0
        self._utts = 0

    @property
    def dim(self) -> int:
        return int(self.dataset[0]["feats"].shape[1])

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self._loader)

    def planned_utts(self) -> int:
        """Utterances this rank reads in an epoch."""
        return len(self.sampler)

    def __iter__(self):
        self._utts = 0
        for batch in self._loader:
            self._utts += len(batch["keys"])
            yield batch

    def stats(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "utts": self._utts}

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "map_style": True}

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        _LOG.warning("the map-style loader restarts epoch %d from its beginning (no position is kept)", state["epoch"])
        self._epoch = int(state["epoch"])
