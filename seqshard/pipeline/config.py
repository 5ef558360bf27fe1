"""Every loader option, parsed and checked once (frozen), with defaults for a big corpus."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from ..errors import ConfigError
from ..features.fbank import FbankOptions
from .audio import AudioOptions, Cmvn, SpecAugmentOptions
from .batching import BatchCost, FixedSize, LengthBudget
from .filters import LengthLimits

UNEVEN_MODES = ("stop", "repeat", "join")

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
        if (self.batch_size is None) == (self.batch_frames is None):
            raise ConfigError(
                "give exactly one of batch_size (fixed) or batch_frames (dynamic, padded frames per batch)."
            )
        self.cost()  # checks the batch sizes
        for name in ("shuffle_window", "sort_window", "interleave", "num_buckets"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.num_workers < 0:
            raise ConfigError(f"num_workers must be >= 0, got {self.num_workers}.")
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
        if self.uneven == "join" and self.epoch_hours is not None:
            raise ConfigError(
                "epoch_hours counts hours over all ranks, which needs the ranks to talk at each step; "
                "uneven='join' does not: use epoch_steps, or uneven='stop'."
            )
        for name in ("epoch_steps", "epoch_hours"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}.")
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
        if isinstance(self.max_bad_shards, bool) or not (
            isinstance(self.max_bad_shards, (int, float)) and self.max_bad_shards >= 0
        ):
            raise ConfigError(
                f"max_bad_shards must be a fraction of the shards (< 1) or a count (>= 1), got {self.max_bad_shards!r}."
            )
        if isinstance(self.remote_retries, bool) or not isinstance(self.remote_retries, int) or self.remote_retries < 0:
            raise ConfigError(f"remote_retries must be a whole number >= 0, got {self.remote_retries!r}.")
        if isinstance(self.remote_timeout, bool) or not (
            isinstance(self.remote_timeout, (int, float)) and self.remote_timeout > 0
        ):
            raise ConfigError(f"remote_timeout must be a number of seconds > 0, got {self.remote_timeout!r}.")
        if self.storage_options is not None and not isinstance(self.storage_options, dict):
            raise ConfigError(
                f"storage_options must be a dict of fsspec options (e.g. {{'anon': True}}), got {self.storage_options!r}."
            )
        if self.cache_limit is not None and self.cache_dir is None:
            raise ConfigError("cache_limit needs cache_dir (where remote shards are kept).")

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
        ):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        for name in ("seed", "pad_label"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{name} must be a whole number, got {value!r}.")
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}.")
        if self.recipe is not None and not callable(self.recipe):
            raise ConfigError(f"recipe must be a function (reader) -> Stage, got {self.recipe!r}.")
        limits = self.limits()
        if None not in (limits.min_frames, limits.max_frames) and limits.min_frames > limits.max_frames:  # type: ignore[operator]
            raise ConfigError(
                f"min_frames {limits.min_frames} is above max_frames {limits.max_frames}: nothing would pass."
            )
        for name in ("min_frames_per_token", "max_frames_per_token", "max_tokens", "max_frames"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be > 0, got {value}.")

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
        if any(not 0.5 <= f <= 2 for f in factors):
            raise ConfigError(f"speed_perturb factors must be in [0.5, 2], got {self.speed_perturb!r}.")
        if len(self.noise_snr) != 2 or self.noise_snr[0] > self.noise_snr[1]:
            raise ConfigError(f"noise_snr must be (low, high) in dB, got {self.noise_snr!r}.")
        if not 0 <= self.noise_prob <= 1:
            raise ConfigError(f"noise_prob must be in [0, 1], got {self.noise_prob}.")
        if self.resample_to is not None and self.resample_to < 1000:
            raise ConfigError(f"resample_to is a sample rate in Hz, got {self.resample_to}.")
        masks = self.spec_augment
        if isinstance(masks, dict):
            unknown = set(masks) - set(SpecAugmentOptions.__dataclass_fields__)
            if unknown:
                raise ConfigError(
                    f"spec_augment: unknown option(s) {', '.join(sorted(unknown))}; "
                    f"known: {', '.join(SpecAugmentOptions.__dataclass_fields__)}."
                )
            spec = SpecAugmentOptions(**masks)
        else:
            spec = SpecAugmentOptions() if masks else None
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
