"""Length filters (too short, too long, too many tokens, length per token out of range), and the
check that features are finite (``check_finite``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import InputError, SkipCounter
from ...options import Limits
from .base import Filter, Map, Stage
from .lengths import Measure
from .sample import Sample

TOKENS_FIELD = "tokens"


def length_filter(source: Stage[Sample], limits: Limits, length: Measure) -> Filter[Sample]:
    """Passes samples within ``limits``; counts the others as ``filtered.<reason>``."""

    def reason_of(sample: Sample) -> str | None:
        tokens = sample.fields.get(TOKENS_FIELD)
        return limits.violation(length(sample), None if tokens is None else len(tokens))

    return Filter(source, reason_of)


@dataclass(frozen=True)
class FiniteCheck:
    """Refuses a sample whose float array ``field`` holds NaN or infinity (InputError
    ``non_finite`` naming the sample and how many frames); others pass unchanged."""

    field: str

    def __call__(self, sample: Sample) -> Sample:
        value = sample.fields.get(self.field)
        if isinstance(value, np.ndarray) and value.dtype.kind in "fc" and not np.isfinite(value).all():
            frames = np.isfinite(value).reshape(len(value), -1).all(axis=1) if value.ndim else np.array([False])
            raise InputError(
                sample.where(),
                "non_finite",
                f"its {self.field} hold NaN or infinity in {int((~frames).sum())} of {len(frames)} frames: the sample "
                "is left out (check_finite=True).",
                "find where they come from: `seqshard cmvn` over the shards names such samples.",
            )
        return sample


def finite_filter(source: Stage[Sample], field: str) -> Map[Sample]:
    """Drops the samples whose ``field`` holds NaN or infinity, counted under
    ``dropped.non_finite`` (the first few named in warnings), whether or not ``skip_bad``."""
    return Map(source, FiniteCheck(field), SkipCounter(True, done="dropped"))
