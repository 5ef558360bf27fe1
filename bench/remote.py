"""Remote shards against local disk, each ratio within one run.

    python bench/remote.py [--gb 2.2] [--rounds 2] [--work bench/out] [--quick]
    python bench/remote.py --http-ratio [--baseline-code NAME=DIR ...] [--rounds 5]

The shards of bench/loader.py (2.2 GB of 80-dim features; made here when missing) are served by the
stdlib HTTP server of tests/http_server.py in a child process on loopback. One epoch of
make_loader (num_workers=0, batch_frames=20000) is timed, warm page cache, from:

    local       the shard folder on local disk
    fetch       the same shards' bytes fetched over the same URL by the same client (RemoteAccess:
                ranged requests of 8 MB, 4 ahead on its thread pool) and dropped: no parsing
    http        http://127.0.0.1:PORT/ (ranged requests of 8 MB, 4 ahead)
    cache       the same URL with cache_dir=: the second epoch, served from the cache
    latency     http with 50 ms added to every request

Prints MB/s and the ratios against local disk; writes OUT/remote.json.

``--http-ratio``: only the http epoch, each in a fresh process, of this checkout and of each
``--baseline-code`` (seqshard imported from another checkout, e.g. a worktree of an earlier
commit), in interleaved rounds of shuffled order, with the fetch of the same bytes (this
checkout's client) in each round; prints every run, the best and the median; writes
OUT/remote-http-ratio.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).parent))
from common import code_path, packed_corpus, with_quick

ROOT = Path(__file__).parent.parent


def start_server(folder: Path, latency: float) -> tuple[mp.Process, str]:
    from http_server import serve_forever

    ports = mp.get_context("spawn").Queue()
    process = mp.get_context("spawn").Process(target=serve_forever, args=(str(folder), latency, ports), daemon=True)
    process.start()
    return process, f"http://127.0.0.1:{ports.get(timeout=60)}"


def epoch_seconds(loader, epoch: int) -> float:
    loader.set_epoch(epoch)
    started = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - started


def fetch_seconds(base_url: str, shards: list[Path]) -> float:
    """Every byte of ``shards`` fetched from ``base_url`` as a remote reader fetches them
    (chunks of RemoteAccess.chunk_bytes, RemoteAccess.ahead in flight), and dropped."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    from seqshard.formats.remote.access import FETCH_THREADS, RemoteAccess

    access = RemoteAccess()
    started = time.perf_counter()
    with ThreadPoolExecutor(FETCH_THREADS) as pool:
        for shard in shards:
            url, size = f"{base_url}/{shard.name}", shard.stat().st_size
            ranges = deque(
                (start, min(size, start + access.chunk_bytes)) for start in range(0, size, access.chunk_bytes)
            )
            flying: deque = deque()
            while ranges or flying:
                while ranges and len(flying) < access.ahead:
                    flying.append(pool.submit(access.fetch, url, *ranges.popleft()))
                flying.popleft().result()
    return time.perf_counter() - started


_EPOCH = """
import sys, time
from seqshard import make_loader
loader = make_loader(sys.argv[1], batch_frames=20000, num_workers=0)
started, cpu = time.perf_counter(), time.process_time()
for _ in loader:
    pass
print(time.perf_counter() - started, time.process_time() - cpu)
"""


