"""The one shape of every loader: shard streams, token batches and the map-style dev loader.

A loader is iterated once per epoch and yields batches (dicts). Code written for
``torch.utils.data.DataLoader`` works unchanged:

- ``set_epoch(n)`` chooses the epoch the next ``iter()`` runs; without it, an ``iter()`` after a
  finished epoch runs the next one (never the same order again by accident);
- ``state_dict()`` / ``load_state_dict(state, strict=True)`` save and restore the position; a
  state saved after an epoch's last batch resumes into the next epoch;
- ``len(loader)`` is the number of batches of the current epoch on this rank where that is
  known exactly; where it is not, ``len()`` raises TypeError saying why, and
  ``planned_batches()`` gives an estimate with the bounds of the real count;
- ``stats()`` says what the epoch did so far (at least ``epoch`` and ``steps``);
- ``dim`` is the feature dimension of batched features (None where batches hold none);
- ``close()`` stops worker processes and releases files (iterating again starts them anew).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

_Closing = TypeVar("_Closing", bound="Closing")


class Closing:
    """A ``with`` block for what has ``close()`` (sample streams, readers): its end closes it."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Closing) -> _Closing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class PlannedBatches:
    """How many batches the epoch the next iteration runs holds on this rank (after a state
    saved at an epoch's end: the next epoch): ``total`` in the whole epoch and ``remaining``
    after what a loaded state had already handed out. ``exact`` when the count is
    known; otherwise an estimate from the shards' index, the real count between ``low`` and
    ``high`` (``error``: the larger distance from ``total`` to either, as a fraction of
    ``total``), with ``why`` it is not exact and what the bounds rest on."""

    total: int
    remaining: int
    exact: bool = True
    error: float = 0.0
    why: str = ""
    low: int | None = None  # None: ``total`` (exact) or not known
    high: int | None = None

    def __post_init__(self) -> None:
        if self.low is None and self.exact:
            object.__setattr__(self, "low", self.total)
        if self.high is None and self.exact:
            object.__setattr__(self, "high", self.total)


@runtime_checkable
class Loader(Protocol):
    """What the trainer, the config and user code may rely on for any seqshard loader."""

    @property
    def epoch(self) -> int: ...

    @property
    def dim(self) -> int | None: ...

    def set_epoch(self, epoch: int) -> None: ...

    def __iter__(self) -> Iterator[dict[str, Any]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def planned_batches(self) -> PlannedBatches: ...

    def close(self) -> None: ...


def length_of(planned: PlannedBatches, loader: str) -> int:
    """``len()`` of a loader with this plan: its total when exact, else TypeError saying why
    and pointing at ``planned_batches()``."""
    if not planned.exact:
        raise TypeError(
            f"the number of batches of this {loader} is not known before the epoch is read ({planned.why}); "
            f"loader.planned_batches() estimates it: about {planned.total}"
            + (f" ({planned.low} to {planned.high})." if planned.low is not None else " (no bounds known).")
        )
    return planned.total
