"""``seqshard demo``: the whole path on a small made-up corpus, saying what happened.

1. writes a Kaldi data dir the way ``make_fbank.sh`` leaves one: speaker-sorted ``feats.scp``
   over several compressed arks, ``text``, ``utt2num_frames``;
2. packs it into two length groups of globally shuffled shards;
3. inspects and verifies the shards;
4. streams one epoch through 2 worker processes with dynamic batches and on-the-fly
   tokenization, and checks every utterance came exactly once;
5. stops half way, saves the loader state, resumes in a new loader, and checks the batches
   are those of the uninterrupted run;
6. writes a hyper-p.json and trains the example CTC model (seqshard.app.trainer) from the shards
   with 2 processes (torchrun, gloo on CPU), printing loss, throughput and data-wait;
7. says where everything is and what to run next.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

WORDS = [
    "the",
    "a",
    "of",
    "speech",
    "data",
    "shard",
    "stream",
    "batch",
    "epoch",
    "model",
    "train",
    "sound",
    "word",
    "voice",
    "loud",
    "quiet",
]


def make_corpus(root: Path, num_utts: int, seed: int = 0) -> dict[str, int]:
    """A speaker-sorted 80-dim fbank-like corpus whose features are drawn from its labels
    (each character a fixed pattern held for 4-14 frames, plus a speaker offset and noise),
    so a model can learn it; returns the speaker of each key."""
    import kaldiio

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    patterns = np.random.default_rng(1234).standard_normal((128, 80)).astype(np.float32)  # the same in every corpus
    speakers = max(1, num_utts // 30)
    speaker_of: dict[str, int] = {}
    scp_parts, text_lines, frames_lines = [], [], []
    arks = 4
    per_ark = -(-num_utts // arks)
    for ark in range(arks):
        with kaldiio.WriteHelper(
            f"ark,scp:{root}/raw_fbank.{ark + 1}.ark,{root}/raw_fbank.{ark + 1}.scp", compression_method=2
        ) as writer:
            for utt in range(ark * per_ark, min(num_utts, (ark + 1) * per_ark)):
                speaker = utt * speakers // num_utts
                key = f"spk{speaker:03d}-utt{utt:05d}"
                text = " ".join(rng.choice(WORDS, size=int(rng.integers(2, 12))))
                durations = rng.integers(4, 15, size=len(text))
                feats = np.repeat(patterns[[ord(ch) % 128 for ch in text]], durations, axis=0)
                voice = 0.3 * rng.standard_normal(80).astype(np.float32)
                writer(key, feats + voice + 8 + 0.5 * rng.standard_normal(feats.shape).astype(np.float32))
                speaker_of[key] = speaker
                text_lines.append(f"{key} {text}\n")
                frames_lines.append(f"{key} {len(feats)}\n")
        scp_parts.append((root / f"raw_fbank.{ark + 1}.scp").read_text())
    (root / "feats.scp").write_text("".join(scp_parts))
    (root / "text").write_text("".join(text_lines))
    (root / "utt2num_frames").write_text("".join(frames_lines))
    characters = sorted({ch for line in text_lines for ch in line.split(" ", 1)[1].strip()})
    units = ["<blank> 0", "<unk> 1"] + [f"{'▁' if ch == ' ' else ch} {i + 2}" for i, ch in enumerate(characters)]
    (root / "units.txt").write_text("\n".join(units) + "\n")
    return speaker_of


TRAIN_OPTION = {  # learns the made-up corpus in about a minute on 2 CPU cores
    "batch_frames": 8000,
    "num_workers": 1,
    "hidden": 256,
    "layers": 1,
    "lr": 0.003,
    "warmup_steps": 10,
    "log_every": 20,
    "save_every": 100,
}


def run_demo(
    out: str | Path, num_utts: int = 1200, num_workers: int = 2, train_epochs: int = 6, train_ranks: int = 2
) -> None:
    from .. import make_loader, pack_data
    from ..tools.inspect import format_text, summarize, to_json
    from ..tools.verify import format_result, verify

    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    print(f"== 1. a Kaldi data dir of {num_utts} utterances (speaker-sorted, compressed arks) in {out}/kaldi")
    speaker_of = make_corpus(out / "kaldi", num_utts)

    print("\n== 2. pack: two length groups, globally shuffled, 2 jobs")
    report = pack_data(
        out / "kaldi/feats.scp",
        out / "kaldi/text",
        out / "shards",
        filter_group=["0:400", "400:2000"],
        utts_per_file=200,
        jobs=2,
        progress=False,
    )
    print(report.format_text())

    pattern = f"{out}/shards/{{0_400,400_2000}}/data-*.tar"
    print(f"\n== 3. inspect and verify {pattern}")
    print(format_text(to_json(summarize(pattern, progress=False))))
    print(format_result(verify(pattern, progress=False)))

    print(
        f"\n== 4. stream one epoch: {num_workers} worker processes, dynamic batches of <= 20000 padded frames, chars tokenized on the fly"
    )
    options = dict(tokenizer=out / "kaldi/units.txt", batch_frames=20000, num_workers=num_workers, seed=0)
    loader = make_loader(pattern, **options)
    loader.set_epoch(0)
    batches = [(b["keys"], tuple(b["feats"].shape), b["labels"].shape[1]) for b in loader]
    keys = [k for batch, _, _ in batches for k in batch]
    stats = loader.stats()
    speakers = np.mean([len({speaker_of[k] for k in batch}) for batch, _, _ in batches])
    print(
        f"{len(batches)} batches, {len(keys)} utterances ({len(set(keys))} distinct of {report.packed} packed), {stats['utts_per_second']:.0f} utts/s"
    )
    print(f"first batches (feats B x T x D, label length): {[shape + (labels,) for _, shape, labels in batches[:4]]}")
    plot = _plot(pattern, out / "lengths.png")
    print(
        f"padding {stats['padding_fraction']:.1%} of batch frames; {speakers:.1f} distinct speakers per batch on average"
    )

    print("\n== 5. stop half way, save the loader state, resume in a new loader")
    half = len(batches) // 2
    interrupted = make_loader(pattern, **options)
    interrupted.set_epoch(0)
    iterator = iter(interrupted)
    head = [next(iterator)["keys"] for _ in range(half)]
    state = json.dumps(interrupted.state_dict())
    del iterator
    resumed = make_loader(pattern, **options)
    resumed.load_state_dict(json.loads(state))
    resumed.set_epoch(0)
    rest = [b["keys"] for b in resumed]
    same = head + rest == [batch for batch, _, _ in batches]
    print(
        f"saved after {half} batches ({len(state)} bytes of JSON); resumed run gave {len(rest)} more batches, identical to the uninterrupted run: {same}"
    )

    trained = True
    if train_epochs > 0:
        print(
            f"\n== 6. train the example CTC model from the shards: {train_ranks} processes (torchrun), {train_epochs} epochs"
        )
        trained = _train(out, pattern, train_epochs, train_ranks)

    ok = report.complete and sorted(keys) == sorted(speaker_of) and same and trained
    print(f"\ndemo {'OK' if ok else 'FAILED'} in {time.perf_counter() - started:.1f} s")
    print(where_next(out, pattern, plot, train_epochs))
    if not ok:
        raise SystemExit(1)


def where_next(out: Path, pattern: str, plot: Path | None, train_epochs: int) -> str:
    """The demo's last words: where its outputs are and the commands to run next, as they run
    from an installed package (the trainer is the module ``seqshard.app.trainer``)."""
    lines = [
        "\n== 7. where things are",
        f"  {out}/kaldi           the Kaldi data dir (feats.scp, text, units.txt)",
        f"  {out}/shards          the shards, index.json and pack_report.json per length group",
    ]
    if plot:
        lines.append(f"  {out}/{plot.name:16s}utterance lengths")
    if train_epochs > 0:
        lines.append(f"  {out}/dev             the dev set (a Kaldi data dir)")
        lines.append(f"  {out}/hyper-p.json    the training config;  {out}/train: checkpoint (ckpt.pt)")
    lines += ["next:", f"  seqshard inspect '{pattern}'"]
    if train_epochs > 0:
        lines += [
            f"  seqshard config --explain {out}/hyper-p.json",
            f"  torchrun --nproc_per_node 2 -m seqshard.app.trainer --config {out}/hyper-p.json --out {out}/train "
            f"--set epochs={train_epochs + 4}   (goes on from the checkpoint; in a clone of the repository, "
            "examples/train_ddp.py runs the same trainer)",
        ]
    lines.append(
        "  your data: seqshard pack --scp data/train/feats.scp --text data/train/text --out data/shards --jobs 8"
    )
    return "\n".join(lines)


def _plot(pattern: str, path: Path) -> Path | None:
    """The length histogram of the shards, when matplotlib is installed."""
    from ..tools.inspect import plot_lengths, summarize, to_json

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("(length plot skipped: pip install 'seqshard[plot]' for it)")
        return None
    plot_lengths(to_json(summarize(pattern, progress=False)), path)
    print(f"length histogram written to {path}")
    return path


def corpus_option(folder: Path, trset: str) -> dict[str, Any]:
    """train.option's data keys for the shards ``trset`` of the made-up corpus in ``folder``
    (its ``kaldi/`` and ``dev/`` data dirs)."""
    dev, units = folder / "dev", folder / "kaldi/units.txt"
    return {"large_dataset": True, "trset": trset, "devset": str(dev), "tokenizer": str(units)}


def _train(out: Path, pattern: str, epochs: int, ranks: int) -> bool:
    """Write hyper-p.json and run seqshard.app.trainer under torchrun; True when it finished."""
    import os
    import subprocess
    import sys

    make_corpus(out / "dev", 60, seed=1)
    option = {**corpus_option(out, pattern), "epochs": epochs, **TRAIN_OPTION}
    config = out / "hyper-p.json"
    config.write_text(json.dumps({"train": {"bin": "seqshard.app.trainer", "option": option}}, indent=2) + "\n")
    print(f"config: {config} (train.option: large_dataset, trset, devset, tokenizer, loader and trainer keys)")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    command += ["-m", "seqshard.app.trainer", "--config", str(config), "--out", str(out / "train")]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    finished = False
    with subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as run:
        assert run.stdout is not None
        for line in run.stdout:  # shown as it comes (torchrun's own notices left out)
            if not line.startswith(("W1", "I1", "*****")):
                print("  " + line.rstrip(), flush=True)
                finished = finished or line.startswith("finished:")
    finished = finished and run.returncode == 0
    print(f"trained in {time.perf_counter() - started:.1f} s" if finished else f"training FAILED ({run.returncode})")
    return finished
