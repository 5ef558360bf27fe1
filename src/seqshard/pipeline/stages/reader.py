"""Reading a reader's units: each shard front to back, several shards in turn.

``interleave`` units are open at once and give one sample each in turn, so that consecutive
samples (and so batches) come from several shards. A unit reads the field files the loader
asks for (the main shard and/or sidecar field shards, see ``formats/index.py``) in lock step:
each holds the same keys in the same order, and a key that differs is an error naming both
files. A file whose index records its first and last key is checked against them when its
first sample is read and when it ends (a shard replaced by a copy of another is damaged).
The state is, per open unit, the byte offset of its next sample in each field file and its
position: a restored reader seeks straight there.

A key read twice by one reader in one epoch (or one pass of ``uneven="repeat"`` and of a
mix's source) is counted as ``duplicate_keys`` and warned about once: two selected shards
hold the same samples. The keys read are kept as 64-bit hashes in a sorted array, 8 bytes
per sample the reader reads (about three times that for a moment while the latest keys are
merged in); they are not part of the state, so keys read before a resume are not compared
with those read after it.
"""

from __future__ import annotations

import functools
import logging
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from ...errors import ShardError, SkipCounter
from ...formats.remote.access import RemoteAccess, is_remote
from ...formats.streams import AnyStream, open_samples, skip_samples
from ...formats.table import MAIN, REPLACED, ShardInfo, ShardTable, size_problem
from ...formats.tar import SampleStream, TarRecord
from ..epoch_plan import Unit
from .base import Stage, State
from .held import Origin
from .sample import Sample

_LOG = logging.getLogger("seqshard")
DAMAGED = "damaged."  # counter prefix: one counter per damaged shard, by its number in the table
DAMAGED_TABLE = "damaged_table."  # and per shard whose member table disagreed with it (read by its headers)
DUPLICATE_KEYS = "duplicate_keys"
ADD_FIELD_AGAIN = "add the field again with `seqshard add-field`"  # a stream's out_of_step_fix may say otherwise


class KeyRepeats:
    """The keys one reader has read, to find those read again: 64-bit hashes in a sorted array
    (8 bytes a key), merged with the latest keys every few thousand keys and at the end."""

    MERGE_EVERY = 4096  # or more: as many as were merged before, so merging costs O(1) a key

    def __init__(self) -> None:
        self._seen = np.empty(0, dtype=np.int64)
        self._hashes = array("q")  # the latest keys' hashes, not merged yet
        self._latest: list[tuple[str, str]] = []  # and (key, file) of each
        self._merge_at = self.MERGE_EVERY

    def add(self, key: str, file: str) -> list[tuple[str, str]]:
        """Note ``key`` read from ``file``; returns the keys found read again by a merge."""
        self._hashes.append(hash(key))  # salted per process: the table lives in one process
        self._latest.append((key, file))
        return self.merge() if len(self._latest) >= self._merge_at else []

    def merge(self) -> list[tuple[str, str]]:
        """Merge the latest keys; returns ``(key, file)`` of each that was read before."""
        if not self._latest:
            return []
        latest = np.array(self._hashes, dtype=np.int64)
        order = np.argsort(latest, kind="stable")
        ordered = latest[order]
        again = np.zeros(len(latest), dtype=bool)
        again[order[1:]] = ordered[1:] == ordered[:-1]  # a later copy of a key among the latest
        at = np.minimum(np.searchsorted(self._seen, latest), max(len(self._seen) - 1, 0))
        if len(self._seen):
            again |= self._seen[at] == latest
        repeats = [self._latest[i] for i in np.flatnonzero(again)]
        self._seen = np.sort(np.concatenate([self._seen, ordered]), kind="stable")  # two sorted runs: linear
        self._hashes = array("q")
        self._latest = []
        self._merge_at = max(self.MERGE_EVERY, len(self._seen))
        return repeats


def _check_local_size(shard: ShardInfo) -> None:
    """An indexed local shard whose size is not its index's is damaged before a sample of it is
    read (a shard cut short would give its first samples, then fail mid-epoch)."""
    problem = size_problem(shard.path, shard.bytes) if shard.num_utts is not None else None
    if problem is not None:  # remote shards are checked against the server's size when opened
        raise ShardError(
            shard.path,
            None,
            f"{problem}. Fix: check it with `seqshard verify`, then copy it again, re-pack it or re-index its folder.",
        )


