"""Audio stages: decode -> resample -> speed perturbation -> noise -> fbank -> CMVN -> SpecAugment.

Each is an ordinary stage (or a function mapped over samples) between labels and the length
filter. Audio is the ``audio`` field (float32 samples in [-1, 1]) with its ``sample_rate``
(batched as one rate per sample; a stream at several rates without ``resample_to`` is warned
about once); fbank replaces them with ``feats`` (T x D frames). Random choices (speed factor, noise, SNR,
dither, masks) come from ``draw(stage, sample)`` (``Reader.sample_rng``): the same for a sample in a given epoch
whatever worker reads it or when, so exact resume needs no state for them. The noise stage
reads its noise as an endless stream of its own shards (never by random access) and keeps that
stream's position in its state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from ...errors import InputError, SkipCounter, option
from ...features.fbank import FbankOptions, num_frames
from ...features.frontend import AudioOptions, audio_fbank, check_rate, draw_masks, spec_augment
from ...features.on_device import MASKS, NOISE_SEED
from ...features.speaker_cmvn import SPEAKER_FIELD, STATS_FIELD, FlooredVariances, SpeakerCmvn
from ...formats.audio import cut, decode_audio, resample
from ...formats.fields import AudioBytes, field_name
from ...formats.peers.lists import SEGMENT_FIELD
from ...seeds import Seed
from .base import Map, Stage, State
from .sample import Sample

_LOG = logging.getLogger("seqshard")
# a sample's cut comes from a Kaldi segments file or a NeMo manifest's offset and duration
CUT_FIX = "fix the times that cut it (a segments line, or a manifest entry's offset and duration; in seconds)."

SampleRng = Callable[[int, Sample], np.random.Generator]  # (stage id, sample) -> its generator for that stage

AUDIO, SAMPLE_RATE, FEATS = "audio", "sample_rate", "feats"
SEGMENT = field_name(SEGMENT_FIELD)


def decode(sample: Sample, channel: int | None = None) -> Sample:
    """The first encoded-audio field (``wav``, ``flac``, ...) decoded into ``audio`` and
    ``sample_rate``, cut to its ``segment`` (``{"start": s, "end": s}``, from a raw list) when
    it has one; a sample without audio raises InputError (reason ``no_audio``)."""
    name = next((k for k, v in sample.fields.items() if isinstance(v, AudioBytes)), None)
    if name is None:
        if AUDIO in sample.fields:
            return sample
        raise InputError(
            sample.where(),
            "no_audio",
            f"the sample has no audio field (it has: {', '.join(sorted(sample.fields)) or 'nothing'}).",
            "read shards that hold audio (wav, flac, ...), or drop the audio options.",
        )
    audio = decode_audio(sample.fields.pop(name).data, sample.where(), channel)
    segment = sample.fields.pop(SEGMENT, None)
    if segment is not None:
        audio = cut(audio, float(segment["start"]), float(segment["end"]), sample.where(), CUT_FIX)
    sample.fields[AUDIO] = audio.samples
    sample.fields[SAMPLE_RATE] = audio.sample_rate
    return sample


class MixedRates:
    """Says once (a warning) when a stream of waveforms (audio shards read without
    ``resample_to`` or fbank) comes at more than one sample rate: its batches may then mix
    rates, each sample's in ``batch["sample_rate"]`` (B,), padded together in ``audio``."""

    def __init__(self) -> None:
        self.first: tuple[str, int] | None = None  # (key, rate) of the first sample
        self.warned = False

    def __call__(self, sample: Sample) -> Sample:
        rate = sample.fields[SAMPLE_RATE]
        if self.first is None:
            self.first = (sample.key, rate)
        elif rate != self.first[1] and not self.warned:
            self.warned = True
            key, first_rate = self.first
            _LOG.warning(
                "%s: the audio is at %d Hz, but %r (read before it) is at %d Hz: batches may mix sample rates "
                '(batch["sample_rate"] holds each sample\'s rate). Pass %s (or another rate) for one rate.',
                sample.where(),
                rate,
                key,
                first_rate,
                option("resample_to", first_rate),
            )
        return sample


