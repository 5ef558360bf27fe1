"""A rank's start on a folder of very many shards: index reading, selection and planning.

    python bench/loader_start.py [--shards 5000 50000 500000] [--ranks 64] [--work bench/out]
                                 [--compare OLD_TREE] [--rounds 1] [--quick]

Packs one small shard, then makes folders of N shards of it (hard links: the same bytes under N
names, with their member tables; a copy of it every 50,000, as a file takes at most 65,000 links) and the index of N entries a pack of N shards writes
(``ShardIndex.save``: ``index.json`` and, from 1,000 shards, its compact table ``index.npz``;
each entry with a checksum of its own, so that the links are not taken for copies). Each
size runs in a fresh process that has imported seqshard, numpy and torch (a training script
has) before the clock starts: ``make_loader(folder, rank=R, world_size=W)`` (index, selection,
this rank's shards; the default batches, ``batch_frames``), the first epoch's plan as this
rank's readers make it (``plan_epoch``, the rank's share), the epoch's batches as an
iteration's start counts them (every rank's share: ``counts.planned_batches(...,
estimate=False)``), the identity the ranks compare (``fingerprint``), and the first batch of
that rank from one worker process (a loader with ``uneven="join"``, which iterates without a
process group; its ``make_loader`` not counted again): together a rank's start, and its peak
memory (``VmHWM``, over the imports). Apart: ``planned_batches()``'s estimate (what ``len`` and
progress bars ask; random orders of the lengths, a cost of the world size, not of the shards),
and one process's loader of the whole folder with its first batch, and the peak with it.
``--compare OLD_TREE`` runs the same probe with the seqshard of OLD_TREE (e.g. a ``git
archive`` of main) on the same folders, interleaved with this tree's, ``--rounds`` times.
Writes WORK/loader_start.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import code_path, small_kaldi_dir, with_quick

HERE = Path(__file__).resolve().parent
LINKS = 50_000
ROOT = HERE.parent

PROBE = r"""
import gc, json, sys, time
sys.path.insert(0, sys.argv[4])
from common import vm_kb
import seqshard, numpy, torch
from seqshard.pipeline.rank import counts
assert seqshard.__file__.startswith(sys.argv[5]), seqshard.__file__
before = vm_kb("VmHWM")
folder, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
clock = time.perf_counter
cpu = time.process_time()
started = clock()
ranked = seqshard.make_loader(folder, num_workers=1, rank=rank, world_size=world)
made = clock()
units = seqshard.extend.plan_epoch(ranked.table, 0, 0, world, 1)[rank][0]
planned = clock()
counts.planned_batches(ranked._setup, 0, None, estimate=False)  # what an iteration's start counts
fingerprint = ranked.table.fingerprint()  # what the ranks compare
counted = clock()
cpu = time.process_time() - cpu
estimate = ranked.planned_batches()  # len()'s estimate, for a progress bar: not needed to start
estimated = clock()
del ranked
gc.collect()
joined = seqshard.make_loader(folder, num_workers=1, rank=rank, world_size=world, uneven="join")  # iterates alone
begun = clock()
first = next(iter(joined))
reading = clock()
start_mb = (vm_kb("VmHWM") - before) / 1024
del joined, first
gc.collect()
alone = seqshard.make_loader(folder, num_workers=0)
first = next(iter(alone))
done = clock()
print(json.dumps({"make_s": made - started, "plan_s": planned - made, "count_s": counted - planned,
                  "first_batch_s": reading - begun, "start_s": counted - started + reading - begun,
                  "start_cpu_s": cpu, "estimate_s": estimated - counted, "start_mb": start_mb,
                  "alone_first_batch_s": done - reading, "peak_mb": (vm_kb("VmHWM") - before) / 1024,
                  "units": len(units), "batches": estimate.total}))
