"""Sidecar field shards: what reading only some fields saves, and what splitting costs.

    python bench/fields.py [--gb 2.2] [--rounds 3] [--work bench/out] [--quick]

On the loader benchmark's packed corpus (2.2 GB of 80-dim float32 features with their text in
each shard), ``seqshard add-field`` adds:

- ``words``: a small label field (the transcript, from the corpus's ``text``) as a sidecar;
- ``fbank``: the features again, from the corpus's ``feats.scp``, as a second sidecar.

Then one epoch (one process, batches of 20000 padded frames or 64 utterances) of:

- everything: the shards' own features and text, and the ``words`` sidecar;
- labels only: ``fields=["words"]`` (the shards are never opened);
- combined: ``fields=["feats", "txt"]`` (features and labels in one tar);
- sidecars: ``fields=["fbank", "words"]`` (the same fields from two sidecar files read in step).

Cold (page cache evicted) and warm (every file read just before, in the same process: this
VM reclaims cached pages between runs), fresh processes, interleaved rounds in shuffled order;
medians; torch is imported before the clock starts. Ratios: labels only / everything (time), sidecars / combined (throughput).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import evict, packed_corpus, with_quick

HERE = Path(__file__).parent

READS = {
    "everything": dict(fields=["feats", "txt", "words"], batch_frames=20000),
    "labels_only": dict(fields=["words"], batch_size=64),
    "combined": dict(fields=["feats", "txt"], batch_frames=20000),
    "sidecars": dict(fields=["fbank", "words"], feature_field="fbank.npy", batch_frames=20000),
}


def run_one(pattern: str, name: str, warm: bool) -> dict:
    import torch  # noqa: F401  imported before timing: every read pays it once, outside the clock

    import seqshard

    if warm:  # this VM reclaims cached pages between runs (kdamond): read them just before
        for path in sorted(Path(pattern).parent.rglob("*.tar")):  # the shards and their sidecars
            with open(path, "rb", buffering=0) as stream:
                while stream.read(8 << 20):
                    pass
    started = time.perf_counter()
    loader = seqshard.make_loader(pattern, num_workers=0, seed=0, **READS[name])
    utts = sum(len(batch["keys"]) for batch in loader)
    return {"seconds": time.perf_counter() - started, "utts": utts}


def prepare(work: Path, gb: float, utts_per_file: int) -> tuple[Path, Path]:
    """The packed corpus with the two sidecars (made once)."""
    corpus, shards = packed_corpus(work, gb, "fields-shards", utts_per_file)
    from seqshard.formats.index import ShardIndex

    index = ShardIndex.load(shards)
    for name, source in (("words", corpus.text), ("fbank", corpus.scp)):
        if name not in index.field_sets:
            started = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "seqshard", "add-field", str(shards), "--name", name, "--from", str(source)]
                + ["--quiet", "--jobs", "2"],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            print(f"add-field {name}: {time.perf_counter() - started:.1f} s")
    return corpus.root, shards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=HERE / "out")
    parser.add_argument("--utts-per-file", type=int, default=2000)
    parser.add_argument("--run", nargs=3, metavar=("PATTERN", "READ", "CACHE"), help=argparse.SUPPRESS)
    args = with_quick(parser, gb=0.05, rounds=1, utts_per_file=25, work=HERE / "out" / "quick")
    if args.run:
        print(json.dumps(run_one(args.run[0], args.run[1], args.run[2] == "warm")))
        return
    _, shards = prepare(args.work, args.gb, args.utts_per_file)
    pattern = f"{shards}/data-*.tar"
    files = sorted(shards.rglob("*.tar"))  # the shards and their sidecars (fields/NAME/*.tar)
    sizes = {
        "main": sum(p.stat().st_size for p in shards.glob("data-?????.tar")),
        "words": sum(p.stat().st_size for p in shards.glob("fields/words/*.tar")),
        "fbank": sum(p.stat().st_size for p in shards.glob("fields/fbank/*.tar")),
    }
    print(
        f"shards {sizes['main'] / 1e9:.2f} GB; sidecars: words {sizes['words'] / 1e6:.1f} MB, fbank {sizes['fbank'] / 1e9:.2f} GB"
    )
    plan = [(name, cold) for name in READS for cold in (True, False)]
    results: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        random.Random(round_).shuffle(plan)
        for name, cold in plan:
            if cold:
                evict(files)
            output = subprocess.run(
                [sys.executable, __file__, "--run", pattern, name, "cold" if cold else "warm"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            result = json.loads(output.strip().splitlines()[-1])
            results.setdefault(f"{name}/{'cold' if cold else 'warm'}", []).append(result["seconds"])
        print(f"round {round_ + 1}/{args.rounds} done")
    median = {name: statistics.median(times) for name, times in results.items()}
    for name, seconds in sorted(median.items()):
        print(f"  {name:<22} {seconds:7.2f} s  (runs: {', '.join(f'{t:.2f}' for t in results[name])})")
    ratios = {}
    for cache in ("cold", "warm"):
        ratios[f"labels_only_over_everything_time_{cache}"] = round(
            median[f"labels_only/{cache}"] / median[f"everything/{cache}"], 4
        )
        combined_bytes = sizes["main"]
        sidecar_bytes = sizes["fbank"] + sizes["words"]
        ratios[f"sidecars_over_combined_throughput_{cache}"] = round(
            (sidecar_bytes / median[f"sidecars/{cache}"]) / (combined_bytes / median[f"combined/{cache}"]), 3
        )
        ratios[f"sidecars_over_combined_time_{cache}"] = round(
            median[f"combined/{cache}"] / median[f"sidecars/{cache}"], 3
        )
    print("ratios (same run): " + ", ".join(f"{k}={v}" for k, v in ratios.items()))
    (args.work / "fields.json").write_text(
        json.dumps({"median_seconds": median, "sizes": sizes, "ratios": ratios}, indent=1)
    )


if __name__ == "__main__":
    main()
