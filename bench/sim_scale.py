"""Epoch planning at WenetSpeech scale, and what "stop" loses, from a synthetic index.

    python bench/sim_scale.py [--shards 7500] [--utts-per-shard 2000] [--quick]

7,500 shards of 2,000 utterances (15 M, lengths log-normal, 1-20 s) as an index would list
them. For 8 ranks x 4 workers and 64 ranks x 4 workers: time and memory of planning one
epoch, and the share of the epoch that uneven='stop' leaves unread when ranks end together,

- naive: shards shuffled then dealt round-robin, shard i to rank i mod R (CAT, WebDataset);
- balanced: seqshard's plan (cut by frames, shards split at utterance boundaries).

"plan" counts the frames beyond the poorest rank's; "batches" simulates dynamic batching
(sort windows of 2,000, 20,000 padded frames) on every worker, merges each rank's workers in
turn and counts what lies beyond the step where the first rank runs out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).parent))
from common import with_quick

from seqshard.formats.table import ShardInfo, ShardTable
from seqshard.pipeline.epoch_plan import Plan, Unit, plan_epoch
from seqshard.pipeline.stages.batching import LengthBudget, cut_batches


def synthetic(shards: int, per_shard: int, seed: int = 0) -> tuple[ShardTable, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(700), 0.55, size=(shards, per_shard)), 100, 2000).astype(np.int32)
    table = ShardTable(
        tuple(
            ShardInfo(f"data-{i:05d}.tar", int(lengths[i].sum()) * 320, per_shard, int(lengths[i].sum()))
            for i in range(shards)
        )
    )
    return table, lengths


def naive_plan(table: ShardTable, epoch: int, seed: int, world_size: int, workers: int) -> Plan:
    order = np.random.default_rng([seed, epoch]).permutation(len(table.shards))
    return [
        [[Unit(int(s)) for s in order[rank::world_size][worker::workers]] for worker in range(workers)]
        for rank in range(world_size)
    ]


def unit_lengths(lengths: np.ndarray, unit: Unit) -> np.ndarray:
    return lengths[unit.shard][unit.first() : unit.stop : unit.step]


def plan_loss(plan: Plan, lengths: np.ndarray) -> float:
    """Frames beyond the poorest rank's, as a share of all frames (what a frame budget sees)."""
    per_rank = [sum(int(unit_lengths(lengths, u).sum()) for w in rank for u in w) for rank in plan]
    return sum(n - min(per_rank) for n in per_rank) / sum(per_rank)


def batch_loss(plan: Plan, lengths: np.ndarray, window: int = 2000, budget: int = 20000) -> float:
    cost = LengthBudget(budget)
    ranks = []
    for rank in plan:
        workers = []
        for units in rank:
            stream = np.concatenate([unit_lengths(lengths, u) for u in units]) if units else np.zeros(0, np.int32)
            sizes = []
            for start in range(0, len(stream), window):
                batches, _ = cut_batches(np.sort(stream[start : start + window]).tolist(), cost)
                sizes.extend(len(b) for b in batches)
            workers.append(sizes)
        merged, turn = [], 0
        while any(workers):
            if workers[turn % len(workers)]:
                merged.append(workers[turn % len(workers)].pop(0))
            turn += 1
        ranks.append(merged)
    steps = min(len(r) for r in ranks)
    total = sum(sum(r) for r in ranks)
    return sum(sum(r[steps:]) for r in ranks) / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=7500)
    parser.add_argument("--utts-per-shard", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=3, help="epochs simulated (losses are averaged)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "sim_scale.json")
    args = with_quick(parser, shards=300, epochs=1, out=Path(__file__).parent / "out" / "quick" / "sim_scale.json")
    table, lengths = synthetic(args.shards, args.utts_per_shard)
    print(
        f"synthetic index: {len(table.shards)} shards, {lengths.size / 1e6:.1f} M utterances, {lengths.sum() * 0.01 / 3600:.0f} hours"
    )
    results = {}
    for world_size, workers in ((8, 4), (64, 4)):
        tracemalloc.start()
        started = time.perf_counter()
        plan_epoch(table, 0, 0, world_size, workers)
        seconds = time.perf_counter() - started
        peak_mb = tracemalloc.get_traced_memory()[1] / 1e6
        tracemalloc.stop()
        row = {"plan_seconds": round(seconds, 4), "plan_peak_mb": round(peak_mb, 1)}
        for name, make in (("naive", naive_plan), ("balanced", plan_epoch)):
            plans = [make(table, epoch, 0, world_size, workers) for epoch in range(args.epochs)]
            row[f"{name}_plan_loss"] = float(np.mean([plan_loss(p, lengths) for p in plans]))
            row[f"{name}_batch_loss"] = float(np.mean([batch_loss(p, lengths) for p in plans]))
        results[f"{world_size}x{workers}"] = row
        print(
            f"{world_size} ranks x {workers} workers: plan {seconds * 1000:.0f} ms, {peak_mb:.1f} MB peak; unread under 'stop': "
            f"naive {row['naive_plan_loss']:.4%} (plan) {row['naive_batch_loss']:.4%} (batches), "
            f"balanced {row['balanced_plan_loss']:.5%} (plan) {row['balanced_batch_loss']:.4%} (batches)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