def to_rate(sample: Sample, target: int) -> Sample:
    sample.fields[AUDIO] = resample(sample.fields[AUDIO], sample.fields[SAMPLE_RATE], target)
    sample.fields[SAMPLE_RATE] = target
    return sample


def speed(sample: Sample, factor: float) -> Sample:
    """Played ``factor`` times faster (pitch and tempo together, as Kaldi's and WeNet's sox
    ``speed``): the samples resampled as if recorded at ``rate * factor``."""
    if factor != 1.0:
        rate = sample.fields[SAMPLE_RATE]
        sample.fields[AUDIO] = resample(sample.fields[AUDIO], rate * factor, rate)
    return sample


def to_fbank(sample: Sample, options: FbankOptions, rng: np.random.Generator | None) -> Sample:
    audio = sample.fields.pop(AUDIO)
    rate = sample.fields.pop(SAMPLE_RATE)
    sample.fields[FEATS] = audio_fbank(audio, rate, options, sample.where(), rng)
    return sample


def for_batch_features(sample: Sample, options: AudioOptions, draw: SampleRng) -> Sample:
    """What fbank made after the workers needs of a sample (``features/on_device.py``): its rate
    checked as fbank checks it, the seed of its dither noise, and its SpecAugment masks, drawn
    from the generators (and in the order) the stages below draw them from."""
    check_rate(sample.fields[SAMPLE_RATE], options.fbank, sample.where())
    if options.fbank.dither > 0:
        sample.fields[NOISE_SEED] = int(draw(Seed.DITHER, sample).integers(1 << 62))
    masks = options.spec_augment
    if masks is not None:
        frames = num_frames(len(sample.fields[AUDIO]), options.fbank)
        sample.fields[MASKS] = draw_masks(frames, options.fbank.dim, masks, draw(Seed.SPEC_AUGMENT, sample))
    return sample


class AddNoise(Stage[Sample]):
    """Adds noise to each sample's audio with probability ``prob`` at an SNR drawn from
    ``snr`` (dB): the next sample of an endless stream over the noise shards (each pass in an
    order of its own), looped when shorter than the audio, a random stretch when longer."""

    def __init__(self, source: Stage[Sample], noise: Stage[Sample], draw: SampleRng, snr: Sequence[float], prob: float):
        super().__init__(source)
        self.noise = noise  # decoded noise samples, without end
        self.draw = draw
        self.snr = (float(snr[0]), float(snr[1]))
        self.prob = prob

    def reset(self, state: State | None = None) -> None:
        super().reset(state)
        self.noise.reset(None if state is None else state.get("noise"))

    def next(self) -> Sample:
        sample = self.source.next()
        rng = self.draw(Seed.NOISE, sample)
        if rng.random() >= self.prob:
            return sample
        noise = to_rate(self.noise.next(), sample.fields[SAMPLE_RATE]).fields[AUDIO]
        audio = sample.fields[AUDIO]
        sample.fields[AUDIO] = mix(audio, _fit(noise, len(audio), rng), rng.uniform(*self.snr))
        return sample

    def get_state(self) -> State:
        return {**super().get_state(), "noise": self.noise.get_state()}


def _fit(noise: np.ndarray, length: int, rng: np.random.Generator) -> np.ndarray:
    if len(noise) >= length:
        start = int(rng.integers(0, len(noise) - length + 1))
        return noise[start : start + length]
    return np.resize(noise, length)  # looped


def mix(audio: np.ndarray, noise: np.ndarray, snr_db: float) -> np.ndarray:
    """``audio + noise`` with the noise scaled to ``snr_db`` below the audio's power."""
    power = float(np.mean(audio.astype(np.float64) ** 2))
    noise_power = float(np.mean(noise.astype(np.float64) ** 2))
    if power == 0 or noise_power == 0:
        return audio
    scale = np.sqrt(power / (noise_power * 10 ** (snr_db / 10)))
    return (audio + scale * noise).astype(np.float32)


