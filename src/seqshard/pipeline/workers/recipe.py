"""Recipes: how one reader's pipeline is composed, from shards to batches.

A recipe is a function ``recipe(reader) -> Stage`` of batches. :func:`default_recipe` is what
``make_loader``'s options describe::

    read (the source: decoded samples) -> labels -> audio -> finite check -> transforms -> length filter
      -> shuffle -> batch

The source a recipe starts from is one stage whatever the loader reads: this reader's units of
the epoch (or of one pass, with ``uneven="repeat"``), or a mix of endless streams of passes
over each source (``seqshard.mux``); every later stage, the user's included, works on it the
same way, so ``recipe=`` and ``transforms=`` serve mixes as they serve one source.

A :class:`Reader` hands a recipe the built-in stages, already configured from the loader's
options, and the reader's seeds; a recipe may put its own stages anywhere between them::

    def my_recipe(reader):
        samples = reader.labels(reader.read())
        samples = SpeedTag(samples, reader)          # a Stage subclass of the user's
        return reader.batch(reader.shuffle(reader.filter_lengths(samples)))

    make_loader(pattern, recipe=my_recipe)

Most needs are met by ``transforms=[...]`` instead, inserted where the default recipe says:
a function (sample -> sample), :func:`keep_if` (a predicate), or a Stage subclass (built as
``cls(source, reader)``). A stage keeps the contract of ``stages/base.py``; its randomness comes
from ``reader.rng(stage_id, ...)`` or, per sample, ``reader.sample_rng(stage_id, sample)``, so
exact and elastic resume keep their guarantees. Recipes and transforms must be picklable
(module-level functions and classes) for spawned workers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import ConfigError, SkipCounter
from ...formats.index_entries import bin_length
from ...formats.keys import key_hash
from ...formats.remote.access import RemoteAccess
from ...options import Batching, BudgetWindow
from ...seeds import Seed, stage_rng
from ..epoch_plan import Unit, planned_utts
from ..stages.audio_chain import decode, signal_stages
from ..stages.base import Filter, Growth, Map, Stage
from ..stages.batching import BatchCost, BucketBudgets, FixedSize, LengthBudget, SortBatch
from ..stages.buckets import BucketDraws, BucketSortBatch, bucket_weights
from ..stages.decode import Decoder
from ..stages.filters import finite_filter, length_filter
from ..stages.labels import Labeler, Labels
from ..stages.mixing import Mix
from ..stages.passes import Passes
from ..stages.reader import ShardReader
from ..stages.sample import Sample
from ..stages.shuffle import WindowShuffle
from .setup import WorkerSetup

# A stream's first sort window holds 1/16 of a full one (4 of the default 64 batches; more in an
# epoch of under 4 full windows, which grows in fewer steps: sort_growth), its first shuffle
# window 1/32: its first batch comes after about 1/10 of a full window's reading, and until the
# first batch the shuffle's windows are read as the sort window asks for them.
SORT_GROWTH = Growth(1 / 16)
SHORT_GROWTH = ((2, Growth(1 / 2)), (4, Growth(1 / 4)))  # an epoch under 2 (4) full windows: sort_growth
SHUFFLE_GROWTH = Growth(1 / 32)

Histogram = Iterable[tuple[int, int]] | Mapping[int, int]  # an index's lengths: bin -> samples
Carry = dict[int, tuple[int, list[Unit]]]  # source -> (its pass, the units left of that pass): an elastic resume


@dataclass(frozen=True)
class KeepIf:
    """A transform that keeps the samples for which ``predicate`` holds; the others are
    counted under ``filtered.<name>``."""

    predicate: Callable[[Sample], bool]
    name: str = "custom"


def keep_if(predicate: Callable[[Sample], bool], name: str = "custom") -> KeepIf:
    """A filter transform: ``make_loader(..., transforms=[keep_if(is_english, "not_english")])``."""
    return KeepIf(predicate, name)


class Reader:
    """One reader (rank x worker process) building its pipeline for one epoch.

    Its built-in stages are configured from the loader's options; :meth:`rng` gives the seeds a
    stage of the user's must use. ``units`` replace the reader's planned units of the epoch, and
    ``carry`` the units left of each source's current pass of an endless stream (both: an
    elastic resume); ``access`` reads the shards; ``read_ahead=False`` reads only what the
    stages ask for; ``batches_before``: the batches the reader made in earlier passes of an
    endless stream (``bucket_sync`` draws go on from there).
    """

    def __init__(
        self,
        setup: WorkerSetup,
        worker: int,
        epoch: int,
        access: RemoteAccess | None = None,
        units: list[Unit] | None = None,
        carry: Carry | None = None,
        read_ahead: bool = True,
        batches_before: int = 0,
    ):
        self.setup = setup
        self.options = setup.options
        self.table = setup.table
        self.rank = setup.rank
        self.worker = worker
        self.epoch = epoch
        self.access = access
        self.units = units
        self.carry = carry or {}
        self.read_ahead = read_ahead
        self.batches_before = batches_before
        self.skip = SkipCounter(True) if self.options.bad_data.skip_bad else None

    @property
    def seed_position(self) -> tuple[int, ...]:
        """(epoch, rank, worker): the position every seed of this reader is derived from."""
        return (self.epoch, self.rank, self.worker)

    @property
    def seed(self) -> int:
        return self.options.shuffling.seed

    def rng(self, stage_id: int, *more: int) -> np.random.Generator:
        """A generator for stage ``stage_id`` of this reader (use a fixed id per stage, >= 100
        for stages of your own: ``seqshard.seeds.USER_IDS``)."""
        return stage_rng(self.seed, stage_id, *self.seed_position, *more)

    def sample_rng(self, stage_id: int, sample: Sample) -> np.random.Generator:
        """A generator for one sample (SpecAugment masks, speed factors): the same for the
        sample in a given epoch (or pass of an endless stream) whatever reader, worker count or
        resume read it."""
        epoch = sample.pass_number if sample.pass_number >= 0 else self.epoch
        return stage_rng(self.seed, Seed.SAMPLE, stage_id, epoch, key_hash(sample.key))

    # -- the source ---------------------------------------------------------------------------
    def read(self) -> Stage[Sample]:
        """This reader's samples, decoded: its units of the epoch (of the pass, with
        ``uneven="repeat"``); for a mix, the mix of every source's endless stream of passes."""
        mix = self.setup.mix
        if mix is not None:
            streams = [self._passes(source) for source in range(len(mix.names))]
            return Mix(streams, mix.shares, self.seed, self.rank, self.worker)
        return self.decoded(self.units if self.units is not None else self.setup.units(self.epoch, self.worker))

    def decoded(self, units: list[Unit]) -> Stage[Sample]:
        """``units`` read and decoded into samples of the requested fields."""
        fields = self.setup.fields
        reader = ShardReader(
            self.table,
            units,
            self.options.shuffling.interleave,
            self.skip,
            self.read_ahead,
            fields.sets,
            self.access,
            self.options.reading.path_root,
        )
        return Map(reader, Decoder(self.table, fields.wanted, fields.features), self.skip)

    def _passes(self, source: int) -> Passes:
        """Endless passes over this reader's share of a mix's ``source``."""
        first, carried = self.carry.get(source, (0, None))

        def one_pass(number: int) -> Stage[Sample]:
            if carried is not None and number == first:
                return self.decoded(carried)
            return self.decoded(self.setup.source_units(source, number, self.worker))

        return Passes(one_pass, first)

    # -- built-in stages ------------------------------------------------------------------
    def labels(self, source: Stage[Sample]) -> Stage[Sample]:
        """Labels from the override file and tokens from the tokenizer (when given)."""
        setup, strip = self.setup, self.options.text.strip_spaces
        if setup.tokenizer is None and setup.override is None and not strip:
            return source
        return Labels(source, Labeler(setup.tokenizer, setup.override, strip), self.skip)

    def audio(self, source: Stage[Sample]) -> Stage[Sample]:
        """Audio decoding and processing (resample, speed, noise, fbank) and feature
        normalisation and masking (CMVN, SpecAugment), as the loader's options ask."""
        setup = self.setup
        noise = self._noise() if setup.noise_table is not None and setup.decodes_audio else None
        later = self.options.audio.feature_device is not None  # fbank made from the batch (features/on_device.py)
        return signal_stages(source, setup.audio, setup.decodes_audio, self.sample_rng, noise, self.skip, later)

    def _noise(self) -> Stage[Sample]:
        """Every noise shard, pass after pass, each pass in an order of this reader's own; bad
        noise files are counted and skipped like bad samples."""
        table = self.setup.noise_table
        assert table is not None

        def one_pass(number: int) -> Stage[Sample]:
            order = stage_rng(self.seed, Seed.NOISE_ORDER, self.rank, self.worker, number).permutation(
                len(table.shards)
            )
            reader = ShardReader(table, [Unit(int(i)) for i in order], 1, self.skip, access=self.access)
            return Map(Map(reader, Decoder(table), self.skip), decode, self.skip)

        return Passes(one_pass)

    def finite(self, source: Stage[Sample]) -> Stage[Sample]:
        """With ``check_finite``, samples whose features (or waveforms) hold NaN or infinity
        are dropped and counted (``dropped.non_finite``)."""
        field = self.setup.checked_field
        return finite_filter(source, field) if self.options.bad_data.check_finite and field else source

    def transforms(self, source: Stage[Sample]) -> Stage[Sample]:
        """The loader's ``transforms``, in order."""
        for transform in self.options.pipeline.transforms:
            source = apply_transform(transform, source, self)
        return source

    def filter_lengths(self, source: Stage[Sample]) -> Stage[Sample]:
        limits = self.options.limits
        return length_filter(source, limits, self.setup.length) if limits.active else source

    def shuffle(self, source: Stage[Sample]) -> Stage[Sample]:
        shuffling = self.options.shuffling
        if not shuffling.shuffle:
            return source
        grow = SHUFFLE_GROWTH if self.options.batching.grow_windows else None
        return WindowShuffle(source, shuffling.shuffle_window, self.seed, *self.seed_position, grow=grow)

    def batch(self, source: Stage[Sample]) -> SortBatch:
        """Length-sorted batches; with ``bucket_sync`` each window's in the order of the
        buckets every rank draws (``stages/buckets.py``)."""
        batching, cost = self.options.batching, batch_cost(self.options.batching)
        made = (source, batching.sort_window, cost, self.seed, *self.seed_position)
        options = dict(
            length=self.setup.length,
            shuffle=self.options.shuffling.shuffle,
            oversize=batching.oversize,
            grow=sort_growth(batching, self.table.length_hist, self.planned_samples()),
        )
        if not batching.bucket_sync:
            return SortBatch(*made, **options)
        weights = bucket_weights(self.table.length_hist, self.setup.buckets, cost)
        shared = (self.worker,) if self.options.epochs.continues_stream else (self.epoch, self.worker)  # no rank
        draws = BucketDraws(self.setup.buckets, weights, self.seed, shared)
        return BucketSortBatch(*made, draws=draws, before=self.batches_before, **options)

    def planned_samples(self) -> int | None:
        """The samples of this reader's epoch (or pass) by its shards' index; None for a mix
        (an endless stream, its windows grown once) or shards of unknown size."""
        if self.setup.mix is not None:
            return None
        return planned_utts(
            self.table, self.units if self.units is not None else self.setup.units(self.epoch, self.worker)
        )


