"""How audio becomes model input: the audio options of a loader (fbank, resampling, speed,
noise, CMVN, SpecAugment), and the computations on arrays they name (Kaldi fbank of float
samples, CMVN, SpecAugment masks), shared by pack-time and on-the-fly features.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..checks import parse_json
from ..errors import ConfigError, InputError, Where, option
from ..formats.files import MAX_JSON_BYTES, read_input
from .fbank import FbankOptions, fbank
from .speaker_cmvn import SpeakerCmvn

KALDI_SCALE = 32768.0  # Kaldi's features work on int16-scale samples


@dataclass(frozen=True)
class SpecAugmentOptions:
    """Frequency and time masks (SpecAugment): ``freq_masks`` bands of up to ``max_freq_width``
    bins and ``time_masks`` spans of up to ``max_time_width`` frames (at most
    ``max_time_ratio`` of the utterance), set to zero. Defaults are WeNet's."""

    freq_masks: int = 2
    max_freq_width: int = 10
    time_masks: int = 2
    max_time_width: int = 50
    max_time_ratio: float = 0.2

    def __post_init__(self) -> None:
        for name in ("freq_masks", "max_freq_width", "time_masks", "max_time_width"):
            if getattr(self, name) < 0:
                raise ConfigError(f"spec_augment {name} must be >= 0, got {getattr(self, name)}.")
        if not 0 <= self.max_time_ratio <= 1:
            raise ConfigError(f"spec_augment max_time_ratio must be in [0, 1], got {self.max_time_ratio}.")


@dataclass(frozen=True)
class AudioOptions:
    """How audio becomes model input (the audio options of ``make_loader``, parsed once)."""

    features: str | None = None  # "fbank", or None for padded waveforms
    fbank: FbankOptions = field(default_factory=FbankOptions)
    resample_to: int | None = None
    speed_perturb: tuple[float, ...] = ()
    noise: Any = None  # patterns of noise shards
    noise_snr: tuple[float, float] = (5.0, 20.0)
    noise_prob: float = 1.0
    cmvn: Cmvn | SpeakerCmvn | None = None  # from a file written by `seqshard cmvn`, or per speaker
    spec_augment: SpecAugmentOptions | None = None
    channel: int | None = None


@dataclass(frozen=True)
class Cmvn:
    """Global mean and standard deviation per feature dimension (``seqshard cmvn``)."""

    mean: np.ndarray
    std: np.ndarray

    @classmethod
    def load(cls, path: str | Path) -> Cmvn:
        try:
            data = parse_json(
                read_input(path, MAX_JSON_BYTES, what="JSON"), path, "make it again with `seqshard cmvn`.", kind=dict
            )
            mean = np.asarray(data["mean"], dtype=np.float32)
            std = np.asarray(data["std"], dtype=np.float32)
        except (OSError, ValueError, KeyError) as error:
            raise ConfigError(f"cmvn {str(path)!r}: not a file written by `seqshard cmvn` ({error}).") from None
        finite = np.isfinite(mean).all() and np.isfinite(std).all()
        if mean.shape != std.shape or mean.ndim != 1 or not finite or (std <= 0).any():
            raise ConfigError(f"cmvn {str(path)!r}: mean and std must be vectors of one length, finite, std > 0.")
        return cls(mean, std)

    def normalize(self, feats: np.ndarray) -> np.ndarray:
        """``(feats - mean) / std``; ValueError when the dimensions differ."""
        if feats.shape[1] != len(self.mean):
            raise ValueError(f"the features have {feats.shape[1]} dimensions, the CMVN statistics {len(self.mean)}.")
        return (feats - self.mean) / self.std


def audio_fbank(
    samples: np.ndarray, rate: int, options: FbankOptions, where: Where, rng: np.random.Generator | None = None
) -> np.ndarray:
    """Kaldi fbank of float ``samples`` in [-1, 1] at ``rate``, which must be the rate the
    options are set for (:func:`check_rate`): the one function behind pack-time and on-the-fly
    fbank."""
    check_rate(rate, options, where)
    return fbank(samples * KALDI_SCALE, options, rng if options.dither > 0 else None)


def check_rate(rate: int, options: FbankOptions, where: Where) -> None:
    """InputError (reason ``sample_rate_mismatch``) unless audio at ``rate`` is what fbank with
    ``options`` is set for."""
    if rate != options.sample_rate:
        raise InputError(
            where,
            "sample_rate_mismatch",
            f"the audio is at {rate} Hz where fbank is set for {options.sample_rate:g} Hz.",
            f"pass {option('resample_to', int(options.sample_rate))}.",
        )


def spec_augment(feats: np.ndarray, options: SpecAugmentOptions, rng: np.random.Generator) -> np.ndarray:
    """A copy of ``feats`` (T x D) with frequency and time masks set to zero."""
    out = np.array(feats, dtype=feats.dtype, copy=True)
    masks = draw_masks(*out.shape, options, rng)
    for start, width in masks[: options.freq_masks]:
        out[:, start : start + width] = 0
    for start, width in masks[options.freq_masks :]:
        out[start : start + width] = 0
    return out


def draw_masks(frames: int, bins: int, options: SpecAugmentOptions, rng: np.random.Generator) -> np.ndarray:
    """SpecAugment's masks of a ``frames`` x ``bins`` utterance, as ``(start, width)`` rows
    (``freq_masks`` bands, then ``time_masks`` spans; int64): what :func:`spec_augment` sets to
    zero, drawn alone so that the masks can be applied elsewhere (on the device)."""
    masks = np.empty((options.freq_masks + options.time_masks, 2), dtype=np.int64)
    for row in range(options.freq_masks):
        width = int(rng.integers(0, min(options.max_freq_width, bins) + 1))
        masks[row] = int(rng.integers(0, bins - width + 1)), width
    longest = min(options.max_time_width, int(frames * options.max_time_ratio))
    for row in range(options.freq_masks, len(masks)):
        width = int(rng.integers(0, longest + 1))
        masks[row] = int(rng.integers(0, frames - width + 1)), width
    return masks
