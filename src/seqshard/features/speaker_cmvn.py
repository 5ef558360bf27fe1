"""Kaldi's per-speaker CMVN: the statistics ``compute-cmvn-stats --spk2utt`` writes (a 2 x (D+1)
float64 matrix per speaker: sums of each dimension, then of its squares, the frame count at
``[0, D]``), checked as ``apply-cmvn`` checks them and applied as it applies them.

Kaldi's ``ApplyCmvn`` (``src/transform/cmvn.cc``): ``mean = sum / count``; without variances
each frame gets ``-mean`` added; with them (``--norm-vars``), ``var = sumsq / count - mean^2``
(floored at 1e-20), ``scale = 1 / sqrt(var)``, ``offset = -mean * scale``, and each frame
becomes ``frame * scale + offset``. Offsets and scales are computed in double precision and
kept as float, as Kaldi keeps them, then applied to float features, so the result is Kaldi's
to the last bit for float32 input. A variance floored is said, as Kaldi's ``Flooring cepstral
variance`` warning says it, once per speaker and process, naming the speaker.

Statistics beyond what any features have are refused, not applied: a mean, or with variances a
standard deviation, beyond :data:`MAX_STATISTIC` (1e10) in any dimension. Kaldi's features
(fbank, MFCC, PLP, pitch) lie within about 1e3, raw FFT values of 16-bit audio within 2e7; a
mean of 1e10 subtracted from float32 features leaves them nothing of their own (float32 keeps
7 digits), so such statistics are damaged, or those of other data.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ..errors import listed

_LOG = logging.getLogger("seqshard")

STATS_FIELD = "cmvn"  # the sample field holding its speaker's statistics (``KEY.cmvn.npy``)
SPEAKER_FIELD = "spk"  # the sample field holding its speaker (``KEY.spk.txt``)
VARIANCE_FLOOR = 1.0e-20  # Kaldi's
MAX_STATISTIC = 1.0e10  # the largest mean, or standard deviation, statistics may give (see above)


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
    return _beyond("mean", stats[0, :-1] / count)


def _beyond(what: str, values: np.ndarray) -> str | None:
    """Why ``values`` (a mean or a standard deviation per dimension) are absurd, or None."""
    far = np.flatnonzero(~(np.abs(values) <= MAX_STATISTIC))
    if len(far) == 0:
        return None
    return (
        f"the statistics give a {what} of {values[far[0]]:.3g} in dimension {far[0]} (of {len(far)} beyond "
        f"{MAX_STATISTIC:.0e}): no features lie there (damaged statistics, or those of other data)"
    )


def variances(stats: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Each dimension's variance, floored at Kaldi's :data:`VARIANCE_FLOOR`, and the dimensions
    floored (their variance below the floor: zero, or negative from inconsistent statistics)."""
    count = stats[0, dim]
    mean = stats[0, :dim] / count
    variance = stats[1, :dim] / count - mean * mean
    floored = np.flatnonzero(variance < VARIANCE_FLOOR)
    return np.maximum(variance, VARIANCE_FLOOR), floored


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
        mean = stats[0, :dim] / stats[0, dim]
        feats = np.asarray(feats, dtype=np.float32)
        if not self.norm_vars:
            return feats + (-mean).astype(np.float32)
        variance, _ = variances(stats, dim)
        problem = _beyond("standard deviation", np.sqrt(variance))
        if problem is not None:
            raise ValueError(problem)
        scale = 1.0 / np.sqrt(variance)
        offset = -(mean * scale)
        return feats * scale.astype(np.float32) + offset.astype(np.float32)


class FlooredVariances:
    """Says, once per speaker (and for the first :data:`SPEAKERS_SAID` speakers), that its
    variances were floored, as Kaldi's ``apply-cmvn`` warns (``Flooring cepstral variance``)."""

    SPEAKERS_SAID = 20

    def __init__(self) -> None:
        self._said: set[str] = set()

    def check(self, stats: np.ndarray, dim: int, speaker: str, where: object) -> None:
        if speaker in self._said or len(self._said) > self.SPEAKERS_SAID:
            return
        _, floored = variances(stats, dim)
        if len(floored) == 0:
            return
        self._said.add(speaker)
        if len(self._said) > self.SPEAKERS_SAID:
            _LOG.warning("further speakers whose variances are floored are not named")
            return
        _LOG.warning(
            "%s: the statistics of %s give dimension(s) %s a variance below %g (zero, or negative: statistics that do "
            "not add up), floored at %g as Kaldi's apply-cmvn floors it: those dimensions are multiplied by %.0e. "
            "Check the statistics (compute-cmvn-stats), or leave cmvn_norm_vars off",
            where,
            speaker,
            listed(floored, shown=10),
            VARIANCE_FLOOR,
            VARIANCE_FLOOR,
            VARIANCE_FLOOR**-0.5,
        )
