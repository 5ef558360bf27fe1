"""The example trainer's model: a small CTC model over feature vectors."""

from __future__ import annotations

import torch
from torch import nn


class SmallCTC(nn.Module):
    """Per-frame normalisation, two strided convolutions (4x fewer frames), LSTM layers, a
    linear output for CTC. Padding frames are zeroed before each convolution, so an utterance's
    outputs do not depend on how far its batch is padded (a batch run in parts gives the
    gradients of the whole)."""

    def __init__(self, dim: int, vocab: int, hidden: int = 256, layers: int = 2):
        super().__init__()
        self.normalise = nn.LayerNorm(dim)
        self.subsample = nn.Sequential(
            nn.Conv1d(dim, hidden, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv1d(hidden, hidden, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        self.lstm = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True)
        self.output = nn.Linear(hidden, vocab)

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.normalise(feats).transpose(1, 2)  # B x D x T
        for convolution, activation in zip(self.subsample[::2], self.subsample[1::2]):
            hidden = activation(convolution(hidden.masked_fill(~_mask(lengths, hidden.shape[2]), 0.0)))
            lengths = _strided(lengths)
        hidden, _ = self.lstm(hidden.transpose(1, 2))
        return self.output(hidden).log_softmax(-1), lengths

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """The frames of each utterance's output (what :meth:`forward` gives with its output),
        where ``lengths`` is: from lengths on the host, the CTC loss reads none from the GPU."""
        for _ in self.subsample[::2]:
            lengths = _strided(lengths)
        return lengths


def _strided(lengths: torch.Tensor) -> torch.Tensor:
    """Frames after a convolution of stride 2 (kernel 3, padding 1)."""
    return (lengths + 1) // 2


def _mask(lengths: torch.Tensor, frames: int) -> torch.Tensor:
    """B x 1 x frames: True on each utterance's frames, False on its padding."""
    return (torch.arange(frames, device=lengths.device) < lengths[:, None]).unsqueeze(1)