def sort_growth(batching: Batching, histogram: Histogram, samples: int | None) -> Growth | None:
    """How the sort windows of a reader's epoch of ``samples`` grow (None: full from the start),
    the index's length ``histogram`` telling how many samples fill a window. Each small window
    pads about as much in all as a full one (its few batches each span a wide range of lengths),
    so an epoch of fewer than 4 full windows starts from a larger one and doubles fewer times
    (``SHORT_GROWTH``: from 1/4 of a full one in an epoch of 2 to 4, from 1/2 in one of fewer);
    one of more, or of unknown size or lengths, grows as ``SORT_GROWTH``. Windows double, so
    that a reader reads 2 batches' worth of the next window for each batch of a growing one;
    its first window, read before its first batch, a persistent worker reads in its spare time
    during the epoch before (``worker.ReaderRun.prepare``)."""
    if not batching.grow_windows:
        return None
    full = window_samples(batching, histogram)
    if samples is None or full is None:
        return SORT_GROWTH
    return next((growth for windows, growth in SHORT_GROWTH if samples < windows * full), SORT_GROWTH)


def window_samples(batching: Batching, histogram: Histogram) -> int | None:
    """Samples of a full sort window: the option's number, or what the default budget window
    reads at the mean share of a batch per sample of the index's length ``histogram`` (bin ->
    samples; None when it is empty)."""
    if batching.sort_window is not None:
        return batching.sort_window
    histogram = dict(histogram)
    if not sum(histogram.values()):
        return None
    cost = batch_cost(batching)
    shares = sum(cost.share(max(1, math.floor(bin_length(b + 0.5)))) * n for b, n in histogram.items())
    return BudgetWindow().samples(shares / sum(histogram.values()))


