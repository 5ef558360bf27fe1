"""Reading a reader's units: each shard front to back, several shards in turn.

``interleave`` units are open at once and give one sample each in turn, so that consecutive
samples (and so batches) come from several shards. The state is, per open unit, the byte
offset and position of its next sample: a restored reader seeks straight there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..errors import ConfigError, ShardError, SkipCounter
from ..formats.tar import SampleStream, skip_samples
from .base import Stage, State
from .shards import ShardTable, Unit

_LOG = logging.getLogger("seqshard")
MAX_EMPTY_PASSES = 16


@dataclass
class RawSample:
    """A sample as read: its key, raw fields and where it is (shard number, byte offset)."""

    key: str
    fields: dict[str, bytes | memoryview]
    shard: int
    offset: int
    ordinal: int


class _OpenUnit:
    def __init__(self, pass_: int, index: int, unit: Unit, path: str, offset: int, ordinal: int):
        self.pass_ = pass_
        self.index = index
        self.unit = unit
        self.stream = SampleStream(path, offset, ordinal)

    def next_sample(self):
        """The unit's next sample, or None when the unit is done."""
        unit = self.unit
        while True:
            if unit.stop is not None and self.stream.ordinal >= unit.stop:
                return None
            sample = self.stream.next_sample()
            if sample is None:
                return None
            if sample.ordinal >= unit.start and (sample.ordinal - unit.start) % unit.step == 0:
                return sample

    def position(self) -> list[int]:
        return [self.pass_, self.index, self.stream.resume_offset, self.stream.ordinal]

    def rest(self) -> Unit:
        """What is left of this unit, as a unit that starts reading where this one stands."""
        return replace(self.unit, offset=self.stream.resume_offset, at=self.stream.ordinal)


class ShardReader(Stage[RawSample]):
    """Yields the samples of ``units_of_pass(0)``; with ``repeat``, then of pass 1, 2, ...

    A damaged shard raises ShardError naming it, or with ``skip`` ends that unit early and
    is counted under ``dropped.damaged_shard``.
    """

    def __init__(
        self,
        table: ShardTable,
        units_of_pass: Callable[[int], list[Unit]],
        interleave: int = 4,
        repeat: bool = False,
        skip: SkipCounter | None = None,
    ):
        super().__init__(None)
        if interleave < 1:
            raise ValueError("interleave must be >= 1")
        self.table = table
        self.units_of_pass = units_of_pass
        self.interleave = interleave
        self.repeat = repeat
        self.skip = skip
        self._pass = 0
        self._units: list[Unit] = []
        self._next_unit = 0
        self._slots: list[_OpenUnit] = []
        self._turn = 0
        self._counts = {"utts_read": 0, "units_done": 0, "dropped.damaged_shard": 0}

    def reset(self, state: State | None = None) -> None:
        super().reset(state)
        self._close_all()
        state = state or {}
        self._pass = int(state.get("pass", 0))
        self._units = self.units_of_pass(self._pass)
        self._next_unit = int(state.get("next", 0))
        self._turn = int(state.get("turn", 0))
        self._counts = {**{k: 0 for k in self._counts}, **state.get("counts", {})}
        for pass_, index, offset, ordinal in state.get("open", []):
            unit = (self._units if pass_ == self._pass else self.units_of_pass(pass_))[index]
            self._slots.append(_OpenUnit(pass_, index, unit, self.table.shards[unit.shard].path, offset, ordinal))

    def _close_all(self) -> None:
        for slot in self._slots:
            slot.stream.close()
        self._slots = []

    def _open_next(self) -> _OpenUnit | None:
        empty_passes = 0
        while self._next_unit >= len(self._units):
            if not self.repeat:
                return None
            self._pass += 1
            self._units = self.units_of_pass(self._pass)
            self._next_unit = 0
            empty_passes = 0 if self._units else empty_passes + 1
            if empty_passes > MAX_EMPTY_PASSES:
                raise ConfigError(
                    "a reader got no data in 16 passes: the dataset has fewer utterances than readers (ranks x workers); use fewer workers."
                )
        index = self._next_unit
        self._next_unit += 1
        unit = self._units[index]
        path = self.table.shards[unit.shard].path
        if unit.offset is not None:
            offset, ordinal = unit.offset, unit.at
        elif unit.start and unit.step == 1:
            offset, ordinal = skip_samples(path, unit.start)
        else:
            offset, ordinal = 0, 0
        return _OpenUnit(self._pass, index, unit, path, offset, ordinal)

    def next(self) -> RawSample:
        while True:
            while len(self._slots) < self.interleave:
                slot = self._open_next()
                if slot is None:
                    break
                self._slots.append(slot)
            if not self._slots:
                raise StopIteration
            self._turn %= len(self._slots)
            slot = self._slots[self._turn]
            try:
                sample = slot.next_sample()
            except ShardError as error:
                if self.skip is None:
                    raise
                _LOG.warning("skipping the rest of a damaged shard: %s", error)
                self._counts["dropped.damaged_shard"] += 1
                sample = None
            if sample is None:
                slot.stream.close()
                replacement = self._open_next()
                if replacement is None:
                    del self._slots[self._turn]
                else:
                    self._slots[self._turn] = replacement
                self._counts["units_done"] += 1
                continue
            self._turn += 1
            self._counts["utts_read"] += 1
            return RawSample(sample.key, sample.fields, slot.unit.shard, sample.offset, sample.ordinal)

    def get_state(self) -> State:
        return {
            "pass": self._pass,
            "next": self._next_unit,
            "turn": self._turn,
            "open": [slot.position() for slot in self._slots],
            "counts": dict(self._counts),
        }

    def stats(self) -> dict[str, int]:
        return dict(self._counts)

    def remaining_units(self) -> list[Unit]:
        """Everything this reader has not yet read (of the current pass), as units."""
        return [slot.rest() for slot in self._slots] + self._units[self._next_unit :]
