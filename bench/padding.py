"""Padding of dynamic batches at budgets of 100 to 1,200 s, against lhotse's DynamicBucketingSampler.

    python bench/padding.py [--utts 100000] [--budgets 100 200 600 1200] [--out bench/out] [--quick]

Lengths as bench/common.py's corpus has them (log-normal, median 7 s, clipped to 1-20 s; 40
utterances per speaker), in the order a shuffled pack stores them. Every batcher sees the same
utterances in the same order, metadata only (no audio, no tar), in this process:

    seqshard         WindowShuffle (the loader's 3,000) then SortBatch with its default window,
                     which follows the budget (BudgetWindow: 64 batches' worth of samples, at
                     least 2,000 and at most 16,384 of them), both growing from small at the
                     stream's start as the loader's recipe builds them for one reader of the
                     corpus (SHUFFLE_GROWTH; sort_growth: less growth in an epoch of few windows)
    fixed 2000       the same with the former fixed window of 2,000 samples
    lhotse           DynamicBucketingSampler(max_duration=B, num_buckets=30, shuffle=True) over
                     a CutSet of dummy cuts of the same durations

A budget B bounds padded length: batch size x longest <= B, in both (lhotse's TimeConstraint
closes a batch when one more cut of its longest would exceed it). Padding is 1 - frames /
padded frames over the epoch. Also: distinct speakers per batch against batches drawn at random
(1.0: as diverse as random), the sort windows' size in samples, CPU per utterance. Prints the
table and the ratio seqshard / lhotse, with the machine's load before and after; writes
OUT/padding.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).parent))
from common import expected_speakers, utterance_frames, with_quick

from seqshard.formats.index_entries import length_bin
from seqshard.options import Batching
from seqshard.pipeline.stages.batching import BudgetWindow, LengthBudget, SortBatch
from seqshard.pipeline.stages.sample import Sample
from seqshard.pipeline.stages.shuffle import WindowShuffle
from seqshard.pipeline.workers.recipe import SHUFFLE_GROWTH, sort_growth
from seqshard.testing import ListSource

FRAMES_PER_SECOND = 100
UTTS_PER_SPEAKER = 40
SHUFFLE_WINDOW = 3000  # the loader's default
LHOTSE_BUCKETS = 30


def corpus(utts: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Frames per utterance and the order a shuffled pack stores them in."""
    rng = np.random.default_rng(seed)
    frames = utterance_frames(rng, utts)
    return frames, rng.permutation(utts)


def speaker(index: int) -> int:
    return index // UTTS_PER_SPEAKER


def summary(batches: list[list[int]], frames: np.ndarray, expected) -> dict:
    """Padding, batch count and size, and speaker diversity of batches of utterance indices."""
    real = sum(int(frames[b].sum()) for b in batches)
    padded = sum(len(b) * int(frames[b].max()) for b in batches)
    speakers = sum(len({speaker(i) for i in b}) for b in batches)
    return {
        "padding": round(1 - real / padded, 5),
        "batches": len(batches),
        "utts_per_batch": round(statistics.mean(map(len, batches)), 1),
        "diversity_vs_random": round(speakers / sum(expected(len(b)) for b in batches), 4),
    }


class _WindowSizes(SortBatch):
    """SortBatch that records how many samples each of its windows held."""

    sizes: list[int]

    def arrange(self, items, number, fresh):
        self.sizes.append(len(items))
        return super().arrange(items, number, fresh)


def seqshard_batches(
    frames, order, budget_frames: int, window, grow: bool = True
) -> tuple[list[list[int]], list[int], float]:
    """Batches (utterance indices), the sizes of its windows but the last (partial) one, and CPU
    seconds of seqshard's stages (``grow``: the first windows small, as the loader's)."""
    samples = [Sample(str(i), {"feats": range(frames[i])}) for i in order.tolist()]  # a length, no data
    histogram = Counter(map(length_bin, frames.tolist()))  # the index's
    growth = sort_growth(Batching(batch_frames=budget_frames), histogram, len(samples)) if grow else None
    shuffle = WindowShuffle(ListSource(samples), SHUFFLE_WINDOW, 0, grow=SHUFFLE_GROWTH if grow else None)
    stage = _WindowSizes(shuffle, window, LengthBudget(budget_frames), 0, grow=growth)
    stage.sizes = []
    started = time.process_time()
    batches = [[int(s.key) for s in batch.samples] for batch in stage]
    return batches, [n for n in stage.sizes if n][:-1] or stage.sizes[:1], time.process_time() - started


