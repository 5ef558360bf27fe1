"""Recipes: how one reader's pipeline is composed, from shards to batches.

A recipe is a function ``recipe(reader) -> Stage`` of batches. :func:`default_recipe` is what
``make_loader``'s options describe::

    read (shards -> decoded samples) -> labels -> audio -> transforms -> length filter -> shuffle -> batch

A :class:`Reader` hands a recipe the built-in stages, already configured from the loader's
options, and the reader's seeds; a recipe may put its own stages anywhere between them::

    def my_recipe(reader):
        samples = reader.labels(reader.read())
        samples = SpeedTag(samples, reader)          # a Stage subclass of the user's
        return reader.batch(reader.shuffle(reader.filter_lengths(samples)))

    make_loader(pattern, recipe=my_recipe)

Most needs are met by ``transforms=[...]`` instead, inserted where the default recipe says:
a function (sample -> sample), :func:`keep_if` (a predicate), or a Stage subclass (built as
``cls(source, reader)``). A stage keeps the contract of ``base.py``; its randomness comes from
``reader.rng(stage_id, ...)`` or, per sample, ``reader.sample_rng(stage_id, sample)``, so
exact and elastic resume keep their guarantees. Recipes and transforms must be picklable
(module-level functions and classes) for spawned workers. Where the next kinds of data plug
in: audio stages (resample, fbank, SpecAugment) are transforms between ``labels`` and
``filter_lengths``; several sources feeding one stream replace ``read``; token batches are
``batch`` with a token-count measure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import ConfigError, SkipCounter
from ...formats.keys import key_hash
from ...seeds import Seed, stage_rng
from ..plan import Unit
from ..stages.audio import signal_stages
from ..stages.base import Filter, Map, Stage
from ..stages.batching import SortBatch
from ..stages.decode import Decoder
from ..stages.filters import length_filter
from ..stages.labels import Labeler, Labels
from ..stages.sample import Sample
from ..stages.shuffle import WindowShuffle
from .setup import WorkerSetup


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
    """One reader (rank x DataLoader worker) building its pipeline for one epoch (or pass).

    ``units`` are the shard pieces it reads. Its built-in stages are configured from the
    loader's options; :meth:`rng` gives the seeds a stage of the user's must use.
    """

    def __init__(
        self,
        setup: WorkerSetup,
        worker: int,
        epoch: int,
        units: list[Unit],
        read_ahead: bool = True,
        stream: int | None = None,
    ):
        self.setup = setup
        self.config = setup.config
        self.table = setup.table
        self.rank = setup.rank
        self.worker = worker
        self.epoch = epoch
        self.units = units
        self.read_ahead = read_ahead
        self.stream = stream  # the source of a mix this reader reads (None: no mix)
        self.skip = SkipCounter(True) if self.config.skip_bad else None

    @property
    def seed_position(self) -> tuple[int, ...]:
        """(epoch, rank, worker), and the source of a mix: the position every seed of this
        reader is derived from."""
        return (self.epoch, self.rank, self.worker) + (() if self.stream is None else (self.stream,))

    def rng(self, stage_id: int, *more: int) -> np.random.Generator:
        """A generator for stage ``stage_id`` of this reader (use a fixed id per stage, >= 100
        for stages of your own)."""
        return stage_rng(self.config.seed, stage_id, *self.seed_position, *more)

    def sample_rng(self, stage_id: int, sample: Sample) -> np.random.Generator:
        """A generator for one sample (SpecAugment masks, speed factors): the same for the
        sample in a given epoch whatever reader, worker count or resume read it."""
        return stage_rng(self.config.seed, Seed.SAMPLE, stage_id, self.epoch, key_hash(sample.key))

    # -- built-in stages ---------------------------------------------------------------------
    def read(self) -> Stage[Sample]:
        """This reader's units, read and decoded into samples of the requested fields."""
        from ..stages.reader import ShardReader

        fields = self.setup.fields
        reader = ShardReader(self.table, self.units, self.config.interleave, self.skip, self.read_ahead, fields.sets)
        return Map(reader, Decoder(self.table, fields.wanted, fields.features), self.skip)

    def labels(self, source: Stage[Sample]) -> Stage[Sample]:
        """Labels from the override file and tokens from the tokenizer (when given)."""
        setup = self.setup
        if setup.tokenizer is None and setup.override is None and not self.config.strip_spaces:
            return source
        return Labels(source, Labeler(setup.tokenizer, setup.override, self.config.strip_spaces), self.skip)

    def audio(self, source: Stage[Sample]) -> Stage[Sample]:
        """Audio decoding and processing (resample, speed, noise, fbank) and feature
        normalisation and masking (CMVN, SpecAugment), as the loader's options ask."""
        return signal_stages(source, self, self.setup.audio, self.setup.decodes_audio)

    def transforms(self, source: Stage[Sample]) -> Stage[Sample]:
        """The loader's ``transforms``, in order."""
        for transform in self.config.transforms:
            source = apply_transform(transform, source, self)
        return source

    def filter_lengths(self, source: Stage[Sample]) -> Stage[Sample]:
        limits = self.config.limits()
        return length_filter(source, limits, self.setup.length) if limits.active else source

    def shuffle(self, source: Stage[Sample]) -> Stage[Sample]:
        if not self.config.shuffle:
            return source
        return WindowShuffle(source, self.config.shuffle_window, self.config.seed, *self.seed_position)

    def batch(self, source: Stage[Sample]) -> SortBatch:
        config = self.config
        return SortBatch(
            source,
            config.sort_window,
            config.cost(),
            config.seed,
            *self.seed_position,
            length=self.setup.length,
            shuffle=config.shuffle,
            oversize=config.oversize,
        )


def default_recipe(reader: Reader) -> Stage:
    """read -> labels -> audio -> transforms -> length filter -> shuffle -> batch."""
    samples = reader.transforms(reader.audio(reader.labels(reader.read())))
    return reader.batch(reader.shuffle(reader.filter_lengths(samples)))


def apply_transform(transform: Any, source: Stage[Sample], reader: Reader) -> Stage[Sample]:
    """One entry of ``transforms`` as a stage over ``source``."""
    if isinstance(transform, KeepIf):
        predicate, name = transform.predicate, transform.name
        return Filter(source, lambda sample: None if predicate(sample) else name)
    if isinstance(transform, type) and issubclass(transform, Stage):
        return transform(source, reader)
    if callable(transform):
        return Map(source, transform, reader.skip)
    raise ConfigError(
        f"transforms takes functions (sample -> sample), keep_if(...) and Stage subclasses, not {transform!r}."
    )


def check_transforms(transforms: Sequence[Any]) -> None:
    """Refuse entries that cannot be transforms before any worker starts."""
    for transform in transforms:
        if not (isinstance(transform, KeepIf) or callable(transform)):
            raise ConfigError(
                f"transforms takes functions (sample -> sample), keep_if(...) and Stage subclasses, not {transform!r}."
            )
