"""What every reader of a loader needs, decided once in the training process.

A frozen :class:`WorkerSetup` holds the shard table, the options, this rank's place, the
tokenizer and label override, the field plan, the length measure and the bucket bounds; it is
pickled to spawned worker processes and handed to recipes (``recipe.Reader``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np

from ...errors import ConfigError, SeqshardError, counted, listed
from ...features.frontend import AudioOptions
from ...features.speaker_cmvn import STATS_FIELD, SpeakerCmvn
from ...formats.budgets import LengthBuckets
from ...formats.fields import field_name
from ...formats.index_entries import bin_bounds, histogram_percentile
from ...formats.remote.access import RemoteAccess
from ...formats.streams import open_samples
from ...formats.table import ShardTable
from ...options import BudgetWindow, LoaderOptions
from ...text.label_override import LabelOverride
from ...text.tokenizers import Tokenizer
from ..epoch_plan import Unit, plan_epoch, source_plan
from ..loader_sources import MixSetup
from ..stages.collate import Collator, speech_rules
from ..stages.fieldplan import FieldPlan, plan_fields
from ..stages.lengths import Duration, FbankFrames, Length, Measure

_LOG = logging.getLogger("seqshard")


@dataclass(frozen=True)
class WorkerSetup:
    """Everything a reader needs to build its pipeline, decided once in the training process
    (pickled to spawned workers); what a process holds while it reads is its
    :class:`~.runtime.WorkerRuntime`."""

    table: ShardTable
    options: LoaderOptions
    rank: int
    world_size: int
    tokenizer: Tokenizer | None
    override: LabelOverride | None
    fields: FieldPlan
    length: Measure
    audio: AudioOptions
    buckets: LengthBuckets  # of bucket_sync (no bounds without it)
    noise_table: ShardTable | None = None  # noise shards mixed into the audio
    mix: MixSetup | None = None  # the sources of a seqshard.mux, when the loader mixes

    @property
    def readers_per_rank(self) -> int:
        return self.options.workers.readers

    def units(self, plan_epoch_number: int, worker: int) -> list[Unit]:
        """The units reader ``worker`` of this rank reads in epoch (or pass) ``plan_epoch_number``."""
        shuffling = self.options.shuffling
        return _cached_plan(
            self.table,
            plan_epoch_number,
            shuffling.seed,
            self.world_size,
            self.readers_per_rank,
            shuffling.shuffle,
            shuffling.split_shards,
        )[self.rank][worker]

    def source_units(self, source: int, number: int, worker: int) -> list[Unit]:
        """The units reader ``worker`` reads in pass ``number`` of source ``source`` of a mix."""
        assert self.mix is not None
        shuffling = self.options.shuffling
        start, stop = self.mix.ranges[source]
        plan = source_plan(self.table, start, stop, source, number, shuffling, self.world_size, self.readers_per_rank)
        return plan[self.rank][worker]

    @property
    def dim(self) -> int | None:
        """Columns of the feature vectors in batches: those of the fbank the loader computes
        from audio (``features="fbank"``), else of the shards' features as the index records
        them; None for batches without features (waveforms, labels only)."""
        if self.audio.features == "fbank":
            return self.audio.fbank.dim
        return self.table.dim

    @property
    def decodes_audio(self) -> bool:
        """Whether readers decode the shards' audio (to process it, or to batch waveforms)."""
        return self.fields.audio is not None and self.fields.features is None

    @property
    def checked_field(self) -> str | None:
        """The array ``check_finite`` checks once audio is processed: the features (stored,
        or fbank's), else the decoded waveforms; None when samples hold neither."""
        if self.audio.features == "fbank":
            return "feats"
        return self.fields.features or ("audio" if self.decodes_audio else None)

    def collator(self) -> Collator:
        rules = speech_rules(
            self.fields.features or "feats", self.options.collation.pad_label, self.options.collation.dtype
        )
        return Collator(rules, {name: (kind, layout) for name, kind, layout in self.fields.batched})


@lru_cache(maxsize=2)
def _cached_plan(
    table: ShardTable, epoch: int, seed: int, world_size: int, workers: int, shuffle: bool, split_shards: bool
):
    return plan_epoch(table, epoch, seed, world_size, workers, shuffle, split_shards)


