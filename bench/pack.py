"""Pack throughput against a raw copy of the same arks and against WebDataset, one run.

    python bench/pack.py [--gb 2.2] [--work bench/out] [--quick]

Makes (once) a speaker-sorted 80-dim float32 corpus of ``--gb`` GB over 8 arks, then, in
``--rounds`` rounds of shuffled order, each step from a cold page cache after a pause: copies the ark bytes (read + write + fsync: the limit), packs with
seqshard (shuffled, 1 and 2 jobs; and --no-shuffle), and packs with WebDataset's ShardWriter
fed by kaldiio. Peak RSS (each process's own ``VmHWM``) of a 1-job pack is shown at two corpus
sizes, and the planning memory per utterance at two sizes of scp. Writes WORK/pack.json.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import evict, make_corpus, run_measured, with_quick

HERE = Path(__file__).parent


def half_corpus(corpus, root: Path) -> tuple[Path, Path]:
    """The first half of the scp (still speaker-sorted) and its labels."""
    lines = corpus.scp.read_text().splitlines(keepends=True)
    half = lines[: len(lines) // 2]
    keys = {line.split()[0] for line in half}
    scp, text = root / "half.scp", root / "half.text"
    scp.write_text("".join(half))
    text.write_text(
        "".join(line for line in corpus.text.read_text().splitlines(keepends=True) if line.split()[0] in keys)
    )
    return scp, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.2)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; medians are reported")
    parser.add_argument(
        "--pause",
        type=float,
        default=5.0,
        help="seconds of quiet before each step (lets the host flush earlier writes)",
    )
    parser.add_argument("--work", type=Path, default=HERE / "out")
    parser.add_argument("--plan-sizes", type=int, nargs=2, default=(250_000, 1_000_000), help="scp sizes planned")
    args = with_quick(parser, gb=0.05, rounds=1, pause=0.0, plan_sizes=(25_000, 100_000), work=HERE / "out" / "quick")
    corpus = make_corpus(args.work / "corpus", int(args.gb * 1e9))
    print(
        f"corpus: {corpus.num_utts} utterances, {corpus.hours:.1f} h, {corpus.bytes / 1e9:.2f} GB of float32 80-dim features in {len(corpus.arks)} arks (speaker-sorted)"
    )
    out = args.work / "pack-out"
    half_scp, half_text = half_corpus(corpus, args.work)
    seqshard = [
        "-m",
        "seqshard",
        "pack",
        "--scp",
        str(corpus.scp),
        "--text",
        str(corpus.text),
        "--out",
        str(out),
        "--quiet",
    ]
    methods = {
        "copy": (
            "raw copy of the arks + sync",
            [str(HERE / "baselines.py"), "copy", str(out), *map(str, corpus.arks)],
        ),
        "seqshard_1job": ("seqshard pack, 1 job", seqshard),
        "seqshard_2jobs": ("seqshard pack, 2 jobs", seqshard + ["--jobs", "2"]),
        "seqshard_noshuffle": ("seqshard pack --no-shuffle, 1 job", seqshard + ["--no-shuffle"]),
        "webdataset": (
            "webdataset ShardWriter + kaldiio",
            [str(HERE / "baselines.py"), "wds-pack", str(corpus.scp), str(corpus.text), str(out)],
        ),
        "seqshard_half_corpus": (
            "seqshard pack, 1 job, half corpus",
            ["-m", "seqshard", "pack", "--scp", str(half_scp), "--text", str(half_text), "--out", str(out), "--quiet"],
        ),
    }
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in methods}
    order = list(methods)
    for round_ in range(args.rounds):
        random.Random(round_).shuffle(order)  # no method always follows the same one
        for name in order:
            shutil.rmtree(out, ignore_errors=True)
            evict(corpus.arks)
            time.sleep(args.pause)
            runs[name].append(run_measured(methods[name][1]))
            shutil.rmtree(out, ignore_errors=True)
        print(f"round {round_ + 1}/{args.rounds}: " + ", ".join(f"{n} {r[-1][0]:.1f}s" for n, r in runs.items()))

    results = {}
    for name, (label, _) in methods.items():
        seconds = statistics.median(r[0] for r in runs[name])
        rss = max(r[1] for r in runs[name])
        size = corpus.bytes / (2 if name == "seqshard_half_corpus" else 1)
        results[name] = {
            "label": label,
            "median_seconds": round(seconds, 2),
            "all_seconds": [round(r[0], 2) for r in runs[name]],
            "mb_per_s": round(size / 1e6 / seconds, 1),
            "peak_rss_mb": round(rss, 1),
        }
        print(f"  {label:<36} {seconds:7.2f} s  {results[name]['mb_per_s']:7.1f} MB/s  peak rss {rss:6.0f} MB")

    def t(name: str) -> float:
        return results[name]["median_seconds"]

    ratios = {
        "pack_1job_vs_copy": round(t("copy") / t("seqshard_1job"), 2),
        "pack_2jobs_vs_copy": round(t("copy") / t("seqshard_2jobs"), 2),
        "pack_1job_vs_webdataset": round(t("webdataset") / t("seqshard_1job"), 2),
        "pack_2jobs_vs_webdataset": round(t("webdataset") / t("seqshard_2jobs"), 2),
        "shuffle_time_over_noshuffle": round(t("seqshard_1job") / t("seqshard_noshuffle"), 2),
        "rss_full_over_half_corpus": round(
            results["seqshard_1job"]["peak_rss_mb"] / results["seqshard_half_corpus"]["peak_rss_mb"], 2
        ),
    }
    print("ratios (medians of the same run): " + ", ".join(f"{k}={v}" for k, v in ratios.items()))
    scale = plan_memory(args.work / "plan-scale", corpus, tuple(args.plan_sizes))
    (args.work / "pack.json").write_text(
        json.dumps(
            {
                "corpus": {"utts": corpus.num_utts, "gb": corpus.bytes / 1e9, "hours": corpus.hours},
                "results": results,
                "ratios": ratios,
                "plan_memory": scale,
            },
            indent=1,
        )
    )


PLAN_PROBE = """
import shutil, sys
from pathlib import Path
from seqshard.prep.executors import InlineExecutor
from seqshard.prep.job import PackJob, PackOptions
from seqshard.prep.inputs import FeatureSource
from seqshard.prep.waves import Waves, plan_chunks, with_buckets
from seqshard.progress import Progress
sys.path.insert(0, sys.argv[4])
from common import vm_kb
before = vm_kb("VmRSS")
options = PackOptions()
out = Path(sys.argv[3])
shutil.rmtree(out, ignore_errors=True)
job = PackJob(out, options, FeatureSource([Path(sys.argv[1])], options), (Path(sys.argv[2]),), (), False, 1, run="plan")
with Progress(False) as bars:
    chunks = plan_chunks(job, bars.bar)
    job = with_buckets(job, chunks)
    waves = Waves(job, chunks, InlineExecutor(), bars)
    waves.scan()
    waves.buckets()
