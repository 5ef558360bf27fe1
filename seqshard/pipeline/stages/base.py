"""The stage contract: an iterator that can say where it is and go back there.

A stage implements three methods:

- ``reset(state=None)``: start over (``None``) or continue from a state it returned before;
  the one method serves both "new epoch" and "restore";
- ``next()``: the next item, or ``StopIteration``;
- ``get_state()``: a small JSON-safe dict: its own counters and its source's state nested
  under ``"source"``; never sample data.

The base class owns ``__next__`` (with lazy set-up) and ``state_dict``/``load_state_dict``;
recipes compose stages through ``recipe.Reader``. Every random choice comes from
:func:`stage_rng`, a pure function of (seed, stage, epoch, rank, worker, position), so the same
seed gives the same items on any machine and a restored stage needs no RNG state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from ...errors import ConfigError, InputError, SkipCounter

T = TypeVar("T")
U = TypeVar("U")
State = dict[str, Any]


class Stage(Generic[T]):
    """Base of every pipeline stage (see the module docstring for the contract)."""

    def __init__(self, source: Stage | None = None):
        self.source = source
        self._started = False

    # -- the contract -------------------------------------------------------------------
    def reset(self, state: State | None = None) -> None:
        """Start over, or continue from ``state``. Subclasses call ``super().reset(state)``."""
        self._started = True
        if self.source is not None:
            self.source.reset(None if state is None else state.get("source"))

    def next(self) -> T:
        raise NotImplementedError

    def get_state(self) -> State:
        return {"source": self.source.get_state()} if self.source is not None else {}

    # -- provided -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        try:
            started = self._started
        except AttributeError:
            raise TypeError(f"{type(self).__name__}.__init__ must call super().__init__(source)") from None
        if not started:
            self.reset()
        return self.next()

    def state_dict(self) -> State:
        return self.get_state()

    def load_state_dict(self, state: State) -> None:
        self.reset(state)

    def stats(self) -> dict[str, int]:
        """Counters of this stage and its sources (utterances read, dropped by reason, ...)."""
        return self.source.stats() if self.source is not None else {}

    def pending(self) -> list[Any]:
        """Items this stage and its sources hold but have not passed on (buffered windows)."""
        return self.source.pending() if self.source is not None else []


def merge_counts(*counters: dict[str, int]) -> dict[str, int]:
    """The counters summed by name (a new dict). Runs for every batch, over every stage's
    counters: the first non-empty one is copied whole, the others added name by name."""
    total: dict[str, int] = {}
    for counter in counters:
        if not total:
            total.update(counter)
            continue
        for name, value in counter.items():
            total[name] = total.get(name, 0) + value
    return total


class CountingStage(Stage[T]):
    """A stage with named counters (``dropped.REASON``, ``filtered.REASON``, ...), kept in its
    state and reported by :meth:`stats`."""

    def __init__(self, source: Stage | None):
        super().__init__(source)
        self.counts: dict[str, int] = {}

    def count(self, name: str, value: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + value

    def reset(self, state: State | None = None) -> None:
        super().reset(state)
        self.counts = dict(state.get("counts", {})) if state else {}

    def get_state(self) -> State:
        return {**super().get_state(), "counts": dict(self.counts)}

    def stats(self) -> dict[str, int]:
        return merge_counts(super().stats(), self.counts)


class Map(CountingStage[U]):
    """Applies ``function`` to each item.

    A bad item makes ``function`` raise InputError; with ``skip`` the item is counted under
    ``dropped.<reason>`` and the next one is taken, otherwise the error stops the stream.
    Nothing is dropped silently.
    """

    def __init__(self, source: Stage, function: Callable[[Any], U], skip: SkipCounter | None = None):
        super().__init__(source)
        self.function = function
        self.skip = skip

    def next(self) -> U:
        while True:
            item = self.source.next()
            try:
                return self.function(item)
            except InputError as error:
                if self.skip is None:
                    raise
                self.skip(error)
                self.count(f"dropped.{error.reason}")


class Filter(CountingStage[T]):
    """Passes the items for which ``reason_of(item)`` is None and counts the others under
    ``filtered.<reason>`` (the reason it returned): nothing is left out uncounted."""

    def __init__(self, source: Stage[T], reason_of: Callable[[T], str | None]):
        super().__init__(source)
        self.reason_of = reason_of

    def next(self) -> T:
        while True:
            item = self.source.next()
            reason = self.reason_of(item)
            if reason is None:
                return item
            self.count(f"filtered.{reason}")


class WindowStage(Stage[U]):
    """Reads its source in windows of ``window`` items and emits what :meth:`arrange` makes
    of each window (the items shuffled, or cut into batches).

    State: the source's state where the current window began, the window's number and how
    many of its outputs were emitted; a restore re-reads that one window (what was in
    flight) and skips the emitted outputs.
    """

    def __init__(self, source: Stage, window: int, what: str):
        super().__init__(source)
        if window < 1:
            raise ConfigError(f"{what} must be >= 1, got {window}.")
        self.window = window
        self._outputs: list[U | None] = []
        self._window_start: State | None = None
        self._window_number = -1
        self._emitted = 0

    def arrange(self, items: list[Any], number: int, fresh: bool) -> list[U]:
        """The outputs of window ``number``; ``fresh`` is False when a restore re-reads it."""
        raise NotImplementedError

    def read_window(self) -> list[Any]:
        """The next window's items: ``window`` of them from the source (fewer at its end). A
        subclass may end a window by what it reads, as long as the same items end it again
        when a restore re-reads them."""
        items: list[Any] = []
        try:
            while len(items) < self.window:
                items.append(self.source.next())
        except StopIteration:
            pass
        return items

    def held(self, output: U) -> list[Any]:
        """The source items inside an output (for :meth:`pending`)."""
        return [output]

    def reset(self, state: State | None = None) -> None:
        self._started = True
        self._outputs, self._emitted = [], 0
        self._window_number, self._window_start = -1, None
        self.source.reset(None if state is None else state.get("source"))
        if state is not None and state.get("window", -1) >= 0:
            self._fill(int(state["window"]), fresh=False)
            self._emitted = int(state["emitted"])

    def _fill(self, number: int, fresh: bool = True) -> None:
        self._window_start = self.source.get_state()
        self._window_number = number
        self._outputs = list(self.arrange(self.read_window(), number, fresh))
        self._emitted = 0

    def next(self) -> U:
        if self._emitted >= len(self._outputs):
            self._fill(self._window_number + 1)
            if not self._outputs:
                raise StopIteration
        output = self._outputs[self._emitted]
        self._outputs[self._emitted] = None  # the consumer holds it now
        self._emitted += 1
        return output  # type: ignore[return-value]

    def pending(self) -> list[Any]:
        return [item for output in self._outputs[self._emitted :] for item in self.held(output)] + self.source.pending()  # type: ignore[arg-type]

    def get_state(self) -> State:
        start = self._window_start if self._window_start is not None else self.source.get_state()
        return {"source": start, "window": self._window_number, "emitted": self._emitted}