def code_epoch_seconds(code: Path, url: str) -> tuple[float, float]:
    """One http epoch (num_workers=0) in a fresh process importing seqshard from ``code``:
    its seconds and the CPU seconds of the process (all its threads) meanwhile."""
    env = {**os.environ, "PYTHONPATH": code_path(code), "PYTHONWARNINGS": "ignore"}
    run = subprocess.run([sys.executable, "-c", _EPOCH, url], cwd=code, env=env, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{code}: {run.stderr[-2000:]}")
    seconds, cpu = run.stdout.split()[-2:]
    return float(seconds), float(cpu)


def http_ratio(args: argparse.Namespace, url: str, shards: list[Path], megabytes: float) -> None:
    """``--http-ratio`` (see the module docstring)."""
    codes = {"this": ROOT, **{name: Path(folder) for name, _, folder in (s.partition("=") for s in args.baseline_code)}}
    times: dict[str, list[float]] = {name: [] for name in [*codes, "fetch"]}
    cpu: dict[str, list[float]] = {name: [] for name in codes}
    for number in range(args.rounds):
        order = list(codes)
        random.Random(number).shuffle(order)
        for name in order:
            seconds, used = code_epoch_seconds(codes[name], url + "/")
            times[name].append(seconds)
            cpu[name].append(used)
        times["fetch"].append(fetch_seconds(url, shards))
        print(f"round {number + 1}/{args.rounds}: " + ", ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items()))
    summary = {n: {"best": min(t), "median": statistics.median(t), "runs": t} for n, t in times.items()}
    for name, row in summary.items():
        ratio = summary["fetch"]["best"] / row["best"]
        used = f"  CPU median {statistics.median(cpu[name]):5.2f} s" if name in cpu else ""
        print(f"{name:10s} best {row['best']:6.2f} s  median {row['median']:6.2f} s  {megabytes / row['best']:7.1f} MB/s"
              f"  fetch / it {ratio:.2f}x{used}")  # fmt: skip
        row["cpu"] = cpu.get(name)
    (args.work / "remote-http-ratio.json").write_text(json.dumps({"megabytes": megabytes, **summary}, indent=1))


def main() -> None:
    from seqshard import make_loader

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", type=Path, default=ROOT / "bench" / "out")
    parser.add_argument("--utts-per-file", type=int, default=2000)
    parser.add_argument("--http-ratio", action="store_true", help="only the http epoch, against --baseline-code")
    parser.add_argument("--baseline-code", action="append", default=[], metavar="NAME=DIR", help="with --http-ratio")
    args = with_quick(parser, gb=0.05, rounds=1, utts_per_file=25, work=ROOT / "bench" / "out" / "quick")
    _, args.shards = packed_corpus(args.work, args.gb, utts_per_file=args.utts_per_file)
    megabytes = sum(p.stat().st_size for p in args.shards.glob("*.tar")) / 1e6
    options = dict(batch_frames=20000, num_workers=0)
    if args.http_ratio:
        server, url = start_server(args.shards, 0.0)
        try:
            return http_ratio(args, url, sorted(args.shards.glob("*.tar")), megabytes)
        finally:
            server.kill()
    plain, plain_url = start_server(args.shards, 0.0)
    slow, slow_url = start_server(args.shards, 0.05)
    cache_dir = Path(tempfile.mkdtemp(prefix="seqshard-cache-"))
    try:
        local = make_loader(str(args.shards), **options)
        http = make_loader(plain_url + "/", **options)
        latency = make_loader(slow_url + "/", **options)
        epoch_seconds(local, 0)  # warm the page cache
        times: dict[str, list[float]] = {"local": [], "fetch": [], "http": [], "cache": [], "latency": []}
        shards = sorted(args.shards.glob("*.tar"))
        for number in range(args.rounds):
            times["local"].append(epoch_seconds(local, number))
            times["fetch"].append(fetch_seconds(plain_url, shards))
            times["http"].append(epoch_seconds(http, number))
            shutil.rmtree(cache_dir, ignore_errors=True)
            cached = make_loader(plain_url + "/", cache_dir=str(cache_dir), **options)
            epoch_seconds(cached, 0)  # fills the cache
            times["cache"].append(epoch_seconds(cached, 1))
            times["latency"].append(epoch_seconds(latency, number))
    finally:
        plain.kill()
        slow.kill()
        shutil.rmtree(cache_dir, ignore_errors=True)
    best = {name: min(values) for name, values in times.items()}
    results = {name: {"seconds": round(s, 3), "mb_per_s": round(megabytes / s, 1)} for name, s in best.items()}
    results["ratios"] = {
        "http_vs_local": round(best["local"] / best["http"], 3),
        "http_vs_fetch": round(best["fetch"] / best["http"], 3),
        "cache_vs_local": round(best["local"] / best["cache"], 3),
        "latency_vs_http": round(best["http"] / best["latency"], 3),
    }
    for name, s in best.items():
        print(f"{name:8s} {s:6.2f} s  {megabytes / s:7.1f} MB/s")
    ratios = results["ratios"]
    print(f"http / fetching its bytes alone {ratios['http_vs_fetch']:.2f}x (goal >= 0.9x); "
          f"http / local {ratios['http_vs_local']:.2f}x (goal >= 0.7x); cache (2nd epoch) / local "
          f"{ratios['cache_vs_local']:.2f}x (goal >= 0.9x); 50 ms latency / none {ratios['latency_vs_http']:.2f}x "
          "(goal >= 0.5x)")  # fmt: skip
    (args.work / "remote.json").write_text(json.dumps({"megabytes": round(megabytes, 1), **results}, indent=1))


if __name__ == "__main__":
    main()
