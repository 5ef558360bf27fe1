"""Token datasets and mixing, each against a baseline measured in the same run.

    python bench/tokens.py [--sentences 840000] [--plan-pairs 10000000] [--out bench/out/tokens] [--quick] [--profile]

A synthetic parallel corpus: 4 language pairs (sizes 8:4:2:1), each side a random word
sequence whose target length follows its source's, tokenized with the LibriSpeech BPE model
in tests/realdata (about 25 tokens per sentence; >= 20 M tokens at the default size).

    binarize   seqshard binarize (1 and 2 jobs) of every side, against SentencePiece's own
               encode of the same lines (one thread, lines already in memory).
    planning   planning one epoch of max_tokens batches for 10 M sentence pairs (lengths
               drawn like the corpus'): seconds and peak memory, in a fresh process.
    padding    of the batches of a real epoch over the 4 pairs (temperature 5).
    iterate    one epoch of make_token_loader batches from the memory-mapped files (a fresh
               loader, so planning the epoch included), against tokenizing the same sentences'
               text (what a loader without binarized data does every epoch): wall and CPU time
               (both single-threaded), --epoch-rounds interleaved rounds, medians.
    mixing     the shard loader's time per sample over 3 packed feature corpora read as one
               pattern list (4 epochs), against the same 3 read through mux() (weights 4:2:1,
               one epoch as long), CPU time of the process (num_workers=0), 7 interleaved
               rounds, medians.

Prints the ratios and writes OUT/tokens.json; ``--profile`` also prints cProfile's costliest
functions of the planning probe and of one epoch (stderr).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).parent))
from common import small_kaldi_dir, vm_kb, with_quick

ROOT = Path(__file__).parent.parent

BPE = ROOT / "tests" / "realdata" / "tokenizers" / "librispeech.train_960_unigram5000.bpemodel"
WORDS = [
    "THE",
    "OF",
    "AND",
    "TO",
    "IN",
    "A",
    "IS",
    "THAT",
    "FOR",
    "IT",
    "AS",
    "WAS",
    "WITH",
    "BE",
    "BY",
    "ON",
    "NOT",
    "HE",
    "THIS",
    "ARE",
    "OR",
    "HIS",
    "FROM",
    "AT",
    "WHICH",
    "BUT",
    "HAVE",
    "AN",
    "THEY",
    "YOU",
    "WERE",
    "HER",
    "SHE",
    "THERE",
    "WOULD",
    "THEIR",
    "WE",
    "HIM",
    "BEEN",
    "HAS",
    "WHEN",
    "WHO",
    "WILL",
    "MORE",
    "NO",
    "IF",
    "OUT",
    "SO",
    "SAID",
    "WHAT",
    "UP",
    "ITS",
    "ABOUT",
    "INTO",
    "THAN",
    "THEM",
    "CAN",
    "ONLY",
    "OTHER",
    "NEW",
    "SOME",
    "COULD",
    "TIME",
    "THESE",
    "TWO",
    "MAY",
    "THEN",
    "DO",
    "FIRST",
    "ANY",
    "MY",
    "NOW",
    "SUCH",
    "LIKE",
    "OUR",
    "OVER",
    "MAN",
    "ME",
    "EVEN",
    "MOST",
    "MADE",
    "AFTER",
    "ALSO",
    "DID",
    "MANY",
    "BEFORE",
    "MUST",
    "THROUGH",
    "BACK",
    "YEARS",
    "WHERE",
    "MUCH",
    "YOUR",
    "WAY",
]
PAIRS = {"de-en": 8, "fr-en": 4, "sw-en": 2, "yo-en": 1}


def write_corpus(root: Path, sentences: int, seed: int = 0) -> dict[str, tuple[Path, Path]]:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    total = sum(PAIRS.values())
    files = {}
    for pair, weight in PAIRS.items():
        count = sentences * weight // total
        src_len = np.clip(rng.lognormal(np.log(14), 0.5, count), 1, 120).astype(int)
        tgt_len = np.clip(src_len * rng.normal(1.0, 0.12, count), 1, 120).astype(int)
        paths = (root / f"{pair}.src.txt", root / f"{pair}.tgt.txt")
        for path, lengths in zip(paths, (src_len, tgt_len)):
            picks = rng.integers(0, len(words), int(lengths.sum()))
            ends = np.cumsum(lengths)
            with open(path, "w") as stream:
                start = 0
                for end in ends:
                    stream.write(" ".join(words[picks[start:end]]) + "\n")
                    start = end
        files[pair] = paths
    return files


def timed(function, clock=time.perf_counter):
    started = clock()
    result = function()
    return clock() - started, result


def both_clocks(function) -> tuple[float, float, object]:
    """Wall and CPU seconds of ``function()`` (single-threaded work: CPU time is what a shared
    machine cannot inflate), and its result."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = function()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def profiled(function, title: str, show: bool):
    """``function()``; with ``show``, run under cProfile and print its 12 costliest functions
    (own time) to stderr."""
    if not show:
        return function()
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    result = profile.runcall(function)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
    print(f"--- profile: {title}\n{text.getvalue()}", file=sys.stderr)
    return result


