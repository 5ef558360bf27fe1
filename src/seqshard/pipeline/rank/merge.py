"""The training process's side of the workers: one deterministic stream, and its position.

Workers' items are taken in turn (worker 0, 1, ..., skipping finished workers), each from its
own worker, whatever order they are made in, so the stream is a pure function of the workers'
streams. The position records, per worker, the state after its last batch handed out
(``low``) and how many batches were taken from it (``pulled``). Batches taken ahead of their
step (``hold``: a rank near its end counts what it surely still has) wait in the order taken
(``held``) and are handed out in that order; a restore regenerates batches ``low+1 .. pulled``
of each worker (only what was in flight) and holds them again.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ...errors import SeqshardError
from ..epoch_plan import Unit
from ..stages.base import merge_counts
from ..stages.held import trimmed
from ..transport.wire import BatchItem, EndItem, Take, unpack


@dataclass
class WorkerPosition:
    """One reader's place in the stream; its state and counters may be the bytes a worker
    process sent (read when asked for, not at every batch; a state in a batch's slot keeps
    that slot until it is read or replaced)."""

    state: dict[str, Any] | bytes | None = None
    low: int = 0
    pulled: int = 0
    done: bool = False
    stats: dict[str, int] | bytes = field(default_factory=dict)

    def saved_state(self) -> dict[str, Any] | None:
        """The reader's state after its last batch handed out (with every earlier one)."""
        self.state = unpack(self.state)  # bytes, or a view of them in the batch's slot, read once
        return self.state  # type: ignore[return-value]

    def counts(self) -> dict[str, int]:
        """The reader's counters."""
        self.stats = unpack(self.stats)
        return self.stats


@dataclass
class RankPosition:
    """Where one rank's stream stands (JSON-safe, no sample data)."""

    epoch: int
    workers: list[WorkerPosition]
    turn: int = 0
    step: int = 0
    held: list[list[int]] = field(default_factory=list)  # [[worker, seq], ...] taken ahead, not handed out
    utts: int = 0
    frames: int = 0
    padded_frames: int = 0
    completed: bool = False
    plan: list[list[list]] | None = None  # per worker, units replacing the epoch's plan (elastic resume)
    carry: list[list | None] | None = (
        None  # per worker, what is left of each source's pass (elastic resume of a stream)
    )
    sources: list[list[int]] = field(default_factory=list)  # per source of a mix: [utts, length] this epoch
    sources_all: list[list[int]] = field(default_factory=list)  # the same since the stream began
    # elastic resume, on the first rank: the saved readers' counters summed, and the utterances
    # they had taken from the epoch's plan (handed out, dropped or filtered)
    before: dict[str, int] = field(default_factory=dict)
    before_planned: int = 0
    windows_grow: bool = True  # False in an epoch resumed from a state saved before windows grew (version 2)
    skipped_batches: int = 0  # moved past without reading (loader.skip_batches), counted in ``step``
    skipped_utts: int = 0
    # what the ranks agreed on (epochs.py): every rank reaches step ``agreed`` without talking;
    # ``ends`` ("data" or "length") when the epoch ends there, "" when they talk again there
    agreed: int = 0
    ends: str = ""
    agreements: int = 0  # this epoch's
    repeated: int = 0  # this rank's last batch handed out again: it ran out before the agreed step

    @classmethod
    def fresh(
        cls,
        epoch: int,
        workers: int,
        plan: list[list[Unit]] | None = None,
        carry: list[list | None] | None = None,
    ) -> RankPosition:
        return cls(
            epoch,
            [WorkerPosition() for _ in range(workers)],
            plan=None if plan is None else [[u.to_json() for u in units] for units in plan],
            carry=carry,
        )

    def counters(self) -> dict[str, int]:
        """The readers' counters summed (with those of the readers before an elastic resume)."""
        return merge_counts(self.before, *(w.counts() for w in self.workers))

    def taken(self) -> int:
        """Utterances taken from the epoch's plan so far: handed out, skipped, dropped or filtered."""
        return (
            self.utts
            + self.skipped_utts
            + sum(v for k, v in self.counters().items() if k.startswith(("dropped.", "filtered.")))
        )

    def units_of(self, worker: int) -> list[Unit] | None:
        """The units replacing ``worker``'s planned ones this epoch, if any."""
        return None if self.plan is None else [Unit.from_json(u) for u in self.plan[worker]]

    def plan_units(self) -> list[list[Unit]] | None:
        """The units replacing every worker's planned ones this epoch (elastic resume), if any."""
        return None if self.plan is None else [[Unit.from_json(u) for u in units] for units in self.plan]

    def to_json(self, trim: bool = True) -> dict[str, Any]:
        """JSON-safe; ``trim``: each window's record without what it handed out (a saved state)."""
        for worker in self.workers:
            worker.saved_state(), worker.counts()
        if not trim:
            return copy.deepcopy(asdict(self))
        workers = [replace(worker, state=trimmed(worker.state)) for worker in self.workers]
        return copy.deepcopy(asdict(replace(self, workers=workers)))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankPosition:
        data = copy.deepcopy(data)
        data.pop("queues", None)  # bucket sync's queues in the training process before version 4 (refused
        for worker in data["workers"]:  # then with bucket sync: checkpoint.py), empty without it
            worker.pop("emitted_above", None)
        data["workers"] = [WorkerPosition(**w) for w in data["workers"]]
        return cls(**data)

    def continuing(self, epoch: int) -> RankPosition:
        """This position relabelled as the start of ``epoch`` (repeat mode: streams go on)."""
        moved = RankPosition.from_json(self.to_json(trim=False))  # its readers may go on as they stand
        moved.epoch, moved.step, moved.utts, moved.frames, moved.padded_frames, moved.completed = (
            epoch,
            0,
            0,
            0,
            0,
            False,
        )
        moved.skipped_batches = moved.skipped_utts = moved.agreed = moved.repeated = moved.agreements = 0
        moved.ends = ""
        moved.sources = [[0, 0] for _ in moved.sources]
        return moved

    def worker_request(self) -> list[dict[str, Any]]:
        return [
            {
                "state": w.saved_state(),
                "seq": w.low,
                "units": None if self.plan is None else self.plan[i],
                "carry": None if self.carry is None else self.carry[i],
            }
            for i, w in enumerate(self.workers)
        ]