class _OpenUnit:
    """One unit being read: a stream per field file of ``field_sets`` of ``shard``, advanced
    together, from ``offsets`` (where sample ``ordinal`` begins in each)."""

    def __init__(
        self,
        index: int,
        unit: Unit,
        shard: ShardInfo,
        field_sets: Sequence[str],
        offsets: Sequence[int],
        ordinal: int,
        read_ahead: bool,
        access: RemoteAccess | None,
        path_root: str | None = None,
    ):
        self.index = index
        self.unit = unit
        self.sets = list(field_sets)
        self.expected = shard.num_utts  # samples the shard's index promises, when indexed
        self.key_ranges = [shard.key_range(name) for name in field_sets]  # (first key, last key), when recorded
        self.last_keys: list[str | None] = [None] * len(field_sets)  # the last key read from each file
        self.streams: list[AnyStream] = []
        try:
            for name, offset in zip(field_sets, offsets):
                path = shard.file_of(name)
                self.streams.append(
                    open_samples(path, offset, ordinal, read_ahead=read_ahead, access=access, path_root=path_root)
                )
        except BaseException:
            self.close()
            raise
        if len(self.streams) == 1:  # the common case: one call a sample, not two
            self.next_sample = functools.partial(self._next_of_one, unit, self.streams[0])  # type: ignore[method-assign]

    def close(self) -> None:
        for stream in self.streams:
            stream.close()

    @property
    def ordinal(self) -> int:
        return self.streams[0].ordinal

    def next_sample(self) -> Sample | None:
        """The unit's next sample (raw fields by member suffix), or None when it is done.

        Raises ShardError when a file ends early (without its end marker, with fewer samples
        than its index says, or before the other field files), or when the field files
        disagree on a key.
        """
        unit = self.unit
        if len(self.streams) == 1:
            return self._next_of_one(unit, self.streams[0])
        while True:
            if unit.stop is not None and self.ordinal >= unit.stop:
                return None
            parts = [stream.next_sample() for stream in self.streams]
            first = parts[0]
            if first is None or any(part is None for part in parts):
                self._check_end(parts)
                return None
            for number, part in enumerate(parts):
                self._check_key(number, part)  # type: ignore[arg-type]
            for stream, part in zip(self.streams[1:], parts[1:]):
                if part.key != first.key:  # type: ignore[union-attr]
                    raise ShardError(
                        stream.path,
                        part.offset,  # type: ignore[union-attr]
                        f"field files disagree: sample {first.ordinal} is {first.key!r} in {self.streams[0].path} "
                        f"but {part.key!r} here ({getattr(stream, 'out_of_step_fix', ADD_FIELD_AGAIN)})",  # type: ignore[union-attr]
                    )
            if first.ordinal >= unit.start and (first.ordinal - unit.start) % unit.step == 0:
                fields = {}
                for part in parts:
                    fields.update(part.fields)  # type: ignore[union-attr]
                offsets = tuple((name, part.offset) for name, part in zip(self.sets, parts))  # type: ignore[union-attr]
                return Sample(first.key, fields, unit.shard, first.ordinal, offsets, self.streams[0].path)

    def _next_of_one(self, unit: Unit, stream: AnyStream) -> Sample | None:
        """``next_sample`` when one field file is read (the common case, kept short)."""
        while True:
            if unit.stop is not None and stream.ordinal >= unit.stop:
                return None
            part = stream.next_sample()
            if part is None:
                self._check_end([None])
                return None
            self.last_keys[0] = part.key
            if part.ordinal == 0 or (self.expected is not None and part.ordinal >= self.expected):
                self._check_key(0, part)
            if part.ordinal >= unit.start and (part.ordinal - unit.start) % unit.step == 0:
                return Sample(
                    part.key, part.fields, unit.shard, part.ordinal, ((self.sets[0], part.offset),), stream.path
                )

    def _check_key(self, number: int, part: TarRecord) -> None:
        """Remember the key read from file ``number``; the first sample of a file must have
        the first key its index records, and no sample may lie beyond its count."""
        self.last_keys[number] = part.key
        if self.expected is not None and part.ordinal >= self.expected:
            raise ShardError(
                self.streams[number].path,
                part.offset,
                f"it holds more samples than the {self.expected} its index.json says: {REPLACED}",
            )
        expected = self.key_ranges[number]
        if part.ordinal == 0 and expected is not None and part.key != expected[0]:
            raise ShardError(
                self.streams[number].path,
                part.offset,
                f"its first sample is {part.key!r} where its index.json says {expected[0]!r}: {REPLACED}",
            )

    def _check_end(self, parts: list) -> None:
        for stream, part, expected, last in zip(self.streams, parts, self.key_ranges, self.last_keys):
            if part is not None:
                raise ShardError(
                    stream.path,
                    part.offset,
                    f"holds more samples than the other field files of its shard ({', '.join(s.path for s in self.streams if s is not stream)})",
                )
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
            if expected is not None and last is not None and last != expected[1]:
                raise ShardError(
                    stream.path,
                    None,
                    f"its last sample is {last!r} where its index.json says {expected[1]!r}: {REPLACED}",
                )

    def damaged_table(self) -> bool:
        """Whether a member table of this unit's files disagreed with its file (that file is
        read by its headers from there on)."""
        return any(getattr(stream, "mismatch", None) is not None for stream in self.streams)

    def position(self) -> list:
        return [self.index, [stream.resume_offset for stream in self.streams], self.ordinal]

    def rest(self) -> Unit:
        """What is left of this unit, as a unit that starts reading where this one stands."""
        offsets = tuple((name, stream.resume_offset) for name, stream in zip(self.sets, self.streams))
        return replace(self.unit, offsets=offsets, at=self.ordinal)


