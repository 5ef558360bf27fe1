"""A pack's planning at scale: the driver's and the largest task's peak memory, the scan wave on
1 and 2 workers, and what 10^9 utterances would take, from figures measured in this run.

    python bench/pack_scale.py [--sizes 100000 1000000 10000000] [--work bench/out] [--quick]

Each size is a metadata-only corpus: ``feats.scp`` lines that all name one real matrix,
``text`` and ``utt2num_frames`` (two length groups), in speaker order. Each size runs in a fresh
process: the scan and bucket waves and the shards' layout (what a pack holds before its first
shard is written) on a pool of 2 processes; the driver reads its own ``VmHWM``, each task its
own. Then the scan wave of the largest size runs on a Dask ``LocalCluster`` of 1 and of 2
workers and on ``--jobs 2`` (seconds of the wave alone, ratio against one worker). Last, the
per-task figures are extrapolated to 10^9 utterances (``B`` buckets of ``BUCKET_ROWS``, chunks
of ``CHUNK_BYTES``): a simulation, said as such. Writes WORK/pack_scale.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import with_quick

HERE = Path(__file__).parent

PROBE = r"""
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from common import vm_kb
before = vm_kb("VmHWM")
from scale_probe import plan
print(json.dumps(plan(Path(sys.argv[1]), sys.argv[2], before)))
"""


def make_metadata(folder: Path, utterances: int) -> tuple[Path, Path]:
    """feats.scp, text and utt2num_frames of ``utterances`` lines naming one real 80-dim matrix."""
    import kaldiio
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    scp, text, frames = folder / "feats.scp", folder / "text", folder / "utt2num_frames"
    if scp.exists():
        with open(scp, "rb") as lines:
            if sum(1 for _ in lines) == utterances:
                return scp, text
    ark = folder / "one.ark"
    kaldiio.save_ark(str(ark), {"x": np.zeros((300, 80), dtype=np.float32)}, scp=str(folder / "one.scp"))
    location = (folder / "one.scp").read_text().split()[1]
    rng = np.random.default_rng(0)
    with open(scp, "w") as s, open(text, "w") as t, open(frames, "w") as f:
        for start in range(0, utterances, 100_000):
            keys = [f"spk{i // 400:07d}-utt{i:010d}" for i in range(start, min(start + 100_000, utterances))]
            lengths = rng.integers(100, 2000, len(keys))
            s.write("".join(f"{k} {location}\n" for k in keys))
            t.write("".join(f"{k} some words of the label number {i}\n" for i, k in enumerate(keys)))
            f.write("".join(f"{k} {n}\n" for k, n in zip(keys, lengths)))
    return scp, text


def run_probe(folder: Path, executor: str) -> dict:
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, str(folder), executor, str(HERE)], capture_output=True, text=True, check=True
    )
    return json.loads(probe.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000])
    parser.add_argument("--work", type=Path, default=HERE / "out" / "pack_scale")
    args = with_quick(parser, sizes=[20_000, 100_000], work=HERE / "out" / "quick" / "pack_scale")
    results: dict = {"sizes": {}}
    for size in args.sizes:
        folder = args.work / f"n{size}"
        make_metadata(folder, size)
        found = run_probe(folder, "processes:2")
        results["sizes"][size] = found
        print(
            f"{size:>11,} utterances: driver {found['driver_mb']:7.1f} MB peak ({found['driver_growth_mb']:6.1f} MB "
            f"over imports), largest task {found['task_mb']:6.1f} MB, {found['chunks']} chunks, "
            f"{found['buckets']} buckets, {found['shards']} shards; scan {found['scan_s']:.1f} s, "
            f"buckets {found['buckets_s']:.1f} s"
        )
    sizes = sorted(results["sizes"])
    low, high = results["sizes"][sizes[0]], results["sizes"][sizes[-1]]
    slope = (high["driver_growth_mb"] - low["driver_growth_mb"]) * 1e6 / max(1, sizes[-1] - sizes[0])
    results["driver_bytes_per_utt"] = slope
    print(f"driver: {slope:.2f} bytes an utterance from {sizes[0]:,} to {sizes[-1]:,} (the slope of its growth)")

    largest = args.work / f"n{sizes[-1]}"
    waves: dict = {}
    for name in ("dask-local:1", "dask-local:2", "processes:2"):
        waves[name] = run_probe(largest, name)["scan_s"]
    results["scan_wave_s"] = waves
    one = waves["dask-local:1"]
    print(
        f"scan wave of {sizes[-1]:,} utterances: Dask 1 worker {one:.2f} s, 2 workers {waves['dask-local:2']:.2f} s "
        f"({one / waves['dask-local:2']:.2f}x), --jobs 2 {waves['processes:2']:.2f} s ({one / waves['processes:2']:.2f}x)"
    )
    results["billion"] = simulate(high, sizes[-1])
    (args.work / "pack_scale.json").write_text(json.dumps(results, indent=1))


def simulate(measured: dict, size: int) -> dict:
    """10^9 utterances through the waves, from per-task figures measured at ``size`` (a
    simulation: each task's work is bounded by its chunk or bucket, not by the corpus)."""
    from seqshard.prep.bucket_wave import BUCKET_ROWS, bucket_count
    from seqshard.prep.chunks import CHUNK_BYTES

    billion = 10**9
    line_bytes = measured["table_bytes"] / size
    chunks = int(billion * line_bytes / CHUNK_BYTES) + 1
    buckets = bucket_count(billion)
    scan_task_s = measured["scan_s"] * 2 / max(1, measured["chunks"])  # 2 workers ran them
    bucket_task_s = measured["buckets_s"] * 2 / max(1, measured["buckets"])
    result = {
        "chunks": chunks,
        "buckets": buckets,
        "scan_cpu_hours": chunks * scan_task_s / 3600,
        "bucket_cpu_hours": buckets * bucket_task_s * (BUCKET_ROWS / max(1, size / measured["buckets"])) / 3600,
        "task_mb": measured["task_mb"],
        "shards": billion // 2000,
    }
    print(
        f"10^9 utterances (simulated from these figures): {chunks:,} scan tasks of {CHUNK_BYTES >> 20} MiB "
        f"(~{scan_task_s:.1f} s each, {result['scan_cpu_hours']:.0f} CPU-hours), {buckets:,} bucket tasks of "
        f"~{BUCKET_ROWS:,} utterances ({result['bucket_cpu_hours']:.0f} CPU-hours), {result['shards']:,} shards; "
        f"each task's memory stays near the largest measured here ({measured['task_mb']:.0f} MB): tasks hold a "
        "chunk or a bucket, never the corpus"
    )
    return result


if __name__ == "__main__":
    main()
