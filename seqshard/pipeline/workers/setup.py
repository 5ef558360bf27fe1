"""What every reader of a loader needs, decided once in the training process.

A :class:`WorkerSetup` holds the shard table, the options, this rank's place, the tokenizer and
label override, the field plan, the length measure and the bucket bounds; it is pickled to
spawned DataLoader workers and handed to recipes (``recipe.Reader``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ...errors import ConfigError, SeqshardError
from ...features.audio import AudioOptions
from ...formats.index import bin_bounds, histogram_percentile
from ...formats.remote import RemoteAccess
from ...formats.table import ShardTable
from ...options import LoaderConfig
from ...text.labels import LabelOverride
from ...text.tokenizers import Tokenizer
from ..plan import Unit, plan_epoch
from ..stages.base import Stage, State
from ..stages.collate import Collator, speech_rules
from ..stages.fieldplan import FieldPlan, plan_fields
from ..stages.lengths import Duration, Length, Measure
from ..stages.mixing import MixSetup
from .transfer import BatchSlots


class LivePipelines:
    """The pipeline of each reader whose stream goes on across epochs (``uneven="repeat"``,
    mixes), with its state after the last batch it made. When the next epoch starts from that
    state (no batch was made ahead and dropped: no worker processes), the pipeline continues as
    it is, instead of being rebuilt from the state, which re-reads its windows."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[State, Stage]] = {}

    def keep(self, worker: int, state: State, pipeline: Stage) -> None:
        self._kept[worker] = (state, pipeline)

    def take(self, worker: int, state: State | None) -> Stage | None:
        """The kept pipeline of ``worker`` if it stands at ``state``, else None."""
        kept = self._kept.pop(worker, None)
        return kept[1] if kept is not None and state is not None and kept[0] == state else None


@dataclass
class WorkerSetup:
    """Everything a worker needs to build its pipeline (pickled to spawned workers)."""

    table: ShardTable
    config: LoaderConfig
    rank: int
    world_size: int
    tokenizer: Tokenizer | None
    override: LabelOverride | None
    fields: FieldPlan
    length: Measure
    audio: AudioOptions
    bucket_bounds: tuple[int, ...] = ()
    slots: BatchSlots | None = None
    noise_table: ShardTable | None = None  # noise shards mixed into the audio
    mix: MixSetup | None = None  # the sources of a seqshard.mux, when the loader mixes
    remote: RemoteAccess = field(default_factory=lambda: RemoteAccess())  # how remote shards are read
    live: LivePipelines = field(default_factory=lambda: LivePipelines())  # streams kept across epochs

    def __getstate__(self) -> dict:
        return {**self.__dict__, "live": LivePipelines()}  # open pipelines stay in their process

    @property
    def readers_per_rank(self) -> int:
        return max(1, self.config.num_workers)

    def units(self, plan_epoch_number: int, worker: int) -> list[Unit]:
        config = self.config
        return _cached_plan(
            self.table,
            plan_epoch_number,
            config.seed,
            self.world_size,
            self.readers_per_rank,
            config.shuffle,
            config.split_shards,
        )[self.rank][worker]

    @property
    def decodes_audio(self) -> bool:
        """Whether readers decode the shards' audio (to process it, or to batch waveforms)."""
        return self.fields.audio is not None and self.fields.features is None

    def collator(self) -> Collator:
        config = self.config
        return Collator(speech_rules(self.fields.features or "feats", config.pad_label, config.dtype))


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


def make_setup(
    table: ShardTable,
    config: LoaderConfig,
    rank: int,
    world_size: int,
    tokenizer: Tokenizer | None,
    override: LabelOverride | None,
    mix: MixSetup | None = None,
) -> WorkerSetup:
    """What every reader of a loader with these options needs (checked here, once)."""
    fields = plan_fields(table, config.fields, config.feature_field, tokenizer is not None and override is None)
    audio = config.audio()
    limits = config.limits()
    if tokenizer is None and (limits.max_tokens or limits.min_frames_per_token or limits.max_frames_per_token):
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
    if not any(suffixes for _, suffixes in table.field_sets):
        raise ConfigError(
            f"no sample could be read from the first shard of each folder ({_first_problem(table.shards[0].path)}): "
            "not tar shards, or damaged? `seqshard verify PATTERN` names what is wrong with each."
        )
    if config.batch_frames is not None and length.unit != "frames":
        raise ConfigError(
            "batch_frames counts frames of the feature field (or 10 ms of audio), which these shards or fields= "
            "do not include; batch by batch_size."
        )
    if config.bucket_sync and length.unit != "frames":
        raise ConfigError(
            "bucket_sync buckets the frames of the feature field, which these shards or fields= do not include."
        )
    bounds = bucket_bounds(table, config.num_buckets) if config.bucket_sync else ()
    noise = _noise_table(audio.noise) if audio.noise is not None else None
    if mix is not None and config.recipe is not None:
        raise ConfigError("a mix composes each source's pipeline itself; use transforms= instead of recipe=.")
    return WorkerSetup(
        table, config, rank, world_size, tokenizer, override, fields, length, audio, bounds, noise_table=noise, mix=mix
    )


def _noise_table(patterns: Any) -> ShardTable:
    """The noise set's shards; all of them must be there (a noise set is not skipped in part)."""
    table = ShardTable.from_patterns(patterns)
    if table.missing:
        shown = "; ".join(f"{m.path} ({m.why})" for m in table.missing[:5])
        raise ConfigError(f"noise: {len(table.missing)} file(s) of the noise set are missing: {shown}.")
    return table


def _measure(features: str | None, audio: str | None, tokens: bool) -> Measure:
    """Frames of the feature field; else 10 ms frames of the audio; else, batching by count,
    label tokens or nothing."""
    if features is not None:
        return Length(features, "frames")
    if audio is not None:
        return Duration("audio")
    return Length("tokens", "tokens") if tokens else Length(None, "samples")


def _first_problem(path: str) -> str:
    """Why the first sample of ``path`` cannot be read (for a message)."""
    from ...formats.streams import open_samples

    try:
        with open_samples(path, read_data=False) as stream:
            stream.next_sample()
    except SeqshardError as error:
        return str(error)
    return f"{path} holds no sample"
