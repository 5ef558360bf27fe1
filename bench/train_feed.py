"""Does the loader keep the example model fed? Step time from memory against from shards.

    python bench/train_feed.py [--utts 2400] [--epochs 2] [--hidden 256] [--layers 1] [--quick]
    python bench/train_feed.py --device cuda [--audio] [--workers 2]

On a GPU machine (epochs of >= 500 steps, both models; about 5 min each on one H100/H200):

    python bench/train_feed.py --device cuda --utts 32000
    python bench/train_feed.py --device cuda --utts 32000 --hidden 1024 --layers 4

A made-up corpus (seqshard.app.demo.make_corpus: 80-dim features drawn from the labels) packed
into shards; the example model (seqshard.app.ctc_model.SmallCTC, CTC, Adam) trained in one process
with one torch thread:

    memory     the epoch's batches materialised in a list first (no loading in the loop)
    shards w0  make_loader batches, num_workers=0 (loading in the training process)
    shards w2  make_loader batches, num_workers=2
    shards auto  num_workers="auto" (the count it chose is printed)

With --audio the corpus is speech instead (--minutes of it, cut from tests/realdata/audio, FLAC
shards) and fbank is made on the fly, which :func:`fbank_rows` compares:

    memory             the epoch's batches (fbank in the workers) materialised first
    fbank workers wN   features="fbank" in N workers
    fbank device wN    features="fbank", feature_device=--device: the workers only decode

Prints step time, the ratio against memory, and the data-wait fraction (time waiting for the
next batch / step time, the loader's own stats()["data_wait"] beside it); writes
OUT/train_feed.json. With --device cuda (on a GPU machine) the model runs there and the loaders
hand batches over on it (device="cuda": each copied while the step before runs); the memory
row's batches are on the GPU before the epoch. Goals: CPU, data-wait <= 5%; GPU (issue 24),
data-wait <= 1% and step time within 3% of memory's with the count "auto" chose.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).parent))
from common import demo_corpus, speech_corpus, with_quick

ROOT = Path(__file__).parent.parent


def train_epoch(model, optimizer, ctc, batches, device) -> dict:
    """Train over ``batches`` (an iterable); timings of waiting and of whole steps."""
    from seqshard.app.train_epoch import timed

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


def fbank_rows(workers: int, device: str) -> dict[str, dict]:
    """make_loader options of audio shards with fbank made in ``workers`` workers, and with the
    workers only decoding and fbank made where batches are handed over (``device``)."""
    fbank = dict(features="fbank", num_workers=workers, persistent_workers=workers > 0)
    return {
        f"fbank workers w{workers}": fbank,
        f"fbank device w{workers}": {**fbank, "feature_device": device},
    }


def speech_shards(out: Path, minutes: float) -> tuple[Path, Path]:
    """FLAC shards of ``minutes`` of speech (made once) and a character units file for them
    (as seqshard.app.demo writes one)."""
    from seqshard import pack_data

    shards = out / "speech-shards"
    if not (shards / "index.json").exists():
        wav_scp, text, _ = speech_corpus(out / "speech", minutes)
        pack_data(None, text, shards, wav_scp=wav_scp, utts_per_file=50, progress=False)
    chars = sorted({c for line in (out / "speech/text").read_text().splitlines() for c in line.split(" ", 1)[1]})
    units = out / "speech-units.txt"
    lines = ["<blank> 0", "<unk> 1"] + [f"{'▁' if c == ' ' else c} {i + 2}" for i, c in enumerate(chars)]
    units.write_text("\n".join(lines) + "\n")
    return shards, units


def main() -> None:
    from seqshard import make_loader
    from seqshard.app.ctc_model import SmallCTC

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--utts", type=int, default=2400)
    parser.add_argument("--epochs", type=int, default=2, help="epochs per way of feeding (the first warms up)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--batch-frames", type=int, default=20000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workers", type=int, default=2, help="workers of the last rows")
    parser.add_argument("--audio", action="store_true", help="speech shards, fbank in the workers and on the device")
    parser.add_argument("--minutes", type=float, default=20.0, help="of speech, with --audio")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = with_quick(parser, utts=200, minutes=2.0, out=ROOT / "bench" / "out" / "quick")
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    device = torch.device(args.device)
    data = args.out / "train_feed"
    options = dict(batch_frames=args.batch_frames, seed=0, device=args.device if device.type == "cuda" else None)
    if args.audio:
        shards, units = speech_shards(data, args.minutes)
        rows = {"memory": dict(features="fbank", num_workers=args.workers), **fbank_rows(args.workers, args.device)}
    else:
        shards, units = demo_corpus(data, args.utts)
        shards = f"{shards}/data-*.tar"
        rows = {
            "memory": dict(num_workers=0),
            "shards w0": dict(num_workers=0),
            f"shards w{args.workers}": dict(num_workers=args.workers, persistent_workers=args.workers > 0),
            "shards auto": dict(num_workers="auto", persistent_workers=True),
        }

    def fresh_model():
        torch.manual_seed(0)
        model = SmallCTC(80, 64, args.hidden, args.layers).to(device)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3), torch.nn.CTCLoss(zero_infinity=True)

    results = {}
    for name, row in rows.items():
        loader = make_loader(shards, units, **options, **row)
        model, optimizer, ctc = fresh_model()
        runs = []
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            batches = list(loader) if name == "memory" else loader
            runs.append(train_epoch(model, optimizer, ctc, batches, device))
        loader.close()
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
        f"{'fed from':18s} {'workers':>7s} {'ms/step':>8s} {'vs memory':>9s} {'data-wait':>9s} {'(loader)':>8s} {'utts/s':>7s}"
    )
    for name, found in results.items():
        found["vs_memory"] = round(found["step_ms"] / base, 3)
        print(f"{name:18s} {found['workers']:>7} {found['step_ms']:8.2f} {found['vs_memory']:8.3f}x "
              f"{found['data_wait']:9.1%} {found['loader_data_wait']:8.1%} {found['utts_per_s']:7.0f}")  # fmt: skip
    if device.type == "cuda":
        print("goal (GPU): data-wait <= 1% and ms/step within 3% of memory's (1.03x) for 'shards auto'")
    else:
        print("goal (CPU): data-wait <= 5% of step time")
    args.out.mkdir(parents=True, exist_ok=True)
    found = {"device": args.device, "card": card, "audio": args.audio, **results}
    (args.out / f"train_feed{'-audio' if args.audio else ''}.json").write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
