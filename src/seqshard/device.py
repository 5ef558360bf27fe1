"""Batches delivered on an accelerator, one ahead of the training loop (``device="cuda"``).

A :class:`CudaCopier` copies a host batch to the GPU on a stream of its own (``non_blocking``:
from pinned memory the copy runs while the GPU computes) and records an event after it;
:func:`one_ahead` starts the copy of batch n+1 before it hands batch n over, so the copy runs
while step n does. Handing a batch over makes the training loop's current stream wait for that
event (on the GPU: the CPU never waits) and marks the batch's tensors as used on that stream,
so the caching allocator does not reuse their memory while the step may still read it. The
host batch (for a shard loader, a shared-memory slot its worker fills again) is held until its
copy's event has completed and only then let go (:class:`InFlight`).

``device="cpu"`` (or None) takes none of this: batches stay where the loader made them.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from .errors import ConfigError, option

DEVICES = "None, 'cpu', 'cuda' or 'cuda:N'"
Item = TypeVar("Item")
Prepare = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]  # (host batch, moved batch) -> batch


def check_device(name: str, value: Any) -> str | None:
    """``value`` as a device name (a ``torch.device`` as its text), or ConfigError naming ``name``."""
    if value is not None and type(value).__name__ == "device":  # torch.device, without importing torch
        value = str(value)
    if value is None or (isinstance(value, str) and re.fullmatch(r"cpu|cuda(:\d+)?", value)):
        return value
    raise ConfigError(f"{name} must be {DEVICES}, got {value!r}.")


def require_device(device: str | None) -> None:
    """ConfigError when ``device`` names a GPU torch cannot use here (checked when a loader is
    made, not at its first batch)."""
    if not is_cuda(device):
        return
    import torch

    index = int(device.split(":")[1]) if ":" in device else 0  # type: ignore[union-attr]
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= found:
        raise ConfigError(
            f"{option('device', device)}, and torch finds {found} CUDA device(s) here (torch {torch.__version__}): run on "
            "a GPU machine with a CUDA build of torch, or leave device unset (batches in host memory)."
        )


def is_cuda(device: str | None) -> bool:
    return device is not None and device.startswith("cuda")


def same_device(first: str, second: str) -> bool:
    """Whether two device names name one device (``"cuda"``: the current GPU, any index)."""
    return first == second or (is_cuda(first) and is_cuda(second) and "cuda" in (first, second))


class Event(Protocol):
    """What :class:`InFlight` asks of an event (``torch.cuda.Event``)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class InFlight:
    """Host batches whose copies may still be running, each let go once its copy's event has
    completed (events of one stream complete in order, so the oldest is checked first)."""

    def __init__(self) -> None:
        self._held: deque[tuple[Event, Any]] = deque()

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, event: Event, host: Any) -> None:
        self._held.append((event, host))

    def release_done(self) -> None:
        """Let go of every host batch whose copy has completed (without waiting)."""
        while self._held and self._held[0][0].query():
            self._held.popleft()

    def release_all(self) -> None:
        """Wait for every copy still running, then let go of their host batches."""
        while self._held:
            event, _ = self._held.popleft()
            event.synchronize()


class CudaCopier:
    """Copies host batches to ``device`` on a side stream; ``prepare(host, moved)`` (e.g.
    features made from waveforms) runs on that stream after the copy. ``timeline``, when a
    list, receives each copy's (start, end) timing events (bench/device_check.py)."""

    def __init__(self, device: str, prepare: Prepare | None = None):
        import torch

        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(self.device)
        self.prepare = prepare
        self.in_flight = InFlight()
        self.timeline: list[tuple[Any, Any]] | None = None

    def start(self, host: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """Launch the copy of ``host`` (and ``prepare``); the moved batch and its event."""
        import torch

        self.in_flight.release_done()
        with torch.cuda.stream(self.stream):
            begun = self._timing_event()
            moved = {
                k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in host.items()
            }
            if self.prepare is not None:
                moved = self.prepare(host, moved)
            event = torch.cuda.Event(enable_timing=begun is not None)
            event.record(self.stream)
        if begun is not None:
            self.timeline.append((begun, event))  # type: ignore[union-attr]
        self.in_flight.hold(event, host)
        return moved, event

    def finish(self, started: tuple[dict[str, Any], Any]) -> dict[str, Any]:
        """The moved batch, for the current stream: it waits for the copy (on the device)."""
        import torch

        moved, event = started
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        for value in moved.values():
            if isinstance(value, torch.Tensor):
                value.record_stream(stream)
        return moved

    def close(self) -> None:
        """Wait for the copies still running and let go of their host batches."""
        self.in_flight.release_all()

    def _timing_event(self) -> Any:
        if self.timeline is None:
            return None
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event


def one_ahead(items: Iterator[Item], start: Callable[[Item], Any], finish: Callable[[Any], Item]) -> Iterator[Item]:
    """``items`` through ``start`` (launch a copy) and ``finish`` (hand it over), the copy of
    the next item started before an item is handed over; the first item of all is handed over
    at once (its copy alone: the first batch waits for nothing more)."""
    pending: list[Any] = []  # the copy started and not handed over (one at most)
    for number, item in enumerate(items):
        started = start(item)
        if number == 0:
            yield finish(started)
            continue
        if pending:
            yield finish(pending.pop())
        pending.append(started)
    if pending:
        yield finish(pending.pop())
