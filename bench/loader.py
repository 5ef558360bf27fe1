"""One epoch of loading, against the limit and the usual alternatives, in one run.

    python bench/loader.py [--gb 2.2] [--rounds 2] [--work bench/out] [--quick]

Reuses (or makes) the pack benchmark's speaker-sorted corpus and packs it. Then, for
num_workers 0 and 2, with a cold page cache (every file evicted) and a warm one, one epoch of:

- raw: sequential read of the shard files (the limit);
- seqshard: make_loader, dynamic batches of 20000 padded frames, default windows;
- seqshard-torchshm (workers only): the same with ``shared_slots=False``: batches travel as
  torch's own shared-memory tensors (a new segment per batch) instead of reused slots;
- seqshard-steady (workers only): persistent workers, the second epoch timed (no start-up);
- webdataset: WebDataset over the same shards: shard shuffle, 1000-sample shuffle buffer,
  .npy decode, batches of 32 padded inside the workers;
- mapstyle: kaldiio random access over feats.scp in shuffled order (``load_scp``), batches
  of 32 padded inside the workers.

Each runs in a fresh process (peak RSS is its own). Also: a simulated seek-bound disk (8 ms
per non-contiguous read, 150 MB/s; IO time charged by a file wrapper and added to the CPU
time of the warm run), the padding and speaker diversity of seqshard's batches against
random batches, and seqshard's peak memory on the corpus listed once and four times: PSS
sampled through the epoch (the process maps the shards: RSS would count every page of the page
cache it touched), of the training process alone and with its workers. Writes WORK/loader.json.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import PeakPss, code_path, evict, expected_speakers, packed_corpus, pss_kb, vm_kb, with_quick

HERE = Path(__file__).parent
SEEK_SECONDS = 0.008
DISK_BYTES_PER_SECOND = 150e6


# ----------------------------------------------------------------------------------------
# a simulated seek-bound disk


class _Disk:
    """Charges time as a spinning disk would: a seek for each read that does not continue
    the previous one (any file), then transfer at a capped bandwidth."""

    seconds = 0.0
    seeks = 0
    last: tuple[str, int] | None = None

    @classmethod
    def charge(cls, path: str, start: int, count: int) -> None:
        if cls.last != (path, start):
            cls.seconds += SEEK_SECONDS
            cls.seeks += 1
        cls.seconds += count / DISK_BYTES_PER_SECOND
        cls.last = (path, start + count)


class _ChargedFile(io.RawIOBase):
    """A file whose reads are charged to the simulated disk (for buffered readers: kaldiio)."""

    def __init__(self, path: str):
        self._raw = io.FileIO(path, "rb")
        self._path = path

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def fileno(self) -> int:
        return self._raw.fileno()

    def readinto(self, buffer) -> int:
        start = self._raw.tell()
        count = self._raw.readinto(buffer)
        _Disk.charge(self._path, start, count)
        return count

    def close(self) -> None:
        self._raw.close()
        super().close()


def charged_open(path, mode="rb", buffering=-1, *args, **kwargs):
    if "r" not in mode or "b" not in mode or not str(path).endswith((".tar", ".ark")):
        return open(path, mode, buffering, *args, **kwargs)
    return io.BufferedReader(
        _ChargedFile(str(path)), buffer_size=buffering if buffering > 1 else io.DEFAULT_BUFFER_SIZE
    )


def install_seek_bound_disk() -> None:
    """kaldiio's reads go through charged files; seqshard maps shards and has the kernel read
    ahead READ_AHEAD bytes at a time, so each read-ahead chunk it enters is one disk request."""
    import kaldiio.matio
    import kaldiio.utils

    from seqshard.formats import tar

    def open_like_kaldi(name, mode="r"):
        return charged_open(name, mode)

    kaldiio.utils.open_like_kaldi = open_like_kaldi
    kaldiio.matio.open_like_kaldi = open_like_kaldi

    original_view = tar.MappedBytes.view
    charged: set[tuple[str, int]] = set()

    def view(self, start, end):
        for chunk in range(start // tar.READ_AHEAD, max(start, end - 1) // tar.READ_AHEAD + 1):
            if (self.path, chunk) not in charged:
                charged.add((self.path, chunk))
                first = chunk * tar.READ_AHEAD
                _Disk.charge(self.path, first, min(tar.READ_AHEAD, self.size - first))
        return original_view(self, start, end)

    tar.MappedBytes.view = view  # every read of a mapped shard (headers parsed or sliced by its table)


# ----------------------------------------------------------------------------------------
# the methods (run inside a fresh process)


def pad_batch(arrays, keys):
    import numpy as np
    import torch

    lengths = [a.shape[0] for a in arrays]
    out = np.zeros((len(arrays), max(lengths), arrays[0].shape[1]), dtype=np.float32)
    for row, array in enumerate(arrays):
        out[row, : array.shape[0]] = array
    return {"feats": torch.from_numpy(out), "feat_lens": torch.tensor(lengths), "keys": list(keys)}


def run_seqshard(args, **options):
    import seqshard

    loader = seqshard.make_loader(args.pattern, batch_frames=20000, num_workers=args.workers, seed=0, **options)
    loader.set_epoch(0)
    return loader


def run_seqshard_torchshm(args):
    return run_seqshard(args, shared_slots=False)


def run_seqshard_steady(args):
    loader = run_seqshard(args, persistent_workers=True)
    for _ in loader:  # the first epoch starts the workers and fills their windows
        pass
    loader.set_epoch(1)
    return loader


def _wds_collate(samples):
    return pad_batch([s[0] for s in samples], [s[1] for s in samples])


def run_webdataset(args):
    import torch
    import webdataset as wds

    urls = sorted(str(p) for p in Path(args.pattern).parent.glob("data-*.tar"))
    dataset = (
        wds.WebDataset(
            urls, shardshuffle=len(urls), nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker, seed=0
        )
        .shuffle(1000)
        .decode()
        .to_tuple("feats.npy", "__key__")
        .batched(32, collation_fn=_wds_collate)
    )
    return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=args.workers)


class _MapStyle:
    def __init__(self, scp):
        import kaldiio

        self.table = kaldiio.load_scp(scp, max_cache_fd=32)
        self.keys = list(self.table.keys())

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, index):
        return self.table[self.keys[index]], self.keys[index]


def _map_collate(samples):
    return pad_batch([s[0] for s in samples], [s[1] for s in samples])


def run_mapstyle(args):
    import torch

    dataset = _MapStyle(args.scp)
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(
        dataset, batch_size=32, shuffle=True, generator=generator, num_workers=args.workers, collate_fn=_map_collate
    )


def run_raw(args):
    total = 0
    for path in sorted(Path(args.pattern).parent.glob("data-*.tar")):
        with open(path, "rb", buffering=0) as stream:
            while chunk := stream.read(8 << 20):
                total += len(chunk)
    return total


def run_one(args) -> dict:
    import torch  # noqa: F401  imported before timing: every method pays it once, outside the clock

    if args.method.startswith("seqshard"):  # so is each method's own library: a process imports it once
        import seqshard.pipeline.rank.shard_loader  # noqa: F401
    elif args.method == "webdataset":
        import webdataset  # noqa: F401

    if args.seek_bound:
        install_seek_bound_disk()
    methods = {
        "seqshard": run_seqshard,
        "seqshard-torchshm": run_seqshard_torchshm,
        "seqshard-steady": run_seqshard_steady,
        "webdataset": run_webdataset,
        "mapstyle": run_mapstyle,
    }
    if args.method == "seqshard-steady":
        loader = methods[args.method](args)  # its first epoch is not timed
    started = time.perf_counter()
    cpu_started = time.process_time()
    if args.method == "raw":
        run_raw(args)
        return {"seconds": time.perf_counter() - started, "utts": 0}
    if args.method != "seqshard-steady":
        loader = methods[args.method](args)
    utts, frames, padded, speakers_per_batch, sizes = 0, 0, 0, [], []
    memory = PeakPss() if args.memory else contextlib.nullcontext()
    profile = cProfile.Profile() if args.profile else None
    with memory:
        if profile is not None:
            profile.enable()
        for batch in loader:
            sizes.append(len(batch["keys"]))
            utts += len(batch["keys"])
            frames += int(batch["feat_lens"].sum())
            padded += batch["feats"].shape[0] * batch["feats"].shape[1]
            speakers_per_batch.append(len({k.split("-")[0] for k in batch["keys"]}))
        if profile is not None:
            profile.disable()
            write_profile(profile, args.profile)
    result = {
        "seconds": time.perf_counter() - started,
        "cpu_seconds": time.process_time() - cpu_started,
        "utts": utts,
        "batches": len(sizes),
        "padding": 1 - frames / padded,
        "speakers_per_batch": statistics.mean(speakers_per_batch),
        "speakers": speakers_per_batch,
        "sizes": sizes,
        "peak_rss_mb": vm_kb("VmHWM") / 1024,  # this process's own, mapped shard pages included
        "pss_mb_at_end": pss_kb() / 1024,
        "main_cpu_ms_per_batch": (time.process_time() - cpu_started) / max(1, len(sizes)) * 1000,
    }
    if args.seek_bound:
        result.update(simulated_io_seconds=_Disk.seconds, seeks=_Disk.seeks)
    if args.memory:
        result.update(peak_pss_mb=memory.own_kb / 1024, peak_pss_with_workers_mb=memory.tree_kb / 1024)
    return result


def write_profile(profile: cProfile.Profile, path: str) -> None:
    """The top entries of ``profile`` by own time and by cumulative time, as text."""
    text = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(25)
    Path(path).write_text(text.getvalue())


# ----------------------------------------------------------------------------------------
# orchestration


def four_times(shards: Path, target: Path) -> str:
    """The same shards listed four times (symlinks with their index entries): a 4x corpus."""
    from seqshard.formats.index import ShardIndex

    target.mkdir(parents=True, exist_ok=True)
    index = ShardIndex.load(shards)
    entries = []
    for copy in range(4):
        for entry in index.shards:
            name = f"data-{copy}{entry.name[5:]}"
            link = target / name
            if not link.exists():
                link.symlink_to((shards / entry.name).resolve())
            entries.append(type(entry)(**{**entry.__dict__, "name": name}))
    ShardIndex(entries, index.feature, index.created, "bench four_times", index.source).save(target)
    return f"{target}/data-*.tar"


def measure(
    method: str,
    workers: int,
    pattern: str,
    scp: str,
    cold: bool,
    files: list[Path],
    seek_bound: bool = False,
    memory: bool = False,
    code: str | None = None,
    profile: Path | None = None,
) -> dict:
    """One epoch of ``method`` in a fresh process; ``code``: a folder whose ``seqshard`` it
    imports (another checkout, for a before/after comparison in one run)."""
    if cold:
        evict(files)
    command = (
        [
            sys.executable,
            __file__,
            "run",
            "--method",
            method,
            "--workers",
            str(workers),
            "--pattern",
            pattern,
            "--scp",
            scp,
        ]
        + (["--seek-bound"] if seek_bound else [])
        + (["--memory"] if memory else [])
        + (["--profile", str(profile)] if profile else [])
    )
    env = {**os.environ, "PYTHONPATH": code_path(code)} if code else None
    output = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    one = sub.add_parser("run")
    one.add_argument("--method", required=True)
    one.add_argument("--workers", type=int, default=0)
    one.add_argument("--pattern", required=True)
    one.add_argument("--scp", required=True)
    one.add_argument("--seek-bound", action="store_true")
    one.add_argument("--memory", action="store_true", help="sample PSS through the epoch")
    one.add_argument("--profile", help="write a cProfile summary of the epoch to this file")
    parser.add_argument(
        "--warm-ratio",
        action="store_true",
        help="only the warm one-process epoch against raw reading and WebDataset (rounds of those three)",
    )
    parser.add_argument(
        "--baseline-code", help="with --warm-ratio: also time seqshard imported from this folder (another checkout)"
    )
    parser.add_argument(
        "--profile-dir", type=Path, help="with --warm-ratio: write cProfile summaries of one warm epoch here"
    )
    parser.add_argument("--gb", type=float, default=2.2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", type=Path, default=HERE / "out")
    parser.add_argument("--utts-per-file", type=int, default=2000)
    args = with_quick(parser, gb=0.05, rounds=1, utts_per_file=25, work=HERE / "out" / "quick")
    if args.command == "run":
        print(json.dumps(run_one(args)))
        return

    corpus, shards = packed_corpus(args.work, args.gb, utts_per_file=args.utts_per_file)
    pattern = f"{shards}/data-*.tar"
    shard_files = sorted(shards.glob("data-*.tar"))
    shard_bytes = sum(p.stat().st_size for p in shard_files)
    scp = str(corpus.scp)
    print(
        f"corpus: {corpus.num_utts} utterances, {corpus.hours:.1f} h, shards {shard_bytes / 1e9:.2f} GB ({len(shard_files)} files), arks {corpus.bytes / 1e9:.2f} GB"
    )

    if args.warm_ratio:
        warm_ratios(args, pattern, scp, shard_files, shard_bytes)
        return

    files = {"raw": shard_files, "webdataset": shard_files, "mapstyle": corpus.arks}
    files.update({m: shard_files for m in ("seqshard", "seqshard-torchshm", "seqshard-steady")})
    results: dict[str, list[dict]] = {}
    workers_only = ("seqshard-torchshm", "seqshard-steady")
    plan = [
        (m, w, c)
        for m in ("raw", "seqshard", *workers_only, "webdataset", "mapstyle")
        for w in (0, 2)
        for c in (True, False)
        if not (m == "raw" and w == 2) and not (m in workers_only and (w == 0 or c))
    ]
    for round_ in range(args.rounds):
        random.Random(round_).shuffle(plan)
        for method, workers, cold in plan:
            result = measure(method, workers, pattern, scp, cold, files[method])
            results.setdefault(f"{method}/w{workers}/{'cold' if cold else 'warm'}", []).append(result)
        print(f"round {round_ + 1}/{args.rounds} done")

    table = {}
    for name, runs in sorted(results.items()):
        seconds = statistics.median(r["seconds"] for r in runs)
        method = name.split("/")[0]
        size = corpus.bytes if method == "mapstyle" else shard_bytes
        table[name] = {
            **runs[0],
            "seconds": round(seconds, 2),
            "mb_per_s": round(size / 1e6 / seconds, 1),
            "all_seconds": [round(r["seconds"], 2) for r in runs],
        }
        extra = (
            f"  padding {table[name]['padding']:.1%}  speakers/batch {table[name]['speakers_per_batch']:.1f}  pss at the end {table[name]['pss_mb_at_end']:.0f} MB"
            if method != "raw"
            else ""
        )
        print(f"  {name:<24} {seconds:7.2f} s  {table[name]['mb_per_s']:7.1f} MB/s{extra}")

    def mbps(name: str) -> float:
        return table[name]["mb_per_s"]

    ratios = {}
    for workers in (0, 2):
        w = f"w{workers}"
        ratios[f"seqshard_cold_vs_raw_{w}"] = round(mbps(f"seqshard/{w}/cold") / mbps("raw/w0/cold"), 2)
        ratios[f"seqshard_cold_vs_webdataset_{w}"] = round(mbps(f"seqshard/{w}/cold") / mbps(f"webdataset/{w}/cold"), 2)
        ratios[f"seqshard_warm_vs_webdataset_{w}"] = round(mbps(f"seqshard/{w}/warm") / mbps(f"webdataset/{w}/warm"), 2)
        ratios[f"seqshard_warm_vs_mapstyle_{w}"] = round(mbps(f"seqshard/{w}/warm") / mbps(f"mapstyle/{w}/warm"), 2)
        ratios[f"seqshard_cold_vs_mapstyle_{w}"] = round(mbps(f"seqshard/{w}/cold") / mbps(f"mapstyle/{w}/cold"), 2)
    ratios["seqshard_w2_over_w0_cold"] = round(mbps("seqshard/w2/cold") / mbps("seqshard/w0/cold"), 2)
    ratios["seqshard_w2_over_w0_warm"] = round(mbps("seqshard/w2/warm") / mbps("seqshard/w0/warm"), 2)
    ratios["seqshard_w2_steady_over_w0_warm"] = round(mbps("seqshard-steady/w2/warm") / mbps("seqshard/w0/warm"), 2)
    ratios["seqshard_w0_warm_vs_raw_warm"] = round(mbps("seqshard/w0/warm") / mbps("raw/w0/warm"), 2)
    ratios["slots_over_torch_shared_memory_w2_warm"] = round(
        mbps("seqshard/w2/warm") / mbps("seqshard-torchshm/w2/warm"), 2
    )
    for name in ("seqshard/w0/warm", "seqshard/w2/warm", "seqshard-torchshm/w2/warm", "seqshard-steady/w2/warm"):
        ratios[f"main_cpu_ms_per_batch_{name.replace('/', '_')}"] = round(table[name]["main_cpu_ms_per_batch"], 3)

    print("seek-bound disk simulation (8 ms per non-contiguous read, 150 MB/s; IO time + CPU time of a warm run):")
    simulated = {}
    for method in ("seqshard", "mapstyle"):
        result = measure(method, 0, pattern, scp, False, [], seek_bound=True)
        simulated[method] = {
            "io_seconds": round(result["simulated_io_seconds"], 1),
            "seeks": result["seeks"],
            "total_seconds": round(result["simulated_io_seconds"] + result["cpu_seconds"], 1),
        }
        print(
            f"  {method:<10} {simulated[method]['seeks']:>8} seeks, {simulated[method]['io_seconds']:7.1f} s of IO, {simulated[method]['total_seconds']:7.1f} s in all"
        )
    ratios["seqshard_vs_mapstyle_seek_bound"] = round(
        simulated["mapstyle"]["total_seconds"] / simulated["seqshard"]["total_seconds"], 2
    )

    random_batches = measure_random_batching(corpus)
    ratios["padding_seqshard"] = round(table["seqshard/w2/warm"]["padding"], 4)
    ratios["padding_random_batches"] = round(random_batches["padding"], 4)
    expected = expected_speakers(corpus_speakers(corpus))
    for workers in (0, 2):
        run = table[f"seqshard/w{workers}/warm"]
        ratios[f"diversity_vs_random_w{workers}"] = round(
            sum(run["speakers"]) / sum(expected(b) for b in run["sizes"]), 3
        )

    quadruple = four_times(shards, args.work / "loader-shards-x4")
    memory = {}
    for name, listed in (("x1", pattern), ("x4", quadruple)):
        found = measure("seqshard", 2, listed, scp, False, [], memory=True)
        memory[name] = {key: round(found[key], 1) for key in ("peak_pss_mb", "peak_pss_with_workers_mb", "peak_rss_mb")}
    ratios["pss_main_process_4x_over_1x"] = round(memory["x4"]["peak_pss_mb"] / memory["x1"]["peak_pss_mb"], 3)
    ratios["pss_with_workers_4x_over_1x"] = round(
        memory["x4"]["peak_pss_with_workers_mb"] / memory["x1"]["peak_pss_with_workers_mb"], 3
    )
    for name, found in memory.items():
        print(f"peak memory, corpus {name} (w2): PSS of the training process {found['peak_pss_mb']:.0f} MB, with its "
              f"workers {found['peak_pss_with_workers_mb']:.0f} MB (RSS of the training process {found['peak_rss_mb']:.0f} MB)")  # fmt: skip
    print("ratios (same run): " + ", ".join(f"{k}={v}" for k, v in ratios.items()))
    for row in table.values():
        row.pop("speakers", None)
        row.pop("sizes", None)
    (args.work / "loader.json").write_text(
        json.dumps(
            {
                "results": table,
                "simulated": simulated,
                "random_batches": random_batches,
                "ratios": ratios,
                "memory": memory,
            },
            indent=1,
        )
    )


def warm_ratios(args, pattern: str, scp: str, shard_files: list[Path], shard_bytes: int) -> None:
    """``--warm-ratio``: warm one-process epochs of raw reading, seqshard and WebDataset (and
    seqshard from ``--baseline-code``), interleaved rounds in shuffled order, each run after
    reading every shard once (this VM reclaims cached pages between runs); medians and ratios
    of throughput. With ``--profile-dir``, one more warm epoch of each seqshard, profiled."""
    variants = {"raw": ("raw", None), "seqshard": ("seqshard", None), "webdataset": ("webdataset", None)}
    if args.baseline_code:
        variants["seqshard-baseline"] = ("seqshard", str(args.baseline_code))
    times: dict[str, list[float]] = {}
    plan = list(variants)
    for round_ in range(args.rounds):
        random.Random(round_).shuffle(plan)
        for name in plan:
            method, code = variants[name]
            _read_all(shard_files)
            result = measure(method, 0, pattern, scp, False, [], code=code)
            times.setdefault(name, []).append(result["seconds"])
        print(f"round {round_ + 1}/{args.rounds} done")
    median = {name: statistics.median(runs) for name, runs in times.items()}
    for name, seconds in median.items():
        runs = ", ".join(f"{t:.2f}" for t in times[name])
        print(f"  {name:<18} {seconds:7.2f} s  {shard_bytes / 1e6 / seconds:8.1f} MB/s  (runs: {runs})")
    ratios = {}
    for name in (n for n in median if n.startswith("seqshard")):
        ratios[f"{name}_vs_raw_warm_w0"] = round(median["raw"] / median[name], 3)
        ratios[f"{name}_vs_webdataset_warm_w0"] = round(median["webdataset"] / median[name], 3)
    print("ratios (same run): " + ", ".join(f"{k}={v}" for k, v in ratios.items()))
    if args.profile_dir:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        for name in (n for n in variants if n.startswith("seqshard")):
            method, code = variants[name]
            _read_all(shard_files)
            measure(method, 0, pattern, scp, False, [], code=code, profile=args.profile_dir / f"{name}.txt")
            print(f"profile of {name}: {args.profile_dir / f'{name}.txt'}")
    (args.work / "loader-warm-ratio.json").write_text(
        json.dumps({"median_seconds": median, "seconds": times, "bytes": shard_bytes, "ratios": ratios}, indent=1)
    )


def _read_all(files: list[Path]) -> None:
    for path in files:
        with open(path, "rb", buffering=0) as stream:
            while stream.read(8 << 20):
                pass


def corpus_speakers(corpus) -> list[int]:
    """Utterances per speaker of the corpus."""
    from collections import Counter

    return list(
        Counter(line.split("-")[0] for line in (corpus.root / "utt2num_frames").read_text().splitlines()).values()
    )


def measure_random_batching(corpus) -> dict:
    """Padding and speaker diversity of fully random batching: the corpus in a random order,
    cut greedily under the same budget of 20000 padded frames."""
    lengths = {}
    for line in (corpus.root / "utt2num_frames").read_text().splitlines():
        key, frames = line.split()
        lengths[key] = int(frames)
    keys = list(lengths)
    random.Random(0).shuffle(keys)
    batches, current, longest = [], [], 0
    for key in keys:
        if current and (len(current) + 1) * max(longest, lengths[key]) > 20000:
            batches.append(current)
            current, longest = [], 0
        current.append(key)
        longest = max(longest, lengths[key])
    batches.append(current)
    frames = sum(lengths.values())
    padded = sum(len(b) * max(lengths[k] for k in b) for b in batches)
    return {
        "padding": 1 - frames / padded,
        "speakers_per_batch": statistics.mean(len({k.split("-")[0] for k in b}) for b in batches),
    }


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
