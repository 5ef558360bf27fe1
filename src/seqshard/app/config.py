"""Loaders from a CAT-style ``hyper-p.json``: ``build_loaders("hyper-p.json")``.

Seed 01's users switch to shards with three keys under ``train.option``: ``large_dataset``
(true: shards; false: the map-style loader over ``feats.scp``), ``tokenizer`` and ``trset``
(a shard pattern, a list of them, or a mix). A dev set (``devset``) is a Kaldi data dir (or
``{"feats": ..., "text": ...}``), read the ordinary way in file order, or shards read with
``shuffle=False``; ``path_root``/``path_map`` say where the arks of Kaldi data dirs are. Every
:func:`seqshard.make_loader` option is a key of ``train.option`` under its own name, and the
example trainer's settings are keys too (:data:`TRAINER_KEYS`). Anything else in
``train.option`` is an error naming the key and the keys allowed; the other top-level sections
of a CAT file (``data``, ``tokenizer``, ``inference``, ...) are not read.

The file is read as written: a key given twice, ``NaN`` or ``Infinity`` (which Python's json
accepts) are errors naming the key and the line, and values keep their JSON types (``"3"`` is
no number, ``true`` no weight).

``seqshard config --explain hyper-p.json`` prints the resolved settings and their defaults.
"""

from __future__ import annotations

import difflib
import json
import json.decoder
import json.scanner
import math
import re
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import ConfigError, InputError, counted
from ..formats.files import MAX_JSON_BYTES, read_input
from ..mix import mux
from ..options import DEFAULT_BATCH_FRAMES, LoaderOptions
from ..scp_dataset import MapStyleLoader


class Key(NamedTuple):
    """A seqshard key of ``train.option``: default, the JSON kinds it takes, what it means, and
    for numbers the range: above ``low`` (or at it, unless ``low_open``), at most ``high``."""

    default: Any
    kinds: tuple[str, ...]
    meaning: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False


