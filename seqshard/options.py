"""Every loader option, parsed and checked once (frozen), with defaults for a big corpus."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from .checks import MAX_WORKERS, check_flag, check_number
from .errors import ConfigError
from .features.audio import AudioOptions, Cmvn, SpecAugmentOptions
from .features.fbank import FbankOptions
from .formats.cache import parse_bytes
from .pipeline.stages.batching import BatchCost, FixedSize, LengthBudget
from .pipeline.stages.filters import LengthLimits

UNEVEN_MODES = ("stop", "repeat", "join")
START_METHODS = tuple(multiprocessing.get_all_start_methods())
MAX_PREFETCH = 256  # batches each worker prepares ahead (each takes a slot of shared memory)
CACHE_LIMIT = "a size such as '200GB' or '500MiB', or a number of bytes > 0"

# The numeric options: what kind of number, and its bounds (check_number's arguments). An option
# whose default is None may also be None.
NUMBERS: dict[str, dict[str, Any]] = {
    "batch_size": dict(whole=True, at_least=1),
    "batch_frames": dict(whole=True, at_least=1),
    "quadratic_frames": dict(above=0),
    "seed": dict(whole=True, at_least=0),
    "shuffle_window": dict(whole=True, at_least=1),
    "sort_window": dict(whole=True, at_least=1),
    "interleave": dict(whole=True, at_least=1),
    "min_frames": dict(whole=True, at_least=0),
    "max_frames": dict(whole=True, above=0),
    "max_tokens": dict(whole=True, above=0),
    "min_frames_per_token": dict(above=0),
    "max_frames_per_token": dict(above=0),
    "pad_label": dict(whole=True),
    "num_mel_bins": dict(whole=True),  # ranges: FbankOptions
    "frame_length_ms": dict(),
    "frame_shift_ms": dict(),
    "dither": dict(),
    "resample_to": dict(whole=True, at_least=1000, what="a sample rate in Hz (a whole number >= 1000)"),
    "noise_prob": dict(at_least=0, at_most=1),
    "channel": dict(whole=True, at_least=0),
    "max_bad_shards": dict(at_least=0, what="a fraction of the shards (< 1) or a count (>= 1)"),
    "remote_retries": dict(whole=True, at_least=0, what="a whole number >= 0"),
    "remote_timeout": dict(above=0, what="a number of seconds > 0"),
    "num_workers": dict(whole=True, at_least=0, at_most=MAX_WORKERS),
    "prefetch_factor": dict(whole=True, at_least=1, at_most=MAX_PREFETCH),
    "timeout": dict(at_least=0, what="a number of seconds >= 0 (0: no limit)"),
    "epoch_steps": dict(whole=True, at_least=1),
    "epoch_hours": dict(above=0),
    "num_buckets": dict(whole=True, at_least=1),
}

# Options that change which batches are produced: a saved state must match them to resume
# exactly. The others (prefetch, pinning, worker persistence) only change how fast.
RUNTIME_ONLY = (
    "prefetch_factor",
    "persistent_workers",
    "pin_memory",
    "multiprocessing_context",
    "timeout",
    "shared_slots",
    "storage_options",
    "cache_dir",
    "cache_limit",
    "remote_retries",
    "remote_timeout",
)


@dataclass(frozen=True)
class LoaderConfig:
    """Options of :func:`seqshard.make_loader` (see its docstring)."""

    batch_size: int | None = None
    batch_frames: int | None = None
    quadratic_frames: float | None = None
    shuffle: bool = True
    seed: int = 0
    shuffle_window: int = 3000
    sort_window: int = 2000
    interleave: int = 4
    split_shards: bool = True
    min_frames: int | None = None
    max_frames: int | None = None
    max_tokens: int | None = None
    min_frames_per_token: float | None = None
    max_frames_per_token: float | None = None
    oversize: str = "alone"
    split: str | None = None
    strip_spaces: bool = False
    pad_label: int = -1
    dtype: str = "float32"
    feature_field: str | None = None
    features: str | None = None
    num_mel_bins: int = 80
    frame_length_ms: float = 25.0
    frame_shift_ms: float = 10.0
    dither: float = 0.0
    resample_to: int | None = None
    speed_perturb: tuple[float, ...] | None = None
    noise: Any = None
    noise_snr: tuple[float, float] = (5.0, 20.0)
    noise_prob: float = 1.0
    cmvn: str | None = None
    spec_augment: bool | dict[str, Any] = False
    channel: int | None = None
    fields: tuple[str, ...] | None = None
    transforms: tuple[Any, ...] = ()
    recipe: Callable[..., Any] | None = None
    skip_bad: bool = False
    max_bad_shards: float = 0.05
    storage_options: dict[str, Any] | None = None
    cache_dir: str | None = None
    cache_limit: str | int | None = None
    remote_retries: int = 4
    remote_timeout: float = 60.0
    allow_pipes: bool = False
    num_workers: int = 2
    prefetch_factor: int = 4
    persistent_workers: bool = False
    pin_memory: bool = False
    multiprocessing_context: str | None = None
    timeout: float = 0
    shared_slots: bool = True
    uneven: str = "stop"
    epoch_steps: int | None = None
    epoch_hours: float | None = None
    epoch_source: int | str | None = None
    bucket_sync: bool = False
    num_buckets: int = 8

    def __post_init__(self) -> None:
        self._check_numbers()
        if (self.batch_size is None) == (self.batch_frames is None):
            raise ConfigError(
                "give exactly one of batch_size (fixed) or batch_frames (dynamic, padded frames per batch)."
            )
        self.cost()  # checks the batch sizes
        if self.batch_size is not None and self.batch_size > self.sort_window:
            raise ConfigError(
                f"batch_size {self.batch_size} is above sort_window {self.sort_window}: batches are cut from windows "
                "of sort_window samples, so none could be full. Raise sort_window."
            )
        if self.batch_size is not None and self.quadratic_frames is not None:
            raise ConfigError("quadratic_frames shapes a batch_frames budget; with batch_size it would do nothing.")
        if self.timeout and not self.num_workers:
            raise ConfigError(
                f"timeout={self.timeout!r} bounds the wait for a worker's batch, and num_workers=0 makes batches in "
                "this process: give num_workers > 0, or leave timeout at 0."
            )
        if self.uneven not in UNEVEN_MODES:
            raise ConfigError(f"uneven must be one of {UNEVEN_MODES}, got {self.uneven!r}.")
        lengths = [n for n in ("epoch_steps", "epoch_hours", "epoch_source") if getattr(self, n) is not None]
        if len(lengths) > 1:
            raise ConfigError(
                f"give at most one of epoch_steps, epoch_hours or epoch_source (got {', '.join(lengths)})."
            )
        if self.uneven == "repeat" and not lengths:
            raise ConfigError(
                "uneven='repeat' needs epoch_steps or epoch_hours (the epoch length, the same on every rank)."
            )
        if self.epoch_source is not None and self.uneven != "repeat":
            raise ConfigError("epoch_source is for mixed sources (make_loader(seqshard.mux([...]), ...)).")
        if isinstance(self.epoch_source, bool) or not isinstance(self.epoch_source, (int, str, type(None))):
            raise ConfigError(
                f"epoch_source must be a mixed source's position or pattern text, got {self.epoch_source!r}."
            )
        if self.uneven == "join" and self.epoch_hours is not None:
            raise ConfigError(
                "epoch_hours counts hours over all ranks, which needs the ranks to talk at each step; "
                "uneven='join' does not: use epoch_steps, or uneven='stop'."
            )
        self._check_types()
        self.audio()  # checks the audio options
        if self.fields is not None and (isinstance(self.fields, str) or not self.fields):
            raise ConfigError(f"fields must be a non-empty list of field names, got {self.fields!r}.")
        if self.bucket_sync and self.uneven == "join":
            raise ConfigError("bucket_sync needs the ranks to step together; it cannot be used with uneven='join'.")
        if self.dtype not in ("float32", "float16"):
            raise ConfigError(f"dtype must be 'float32' or 'float16', got {self.dtype!r}.")
        if self.oversize not in ("alone", "drop"):
            raise ConfigError(f"oversize must be 'alone' or 'drop', got {self.oversize!r}.")
        if self.multiprocessing_context is not None and self.multiprocessing_context not in START_METHODS:
            raise ConfigError(
                f"multiprocessing_context must be one of {', '.join(START_METHODS)} or None, "
                f"got {self.multiprocessing_context!r}."
            )
        if self.storage_options is not None and not isinstance(self.storage_options, dict):
            raise ConfigError(
                f"storage_options must be a dict of fsspec options (e.g. {{'anon': True}}), got {self.storage_options!r}."
            )
        self._check_cache_limit()

    def _check_numbers(self) -> None:
        """Every numeric option: its kind, finite, in its range (None where that is the default);
        numpy numbers become Python's (the options go into JSON states)."""
        for option in fields(self):
            if option.name in NUMBERS:
                value = getattr(self, option.name)
                checked = check_number(option.name, value, optional=option.default is None, **NUMBERS[option.name])
                object.__setattr__(self, option.name, checked)
        if self.speed_perturb is not None and not isinstance(self.speed_perturb, (tuple, list)):
            raise ConfigError(
                f"speed_perturb must be a list of factors (e.g. [0.9, 1.0, 1.1]), got {self.speed_perturb!r}."
            )
        for factor in self.speed_perturb or ():
            check_number("speed_perturb factors", factor, at_least=0.5, at_most=2, what="in [0.5, 2]")
        if not isinstance(self.noise_snr, (tuple, list)) or len(self.noise_snr) != 2:
            raise ConfigError(f"noise_snr must be (low, high) in dB, got {self.noise_snr!r}.")
        for bound in self.noise_snr:
            check_number("noise_snr", bound, what="(low, high) in dB, finite numbers")

    def _check_cache_limit(self) -> None:
        if self.cache_limit is None:
            return
        if self.cache_dir is None:
            raise ConfigError("cache_limit needs cache_dir (where remote shards are kept).")
        if isinstance(self.cache_limit, str):
            try:
                limit = parse_bytes(self.cache_limit)
            except (ValueError, OverflowError):
                limit = None
        else:
            limit = check_number("cache_limit", self.cache_limit, above=0, what=CACHE_LIMIT)
        if limit is None or limit <= 0:
            raise ConfigError(f"cache_limit must be {CACHE_LIMIT}, got {self.cache_limit!r}.")

    def bad_shard_budget(self, num_shards: int) -> int:
        """How many bad (damaged, missing) shards an epoch may skip before the run stops."""
        if self.max_bad_shards >= 1:
            return int(self.max_bad_shards)
        return int(self.max_bad_shards * num_shards)

    def cost(self) -> BatchCost:
        if self.batch_size is not None:
            return FixedSize(self.batch_size)
        return LengthBudget(int(self.batch_frames), self.quadratic_frames)  # type: ignore[arg-type]

    def _check_types(self) -> None:
        for name in (
            "shuffle",
            "split_shards",
            "skip_bad",
            "strip_spaces",
            "persistent_workers",
            "pin_memory",
            "allow_pipes",
            "shared_slots",
            "bucket_sync",
        ):
            check_flag(name, getattr(self, name))
        if not isinstance(self.feature_field, (str, type(None))):
            raise ConfigError(f"feature_field must be a field name or None, got {self.feature_field!r}.")
        for name in ("cmvn", "cache_dir"):
            if not isinstance(getattr(self, name), (str, os.PathLike, type(None))):
                raise ConfigError(f"{name} must be a path or None, got {getattr(self, name)!r}.")
        if self.split not in (None, "char", "word"):
            raise ConfigError(f"split must be 'char', 'word' or None (chosen from the units), got {self.split!r}.")
        if not isinstance(self.transforms, (tuple, list)):
            raise ConfigError(f"transforms must be a list of transforms, got {self.transforms!r}.")
        if self.recipe is not None and not callable(self.recipe):
            raise ConfigError(f"recipe must be a function (reader) -> Stage, got {self.recipe!r}.")
        limits = self.limits()
        if None not in (limits.min_frames, limits.max_frames) and limits.min_frames > limits.max_frames:  # type: ignore[operator]
            raise ConfigError(
                f"min_frames {limits.min_frames} is above max_frames {limits.max_frames}: nothing would pass."
            )

    def audio(self) -> AudioOptions:
        """The audio options, checked (fbank options, factors, SNR range, masks)."""
        if self.features not in (None, "fbank"):
            raise ConfigError(f"features must be 'fbank' or None, got {self.features!r}.")
        try:
            fbank = FbankOptions(
                sample_rate=float(self.resample_to or FbankOptions.sample_rate),
                num_mel_bins=self.num_mel_bins,
                frame_length_ms=self.frame_length_ms,
                frame_shift_ms=self.frame_shift_ms,
                dither=self.dither,
            )
        except ValueError as error:
            raise ConfigError(str(error)) from None
        factors = tuple(float(f) for f in self.speed_perturb or ())
        if self.noise_snr[0] > self.noise_snr[1]:
            raise ConfigError(f"noise_snr must be (low, high) in dB, got {self.noise_snr!r}.")
        masks = self.spec_augment
        if isinstance(masks, dict):
            known = SpecAugmentOptions.__dataclass_fields__
            unknown = set(masks) - set(known)
            if unknown:
                raise ConfigError(
                    f"spec_augment: unknown option(s) {', '.join(sorted(unknown))}; known: {', '.join(known)}."
                )
            for name, value in masks.items():
                check_number(f"spec_augment {name}", value, whole=isinstance(known[name].default, int))
            spec = SpecAugmentOptions(**masks)
        elif isinstance(masks, bool):
            spec = SpecAugmentOptions() if masks else None
        else:
            raise ConfigError(f"spec_augment must be True, False or a dict of mask options, got {masks!r}.")
        return AudioOptions(
            self.features,
            fbank,
            self.resample_to,
            factors,
            self.noise,
            tuple(self.noise_snr),
            self.noise_prob,
            Cmvn.load(self.cmvn) if self.cmvn else None,
            spec,
            self.channel,
        )

    def limits(self) -> LengthLimits:
        return LengthLimits(
            self.min_frames, self.max_frames, self.max_tokens, self.min_frames_per_token, self.max_frames_per_token
        )

    def batch_defining(self) -> dict[str, Any]:
        """The options a saved state must agree with (see RUNTIME_ONLY), JSON-safe: functions
        and classes (transforms, recipe) by their qualified names."""
        described = {}
        for option in fields(self):
            key, value = option.name, getattr(self, option.name)
            if key in RUNTIME_ONLY:
                continue
            if key == "transforms":
                value = [_qualified_name(t) for t in value]
            elif key == "recipe":
                value = None if value is None else _qualified_name(value)
            elif key in ("fields", "speed_perturb", "noise_snr") and value is not None:
                value = list(value)
            described[key] = value
        return described

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _qualified_name(item: Any) -> str:
    target = getattr(item, "predicate", item)  # keep_if(...) by its predicate
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__name__)}"
    return f"keep_if({name})" if target is not item else name
