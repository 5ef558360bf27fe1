"""How much of a pack a rerun redoes after a kill late in the run.

    python bench/pack_resume.py [--gb 2.2] [--at 0.9] [--rounds 3] [--work bench/out] [--corpus corpus] [--quick]

On the corpus of ``common.make_corpus`` (one sweep: every shard open until the end), each round
times an uninterrupted ``seqshard pack`` (1 job), then runs the same command again into a fresh
folder and SIGKILLs its process group once ``--at`` of the shard bytes are written (partial
files included), and times the rerun that finishes it. Printed: the medians and the rerun /
uninterrupted ratio (the goal: <= 0.2 for a kill at 90%), with the utterances the rerun
continued from partial shards. The page cache is evicted before each step. Writes
WORK/pack_resume.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import evict, make_corpus, with_quick

HERE = Path(__file__).parent


def pack(corpus, out: Path) -> list[str]:
    return [sys.executable, "-m", "seqshard", "pack", "--scp", str(corpus.scp), "--text", str(corpus.text)] + [
        "--out",
        str(out),
        "--quiet",
        "--json",
    ]


def written(out: Path) -> int:
    """Bytes of shards in ``out`` so far, partial files included."""
    total = 0
    for path in [*out.glob("data-*.tar"), *out.glob(".data-*.tar.partial")]:
        with contextlib.suppress(FileNotFoundError):  # renamed meanwhile
            total += path.stat().st_size
    return total


def timed(command: list[str]) -> tuple[float, dict]:
    start = time.perf_counter()
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return time.perf_counter() - start, json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.2)
    parser.add_argument("--at", type=float, default=0.9, help="share of the uninterrupted time at which to kill")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=HERE / "out")
    parser.add_argument("--corpus", default="corpus", help="its folder under WORK (pack.py's corpus by default)")
    # --quick: 0.5 GB, not the 0.05 GB corpus the other quick runs share (in its own folder): a
    # smaller pack writes its shards in less than CHECKPOINT_SECONDS, so the kill comes before
    # any checkpoint and the rerun only repeats the pack
    args = with_quick(parser, gb=0.5, rounds=1, corpus="corpus-0.5gb", work=HERE / "out" / "quick")
    corpus = make_corpus(args.work / args.corpus, int(args.gb * 1e9))
    out = args.work / "resume-out"
    full, rerun, continued = [], [], []
    for _ in range(args.rounds):
        shutil.rmtree(out, ignore_errors=True)
        evict([*corpus.arks, corpus.scp, corpus.text])
        seconds, report = timed(pack(corpus, out))
        full.append(seconds)
        total = report["bytes_written_now"]
        shutil.rmtree(out, ignore_errors=True)
        evict([*corpus.arks, corpus.scp, corpus.text])
        process = subprocess.Popen(pack(corpus, out), start_new_session=True, stdout=subprocess.DEVNULL)
        while process.poll() is None and written(out) < args.at * total:
            time.sleep(0.05)
        if process.poll() is not None:
            raise SystemExit("the pack finished before the kill; use a larger --gb")
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        evict([*corpus.arks, corpus.scp, corpus.text])
        seconds, report = timed(pack(corpus, out))
        rerun.append(seconds)
        continued.append(report.get("resumed_utts", 0))
    results = {
        "utterances": corpus.num_utts,
        "uninterrupted_s": statistics.median(full),
        "rerun_s": statistics.median(rerun),
        "ratio": round(statistics.median(rerun) / statistics.median(full), 3),
        "continued_utts": continued,
        "killed_at": args.at,
    }
    print(
        f"{corpus.num_utts} utterances: uninterrupted {results['uninterrupted_s']:.1f} s; killed at {args.at:.0%}, the "
        f"rerun took {results['rerun_s']:.1f} s = {results['ratio']:.2f} of it (continued {continued} utterances)"
    )
    if 0 in continued:
        from seqshard.prep.write import CHECKPOINT_SECONDS

        print(
            f"no checkpoint before the kill in {continued.count(0)} of {len(continued)} rounds (checkpoints come at "
            f"most every {CHECKPOINT_SECONDS} s): those reruns packed everything again; use a larger --gb"
        )
    (args.work / "pack_resume.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
