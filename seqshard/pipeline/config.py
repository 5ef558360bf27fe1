"""Every loader option, parsed and checked once (frozen), with defaults for a big corpus."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from ..errors import ConfigError
from .batching import BatchCost, FixedSize, FrameBudget
from .filters import LengthLimits

UNEVEN_MODES = ("stop", "repeat", "join")

# Options that change which batches are produced: a saved state must match them to resume
# exactly. The others (prefetch, pinning, worker persistence) only change how fast.
RUNTIME_ONLY = ("prefetch_factor", "persistent_workers", "pin_memory", "multiprocessing_context", "timeout")


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
    skip_bad: bool = False
    num_workers: int = 2
    prefetch_factor: int = 4
    persistent_workers: bool = False
    pin_memory: bool = False
    multiprocessing_context: str | None = None
    timeout: float = 0
    uneven: str = "stop"
    epoch_steps: int | None = None
    epoch_hours: float | None = None
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
        if self.uneven == "repeat" and (self.epoch_steps is None) == (self.epoch_hours is None):
            raise ConfigError(
                "uneven='repeat' needs exactly one of epoch_steps or epoch_hours (the epoch length, the same on every rank)."
            )
        if self.uneven != "repeat" and (self.epoch_steps is not None or self.epoch_hours is not None):
            raise ConfigError("epoch_steps/epoch_hours only apply with uneven='repeat'.")
        if self.bucket_sync and self.uneven == "join":
            raise ConfigError("bucket_sync needs the ranks to step together; it cannot be used with uneven='join'.")
        if self.dtype not in ("float32", "float16"):
            raise ConfigError(f"dtype must be 'float32' or 'float16', got {self.dtype!r}.")
        if self.oversize not in ("alone", "drop"):
            raise ConfigError(f"oversize must be 'alone' or 'drop', got {self.oversize!r}.")

    def cost(self) -> BatchCost:
        if self.batch_size is not None:
            return FixedSize(self.batch_size)
        return FrameBudget(int(self.batch_frames), self.quadratic_frames)  # type: ignore[arg-type]

    def limits(self) -> LengthLimits:
        return LengthLimits(
            self.min_frames, self.max_frames, self.max_tokens, self.min_frames_per_token, self.max_frames_per_token
        )

    def batch_defining(self) -> dict[str, Any]:
        """The options a saved state must agree with (see RUNTIME_ONLY)."""
        return {k: v for k, v in asdict(self).items() if k not in RUNTIME_ONLY}

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