FLOORED = FlooredVariances()  # said once per speaker and process, not again each epoch


class SpeakerNormalize:
    """Kaldi's per-speaker CMVN of a sample's features by its ``cmvn`` field (its speaker's
    statistics), which leaves the sample once applied."""

    def __init__(self, cmvn: SpeakerCmvn):
        self.cmvn = cmvn

    def __call__(self, sample: Sample) -> Sample:
        stats = sample.fields.pop(STATS_FIELD, None)
        if stats is None:
            raise InputError(
                sample.where(),
                "no_cmvn",
                f"the sample has no speaker statistics (field {STATS_FIELD!r}).",
                "pack with --utt2spk and --cmvn-scp (every utterance's speaker needs statistics).",
            )
        try:
            sample.fields[FEATS] = self.cmvn.normalize(sample.fields[FEATS], stats)
        except ValueError as error:
            raise InputError(sample.where(), "bad_cmvn", f"{error}.") from None
        if self.cmvn.norm_vars:
            speaker = sample.fields.get(SPEAKER_FIELD)
            who = f"speaker {speaker!r}" if isinstance(speaker, str) else f"the speaker of {sample.key!r}"
            FLOORED.check(stats, sample.fields[FEATS].shape[1], who, sample.where())
        return sample


def signal_stages(
    source: Stage[Sample],
    options: AudioOptions,
    decode_audio: bool,
    draw: SampleRng,
    noise: Stage[Sample] | None = None,
    skip: SkipCounter | None = None,
    features_later: bool = False,
) -> Stage[Sample]:
    """The stages the options ask for, in order: with ``decode_audio`` (the shards hold audio)
    decode, resample, speed, ``noise`` (a stream of noise samples, when the options add noise)
    and fbank; then CMVN and SpecAugment of the features. ``draw(stage_id, sample)`` gives each
    sample's generator for a stage; ``skip`` counts bad samples instead of raising.
    ``features_later`` (``feature_device``): fbank, CMVN and SpecAugment are left to the
    batch (:func:`for_batch_features` prepares each sample for them)."""
    stage = source
    if decode_audio:
        channel = options.channel
        stage = Map(stage, lambda s: decode(s, channel), skip)
        if options.resample_to:
            target = options.resample_to
            stage = Map(stage, lambda s: to_rate(s, target), skip)
        elif options.features != "fbank":  # fbank checks each sample's rate against its own
            stage = Map(stage, MixedRates())
        if options.speed_perturb:
            factors = options.speed_perturb
            stage = Map(stage, lambda s: speed(s, factors[int(draw(Seed.SPEED, s).integers(len(factors)))]))
        if noise is not None:
            stage = AddNoise(stage, noise, draw, options.noise_snr, options.noise_prob)
        if options.features == "fbank" and features_later:
            return Map(stage, lambda s: for_batch_features(s, options, draw), skip)
        if options.features == "fbank":
            fbank_options = options.fbank
            stage = Map(stage, lambda s: to_fbank(s, fbank_options, draw(Seed.DITHER, s)), skip)
    if isinstance(options.cmvn, SpeakerCmvn):
        stage = Map(stage, SpeakerNormalize(options.cmvn), skip)
    elif options.cmvn is not None:
        cmvn = options.cmvn

        def normalize(sample: Sample) -> Sample:
            try:
                sample.fields[FEATS] = cmvn.normalize(sample.fields[FEATS])
            except ValueError as error:
                raise InputError(sample.where(), "dim_mismatch", str(error)) from None
            return sample

        stage = Map(stage, normalize, skip)
    if options.spec_augment is not None:
        masks = options.spec_augment

        def augment(sample: Sample) -> Sample:
            rng = draw(Seed.SPEC_AUGMENT, sample)
            sample.fields[FEATS] = spec_augment(sample.fields[FEATS], masks, rng)
            return sample

        stage = Map(stage, augment)
    return stage