def planning_child(sentences: int, profile: bool = False) -> None:
    """Runs in a fresh process: plans an epoch of ``sentences`` pairs; prints seconds and peak RSS
    (with ``profile``, plans it once more under cProfile afterwards)."""
    from seqshard.tokens.token_epochs import BatchRules, plan_epoch

    class Sizes:  # the part of OpenPair planning reads
        def __init__(self, rng):
            self.src_sizes = np.clip(rng.lognormal(np.log(26), 0.5, sentences), 2, 250).astype(np.int32)
            self.tgt_sizes = np.clip(self.src_sizes * rng.normal(1.0, 0.12, sentences), 2, 250).astype(np.int32)

        def __len__(self):
            return sentences

    pairs = [Sizes(np.random.default_rng(0))]
    before = vm_kb("VmRSS")
    seconds, plan = timed(lambda: plan_epoch(pairs, None, BatchRules(max_tokens=4096), 0, 8))
    peak = vm_kb("VmHWM")  # this process's own peak (ru_maxrss would count its parent's pages)
    print(
        json.dumps(
            {"seconds": seconds, "peak_mb": peak / 1024, "before_mb": before / 1024, "batches": plan.num_batches}
        )
    )
    profiled(lambda: plan_epoch(pairs, None, BatchRules(max_tokens=4096), 0, 8), "planning", profile)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=840000, help="sentence pairs over the 4 pairs")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "tokens")
    parser.add_argument("--plan-pairs", type=int, default=10_000_000, help="sentence pairs planned in a fresh process")
    parser.add_argument("--mix-speakers", type=int, default=400, help="speakers of the largest mixed corpus (20 each)")
    parser.add_argument("--mix-rounds", type=int, default=7)
    parser.add_argument("--epoch-rounds", type=int, default=3, help="rounds of the epoch against the tokenizer")
    parser.add_argument(
        "--profile", action="store_true", help="print cProfile's costliest functions of planning and the epoch"
    )
    parser.add_argument("--plan-child", type=int, help=argparse.SUPPRESS)
    args = with_quick(
        parser,
        sentences=20_000,
        plan_pairs=200_000,
        mix_speakers=100,  # the smallest source (500 utterances) still fills more than its windows (~214)
        mix_rounds=1,
        epoch_rounds=1,
        out=ROOT / "bench/out/quick/tokens",
    )
    if args.plan_child:
        planning_child(args.plan_child, args.profile)
        return
    import sentencepiece

    from seqshard import TokenDataset, TokenPair, binarize, make_token_loader, mux

    results: dict = {}
    files = write_corpus(args.out / "text", args.sentences)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(BPE))

    # binarize against the tokenizer alone
    all_lines = {path: path.read_text().splitlines() for paths in files.values() for path in paths}
    tokenizer_seconds = sum(
        timed(lambda lines=lines: processor.encode(lines, out_type=int, num_threads=1))[0]
        for lines in all_lines.values()
    )
    for jobs in (1, 2):
        seconds = 0.0
        for pair, paths in files.items():
            for side, path in zip(("src", "tgt"), paths):
                started = time.perf_counter()
                binarize(path, args.out / f"{pair}.{side}", BPE, jobs=jobs, progress=False)
                seconds += time.perf_counter() - started
        results[f"binarize_jobs{jobs}_over_tokenizer"] = round(tokenizer_seconds / seconds, 2)
        print(f"binarize, {jobs} job(s): {seconds:.2f} s; tokenizer alone {tokenizer_seconds:.2f} s "
              f"-> {tokenizer_seconds / seconds:.2f}x the tokenizer's speed (goal >= 0.5x)")  # fmt: skip
    tokens = sum(TokenDataset(args.out / f"{p}.{s}").num_tokens for p in files for s in ("src", "tgt"))
    results["tokens"] = tokens
    print(f"corpus: {args.sentences} sentence pairs, {tokens / 1e6:.1f} M tokens in 4 pairs")

    # planning 10 M pairs in a fresh process
    child = subprocess.run(
        [sys.executable, __file__, "--plan-child", str(args.plan_pairs), *(["--profile"] if args.profile else [])],
        capture_output=True,
        text=True,
        check=True,
    )
    print(child.stderr, end="", file=sys.stderr)
    planned = json.loads(child.stdout.strip().splitlines()[-1])
    results["plan_pairs"] = args.plan_pairs
    results["plan_seconds"] = round(planned["seconds"], 2)
    results["plan_peak_mb"] = round(planned["peak_mb"])
    results["plan_rss_before_mb"] = round(planned["before_mb"])
    print(f"planning {args.plan_pairs:,} pairs (8 ranks): {planned['seconds']:.2f} s, peak RSS {planned['peak_mb']:.0f} MB, "
          f"{planned['before_mb']:.0f} MB before planning (goals for 10 M: < 3 s, < 500 MB)")  # fmt: skip

    # one epoch over the mix, and the padding of its batches
    mixed = mux([TokenPair(str(args.out / f"{p}.src"), str(args.out / f"{p}.tgt")) for p in files], temperature=5)

    def epoch():  # a fresh loader each time, so that the epoch includes planning it
        loader = make_token_loader(mixed, max_tokens=4096, seed=1)
        return both_clocks(lambda: sum(1 for _ in loader)), loader

    (_, _, batches), loader = epoch()
    stats = loader.stats()
    results["padding_src"] = round(stats["padding_fraction"]["src"], 4)
    results["padding_tgt"] = round(stats["padding_fraction"]["tgt"], 4)
    print(f"padding of max_tokens batches: source {stats['padding_fraction']['src']:.1%}, target "
          f"{stats['padding_fraction']['tgt']:.1%} (goal <= 5%)")  # fmt: skip
    plan = loader.plan()
    text_lines = {pair: ([], []) for pair in files}
    names = list(files)
    for source, index in zip(plan.source[:], plan.index[:]):
        text_lines[names[source]][0].append(index)
    epoch_text = []
    for pair, (indices, _) in text_lines.items():
        src_lines, tgt_lines = all_lines[files[pair][0]], all_lines[files[pair][1]]
        epoch_text += [src_lines[i] for i in indices] + [tgt_lines[i] for i in indices]
    rounds: dict[str, list[float]] = {"iterate": [], "iterate_cpu": [], "tokenize": [], "tokenize_cpu": []}
    for _ in range(args.epoch_rounds):  # interleaved rounds, medians (the machine is shared)
        (wall, cpu, _), _ = epoch()
        rounds["iterate"].append(wall)
        rounds["iterate_cpu"].append(cpu)
        wall, cpu, _ = both_clocks(lambda: processor.encode(epoch_text, out_type=int, num_threads=1))
        rounds["tokenize"].append(wall)
        rounds["tokenize_cpu"].append(cpu)
    median = {name: float(np.median(values)) for name, values in rounds.items()}
    plan_seconds, _ = timed(lambda: loader.batching.plan(0, 1), time.process_time)  # the epoch's planning
    results["iterate_over_tokenize"] = round(median["tokenize"] / median["iterate"], 1)
    results["iterate_over_tokenize_cpu"] = round(median["tokenize_cpu"] / median["iterate_cpu"], 1)
    results.update({f"{name}_seconds": round(value, 2) for name, value in median.items()})
    results["iterate_plan_cpu_seconds"] = round(plan_seconds, 2)
    print(f"one epoch of {batches} batches ({stats['sentences']} pairs), median of {args.epoch_rounds}: "
          f"{median['iterate']:.2f} s ({median['iterate_cpu']:.2f} s CPU, of which planning it {plan_seconds:.2f} s); "
          f"tokenizing the epoch's text: {median['tokenize']:.2f} s ({median['tokenize_cpu']:.2f} s CPU) -> "
          f"{results['iterate_over_tokenize']}x ({results['iterate_over_tokenize_cpu']}x in CPU time) (goal >= 10x)")  # fmt: skip
    if args.profile:
        fresh = make_token_loader(mixed, max_tokens=4096, seed=1)
        profiled(lambda: sum(1 for _ in fresh), "one epoch of token batches (planning it included)", True)

    # mixing overhead in the shard loader
    results.update(mixing_overhead(args.out / "mix", args.mix_speakers, args.mix_rounds))
    (args.out / "tokens.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out / 'tokens.json'}")


