"""Worker processes: each runs its reader's iterations and sends the batches to the training
process, which does nothing but take them.

A worker process and the training process share three pipes:

- commands (training -> worker): ``("run", iteration, epoch, spec)`` starts an iteration (one
  still running is abandoned), ``("stop",)`` ends the process;
- credits (training -> worker): one byte for each item the training process took; a worker
  has at most ``ahead`` items sent and not taken, and waits for credits blocked on the pipe;
- items (worker -> training): the transport's messages (``transport/wire.py``: a batch's
  arrays lie in a shared slot, ``transport/slots.py``; its state and counters are bytes the
  training process keeps unread), read by the training process (``transport/delivery.py``).

The training process reads a worker's pipe only when the merged stream takes that worker's
next item: one blocking read (no thread of the loader's in the training process, no polling
while it waits, the GIL released), one unpickling of a small message, one byte written back.

Reading ahead across epochs: a persistent worker that has read all of its epoch (what is left
is in its last window) starts the next epoch from its beginning in the time it would wait for
credits, and keeps the batches it makes (not collated: no slot held; at most
``AHEAD_OF_EPOCH``) until the next request. They are sent when the request is for that epoch
from its start, dropped otherwise (``set_epoch`` chose another, a state was loaded). The
batches are those the request would give: the next epoch's pipeline is a function of its
seed alone.

A worker exits when its parent is gone (checked every ``WATCH_S`` while it waits), and is
stopped when its parent exits: workers ignore SIGTERM (``_settle``), which multiprocessing's own
exit sends its daemon children before it waits for them without a limit, so the workers still
running at exit are stopped first (``_stop_at_exit``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import multiprocessing.connection
import os
import pickle
import random
import signal
import traceback
import weakref
from collections import deque
from typing import Any

from ...errors import SeqshardError
from ..transport.delivery import Inbox
from ..transport.slots import shm_problem
from ..transport.wire import BatchItem, EndItem, ErrorItem, Item, encode, pack
from .runtime import WorkerRuntime
from .setup import WorkerSetup
from .worker import Made, ReaderRun

WATCH_S = 5.0  # how often a waiting worker checks that its parent is alive
AHEAD_OF_EPOCH = 16  # batches of the next epoch a persistent worker makes before it is asked
FRESH = {"state": None, "seq": 0, "units": None, "carry": None}  # an epoch from its beginning
_LIVE: weakref.WeakSet[WorkerLink] = weakref.WeakSet()  # links not stopped yet (of this process or a parent)


class WorkerLink:
    """The training process's end of one worker process."""

    def __init__(
        self, context: Any, setup: WorkerSetup, runtime: WorkerRuntime, worker: int, ahead: int, persistent: bool
    ):
        self.worker = worker
        self._owner = os.getpid()
        self._stopped = False
        commands, self._commands = context.Pipe(duplex=False)
        credits, self._credits = context.Pipe(duplex=False)
        self._items, items = context.Pipe(duplex=False)
        loop = WorkerLoop(setup, runtime, worker, commands, credits, items, ahead, persistent, os.getpid())
        self.process = context.Process(target=serve, args=(loop,), name=f"seqshard-worker-{worker}", daemon=True)
        self.process.start()
        for end in (commands, credits, items):  # the worker's ends: its own now
            end.close()
        self.inbox = Inbox(worker, self._items, self._credits, functools.partial(_gone, self.process, worker))
        _LIVE.add(self)

    def run(self, iteration: int, epoch: int, spec: dict[str, Any]) -> None:
        """Start an iteration (the worker abandons one it is running)."""
        self._commands.send(("run", iteration, epoch, spec))

    @property
    def alive(self) -> bool:
        return not self._stopped and self.process.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the worker to exit and wait for it (killed after ``timeout`` seconds: it ignores
        SIGTERM). Once; only in the process that started it."""
        if self._stopped or os.getpid() != self._owner:
            return
        self._stopped = True
        _LIVE.discard(self)
        with contextlib.suppress(OSError):
            self._commands.send(("stop",))
        for end in (self._commands, self._credits, self._items):
            end.close()
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)


def _gone(process: Any, worker: int) -> str:
    """Why worker ``worker``'s pipe closed: how its process ended."""
    process.join(1.0)
    code = process.exitcode
    how = "is still running" if code is None else f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    gone = f"seqshard worker {worker} (pid {process.pid}) stopped unexpectedly ({how})"
    if code == -signal.SIGBUS:  # what touching shared memory that /dev/shm has no room for does
        return f"{gone}: a bus error, most often a full /dev/shm. " + shm_problem("its batches", "SIGBUS")
    return f"{gone}; if it was killed for memory (signal 9), try fewer num_workers or smaller windows."


@atexit.register  # after multiprocessing's own exit function was registered: runs before it
def _stop_at_exit() -> None:
    for link in list(_LIVE):
        link.stop(timeout=2.0)


