"""Length filters: too short, too long, too many tokens, frames per token out of range."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Stage, State, merge_counts
from .decode import Utterance


@dataclass(frozen=True)
class LengthLimits:
    """Bounds an utterance must meet; ``None`` means no bound. Checked in this order."""

    min_frames: int | None = None
    max_frames: int | None = None
    max_tokens: int | None = None
    min_frames_per_token: float | None = None
    max_frames_per_token: float | None = None

    def violation(self, utt: Utterance) -> str | None:
        """The name of the first bound ``utt`` breaks, or None."""
        frames, tokens = utt.num_frames, utt.num_tokens
        if self.min_frames is not None and frames < self.min_frames:
            return "too_few_frames"
        if self.max_frames is not None and frames > self.max_frames:
            return "too_many_frames"
        if self.max_tokens is not None and tokens > self.max_tokens:
            return "too_many_tokens"
        if utt.tokens is not None and tokens > 0:
            ratio = frames / tokens
            if self.min_frames_per_token is not None and ratio < self.min_frames_per_token:
                return "too_few_frames_per_token"
            if self.max_frames_per_token is not None and ratio > self.max_frames_per_token:
                return "too_many_frames_per_token"
        return None

    @property
    def active(self) -> bool:
        return any(
            v is not None
            for v in (
                self.min_frames,
                self.max_frames,
                self.max_tokens,
                self.min_frames_per_token,
                self.max_frames_per_token,
            )
        )


class LengthFilter(Stage[Utterance]):
    """Passes utterances within ``limits``; counts the others as ``filtered.<reason>``."""

    def __init__(self, source: Stage[Utterance], limits: LengthLimits):
        super().__init__(source)
        self.limits = limits
        self.filtered: dict[str, int] = {}

    def reset(self, state: State | None = None) -> None:
        super().reset(state)
        self.filtered = dict(state.get("filtered", {})) if state else {}

    def next(self) -> Utterance:
        while True:
            utt = self.source.next()
            reason = self.limits.violation(utt)
            if reason is None:
                return utt
            self.filtered[reason] = self.filtered.get(reason, 0) + 1

    def get_state(self) -> State:
        return {**super().get_state(), "filtered": dict(self.filtered)}

    def stats(self) -> dict[str, int]:
        return merge_counts(super().stats(), {f"filtered.{k}": v for k, v in self.filtered.items()})
