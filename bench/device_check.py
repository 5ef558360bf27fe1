"""On a GPU, what the CPU tests cannot check: batches handed over on the device (issue 24, items
4 and 5). About a minute; prints PASS or FAIL per check (INFO lines are figures) and exits 1 if
any check failed.

    python bench/device_check.py [--utts 1600] [--minutes 3] [--out bench/out/device_check]

    registered once   device="cuda": the shared slots registered as pinned memory once over two
                      epochs, the ring reported pinned by CUDA, batches on the GPU
    pinned, no copy   pin_memory=True without device, two epochs of workers forked after the ring was
                      registered: batch tensors are the slot's own memory and pinned; every slot
                      let go comes back once its fence has completed
    same batches      device="cuda" batches equal to the CPU loader's, bit for bit, 2 epochs, 2 workers
    copies ahead      each batch's copy (timed with CUDA events on the loader's stream) started
                      before the step ahead of it ended and was done before its own step began
    no leak           epochs 2 and 3 end with the same GPU memory allocated, no copy held, no slot leased
    fbank on device   features="fbank" + spec_augment + cmvn: feature_device="cuda" equals fbank in
                      the workers within 1e-3, with the same lengths and masks
    token batches     make_token_loader(device="cuda") equals the CPU batches
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).parent))
from common import check, demo_corpus, info, run_checks, speech_corpus

from seqshard import make_loader, make_token_loader, pack_data
from seqshard.pipeline.transport.slots import LEASED
from seqshard.testing import batch_slots


def step(batch: dict, weight: torch.Tensor | None = None) -> torch.Tensor:
    """GPU work that reads the batch: with ``weight`` (4096 x 4096) a few ms, a stand-in for a
    model's step."""
    total = batch["feats"].float().mean()
    return total if weight is None else total + (weight @ weight).mean()


def equal_batches(first: list[dict], second: list[dict]) -> tuple[bool, str]:
    for number, (a, b) in enumerate(zip(first, second, strict=True)):
        if a.keys() != b.keys() or a.get("keys") != b.get("keys"):
            return False, f"batch {number}: keys differ"
        for key, value in a.items():
            if isinstance(value, torch.Tensor) and not torch.equal(value.cpu(), b[key].cpu()):
                return False, f"batch {number}: {key} differs"
    return True, f"{len(first)} batches"


def feature_checks(shards: Path, device: torch.device, weight: torch.Tensor) -> None:
    options = dict(batch_frames=20000, seed=0, num_workers=2, persistent_workers=True)
    on_cpu = make_loader(f"{shards}/data-*.tar", **options)
    loader = make_loader(f"{shards}/data-*.tar", device=str(device), **options)
    cpu_batches, gpu_batches = [], []
    for epoch in (0, 1):
        on_cpu.set_epoch(epoch)
        cpu_batches.append(list(on_cpu))
        loader.set_epoch(epoch)
        gpu_batches.append(list(loader))
    on_cpu.close()
    on_gpu = all(
        b["feats"].device.type == "cuda" and b["feat_lens"].device.type == "cuda" for e in gpu_batches for b in e
    )
    slots = batch_slots(loader)
    check(
        "registered once",
        slots.registrations == 1 and slots._buffer.is_pinned() and on_gpu,
        f"registrations {slots.registrations}, ring pinned {slots._buffer.is_pinned()}, batches on the GPU {on_gpu}",
    )
    same = [equal_batches(a, b) for a, b in zip(cpu_batches, gpu_batches)]
    check("same batches", all(ok for ok, _ in same), "; ".join(text for _, text in same))
    del gpu_batches, cpu_batches

    # workers started anew each epoch: the second epoch's are forked after the ring was registered
    pinned = make_loader(f"{shards}/data-*.tar", pin_memory=True, **{**options, "persistent_workers": False})
    ring = batch_slots(pinned)._buffer
    base, end = ring.data_ptr(), ring.data_ptr() + ring.numel()
    inside = pinned_ok = count = 0
    for epoch in (0, 1):
        pinned.set_epoch(epoch)
        for batch in pinned:
            count += 1
            inside += base <= batch["feats"].data_ptr() < end
            pinned_ok += batch["feats"].is_pinned()
            moved = batch["feats"].to(device, non_blocking=True)  # the user's own copy, fenced
            del batch, moved
    torch.cuda.synchronize()
    pinned_slots = batch_slots(pinned)
    pinned_slots.reclaim()
    leased = sum(pinned_slots.mark(i) == LEASED for i in range(pinned_slots.workers * pinned_slots.per_worker))
    check(
        "pinned, no copy",
        pinned_ok == count > 0 and inside >= 0.95 * count and leased == 0 and pinned_slots.registrations == 1,
        f"{inside}/{count} batches in their slot, {pinned_ok}/{count} pinned, {leased} slots still leased",
    )
    pinned.close()

    copier_timeline: list = []
    loader.set_epoch(2)
    iterator = iter(loader)
    first = next(iterator)  # the copier exists from the first batch on
    loader._runner.delivery.copier.timeline = copier_timeline
    steps = []
    waits = 0.0
    started = time.perf_counter()
    while True:
        asked = time.perf_counter()
        batch = next(iterator, None)
        waits += time.perf_counter() - asked
        if batch is None:
            break
        begin, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step(batch, weight).item()  # synchronises, as a training loop's loss.item() does
        end_event.record()
        steps.append((begin, end_event))
    seconds = time.perf_counter() - started
    torch.cuda.synchronize()
    del first
    # copy k of the timeline is the batch of step k (the copies start from the second batch on)
    ahead = hidden = 0
    pairs = list(zip(copier_timeline, steps))
    for number in range(1, len(pairs)):
        (copy_start, copy_end), (step_start, _) = pairs[number]
        _, previous_end = steps[number - 1]
        ahead += copy_start.elapsed_time(previous_end) > 0  # started before the step ahead of it ended
        hidden += copy_end.elapsed_time(step_start) >= 0  # done before its own step began
    counted = max(1, len(pairs) - 1)
    check(
        "copies ahead",
        ahead / counted >= 0.9 and hidden / counted >= 0.9,
        f"{ahead}/{counted} copies started during the step before, {hidden}/{counted} done before their step",
    )
    copy_ms = float(np.median([a.elapsed_time(b) for a, b in copier_timeline])) if copier_timeline else 0.0
    step_ms = float(np.median([a.elapsed_time(b) for a, b in steps])) if steps else 0.0
    info(
        "copy and step", f"median copy {copy_ms:.3f} ms, median step {step_ms:.2f} ms, data-wait {waits / seconds:.1%}"
    )
    loader._runner.delivery.copier.timeline = None

    allocated = []
    for epoch in (3, 4, 5):
        loader.set_epoch(epoch)
        for batch in loader:
            step(batch)
        del batch
        gc.collect()
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    slots.reclaim()
    leased = sum(slots.mark(i) == LEASED for i in range(slots.workers * slots.per_worker))
    held = len(loader._runner.delivery.copier.in_flight)
    check(
        "no leak",
        allocated[1] == allocated[2] and held == 0 and leased == 0 and slots.registrations == 1,
        f"GPU memory after epochs: {[a >> 10 for a in allocated]} KiB, copies held {held}, slots leased {leased}",
    )
    loader.close()