def serve(loop: WorkerLoop) -> None:
    """The body of a worker process."""
    _settle(loop.setup, loop.worker)
    try:
        loop.serve()
    except (KeyboardInterrupt, EOFError, BrokenPipeError, ConnectionResetError):
        pass  # interrupted, or the training process is gone: it reports what happened
    finally:
        loop.close()


def _settle(setup: WorkerSetup, worker: int) -> None:
    """One math thread per worker (as torch's DataLoader workers), and Python's and torch's
    global generators seeded per worker (for transforms that use them). A worker ignores the
    signals a scheduler sends a whole job before it stops it (SIGTERM, SIGUSR1; torchrun and
    Slurm signal every process): its rank decides when to stop (a trainer finishes its step and
    saves a checkpoint first), and a worker leaves when its rank does.

    The objects alive then (modules, torch's ~170,000, the setup) leave the view of the cyclic
    garbage collector (``gc.freeze``): its full collections come every few windows of samples;
    scanning those objects took 60-180 ms each here (7-18 steps of 10 ms, the queue of batches
    emptied), the reader's own objects take about a millisecond."""
    import torch

    for number in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(number, signal.SIG_IGN)

    torch.set_num_threads(1)
    seed = (setup.options.shuffling.seed * 1_000_003 + setup.rank * 1_009 + worker) % 2**63
    torch.manual_seed(seed)
    random.seed(seed)
    gc.freeze()


class _NextEpoch:
    """The next epoch, made ahead by a persistent worker: its run and what it made so far."""

    def __init__(self, run: ReaderRun):
        self.run = run
        self.made: deque[Made | EndItem | ErrorItem] = deque()

    @property
    def done(self) -> bool:
        return len(self.made) >= AHEAD_OF_EPOCH or (bool(self.made) and not isinstance(self.made[-1], Made))

    def step(self) -> None:
        """Make one more batch (an error is kept, to be raised when that epoch is asked for)."""
        try:
            made = self.run.make()
            if isinstance(made, Made):
                self.run.prepare()
        except Exception as error:  # a bug or a user's transform, met in the next epoch's data
            made = ErrorItem(self.run.worker, self.run.seq, _portable(error, self.run.worker))
        self.made.append(made)


