"""Where this process stands in a distributed job, and the loader's tiny collectives.

This is the one module that reads the environment: ``torch.distributed`` when it is
initialised, else torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``, else a single process.
The result is a frozen :class:`DistContext` passed explicitly to whatever needs it.

The loader's collectives (a few an epoch: ``rank/epochs.py``) run on a gloo process group,
created once on first use, so that they work the same under the NCCL backend (CPU tensors, no
CUDA stream involved).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .checks import check_number, check_rule
from .errors import ConfigError


@dataclass(frozen=True)
class DistContext:
    """Rank and world size of this process (and how they were found)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    source: str = "single process"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def cores_per_rank() -> int:
    """The CPU cores this process may use (its affinity) shared by the ranks of its node
    (torchrun's ``LOCAL_WORLD_SIZE``), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    raw = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        local = int(raw)
    except ValueError:
        raise ConfigError(f"LOCAL_WORLD_SIZE must be a whole number (ranks on this node), got {raw!r}.") from None
    check_number("LOCAL_WORLD_SIZE", local, whole=True, at_least=1)
    return max(1, cores // local)


def spare_cores() -> int:
    """The cores this rank may use less one for the training process, at least 1: the most
    worker processes worth starting."""
    return max(1, cores_per_rank() - 1)


def discover(rank: int | None = None, world_size: int | None = None) -> DistContext:
    """Rank and world size: explicit arguments win, then torch.distributed, then torchrun's
    environment, then a single process."""
    check_rule("rank", rank, optional=True)
    check_rule("world_size", world_size, optional=True)
    found = DistContext()
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            found = DistContext(
                dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), "torch.distributed"
            )
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    if found.source == "single process" and "WORLD_SIZE" in os.environ:
        found = DistContext(
            int(os.environ.get("RANK", 0)),
            int(os.environ["WORLD_SIZE"]),
            int(os.environ.get("LOCAL_RANK", 0)),
            "environment (RANK/WORLD_SIZE)",
        )
    if rank is not None or world_size is not None:
        found = DistContext(
            found.rank if rank is None else rank,
            found.world_size if world_size is None else world_size,
            found.local_rank,
            "arguments",
        )
    if not 0 <= found.rank < found.world_size:
        raise ConfigError(f"rank {found.rank} is not within world_size {found.world_size} (from {found.source}).")
    return found


class Collectives:
    """Small CPU collectives among the loader's ranks (no-ops with one rank). ``calls`` counts
    those this process took part in (``seqshard.testing.collectives_made``)."""

    def __init__(self, context: DistContext):
        self.context = context
        self._group: Any = None
        self._ready = False
        self.calls = 0

    def _setup(self) -> None:
        if self._ready:
            return
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                f"this loader synchronises {self.context.world_size} ranks, which needs torch.distributed "
                "initialised (init_process_group) before iterating; or use uneven='join' / uneven='repeat' with epoch_steps."
            )
        if dist.get_world_size() != self.context.world_size:
            raise ConfigError(
                f"the loader was made for world_size {self.context.world_size} but torch.distributed has {dist.get_world_size()}."
            )
        self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self._ready = True

    def _all_reduce(self, values: list[int], op: str) -> list[int]:
        if not self.context.distributed:
            return list(values)
        import torch
        import torch.distributed as dist

        self._setup()
        tensor = torch.tensor(values, dtype=torch.int64)
        self.calls += 1
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op), group=self._group)
        return [int(v) for v in tensor.tolist()]

    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (as many on every rank), in rank order: one all-reduce of a
        ranks x values table that each rank fills in its own row."""
        if not self.context.distributed:
            return [list(values)]
        import torch
        import torch.distributed as dist

        self._setup()
        table = torch.zeros((self.context.world_size, len(values)), dtype=torch.int64)
        table[self.context.rank] = torch.tensor(values, dtype=torch.int64)
        self.calls += 1
        dist.all_reduce(table, op=dist.ReduceOp.SUM, group=self._group)
        return [[int(v) for v in row] for row in table.tolist()]

    def all_min(self, values: list[int]) -> list[int]:
        return self._all_reduce(values, "MIN")

    def ready(self) -> bool:
        """Whether torch.distributed runs (collectives can be used)."""
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized()

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order."""
        if not self.context.distributed:
            return [value]
        import torch.distributed as dist

        self._setup()
        gathered: list[Any] = [None] * self.context.world_size
        self.calls += 1
        dist.all_gather_object(gathered, value, group=self._group)
        return gathered
