"""Does the loader keep the example model fed? Step time from memory against from shards.

    python bench/train_feed.py [--utts 2400] [--epochs 2] [--hidden 256] [--layers 1] [--device cuda] [--quick]

On a GPU machine (epochs of >= 500 steps, both models; about 5 min each on one H100/H200):

    python bench/train_feed.py --device cuda --utts 32000
    python bench/train_feed.py --device cuda --utts 32000 --hidden 1024 --layers 4

A made-up corpus (seqshard.demo.make_corpus: 80-dim features drawn from the labels) packed
into shards; the example model (seqshard.trainer.SmallCTC, CTC, Adam) trained in one process
with one torch thread:

    memory     the epoch's batches materialised in a list first (no loading in the loop)
    shards w0  make_loader batches, num_workers=0 (loading in the training process)
    shards w2  make_loader batches, num_workers=2
    shards auto  num_workers="auto" (the count it chose is printed)

Prints step time, the ratio against memory, and the data-wait fraction (time waiting for the
next batch / step time, the loader's own stats()["data_wait"] beside it); writes
OUT/train_feed.json. With --device cuda (on a GPU machine) the model runs there with pinned
batches. Goals: CPU, data-wait <= 5%; GPU (issue 24), data-wait <= 1% and step time within 3%
of memory's with the count "auto" chose.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent))
from common import with_quick

ROOT = Path(__file__).parent.parent


def train_epoch(model, optimizer, ctc, batches, device) -> dict:
    """Train over ``batches`` (an iterable); timings of waiting and of whole steps."""
    from seqshard.trainer import timed

    waited = total = 0.0
    steps = utts = 0
    for batch, wait in timed(batches):
        started = time.perf_counter()
        feats = batch["feats"].to(device, non_blocking=True)
        log_probs, lengths = model(feats, batch["feat_lens"].to(device))
        loss = ctc(log_probs.transpose(0, 1), batch["labels"].to(device), lengths, batch["label_lens"].to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        waited += wait
        total += wait + time.perf_counter() - started
        steps += 1
        utts += len(batch["keys"])
    return {"steps": steps, "utts": utts, "seconds": total, "wait": waited}


def main() -> None:
    from seqshard import make_loader, pack_data
    from seqshard.demo import make_corpus
    from seqshard.formats.index import ShardIndex
    from seqshard.trainer import SmallCTC

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--utts", type=int, default=2400)
    parser.add_argument("--epochs", type=int, default=2, help="epochs per way of feeding (the first warms up)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--batch-frames", type=int, default=20000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = with_quick(parser, utts=200, out=ROOT / "bench" / "out" / "quick")
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    device = torch.device(args.device)
    data = args.out / "train_feed"
    shards = data / "shards"
    if not (shards / "index.json").exists() or ShardIndex.load(shards).num_utts != args.utts:
        shutil.rmtree(data, ignore_errors=True)
        make_corpus(data / "kaldi", args.utts)
        pack_data(data / "kaldi/feats.scp", data / "kaldi/text", shards, utts_per_file=200, progress=False)
    options = dict(batch_frames=args.batch_frames, seed=0, pin_memory=device.type == "cuda")
    units = data / "kaldi/units.txt"

    def fresh_model():
        torch.manual_seed(0)
        model = SmallCTC(80, 64, args.hidden, args.layers).to(device)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3), torch.nn.CTCLoss(zero_infinity=True)

    results = {}
    for name, workers in (("memory", 0), ("shards w0", 0), ("shards w2", 2), ("shards auto", "auto")):
        loader = make_loader(f"{shards}/data-*.tar", units, num_workers=workers, persistent_workers=workers != 0,
                             **options)  # fmt: skip
        model, optimizer, ctc = fresh_model()
        runs = []
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            batches = list(loader) if name == "memory" else loader
            runs.append(train_epoch(model, optimizer, ctc, batches, device))
        last = runs[-1]  # the first epoch warms up (workers start, pages fault in)
        results[name] = {
            "workers": loader.options.workers.num_workers,
            "loader_data_wait": round(loader.stats()["data_wait"], 4) if name != "memory" else 0.0,
            "steps": last["steps"],
            "step_ms": round(1000 * last["seconds"] / last["steps"], 2),
            "data_wait": round(last["wait"] / last["seconds"], 4),
            "utts_per_s": round(last["utts"] / last["seconds"], 1),
        }
    base = results["memory"]["step_ms"]
    card = torch.cuda.get_device_name() if device.type == "cuda" else "CPU, 1 torch thread"
    print(f"{card}; model: {args.layers} LSTM layer(s) of {args.hidden}; second of {args.epochs} epochs, "
          f"{results['memory']['steps']} steps an epoch")  # fmt: skip
    print(
        f"{'fed from':12s} {'workers':>7s} {'ms/step':>8s} {'vs memory':>9s} {'data-wait':>9s} {'(loader)':>8s} {'utts/s':>7s}"
    )
    for name, found in results.items():
        found["vs_memory"] = round(found["step_ms"] / base, 3)
        print(f"{name:12s} {found['workers']:>7} {found['step_ms']:8.2f} {found['vs_memory']:8.3f}x "
              f"{found['data_wait']:9.1%} {found['loader_data_wait']:8.1%} {found['utts_per_s']:7.0f}")  # fmt: skip
    if device.type == "cuda":
        print("goal (GPU): data-wait <= 1% and ms/step within 3% of memory's (1.03x) for 'shards auto'")
    else:
        print("goal (CPU): data-wait <= 5% of step time")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_feed.json").write_text(json.dumps({"device": args.device, "card": card, **results}, indent=1))


if __name__ == "__main__":
    main()
