"""Calibrated budgets on a GPU: does what `seqshard calibrate` finds fit, and what does it buy?

    python bench/calibrate_gpu.py [--utts 6000] [--layers 2,4] [--fraction 0.9] [--buckets 8]
    python bench/calibrate_gpu.py --quick --device cpu       # a smoke run (small batches, CPU)

A corpus of 80-dim features (lengths as read speech has them: log-normal, median 7 s, 1-20 s;
labels of T/10 characters) is packed; then for the example model (seqshard.app.ctc_model.SmallCTC,
hidden 256, 2 LSTM layers) and a 4-layer version:

    calibrate   seqshard.calibrate at --fraction of the card's memory: each bucket's budget
    edge        per bucket, a step on the batch the budget allows at the bucket's shortest length
                (more utterances, shorter: the case a budget in padded frames must also cover);
                its peak against the limit
    budgets     one epoch of make_loader(budgets=...): steps, frames/s, peak memory, the largest
                batch's padded frames against its bucket's budget, out-of-memory errors (none expected)
    default     one epoch of make_loader(batch_frames=20000), the default budget: the baseline

Prints one line per measurement and a summary; writes OUT/calibrate_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).parent))
from common import utterance_frames, with_quick

ROOT = Path(__file__).parent.parent
LETTERS = "abcdefghijklmnopqrstuvwxyz' "
STATE: dict = {}  # the model, optimizer and loss the calibrated step trains


def make_corpus(folder: Path, utts: int, seed: int = 0) -> Path:
    """``utts`` utterances of 80-dim float32 features and their labels, packed; the shards."""
    import kaldiio

    from seqshard import pack_data

    shards = folder / "shards"
    if (shards / "pack_report.json").exists() and json.loads((shards / "pack_report.json").read_text())[
        "packed"
    ] == utts:
        return shards
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    frames = utterance_frames(rng, utts)
    with (
        kaldiio.WriteHelper(f"ark,scp:{folder}/feats.ark,{folder}/feats.scp") as writer,
        open(folder / "text", "w") as text,
    ):
        for number, length in enumerate(frames.tolist()):
            key = f"utt{number:06d}"
            writer(key, rng.standard_normal((length, 80), dtype=np.float32))
            label = "".join(rng.choice(list(LETTERS[:-1]), size=max(1, length // 10)))
            text.write(f"{key} {label}\n")
    (folder / "units.txt").write_text("".join(f"{c} {n + 1}\n" for n, c in enumerate(LETTERS[:-1])) + "<unk> 28\n")
    pack_data(folder / "feats.scp", folder / "text", shards, utts_per_file=500, jobs=4, progress=False)
    return shards


def utterance_lengths(shards: Path) -> list[int]:
    """Every utterance's length, from the shards' member tables."""
    from seqshard.formats.members import load_table

    return [n for shard in sorted(shards.glob("data-*.tar")) for n in load_table(shard).lengths.tolist()]


def prepare(layers: int, device: torch.device) -> None:
    """The example model with ``layers`` LSTM layers, its Adam and its CTC loss, as STATE."""
    from seqshard.app.ctc_model import SmallCTC

    torch.manual_seed(0)
    STATE.clear()
    model = SmallCTC(80, len(LETTERS), hidden=256, layers=layers).to(device)
    STATE.update(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-4), device=device)
    STATE["ctc"] = torch.nn.CTCLoss(zero_infinity=True)


def step(batch: dict) -> float:
    """One training step of STATE's model on ``batch`` (forward, backward, update)."""
    model, optimizer, device = STATE["model"], STATE["optimizer"], STATE["device"]
    log_probs, lengths = model(batch["feats"].to(device, non_blocking=True), batch["feat_lens"].to(device))
    loss = STATE["ctc"](log_probs.transpose(0, 1), batch["labels"].to(device), lengths, batch["label_lens"].to(device))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.item())


def epoch(loader, device: torch.device, budgets=None) -> dict:
    """One epoch of training on ``loader``: steps, frames per second of the whole loop and of the
    steps alone (the loader runs in this process: batches of the calibrated budgets are too large
    for shared-memory slots), peak memory, out-of-memory errors, and the largest share of its
    bucket's budget a batch used."""
    from seqshard.app.train_epoch import timed
    from seqshard.tools.calibrate import peak_memory, reset_peak, within_memory

    reset_peak(device)
    steps = frames = errors = 0
    share = stepping = 0.0
    started = time.perf_counter()
    for batch, _ in timed(loader):
        longest, size = int(batch["feat_lens"].max()), len(batch["keys"])
        if budgets is not None:
            share = max(share, size * longest / budgets.budget_of(longest))
        began = time.perf_counter()
        if not within_memory(step, batch)[0]:
            errors += 1
            continue
        stepping += time.perf_counter() - began  # step() waits for the loss: the GPU is done
        steps += 1
        frames += int(batch["feat_lens"].sum())
    seconds = time.perf_counter() - started
    return {
        "steps": steps,
        "frames_per_second": frames / seconds,
        "frames_per_step_second": frames / stepping if stepping else 0.0,
        "seconds": seconds,
        "peak_bytes": peak_memory(device),
        "out_of_memory": errors,
        "largest_share_of_budget": share if budgets is not None else None,
    }


