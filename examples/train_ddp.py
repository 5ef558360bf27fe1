"""A small CTC model trained with DDP from seqshard shards, checkpointing the loader with the
model so that a killed run resumes on the exact next batch.

    torchrun --nproc_per_node 2 examples/train_ddp.py            # or: python examples/train_ddp.py

Everything goes into --out (default train-out/, ignored by git): without --shards the script
first makes and packs a small made-up corpus in OUT/data; the checkpoint is OUT/ckpt.pt. Your
own shards:

    torchrun --nproc_per_node 2 examples/train_ddp.py \\
        --shards 'data/shards/{10_1000,1000_2000}/data-*.tar' --units units.txt --epochs 10

Kill it at any point and run the same command again: it continues from the last checkpoint,
with the epoch and step counters where they were. Run again after the last epoch, it says the
run is finished and exits. Runs on CPU (gloo) or GPU (nccl), under torchrun or as one process.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("train-out"), help="folder for the checkpoint and demo data")
    parser.add_argument("--shards", help="shard pattern; default: a small demo corpus made in OUT/data")
    parser.add_argument("--units", help="units file or SentencePiece model (with --shards)")
    parser.add_argument("--demo-utts", type=int, default=600, help="utterances of the demo corpus")
    parser.add_argument("--checkpoint", type=Path, help="default: OUT/ckpt.pt")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--batch-frames", type=int, default=20000)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model's initial weights and of the loader")
    parser.add_argument(
        "--stop-after-steps",
        type=int,
        help="end this run after N steps, with a checkpoint (jobs cut into time slices); running again goes on",
    )
    args = parser.parse_args()
    if (args.shards is None) != (args.units is None):
        parser.error("--shards and --units go together (without both, a demo corpus is made)")
    args.checkpoint = args.checkpoint or args.out / "ckpt.pt"
    return args


def make_demo_data(folder: Path, num_utts: int) -> tuple[str, str]:
    """A small Kaldi data dir packed into shards (once; later runs reuse it)."""
    from seqshard.demo import make_corpus

    shards = folder / "shards"
    if not (shards / "pack_report.json").exists():
        make_corpus(folder / "kaldi", num_utts)
        seqshard.pack_data(folder / "kaldi/feats.scp", folder / "kaldi/text", shards, utts_per_file=100, progress=False)
    return f"{shards}/data-*.tar", str(folder / "kaldi/units.txt")


def init_distributed(cuda: bool) -> None:
    backend = "nccl" if cuda else "gloo"
    if "WORLD_SIZE" in os.environ:  # torchrun (or any launcher setting RANK, WORLD_SIZE, MASTER_*)
        dist.init_process_group(backend)
    else:  # one process, no launcher
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def main() -> int:
    args = parse_args()
    cuda = torch.cuda.is_available()
    init_distributed(cuda)
    try:
        return train(args, cuda)
    finally:
        # Free what still holds the process group (DDP's reducer, the loader's workers) while
        # the interpreter is whole: gloo's threads torn down at interpreter exit can abort.
        gc.collect()
        dist.destroy_process_group()


def train(args: argparse.Namespace, cuda: bool) -> int:
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    def say(message: str) -> None:
        if rank == 0:
            print(message, flush=True)

    checkpoint, epoch, step = None, 0, 0  # epoch: the one to run next; step: optimizer steps done
    if args.checkpoint.exists():
        checkpoint = torch.load(args.checkpoint, map_location=device, weights_only=False)
        epoch = checkpoint.get("epoch", checkpoint["loader"]["epoch"])
        step = checkpoint.get("step", 0)
        if epoch >= args.epochs:
            say(
                f"{args.checkpoint} is the checkpoint of a finished run: all {epoch} epochs done, {step} steps; "
                f"nothing to train (pass --epochs above {epoch} to train on, or remove it to start afresh)"
            )
            return 0

    if args.shards is None:
        args.out.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            args.shards, args.units = make_demo_data(args.out / "data", args.demo_utts)
        dist.barrier()
        if rank != 0:
            args.shards, args.units = make_demo_data(args.out / "data", args.demo_utts)  # made: paths only
    args.checkpoint.parent.mkdir(parents=True, exist_ok=True)

    loader = seqshard.make_loader(
        args.shards,
        args.units,
        batch_frames=args.batch_frames,
        num_workers=args.workers,
        pin_memory=cuda,
        seed=args.seed,
    )
    vocab = loader.tokenizer.vocab_size
    torch.manual_seed(args.seed)
    model = nn.parallel.DistributedDataParallel(
        TinyCTC(loader.table.dim, vocab).to(device), device_ids=[device.index] if cuda else None
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctc = nn.CTCLoss(zero_infinity=True)

    if checkpoint is not None:
        model.module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        if checkpoint["loader"]["epoch"] == epoch:  # saved inside this epoch: go on at the next batch
            loader.load_state_dict(checkpoint["loader"])  # every rank's position
        say(f"resumed from {args.checkpoint}: epoch {epoch}, after step {step}")
    else:
        say(f"training from scratch: {args.epochs} epochs, checkpoints in {args.checkpoint}")

    def save(next_epoch: int) -> None:
        """``next_epoch``: the epoch a resume runs (the current one, or the next when it is done)."""
        loader_state = loader.state_dict()  # a collective: every rank calls it at the same step
        if rank == 0:
            temporary = args.checkpoint.with_name(args.checkpoint.name + ".partial")
            state = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "loader": loader_state,
                "epoch": next_epoch,
                "step": step,
            }
            torch.save(state, temporary)
            temporary.replace(args.checkpoint)

    steps_this_run = 0
    while epoch < args.epochs:
        loader.set_epoch(epoch)
        for batch in loader:
            log_probs, lengths = model(batch["feats"].to(device, non_blocking=True), batch["feat_lens"].to(device))
            loss = ctc(log_probs.transpose(0, 1), batch["labels"].to(device), lengths, batch["label_lens"].to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            steps_this_run += 1
            stopping = args.stop_after_steps is not None and steps_this_run >= args.stop_after_steps
            if step % args.save_every == 0 or stopping:
                save(epoch)
                utts_per_second = loader.stats()["utts_per_second"]
                say(f"epoch {epoch} step {step} loss {loss.item():.3f} {utts_per_second:.0f} utts/s, checkpoint saved")
            if stopping:
                say(f"stopped after {steps_this_run} steps of this run (--stop-after-steps); run again to go on")
                return 0
        epoch += 1
        save(epoch)  # the epoch is done: a resume starts the next one
        say(f"epoch {epoch - 1} done at step {step}, checkpoint saved")
    say(f"finished: {args.epochs} epochs, {step} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