class ShardReader(Stage[Sample]):
    """Yields the samples of ``units``, ``interleave`` units at a time, reading the field
    files of ``field_sets`` (``MAIN`` is the shard itself; other names are sidecar field sets).

    A damaged shard (unreadable, truncated, shorter than its index says, other first or last
    key than its index records) raises ShardError naming it, or with ``skip`` is left at the
    damage: counted by shard (``damaged.<shard>``), its planned samples not read under
    ``dropped.damaged``. A shard whose member table disagrees with it is read by its headers
    and counted by shard (``damaged_table.<shard>``). Keys read twice are counted (see the
    module docstring).
    ``read_ahead=False`` reads only what is asked for; ``path_root``: the folder relative paths
    of lists read directly are taken from.
    """

    def __init__(
        self,
        table: ShardTable,
        units: list[Unit],
        interleave: int = 4,
        skip: SkipCounter | None = None,
        read_ahead: bool = True,
        field_sets: Sequence[str] = (MAIN,),
        access: RemoteAccess | None = None,
        path_root: str | None = None,
    ):
        super().__init__(None)
        if interleave < 1:
            raise ValueError("interleave must be >= 1")
        if not field_sets:
            raise ValueError("a reader needs at least one field set to read")
        self.table = table
        self.interleave = interleave
        self.skip = skip
        self.read_ahead = read_ahead
        self.field_sets = tuple(field_sets)
        self.access = access
        self.path_root = path_root
        self._units = units
        self._next_unit = 0
        self._slots: list[_OpenUnit] = []
        self._turn = 0
        self._counts = {"utts_read": 0, "units_done": 0, "dropped.damaged": 0, DUPLICATE_KEYS: 0}
        self._keys_read = KeyRepeats()
        self._restored: list = []  # positions of the units open in the state restored, until they are opened
        self._filled = False  # as many units open as may be (until one ends)

    def reset(self, state: State | None = None) -> None:
        super().reset(state)
        self._close_all()
        self._keys_read = KeyRepeats()
        state = state or {}
        self._next_unit = int(state.get("next", 0))
        self._turn = int(state.get("turn", 0))
        self._counts = {**{k: 0 for k in self._counts}, **state.get("counts", {})}
        self._restored = list(state.get("open", []))  # opened at the first read: a restore may read nothing here
        self._filled = False

    def _open_restored(self) -> None:
        restored, self._restored = self._restored, []
        for index, offsets, ordinal in restored:
            self._slots.append(self._open(index, self._units[index], offsets, ordinal))

    def _files(self, unit: Unit) -> list[tuple[str, str]]:
        shard = self.table.shards[unit.shard]
        return [(name, shard.file_of(name)) for name in self.field_sets]

    def _open(self, index: int, unit: Unit, offsets: Sequence[int], ordinal: int) -> _OpenUnit:
        shard = self.table.shards[unit.shard]
        if self.skip is None and MAIN in self.field_sets:  # skipping, the intact samples are read, the rest counted
            _check_local_size(shard)
        return _OpenUnit(
            index, unit, shard, self.field_sets, offsets, ordinal, self.read_ahead, self.access, self.path_root
        )

    def _close_all(self) -> None:
        for slot in self._slots:
            slot.close()
        self._slots = []

    def _open_next(self) -> _OpenUnit | None:
        if self._next_unit >= len(self._units):
            return None
        index = self._next_unit
        self._next_unit += 1
        unit = self._units[index]
        if self.read_ahead and self.access and self._next_unit < len(self._units):  # remote: start on the next one
            for _, path in self._files(self._units[self._next_unit]):
                if is_remote(path):
                    self.access.prefetch(path)
        known = dict(unit.offsets or ())
        if all(name in known for name in self.field_sets):
            offsets, ordinal = [known[name] for name in self.field_sets], unit.at
        elif unit.first() and unit.step == 1:
            offsets, ordinal = self._skip_to(unit)
        else:
            offsets, ordinal = [0] * len(self.field_sets), 0
        return self._open(index, unit, offsets, ordinal)

    def _skip_to(self, unit: Unit) -> tuple[list[int], int]:
        """Where ``unit``'s first sample starts in each field file, and its ordinal (smaller
        when the shard holds fewer samples)."""
        found = [skip_samples(path, unit.first(), self.access) for _, path in self._files(unit)]
        return [offset for offset, _ in found], found[0][1]

    def _damaged(self, error: ShardError, unit: Unit, at: int) -> None:
        """Raise, or (skipping) count the damaged shard and its planned samples from ``at`` on
        as ``dropped.damaged`` (when the shard's size is known), so that counts add up."""
        if self.skip is None:
            raise error
        _LOG.warning("skipping (the rest of) a damaged shard: %s", error)
        self._counts[f"{DAMAGED}{unit.shard}"] = 1  # by shard: a shard split between readers is one
        lost = replace(unit, at=max(at, unit.at)).count(self.table.shards[unit.shard].num_utts)
        self._counts["dropped.damaged"] += lost or 0

    def _fill_slots(self) -> None:
        """Open units until ``interleave`` are open or none is left."""
        if self._restored:
            self._open_restored()
        while len(self._slots) < self.interleave:
            try:
                slot = self._open_next()
            except ShardError as error:
                unit = self._units[self._next_unit - 1]
                self._damaged(error, unit, unit.first())
                continue
            if slot is None:
                break
            self._slots.append(slot)
        self._filled = True  # until a unit ends (or a reset)

    def next(self) -> Sample:
        while True:
            if not self._filled:
                self._fill_slots()
            if not self._slots:
                self._count_repeats(self._keys_read.merge())
                raise StopIteration
            self._turn %= len(self._slots)
            slot = self._slots[self._turn]
            at = slot.ordinal  # samples from here to the one that fails are not read (or not kept)
            try:
                sample = slot.next_sample()
            except ShardError as error:
                self._damaged(error, slot.unit, at)
                sample = None
            if sample is None:
                self._count_table(slot)
                slot.close()
                del self._slots[self._turn]
                self._counts["units_done"] += 1
                self._filled = False
                continue
            self._turn += 1
            self._counts["utts_read"] += 1
            repeats = self._keys_read.add(sample.key, sample.file)
            if repeats:
                self._count_repeats(repeats)
            return sample

    def _count_repeats(self, repeats: list[tuple[str, str]]) -> None:
        """Count keys this reader had read already; warn at the first."""
        if not repeats:
            return
        if not self._counts[DUPLICATE_KEYS]:
            _LOG.warning(
                "key %r was read twice by one reader in one epoch (again from %s): two selected shards hold the "
                "same samples (a copy of a shard under another name?). Such repeats are counted as %s in stats(); "
                "select each shard once.",
                *repeats[0],
                DUPLICATE_KEYS,
            )
        self._counts[DUPLICATE_KEYS] += len(repeats)

    def _count_table(self, *slots: _OpenUnit) -> dict[str, int]:
        """Count the shards of ``slots`` whose member table disagreed; the counters."""
        for slot in slots:
            if slot.damaged_table():
                self._counts[f"{DAMAGED_TABLE}{slot.unit.shard}"] = 1  # by shard, as damaged shards are
        return self._counts

    def get_state(self) -> State:
        return {
            "next": self._next_unit,
            "turn": self._turn,
            "open": [slot.position() for slot in self._slots] or list(self._restored),
            "counts": dict(self._count_table(*self._slots)),
        }

    def stats(self) -> dict[str, int]:
        return dict(self._count_table(*self._slots))

    def fetcher(self) -> SampleFetcher:
        """A stage that reads this reader's samples again one by one, from their origins."""
        return SampleFetcher(self.table, self.field_sets, self.access, self.path_root)

    def remaining_units(self) -> list[Unit]:
        """Everything this reader has not yet read, as units."""
        self._open_restored()
        return [slot.rest() for slot in self._slots] + self._units[self._next_unit :]


