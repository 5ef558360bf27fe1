"""Progress for long work, switchable off for tests and quiet runs.

On a terminal: tqdm bars. Otherwise (stderr redirected to a log file, a Slurm job, a pipe):
plain lines such as ``pack: 1200/4800 utt (25.0%), 350 utt/s, about 10 s left``, at most one
every ``interval`` seconds per bar, and one final line with the true count when a bar reaches
its total or is closed, so a log never ends part way through nor holds cursor escape codes.

A total given as an estimate (``exact=False``: an epoch's batches planned from the shards'
index) is shown as ``25/~19 batch``, without a percentage, and its final line comes when the
bar is closed. A count that passes its total grows the total, so no bar shows more than 100%.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from .errors import redact


class Progress:
    """Creates progress bars on stderr and closes them all at the end.

    ``interval``: seconds between two plain lines of one bar when stderr is not a terminal
    (0 writes a line at every advance). ``clock``: the time source (tests pass a fake one).
    """

    def __init__(
        self, enabled: bool = True, interval: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.enabled = enabled
        self.interval = interval
        self.clock = clock
        self._bars: list = []

    def bar(self, description: str, total: int, unit: str = "it", exact: bool = True) -> Callable[[int], None]:
        """A new bar; returns the function that advances it. ``exact=False``: ``total`` is an
        estimate. A URL in ``description`` is shown redacted."""
        if not self.enabled:
            return _ignore
        description = redact(description)
        stream = sys.stderr
        if not _is_terminal(stream):
            line = _LineProgress(description, total, unit, stream, self.interval, self.clock, exact)
            self._bars.append(line)
            return line.update
        bar = _TerminalBar(description, total, unit, exact)
        self._bars.append(bar)
        return bar.update

    def close(self) -> None:
        for bar in self._bars:
            bar.close()
        self._bars.clear()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _TerminalBar:
    """A tqdm bar whose total grows with a count that passes it, and whose estimated total
    becomes the true count when it is closed (so it ends at 100%)."""

    def __init__(self, description: str, total: int, unit: str, exact: bool) -> None:
        from tqdm import tqdm

        tqdm.monitor_interval = 0  # no monitor thread: pack forks writer processes
        scale = unit == "B"
        self.exact = exact
        self.tqdm = tqdm(
            total=total,
            desc=description,
            unit=unit,
            unit_scale=scale,
            unit_divisor=1024 if scale else 1000,
            dynamic_ncols=True,
            leave=True,
        )

    def update(self, n: int = 1) -> None:
        if self.tqdm.total is not None and self.tqdm.n + n > self.tqdm.total:
            self.tqdm.total = self.tqdm.n + n
        self.tqdm.update(n)

    def close(self) -> None:
        if not self.exact and self.tqdm.total != self.tqdm.n:
            self.tqdm.total = self.tqdm.n
            self.tqdm.refresh()
        self.tqdm.close()


class _LineProgress:
    """A bar for log files: a plain line now and then, and a final one."""

    def __init__(
        self,
        description: str,
        total: int | None,
        unit: str,
        stream: TextIO,
        interval: float,
        clock: Callable[[], float],
        exact: bool = True,
    ) -> None:
        self.description = description
        self.total = total
        self.planned = total  # the total as given (``total`` grows with a count that passes it)
        self.exact = exact
        self.unit = unit
        self.stream = stream
        self.interval = interval
        self.clock = clock
        self.count = 0
        self.started = clock()
        self.last_line = self.started
        self.shown: int | None = None  # the count of the last line written
        self.shown_final = False  # that line was a final one ("done in" / "stopped after")
        self.reached = False  # the line for count == total was written
        self.closed = False

    def update(self, n: int = 1) -> None:
        if self.closed:
            return
        self.count += n
        if self.total and self.count > self.total:
            self.total = self.count
        if self.exact and self.total and self.count >= self.total and not self.reached:
            self.reached = True
            self._write(final=True)
            return
        now = self.clock()
        if now - self.last_line >= self.interval:
            self._write(final=False, now=now)

    def close(self) -> None:
        if self.closed:
            return
        if not self.exact:
            self.total = self.count  # the estimate is now known
        if self.shown != self.count or not (self.shown_final or self.reached):
            self._write(final=not self.reached)  # after a "done" line, a line with the true count only
        self.closed = True

    def _write(self, final: bool, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        elapsed = max(now - self.started, 0.0)
        rate = self.count / elapsed if elapsed > 0 else None
        text = f"{self.description}: {self._amount()}"
        if self.exact and self.total and self.total > 0:
            text += f" ({100.0 * self.count / self.total:.1f}%)"
        if rate is not None:
            text += f", {self._rate(rate)}"
        if self.exact and self.planned and self.count > self.planned:
            text += f", {self.count - self.planned} more than the {self.planned} planned"
        if final:
            finished = not self.exact or self.total is None or self.count >= self.total
            text += f", {'done in' if finished else 'stopped after'} {_duration(elapsed)}"
        elif rate and self.total and self.total > self.count:
            text += f", about {_duration((self.total - self.count) / rate)} left"
        try:
            self.stream.write(text + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stderr must not stop the work
            pass
        self.shown = self.count
        self.shown_final = final
        self.last_line = now

    def _amount(self) -> str:
        if self.unit == "B":
            scale, name = _byte_scale(self.total if self.total else self.count)
            total = f"/{self.total / scale:.{_decimals(scale)}f}" if self.total else ""
            return f"{self.count / scale:.{_decimals(scale)}f}{total} {name}"
        if not self.total or (not self.exact and self.count >= self.total):
            return f"{self.count} {self.unit}"
        return f"{self.count}/{'' if self.exact else '~'}{self.total} {self.unit}"

    def _rate(self, rate: float) -> str:
        if self.unit == "B":
            scale, name = _byte_scale(rate)
            return f"{rate / scale:.1f} {name}/s"
        return f"{rate:.0f} {self.unit}/s" if rate >= 10 else f"{rate:.2g} {self.unit}/s"


def _byte_scale(value: float) -> tuple[float, str]:
    return (1e9, "GB") if value >= 1e9 else (1e6, "MB")


def _decimals(scale: float) -> int:
    return 2 if scale >= 1e9 else 1


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


def _ignore(_: int) -> None:
    return None
