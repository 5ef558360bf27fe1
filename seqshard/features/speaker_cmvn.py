"""Kaldi's per-speaker CMVN: the statistics ``compute-cmvn-stats --spk2utt`` writes (a 2 x (D+1)
float64 matrix per speaker: sums of each dimension, then of its squares, the frame count at
``[0, D]``), checked as ``apply-cmvn`` checks them and applied as it applies them.

Kaldi's ``ApplyCmvn`` (``src/transform/cmvn.cc``): ``mean = sum / count``; without variances
each frame gets ``-mean`` added; with them (``--norm-vars``), ``var = sumsq / count - mean^2``
(floored at 1e-20), ``scale = 1 / sqrt(var)``, ``offset = -mean * scale``, and each frame
becomes ``frame * scale + offset``. Offsets and scales are computed in double precision and
kept as float, as Kaldi keeps them, then applied to float features, so the result is Kaldi's
to the last bit for float32 input.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

STATS_FIELD = "cmvn"  # the sample field holding its speaker's statistics (``KEY.cmvn.npy``)
SPEAKER_FIELD = "spk"  # the sample field holding its speaker (``KEY.spk.txt``)
VARIANCE_FLOOR = 1.0e-20  # Kaldi's
FLOAT32_MAX = float(np.finfo(np.float32).max)


def stats_problem(stats: np.ndarray, dim: int | None = None) -> str | None:
    """Why ``stats`` cannot normalize features (of ``dim`` dimensions, when known), as
    ``apply-cmvn`` refuses it; None when it can."""
    if stats.ndim != 2 or stats.shape[0] not in (1, 2) or stats.shape[1] < 2:
        return f"the statistics are {'x'.join(map(str, stats.shape))}, not 2 x (D+1) (or 1 x (D+1): means only)"
    if dim is not None and stats.shape[1] != dim + 1:
        return f"the statistics are for {stats.shape[1] - 1} dimensions, the features have {dim}"
    if not np.isfinite(stats).all():
        return "the statistics hold NaN or infinity"
    count = float(stats[0, -1])
    if count < 1.0:
        return f"the statistics count {count:g} frames (Kaldi needs at least 1)"
    if np.abs(stats[0, :-1] / count).max() > FLOAT32_MAX:
        return "the statistics' means are beyond float features' range (3.4e38)"
    return None


@dataclass(frozen=True)
class SpeakerCmvn:
    """``make_loader(cmvn="speaker")``: each sample's features normalized by its speaker's
    statistics (its ``cmvn`` field, from ``pack --cmvn-scp``): means, and variances with
    ``norm_vars`` (Kaldi's ``--norm-vars``, off by default as in Kaldi)."""

    norm_vars: bool = False

    def normalize(self, feats: np.ndarray, stats: np.ndarray) -> np.ndarray:
        """``feats`` (T x D) normalized by ``stats``; ValueError naming what does not fit."""
        problem = stats_problem(stats, feats.shape[1])
        if problem is None and self.norm_vars and stats.shape[0] == 1:
            problem = "variance normalization needs the squares row, and the statistics hold means only"
        if problem is not None:
            raise ValueError(problem)
        dim = feats.shape[1]
        count = stats[0, dim]
        mean = stats[0, :dim] / count
        feats = np.asarray(feats, dtype=np.float32)
        if not self.norm_vars:
            return feats + (-mean).astype(np.float32)
        variance = np.maximum(stats[1, :dim] / count - mean * mean, VARIANCE_FLOOR)
        scale = 1.0 / np.sqrt(variance)
        offset = -(mean * scale)
        if np.abs(offset).max() > FLOAT32_MAX:
            raise ValueError("the statistics' offsets (-mean / std) are beyond float features' range (3.4e38)")
        return feats * scale.astype(np.float32) + offset.astype(np.float32)
