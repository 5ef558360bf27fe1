"""seqshard in PyTorch Lightning: a LightningDataModule over shards, resumed by Lightning itself.

    python examples/lightning_module.py SHARDS_PATTERN [--max-steps 200] [--resume CKPT]

A seqshard loader is what ``train_dataloader()`` returns: Lightning iterates it once per epoch
(a new iteration runs the next epoch, as a DataLoader's sampler would with ``set_epoch``),
calls ``len()`` for its progress bar and schedules (exact with ``batch_size`` or
``epoch_steps``; with ``batch_frames`` give ``epoch_steps`` or use ``planned_batches()``), and,
since the loader has ``state_dict``/``load_state_dict``, saves its position in Lightning's own
checkpoints and restores it on ``Trainer.fit(ckpt_path=...)``: a run resumed from a checkpoint
taken mid-epoch goes on with the next batch.

Lightning fetches a batch ahead of the step it trains (to know when an epoch ends), so the
loader handed to Lightning is wrapped by :class:`TrainedPosition`, whose state is that of the
batch the model trains on, not of the batch fetched ahead.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from torch import nn

import seqshard


class TrainedPosition:
    """A seqshard loader whose ``state_dict()`` is its position after the batch the model trains
    on (``training()`` is called from ``on_train_batch_start``), not after the batch Lightning
    fetched ahead; everything else is the loader's."""

    def __init__(self, loader: seqshard.Loader):
        self.loader = loader
        self._states: list[dict[str, Any]] = []  # after each batch handed out and not yet trained on
        self._training: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._states = []
        for batch in self.loader:
            self._states.append(self.loader.state_dict(gather=False))  # this rank's: no collective per step
            yield batch

    def training(self) -> None:
        """The model takes a step on the oldest batch handed out."""
        if self._states:
            self._training = self._states.pop(0)

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        """The position after the batch in training, every rank's (Lightning asks every rank)."""
        local = self._training if self._training is not None else self.loader.state_dict(gather=False)
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return local
        every: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, local)
        return {**local, "ranks": {rank: state for found in every for rank, state in found["ranks"].items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


class ShardDataModule(L.LightningDataModule):
    """Training batches from seqshard shards (``make_loader``'s options as keywords)."""

    def __init__(self, patterns: str, **options: Any):
        super().__init__()
        self.patterns = patterns
        self.options = options
        self.train: TrainedPosition | None = None

    def setup(self, stage: str) -> None:
        if self.train is None:
            self.train = TrainedPosition(seqshard.make_loader(self.patterns, **self.options))

    def train_dataloader(self) -> TrainedPosition:
        assert self.train is not None
        return self.train


class FrameAverage(L.LightningModule):
    """A tiny model: predicts each utterance's mean feature vector from its first frame."""

    def __init__(self, dim: int):
        super().__init__()
        self.layer = nn.Linear(dim, dim)
        self.keys: list[list[str]] = []  # the utterances of each step, to compare runs

    def training_step(self, batch: dict[str, Any], index: int) -> torch.Tensor:
        self.keys.append(list(batch["keys"]))
        feats, lengths = batch["feats"], batch["feat_lens"]
        mean = feats.sum(1) / lengths[:, None]
        return nn.functional.mse_loss(self.layer(feats[:, 0]), mean)

    def on_train_batch_start(self, batch: Any, index: int) -> None:
        self.trainer.datamodule.train.training()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def trainer(max_steps: int, folder: str, every: int | None = None) -> L.Trainer:
    """A CPU trainer saving a checkpoint every ``every`` steps into ``folder``."""
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(folder, every_n_train_steps=every, save_top_k=-1)] if every else []
    return L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(every),
        callbacks=callbacks,
        default_root_dir=folder,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("patterns", help="shard pattern(s), e.g. 'data/shards/*/data-*.tar'")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--out", default="lightning-out")
    parser.add_argument("--resume", help="a checkpoint of an earlier run (Lightning's .ckpt)")
    args = parser.parse_args()
    data = ShardDataModule(args.patterns, batch_size=8, num_workers=2)
    data.setup("fit")
    model = FrameAverage(data.train.loader.dim)
    trainer(args.max_steps, args.out, every=50).fit(model, datamodule=data, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
