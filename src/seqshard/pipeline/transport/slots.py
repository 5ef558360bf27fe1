"""Moving collated batches from worker processes to the training process without a copy.

A tensor sent the way torch's DataLoader workers send it lies in a new shared-memory segment:
allocating it and faulting in its pages costs more than building the batch (measured here: 300 batches
of 40 x 500 x 80 floats took 0.22 s to build and 1.15 s when each went into a new shared
segment). So each worker gets a ring of shared slots, allocated once, and collates a batch's
arrays straight into a free slot. The training process receives tensors that *are* that
shared memory (no copy) and the slot is given back when the last of those tensors, or any
view of them, is gone: the tensors hold a reference to a lease object whose finalizer frees
the slot (a ctypes array over the slot, one per batch; the arrays are numpy arrays over it under
each tensor). The batch's pipeline state travels in its slot too, kept there as a view until
the training process reads or replaces it. With ``pin_memory`` (or ``device="cuda"``) on a
CUDA machine the whole ring is registered once as pinned host memory (``cudaHostRegister``), so batches are pinned where the
workers wrote them, without a copy; a copy to the GPU with ``non_blocking=True`` may then still
be reading a slot after the training loop let go of its tensors, so such a slot is freed only
once an event recorded on the current CUDA stream at that moment has completed (its
``fence``; ``seqshard/device.py`` instead holds a batch until its own copy has completed). A
batch too large for a slot, or one that finds no free slot (the training process holds them
all), travels the default way.

A slot's mark says who has it: 0 free, -1 leased to the training process, or the number of
the iteration whose worker filled it. A slot filled in an abandoned iteration and never
received is free again in the next one.

Shared memory lives in ``/dev/shm``, which a container often keeps small (64 MB by Docker's
default): where it is full, the ring, or a batch travelling the default way, cannot be allocated,
and :class:`SharedMemoryError` says so, with what it wanted, what is free and the options that
need less (:func:`shm_problem`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ...errors import SeqshardError
from ..stages.collate import aligned

_LOG = logging.getLogger("seqshard")

ALIGN = 64
FREE, LEASED = 0, -1


class SharedMemoryError(SeqshardError, RuntimeError):
    """Shared memory (``/dev/shm``) could not be allocated: :func:`shm_problem` says why."""


def shm_problem(what: str, error: BaseException | str) -> str:
    """Why ``what`` could not be allocated in shared memory (``error``: torch's or the OS's
    word), how full ``/dev/shm`` is, and the options that need less of it."""
    try:
        found = os.statvfs("/dev/shm")
        room = f"/dev/shm has {found.f_bavail * found.f_frsize >> 20} MB free of {found.f_blocks * found.f_frsize >> 20} MB"
    except OSError:
        room = "no /dev/shm"
    return (
        f"{what} could not be allocated in shared memory ({room}): {error}. Fix: fewer num_workers or a smaller "
        "prefetch_factor (each worker holds prefetch_factor + 3 batches there, + 5 pinned), smaller batches (batch_frames, "
        "batch_size or budgets), or a larger /dev/shm (a container's --shm-size, e.g. `docker run --shm-size=16g`; "
        "in Kubernetes an emptyDir of medium Memory mounted at /dev/shm)."
    )


class SlotArray(NamedTuple):
    """Where an array of a batch lies in its slot (a tuple: it travels with every batch)."""

    offset: int
    shape: tuple[int, ...]
    dtype: str


class SlotArena:
    """Bump allocation of arrays inside one slot (worker side)."""

    def __init__(self, slot: int, memory: np.ndarray):
        self.slot = slot
        self._memory = memory
        self._used = 0

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        size = int(np.prod(shape)) * dtype.itemsize
        start, self._used = self._used, self._used + aligned(size, ALIGN)
        if self._used > len(self._memory):
            raise MemoryError("batch larger than its slot")  # callers size the batch first
        return self._memory[start : start + size].view(dtype).reshape(shape)

    def put(self, data: bytes) -> tuple[int, int]:
        """Copy ``data`` here; its place (offset, length)."""
        array = self.allocate((len(data),), np.dtype(np.uint8))
        array[:] = np.frombuffer(data, dtype=np.uint8)
        return self.describe(array).offset, len(data)

    def describe(self, array: np.ndarray) -> SlotArray:
        """The place of an array allocated here."""
        offset = array.__array_interface__["data"][0] - self._memory.__array_interface__["data"][0]
        return SlotArray(offset, tuple(array.shape), array.dtype.str)


class BatchSlots:
    """``workers`` rings of ``per_worker`` slots of ``slot_bytes`` bytes of shared memory."""

    def __init__(self, workers: int, per_worker: int, slot_bytes: int, context: Any, shared: bool = True):
        import torch

        self.workers = workers
        self.per_worker = per_worker
        self.slot_bytes = aligned(slot_bytes, ALIGN)
        try:
            self._buffer = torch.empty(workers * per_worker * self.slot_bytes, dtype=torch.uint8)
            if shared:  # without worker processes the ring is this process's own memory
                self._buffer.share_memory_()
            self._marks = context.Array("i", workers * per_worker, lock=False)
        except (RuntimeError, OSError) as error:
            what = f"the batch slots of {workers} reader(s) ({per_worker} of {self.slot_bytes >> 20} MB each)"
            raise SharedMemoryError(shm_problem(what, error)) from None
        self._memory: np.ndarray | None = None
        self._leases: list[type] | None = None  # per slot, the class of its leases (made where batches are received)
        self._from_numpy: Any = None  # torch.from_numpy, there
        self._base = 0  # the address of the ring's first byte, there
        self.registrations = 0  # times the ring was registered as pinned memory (once at most)
        self.pinned: bool | None = None  # whether the ring is registered as pinned memory (None: not tried yet)
        # (slot, event): slots training let go, freed once the event has completed
        self._fenced: deque[tuple[int, Any]] = deque()

    def __getstate__(self) -> dict[str, Any]:
        return {
            **self.__dict__,
            "_memory": None,
            "_leases": None,
            "_from_numpy": None,
            "_base": 0,
            "pinned": None,
            "_fenced": deque(),
            "registrations": 0,
        }

    def _slot_memory(self, slot: int) -> np.ndarray:
        start = slot * self.slot_bytes
        return self._ring()[start : start + self.slot_bytes]

    # -- worker side ---------------------------------------------------------------------
    def acquire(self, worker: int, nbytes: int, iteration: int) -> SlotArena | None:
        """A free slot of ``worker``'s ring to collate ``nbytes`` into, or None (too large, or
        every slot is still held)."""
        if nbytes > self.slot_bytes:
            return None
        for slot in range(worker * self.per_worker, (worker + 1) * self.per_worker):
            mark = self._marks[slot]
            if mark == FREE or (mark > 0 and mark != iteration):
                self._marks[slot] = iteration
                return SlotArena(slot, self._slot_memory(slot))
        return None

    def mark(self, slot: int) -> int:
        """Who holds ``slot``: ``FREE``, ``LEASED`` (the training process, until the last tensor
        over it goes, or its fence completes), or the iteration its worker collates into it."""
        return self._marks[slot]

    def address(self, slot: int) -> int:
        """The address of ``slot``'s first byte (its batches' tensors lie in the slot's
        ``slot_bytes`` from there: ``tensor.data_ptr()``)."""
        return self._buffer.data_ptr() + slot * self.slot_bytes

    def held_unread(self, slot: int, iteration: int) -> bool:
        """Whether ``slot`` still holds what its worker wrote in ``iteration``, never received."""
        return self._marks[slot] == iteration

    def claim(self, slot: int, iteration: int) -> None:
        """Hand a slot held unread over to ``iteration`` (its batch is sent again)."""
        self._marks[slot] = iteration

    # -- training-process side --------------------------------------------------------------
    def receive(
        self,
        slot: int,
        arrays: dict[str, Any],
        pin: bool,
        fence: Any = None,
        names: Sequence[str] | None = None,
        packed: Any = None,
    ) -> Any:
        """Replace the places in ``arrays`` (all its values, or those ``names`` lists: each a
        :class:`SlotArray` or a plain ``(offset, shape, dtype)`` tuple) by tensors over
        ``slot``: the shared memory itself, freed with the last tensor (or view) that uses it.
        Returns ``packed`` (a state as sent), as the bytes it names there (a numpy array over
        the slot, which it keeps, like a tensor) when it is a place ``(offset, length)``. With
        ``pin`` that memory is pinned (the ring registered once; where that fails, copies in
        pinned memory). ``fence()``, when given, makes the event a freed slot waits for (see
        the module's text)."""
        if self._fenced:
            self.reclaim()
        pinned = pin and self.pin()
        self._marks[slot] = LEASED
        if self._leases is None:
            self._leases = _lease_classes(self)
        lease = self._leases[slot].from_address(self._base + slot * self.slot_bytes)  # one per batch: see _Lease
        if pinned and fence is not None:
            lease.fence = fence
        for name in arrays if names is None else names:
            offset, shape, kind = arrays[name]
            tensor = self._from_numpy(np.ndarray(shape, kind, lease, offset))
            arrays[name] = tensor.pin_memory() if pin and not pinned else tensor
        if type(packed) is tuple:
            offset, length = packed
            return np.ndarray((length,), np.uint8, lease, offset)
        return packed

    def _ring(self) -> np.ndarray:
        if self._memory is None:
            self._memory = self._buffer.numpy()
        return self._memory

    def pin(self) -> bool:
        """Register the whole ring as pinned host memory, once; whether it is pinned."""
        if self.pinned is None:
            self.pinned = _register(self._buffer)
            if self.pinned:
                self.registrations += 1
                weakref.finalize(self, _unregister, self._buffer)
        return self.pinned

    def reclaim(self) -> None:
        """Free the slots whose fence has completed (a slot let go meanwhile waits its turn)."""
        for _ in range(len(self._fenced)):
            slot, event = self._fenced.popleft()
            if event.query():
                self._marks[slot] = FREE
            else:
                self._fenced.append((slot, event))


def _lease_classes(slots: BatchSlots) -> list[type]:
    """Per slot of ``slots``, the class of its leases: a ctypes array the size of a slot, made
    at the slot's address, that frees the slot when it is collected (:class:`_Lease`; the ring
    lives as long as a lease: its class holds ``slots``). Made where batches are received, with
    what receiving needs at hand."""
    import torch

    slots._from_numpy = torch.from_numpy
    slots._base = slots._buffer.data_ptr()
    over = ctypes.c_ubyte * slots.slot_bytes
    kind = type("_SlotLease", (_Lease, over), {})
    return [type("_SlotLease", (kind,), {"slot": slot, "slots": slots}) for slot in range(len(slots._marks))]


class _Lease:
    """A slot's bytes in the training process, as a ctypes array over them (subclassed per slot:
    ``slot`` and ``slots`` are class attributes, so making one costs one call). The arrays of a
    batch are numpy arrays over it (their ``base``), each under a tensor, so it lives exactly as
    long as the last tensor or view of the batch; then the slot is free (or, with a ``fence``,
    waits for it: see the module's text)."""

    slot: int
    slots: BatchSlots
    fence: Any = None
    free = FREE  # (a class attribute: module globals may be gone when a lease is collected at exit)

    def __del__(self) -> None:
        if self.fence is None:
            self.slots._marks[self.slot] = self.free
        else:
            self.slots._fenced.append((self.slot, self.fence()))


def current_stream_event() -> Any:
    """An event recorded now on the current CUDA stream (a slot's fence)."""
    import torch

    event = torch.cuda.Event()
    event.record()
    return event


def _register(buffer: Any) -> bool:
    """Whether ``buffer`` (a CPU tensor) could be registered as pinned host memory."""
    import torch

    code = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0)
    if int(code) != 0:
        _LOG.warning(
            "the shared batch slots could not be registered as pinned memory (CUDA error %s): batches are copied "
            "into pinned memory one by one instead",
            int(code),
        )
        return False
    return True


def _unregister(buffer: Any) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