def bucket_bounds(table: ShardTable, count: int) -> tuple[int, ...]:
    """Lengths cutting the dataset's length histogram into ``count`` buckets of equal mass."""
    histogram = dict(table.length_hist)
    if not histogram:
        raise ConfigError(
            "bucket_sync needs length histograms from the shards' index.json (run `seqshard index` on foreign shards)."
        )
    bounds = sorted({round(histogram_percentile(histogram, 100 * k / count)) for k in range(1, count)})
    return tuple(b for b in bounds if b > bin_bounds(min(histogram))[0])


def _speaker_fields(table: ShardTable, options: LoaderOptions, audio: AudioOptions, needs_text: bool) -> FieldPlan:
    """The field plan; with ``cmvn="speaker"`` it reads each sample's speaker statistics too
    (shards without them are refused here, not sample by sample), which the CMVN stage
    consumes, so that no batch carries them."""
    wanted = options.reading.fields
    if not isinstance(audio.cmvn, SpeakerCmvn):
        return plan_fields(table, wanted, options.reading.feature_field, needs_text)
    names = {field_name(suffix) for _, suffixes in table.field_sets for suffix in suffixes}
    if STATS_FIELD not in names:
        raise ConfigError(
            f"cmvn='speaker' normalizes by each utterance's speaker statistics, which these shards do not hold (field "
            f"{STATS_FIELD!r}; they have: {', '.join(sorted(names)) or 'unknown'}): pack them with --utt2spk utt2spk "
            "--cmvn-scp cmvn.scp."
        )
    if wanted is not None and STATS_FIELD not in wanted:
        wanted = (*wanted, STATS_FIELD)
    fields = plan_fields(table, wanted, options.reading.feature_field, needs_text)
    return replace(fields, batched=tuple(entry for entry in fields.batched if entry[0] != STATS_FIELD))


def make_setup(
    table: ShardTable,
    options: LoaderOptions,
    rank: int,
    world_size: int,
    tokenizer: Tokenizer | None,
    override: LabelOverride | None,
    mix: MixSetup | None = None,
    access: RemoteAccess | None = None,
) -> WorkerSetup:
    """What every reader of a loader with these options needs; the checks that involve the data
    (its fields, a tokenizer, the noise set) run here, once."""
    audio = options.audio.parsed()
    fields = _speaker_fields(table, options, audio, tokenizer is not None and override is None)
    if tokenizer is None and options.limits.count_tokens:
        raise ConfigError(
            "max_tokens, min_frames_per_token and max_frames_per_token count label tokens: give a tokenizer."
        )
    processing = audio.features or audio.resample_to or audio.speed_perturb or audio.noise is not None
    if processing and fields.audio is None:
        raise ConfigError(
            "the audio options (features='fbank', resample_to, speed_perturb, noise) need shards that hold "
            f"audio (wav, flac, ...); these hold: {', '.join(s for _, f in table.field_sets for s in f) or 'unknown'}."
        )
    if (audio.cmvn is not None or audio.spec_augment is not None) and fields.audio is not None and not audio.features:
        raise ConfigError(
            "cmvn and spec_augment work on features, and these shards hold audio: pass features='fbank' "
            "(or pack with --features fbank)."
        )
    features = "feats" if audio.features == "fbank" else fields.features
    length = _measure(features, fields.audio, tokenizer is not None)
    if options.audio.feature_device is not None:
        length = FbankFrames(audio.fbank)  # the frames of fbank in the workers: the same batches
        _check_batch_features(fields, audio)
    if not any(suffixes for _, suffixes in table.field_sets):
        raise ConfigError(
            f"no sample could be read from the first shard of each folder ({_first_problem(table.shards[0].path, access)}): "
            "not tar shards, or damaged? `seqshard verify PATTERN` names what is wrong with each."
        )
    batching = options.batching
    if (batching.batch_frames is not None or batching.budgets is not None) and length.unit != "frames":
        raise ConfigError(
            "batch_frames counts frames of the feature field (or 10 ms of audio), which these shards or fields= "
            "do not include; batch by batch_size."
        )
    if batching.bucket_sync and length.unit != "frames":
        raise ConfigError(
            "bucket_sync buckets the frames of the feature field, which these shards or fields= do not include."
        )
    if options.epochs.epoch_hours is not None and length.unit != "frames":
        raise ConfigError(
            "epoch_hours counts hours of the feature field's frames (or of audio), which these shards or fields= "
            "do not include: give epoch_steps."
        )
    if options.bad_data.check_finite and features is None and not (fields.audio and fields.features is None):
        raise ConfigError("check_finite checks features or audio, which these shards or fields= do not include.")
    bounds = LengthBuckets(bucket_bounds(table, batching.num_buckets) if batching.bucket_sync else ())
    noise = _noise_table(audio.noise, access) if audio.noise is not None else None
    setup = WorkerSetup(
        table, options, rank, world_size, tokenizer, override, fields, length, audio, bounds, noise_table=noise, mix=mix
    )
    if mix is not None and rank == 0:
        _warn_of_windows_over_a_pass(setup, mix)
    unlabelled = [
        p for p in map(table.shards.paths.__getitem__, np.flatnonzero(table.shards.listed)) if p.endswith(".scp")
    ]
    if unlabelled and override is None and rank == 0:
        _LOG.warning(
            "%s %s KEY PATH lines (a wav.scp) and no labels: batches hold no texts%s; pass labels= the Kaldi text "
            "file of the same keys (labels='data/train/text').",
            unlabelled[0] if len(unlabelled) == 1 else f"{unlabelled[0]} and {counted(len(unlabelled) - 1, 'other')}",
            "holds" if len(unlabelled) == 1 else "hold",
            f", and empty labels from the {tokenizer.describe()}" if tokenizer is not None else "",
        )
    return setup


