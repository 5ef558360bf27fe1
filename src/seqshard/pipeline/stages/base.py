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

import copy
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ...errors import ConfigError, InputError, SkipCounter, StateMismatchError
from .held import Held, Origin, without_held

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
        """The state, JSON-safe (a window's record as its text: ``held.py``)."""
        return copy.deepcopy(self.get_state())

    def load_state_dict(self, state: State) -> None:
        self.reset(state)

    def stats(self) -> dict[str, int]:
        """Counters of this stage and its sources (utterances read, dropped by reason, ...)."""
        return self.source.stats() if self.source is not None else {}

    def pending(self) -> list[Any]:
        """Items this stage and its sources hold but have not passed on (buffered windows)."""
        return self.source.pending() if self.source is not None else []

    def prepare(self) -> None:
        """Work ahead, called after an output was handed out: a stage that holds windows reads
        part of its next one (``WindowStage``); others pass the call to their source."""
        if self.source is not None:
            self.source.prepare()

    def read_further(self, until: float) -> bool:
        """Work further ahead until ``until`` (a ``time.perf_counter()`` deadline), in time the
        reader would otherwise spend waiting: a stage that holds windows reads more of its next
        one (its first, before any output); others pass the call to their source. True when that
        window is read."""
        return self.source.read_further(until) if self.source is not None else True

    def reading_done(self) -> bool:
        """Whether the stream has read all it will read (what is left is in its windows);
        False when unknown."""
        return self.source.reading_done() if self.source is not None else False


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


@dataclass(frozen=True)
class Growth:
    """How a stream's first windows grow: window ``n`` holds ``first * factor**n`` of a full
    window, a full one from the window where that reaches 1, and never fewer than ``floor``
    items (a window that small is full from the start). Small first windows give a stream's
    first output after a small part of a window's reading."""

    first: float
    factor: float = 2.0
    floor: int = 64

    def __post_init__(self) -> None:
        if not 0 < self.first <= 1 or self.factor <= 1:
            raise ConfigError(f"a window's growth must start at a share in (0, 1] and grow, got {self!r}.")

    def scale(self, number: int) -> float:
        """The share of a full window that window ``number`` holds."""
        return 1.0 if number >= 256 else min(1.0, self.first * self.factor**number)

    def items(self, full: int, number: int) -> int:
        """Items of window ``number`` of windows of ``full`` items."""
        share = self.scale(number)
        if share >= 1:
            return full
        return min(full, max(self.floor, math.ceil(full * share)))

    @staticmethod
    def saved(saved: Any, legacy: Growth | None, grow: Growth | None, stage: str) -> Growth | None:
        """The growth a saved state of a ``stage`` says its windows had (its "grow": the first
        window's share of a full one and the factor between windows; True before the share was
        kept: ``legacy``, else ``grow``)."""
        if saved is False:
            return None
        if saved is True:
            return legacy or grow
        try:
            first, factor = (float(number) for number in saved)
            return Growth(first, factor, (grow or Growth(1.0)).floor)
        except (TypeError, ValueError, ConfigError):
            raise StateMismatchError(
                f"a saved {stage} state says its windows grew as {saved!r}, not as [share of a full "
                "window in (0, 1], factor above 1]: the state is damaged; start the epoch afresh."
            ) from None


_UNREAD = object()  # an output of a window restored from its record, not read again yet
REPLAY_BATCH = 64  # items read again at once, at least one output's
ARRANGE_PIECES = 3  # a window's arrangement made ahead: its outputs, their record, the record's text


class Window:
    """A window being read: its number, the source's state where it began, its items (as
    :meth:`WindowStage.add` stores them) and what a subclass sums while it reads."""

    __slots__ = ("ended", "full", "items", "limit", "number", "start", "weight")

    def __init__(self, number: int, start: State, ended: bool = False):
        self.number = number
        self.start = start
        self.items: list[Any] = []
        self.weight = 0.0
        self.limit: Any = None  # what closes it, as the stage's add() keeps it
        self.full = False  # the items close the window
        self.ended = ended  # the source ended in it

    @property
    def closed(self) -> bool:
        return self.full or self.ended

    def read_from(self, source: Stage, add: Callable[[Window, Any], bool], until: int | None = None) -> Window:
        """Read items of ``source`` into this window with ``add`` until it closes (or holds ``until`` items)."""
        if self.closed:
            return self
        items, stop = self.items, math.inf if until is None else until
        while len(items) < stop:
            try:
                item = source.next()
            except StopIteration:
                self.ended = True
                break
            if add(self, item):
                break
        return self