print(before, vm_kb("VmHWM"))
"""


def plan_memory(folder: Path, corpus, sizes: tuple[int, int]) -> dict:
    """Peak RSS of planning a pack of N utterances in one process (its scan and bucket waves;
    scp lines all naming one real matrix: planning reads only lines), at two sizes: the
    metadata cost per utterance (a bucket's, once the corpus has several). Each probe is a
    fresh process that reads its own ``VmHWM`` (its ``ru_maxrss`` would include this one's)."""
    folder.mkdir(parents=True, exist_ok=True)
    location = corpus.scp.read_text().split("\n", 1)[0].split()[1]
    peaks, baseline = {}, {}
    for count in sizes:
        scp, text = folder / f"feats-{count}.scp", folder / f"text-{count}"
        if not scp.exists():
            scp.write_text("".join(f"spk{i // 40:06d}-utt{i:08d} {location}\n" for i in range(count)))
            text.write_text(
                "".join(f"spk{i // 40:06d}-utt{i:08d} SOME WORDS OF A TRANSCRIPT {i % 977}\n" for i in range(count))
            )
        output = subprocess.run(
            [sys.executable, "-c", PLAN_PROBE, str(scp), str(text), str(folder / "out"), str(HERE)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        before, peak = map(int, output.split()[-2:])  # kB
        baseline[count], peaks[count] = before / 1024, peak / 1024
    small, large = sizes
    per_utt = (peaks[large] - peaks[small]) * 2**20 / (large - small)
    print(
        f"planning memory: peak RSS {peaks[small]:.0f} MB at {small} utterances, {peaks[large]:.0f} MB at {large} "
        f"(after imports: {baseline[small]:.0f} MB): {per_utt:.0f} bytes per utterance"
    )
    return {"peak_rss_mb": peaks, "rss_after_imports_mb": baseline, "bytes_per_utt": round(per_utt)}


if __name__ == "__main__":
    main()
