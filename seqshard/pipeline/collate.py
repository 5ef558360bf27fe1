"""Padding a batch of utterances into tensors (done in the DataLoader worker, so that only
batch tensors, which travel through shared memory, cross to the training process)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .decode import Utterance


def collate(batch: Sequence[Utterance], pad_label: int = -1, dtype: str = "float32") -> dict[str, Any]:
    """``feats`` B x T x D (zero padded), ``feat_lens``, ``labels`` B x L (``pad_label``
    padded; present when the utterances were tokenized), ``label_lens``, ``keys``, ``texts``."""
    import torch

    lengths = np.fromiter((u.num_frames for u in batch), dtype=np.int64, count=len(batch))
    dim = batch[0].feats.shape[1]
    feats = np.zeros((len(batch), int(lengths.max()), dim), dtype=dtype)
    for row, utt in enumerate(batch):
        feats[row, : utt.num_frames] = utt.feats
    out: dict[str, Any] = {
        "feats": torch.from_numpy(feats),
        "feat_lens": torch.from_numpy(lengths),
        "keys": [u.key for u in batch],
        "texts": [u.text for u in batch],
    }
    if batch[0].tokens is not None:
        label_lens = np.fromiter((u.num_tokens for u in batch), dtype=np.int64, count=len(batch))
        labels = np.full((len(batch), int(label_lens.max(initial=0))), pad_label, dtype=np.int64)
        for row, utt in enumerate(batch):
            labels[row, : utt.num_tokens] = utt.tokens
        out["labels"] = torch.from_numpy(labels)
        out["label_lens"] = torch.from_numpy(label_lens)
    return out