class NextWindow:
    """The window after a window stage's current one, read before it is needed: :meth:`prepare`
    (called after an output was handed out) reads the share of it that the outputs handed out
    since the last call stand for, so it is read a few outputs before the current window runs
    out, and the calls left arrange it a piece each (``arranging``: a generator of the
    arrangement's pieces, its value the arranged window), so that a window's boundary costs no
    more than any other output; :meth:`further` reads and arranges it while time allows, so
    that this is done long before. Without either it is read (and arranged) when the current
    window runs out (:meth:`take`). Its items are the same either way: what ends a window
    depends on its items alone, and what it is arranged into on them and its number."""

    def __init__(
        self,
        source: Stage,
        add: Callable[[Window, Any], bool],
        arranging: Callable[[Window], Iterator[None]] | None = None,
    ):
        self.source, self.add, self.arranging = source, add, arranging
        self.window: Window | None = None
        self.prepared = 0  # outputs of the current window whose share of this one was read
        self.primed = False  # prepare() was called since the stream started or was restored
        self._pieces: Iterator[None] | None = None  # the window's arrangement under way
        self.arranged: Any = None  # and its value once made

    def after(self, number: int) -> Window:
        """Window ``number + 1``, begun where the source stands unless it was already."""
        if self.window is None:
            self.window = Window(number + 1, self.source.get_state())
        return self.window

    def take(self, number: int) -> tuple[Window, Any]:
        """Window ``number + 1`` read to its end, no longer ahead, and its arrangement where
        :meth:`further` began it (the rest of it made now), else None."""
        window, self.window = self.after(number), None
        if self._pieces is not None:
            while self._arrange_piece():
                pass
        arranged, self.arranged, self._pieces = self.arranged, None, None
        return window.read_from(self.source, self.add), arranged

    def _arrange_piece(self) -> bool:
        """One more piece of the arrangement under way; False once it is made."""
        try:
            next(self._pieces)  # type: ignore[arg-type]
            return True
        except StopIteration as done:
            self.arranged, self._pieces = done.value, None
            return False

    def prepare(self, number: int, emitted: int, outputs: int, expected: Callable[[int], int]) -> None:
        """Read the share of the window after window ``number`` for the outputs handed out
        since the last call (``emitted`` of its ``outputs`` so far; ``expected``: about how
        many items a window of a number holds); once it is read, make the next piece of its
        arrangement. The reading ends ``ARRANGE_PIECES`` calls early, left to the pieces."""
        if emitted <= self.prepared or number < 0:
            return
        ahead = self.after(number)
        # before the first call, outputs went out with nothing read ahead
        handed = emitted - self.prepared if self.primed else 1
        if not ahead.closed:
            # the reading left, spread over the outputs left (those handed out since the last
            # call included) but those whose calls arrange it
            later = outputs - emitted - (ARRANGE_PIECES * handed if self.arranging is not None else 0)
            left = expected(ahead.number) - len(ahead.items)
            ahead.read_from(
                self.source, self.add, len(ahead.items) + math.ceil(left * handed / (handed + max(0, later)))
            )
        elif self.arranging is not None and self.arranged is None:
            self._next_piece(ahead)
        self.prepared, self.primed = emitted, True

    def _next_piece(self, ahead: Window) -> None:
        """The next piece of the arrangement of ``ahead`` (read to its end)."""
        if self._pieces is None:
            self._pieces = self.arranging(ahead)  # type: ignore[misc]
        self._arrange_piece()

    def further(self, number: int, until: float) -> bool:
        """Read the window after window ``number`` an item at a time, the source reading its share
        ahead for each, until it closes or ``until`` comes (``Stage.read_further``); then, if time
        is left, the next piece of its arrangement. True once it is read (what is left of its
        arrangement is made by later calls, or where it is taken)."""
        ahead = self.after(number)
        while not ahead.closed and time.perf_counter() < until:
            ahead.read_from(self.source, self.add, len(ahead.items) + 1)
            self.source.prepare()
        self.source.read_further(until)
        if ahead.closed and self.arranging is not None and self.arranged is None and time.perf_counter() < until:
            self._next_piece(ahead)
        return ahead.closed