def batch_cost(batching: Batching) -> BatchCost:
    """What a batch may hold: a fixed count, or a budget of padded length (one per length
    bucket with ``budgets``)."""
    if batching.batch_size is not None:
        return FixedSize(batching.batch_size)
    if batching.budgets is not None:
        return BucketBudgets(batching.budgets)  # type: ignore[arg-type]
    return LengthBudget(int(batching.batch_frames), batching.quadratic_frames)  # type: ignore[arg-type]


SAMPLE_HINT = (
    "a transforms= function (and a keep_if predicate) gets a seqshard Sample, not a dict: read a field as "
    "sample['feats'] or sample.fields['feats'], set one with sample.fields['feats'] = value, and return the sample"
)


def _explained(function: Callable[[Sample], Any], returns_sample: bool) -> Callable[[Sample], Any]:
    """``function`` whose dict-style use of a sample (``sample['x'] = v``, ``sample.get``, a
    dict returned) fails with what a Sample offers, not a bare TypeError or AttributeError."""
    name = getattr(function, "__qualname__", repr(function))

    def call(sample: Sample) -> Any:
        try:
            result = function(sample)
        except (TypeError, AttributeError) as error:
            if "'Sample' object" not in str(error):
                raise
            raise type(error)(f"{error} (in {name}): {SAMPLE_HINT}.") from error
        if returns_sample and not isinstance(result, Sample):
            raise TypeError(f"{name} returned {type(result).__name__}, not the sample: {SAMPLE_HINT}.")
        return result

    return call


def default_recipe(reader: Reader) -> Stage:
    """read -> labels -> audio -> finite check -> transforms -> length filter -> shuffle -> batch."""
    samples = reader.transforms(reader.finite(reader.audio(reader.labels(reader.read()))))
    return reader.batch(reader.shuffle(reader.filter_lengths(samples)))


def apply_transform(transform: Any, source: Stage[Sample], reader: Reader) -> Stage[Sample]:
    """One entry of ``transforms`` as a stage over ``source``."""
    if isinstance(transform, KeepIf):
        predicate, name = _explained(transform.predicate, returns_sample=False), transform.name
        return Filter(source, lambda sample: None if predicate(sample) else name)
    if isinstance(transform, type) and issubclass(transform, Stage):
        return transform(source, reader)
    if callable(transform):
        return Map(source, _explained(transform, returns_sample=True), reader.skip)
    raise ConfigError(
        f"transforms takes functions (sample -> sample), keep_if(...) and Stage subclasses, not {transform!r}."
    )
