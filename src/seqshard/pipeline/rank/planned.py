"""A reader's batches known without reading a sample: the loader's own recipe run over keys and
lengths from the shards' member tables (``formats/members.py``).

The batches a reader makes depend on the samples' order (its units, read ``interleave`` at a
time), their keys and lengths, and the seeded shuffle and sort windows. A member table gives
every sample's key, its byte offset in each field file and, when its writer recorded it, its
length. :class:`PlannedReader` hands the recipe a source that yields exactly those samples
(:class:`PlannedShardReader`: the :class:`~..stages.reader.ShardReader` itself, its units
opened on the tables instead of the files) and stands in for the stages that neither change a
length nor drop a sample (decoding, labels, CMVN, SpecAugment: :class:`Unchanged`); the length
filter, shuffle and sort windows are the loader's own stages. So the batches, and the pipeline
states after each, are those a worker makes (same code, same seeds), and a state of the plan
restores a worker exactly: ``loader.skip_batches`` hands such states to the workers.

What the plan cannot see, it refuses (:func:`unplannable` says why): a recipe or transforms of
the user's, audio measured as it is decoded, limits that count label tokens, ``skip_bad``
(bad samples are only found by reading), ``check_finite`` (nor are non-finite ones), epochs cut
by hours, an elastic
resume, and shards without member tables or without lengths in them, or whose size is not
their table's. A table is trusted as far as that: one that disagrees with its shard otherwise
(which a worker finds as it reads, counting ``damaged_tables``) makes the plan differ from the
batches; ``seqshard verify`` finds such shards.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError
from ...formats.fields import field_name
from ...formats.members import MemberTable, has_table_format, load_table
from ...formats.table import MAIN, ShardTable
from ..epoch_plan import Unit
from ..stages.base import Stage, State, merge_counts
from ..stages.decode import LEGACY_FEATURE_FIELDS
from ..stages.lengths import Length
from ..stages.reader import ShardReader
from ..stages.sample import Sample
from ..workers.recipe import Reader
from ..workers.setup import WorkerSetup
from ..workers.worker import build_pipeline

PLANNED = "planned length"  # the field a planned sample carries its length in


class NotPlannable(ConfigError):
    """The loader's batches cannot be known without reading (the message says why)."""


@dataclass(frozen=True)
class PlannedLength:
    """The length a planned sample carries (1 for every sample when the loader counts samples)."""

    unit: str = "frames"
    counts: bool = False

    def __call__(self, sample: Sample) -> int:
        return 1 if self.counts else sample.fields[PLANNED]

    def describe(self) -> str:
        return f"planned {self.unit}"


def unplannable(setup: WorkerSetup) -> str | None:
    """Why this loader's batches cannot be known from its shards' member tables, or None
    (the shards themselves are checked as the plan opens them)."""
    options = setup.options
    if options.pipeline.recipe is not None:
        return "a recipe= of your own decides the batches"
    if options.pipeline.transforms:
        return "transforms= may change or drop samples"
    if setup.decodes_audio:
        return "audio is measured as it is decoded"
    if options.limits.count_tokens:
        return "max_tokens and the frames-per-token limits count label tokens, known once labels are read"
    if options.bad_data.skip_bad:
        return "skip_bad drops bad samples, found only by reading them"
    if options.bad_data.check_finite:
        return "check_finite drops samples whose features hold NaN or infinity, found only by reading them"
    if options.epochs.epoch_hours is not None or options.epochs.epoch_source is not None:
        return "the epoch is cut by what every rank has read (epoch_hours, epoch_source)"
    length = setup.length
    if not isinstance(length, Length) or (length.field is not None and length.field != _indexed_feature(setup.table)):
        return f"member tables record lengths of the index's feature field, and batches are cut by {length.describe()}"
    return None


def _indexed_feature(table: ShardTable) -> str | None:
    """The feature field whose frames the packer (or ``seqshard index``) records."""
    main = [field_name(suffix) for suffix in dict(table.field_sets).get(MAIN, ())]
    return next((name for name in LEGACY_FEATURE_FIELDS if name in main), None)


def planned_setup(setup: WorkerSetup) -> WorkerSetup:
    """``setup`` for planning: its length measure reads the planned length."""
    why = unplannable(setup)
    if why is not None:
        raise NotPlannable(f"the batches cannot be known without reading the samples: {why}.")
    counts = isinstance(setup.length, Length) and setup.length.field is None
    return dataclasses.replace(setup, length=PlannedLength(setup.length.unit, counts))


def planned_pipeline(setup: WorkerSetup, worker: int, epoch: int) -> Stage:
    """Reader ``worker``'s pipeline of ``epoch`` over planned samples (``setup`` from
    :func:`planned_setup`); ``reset`` it with a worker's state to go on from there."""
    return build_pipeline(setup, worker, epoch, reader=PlannedReader)


class PlannedReader(Reader):
    """A :class:`Reader` whose source yields planned samples (key, length, offsets) and whose
    stages that keep lengths and drop nothing are :class:`Unchanged` (see the module docstring)."""

    def decoded(self, units: list[Unit]) -> Stage[Sample]:
        fields = self.setup.fields
        reader = PlannedShardReader(self.table, units, self.options.shuffling.interleave, fields.sets)
        return Unchanged(reader)  # stands for the Decoder's Map

    def labels(self, source: Stage[Sample]) -> Stage[Sample]:
        return _unchanged_like(super().labels(source), source)

    def audio(self, source: Stage[Sample]) -> Stage[Sample]:
        return _unchanged_like(super().audio(source), source)  # features only: CMVN, SpecAugment


