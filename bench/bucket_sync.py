"""How much step-time spread across ranks bucket sync removes (real gloo ranks, CPU).

    python bench/bucket_sync.py [--ranks 4] [--gb 2.2] [--work bench/out] [--quick]

Runs one epoch of the loader on R ranks over the loader benchmark's shards (made here when
missing), with and without
``bucket_sync``, records each rank's padded length T at every step, and reports:

- the spread of T across ranks per step, ``(max - min) / mean``, averaged over steps;
- the share of DDP step time spent waiting at the all-reduce for the slowest rank, under a
  step cost of ``1 + T / 500`` (dynamic batches hold ~constant frames, so the length-
  dependent part is attention's; 500 frames is where it equals the rest for a typical
  Conformer): ``sum(max_r c - mean_r c) / sum(max_r c)``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).parent))
from common import packed_corpus, with_quick


def rank_main(rank: int, world_size: int, init: str, pattern: str, bucket_sync: bool, out: str) -> None:
    import torch.distributed as dist

    import seqshard

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    loader = seqshard.make_loader(pattern, batch_frames=20000, num_workers=0, bucket_sync=bucket_sync, seed=0)
    lengths = [int(batch["feats"].shape[1]) for batch in loader]
    Path(out, f"rank{rank}.json").write_text(json.dumps(lengths))
    dist.destroy_process_group()


def cost(length: int) -> float:
    return 1 + length / 500


def run(world_size: int, pattern: str, bucket_sync: bool) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        init = f"file://{folder}/init"
        mp.spawn(rank_main, args=(world_size, init, pattern, bucket_sync, folder), nprocs=world_size, join=True)
        per_rank = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(world_size)]
    steps = list(zip(*per_rank))
    spread = statistics.mean((max(s) - min(s)) / statistics.mean(s) for s in steps)
    slowest = sum(max(cost(t) for t in s) for s in steps)
    waiting = sum(max(cost(t) for t in s) - statistics.mean(cost(t) for t in s) for s in steps) / slowest
    return {"steps": len(steps), "length_spread": round(spread, 4), "waiting_share": round(waiting, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--gb", type=float, default=2.2)
    parser.add_argument("--work", type=Path, default=Path(__file__).parent / "out")
    parser.add_argument("--utts-per-file", type=int, default=2000)
    args = with_quick(parser, ranks=2, gb=0.05, utts_per_file=25, work=Path(__file__).parent / "out" / "quick")
    _, shards = packed_corpus(args.work, args.gb, utts_per_file=args.utts_per_file)
    pattern = f"{shards}/data-*.tar"
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    results = {name: run(args.ranks, pattern, sync) for name, sync in (("unsynced", False), ("bucket_sync", True))}
    for name, row in results.items():
        print(
            f"{name:<12} {row['steps']} steps: length spread across ranks {row['length_spread']:.1%}, time waiting for the slowest rank {row['waiting_share']:.1%}"
        )
    (args.work / "bucket_sync.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
