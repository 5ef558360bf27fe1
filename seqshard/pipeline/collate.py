"""Padding a batch of utterances: done in the DataLoader worker, as numpy arrays.

Only the padded batch crosses to the training process (see ``transfer.py``); there the
arrays become torch tensors without another copy (:func:`to_tensors`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .decode import Utterance


def padded_shape(batch: Sequence[Utterance]) -> tuple[int, int, int]:
    return len(batch), max(u.num_frames for u in batch), int(batch[0].feats.shape[1])


def pad_features(batch: Sequence[Utterance], out: np.ndarray) -> np.ndarray:
    """Write ``batch`` into ``out`` (B x T x D), zero padded; ``out`` may hold old data."""
    for row, utt in enumerate(batch):
        out[row, : utt.num_frames] = utt.feats
        out[row, utt.num_frames :] = 0
    return out


def collate_arrays(
    batch: Sequence[Utterance], pad_label: int = -1, dtype: str = "float32", feats_out: np.ndarray | None = None
) -> dict[str, Any]:
    """``feats`` B x T x D (zero padded; written into ``feats_out`` when given), ``feat_lens``,
    ``labels`` B x L (``pad_label`` padded; when the utterances were tokenized),
    ``label_lens``, ``keys``, ``texts``, all numpy or lists."""
    shape = padded_shape(batch)
    feats = pad_features(batch, feats_out if feats_out is not None else np.empty(shape, dtype=dtype))
    out: dict[str, Any] = {
        "feats": feats,
        "feat_lens": np.fromiter((u.num_frames for u in batch), dtype=np.int64, count=len(batch)),
        "keys": [u.key for u in batch],
        "texts": [u.text for u in batch],
    }
    if batch[0].tokens is not None:
        label_lens = np.fromiter((u.num_tokens for u in batch), dtype=np.int64, count=len(batch))
        labels = np.full((len(batch), int(label_lens.max(initial=0))), pad_label, dtype=np.int64)
        for row, utt in enumerate(batch):
            labels[row, : utt.num_tokens] = utt.tokens
        out["labels"] = labels
        out["label_lens"] = label_lens
    return out


def to_tensors(arrays: dict[str, Any]) -> dict[str, Any]:
    """The same batch with numpy arrays as torch tensors (sharing their memory)."""
    import torch

    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in arrays.items()}


def collate(batch: Sequence[Utterance], pad_label: int = -1, dtype: str = "float32") -> dict[str, Any]:
    """The batch as torch tensors (the map-style dev reader's collate function)."""
    return to_tensors(collate_arrays(batch, pad_label, dtype))
