"""Kaldi-compatible log mel filterbank features of a padded batch of waveforms, in torch, on the
batch's own device (``features="fbank", feature_device=...``).

The same computation as :func:`seqshard.features.fbank.fbank`, step for step and with the same
window, mel banks and floors, but over a whole batch at once: frames are a strided view of the
padded ``B x S`` waveforms, the FFT runs over ``B x T`` frames and the mel banks are one matrix
product. Framing, DC removal, pre-emphasis, the window and the FFT run in float64 as the numpy
path does (in float32 the weak bins of a frame with a wide dynamic range lose precision: 2.3e-3
in the logs of a pure tone), the power spectrum and the mel product in float32 as Kaldi's. Frames past a sample's end
are zero, as the collated features of the workers are.
"""

from __future__ import annotations

import math
from typing import Any

from .fbank import _FLT_EPSILON, FbankOptions, _mel_banks, _window

_CONSTANTS: dict[tuple[FbankOptions, str], tuple[Any, Any]] = {}  # (options, device) -> (window, mel banks)


def frame_counts(lengths: Any, options: FbankOptions) -> Any:
    """Frames Kaldi makes of each length (a tensor of sample counts): ``num_frames`` batched."""
    import torch

    size, shift = options.window_size, options.window_shift
    return torch.where(lengths >= size, 1 + torch.div(lengths - size, shift, rounding_mode="floor"), 0)


def fbank_batch(
    waves: Any, lengths: Any, longest: int, options: FbankOptions, noise_seeds: list[int] | None = None
) -> tuple[Any, Any]:
    """Features of a padded batch: ``(B x longest x options.dim float32, frames per sample)``.

    ``waves`` (B x S, any float dtype) are in Kaldi's scale (int16 sample values); ``lengths``
    (B, int64, on the same device) are each row's samples. ``longest`` is the most frames of
    any row (given by the caller, who knows the lengths on the host: asking the device would
    wait for it). With ``options.dither > 0``, ``noise_seeds`` (one per row) seed each row's
    noise on the device (:func:`seqshard.seeds.torch_generator`).
    """
    import torch

    if not options.snip_edges:
        raise ValueError("fbank on the device frames with snip_edges=True only (the loader's framing)")
    if options.dither > 0 and (noise_seeds is None or len(noise_seeds) != len(waves)):
        raise ValueError("dither > 0 needs one noise seed per row")
    device = waves.device
    frames = frame_counts(lengths, options)
    out = torch.zeros((len(waves), longest, options.dim), dtype=torch.float32, device=device)
    if longest == 0:
        return out, frames
    size, shift = options.window_size, options.window_shift
    span = (longest - 1) * shift + size
    if waves.shape[1] < span:  # a row's last frame always fits its samples; padding may be shorter
        waves = torch.nn.functional.pad(waves, (0, span - waves.shape[1]))
    windowed = waves[:, :span].to(torch.float64).unfold(1, size, shift)  # B x T x size (a copy: unfold of a cast)
    if options.dither > 0:
        windowed = windowed + options.dither * _noise(windowed.shape, noise_seeds, device)  # type: ignore[arg-type]
    if options.remove_dc_offset:
        windowed = windowed - windowed.mean(dim=-1, keepdim=True)
    energy = _log_energy(windowed, options.energy_floor) if options.use_energy else None
    if options.preemphasis:
        shifted = torch.cat([windowed[..., :1], windowed[..., :-1]], dim=-1)
        windowed = windowed - options.preemphasis * shifted
    window, banks = _constants(options, device)
    windowed = windowed * window
    spectrum = torch.fft.rfft(windowed, n=options.fft_size)[..., : options.fft_size // 2].to(torch.complex64)
    power = spectrum.real.square() + spectrum.imag.square()
    if not options.use_power:
        power = power.sqrt()
    mel = power @ banks
    if options.use_log_fbank:
        mel = mel.clamp_min(_FLT_EPSILON).log()
    first = int(options.use_energy)
    out[..., first:] = mel
    if energy is not None:
        out[..., 0] = energy
    valid = torch.arange(longest, device=device)[None, :] < frames[:, None]
    return out.masked_fill_(~valid[..., None], 0.0), frames


def _constants(options: FbankOptions, device: Any) -> tuple[Any, Any]:
    """The window (float64) and the mel banks (float32) on ``device``, made once."""
    import torch

    key = (options, str(device))
    if key not in _CONSTANTS:
        window = torch.from_numpy(_window(options)).to(device)
        banks = torch.from_numpy(_mel_banks(options)).to(device)
        _CONSTANTS[key] = (window, banks)
    return _CONSTANTS[key]


def _log_energy(frames: Any, energy_floor: float) -> Any:
    """Kaldi's raw log energy per frame (after dither and DC removal, before pre-emphasis)."""
    energy = frames.square().sum(dim=-1).clamp_min(_FLT_EPSILON).log()
    return energy.clamp_min(math.log(energy_floor)) if energy_floor > 0 else energy


def _noise(shape: tuple[int, ...], seeds: list[int], device: Any) -> Any:
    """Standard normal noise, row ``b`` drawn from a generator seeded with ``seeds[b]``."""
    import torch

    from ..seeds import torch_generator

    rows = [
        torch.randn(shape[1:], generator=torch_generator(s, device), dtype=torch.float64, device=device) for s in seeds
    ]
    return torch.stack(rows)