def _unchanged_like(made: Stage, source: Stage) -> Stage:
    """As many :class:`Unchanged` stages over ``source`` as ``made`` put over it."""
    layers = 0
    while made is not source:
        assert made.source is not None, "a stage of the recipe does not stand on its source"
        made, layers = made.source, layers + 1
    for _ in range(layers):
        source = Unchanged(source)
    return source


class Unchanged(Stage[Sample]):
    """Stands for a stage that keeps every sample's length and drops none: passes samples on
    and keeps that stage's own part of a state as it was, so the state restores it."""

    def __init__(self, source: Stage[Sample]):
        super().__init__(source)
        self._own: State = {}

    def reset(self, state: State | None = None) -> None:
        self._own = {k: v for k, v in (state or {}).items() if k != "source"}
        super().reset(state)

    def next(self) -> Sample:
        return self.source.next()  # type: ignore[union-attr]

    def get_state(self) -> State:
        return {**self._own, **super().get_state()}

    def stats(self) -> dict[str, int]:
        return merge_counts(super().stats(), self._own.get("counts", {}))


@dataclass(frozen=True)
class _ShardPlan:
    """What a planned reader takes from a shard's member tables: keys, lengths, and each
    sample's offset (one more: the end) in each field file read, as Python lists."""

    keys: Sequence[str]
    lengths: list[int]
    offsets: list[tuple[str, list[int]]]  # field set -> offsets


class PlannedShardReader(ShardReader):
    """A :class:`ShardReader` whose units are read from member tables: the same samples in the
    same order, and the same state, with a length and no data."""

    def __init__(self, table: ShardTable, units: list[Unit], interleave: int, field_sets: Sequence[str]):
        super().__init__(table, units, interleave, None, False, field_sets)
        self._plans: dict[int, _ShardPlan] = {}

    def _plan_of(self, shard: int) -> _ShardPlan:
        """The member tables of ``shard``'s field files read, as a :class:`_ShardPlan`."""
        if shard not in self._plans:
            tables: dict[str, MemberTable] = {}
            for name, path in self._files(Unit(shard)):
                found = load_table(path) if has_table_format(path) else None
                if found is None:
                    raise NotPlannable(
                        f"the batches cannot be known without reading the samples: {path} has no member table "
                        "(remote shards, lists and Shar folders have none; `seqshard index` writes them for local tars)."
                    )
                if found.file_size != os.stat(path).st_size:  # a reader would go by the headers: the plan cannot
                    raise NotPlannable(
                        f"the batches cannot be known without reading the samples: {path} changed since its member "
                        f"table was made ({os.stat(path).st_size} bytes, the table says {found.file_size}): check it "
                        "with `seqshard verify`, then `seqshard index` its folder."
                    )
                tables[name] = found
            lengths = tables[MAIN].lengths if MAIN in tables else None
            if lengths is None:
                raise NotPlannable(
                    f"the batches cannot be known without reading the samples: the member table of "
                    f"{self.table.shards[shard].path} records no utterance lengths (packed by an older seqshard, or "
                    "indexed from its pack journal): pack it again, or remove its folder's .members/ and "
                    ".seqshard-pack/ and run `seqshard index` on the folder."
                )
            offsets = [(name, table.sample_offsets.tolist()) for name, table in tables.items()]
            self._plans[shard] = _ShardPlan(tables[MAIN].keys, lengths.tolist(), offsets)
        return self._plans[shard]

    def _skip_to(self, unit: Unit) -> tuple[list[int], int]:
        plan = self._plan_of(unit.shard)
        ordinal = min(unit.first(), len(plan.keys))
        return [offsets[ordinal] for _, offsets in plan.offsets], ordinal

    def _open(self, index: int, unit: Unit, offsets: Sequence[int], ordinal: int) -> Any:
        return _PlannedUnit(index, unit, self._plan_of(unit.shard), ordinal, self.table.shards[unit.shard].path)


class _PlannedUnit:
    """One unit read from its shard's plan (the interface of the reader's open units)."""

    def __init__(self, index: int, unit: Unit, plan: _ShardPlan, ordinal: int, path: str):
        self.index, self.unit, self.plan, self.ordinal, self.path = index, unit, plan, ordinal, path

    def close(self) -> None:
        pass

    def damaged_table(self) -> bool:
        return False  # the plan takes the table as it is (its size checked against the shard's)

    def next_sample(self) -> Sample | None:
        unit, plan = self.unit, self.plan
        end = len(plan.keys) if unit.stop is None else min(unit.stop, len(plan.keys))
        while self.ordinal < end:
            number = self.ordinal
            self.ordinal += 1
            if number >= unit.start and (number - unit.start) % unit.step == 0:
                offsets = tuple((name, at[number]) for name, at in plan.offsets)
                return Sample(
                    plan.keys[number], {PLANNED: plan.lengths[number]}, unit.shard, number, offsets, self.path
                )
        return None

    def position(self) -> list:
        return [self.index, [at[self.ordinal] for _, at in self.plan.offsets], self.ordinal]
