"""Kaldi-compatible log mel filterbank features (``compute-fbank-feats``), vectorized with numpy.

Frames are processed in blocks, never one by one: framing is a strided view, the FFT runs over a
``(frames, fft_size)`` matrix and the mel banks are one matrix product. Results match Kaldi to
float32 rounding (tests/test_fbank.py states the measured differences).

The waveform is in Kaldi's scale: the sample values of a 16-bit PCM file as floats (-32768 ..
32767), not divided by 32768. A waveform scaled by ``s`` shifts every log mel value by ``2 ln s``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..checks import check_flag, check_number
from ..errors import ConfigError

__all__ = ["WINDOWS", "FbankOptions", "fbank", "num_frames"]

WINDOWS = ("povey", "hamming", "hanning", "rectangular")
# Kaldi floors energies at FLT_EPSILON before taking logs.
_FLT_EPSILON = float(np.finfo(np.float32).eps)
# Frames per block: big enough to amortise numpy's per-call cost, small enough that a block's
# buffers (~1 MB) stay in cache between the steps instead of streaming through memory each time.
_BLOCK_FRAMES = 256
# Samples per frame at most (5.5 s at 48 kHz): the window, FFT and mel banks are sized from it.
_MAX_WINDOW = 1 << 18


@dataclass(frozen=True)
class FbankOptions:
    """The options of Kaldi's ``compute-fbank-feats`` that :func:`fbank` honours (Kaldi's names in comments).

    Defaults are Kaldi's except ``num_mel_bins`` (Kaldi: 23) and ``dither`` (Kaldi: 1.0; here 0
    so that output is deterministic unless noise is asked for).
    """

    sample_rate: float = 16000.0  # --sample-frequency
    num_mel_bins: int = 80  # --num-mel-bins
    frame_length_ms: float = 25.0  # --frame-length
    frame_shift_ms: float = 10.0  # --frame-shift
    dither: float = 0.0  # --dither
    preemphasis: float = 0.97  # --preemphasis-coefficient
    remove_dc_offset: bool = True  # --remove-dc-offset
    window: str = "povey"  # --window-type
    round_to_power_of_two: bool = True  # --round-to-power-of-two
    snip_edges: bool = True  # --snip-edges
    low_freq: float = 20.0  # --low-freq
    high_freq: float = 0.0  # --high-freq; <= 0 means nyquist + high_freq
    use_energy: bool = False  # --use-energy: raw log energy as column 0
    use_log_fbank: bool = True  # --use-log-fbank
    use_power: bool = True  # --use-power; False uses the magnitude spectrum
    energy_floor: float = 0.0  # --energy-floor

    def __post_init__(self) -> None:
        _check_kinds(self)
        _check_framing(self)
        _check_spectrum(self)

    @property
    def window_size(self) -> int:
        """Samples per frame."""
        return _samples(self.sample_rate, self.frame_length_ms)

    @property
    def window_shift(self) -> int:
        """Samples between the starts of consecutive frames."""
        return _samples(self.sample_rate, self.frame_shift_ms)

    @property
    def fft_size(self) -> int:
        """FFT length: the frame zero-padded to a power of two when ``round_to_power_of_two``."""
        size = self.window_size
        return 1 << (size - 1).bit_length() if self.round_to_power_of_two else size

    @property
    def high_freq_hz(self) -> float:
        """Upper edge of the mel banks in Hz."""
        return self.high_freq if self.high_freq > 0 else 0.5 * self.sample_rate + self.high_freq

    @property
    def dim(self) -> int:
        """Columns of the output: the mel bins, plus one when ``use_energy``."""
        return self.num_mel_bins + int(self.use_energy)


def _samples(sample_rate: float, ms: float) -> int:
    # Kaldi keeps both options as float32 and truncates their double product: do the same, so
    # that values such as 12.3 ms give Kaldi's frame size.
    return int(float(np.float32(sample_rate)) * 0.001 * float(np.float32(ms)))


def _require_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")


def _check_kinds(opts: FbankOptions) -> None:
    """Raise ConfigError for an option that is not a finite number, a flag or a name."""
    for option in fields(opts):
        value = getattr(opts, option.name)
        if isinstance(option.default, bool):
            check_flag(option.name, value)
        elif isinstance(option.default, (int, float)):
            check_number(option.name, value, whole=isinstance(option.default, int))


def _check_framing(opts: FbankOptions) -> None:
    """Raise ConfigError (a ValueError) for options that make framing impossible or differ from Kaldi's."""
    _require_positive("sample_rate", opts.sample_rate)
    _require_positive("frame_length_ms", opts.frame_length_ms)
    _require_positive("frame_shift_ms", opts.frame_shift_ms)
    for name in ("frame_length_ms", "frame_shift_ms"):
        samples = opts.sample_rate * 0.001 * getattr(opts, name)
        if samples > _MAX_WINDOW:
            raise ConfigError(
                f"{name}={getattr(opts, name)} at sample_rate={opts.sample_rate} gives {samples:.0f} samples; "
                f"at most {_MAX_WINDOW}"
            )
    if opts.window_size < 2:
        raise ConfigError(f"frame_length_ms={opts.frame_length_ms} gives {opts.window_size} samples; need >= 2")
    if opts.window_shift < 1:
        raise ConfigError(f"frame_shift_ms={opts.frame_shift_ms} gives 0 samples; need >= 1")
    if opts.fft_size % 2:
        # Kaldi's real FFT needs an even length; refuse what Kaldi itself would refuse.
        raise ConfigError(
            f"frame_length_ms={opts.frame_length_ms} gives an odd frame of {opts.window_size} samples, "
            "which Kaldi accepts only with round_to_power_of_two=True"
        )
    if not (math.isfinite(opts.dither) and opts.dither >= 0):
        raise ConfigError(f"dither must be a finite number >= 0, got {opts.dither!r}")
    if not 0 <= opts.preemphasis <= 1:
        raise ConfigError(f"preemphasis must be in [0, 1], got {opts.preemphasis!r}")
    if opts.window not in WINDOWS:
        raise ConfigError(f"window must be one of {', '.join(WINDOWS)}; got {opts.window!r}")