class MergedStream:
    """Takes workers' items in turn (``take(worker)``: that worker's next item) and keeps
    ``position`` up to date."""

    def __init__(self, take: Take, position: RankPosition):
        self._take = take
        self.position = position
        self._held: deque[BatchItem] = deque()
        self._done = sum(w.done for w in position.workers)  # workers that sent their end
        self._count = len(position.workers)
        self._replay()

    def _replay(self) -> None:
        """Regenerate what was in flight at the saved position: the batches held ahead."""
        found: dict[tuple[int, int], BatchItem] = {}
        for worker, spot in enumerate(self.position.workers):
            for seq in range(spot.low + 1, spot.pulled + 1):
                item = self._take(worker)
                if not isinstance(item, BatchItem) or item.seq != seq:
                    raise SeqshardError(
                        f"worker {worker} did not regenerate batch {seq} on resume (got {item.seq}); the shards changed since the state was saved?"
                    )
                found[(worker, seq)] = item
        held = [(w, s) for w, s in self.position.held]
        if sorted(found) != sorted(held):
            raise SeqshardError(
                f"saved loader position is inconsistent: {sorted(set(found) - set(held))} pulled but not held"
            )
        self._held.extend(found[spot] for spot in held)

    @property
    def exhausted(self) -> bool:
        """Whether every worker has sent its end (batches may still be held)."""
        return self._done == self._count

    @property
    def held(self) -> list[BatchItem]:
        """The batches taken ahead and not handed out, in the order they go out."""
        return list(self._held)

    def next(self) -> BatchItem | None:
        """The batch of the next step: the first held one, else the next in turn; None when
        every worker is finished."""
        if self._held:
            self.position.held.pop(0)
            return self._held.popleft()
        return self.pull()

    def hold(self, count: int) -> None:
        """Take batches ahead until ``count`` are held or every worker is finished."""
        while len(self._held) < count:
            item = self.pull()
            if item is None:
                return
            self._held.append(item)
            self.position.held.append([item.worker, item.seq])

    def pull(self) -> BatchItem | None:
        """The next batch in turn, or None when every worker is finished."""
        position = self.position
        workers, count = position.workers, self._count
        while self._done < count:
            turn = position.turn % count
            position.turn = turn + 1
            spot = workers[turn]
            if spot.done:
                continue
            item = self._take(turn)
            spot.stats = item.stats  # type: ignore[union-attr]
            if type(item) is not BatchItem:
                assert isinstance(item, EndItem)
                spot.done = True
                self._done += 1
                if spot.low == spot.pulled:
                    spot.state = item.state
                continue
            spot.pulled = item.seq
            return item
        return None

    # -- handing items out -----------------------------------------------------------------
    def emit(self, item: BatchItem) -> None:
        """Record that ``item`` was handed to training (items go out in the order taken)."""
        position = self.position
        spot = position.workers[item.worker]
        spot.low, spot.state = item.seq, item.state
        position.step += 1
        position.utts += item.size
        position.frames += item.length
        position.padded_frames += item.padded
        if item.by_source is not None:
            self._count_sources(item.by_source)

    def _count_sources(self, by_source: list[list[int]]) -> None:
        position = self.position
        if not position.sources:
            position.sources = [[0, 0] for _ in by_source]
            position.sources_all = position.sources_all or [[0, 0] for _ in by_source]
        for counts, total, (utts, length) in zip(position.sources, position.sources_all, by_source):
            counts[0] += utts
            counts[1] += length
            total[0] += utts
            total[1] += length

    def emit_again(self) -> None:
        """Record that the last batch was handed out once more (see ``RankPosition.repeated``)."""
        self.position.step += 1
        self.position.repeated += 1
