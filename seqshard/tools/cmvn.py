"""``seqshard cmvn``: global mean and standard deviation of every feature dimension over a
shard set, written as JSON for the loader's ``cmvn=`` option.

The features are those the loader would give (feature shards as stored; audio shards through
the same fbank stage, without augmentation or dither), read in shard order. Sums are float64
over every frame, so the result does not depend on batching or worker count.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..formats.files import write_json_atomic
from ..formats.patterns import Patterns

STD_FLOOR = 1e-5  # a constant dimension is divided by this, not by zero
FEATURE_OPTIONS = (
    "features",
    "num_mel_bins",
    "frame_length_ms",
    "frame_shift_ms",
    "resample_to",
    "channel",
    "feature_field",
    "skip_bad",
    "num_workers",
)


@dataclass(frozen=True)
class CmvnStats:
    """What ``seqshard cmvn`` computed and over how much data."""

    mean: np.ndarray
    std: np.ndarray
    frames: int
    utterances: int
    dropped: dict[str, int]
    floored: int  # dimensions whose std was raised to STD_FLOOR

    def to_json(self) -> dict[str, Any]:
        return {
            "mean": self.mean.tolist(),
            "std": self.std.tolist(),
            "frames": self.frames,
            "utterances": self.utterances,
            "dropped": self.dropped,
        }


def compute_cmvn(patterns: Patterns, max_utts: int | None = None, **options: Any) -> CmvnStats:
    """CMVN statistics of the shards ``patterns`` names (``options``: see FEATURE_OPTIONS)."""
    from ..loader import make_loader

    unknown = set(options) - set(FEATURE_OPTIONS)
    if unknown:
        raise ConfigError(f"cmvn takes only feature options; not {', '.join(sorted(unknown))}.")
    loader = make_loader(patterns, batch_size=64, shuffle=False, **options)
    if loader.holds_audio and not options.get("features"):
        raise ConfigError("these shards hold audio: compute features for the statistics with --features fbank.")
    total = square = None
    frames = utterances = 0
    for batch in loader:
        lengths = batch["feat_lens"].numpy()
        feats = batch["feats"].numpy().astype(np.float64)
        mask = np.arange(feats.shape[1])[None, :] < lengths[:, None]
        real = feats[mask]
        total = real.sum(axis=0) if total is None else total + real.sum(axis=0)
        square = (real**2).sum(axis=0) if square is None else square + (real**2).sum(axis=0)
        frames += int(lengths.sum())
        utterances += len(lengths)
        if max_utts is not None and utterances >= max_utts:
            break
    if total is None or square is None or frames == 0:
        raise ConfigError("cmvn: the shards gave no frames (nothing to compute statistics from).")
    mean = total / frames
    std = np.sqrt(np.maximum(square / frames - mean**2, 0.0))
    floored = int((std < STD_FLOOR).sum())
    dropped: dict[str, int] = {}
    for rank in (loader.last_summary or {}).get("ranks", []):
        for reason, count in rank.get("dropped", {}).items():
            dropped[reason] = dropped.get(reason, 0) + count
    return CmvnStats(mean, np.maximum(std, STD_FLOOR), frames, utterances, dropped, floored)


def write_cmvn(stats: CmvnStats, out: str | Path) -> None:
    """Write ``stats`` as the JSON the loader's ``cmvn=`` reads (whole, or not at all)."""
    write_json_atomic(Path(out), stats.to_json())