class WindowStage(Stage[U]):
    """Reads its source in windows of ``window`` items and emits what :meth:`arrange` makes
    of each window (the items shuffled, or cut into batches).

    The next window is read ahead (:class:`NextWindow`); counters are reported as they stood
    where the current window ended (:meth:`stats`), whatever was read ahead.

    ``grow``: a stream's first windows are small and double (:class:`Growth`), so its first
    output comes after a small part of a window's reading.

    State: the source's state where the current window began, the window's number and how
    many of its outputs were emitted (and, while windows grow, the share of a full window the
    first one held and the factor between windows); a restore re-reads that one window (what was
    in flight) and skips the emitted outputs, its windows growing as they grew when the state was
    saved (:meth:`Growth.saved`). With ``replay`` set (by the reader that built the pipeline),
    the state also holds the window's outputs by their samples' origins (``held``) and the
    source's state where the window ended (``end``): a restore reads only the samples of each
    output it hands out, as it hands it out, and the source goes on from ``end`` (``held.py``).
    """

    legacy_growth: Growth | None = None
    replay: Callable[[list[Origin]], list[Any]] | None = None
    arranges_ahead = False  # arrange() depends on a window's items and number alone: it may run ahead

    def __init__(self, source: Stage, window: int, what: str, grow: Growth | None = None):
        super().__init__(source)
        if window < 1:
            raise ConfigError(f"{what} must be >= 1, got {window}.")
        self.window = window
        self.grow = grow
        self._clear()

    # -- what a subclass defines ----------------------------------------------------------
    def arrange(self, items: list[Any], number: int, fresh: bool) -> list[U]:
        """The outputs of window ``number``; ``fresh`` is False when a restore re-reads it."""
        raise NotImplementedError

    def formed(self, items: int, outputs: list[U]) -> None:
        """A window of ``items`` read for the first time became the current one, arranged into
        ``outputs``: a subclass counts what it left out."""

    def add(self, window: Window, item: Any) -> bool:
        """Put ``item`` into ``window``; set ``window.full`` (and return it) when its items
        close it. A subclass may store the item otherwise (with its length) and end a window by
        what it holds, as long as the same items end it again when a restore re-reads them."""
        items = window.items
        items.append(item)
        if window.limit is None:
            window.limit = self.capacity(window.number)
        window.full = len(items) >= window.limit
        return window.full

    def capacity(self, number: int) -> int:
        """The most items window ``number`` holds."""
        return self.window if self.growth is None else self.growth.items(self.window, number)

    def held(self, output: U) -> list[Any]:
        """The source items inside an output (for :meth:`pending`)."""
        return [output]

    def unwrap(self, item: Any) -> Any:
        """The source item of an item as :meth:`add` stored it (for :meth:`pending`)."""
        return item

    def numbers(self, output: U) -> Sequence[int]:
        """Numbers of an output's items its record keeps (a sort window's lengths); a stage
        that keeps none does not define it."""
        raise NotImplementedError

    def rebuild(self, items: list[Any], numbers: list[int] | None) -> U:
        """The output that held ``items`` (read again from their origins) and their ``numbers``."""
        return items[0]

    # -- provided ---------------------------------------------------------------------------
    def scale(self, number: int) -> float:
        """The share of a full window that window ``number`` holds (1 unless windows grow)."""
        return 1.0 if self.growth is None else self.growth.scale(number)

    def _clear(self) -> None:
        """No window read yet (a new stream)."""
        self.growth = self.grow  # the growth of the stream being read: ``grow``, or a restored state's
        self._outputs: list[U | None] = []
        self._window_start: State | None = None
        self._window_number = -1
        self._emitted = 0
        self._count = 0  # items of the current window
        arranging = (lambda window: _arranged_ahead(self, window)) if self.arranges_ahead else None
        self._ahead = NextWindow(self.source, self.add, arranging)
        self._source_stats: dict[str, int] | None = None  # the source's counters where the current window ended
        self._held: Held | None = None  # the current window's outputs by origin (with replay)
        self._window_end: State | None = None  # and the source's state where it ended

    def reset(self, state: State | None = None) -> None:
        self._started = True
        self._clear()
        if state is not None:
            self.growth = Growth.saved(state.get("grow", False), self.legacy_growth, self.grow, type(self).__name__)
        if state is not None and "held" in state and self.replay is not None:
            self._restore_held(state)
            return
        self.source.reset(None if state is None else state.get("source"))
        if state is not None and state.get("window", -1) >= 0:
            self._arrange(
                Window(int(state["window"]), self.source.get_state()).read_from(self.source, self.add), fresh=False
            )
            self._emitted = self._ahead.prepared = int(state["emitted"])

    def _restore_held(self, state: State) -> None:
        """Restore the window from its record: the source where the window ended, the outputs
        not handed out read again as they are handed out (:meth:`_unread`)."""
        held = self._held = Held.of(state["held"])
        self.source.reset(state["end"])
        self._window_end, self._window_start = state["end"], state["source"]
        self._window_number, self._count = int(state["window"]), held.total
        self._emitted = self._ahead.prepared = int(state["emitted"])
        self._outputs = [None] * self._emitted + [_UNREAD] * (held.outputs - self._emitted)
        self._source_stats = self.source.stats()
        if held.ended:  # nothing follows
            self._ahead.window = Window(self._window_number + 1, self._window_end, ended=True)

    def _unread(self, index: int) -> None:
        assert self._held is not None and self.replay is not None
        read_again(self._held, self._outputs, index, self.replay, self.rebuild)

    def _arrange(self, window: Window, fresh: bool, arranged: tuple[list[U], Held | None] | None = None) -> None:
        """Make ``window`` the current one (``arranged``: its outputs and their record, made ahead)."""
        self._source_stats = self.source.stats()
        self._window_start = window.start
        self._window_number = window.number
        self._count = len(window.items)
        self._outputs = list(self.arrange(window.items, window.number, fresh)) if arranged is None else arranged[0]
        if fresh:
            self.formed(self._count, self._outputs)  # type: ignore[arg-type]
        self._emitted = self._ahead.prepared = 0
        if self.replay is not None:
            self._window_start = without_held(window.start)
            self._window_end = self.source.get_state()
            self._held = _record(self, self._outputs, window.ended) if arranged is None else arranged[1]
        if window.ended:  # nothing follows: an empty window ends the stream
            self._ahead.window = Window(window.number + 1, self.source.get_state(), ended=True)

    def next(self) -> U:
        if self._emitted >= len(self._outputs):
            window, arranged = self._ahead.take(self._window_number)
            self._arrange(window, True, arranged)
            if not self._outputs:
                raise StopIteration
        output = self._outputs[self._emitted]
        if output is _UNREAD:
            self._unread(self._emitted)
            output = self._outputs[self._emitted]
        self._outputs[self._emitted] = None  # the consumer holds it now
        self._emitted += 1
        return output  # type: ignore[return-value]

    def prepare(self) -> None:
        """Read the next window's share for the outputs handed out since the last call, then
        let the source read ahead for what this stage took from it."""
        self._ahead.prepare(self._window_number, self._emitted, len(self._outputs), self._expected)
        self.source.prepare()

    def read_further(self, until: float) -> bool:
        return self._ahead.further(self._window_number, until)

    def reading_done(self) -> bool:
        return self._ahead.window is not None and self._ahead.window.ended

    def stats(self) -> dict[str, int]:
        """The source's counters where the current window ended (what the next window read
        ahead counts later), so that they match the state: a restore reads that far again."""
        return dict(self._source_stats) if self._source_stats is not None else self.source.stats()

    def _expected(self, number: int) -> int:
        """About how many items window ``number`` will hold (a little more, so that reading
        ahead ends early rather than late)."""
        capacity = self.capacity(number)
        if not self._count:
            return capacity
        ratio = self.scale(number) / self.scale(self._window_number)
        return min(capacity, math.ceil(self._count * ratio * 1.05) + 1)

    def pending(self) -> list[Any]:
        unread = next((i for i in range(self._emitted, len(self._outputs)) if self._outputs[i] is _UNREAD), None)
        if unread is not None:
            self._unread(unread)
            return self.pending()
        waiting = [item for output in self._outputs[self._emitted :] for item in self.held(output)]  # type: ignore[arg-type]
        ahead = [self.unwrap(item) for item in self._ahead.window.items] if self._ahead.window is not None else []
        return waiting + ahead + self.source.pending()

    def get_state(self) -> State:
        start = self._window_start if self._window_start is not None else self.source.get_state()
        state = {"source": start, "window": self._window_number, "emitted": self._emitted}
        if self.growth is not None:
            state["grow"] = [self.growth.first, self.growth.factor]
        if self._held is not None:
            state["end"], state["held"] = self._window_end, self._held
        return state


