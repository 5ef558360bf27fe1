"""Length filters: too short, too long, too many tokens, length per token out of range."""

from __future__ import annotations

from dataclasses import astuple, dataclass

from .base import Filter, Stage
from .lengths import Measure
from .sample import Sample

TOKENS_FIELD = "tokens"


@dataclass(frozen=True)
class LengthLimits:
    """Bounds a sample must meet, lengths in the batching measure's unit (frames for feature
    shards); ``None`` means no bound. Checked in this order."""

    min_frames: int | None = None
    max_frames: int | None = None
    max_tokens: int | None = None
    min_frames_per_token: float | None = None
    max_frames_per_token: float | None = None

    def violation(self, length: int, tokens: int | None) -> str | None:
        """The name of the first bound broken by a sample of ``length`` with ``tokens`` label
        tokens (None when not tokenized), or None."""
        if self.min_frames is not None and length < self.min_frames:
            return "too_few_frames"
        if self.max_frames is not None and length > self.max_frames:
            return "too_many_frames"
        if tokens is None:
            return None
        if self.max_tokens is not None and tokens > self.max_tokens:
            return "too_many_tokens"
        if tokens > 0:
            ratio = length / tokens
            if self.min_frames_per_token is not None and ratio < self.min_frames_per_token:
                return "too_few_frames_per_token"
            if self.max_frames_per_token is not None and ratio > self.max_frames_per_token:
                return "too_many_frames_per_token"
        return None

    @property
    def active(self) -> bool:
        return any(v is not None for v in astuple(self))


def length_filter(source: Stage[Sample], limits: LengthLimits, length: Measure) -> Filter[Sample]:
    """Passes samples within ``limits``; counts the others as ``filtered.<reason>``."""

    def reason_of(sample: Sample) -> str | None:
        tokens = sample.fields.get(TOKENS_FIELD)
        return limits.violation(length(sample), None if tokens is None else len(tokens))

    return Filter(source, reason_of)
