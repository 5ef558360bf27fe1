"""Where a training loop's waits for batches come from: bench/feed.py's loop (a step that sleeps,
one or two persistent workers, the second epoch timed), with each wait set against what the
workers were doing meanwhile.

    python bench/window_waits.py [--utts 12000] [--steps 10 20] [--workers 1 2] [--rounds 3]
                                 [--baseline-code DIR] [--out bench/out] [--quick]

Each measure runs in a fresh process (rounds interleaved, the order shuffled), this checkout's
seqshard and, with ``--baseline-code``, another's in the same rounds. The workers (forked) log
each batch they make (``ReaderRun.make``: wall and CPU time, whether a window was arranged in
it and for how long), each ``prepare`` (the reading ahead), each wait for a credit (the queue
full) and each garbage collection, with the seconds the process sat runnable but not running
(``/proc/thread-self/schedstat``: the machine's other load). A wait of the training process
that exceeds ``--long`` of its step is put down to the worker activity it overlaps: making a
batch with a window's arrangement, without, reading ahead, a collection, none (the batch was
there: the training process's own taking), and how much of it the worker or the training
process spent runnable but not scheduled.

Prints, per code, step and workers: data-wait over the epoch and after its first batch, the
longest later wait, the waits' histogram, and what the long waits overlapped (summed over the
rounds, ms). Writes OUT/window_waits.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # not the checkout: a measure imports the seqshard on PYTHONPATH
from common import code_path, demo_corpus, with_quick

ROOT = Path(__file__).parent.parent
BATCH_FRAMES = 20_000  # as bench/feed.py
EDGES_MS = (0.1, 0.3, 1, 3, 10, 30, 100)


def _queued() -> float:
    """Seconds this thread sat runnable but not running, so far (the scheduler's run-queue delay)."""
    try:
        with open("/proc/thread-self/schedstat") as stat:
            return int(stat.read().split()[1]) / 1e9
    except OSError:
        return 0.0


def instrument(log_path: str) -> None:
    """Wrap the worker's steps so that a worker process logs them to ``log_path`` (one JSON line
    an event: kind, start, end, CPU seconds, seconds runnable but not running)."""
    import gc

    from seqshard.pipeline.stages.base import WindowStage
    from seqshard.pipeline.workers import process, worker

    state = {"file": None, "arranged": 0.0}

    def log(kind: str, start: float, end: float, cpu: float, queued: float, **extra) -> None:
        if os.getpid() == parent:
            return
        if state["file"] is None:
            state["file"] = open(f"{log_path}.{os.getpid()}", "a", buffering=1)  # noqa: SIM115 (open until the worker exits)
        state["file"].write(json.dumps([kind, start, end, cpu, queued, extra]) + "\n")

    def timed(owner, name: str, kind: str):
        original = getattr(owner, name, None)
        if original is None:
            return

        def wrapper(*args, **kwargs):
            state["arranged"], wall, cpu, queued = 0.0, time.perf_counter(), time.thread_time(), _queued()
            try:
                return original(*args, **kwargs)
            finally:
                arranged = state["arranged"]
                log(kind, wall, time.perf_counter(), time.thread_time() - cpu, _queued() - queued, arranged=arranged)

        setattr(owner, name, wrapper)

    arrange = WindowStage._arrange

    def arranged(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return arrange(self, *args, **kwargs)
        finally:
            state["arranged"] += time.perf_counter() - started

    WindowStage._arrange = arranged
    timed(worker.ReaderRun, "make", "make")
    timed(worker.ReaderRun, "item", "collate")
    timed(worker.ReaderRun, "prepare", "prepare")
    timed(process.WorkerLoop, "_wait_for_credit", "credit")
    collecting = {}

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            collecting["at"] = time.perf_counter()
        elif "at" in collecting:
            log("gc", collecting.pop("at"), time.perf_counter(), 0.0, 0.0, generation=info["generation"])

    gc.callbacks.append(on_gc)
    parent = os.getpid()


def run_one(args: argparse.Namespace) -> dict:
    """The measure itself (in a fresh process): two epochs, the second timed."""
    import torch

    torch.set_num_threads(1)
    log_path = f"{args.log}"
    instrument(log_path)
    from seqshard import make_loader

    options = dict(num_workers=args.workers, persistent_workers=True, batch_frames=BATCH_FRAMES, seed=0)
    loader = make_loader(args.pattern, **options)
    pause = args.step / 1000
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        steps = []
        cpu, wall = time.process_time(), time.perf_counter()
        batches = iter(loader)
        while True:
            asked, queued = time.perf_counter(), _queued()
            try:
                batch = next(batches)
            except StopIteration:
                break
            steps.append((asked, time.perf_counter(), _queued() - queued))
            del batch
            time.sleep(pause)
        wall = time.perf_counter() - wall
    loader.close()
    time.sleep(0.2)
    events = []
    for path in Path(log_path).parent.glob(Path(log_path).name + ".*"):
        events += [json.loads(line) for line in path.read_text().splitlines() if line]
        path.unlink()
    return {"steps": steps, "wall": wall, "events": events, "cpu": time.process_time() - cpu}


def attribute(found: dict, step_ms: float, long: float) -> dict:
    """The epoch's figures and what its long waits overlapped (ms, summed)."""
    steps, wall = found["steps"], found["wall"]
    waits = [got - asked for asked, got, _ in steps]
    longest = max(waits[1:], default=0.0)
    histogram = [0] * (len(EDGES_MS) + 1)
    for wait in waits[1:]:
        histogram[sum(1000 * wait > edge for edge in EDGES_MS)] += 1
    start = steps[0][0]
    events = [e for e in found["events"] if e[2] >= start]
    blame: dict[str, float] = {}
    for asked, got, main_queued in steps[1:]:
        if got - asked < long * step_ms / 1000:
            continue
        blame["long waits"] = blame.get("long waits", 0.0) + 1000 * (got - asked)
        blame["main runnable, not running"] = blame.get("main runnable, not running", 0.0) + 1000 * main_queued
        covered = 0.0
        for kind, begin, end, _cpu, queued, extra in events:
            overlap = min(end, got) - max(begin, asked)
            if overlap <= 0:
                continue
            share = overlap / max(end - begin, 1e-9)
            if kind == "make":
                kind = "make, with a window's arrangement" if extra.get("arranged") else "make"
            if kind != "gc":
                covered += overlap
                blame["worker runnable, not running"] = (
                    blame.get("worker runnable, not running", 0.0) + 1000 * queued * share
                )
            blame[kind] = blame.get(kind, 0.0) + 1000 * overlap
        blame["nothing of the worker's"] = blame.get("nothing of the worker's", 0.0) + 1000 * max(
            0.0, got - asked - covered
        )
    arranges = [1000 * e[5]["arranged"] for e in events if e[0] == "make" and e[5].get("arranged")]
    makes = sorted(1000 * (e[2] - e[1]) for e in events if e[0] == "make")
    return {
        "steps": len(steps),
        "wait": sum(waits) / wall,
        "wait_after_first": sum(waits[1:]) / (wall - waits[0]),
        "first_ms": 1000 * waits[0],
        "longest_ms": 1000 * longest,
        "median_wait_ms": 1000 * statistics.median(waits[1:]),
        "wait_under_1ms": sum(w for w in waits[1:] if w < 0.001) / wall,  # the training process's own taking
        "wait_over_1ms": sum(w for w in waits[1:] if w >= 0.001) / wall,
        "histogram": histogram,
        "blame_ms": blame,
        "arrange_ms": arranges,
        "make_median_ms": makes[len(makes) // 2] if makes else 0.0,
        "make_max_ms": makes[-1] if makes else 0.0,
    }


def measure(code: str | None, pattern: str, step: float, workers: int, out: Path) -> dict:
    log = out / f"window-waits-{os.getpid()}.log"
    command = [sys.executable, __file__, "one", "--pattern", pattern, "--step", str(step)]
    command += ["--workers", str(workers), "--log", str(log)]
    env = {**os.environ, "PYTHONPATH": code_path(code or ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"measure failed: {' '.join(command)}\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    one = sub.add_parser("one", help="one measure, in this process (the driver runs it)")
    one.add_argument("--pattern")
    one.add_argument("--step", type=float, required=True)
    one.add_argument("--workers", type=int, default=1)
    one.add_argument("--log")
    parser.add_argument("--utts", type=int, default=12_000)
    parser.add_argument("--steps", type=float, nargs="+", default=[10, 20], help="ms a step sleeps")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--long", type=float, default=0.1, help="a wait over this share of the step is looked into")
    parser.add_argument("--baseline-code", help="a folder whose seqshard is measured in the same rounds (main)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    parser.add_argument("--keep-raw", action="store_true", help="write each measure's steps and events")
    if sys.argv[1:2] == ["one"]:
        print(json.dumps(run_one(parser.parse_args())))
        return
    args = with_quick(parser, utts=600, steps=[10], workers=[1], rounds=1, out=ROOT / "bench" / "out" / "quick")
    sys.path.insert(0, code_path(ROOT))
    args.out.mkdir(parents=True, exist_ok=True)
    shards, _ = demo_corpus(args.out / f"feed-{args.utts}", args.utts, utts_per_file=500)  # bench/feed.py's
    pattern = f"{shards}/data-*.tar"
    codes = {"this": None} | ({"baseline": args.baseline_code} if args.baseline_code else {})
    cases = [(code, step, workers) for code in codes for step in args.steps for workers in args.workers]
    order = [case for _ in range(args.rounds) for case in cases]
    loads = [os.getloadavg()[0]]
    rows: dict[tuple, list[dict]] = {}
    for number, (code, step, workers) in enumerate(random.Random(0).sample(order, len(order))):
        print(f"[{number + 1}/{len(order)}] {code} step {step:g} ms, {workers} workers", file=sys.stderr)
        found = measure(codes[code], pattern, step, workers, args.out)
        if args.keep_raw:
            (args.out / f"window-waits-raw-{code}-{step:g}-{workers}-{number}.json").write_text(json.dumps(found))
        rows.setdefault((code, step, workers), []).append(attribute(found, step, args.long))
        loads.append(os.getloadavg()[0])
    report(rows, args.long)
    print(f"load average (1 min) through the run: {min(loads):.1f}-{max(loads):.1f}")
    (args.out / "window_waits.json").write_text(
        json.dumps({"loads": loads, "rows": [[list(k), v] for k, v in rows.items()]}, indent=1)
    )


def _each(found: list[dict], name: str) -> str:
    """Each round's figure ``name``."""
    return " ".join(f"{r[name]:.2%}" if name.startswith("wait") else f"{r[name]:.1f}" for r in found)


def report(rows: dict[tuple, list[dict]], long: float) -> None:
    edges = ["<0.1"] + [f"<{edge:g}" for edge in EDGES_MS[1:]] + [f">{EDGES_MS[-1]:g}"]
    print(f"waits after the first batch by ms: {' '.join(edges)}; a wait over {long:.0%} of the step looked into")
    for (code, step, workers), found in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        each = functools.partial(_each, found)
        print(f"{code:8s} step {step:g} ms, {workers} workers: wait {each('wait')}; after 1st {each('wait_after_first')}; "
              f"longest {each('longest_ms')} ms; median {each('median_wait_ms')} ms; first {each('first_ms')} ms")  # fmt: skip
        histogram = [sum(r["histogram"][i] for r in found) for i in range(len(EDGES_MS) + 1)]
        print(f"{'':8s}   of the wait, in waits under 1 ms {each('wait_under_1ms')}, over {each('wait_over_1ms')}")
        print(
            f"{'':8s}   histogram {histogram}; make median {each('make_median_ms')} ms, longest {each('make_max_ms')} ms"
        )
        arranges = [a for r in found for a in r["arrange_ms"]]
        if arranges:
            print(f"{'':8s}   arrangements: {len(arranges)}, median {statistics.median(arranges):.1f} ms, "
                  f"longest {max(arranges):.1f} ms")  # fmt: skip
        blame: dict[str, float] = {}
        for r in found:
            for name, ms in r["blame_ms"].items():
                blame[name] = blame.get(name, 0.0) + ms
        print(f"{'':8s}   long waits overlapped: " + ", ".join(f"{name} {ms:.1f}" for name, ms in blame.items()))


if __name__ == "__main__":
    main()
