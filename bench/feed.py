"""Does the loader keep a fast GPU fed? A training loop whose step sleeps (the CPU idle and the
GIL free, as while a GPU computes), fed by this checkout's loader and, in the same rounds, by
another checkout's (``--baseline-code``).

    python bench/feed.py [--utts 12000] [--steps 5 10 20] [--workers 0 1 2] [--rounds 2]
                         [--baseline-code DIR] [--audio-minutes 10] [--kinds feats audio resumed]
                         [--out bench/out] [--quick]

Features: seqshard.app.demo.make_corpus (80-dim, about 310 frames an utterance) packed, batches of
20,000 padded frames (about 200 steps an epoch for 12,000 utterances), labels as text
(``--tokenizer``: tokenized with the corpus's units, which about doubles a reader's work). Audio: bench/audio.py's
corpus of real speech cut into 2-15 s utterances, packed as FLAC, fbank computed on the fly
(``AUDIO_WAYS``: in the workers; the device's way is added there).

Each measure runs in a fresh process (rounds interleaved, their order shuffled): two epochs with
persistent workers (none with 0), the second timed; the step sleeps for STEP ms after each batch:

    wait          time in next() / the epoch's wall time, over the whole epoch and after its
                  first batch
    first         ms from iter() to the first batch
    longest       the longest wait after the first batch
    cpu           the training process's time.process_time() over the epoch, per batch (the bare
                  loop's own, sleeping steps without a loader, is printed for reference)
    calls         the function calls the training process makes per batch (a third epoch under
                  sys.setprofile, the loop's own included): its work, whatever the machine's load
    reader        a reader's time per batch: the 0-worker run's CPU per batch (its process makes
                  the batches); the goals apply where that is below the step
    resumed       ms from iter() to the first batch of a new loader that loaded the state saved
                  half way through the second epoch, and ms in load_state_dict (with workers it
                  starts them there, on the loaded position); iter() at once, and 0.5 s later (a
                  training script loads its model between the two)

Goals (issue 24), where a reader's time per batch is below the step: wait <= 1% over the epoch
including its start, first batch <= 20 ms, no later wait longer than one step, <= 0.05 ms of
training-process CPU per batch. Writes OUT/feed.json; prints the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # not the checkout: a measure imports the seqshard on PYTHONPATH
from common import code_path, demo_corpus, speech_corpus, with_quick

ROOT = Path(__file__).parent.parent
BATCH_FRAMES = 20_000
AUDIO_STEP_MS = 20
AUDIO_WAYS = {  # how the audio's fbank is computed: name -> make_loader options
    "fbank in workers": dict(features="fbank"),
    # the device's column: "fbank on the device": dict(features="fbank", feature_device="cuda"),
}


def run_one(args: argparse.Namespace) -> dict:
    """The measure itself (in a fresh process): two epochs, the second timed."""
    import torch

    torch.set_num_threads(1)
    if args.bare:
        return bare_loop(args.step, args.steps_hint)
    from seqshard import make_loader

    options = dict(num_workers=args.workers, persistent_workers=args.workers > 0, batch_frames=BATCH_FRAMES, seed=0)
    options |= json.loads(args.options)
    loader = make_loader(args.pattern, args.tokenizer, **options)
    if args.resume is not None:
        return resumed(loader, make_loader(args.pattern, args.tokenizer, **options), args.resume)
    pause = args.step / 1000
    found = {}
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        waits = []
        cpu, wall = time.process_time(), time.perf_counter()
        batches = iter(loader)
        while True:
            asked = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                break
            waits.append(time.perf_counter() - asked)
            del batch
            time.sleep(pause)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        found = {
            "steps": len(waits),
            "wait": sum(waits) / wall,
            "wait_after_first": sum(waits[1:]) / (wall - waits[0]),
            "first_ms": 1000 * waits[0],
            "longest_ms": 1000 * max(waits[1:], default=0.0),
            "cpu_ms": 1000 * cpu / len(waits),
            "epoch_s": wall,
        }
    found["calls"] = calls_per_batch(loader, pause)
    loader.close()
    return found


def calls_per_batch(loader, pause: float) -> float:
    """Function calls (Python's and builtins') the training process makes per batch over a third
    epoch, the loop's own included: a measure of its work that the machine's load leaves alone."""
    calls = steps = 0

    def count(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    loader.set_epoch(2)
    sys.setprofile(count)
    for batch in loader:
        del batch
        steps += 1
        time.sleep(pause)
    sys.setprofile(None)
    return calls / steps


def resumed(loader, again, pause: float) -> dict:
    """Milliseconds to the first batch after ``again`` loads the state ``loader`` saved half way
    through its second epoch."""
    steps = len(list(loader))
    loader.set_epoch(1)
    batches = iter(loader)
    for _ in range(steps // 2):
        next(batches)
    state = loader.state_dict()
    loader.close()
    started = time.perf_counter()
    again.load_state_dict(state)  # with workers, it starts them on the loaded position
    loaded = time.perf_counter()
    time.sleep(pause)  # the rest of a training script's start (its model loaded)
    asked = time.perf_counter()
    next(iter(again))
    return {"resumed_ms": 1000 * (time.perf_counter() - asked), "load_ms": 1000 * (loaded - started)}


def bare_loop(step_ms: float, steps: int) -> dict:
    """The loop alone: its own CPU per step (time.sleep and the clock reads)."""
    pause = step_ms / 1000
    cpu = time.process_time()
    for _ in range(steps):
        asked = time.perf_counter()
        time.perf_counter() - asked
        time.sleep(pause)
    return {"cpu_ms": 1000 * (time.process_time() - cpu) / steps}


def measure(code: str | None, pattern: str, tokenizer: str | None, step: float, workers: int, options: dict) -> dict:
    command = [sys.executable, __file__, "one", "--pattern", pattern, "--step", str(step), "--workers", str(workers)]
    pause = options.pop("resume", None)
    command += ["--resume", str(pause)] if pause is not None else []
    command += ["--options", json.dumps(options)] + (["--tokenizer", tokenizer] if tokenizer else [])
    env = {**os.environ, "PYTHONPATH": code_path(code or ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"measure failed: {' '.join(command)}\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bare(step: float, steps: int) -> float:
    command = [sys.executable, __file__, "one", "--bare", "--step", str(step), "--steps-hint", str(steps)]
    done = subprocess.run(
        command, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": code_path(ROOT)}
    )
    return json.loads(done.stdout.strip().splitlines()[-1])["cpu_ms"]


def feature_corpus(out: Path, utts: int) -> tuple[str, str]:
    """The packed made-up corpus (made once per size): (pattern, units file)."""
    shards, units = demo_corpus(out / f"feed-{utts}", utts, utts_per_file=500)
    return f"{shards}/data-*.tar", str(units)


def audio_corpus(out: Path, minutes: float) -> str:
    """bench/audio.py's corpus packed as FLAC (made once per size): the pattern."""
    from seqshard import pack_data

    data = out / f"feed-audio-{minutes:g}min"
    shards = data / "shards"
    if not (shards / "index.json").exists():
        shutil.rmtree(data, ignore_errors=True)
        wav_scp, text, _ = speech_corpus(data / "corpus", minutes)
        pack_data(None, text, shards, wav_scp=wav_scp, audio_format="flac", utts_per_file=50, progress=False)
    return f"{shards}/data-*.tar"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    one = sub.add_parser("one", help="one measure, in this process (the driver runs it)")
    one.add_argument("--pattern")
    one.add_argument("--tokenizer")
    one.add_argument("--step", type=float, required=True)
    one.add_argument("--workers", type=int, default=0)
    one.add_argument("--options", default="{}")
    one.add_argument("--bare", action="store_true")
    one.add_argument("--resume", type=float, help="measure a resume, iter() this many seconds after load_state_dict")
    one.add_argument("--steps-hint", type=int, default=215)
    parser.add_argument("--utts", type=int, default=12_000)
    parser.add_argument("--steps", type=float, nargs="+", default=[5, 10, 20], help="ms a step sleeps")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokenizer", action="store_true", help="labels tokenized with the corpus's units")
    parser.add_argument("--baseline-code", help="a folder whose seqshard is measured in the same rounds (main)")
    parser.add_argument("--audio-minutes", type=float, default=10.0, help="0: no audio rows")
    parser.add_argument("--kinds", nargs="+", default=["feats", "audio", "resumed"], help="the rows measured")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    if sys.argv[1:2] == ["one"]:
        print(json.dumps(run_one(parser.parse_args())))
        return
    sys.path.insert(0, code_path(ROOT))  # the driver makes the corpora with this checkout
    args = with_quick(
        parser, utts=600, steps=[5], workers=[0, 1], rounds=1, audio_minutes=1.0, out=ROOT / "bench" / "out" / "quick"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    pattern, units = feature_corpus(args.out, args.utts)
    codes = {"this": None} | ({"baseline": args.baseline_code} if args.baseline_code else {})
    units = units if args.tokenizer else None
    cases = [("feats", pattern, units, step, workers, {}) for step in args.steps for workers in args.workers]
    if args.audio_minutes > 0 and "audio" in args.kinds:
        audio = audio_corpus(args.out, args.audio_minutes)
        cases += [(f"audio: {way}", audio, None, AUDIO_STEP_MS, workers, options)
                  for way, options in AUDIO_WAYS.items() for workers in args.workers]  # fmt: skip
    cases += [("resumed", pattern, units, 0, workers, {"resume": 0.0}) for workers in args.workers]
    cases += [("resumed 0.5 s later", pattern, units, 0, workers, {"resume": 0.5}) for workers in args.workers]
    cases = [case for case in cases if case[0].split(":")[0].split(" ")[0] in args.kinds]
    runs: dict[tuple, list[dict]] = {}
    order = [(code, case) for _ in range(args.rounds) for code in codes for case in cases]
    for number, (code, case) in enumerate(random.Random(0).sample(order, len(order))):
        kind, pattern_, tokenizer, step, workers, options = case
        print(f"[{number + 1}/{len(order)}] {code} {kind} step {step:g} ms, {workers} workers", file=sys.stderr)
        runs.setdefault((code, kind, step, workers), []).append(
            measure(codes[code], pattern_, tokenizer, step, workers, dict(options))
        )
        raw = [[list(key), found] for key, found in runs.items()]  # kept as it goes: a long run's figures
        (args.out / "feed-runs.json").write_text(json.dumps(raw))
    floors = {
        step: bare(step, 215) for step in sorted({case[3] for case in cases if not case[0].startswith("resumed")})
    }
    results = report(runs, codes, floors)
    load_after = os.getloadavg()[0]
    print(f"load average (2 cores shared): {load:.1f} before, {load_after:.1f} after")
    (args.out / "feed.json").write_text(
        json.dumps({"load": [load, load_after], "utts": args.utts, "floors": floors, "rows": results}, indent=1)
    )


def report(runs: dict[tuple, list[dict]], codes: dict, floors: dict) -> list[dict]:
    """Medians over rounds, printed as a table; a reader's time per batch from the 0-worker run."""
    print(f"bare loop, CPU per step: {', '.join(f'{s:g} ms: {c:.3f} ms' for s, c in floors.items())}")
    print(f"{'code':9s} {'kind':22s} {'step':>5s} {'w':>2s} {'steps':>5s} {'wait':>7s} {'after 1st':>9s} "
          f"{'first ms':>8s} {'longest':>8s} {'cpu ms':>7s} {'calls':>6s} {'reader ms':>9s}")  # fmt: skip
    rows = []
    for (code, kind, step, workers), found in sorted(
        runs.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][3], kv[0][0])
    ):
        median = {k: statistics.median(r[k] for r in found) for k in found[0]}
        if kind.startswith("resumed"):
            rows.append({"code": code, "kind": kind, "workers": workers, **median})
            print(
                f"{code:9s} {kind:22s} {'':5s} {workers:2d} first batch after load_state_dict {median['resumed_ms']:.1f} ms"
                f" (load_state_dict itself {median.get('load_ms', float('nan')):.1f} ms)"
            )
            continue
        reader = runs.get((code, kind, step, 0))
        reader_ms = statistics.median(r["cpu_ms"] for r in reader) if reader else float("nan")
        row = {"code": code, "kind": kind, "step_ms": step, "workers": workers, "reader_ms": reader_ms, **median}
        rows.append(row)
        print(f"{code:9s} {kind:22s} {step:5g} {workers:2d} {median['steps']:5.0f} {median['wait']:7.2%} "
              f"{median['wait_after_first']:9.2%} {median['first_ms']:8.1f} {median['longest_ms']:8.1f} "
              f"{median['cpu_ms']:7.3f} {median['calls']:6.0f} {reader_ms:9.2f}")  # fmt: skip
    print("goals where a reader's time per batch is below the step (workers > 0): wait <= 1%, first <= 20 ms, "
          "longest <= the step, cpu <= 0.05 ms")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
