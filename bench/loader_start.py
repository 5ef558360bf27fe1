"""A rank's start on a folder of very many shards: index reading, selection and planning.

    python bench/loader_start.py [--shards 10000 50000 500000] [--ranks 64] [--work bench/out] [--quick]

Packs one small shard, then makes folders of N shards of it (hard links: the same bytes under N
names, with their member tables) and an ``index.json`` of N entries, as a pack of N shards
writes it (each entry with a checksum of its own, so that the links are not taken for copies:
a rank's start reads no shard but those of its first batch). Each size runs in a fresh process:
``make_loader(folder, rank=R, world_size=W)`` (index, selection, this rank's shards), then
one process's loader of the whole folder and its first batch, with the times and the
process's peak memory (``VmHWM``) over its imports.
Writes WORK/loader_start.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import small_kaldi_dir, with_quick

HERE = Path(__file__).parent

PROBE = r"""
import json, sys, time
sys.path.insert(0, sys.argv[4])
from common import vm_kb
import seqshard, numpy
before = vm_kb("VmHWM")
started = time.perf_counter()
ranked = seqshard.make_loader(sys.argv[1], batch_size=4, num_workers=0, rank=int(sys.argv[2]), world_size=int(sys.argv[3]))
made = time.perf_counter()
alone = seqshard.make_loader(sys.argv[1], batch_size=4, num_workers=0)
first = next(iter(alone))
done = time.perf_counter()
print(json.dumps({"make_s": made - started, "alone_first_batch_s": done - made, "peak_mb": (vm_kb("VmHWM") - before) / 1024}))
"""


def make_folder(seed_shard: Path, seed_index: dict, folder: Path, shards: int) -> None:
    """``shards`` names of one shard (hard links) and an index listing each."""
    if (folder / "index.json").exists():
        return
    (folder / ".members").mkdir(parents=True, exist_ok=True)
    entry = seed_index["shards"][0]
    table = seed_shard.parent / ".members" / f"{seed_shard.name}.npz"
    entries = []
    for number in range(shards):
        name = f"data-{number:07d}.tar"
        os.link(seed_shard, folder / name)
        os.link(table, folder / ".members" / f"{name}.npz")
        entries.append({**entry, "name": name, "checksum": f"crc32:{number:08x}"})  # not taken for copies
    index = {**seed_index, "shards": entries}
    index["totals"] = {**index["totals"], "num_shards": shards, "num_utts": shards * entry["num_utts"]}
    index["totals"]["num_frames"] = shards * entry["num_frames"]
    index["totals"]["bytes"] = shards * entry["bytes"]
    (folder / "index.json").write_text(json.dumps(index))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, nargs="+", default=[10_000, 50_000, 500_000])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--work", type=Path, default=HERE / "out" / "loader_start")
    args = with_quick(parser, shards=[2_000, 10_000], ranks=8, work=HERE / "out" / "quick" / "loader_start")
    from seqshard import pack_data

    seed = args.work / "seed"
    if not (seed / "out" / "index.json").exists():
        data = small_kaldi_dir(seed / "kaldi", 2, 4, 8, (5, 20), "spk")
        pack_data(data[0], data[1], seed / "out", utts_per_file=8, progress=False)
    seed_index = json.loads((seed / "out" / "index.json").read_text())
    results = {}
    for shards in args.shards:
        folder = args.work / f"s{shards}"
        started = time.perf_counter()
        make_folder(seed / "out" / "data-00000.tar", seed_index, folder, shards)
        made = time.perf_counter() - started
        probe = subprocess.run(
            [sys.executable, "-c", PROBE, str(folder), str(args.ranks - 1), str(args.ranks), str(HERE)],
            capture_output=True,
            text=True,
        )
        if probe.returncode:
            raise SystemExit(probe.stderr[-3000:])
        found = json.loads(probe.stdout.strip().splitlines()[-1])
        results[shards] = found
        print(
            f"{shards:>9,} shards: make_loader as rank {args.ranks - 1} of {args.ranks} {found['make_s']:.2f} s; "
            f"one process's make_loader and first batch {found['alone_first_batch_s']:.2f} s; "
            f"{found['peak_mb']:.0f} MB over imports" + (f" (folder made in {made:.0f} s)" if made > 1 else "")
        )
    (args.work / "loader_start.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