#: seqshard's own keys of ``train.option``
DATA_KEYS: dict[str, Key] = {
    "large_dataset": Key(False, ("bool",), "true: stream shards (make_loader); false: map-style over feats.scp"),
    "trset": Key(
        MISSING, ("str", "list[str]", "dict"), "shard pattern(s) or mix (large_dataset), else a Kaldi data dir"
    ),
    "devset": Key(None, ("str", "dict", "None"), "dev set: a Kaldi data dir, {feats, text}, or shards"),
    "tokenizer": Key(None, ("str", "None"), "SentencePiece .model or units file"),
    "labels": Key(None, ("str", "list[str]", "None"), "Kaldi text file(s) replacing the shards' labels"),
    "dev_batch_size": Key(16, ("int",), "utterances per dev batch", low=0, low_open=True),
    "path_root": Key(None, ("str", "None"), "folder relative ark paths of Kaldi data dirs are taken from"),
    "path_map": Key(None, ("dict[str]", "list[str]", "None"), 'ark path prefixes rewritten: {"OLD": "NEW"}'),
}
#: the example trainer's keys (seqshard.app.trainer)
TRAINER_KEYS: dict[str, Key] = {
    "epochs": Key(2, ("int",), "epochs to train", low=0, low_open=True),
    "lr": Key(1e-3, ("float",), "Adam learning rate (peak of the warm-up schedule)", low=0, low_open=True),
    "warmup_steps": Key(50, ("int",), "steps of linear learning-rate warm-up", low=0, high=2**31 - 1),
    "save_every": Key(50, ("int",), "steps between checkpoints", low=0, low_open=True),
    "log_every": Key(10, ("int",), "steps between log lines (loss, utts/s, frames/s, data-wait)", low=0, low_open=True),
    "hidden": Key(256, ("int",), "model width", low=0, high=8192, low_open=True),
    "layers": Key(2, ("int",), "LSTM layers of the model", low=0, high=64, low_open=True),
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
MAP_STYLE_BATCH_SIZE = 16  # the map-style loader's batch_size when none is given
MAX_NESTING = 64  # lists and objects within each other in a config (a deeper one is refused, not recursed into)
KALDI_SETS = {"trset": "with large_dataset false, trset", "devset": "devset"}


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
    for item in LoaderOptions.option_fields():
        if item.name in NOT_FROM_FILES or item.name in DATA_KEYS:  # path_root: the data key's meaning
            continue
        default = item.default if item.default is not MISSING else None
        keys[item.name] = (default, str(item.type))
    return keys


def load_config(source: str | Path | dict[str, Any], *, name: str = "the config") -> TrainConfig:
    """Read and check ``train.option`` of a hyper-p.json file (or the same as a dict, called
    ``name`` in messages)."""
    where = name if isinstance(source, dict) else str(source)
    document = source if isinstance(source, dict) else read_json(Path(source))
    _check_nesting(document, where)
    option = _option_section(document, where)
    config = TrainConfig(where, {}, given=set(option))
    for key, value in option.items():
        check_option(where, key, value)
    for key, spec in DATA_KEYS.items():
        if spec.default is MISSING and key not in option:
            raise ConfigError(f"{where}: train.option.{key} is required ({spec.meaning}).")
        config.data[key] = option.get(key, spec.default)
    config.trainer = {key: option.get(key, spec.default) for key, spec in TRAINER_KEYS.items()}
    config.loader = {key: option[key] for key in loader_keys() if key in option}
    for key in ("fields", "speed_perturb", "noise_snr"):
        if isinstance(config.loader.get(key), list):
            config.loader[key] = tuple(config.loader[key])
    if config.data["large_dataset"]:
        options = dict(config.loader)
        if not {"batch_size", "batch_frames", "budgets"} & set(options):
            options["batch_frames"] = DEFAULT_BATCH_FRAMES
        if isinstance(config.data["trset"], dict):  # a mix: make_loader runs it as an endless stream
            _patterns(where, config.data["trset"])
            if all(options.get(n) is None for n in ("epoch_steps", "epoch_hours", "epoch_source")):
                raise ConfigError(
                    f"{where}: train.option.trset is a mix, which never runs out: give epoch_steps, epoch_hours or "
                    "epoch_source (one pass's worth of one source)."
                )
            options["uneven"] = "repeat"
        try:
            LoaderOptions(mixed=isinstance(config.data["trset"], dict), **options)
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
        map_style_options(config)
    _path_map(config)  # checks its form
    return config


def check_option(where: str, key: str, value: Any) -> None:
    """One key of ``train.option``: a setting, of its JSON type, every number in it finite, and
    in its range (seqshard's and the trainer's keys; make_loader checks its own ranges)."""
    if key in NOT_FROM_FILES:
        raise ConfigError(f"{where}: train.option.{key} is a Python object; give it to make_loader directly.")
    loaders = loader_keys()
    spec = DATA_KEYS.get(key) or TRAINER_KEYS.get(key)
    if spec is None and key not in loaders:
        allowed = [*DATA_KEYS, *TRAINER_KEYS, *loaders]
        close = difflib.get_close_matches(key, allowed, n=3)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ConfigError(f"{where}: train.option.{key} is not a setting.{hint} Allowed: {', '.join(sorted(allowed))}.")
    _check_type(where, key, value, spec.kinds if spec else _json_types(loaders[key][1]))
    _check_finite(where, f"train.option.{key}", value)
    if spec is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
        _check_range(where, key, value, spec)


def apply_overrides(document: Any, where: str, overrides: Sequence[str]) -> dict[str, Any]:
    """``document`` (a config) with ``KEY=JSON`` overrides of ``train.option`` keys (the
    trainer's ``--set``), each read as the file is and checked by :func:`check_option`."""
    if isinstance(document, dict) and isinstance(document.setdefault("train", {}), dict):
        document["train"].setdefault("option", {})
    option = _option_section(document, where)
    for item in overrides:
        key, sep, text = item.partition("=")
        label = f"--set {item}"
        if not sep or not key:
            raise ConfigError(f"{label}: expected KEY=JSON (e.g. --set lr=0.002, --set 'devset=\"data/dev\"').")
        value = parse_json(text, label)
        check_option(label, key, value)
        option[key] = value
    return document


def _option_section(document: Any, where: str) -> dict[str, Any]:
    if not isinstance(document, dict) or not isinstance(document.get("train"), dict):
        raise ConfigError(f'{where}: no \'train\' section (expected {{"train": {{"option": {{...}}}}}}).')
    train = document["train"]
    unknown = set(train) - {"bin", "option"}
    if unknown:
        raise ConfigError(f"{where}: train.{sorted(unknown)[0]} is not a key of 'train' (allowed: bin, option).")
    option = train.get("option")
    if not isinstance(option, dict):
        raise ConfigError(f"{where}: train.option must be an object of settings, got {option!r}.")
    return option


def map_style_options(config: TrainConfig) -> LoaderOptions:
    """The map-style loader's options (``large_dataset: false``), checked as make_loader checks
    them (``batch_size`` 16 when not given)."""
    options = {key: config.loader[key] for key in MAP_STYLE_KEYS if key in config.loader}
    if options.get("batch_size") is None:
        options["batch_size"] = MAP_STYLE_BATCH_SIZE
    try:
        return LoaderOptions(**options)
    except ConfigError as error:
        raise ConfigError(f"{config.source}: train.option: {error}") from None


def build_loaders(
    source: str | Path | dict[str, Any],
    rank: int | None = None,
    world_size: int | None = None,
    *,
    name: str = "the config",
) -> tuple[Any, Any]:
    """(train loader, dev loader or None) from a hyper-p.json file or dict (called ``name`` in
    messages). A dev set of Kaldi data is checked now: the first value of each of its arks is read."""
    config = load_config(source, name=name)
    data = config.data
    if data["large_dataset"]:
        from ..loader import make_loader

        train = make_loader(
            _patterns(config.source, data["trset"]),
            data["tokenizer"],
            labels=data["labels"],
            rank=rank,
            world_size=world_size,
            **config.loader,
        )
    else:
        options = map_style_options(config)
        train = MapStyleLoader(
            kaldi_dataset(config, "trset"),
            batch_size=options.batching.batch_size,  # type: ignore[arg-type]
            shuffle=options.shuffling.shuffle,
            seed=options.shuffling.seed,
            num_workers=map_style_workers(options.workers.num_workers),
            rank=rank,
            world_size=world_size,
        )
    return train, _dev_loader(config, rank, world_size)


def map_style_workers(num_workers: int | str) -> int:
    """``num_workers`` for a map-style loader, which measures nothing: ``"auto"`` is the cores
    this rank may use, one left for training."""
    from ..dist import spare_cores

    return spare_cores() if num_workers == "auto" else int(num_workers)


def check_data(source: str | Path | dict[str, Any]) -> TrainConfig:
    """:func:`load_config`, then the data it names checked as the loaders will read it (``seqshard
    config``): of a Kaldi data dir, the first value of each ark (the dev set, and the train set
    with ``large_dataset: false``: every line of its scp is read to find its arks); of shards,
    the selection (:func:`check_shards`)."""
    config = load_config(source)
    for key in KALDI_SETS:
        if _is_kaldi_set(config, key):
            check_readable(config, key, kaldi_dataset(config, key))
        elif config.data[key] is not None:
            check_shards(config, key)
    return config


def check_shards(config: TrainConfig, key: str) -> None:
    """Every local pattern of the shard set ``key`` (each source of a mix) selects at least one
    shard, and none of the shards it selects is missing (unless ``skip_bad`` lets the train
    loader skip them). Only local shards are checked: URLs are left to the loader."""
    from ..formats.remote.url_selection import split_patterns
    from ..formats.selection import select_shards

    local, _ = split_patterns(_leaf_patterns(config.data[key]))
    if not local:
        return
    skipped = bool(key == "trset" and config.loader.get("skip_bad"))
    try:
        missing = select_shards(local, skipped).missing
    except ConfigError as error:
        raise ConfigError(f"{config.source}: train.option.{key}: {error}") from None
    if missing and not skipped:
        fix = "restore them" + (" or set train.option.skip_bad to train on the others" if key == "trset" else "")
        raise ConfigError(
            f"{config.source}: train.option.{key}: {counted(len(missing), 'selected shard', 'is')} missing, first "
            f"{missing[0].path} ({missing[0].why}). Fix: {fix}."
        )
    spec = config.loader.get("epoch_source")
    if key == "trset" and spec is not None and len(local) == len(_leaf_patterns(config.data[key])):
        from ..formats.remote.access import RemoteAccess
        from ..pipeline.loader_sources import check_epoch_source, mixed_table

        try:  # the loader's own check, on the same tables
            _, mix = mixed_table(_patterns(config.source, config.data[key]), RemoteAccess(), skipped)
            check_epoch_source(mix, spec)
        except ConfigError as error:
            raise ConfigError(f"{config.source}: train.option: {error}") from None


def _leaf_patterns(shards: Any) -> list[str]:
    """The patterns of a shard set: a pattern, a list of them, or a mix of those."""
    if isinstance(shards, dict):
        return [p for source in shards.get("mux", []) for p in _leaf_patterns(source)]
    return [shards] if isinstance(shards, str) else list(shards)


def _is_kaldi_set(config: TrainConfig, key: str) -> bool:
    """Whether ``trset`` or ``devset`` is a Kaldi data dir (read by the map-style loader), not
    shards; a dev set that names nothing there is an error."""
    if key == "trset":
        return not config.data["large_dataset"]
    devset = config.data["devset"]
    if devset is None:
        return False
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
    return isinstance(devset, dict) or (Path(devset) / "feats.scp").is_file()


def kaldi_dataset(config: TrainConfig, key: str) -> Any:
    """The :class:`~seqshard.scp_dataset.ScpDataset` of a Kaldi data dir of the config
    (``trset`` or ``devset``), with the config's tokenizer, label and ark path options."""
    from ..scp_dataset import ScpDataset

    feats, text = _kaldi_dir(config.source, key, config.data[key])
    try:
        return ScpDataset(
            feats,
            text,
            config.data["tokenizer"],
            split=config.loader.get("split"),
            strip_spaces=bool(config.loader.get("strip_spaces", False)),
            path_root=config.data["path_root"],
            path_map=_path_map(config),
        )
    except InputError as error:
        raise ConfigError(f"{config.source}: train.option.{key}: {error.describe(skip_hint=False)}") from None


def check_readable(config: TrainConfig, key: str, dataset: Any) -> None:
    """Read the first value of every ark ``dataset`` names, so that arks that cannot be found
    (a relative path taken from another folder) fail now, not after an epoch of training."""
    from ..formats.peers.kaldi import parse_location

    first_rows: dict[str, int] = {}
    ark = ""
    try:
        for row in range(len(dataset)):
            utt, value = dataset.scp.record(row)
            location = parse_location(value, dataset.scp.where(row, utt), dataset.path_map, dataset.path_root)
            first_rows.setdefault(location.path, row)
        for ark in first_rows:
            dataset[first_rows[ark]]
    except InputError as error:
        fix = error.fix
        path_map = 'train.option.path_map ({"OLD_PREFIX": "NEW_PREFIX"}) rewrites ark paths of data dirs made elsewhere'
        if error.reason == "missing_ark" and Path(ark).is_absolute():
            fix = f"check that the ark exists; {path_map}."
        elif error.reason == "missing_ark":
            root = dataset.path_root or f"the current folder, {Path.cwd()}"
            fix = f"relative ark paths start from {root}: set train.option.path_root to their folder; or {path_map}."
        raise ConfigError(
            f"{config.source}: train.option.{key} cannot be read: {error.where}: {error.problem}"
            + (f" Fix: {fix}" if fix else "")
        ) from None


def _dev_loader(config: TrainConfig, rank: int | None, world_size: int | None) -> Any:
    if _is_kaldi_set(config, "devset"):
        dataset = kaldi_dataset(config, "devset")
        check_readable(config, "devset", dataset)
        return MapStyleLoader(
            dataset,
            batch_size=config.data["dev_batch_size"],
            shuffle=False,
            num_workers=0,
            rank=rank,
            world_size=world_size,
        )
    if config.data["devset"] is None:
        return None
    from ..loader import make_loader

    shared = {k: v for k, v in config.loader.items() if k in ("split", "strip_spaces", "pad_label", "dtype", "device")}
    return make_loader(
        config.data["devset"],
        config.data["tokenizer"],
        rank=rank,
        world_size=world_size,
        batch_size=config.data["dev_batch_size"],
        shuffle=False,
        uneven="join",  # every rank reads all of its part, without talking
        num_workers=0,
        **shared,
    )


def _patterns(where: str, trset: Any, name: str = "train.option.trset") -> Any:
    """A pattern, a list of patterns, or a mix: {"mux": [...], "weights": [...]} or
    {"mux": [...], "temperature": T} (sources may be mixes themselves), checked part by part."""
    if isinstance(trset, (str, list)):
        return trset
    if set(trset) - {"mux", "weights", "temperature"} or "mux" not in trset:
        raise ConfigError(
            f'{where}: {name} as an object is a mix: {{"mux": [sources], "weights": [...]}} or '
            f'{{"mux": [sources], "temperature": T}}; got keys {sorted(trset)}.'
        )
    sources = trset["mux"]
    if not isinstance(sources, list) or not sources:
        raise ConfigError(
            f"{where}: {name}.mux must be a non-empty list of sources (patterns or mixes), got {json.dumps(sources)}."
        )
    for number, source in enumerate(sources):
        if not (isinstance(source, (str, dict)) or _is_list_of(source, _is_string)):
            raise ConfigError(
                f"{where}: {name}.mux[{number}] must be a pattern (a string or a list of them) or a mix (an object), "
                f"got {json.dumps(source)}."
            )
    weights, temperature = trset.get("weights"), trset.get("temperature")
    if weights is not None and not _is_list_of(weights, _is_number):
        raise ConfigError(f"{where}: {name}.weights must be a list of numbers, got {json.dumps(weights)}.")
    if temperature is not None and not _is_number(temperature):
        raise ConfigError(f"{where}: {name}.temperature must be a number > 0, got {json.dumps(temperature)}.")
    parts = [_patterns(where, s, f"{name}.mux[{n}]") if isinstance(s, dict) else s for n, s in enumerate(sources)]
    try:
        return mux(parts, weights=weights, temperature=temperature)
    except ConfigError as error:
        raise ConfigError(f"{where}: {name}: {error}") from None


def _kaldi_dir(where: str, key: str, value: Any) -> tuple[Any, Any]:
    """(feats.scp, text) of a Kaldi data dir, or of {"feats": ..., "text": ...} (each a file or
    a list of files)."""
    if isinstance(value, dict):
        extra = set(value) - {"feats", "text"}
        if extra or "feats" not in value:
            raise ConfigError(
                f"{where}: train.option.{key} as an object needs 'feats' (and 'text'); got {sorted(value)}."
            )
        for part, files in value.items():
            if not (isinstance(files, str) or (_is_list_of(files, _is_string) and files)):
                raise ConfigError(
                    f"{where}: train.option.{key}.{part} must be a file or a list of files, got {json.dumps(files)}."
                )
            missing = [f for f in ([files] if isinstance(files, str) else files) if not Path(f).is_file()]
            if missing:
                raise ConfigError(
                    f"{where}: train.option.{key}.{part}: {missing[0]!r} is not a file (from {Path.cwd()})."
                )
        return value["feats"], value.get("text")
    if not isinstance(value, str) or not (Path(value) / "feats.scp").is_file():
        raise ConfigError(
            f"{where}: train.option.{key} = {value!r} is not a Kaldi data dir with feats.scp ({KALDI_SETS[key]} is a "
            'data dir or {"feats": ..., "text": ...}).'
        )
    text = Path(value) / "text"
    return str(Path(value) / "feats.scp"), str(text) if text.is_file() else None


def _path_map(config: TrainConfig) -> tuple[tuple[str, str], ...]:
    from ..prep.pack import parse_path_map

    try:
        return parse_path_map(config.data["path_map"])
    except ConfigError as error:
        raise ConfigError(f"{config.source}: train.option.{error}") from None


# -- JSON as written ----------------------------------------------------------------------------


class _JsonProblem(Exception):
    """What is wrong with a JSON text, and on which line."""

    def __init__(self, line: int, problem: str):
        super().__init__(line, problem)
        self.line = line
        self.problem = problem


class _JsonAsWritten(json.JSONDecoder):
    """Python's JSON decoder made strict where it is lenient: a key given twice in one object
    (Python keeps the last), ``NaN``, ``Infinity`` and numbers beyond a float's range (Python
    reads them as such) raise :class:`_JsonProblem` with the key and its line."""

    def __init__(self) -> None:
        super().__init__()
        self.parse_object = self._object
        self.scan_once = json.scanner.py_make_scanner(self)  # the pure-Python scanner calls parse_object

    @staticmethod
    def _object(s_and_end, strict, scan_once, object_hook, object_pairs_hook, memo=None):
        starts: list[int] = []

        def value_at(text: str, index: int) -> Any:
            starts.append(index)
            return scan_once(text, index)

        text = s_and_end[0]
        pairs, end = json.decoder.JSONObject(s_and_end, strict, value_at, None, list, memo)
        lines: dict[str, int] = {}
        for (key, value), start in zip(pairs, starts):
            line = text.count("\n", 0, start) + 1
            if key in lines:
                raise _JsonProblem(
                    line, f"{key!r} is given twice in one object (lines {lines[key]} and {line}): remove one."
                )
            lines[key] = line
            bad = _non_finite(value)
            if bad is not None:
                raise _JsonProblem(
                    line,
                    f"{key!r} holds {json.dumps(bad)}, which JSON does not have (Python reads NaN, Infinity and "
                    "numbers beyond 1.8e308 as such): give a finite number.",
                )
        return dict(pairs), end


def parse_json(text: str, where: str) -> Any:
    """``text`` read as strict JSON (see :class:`_JsonAsWritten`); errors name ``where``."""
    try:
        return _JsonAsWritten().decode(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{where}:{error.lineno}: not valid JSON ({error.msg}).") from None
    except _JsonProblem as problem:
        raise ConfigError(f"{where}:{problem.line}: {problem.problem}") from None
    except RecursionError:
        raise ConfigError(_too_deep(where)) from None


def _check_nesting(document: Any, where: str) -> None:
    """Refuse a config whose lists and objects nest deeper than MAX_NESTING (no setting does)."""
    stack = [(document, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_NESTING:
            raise ConfigError(_too_deep(where))
        children = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
        stack.extend((child, depth + 1) for child in children)


def _too_deep(where: str) -> str:
    return (
        f"{where}: lists and objects nest deeper than {MAX_NESTING} levels, which no setting needs (a mix of mixes "
        "takes a few): is it the config?"
    )


def read_json(path: Path) -> Any:
    """A config file, read by :func:`parse_json`."""
    try:
        text = read_input(path, MAX_JSON_BYTES, what="a config").decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file.") from None
    except OSError as error:  # a FIFO, a device, a folder, a file beyond any config
        raise ConfigError(f"{path}: {error.strerror}; give a JSON config file.") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text (byte {error.start}); is it a JSON config?") from None
    return parse_json(text, str(path))


def _non_finite(value: Any) -> float | None:
    """A NaN or infinite number in ``value`` or its lists, else None (objects check their own)."""
    if isinstance(value, float) and not math.isfinite(value):
        return value
    if isinstance(value, list):
        return next((bad for bad in map(_non_finite, value) if bad is not None), None)
    return None


# -- types and ranges ---------------------------------------------------------------------------


def _json_types(annotation: str) -> tuple[str, ...]:
    """The JSON kinds a dataclass annotation accepts (``int | None`` -> int, None)."""
    while "[" in annotation:
        annotation = re.sub(r"\[[^\[\]]*\]", "", annotation)
    kinds = []
    for token in (t.strip() for t in annotation.split("|")):
        kinds.append({"tuple": "list", "Any": "any"}.get(token, token))
    return tuple(kinds)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_string(value: Any) -> bool:
    return isinstance(value, str)


def _is_list_of(value: Any, check: Any) -> bool:
    return isinstance(value, list) and all(map(check, value))


_KINDS = {
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "a whole number"),
    "float": (_is_number, "a number"),
    "str": (_is_string, "a string"),
    "None": (lambda v: v is None, "null"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
    "dict[str]": (lambda v: isinstance(v, dict) and all(map(_is_string, v.values())), "an object of strings"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "list[str]": (lambda v: _is_list_of(v, _is_string), "a list of strings"),
    "any": (lambda v: True, "anything"),
}


def _check_type(where: str, key: str, value: Any, kinds: tuple[str, ...]) -> None:
    if not any(_KINDS[kind][0](value) if kind in _KINDS else False for kind in kinds):
        allowed = " or ".join(_KINDS[kind][1] if kind in _KINDS else kind for kind in kinds)
        raise ConfigError(f"{where}: train.option.{key} must be {allowed}, got {_shown(value)}.")


def _check_finite(where: str, name: str, value: Any) -> None:
    """Every number in ``value`` (its lists and objects too) is finite: NaN and infinity are
    refused wherever they come from (a dict given in Python, a file, ``--set``)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: {name} must be a finite number, got {json.dumps(value)}.")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for part, item in items:
        _check_finite(where, f"{name}.{part}" if isinstance(value, dict) else f"{name}[{part}]", item)


def _check_range(where: str, key: str, value: float, spec: Key) -> None:
    if spec.low is not None and (value <= spec.low if spec.low_open else value < spec.low):
        bound = f"{'>' if spec.low_open else '>='} {spec.low}"
        raise ConfigError(f"{where}: train.option.{key} must be {bound}, got {_shown(value)}.")
    if spec.high is not None and value > spec.high:
        raise ConfigError(f"{where}: train.option.{key} must be <= {spec.high}, got {_shown(value)}.")


def _shown(value: Any, limit: int = 60) -> str:
    """``value`` as JSON, cut short when long (a number of 400 digits, a long list)."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def explain(source: str | Path | dict[str, Any]) -> str:
    """The resolved settings of a config, each marked as set or default."""
    config = load_config(source)
    lines = [f"{config.source}: train.option resolved", ""]

    def row(key: str, value: Any, note: str = "") -> None:
        mark = "set" if key in config.given else "default"
        lines.append(f"  {key:22s} {json.dumps(value, default=str):40s} ({mark}){'  ' + note if note else ''}")

    lines.append("data")
    for key, spec in DATA_KEYS.items():
        row(key, config.data[key], spec.meaning)
    large = config.data["large_dataset"]
    kind = "make_loader (shards)" if large else "map-style loader over feats.scp"
    lines += ["", f"loader: {kind}"]
    for key, (default, _) in loader_keys().items():
        value = config.loader.get(key, default)
        if key == "batch_frames" and not {"batch_size", "budgets"} & set(config.loader) and value is None:
            value = 20000 if large else None
        if key == "batch_size" and not large and value is None:
            value = MAP_STYLE_BATCH_SIZE
        note = "not used (shards only)" if not large and key not in MAP_STYLE_KEYS else ""
        row(key, value, note)
    lines += ["", "trainer (seqshard.app.trainer)"]
    for key, spec in TRAINER_KEYS.items():
        row(key, config.trainer[key], spec.meaning)
    return "\n".join(lines)