def edges(budgets, shortest: list[int], device: torch.device, limit: int | None) -> list[dict]:
    """Per bucket, a step on the batch its budget allows at its shortest length."""
    from seqshard.tools.calibrate import peak_memory, reset_peak, synthetic_batch, within_memory

    found = []
    for bucket, (budget, length) in enumerate(zip(budgets.budgets, shortest)):
        size = budget // length
        reset_peak(device)
        failed = not within_memory(step, synthetic_batch(size, length, 80, len(LETTERS), device))[0]
        peak = None if failed else peak_memory(device)
        row = {"bucket": bucket, "size": size, "length": length, "peak_bytes": peak, "out_of_memory": failed}
        row["peak_over_limit"] = None if peak is None or limit is None else peak / limit
        found.append(row)
    return found


def main() -> None:
    from seqshard import calibrate, make_loader

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--utts", type=int, default=6000)
    parser.add_argument("--layers", default="2,4", help="LSTM layers of each model calibrated (the example's: 2)")
    parser.add_argument("--fraction", type=float, default=0.9, help="of the card's memory a step may peak at")
    parser.add_argument("--buckets", type=int, default=8)
    parser.add_argument("--max-batch-size", type=int, default=16384)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = with_quick(parser, utts=100, buckets=2, max_batch_size=32, out=ROOT / "bench" / "out" / "quick")
    device = torch.device(args.device)
    if device.type == "cpu":  # torch's 2 threads on 2 shared cores ran steps 2-10x slower, by the others' load
        torch.set_num_threads(1)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    began = time.perf_counter()
    shards = make_corpus(args.out / "calibrate_gpu", args.utts)
    pattern = f"{shards}/data-*.tar"
    print(f"card {card}; corpus {args.utts} utterances packed in {time.perf_counter() - began:.0f} s", flush=True)
    results: dict = {"card": card, "utts": args.utts, "fraction": args.fraction, "models": {}}
    for layers in [int(n) for n in args.layers.split(",")]:
        prepare(layers, device)
        out = args.out / f"budgets-{layers}layers.json"
        started = time.perf_counter()
        budgets, buckets = calibrate(
            pattern,
            step,
            out=out,
            device=args.device,
            memory_fraction=args.fraction,
            buckets=args.buckets,
            vocab_size=len(LETTERS),
            max_batch_size=args.max_batch_size,
            report=lambda line, name=f"{layers} layers": print(f"  {name}: {line}", flush=True),
        )
        limit = json.loads(out.read_text())["memory_limit"]
        row: dict = {"calibrate_seconds": time.perf_counter() - started, "budgets": list(budgets.budgets)}
        row["bounds"] = list(budgets.bounds)
        row["batch_sizes"] = [b.batch_size for b in buckets]
        shortest = [budgets.bounds[b - 1] if b else min(utterance_lengths(shards)) for b in range(len(buckets))]
        row["edges"] = edges(budgets, shortest, device, limit)
        for edge in row["edges"]:
            print(f"  {layers} layers edge: {edge}", flush=True)
        loader = make_loader(pattern, tokenizer=shards.parent / "units.txt", budgets=str(out), num_workers=0)
        row["at_budgets"] = epoch(loader, device, budgets)
        print(f"  {layers} layers at the calibrated budgets: {row['at_budgets']}", flush=True)
        loader = make_loader(pattern, tokenizer=shards.parent / "units.txt", batch_frames=20000, num_workers=0)
        row["at_default"] = epoch(loader, device)
        print(f"  {layers} layers at batch_frames=20000: {row['at_default']}", flush=True)
        row["speedup"] = row["at_budgets"]["frames_per_second"] / row["at_default"]["frames_per_second"]
        row["step_speedup"] = row["at_budgets"]["frames_per_step_second"] / row["at_default"]["frames_per_step_second"]
        results["models"][f"{layers} layers"] = row
    results["seconds"] = time.perf_counter() - began
    (args.out / "calibrate_gpu.json").write_text(json.dumps(results, indent=1))
    print(f"\n{card}, {args.utts} utterances, memory limit {args.fraction:.0%} of the card, {results['seconds']:.0f} s")
    print(
        f"{'model':>9} {'calibrate':>9} {'OOM edge/epoch':>14} {'peak/limit':>10} {'fps budgets':>12} {'fps 20000':>10} {'speedup':>7}"
    )
    for name, row in results["models"].items():
        ooms = f"{sum(e['out_of_memory'] for e in row['edges'])}/{row['at_budgets']['out_of_memory']}"
        peaks = [e["peak_over_limit"] for e in row["edges"] if e["peak_over_limit"] is not None]
        peak = f"{max(peaks):.2f}" if peaks else "-"
        print(
            f"{name:>9} {row['calibrate_seconds']:>8.0f}s {ooms:>14} {peak:>10} "
            f"{row['at_budgets']['frames_per_second']:>12.0f} {row['at_default']['frames_per_second']:>10.0f} "
            f"{row['speedup']:>6.2f}x {row['step_speedup']:>5.2f}x"
        )


if __name__ == "__main__":
    main()