def fbank_checks(out: Path, minutes: float, device: torch.device) -> None:
    wav_scp, text, seconds = speech_corpus(out / "speech", minutes)
    shards = out / "speech-shards"
    shutil.rmtree(shards, ignore_errors=True)
    pack_data(None, text, shards, wav_scp=wav_scp, utts_per_file=8, progress=False)
    cmvn = out / "cmvn.json"
    rng = np.random.default_rng(0)
    cmvn.write_text(json.dumps({"mean": rng.uniform(5, 12, 80).tolist(), "std": rng.uniform(1, 4, 80).tolist()}))
    options = dict(features="fbank", spec_augment=True, cmvn=str(cmvn), batch_frames=20000, num_workers=2,
                   persistent_workers=True, device=str(device))  # fmt: skip
    timings = {}
    results = {}
    for name, extra in (("workers", {}), ("device", {"feature_device": str(device)})):
        loader = make_loader(shards, **options, **extra)
        list(loader)  # warm up: workers start, pages fault in
        loader.set_epoch(0)
        started = time.perf_counter()
        results[name] = list(loader)
        torch.cuda.synchronize()
        timings[name] = time.perf_counter() - started
        dim = loader.dim
        loader.close()
    worst = 0.0
    same = True
    for a, b in zip(results["workers"], results["device"], strict=True):
        same &= a["keys"] == b["keys"] and torch.equal(a["feat_lens"], b["feat_lens"]) and a.keys() == b.keys()
        same &= a["feats"].shape == b["feats"].shape and torch.equal(a["feats"] == 0, b["feats"] == 0)
        worst = max(worst, float((a["feats"] - b["feats"]).abs().max()))
    check(
        "fbank on device",
        same and worst <= 1e-3 and dim == 80,
        f"{len(results['device'])} batches, same keys/lengths/masks {same}, largest difference {worst:.2e}, dim {dim}",
    )
    info(
        "fbank epoch",
        f"{seconds / 60:.1f} min of audio, 2 workers: in the workers {timings['workers']:.2f} s, on the device "
        f"{timings['device']:.2f} s ({timings['workers'] / timings['device']:.2f}x)",
    )


def token_checks(out: Path, device: torch.device) -> None:
    from seqshard.formats.peers.mmidx import TokenDatasetWriter

    writer = TokenDatasetWriter(out / "lm", np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(3000):
        writer.add(rng.integers(3, 1000, int(rng.integers(5, 200))))
    writer.finish()
    on_cpu = list(make_token_loader(out / "lm", max_tokens=4096))
    on_gpu = list(make_token_loader(out / "lm", max_tokens=4096, device=str(device)))
    ok, text = equal_batches(on_cpu, on_gpu)
    inputs = all(b["net_input"]["src_tokens"].device.type == "cuda" for b in on_gpu)
    check("token batches", ok and inputs, f"{text}, net_input on the GPU {inputs}")


def main() -> None:

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--utts", type=int, default=1600)
    parser.add_argument("--minutes", type=float, default=3.0, help="of speech for the fbank check")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "device_check")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("FAIL  no CUDA device: this script checks the GPU path")
        sys.exit(1)
    device = torch.device(args.device)
    torch.cuda.set_device(torch.device(device).index or 0)
    info("device", f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    began = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    shards, _ = demo_corpus(args.out / "features", args.utts)  # made again when --utts differs
    weight = torch.randn(4096, 4096, device=device) / 64
    parts = (
        ("features", lambda: feature_checks(shards, device, weight)),
        ("fbank", lambda: fbank_checks(args.out, args.minutes, device)),
        ("tokens", lambda: token_checks(args.out, device)),
    )
    run_checks(parts, began)


if __name__ == "__main__":
    main()