class SampleFetcher(Stage[Sample]):
    """Samples read again one by one at their origins (``held.Origin``), in the order they are
    queued (:meth:`queue`): the source of a window's replay (``workers/replay.py``). Each field
    file is read by its tar headers from the origin's byte offset, as a shard without a member
    table is read (a few files kept open: the samples of a window come from a few shards)."""

    KEEP_OPEN = 16

    def __init__(
        self,
        table: ShardTable,
        field_sets: Sequence[str],
        access: RemoteAccess | None = None,
        path_root: str | None = None,
    ):
        super().__init__(None)
        self.table, self.field_sets, self.access, self.path_root = table, tuple(field_sets), access, path_root
        self._queue: deque[Origin] = deque()
        self._streams: dict[str, AnyStream] = {}  # oldest first
        self._checked: set[int] = set()  # shards whose size was checked against their index

    def queue(self, origins: Sequence[Origin]) -> None:
        self._queue.extend(origins)

    def reset(self, state: State | None = None) -> None:
        super().reset(state)
        self._queue.clear()

    def next(self) -> Sample:
        if not self._queue:
            raise StopIteration
        origin = self._queue.popleft()
        shard = self.table.shards[origin.shard]
        if origin.shard not in self._checked and MAIN in self.field_sets:
            _check_local_size(shard)
            self._checked.add(origin.shard)
        fields: dict = {}
        first = None
        for name, offset in origin.offsets:
            path = shard.file_of(name)
            record = self._read(path, offset, origin.ordinal)
            if record is None or (first is not None and record.key != first.key):
                found = "the end of the shard" if record is None else f"{record.key!r}"
                raise ShardError(
                    path, offset, f"sample {origin.ordinal + 1} was read here before, now {found} (changed since?)"
                )
            first = first or record
            fields.update(record.fields)
        assert first is not None
        return Sample(
            first.key, fields, origin.shard, origin.ordinal, origin.offsets, shard.file_of(origin.offsets[0][0])
        )

    def _read(self, path: str, offset: int, ordinal: int) -> TarRecord | None:
        """The sample at ``offset`` of ``path`` (a stream kept open when it can go there)."""
        stream = self._streams.pop(path, None)
        if stream is not None and stream.resume_offset != offset:
            if isinstance(stream, SampleStream):
                stream.seek(offset, ordinal)
            else:  # lists, manifests, Shar and NeMo streams: opened again at the offset
                stream.close()
                stream = None
        if stream is None:
            stream = open_samples(
                path, offset, ordinal, read_ahead=False, access=self.access, use_table=False, path_root=self.path_root
            )
        self._streams[path] = stream
        if len(self._streams) > self.KEEP_OPEN:
            oldest = next(iter(self._streams))
            self._streams.pop(oldest).close()
        return stream.next_sample()

    def close(self) -> None:
        for stream in self._streams.values():
            stream.close()
        self._streams = {}