def _check_spectrum(opts: FbankOptions) -> None:
    """Raise ConfigError (a ValueError) for bad mel bank or energy options."""
    if opts.num_mel_bins < 3:
        raise ConfigError(f"num_mel_bins must be an integer >= 3 (as in Kaldi), got {opts.num_mel_bins!r}")
    if opts.num_mel_bins > opts.fft_size // 2:
        raise ConfigError(
            f"num_mel_bins={opts.num_mel_bins} is too many for a {opts.fft_size}-point FFT: "
            f"at most {opts.fft_size // 2}"
        )
    nyquist = 0.5 * opts.sample_rate
    if not 0 <= opts.low_freq < nyquist:
        raise ConfigError(f"low_freq must be in [0, nyquist={nyquist}), got {opts.low_freq!r}")
    high = opts.high_freq_hz
    if not opts.low_freq < high <= nyquist:
        raise ConfigError(
            f"high_freq={opts.high_freq!r} puts the upper mel edge at {high} Hz; "
            f"it must be in (low_freq={opts.low_freq}, nyquist={nyquist}]"
        )
    if not (math.isfinite(opts.energy_floor) and opts.energy_floor >= 0):
        raise ConfigError(f"energy_floor must be a finite number >= 0, got {opts.energy_floor!r}")
    empty = np.flatnonzero(~_mel_banks(opts).any(axis=0))
    if empty.size:
        raise ConfigError(
            f"num_mel_bins={opts.num_mel_bins} is too many for a {opts.fft_size}-point FFT "
            f"between {opts.low_freq} and {high} Hz: mel bin {empty[0]} covers no FFT bin"
        )


