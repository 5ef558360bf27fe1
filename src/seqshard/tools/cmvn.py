"""``seqshard cmvn``: global mean and standard deviation of every feature dimension over a
shard set, written as JSON for the loader's ``cmvn=`` option.

The features are those the loader would give (feature shards as stored; audio shards through
the same fbank stage, without augmentation or dither), read in shard order. Sums are float64
over every frame, so the result does not depend on batching or worker count. A frame holding
NaN or infinity is left out (it would make every mean and every normalized batch NaN), counted
and its utterance named; ``max_utts`` takes exactly that many utterances.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..checks import check_number
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


SHOWN_KEYS = 5  # keys of utterances with non-finite frames named in the output


@dataclass(frozen=True)
class CmvnStats:
    """What ``seqshard cmvn`` computed and over how much data; frames holding NaN or infinity
    are left out of the statistics and counted (``non_finite_*``, the first keys named)."""

    mean: np.ndarray
    std: np.ndarray
    frames: int
    utterances: int
    dropped: dict[str, int]
    floored: int  # dimensions whose std was raised to STD_FLOOR
    non_finite_frames: int = 0
    non_finite_utterances: int = 0
    non_finite_keys: tuple[str, ...] = ()  # the first SHOWN_KEYS of them

    def to_json(self) -> dict[str, Any]:
        return {
            "mean": self.mean.tolist(),
            "std": self.std.tolist(),
            "frames": self.frames,
            "utterances": self.utterances,
            "dropped": self.dropped,
            "non_finite": {
                "frames": self.non_finite_frames,
                "utterances": self.non_finite_utterances,
                "first_keys": list(self.non_finite_keys),
            },
        }


def compute_cmvn(patterns: Patterns, max_utts: int | None = None, **options: Any) -> CmvnStats:
    """CMVN statistics of the shards ``patterns`` names, over the first ``max_utts``
    utterances the loader gives (all when None; ``options``: see FEATURE_OPTIONS). Frames holding
    NaN or infinity are left out, counted and their utterances named (``CmvnStats``)."""
    from ..loader import make_loader

    check_number("max_utts", max_utts, whole=True, at_least=1, optional=True)
    unknown = set(options) - set(FEATURE_OPTIONS)
    if unknown:
        raise ConfigError(f"cmvn takes only feature options; not {', '.join(sorted(unknown))}.")
    loader = make_loader(patterns, batch_size=64, shuffle=False, **options)
    if loader.holds_audio and not options.get("features"):
        raise ConfigError("these shards hold audio: compute features for the statistics with --features fbank.")
    total = square = None
    frames = utterances = bad_frames = bad_utterances = 0
    bad_keys: list[str] = []
    for batch in loader:
        rows = len(batch["keys"]) if max_utts is None else min(len(batch["keys"]), max_utts - utterances)
        lengths = batch["feat_lens"].numpy()[:rows]
        feats = batch["feats"].numpy()[:rows].astype(np.float64)
        real = np.arange(feats.shape[1])[None, :] < lengths[:, None]
        finite = np.isfinite(feats).all(axis=2)
        bad = real & ~finite
        if bad.any():
            rows_with_bad = np.flatnonzero(bad.any(axis=1))
            bad_frames += int(bad.sum())
            bad_utterances += len(rows_with_bad)
            bad_keys += [batch["keys"][row] for row in rows_with_bad[: SHOWN_KEYS - len(bad_keys)]]
        kept = feats[real & finite]
        total = kept.sum(axis=0) if total is None else total + kept.sum(axis=0)
        square = (kept**2).sum(axis=0) if square is None else square + (kept**2).sum(axis=0)
        frames += len(kept)
        utterances += rows
        if max_utts is not None and utterances >= max_utts:
            break
    if total is None or square is None or frames == 0:
        raise ConfigError(
            "cmvn: the shards gave no frames (nothing to compute statistics from)"
            + (f": all {bad_frames} hold NaN or infinity (first: {', '.join(bad_keys)})." if bad_frames else ".")
        )
    mean = total / frames
    std = np.sqrt(np.maximum(square / frames - mean**2, 0.0))
    floored = int((std < STD_FLOOR).sum())
    dropped: dict[str, int] = {}
    for rank in (loader.last_summary or {}).get("ranks", []):
        for reason, count in rank.get("dropped", {}).items():
            dropped[reason] = dropped.get(reason, 0) + count
    return CmvnStats(
        mean,
        np.maximum(std, STD_FLOOR),
        frames,
        utterances,
        dropped,
        floored,
        bad_frames,
        bad_utterances,
        tuple(bad_keys),
    )


def write_cmvn(stats: CmvnStats, out: str | Path) -> None:
    """Write ``stats`` as the JSON the loader's ``cmvn=`` reads (whole, or not at all)."""
    write_json_atomic(Path(out), stats.to_json())
