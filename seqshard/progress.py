"""Progress bars for long work (tqdm), switchable off for tests and quiet runs."""

from __future__ import annotations

from collections.abc import Callable


class Progress:
    """Creates tqdm bars on stderr and closes them all at the end."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._bars: list = []

    def bar(self, description: str, total: int, unit: str = "it") -> Callable[[int], None]:
        """A new bar; returns the function that advances it."""
        if not self.enabled:
            return _ignore
        from tqdm import tqdm

        tqdm.monitor_interval = 0  # no monitor thread: pack forks writer processes
        scale = unit == "B"
        bar = tqdm(
            total=total,
            desc=description,
            unit=unit,
            unit_scale=scale,
            unit_divisor=1024 if scale else 1000,
            dynamic_ncols=True,
            leave=True,
        )
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


def _ignore(_: int) -> None:
    return None