def num_frames(num_samples: int, options: FbankOptions) -> int:
    """Frames that Kaldi makes from ``num_samples`` samples (its ``NumFrames`` with flush=true)."""
    size, shift = options.window_size, options.window_shift
    if options.snip_edges:
        return 0 if num_samples < size else 1 + (num_samples - size) // shift
    # num_samples / shift rounded to the nearest integer; frames reaching past an end read its mirror image.
    return (num_samples + shift // 2) // shift


@functools.lru_cache(maxsize=16)
def _window(opts: FbankOptions) -> np.ndarray:
    """The window function, float64 of length ``window_size``."""
    cos = np.cos(2 * math.pi / (opts.window_size - 1) * np.arange(opts.window_size))
    if opts.window == "povey":
        return (0.5 - 0.5 * cos) ** 0.85
    if opts.window == "hamming":
        return 0.54 - 0.46 * cos
    if opts.window == "hanning":
        return 0.5 - 0.5 * cos
    return np.ones_like(cos)


def _mel(hz: np.ndarray | float) -> np.ndarray:
    return 1127.0 * np.log1p(np.asarray(hz, dtype=np.float64) / 700.0)


@functools.lru_cache(maxsize=16)
def _mel_banks(opts: FbankOptions) -> np.ndarray:
    """Kaldi's triangular mel weights, float32 ``(fft_size // 2, num_mel_bins)``.

    The Nyquist FFT bin is left out, as in Kaldi.
    """
    low, high = _mel(opts.low_freq), _mel(opts.high_freq_hz)
    edges = low + (high - low) / (opts.num_mel_bins + 1) * np.arange(opts.num_mel_bins + 2)
    left, center, right = edges[:-2], edges[1:-1], edges[2:]
    mel = _mel(opts.sample_rate / opts.fft_size * np.arange(opts.fft_size // 2))[:, None]
    rising = (mel - left) / (center - left)
    falling = (right - mel) / (right - center)
    weights = np.where(mel <= center, rising, falling)
    return np.where((mel > left) & (mel < right), weights, 0.0).astype(np.float32)


def _reflect(index: np.ndarray, n: int) -> np.ndarray:
    """Kaldi's mirroring of out-of-range sample indices: -1 -> 0, n -> n - 1, repeated for tiny inputs."""
    index = np.mod(index, 2 * n)
    return np.where(index >= n, 2 * n - 1 - index, index)


def _frames(wave: np.ndarray, opts: FbankOptions, count: int) -> np.ndarray:
    """A strided ``(count, window_size)`` view of the frames, over a mirror-padded copy when edges need it."""
    size, shift = opts.window_size, opts.window_shift
    if not opts.snip_edges:
        # Frame f is centred on sample f * shift + shift // 2; mirror the ends so that every frame fits.
        start = shift // 2 - size // 2
        stop = (count - 1) * shift + start + size
        n = len(wave)
        head = wave[_reflect(np.arange(start, min(0, stop)), n)]
        tail = wave[_reflect(np.arange(max(n, start), stop), n)]
        wave = np.concatenate([head, wave[max(0, start) : max(0, min(n, stop))], tail])
    return sliding_window_view(wave, size)[::shift][:count]


def fbank(waveform: np.ndarray, options: FbankOptions, rng: np.random.Generator | None = None) -> np.ndarray:
    """Log mel filterbank features of one utterance: ``(num_frames, options.dim)`` float32.

    ``waveform`` is 1-D in Kaldi's scale (int16 sample values, not divided by 32768); int16
    arrays are fine as they are. With ``use_energy`` the log energy is column 0, as in Kaldi.
    ``rng`` draws the dither noise and is required when ``options.dither > 0``; the same seed
    gives the same features.
    """
    wave = np.asarray(waveform, dtype=np.float64)
    if wave.ndim != 1:
        raise ValueError(f"waveform must be 1-D, got shape {wave.shape}")
    if options.dither > 0 and rng is None:
        raise ValueError("dither > 0 needs rng, a np.random.Generator to draw the noise from")
    count = num_frames(len(wave), options)
    out = np.empty((count, options.dim), dtype=np.float32)
    if count == 0:
        return out
    frames = _frames(wave, options, count)
    for begin in range(0, count, _BLOCK_FRAMES):
        block = slice(begin, begin + _BLOCK_FRAMES)
        _compute_block(frames[block], options, rng, out[block])
    return out


def _compute_block(frames: np.ndarray, opts: FbankOptions, rng: np.random.Generator | None, out: np.ndarray) -> None:
    """Features of a block of frames, written into ``out``."""
    windowed = np.array(frames, dtype=np.float64)
    if opts.dither > 0:
        # Kaldi dithers each frame on its own, so overlapping samples get different noise.
        windowed += opts.dither * rng.standard_normal(windowed.shape)
    if opts.remove_dc_offset:
        windowed -= windowed.mean(axis=1, keepdims=True)
    if opts.use_energy:
        out[:, 0] = _log_energy(windowed, opts.energy_floor)
    if opts.preemphasis:
        windowed[:, 1:] -= opts.preemphasis * windowed[:, :-1]
        windowed[:, 0] *= 1.0 - opts.preemphasis
    windowed *= _window(opts)
    mel = _power_spectrum(windowed, opts) @ _mel_banks(opts)
    if opts.use_log_fbank:
        np.log(np.maximum(mel, _FLT_EPSILON, out=mel), out=mel)
    out[:, int(opts.use_energy) :] = mel


def _power_spectrum(windowed: np.ndarray, opts: FbankOptions) -> np.ndarray:
    """``|FFT|**2`` (or ``|FFT|``) of each row, float32, without the Nyquist bin."""
    # The FFT runs in float64 (numpy's float32 FFT is no faster); squaring in float32 as Kaldi
    # does halves the memory traffic of the rest.
    spectrum = np.fft.rfft(windowed, n=opts.fft_size)[:, : opts.fft_size // 2].astype(np.complex64)
    parts = np.square(spectrum.view(np.float32))
    power = np.add(parts[:, 0::2], parts[:, 1::2])
    return power if opts.use_power else np.sqrt(power, out=power)


def _log_energy(frames: np.ndarray, energy_floor: float) -> np.ndarray:
    """Kaldi's raw log energy per frame (after dither and DC removal, before preemphasis)."""
    energy = np.log(np.maximum(np.einsum("ij,ij->i", frames, frames), _FLT_EPSILON))
    return np.maximum(energy, math.log(energy_floor)) if energy_floor > 0 else energy
