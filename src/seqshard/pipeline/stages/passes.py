"""An endless stream of passes over a reader's data: each source of a mix, and the whole
pipeline of ``uneven="repeat"`` over one source.

Pass ``p`` is the stage ``make_pass(p)`` (over the reader's units of plan ``p``), run to its end;
then pass ``p + 1`` starts (a new plan). Each pass reads each utterance of its plan exactly
once, and each sample is tagged with its pass number (``sample.pass_number``: its per-sample
random choices differ from pass to pass). Windows after this stage may span two passes;
batching keeps copies of one utterance in different batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...errors import ConfigError
from .base import Stage, State, merge_counts
from .sample import Sample

MAX_EMPTY_PASSES = 16


class Passes(Stage):
    """Yields the items of ``make_pass(0)``, then of ``make_pass(1)``, ... without end.

    State: the pass number, the current pass's state, and the counters of finished passes.
    """

    def __init__(self, make_pass: Callable[[int], Stage], first: int = 0):
        super().__init__(None)
        self.make_pass = make_pass
        self.first = first  # the pass a fresh stream starts with (an elastic resume goes on from its pass)
        self._pass = first
        self._inner: Stage | None = None
        self._finished: dict[str, int] = {}
        self._yielded = 0

    def reset(self, state: State | None = None) -> None:
        super().reset(state)
        state = state or {}
        self._pass = int(state.get("pass", self.first))
        self._finished = dict(state.get("finished", {}))
        self._yielded = int(state.get("yielded", 0))
        self._inner = self.make_pass(self._pass)
        self._inner.reset(state.get("inner"))

    def next(self) -> Any:
        assert self._inner is not None
        empty = 0
        while True:
            try:
                item = self._inner.next()
            except StopIteration:
                empty = empty + 1 if self._yielded == 0 else 0
                if empty > MAX_EMPTY_PASSES:
                    raise ConfigError(
                        f"a reader got no data in {MAX_EMPTY_PASSES} passes: the dataset has fewer utterances than "
                        "readers (ranks x workers); use fewer workers."
                    ) from None
                self._finished = merge_counts(self._finished, self._inner.stats())
                self._pass += 1
                self._yielded = 0
                self._inner = self.make_pass(self._pass)
                self._inner.reset()
                continue
            self._yielded += 1
            if isinstance(item, Sample):
                item.pass_number = self._pass
            return item

    @property
    def finished(self) -> dict[str, int]:
        """The counters of the passes before the current one."""
        return self._finished

    @property
    def current(self) -> tuple[int, Stage | None]:
        """The pass being read and its stage."""
        return self._pass, self._inner

    def get_state(self) -> State:
        return {
            "pass": self._pass,
            "yielded": self._yielded,
            "finished": dict(self._finished),
            "inner": self._inner.get_state() if self._inner is not None else None,
        }

    def stats(self) -> dict[str, int]:
        return merge_counts(self._finished, self._inner.stats() if self._inner is not None else {})

    def pending(self) -> list[Any]:
        return self._inner.pending() if self._inner is not None else []

    def prepare(self) -> None:
        if self._inner is not None:
            self._inner.prepare()

    def read_further(self, until: float) -> bool:
        return self._inner.read_further(until) if self._inner is not None else True