"""


def make_folder(seed_shard: Path, seed_index: dict, folder: Path, shards: int) -> None:
    """``shards`` names of one shard (hard links) and the index a pack of them writes."""
    from seqshard.formats.index import ShardIndex

    if (folder / "index.json").exists():
        return
    (folder / ".members").mkdir(parents=True, exist_ok=True)
    entry = seed_index["shards"][0]
    table = seed_shard.parent / ".members" / f"{seed_shard.name}.npz"
    copies = folder.parent / f"{folder.name}.copies"  # a file has at most 65,000 links (ext4): a copy every 50,000
    copies.mkdir(exist_ok=True)
    entries = []
    for number in range(shards):
        if number % LINKS == 0:
            shard, shard_table = copies / f"{number // LINKS}.tar", copies / f"{number // LINKS}.tar.npz"
            shutil.copyfile(seed_shard, shard)
            shutil.copyfile(table, shard_table)
        name = f"data-{number:07d}.tar"
        os.link(shard, folder / name)
        os.link(shard_table, folder / ".members" / f"{name}.npz")
        entries.append({**entry, "name": name, "checksum": f"crc32:{number:08x}"})  # not taken for copies
    ShardIndex.from_json({**seed_index, "shards": entries}, folder, "bench").save(folder)


def probe(code: Path, folder: Path, ranks: int) -> dict:
    """The probe's figures, run with the seqshard of ``code``."""
    env = {**os.environ, "PYTHONPATH": code_path(code)}
    found = subprocess.run(  # in the tree's folder: `python -c` puts the current folder first on the path
        [
            sys.executable,
            "-c",
            PROBE,
            str(folder.resolve()),
            str(ranks - 1),
            str(ranks),
            str(HERE),
            str(Path(code).resolve()),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=code,
    )
    if found.returncode:
        raise SystemExit(found.stderr[-3000:])
    return json.loads(found.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, nargs="+", default=[5_000, 50_000, 500_000])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--work", type=Path, default=HERE / "out" / "loader_start")
    parser.add_argument("--compare", type=Path, help="a tree of another seqshard (e.g. main), run in turn")
    parser.add_argument("--rounds", type=int, default=1)
    args = with_quick(parser, shards=[2_000, 10_000], ranks=8, work=HERE / "out" / "quick" / "loader_start")
    from seqshard import pack_data

    seed = args.work / "seed"
    if not (seed / "out" / "index.json").exists():
        data = small_kaldi_dir(seed / "kaldi", 2, 4, 8, (5, 20), "spk")
        pack_data(data[0], data[1], seed / "out", utts_per_file=8, progress=False)
    seed_index = json.loads((seed / "out" / "index.json").read_text())
    codes = {"this": ROOT} | ({"compared": args.compare} if args.compare else {})
    results: dict = {}
    for shards in args.shards:
        folder = args.work / f"s{shards}"
        started = time.perf_counter()
        make_folder(seed / "out" / "data-00000.tar", seed_index, folder, shards)
        made = time.perf_counter() - started
        for _ in range(args.rounds):
            for name, code in codes.items():
                found = probe(code, folder, args.ranks) | {"load": os.getloadavg()[0]}
                results.setdefault(name, {}).setdefault(shards, []).append(found)
                print(
                    f"{name:>8} {shards:>9,} shards, rank {args.ranks - 1} of {args.ranks}: start {found['start_s']:.2f} s "
                    f"(make_loader {found['make_s']:.2f}, plan {found['plan_s']:.2f}, the epoch's count "
                    f"{found['count_s']:.2f}, first batch {found['first_batch_s']:.2f}; CPU before the first batch "
                    f"{found['start_cpu_s']:.2f} s), {found['start_mb']:.0f} MB; planned_batches()'s estimate "
                    f"{found['estimate_s']:.2f} s; one process's loader and first batch "
                    f"{found['alone_first_batch_s']:.2f} s; peak {found['peak_mb']:.0f} MB over imports; load {found['load']:.1f}"
                    + (f" (folder made in {made:.0f} s)" if made > 1 else ""),
                    flush=True,
                )
    (args.work / "loader_start.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
