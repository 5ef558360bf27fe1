"""Reading a reader's units: each shard front to back, several shards in turn.

``interleave`` units are open at once and give one sample each in turn, so that consecutive
samples (and so batches) come from several shards. The state is, per open unit, the byte
offset and position of its next sample: a restored reader seeks straight there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from ..errors import ShardError, SkipCounter
from ..formats.tar import SampleStream, skip_samples
from .base import Stage, State
from .shards import ShardTable, Unit

_LOG = logging.getLogger("seqshard")


@dataclass
class RawSample:
    """A sample as read: its key, raw fields and where it is (shard number, byte offset)."""

    key: str
    fields: dict[str, bytes | memoryview]
    shard: int
    offset: int
    ordinal: int


class _OpenUnit:
    def __init__(
        self,
        index: int,
        unit: Unit,
        path: str,
        offset: int,
        ordinal: int,
        expected: int | None,
        read_ahead: bool,
    ):
        self.index = index
        self.unit = unit
        self.expected = expected  # samples the shard's index promises, when indexed
        self.stream = SampleStream(path, offset, ordinal, read_ahead=read_ahead)

    def next_sample(self):
        """The unit's next sample, or None when the unit is done.

        Raises ShardError when the shard ends early: without its end marker, or with fewer
        samples than its index says (a shard cut at a member boundary reads as a valid tar).
        """
        unit = self.unit
        while True:
            if unit.stop is not None and self.stream.ordinal >= unit.stop:
                return None
            sample = self.stream.next_sample()
            if sample is None:
                self._check_end()
                return None
            if sample.ordinal >= unit.start and (sample.ordinal - unit.start) % unit.step == 0:
                return sample

    def _check_end(self) -> None:
        stream = self.stream
        if not stream.ended_cleanly:
            raise ShardError(
                stream.path, stream.resume_offset, "the shard ends without the tar end marker (cut short?)"
            )
        if self.expected is not None and stream.ordinal < self.expected:
            raise ShardError(
                stream.path,
                None,
                f"the shard holds {stream.ordinal} samples where its index.json says {self.expected} (cut short or replaced?)",
            )

    def position(self) -> list[int]:
        return [self.index, self.stream.resume_offset, self.stream.ordinal]

    def rest(self) -> Unit:
        """What is left of this unit, as a unit that starts reading where this one stands."""
        return replace(self.unit, offset=self.stream.resume_offset, at=self.stream.ordinal)


class ShardReader(Stage[RawSample]):
    """Yields the samples of ``units``, ``interleave`` units at a time.

    A damaged shard (unreadable, truncated, shorter than its index says) raises ShardError
    naming it, or with ``skip`` is left at the damage and counted under
    ``dropped.damaged_shard``. ``read_ahead=False`` reads only what is asked for.
    """

    def __init__(
        self,
        table: ShardTable,
        units: list[Unit],
        interleave: int = 4,
        skip: SkipCounter | None = None,
        read_ahead: bool = True,
    ):
        super().__init__(None)
        if interleave < 1:
            raise ValueError("interleave must be >= 1")
        self.table = table
        self.interleave = interleave
        self.skip = skip
        self.read_ahead = read_ahead
        self._units = units
        self._next_unit = 0
        self._slots: list[_OpenUnit] = []
        self._turn = 0
        self._counts = {"utts_read": 0, "units_done": 0, "dropped.damaged_shard": 0}

    def reset(self, state: State | None = None) -> None:
        super().reset(state)
        self._close_all()
        state = state or {}
        self._next_unit = int(state.get("next", 0))
        self._turn = int(state.get("turn", 0))
        self._counts = {**{k: 0 for k in self._counts}, **state.get("counts", {})}
        for index, offset, ordinal in state.get("open", []):
            self._slots.append(self._open(index, self._units[index], offset, ordinal))

    def _open(self, index: int, unit: Unit, offset: int, ordinal: int) -> _OpenUnit:
        shard = self.table.shards[unit.shard]
        return _OpenUnit(index, unit, shard.path, offset, ordinal, shard.num_utts, self.read_ahead)

    def _close_all(self) -> None:
        for slot in self._slots:
            slot.stream.close()
        self._slots = []

    def _open_next(self) -> _OpenUnit | None:
        if self._next_unit >= len(self._units):
            return None
        index = self._next_unit
        self._next_unit += 1
        unit = self._units[index]
        if unit.offset is not None:
            offset, ordinal = unit.offset, unit.at
        elif unit.start and unit.step == 1:
            offset, ordinal = skip_samples(self.table.shards[unit.shard].path, unit.start)
        else:
            offset, ordinal = 0, 0
        return self._open(index, unit, offset, ordinal)

    def _damaged(self, error: ShardError) -> None:
        if self.skip is None:
            raise error
        _LOG.warning("skipping (the rest of) a damaged shard: %s", error)
        self._counts["dropped.damaged_shard"] += 1

    def _fill_slots(self) -> None:
        while len(self._slots) < self.interleave:
            try:
                slot = self._open_next()
            except ShardError as error:
                self._damaged(error)
                continue
            if slot is None:
                return
            self._slots.append(slot)

    def next(self) -> RawSample:
        while True:
            self._fill_slots()
            if not self._slots:
                raise StopIteration
            self._turn %= len(self._slots)
            slot = self._slots[self._turn]
            try:
                sample = slot.next_sample()
            except ShardError as error:
                self._damaged(error)
                sample = None
            if sample is None:
                slot.stream.close()
                del self._slots[self._turn]
                self._counts["units_done"] += 1
                continue
            self._turn += 1
            self._counts["utts_read"] += 1
            return RawSample(sample.key, sample.fields, slot.unit.shard, sample.offset, sample.ordinal)

    def get_state(self) -> State:
        return {
            "next": self._next_unit,
            "turn": self._turn,
            "open": [slot.position() for slot in self._slots],
            "counts": dict(self._counts),
        }

    def stats(self) -> dict[str, int]:
        return dict(self._counts)

    def remaining_units(self) -> list[Unit]:
        """Everything this reader has not yet read, as units."""
        return [slot.rest() for slot in self._slots] + self._units[self._next_unit :]