def _record(stage: WindowStage, outputs: list, ended: bool) -> Held | None:
    """The record of a window's ``outputs`` (``Held.describe``) by ``stage``."""
    items_of = stage.held if type(stage).held is not WindowStage.held else None  # None: an output is an item
    numbers_of = stage.numbers if type(stage).numbers is not WindowStage.numbers else None
    return Held.describe(outputs, items_of, numbers_of, ended)


def _arranged_ahead(stage: WindowStage, window: Window) -> Iterator[None]:
    """``stage``'s arrangement of its next ``window`` made ahead, in pieces (``NextWindow``):
    its outputs; then, with replay, their record; then the record's text, which the state of
    its first output carries packed. Its value: the outputs and the record."""
    outputs = list(stage.arrange(window.items, window.number, True))
    if stage.replay is None:
        return outputs, None
    yield
    held = _record(stage, outputs, window.ended)
    if held is not None:
        yield
        held.encode()
    return outputs, held


def read_again(
    held: Held, outputs: list, index: int, replay: Callable[[list[Origin]], list[Any]], rebuild: Callable
) -> None:
    """Read again the ``outputs`` not handed out from ``index`` on, from their origins in
    ``held``, up to REPLAY_BATCH items at a time (the first output whatever its size)."""
    stop, origins = index, []
    while stop < len(outputs) and outputs[stop] is _UNREAD and (stop == index or len(origins) < REPLAY_BATCH):
        origins.extend(held.origins(stop))
        stop += 1
    items = replay(origins)
    for number in range(index, stop):
        count = held.count_of(number)
        numbers = held.extra_of(number) if held.extra is not None else None
        outputs[number], items = rebuild(items[:count], numbers), items[count:]