def mixing_overhead(root: Path, speakers: int, rounds_count: int) -> dict:
    from seqshard import make_loader, mux, pack_data
    from seqshard.formats.index import ShardIndex

    sources = []
    sizes = {"a": speakers, "b": speakers // 2, "c": speakers // 4}
    for name, count in sizes.items():
        folder = root / name
        if not (folder / "index.json").exists() or ShardIndex.load(folder).num_utts != 20 * count:
            shutil.rmtree(folder, ignore_errors=True)
            scp, text = small_kaldi_dir(root / f"kaldi-{name}", count, 20, dim=8, frames=(5, 40), prefix=name)
            pack_data(scp, text, folder, utts_per_file=500, progress=False)
            shutil.rmtree(root / f"kaldi-{name}")
        sources.append(str(folder))
    corpus = 20 * sum(sizes.values())
    options = dict(batch_size=32, num_workers=0, shuffle_window=1000, sort_window=500)
    plain = make_loader(sources, **options)  # 4 epochs of the three corpora read as one list
    mixed = make_loader(mux(sources, weights=[4, 2, 1]), epoch_steps=4 * corpus // 32, **options)  # as many, mixed
    rounds: dict[str, list[float]] = {"plain": [], "mixed": []}
    for number in range(rounds_count):  # interleaved rounds; medians of CPU time (the machine is shared)

        def four_epochs(number: int = number) -> int:
            count = 0
            for epoch in range(4):
                plain.set_epoch(4 * number + epoch)
                count += sum(len(b["keys"]) for b in plain)
            return count

        seconds, count = timed(four_epochs, time.process_time)
        rounds["plain"].append(seconds / count * 1e6)
        mixed.set_epoch(number)
        seconds, count = timed(lambda: sum(len(b["keys"]) for b in mixed), time.process_time)
        rounds["mixed"].append(seconds / count * 1e6)
    plain_us, mixed_us = np.median(rounds["plain"]), np.median(rounds["mixed"])
    print(f"shard loader per sample: one pattern list {plain_us:.1f} us, mux {mixed_us:.1f} us -> mixing adds "
          f"{(mixed_us / plain_us - 1):+.1%} (goal <= 5%)")  # fmt: skip
    return {"per_sample_us_plain": round(plain_us, 1), "per_sample_us_mux": round(mixed_us, 1),
            "mixing_overhead": round(mixed_us / plain_us - 1, 3)}  # fmt: skip


if __name__ == "__main__":
    main()