def lhotse_batches(frames, order, budget_seconds: float) -> tuple[list[list[int]], float]:
    """Batches (utterance indices) and CPU seconds of lhotse's DynamicBucketingSampler."""
    from lhotse import CutSet
    from lhotse.dataset import DynamicBucketingSampler
    from lhotse.testing.dummies import dummy_cut

    cuts = CutSet.from_cuts(dummy_cut(i, duration=frames[i] / FRAMES_PER_SECOND) for i in order.tolist())
    sampler = DynamicBucketingSampler(
        cuts, max_duration=budget_seconds, num_buckets=LHOTSE_BUCKETS, shuffle=True, seed=0
    )
    started = time.process_time()
    batches = [[int(cut.id.rsplit("-", 1)[1]) for cut in batch] for batch in sampler]
    return batches, time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--utts", type=int, default=100_000)
    parser.add_argument("--budgets", type=float, nargs="+", default=[100, 200, 600, 1200], help="seconds")
    parser.add_argument("--window-batches", type=int, default=BudgetWindow().batches, help="seqshard's BudgetWindow")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = with_quick(parser, utts=10_000, out=Path(__file__).parent / "out" / "quick")
    warnings.filterwarnings("ignore", module="lhotse")  # an eager CutSet: fine for metadata
    load_before = os.getloadavg()
    frames, order = corpus(args.utts)
    expected = expected_speakers(list(Counter(map(speaker, range(args.utts))).values()))
    hours = frames.sum() / FRAMES_PER_SECOND / 3600
    print(f"{args.utts} utterances, {hours:.0f} h (median {np.median(frames) / 100:.1f} s); load {load_before[0]:.2f}")
    print(f"{'budget':>8}  {'seqshard':>9}  {'fixed 2000':>10}  {'lhotse':>7}  {'ratio':>6}  "
          f"{'window: median (max)':>17}  {'diversity':>9}  {'us/utt':>13}")  # fmt: skip
    rows = {}
    for budget in args.budgets:
        budget_frames = int(budget * FRAMES_PER_SECOND)
        window = BudgetWindow(batches=args.window_batches)
        new, windows, new_cpu = seqshard_batches(frames, order, budget_frames, window)
        old, _, old_cpu = seqshard_batches(frames, order, budget_frames, 2000, grow=False)
        bucketed, lhotse_cpu = lhotse_batches(frames, order, budget)
        for batches in (new, old, bucketed):
            assert sorted(i for b in batches for i in b) == list(range(args.utts)), "an utterance lost or repeated"
        row = {
            "seqshard": {
                **summary(new, frames, expected),
                "window_samples_median": int(statistics.median(windows)),
                "window_samples_max": max(windows),
            },
            "seqshard_window_2000": summary(old, frames, expected),
            "lhotse": summary(bucketed, frames, expected),
            "us_per_utt": {
                name: round(cpu / args.utts * 1e6, 2)
                for name, cpu in (("seqshard", new_cpu), ("seqshard_window_2000", old_cpu), ("lhotse", lhotse_cpu))
            },
        }
        row["padding_seqshard_over_lhotse"] = round(row["seqshard"]["padding"] / row["lhotse"]["padding"], 3)
        rows[f"{budget:g}s"] = row
        diversity = f"{row['seqshard']['diversity_vs_random']:.2f}/{row['lhotse']['diversity_vs_random']:.2f}"
        cpu = f"{row['us_per_utt']['seqshard']:.1f}/{row['us_per_utt']['lhotse']:.1f}"
        print(f"{budget:>7g}s  {row['seqshard']['padding']:>9.2%}  {row['seqshard_window_2000']['padding']:>10.2%}  "
              f"{row['lhotse']['padding']:>7.2%}  {row['padding_seqshard_over_lhotse']:>5.2f}x  "
              f"{int(statistics.median(windows)):>8} ({max(windows):>6})  {diversity:>9}  {cpu:>13}")  # fmt: skip
    load_after = os.getloadavg()
    print(f"load {load_after[0]:.2f} after. ratio: seqshard padding / lhotse's (goal <= 1 at every budget); "
          "diversity and us/utt: seqshard / lhotse")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    results = {
        "utts": args.utts,
        "hours": round(float(hours), 1),
        "lhotse_buckets": LHOTSE_BUCKETS,
        "shuffle_window": SHUFFLE_WINDOW,
        "budget_window": BudgetWindow(batches=args.window_batches).__dict__,
        "load_before": load_before,
        "load_after": load_after,
        "budgets": rows,
    }
    (args.out / "padding.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out / 'padding.json'}")


if __name__ == "__main__":
    main()