class WorkerLoop:
    """What a worker process does: waits for a command, runs the iteration it asks for,
    sending items as credits allow, and in the time it would wait, makes the next epoch."""

    def __init__(
        self,
        setup: WorkerSetup,
        runtime: WorkerRuntime,
        worker: int,
        commands: Any,
        credits: Any,
        items: Any,
        ahead: int,
        persistent: bool,
        parent: int,
    ):
        self.setup, self.runtime, self.worker = setup, runtime, worker
        self._commands, self._credits_in, self._items = commands, credits, items
        self._ahead = ahead
        self._persistent = persistent and not setup.options.epochs.continues_stream
        self._parent = parent
        self._credits = 0
        self._next: _NextEpoch | None = None
        self._epoch = -1  # the epoch of the last request
        self._iteration = 0  # the iteration of the last request
        # the last batches sent: (seq, packed state, the item, slot), kept only where they may be
        # sent again (``_sent_again``: a stream that goes on across epochs, batches in slots)
        self._resends = setup.options.epochs.continues_stream and runtime.slots is not None
        self._sent: deque[tuple[int, bytes, BatchItem, int | None]] = deque(
            maxlen=runtime.slots.per_worker if runtime.slots else 1
        )

    def close(self) -> None:
        for end in (self._commands, self._credits_in, self._items):
            end.close()

    def serve(self) -> None:
        command = self._wait_command()
        while command[0] == "run":
            _, iteration, epoch, spec = command
            try:
                command = self._run(iteration, epoch, spec)
            except Exception as error:  # a bug or a user's transform; the training process raises it
                self._send(iteration, ErrorItem(self.worker, spec["seq"], _portable(error, self.worker)))
                self._next = None
                command = self._wait_command()

    # -- one iteration ------------------------------------------------------------------------
    def _run(self, iteration: int, epoch: int, spec: dict[str, Any]) -> tuple:
        self._read_credits()  # credits of an abandoned iteration are not this one's
        self._credits = self._ahead
        ready = self._next if self._next is not None and self._next.run.epoch == epoch and spec == FRESH else None
        self._next = None
        again, spec = self._sent_again(iteration, spec)
        self._epoch, self._iteration = epoch, iteration
        run = ready.run if ready is not None else ReaderRun(self.setup, self.runtime, self.worker, epoch, spec, True)
        for message in again:
            self._items.send_bytes(message)
            self._credits -= 1
        made_ahead = ready.made if ready is not None else deque()
        while True:
            early = bool(made_ahead)
            made = made_ahead.popleft() if early else run.make()
            if not isinstance(made, Made):
                self._send(iteration, made)
                return self._idle(run)
            self._send(iteration, run.item(made, iteration), made.state)
            if not early:
                run.prepare()
            command = self._wait_for_credit(run)
            if command is not None:
                return command

    def _wait_for_credit(self, run: ReaderRun) -> tuple | None:
        """Wait until an item may be sent; a command that arrives first is returned."""
        while True:
            if self._commands.poll():
                return self._commands.recv()
            if self._credits > 0:
                return None
            if self._may_read_ahead(run):
                self._read_credits()
                if not self._credits:
                    self._step_next_epoch()
                continue
            if self._wait([self._commands, self._credits_in]) and not self._commands.poll():
                self._read_credits()

    def _idle(self, run: ReaderRun) -> tuple:
        """After an iteration: make the next epoch while no command comes, then wait for one."""
        while self._may_read_ahead(run):
            if self._commands.poll():
                return self._commands.recv()
            self._step_next_epoch()
        return self._wait_command()

    def _sent_again(self, iteration: int, spec: dict[str, Any]) -> tuple[list[bytes], dict[str, Any]]:
        """A stream that goes on across epochs (``uneven="repeat"``, mixes): the batches this
        worker sent in the last iteration that the training process never took (it cut the
        epoch before them) are sent again for ``iteration``, from the slots that still hold
        them, and the spec moves past them, where the worker's live pipeline stands. Nothing
        when the spec does not start right before them or one was taken (its slot left)."""
        sent, self._sent = list(self._sent), deque(maxlen=self._sent.maxlen)
        slots = self.runtime.slots
        if not sent or not self.setup.options.epochs.continues_stream or spec.get("units") is not None:
            return [], spec
        seqs = [seq for seq, _, _, _ in sent]
        if spec["seq"] not in seqs[:-1] or pickle.loads(sent[seqs.index(spec["seq"])][1]) != spec["state"]:
            return [], spec
        later = sent[seqs.index(spec["seq"]) + 1 :]
        held = [slot for _, _, _, slot in later]
        if slots is None or any(slot is None or not slots.held_unread(slot, self._iteration) for slot in held):
            return [], spec
        for slot in held:
            slots.claim(slot, iteration)
        last_seq, last_state, _, _ = later[-1]
        messages = [encode(iteration, item) for _, _, item, _ in later]
        self._sent.extend(later)
        return messages, {**spec, "seq": last_seq, "state": pickle.loads(last_state)}

    # -- the next epoch, ahead of its request ---------------------------------------------
    def _may_read_ahead(self, run: ReaderRun) -> bool:
        if not self._persistent or run.error is not None or not run.reading_done():
            return False
        return self._next is None or not self._next.done

    def _step_next_epoch(self) -> None:
        if self._next is None:
            self._next = _NextEpoch(ReaderRun(self.setup, self.runtime, self.worker, self._epoch + 1, FRESH, True))
        self._next.step()

    # -- pipes -------------------------------------------------------------------------------
    def _send(self, iteration: int, item: Item, state: Any = None) -> None:
        """Send ``item`` (``state``: a batch's packed state, which may travel in its slot)."""
        if self._resends and isinstance(item, BatchItem) and isinstance(state, bytes):
            self._sent.append((item.seq, state, item, item.slot))
        try:
            data = encode(iteration, item)
        except Exception as error:  # an item that does not pickle (an exotic error), no room in /dev/shm
            data = encode(iteration, ErrorItem(self.worker, item.seq, _portable(error, self.worker)))
        self._items.send_bytes(data)
        self._credits -= 1

    def _read_credits(self) -> None:
        """Count the credits that have come (without waiting for any)."""
        if self._credits_in.poll():
            self._credits += len(os.read(self._credits_in.fileno(), 1 << 16))

    def _wait(self, ends: list) -> bool:
        """Block until one of ``ends`` is ready (True), checking the parent every WATCH_S."""
        while True:
            if multiprocessing.connection.wait(ends, WATCH_S):
                return True
            if os.getppid() != self._parent:
                raise EOFError("the training process is gone")

    def _wait_command(self) -> tuple:
        self._wait([self._commands])
        return self._commands.recv()


def _portable(error: BaseException, worker: int) -> BaseException:
    """``error`` as the training process can raise it: seqshard's errors as they are; others
    as the same type (RuntimeError when it cannot be made) with the worker's traceback."""
    if isinstance(error, SeqshardError):
        try:
            pickle.loads(pack(error))
            return error
        except Exception:
            pass
    text = f"Caught {type(error).__name__} in seqshard worker {worker}.\nOriginal {traceback.format_exc()}"
    try:
        portable = type(error)(text)
        pickle.loads(pack(portable))
        return portable
    except Exception:
        return RuntimeError(text)
