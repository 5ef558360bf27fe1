"""Helpers shared by the benchmarks: a speaker-sorted Kaldi corpus, cache eviction, timing.

Benchmarks never assert on time: they print ratios against a baseline measured in the same
run, because the machines they run on are shared and noisy.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FRAME_SHIFT_S = 0.01


@dataclass
class Corpus:
    root: Path
    scp: Path
    text: Path
    arks: list[Path]
    num_utts: int
    bytes: int
    hours: float


def make_corpus(
    root: Path, target_bytes: int, dim: int = 80, num_arks: int = 8, seed: int = 0, utts_per_speaker: int = 40
) -> Corpus:
    """A Kaldi data dir of float32 features, speaker-sorted like make_fbank.sh output.

    Lengths follow a log-normal spread clipped to 1-20 s (median about 7 s), the shape of
    read-speech corpora. Reuses an existing corpus with the same parameters.
    """
    import kaldiio

    root.mkdir(parents=True, exist_ok=True)
    params = {
        "target_bytes": target_bytes,
        "dim": dim,
        "num_arks": num_arks,
        "seed": seed,
        "utts_per_speaker": utts_per_speaker,
    }
    done = root / "corpus.json"
    if done.exists() and json.loads(done.read_text())["params"] == params:
        return _corpus_from(root, json.loads(done.read_text()))
    rng = np.random.default_rng(seed)
    bytes_per_frame = dim * 4
    lengths = []
    total = 0
    while total < target_bytes:
        frames = int(np.clip(rng.lognormal(np.log(700), 0.55), 100, 2000))
        lengths.append(frames)
        total += frames * bytes_per_frame
    per_ark = -(-len(lengths) // num_arks)
    scp_lines, text_lines, arks = [], [], []
    for ark_index in range(num_arks):
        ark = root / f"raw_fbank.{ark_index + 1}.ark"
        part_scp = root / f"raw_fbank.{ark_index + 1}.scp"
        arks.append(ark)
        with kaldiio.WriteHelper(f"ark,scp:{ark},{part_scp}") as writer:
            for utt in range(ark_index * per_ark, min(len(lengths), (ark_index + 1) * per_ark)):
                speaker = utt // utts_per_speaker
                key = f"spk{speaker:05d}-utt{utt:07d}"
                base = rng.standard_normal(dim).astype(np.float32) * 2 + 10
                writer(key, base + rng.standard_normal((lengths[utt], dim), dtype=np.float32))
                text_lines.append(f"{key} SPEAKER {speaker} SAYS WORD {utt % 97} AND WORD {utt % 89}\n")
        scp_lines.append(part_scp.read_text())
    (root / "feats.scp").write_text("".join(scp_lines))
    (root / "text").write_text("".join(text_lines))
    (root / "utt2num_frames").write_text("".join(f"{line.split()[0]} {n}\n" for line, n in zip(text_lines, lengths)))
    info = {
        "params": params,
        "num_utts": len(lengths),
        "bytes": sum(a.stat().st_size for a in arks),
        "frames": int(sum(lengths)),
        "arks": [a.name for a in arks],
    }
    done.write_text(json.dumps(info))
    return _corpus_from(root, info)


def _corpus_from(root: Path, info: dict) -> Corpus:
    return Corpus(
        root,
        root / "feats.scp",
        root / "text",
        [root / a for a in info["arks"]],
        info["num_utts"],
        info["bytes"],
        info["frames"] * FRAME_SHIFT_S / 3600,
    )


def evict(paths) -> None:
    """Drop files from the page cache (after flushing them) so the next read hits the disk."""
    for path in paths:
        path = Path(path)
        files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
        for file in files:
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def fsync_tree(path: Path) -> None:
    for file in [p for p in Path(path).rglob("*") if p.is_file()]:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def run_measured(command: list[str], env: dict | None = None) -> tuple[float, float]:
    """Run a command; return (wall seconds, peak RSS in MB of the process itself)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"benchmark step failed ({status}): {' '.join(command)}")
    return seconds, usage.ru_maxrss / 1024


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
