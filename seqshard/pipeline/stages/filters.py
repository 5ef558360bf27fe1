"""Length filters: too short, too long, too many tokens, length per token out of range."""

from __future__ import annotations

from ...options import Limits
from .base import Filter, Stage
from .lengths import Measure
from .sample import Sample

TOKENS_FIELD = "tokens"


def length_filter(source: Stage[Sample], limits: Limits, length: Measure) -> Filter[Sample]:
    """Passes samples within ``limits``; counts the others as ``filtered.<reason>``."""

    def reason_of(sample: Sample) -> str | None:
        tokens = sample.fields.get(TOKENS_FIELD)
        return limits.violation(length(sample), None if tokens is None else len(tokens))

    return Filter(source, reason_of)
