"""Audio features of a whole batch, made after the batch leaves the workers
(``features="fbank", feature_device=...``): fbank (``torch_fbank.py``), CMVN and SpecAugment, in
torch, where the batch is (the GPU, or the training process's CPU).

The workers then decode, resample, perturb speed and add noise, and collate padded waveforms
(``audio``, ``audio_lens``, ``sample_rate``) plus, per sample, what the random parts need: the
SpecAugment masks, drawn from the sample's own seed exactly as the workers' SpecAugment draws
them (so the masks are the same wherever the features are made, and a resume gives them again),
and the seed of the dither noise. :class:`BatchFeatures` turns such a batch into the one fbank
in the workers gives: ``feats`` (B x T x D, zero padded) and ``feat_lens``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .fbank import num_frames
from .frontend import KALDI_SCALE, AudioOptions
from .torch_fbank import fbank_batch

MASKS = "spec_augment_masks"  # per sample: (start, width) rows, freq masks then time masks
NOISE_SEED = "dither_seed"  # per sample: the seed of its dither noise
WAVEFORM_KEYS = ("audio", "audio_lens", "sample_rate", MASKS, f"{MASKS}_lens", NOISE_SEED)


class BatchFeatures:
    """Replaces a batch's waveforms by their features (see the module's text); ``dtype`` is
    the collation's (``"float32"`` or ``"float16"``)."""

    def __init__(self, options: AudioOptions, dtype: str):
        self.options = options
        self.dtype = dtype
        self._statistics: dict[str, tuple[Any, Any]] = {}  # device -> CMVN mean and std there

    def __call__(self, host: dict[str, Any], batch: dict[str, Any]) -> dict[str, Any]:
        """``batch`` (tensors where the features are made) with features for waveforms.
        ``host`` is the same batch in host memory (it may be ``batch`` itself): lengths and
        seeds are read there, so that nothing waits for the device."""
        import torch

        fbank, cmvn, augment = self.options.fbank, self.options.cmvn, self.options.spec_augment
        sample_counts = host["audio_lens"].numpy()
        longest = num_frames(int(sample_counts.max()), fbank) if len(sample_counts) else 0  # frames grow with samples
        seeds = host[NOISE_SEED].tolist() if fbank.dither > 0 else None
        audio = batch["audio"]
        feats, frames = fbank_batch(audio * KALDI_SCALE, batch["audio_lens"], longest, fbank, seeds)
        padding = torch.arange(longest, device=audio.device)[None, :] >= frames[:, None]  # B x T
        if cmvn is not None:
            mean, std = self._cmvn(audio.device)
            feats = ((feats - mean) / std).masked_fill_(padding[..., None], 0.0)
        if augment is not None:
            masks = batch[MASKS]  # B x masks x 2
            bands = _covered(masks[:, : augment.freq_masks], feats.shape[2])
            spans = _covered(masks[:, augment.freq_masks :], longest)
            feats = feats.masked_fill_(bands[:, None, :] | spans[:, :, None], 0.0)
        out = {key: value for key, value in batch.items() if key not in WAVEFORM_KEYS}
        out["feats"] = feats.to(getattr(torch, self.dtype))
        out["feat_lens"] = frames
        return out

    def _cmvn(self, device: Any) -> tuple[Any, Any]:
        import torch

        key = str(device)
        if key not in self._statistics:
            cmvn = self.options.cmvn
            assert cmvn is not None
            self._statistics[key] = tuple(torch.from_numpy(np.asarray(v)).to(device) for v in (cmvn.mean, cmvn.std))
        return self._statistics[key]


def _covered(masks: Any, size: int) -> Any:
    """B x size: which positions one of each row's ``(start, width)`` masks covers."""
    import torch

    positions = torch.arange(size, device=masks.device)[None, None, :]
    start, stop = masks[..., :1], masks[..., :1] + masks[..., 1:]
    return ((positions >= start) & (positions < stop)).any(dim=1)