def _warn_of_windows_over_a_pass(setup: WorkerSetup, mix: MixSetup) -> None:
    """Say when a reader's windows hold more than one pass of a source's part: its shuffle and
    sort windows then hold copies of that source's utterances, and a short epoch can give an
    utterance twice while most of the source is never read."""
    readers = setup.world_size * setup.readers_per_rank
    shuffling, batching = setup.options.shuffling, setup.options.batching
    window = (shuffling.shuffle_window if shuffling.shuffle else 0) + (
        batching.sort_window or BudgetWindow().min_samples
    )
    for name, share, size in zip(mix.names, mix.shares, mix.sizes):
        if size is None or share <= 0:
            continue
        per_reader = size / readers
        if window * share > per_reader:
            _LOG.warning(
                "mux source %s: each of the %d readers reads about %d of its utterances a pass, but its windows hold "
                "about %d of them (shuffle_window + sort window %d x share %.2f), so copies of its utterances share "
                "a window and can come twice in an epoch; lower shuffle_window and sort_window to %d together, use "
                "fewer workers, or give the source a smaller weight.",
                name,
                readers,
                per_reader,
                window * share,
                window,
                share,
                int(per_reader / share),
            )


def _check_batch_features(fields: FieldPlan, audio: AudioOptions) -> None:
    """What fbank made from the batch (``feature_device``) needs of the shards and options."""
    if fields.audio is None or fields.features is not None:
        raise ConfigError(
            "feature_device makes fbank from the waveforms of a batch: it needs shards that hold audio (wav, flac, "
            "...) and no feature field read with it."
        )
    if audio.cmvn is not None and len(audio.cmvn.mean) != audio.fbank.dim:
        raise ConfigError(
            f"cmvn has statistics of {len(audio.cmvn.mean)} dimensions and fbank makes {audio.fbank.dim}: give "
            "statistics of these features (`seqshard cmvn`), or num_mel_bins to match them."
        )


def _noise_table(patterns: Any, access: RemoteAccess | None) -> ShardTable:
    """The noise set's shards; all of them must be there (a noise set is not skipped in part)."""
    table = ShardTable.from_patterns(patterns, access)
    if table.missing:
        shown = listed([f"{m.path} ({m.why})" for m in table.missing], "; ")
        raise ConfigError(f"noise: {counted(len(table.missing), 'file')} of the noise set missing: {shown}.")
    return table


def _measure(features: str | None, audio: str | None, tokens: bool) -> Measure:
    """Frames of the feature field; else 10 ms frames of the audio; else, batching by count,
    label tokens or nothing."""
    if features is not None:
        return Length(features, "frames")
    if audio is not None:
        return Duration("audio")
    return Length("tokens", "tokens") if tokens else Length(None, "samples")


def _first_problem(path: str, access: RemoteAccess | None) -> str:
    """Why the first sample of ``path`` cannot be read (for a message)."""
    try:
        with open_samples(path, read_data=False, access=access) as stream:
            stream.next_sample()
    except SeqshardError as error:
        return str(error)
    return f"{path} holds no sample"
