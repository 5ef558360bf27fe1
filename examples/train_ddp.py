"""A small CTC model trained with DDP from seqshard shards, checkpointing the loader with the
model so that a killed run resumes on the exact next batch.

    seqshard demo --out demo                          # makes and packs a small corpus
    torchrun --nproc_per_node 2 examples/train_ddp.py \\
        --shards 'demo/shards/{0_400,400_2000}/data-*.tar' --units demo/kaldi/units.txt \\
        --checkpoint ckpt.pt --epochs 2

Kill it at any point and run the same command again: it continues from the last checkpoint.
Runs on CPU (gloo) or GPU (nccl).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import seqshard


class TinyCTC(nn.Module):
    def __init__(self, dim: int, vocab: int, hidden: int = 128):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv1d(dim, hidden, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv1d(hidden, hidden, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        self.output = nn.Linear(hidden, vocab)

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.encoder(feats.transpose(1, 2)).transpose(1, 2)
        return self.output(hidden).log_softmax(-1), (lengths + 3) // 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", required=True)
    parser.add_argument("--units", required=True, help="units file or SentencePiece model")
    parser.add_argument("--checkpoint", type=Path, default=Path("ckpt.pt"))
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")

    loader = seqshard.make_loader(args.shards, args.units, batch_frames=20000, num_workers=2, pin_memory=cuda, seed=0)
    vocab = loader.tokenizer.vocab_size
    model = nn.parallel.DistributedDataParallel(
        TinyCTC(loader.table.dim, vocab).to(device), device_ids=[device.index] if cuda else None
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctc = nn.CTCLoss(zero_infinity=True)

    start_epoch = 0
    if args.checkpoint.exists():
        checkpoint = torch.load(args.checkpoint, map_location=device, weights_only=False)
        model.module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        loader.load_state_dict(checkpoint["loader"])  # the position inside the epoch, every rank's
        start_epoch = checkpoint["loader"]["epoch"]
        if rank == 0:
            print(f"resumed from {args.checkpoint} in epoch {start_epoch}")

    def save() -> None:
        loader_state = loader.state_dict()  # a collective: every rank calls it at the same step
        if rank == 0:
            temporary = args.checkpoint.with_suffix(".partial")
            torch.save(
                {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "loader": loader_state},
                temporary,
            )
            temporary.replace(args.checkpoint)

    for epoch in range(start_epoch, args.epochs):
        loader.set_epoch(epoch)
        for step, batch in enumerate(loader, start=1):
            log_probs, lengths = model(batch["feats"].to(device, non_blocking=True), batch["feat_lens"].to(device))
            loss = ctc(log_probs.transpose(0, 1), batch["labels"].to(device), lengths, batch["label_lens"].to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % args.save_every == 0:
                save()
                if rank == 0:
                    print(
                        f"epoch {epoch} step {step} loss {loss.item():.3f} {loader.stats()['utts_per_second']:.0f} utts/s"
                    )
        save()  # the epoch is done: a resume starts the next one
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
