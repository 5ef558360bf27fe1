"""Helpers shared by the benchmarks: a speaker-sorted Kaldi corpus, cache eviction, timing,
memory, and the ``--quick`` smoke mode.

Benchmarks never assert on time: they print ratios against a baseline measured in the same
run, because the machines they run on are shared and noisy.

Memory: a process's own peak is ``VmHWM`` read by the process itself (:func:`vm_kb`; for a
command, :func:`run_measured` runs it under bench/peak.py), never a child's ``ru_maxrss``
(which keeps its parent's pages across ``exec``). A process that maps shards is measured by
its PSS (:func:`pss_kb`): RSS counts every mapped page of the page cache it touched in full.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

FRAME_SHIFT_S = 0.01
HERE = Path(__file__).parent


@dataclass
class Corpus:
    root: Path
    scp: Path
    text: Path
    arks: list[Path]
    num_utts: int
    bytes: int
    hours: float


def code_path(tree: str | Path) -> str:
    """What to put on PYTHONPATH for the seqshard of checkout ``tree``: its ``src/`` (older
    checkouts, before the src layout, hold the package at their root)."""
    source = Path(tree) / "src"
    return str(source if (source / "seqshard").is_dir() else Path(tree))


def utterance_frames(rng, size: int | None = None):
    """Lengths in 10 ms frames as read speech has them: log-normal (median 7 s, sigma 0.55),
    clipped to 1-20 s. One draw, or an array of ``size``."""
    import numpy as np

    return np.clip(rng.lognormal(np.log(700), 0.55, size), 100, 2000).astype(np.int64)


def expected_speakers(utts_per_speaker: list[int]):
    """E[distinct speakers] among b utterances drawn at random (without replacement) from a
    corpus whose speakers have these many utterances, as a function of b."""
    from math import exp, lgamma

    total = sum(utts_per_speaker)

    def expected(b: int) -> float:
        def none_of(n: int) -> float:  # P(none of a speaker's n utterances among the b drawn)
            if total - n < b:
                return 0.0
            return exp(lgamma(total - n + 1) - lgamma(total - n - b + 1) - lgamma(total + 1) + lgamma(total - b + 1))

        return sum(1 - none_of(n) for n in utts_per_speaker)

    return expected


def make_corpus(
    root: Path, target_bytes: int, dim: int = 80, num_arks: int = 8, seed: int = 0, utts_per_speaker: int = 40
) -> Corpus:
    """A Kaldi data dir of float32 features, speaker-sorted like make_fbank.sh output.

    Lengths follow a log-normal spread clipped to 1-20 s (median about 7 s), the shape of
    read-speech corpora. Reuses an existing corpus with the same parameters.
    """
    import kaldiio
    import numpy as np

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
        frames = int(utterance_frames(rng))
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


def small_kaldi_dir(
    root: Path, speakers: int, per_speaker: int, dim: int, frames: tuple[int, int], prefix: str, seed: int = 0
) -> tuple[Path, Path]:
    """A speaker-sorted feats.scp (one ark) and ``text`` of tiny utterances, lengths uniform in
    ``frames``; returns (feats.scp, text)."""
    import kaldiio
    import numpy as np

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    scp, text = root / "feats.scp", root / "text"
    with kaldiio.WriteHelper(f"ark,scp:{root / 'feats.ark'},{scp}") as writer, open(text, "w") as labels:
        for speaker in range(speakers):
            for utt in range(per_speaker):
                key = f"{prefix}{speaker:04d}-utt{utt:03d}"
                length = int(rng.integers(*frames))
                writer(key, (rng.standard_normal((length, dim)) + speaker).astype(np.float32))
                labels.write(f"{key} WORD{speaker % 50} TOKEN{utt % 7}\n")
    return scp, text


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


def run_measured(args: list[str], env: dict | None = None) -> tuple[float, float]:
    """Run ``python ARGS`` (a script or ``-m module``); return (wall seconds, the process's own
    peak RSS in MB, its ``VmHWM`` written by bench/peak.py at exit)."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "peak"
        command = [sys.executable, str(HERE / "peak.py"), str(report), *args]
        start = time.perf_counter()
        status = subprocess.run(command, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL).returncode
        seconds = time.perf_counter() - start
        if status != 0:
            raise SystemExit(f"benchmark step failed ({status}): {' '.join(command)}")
        return seconds, int(report.read_text()) / 1024


def vm_kb(field: str, pid: int | str = "self") -> int:
    """A ``Vm*`` line of ``/proc/PID/status`` in kB (``VmHWM``: peak RSS since ``exec``)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.M).group(1))


def pss_kb(pid: int | str = "self") -> int:
    """Proportional set size in kB: each shared or mapped page divided among the processes
    that map it (the memory a process adds; RSS counts mapped shard pages in full)."""
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    return int(re.search(r"^Pss:\s+(\d+) kB", rollup, re.M).group(1))


def process_tree(pid: int | str = "self") -> list[int]:
    """``pid`` and its descendants (a loader's workers)."""
    pid = os.getpid() if pid == "self" else int(pid)
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            with contextlib.suppress(FileNotFoundError):  # the task ended meanwhile
                queue.extend(int(child) for child in task.read_text().split())
    return found


def tree_pss_kb(pid: int | str = "self") -> int:
    """PSS of ``pid`` and its descendants together (processes that exit meanwhile count 0)."""
    total = 0
    for member in process_tree(pid):
        with contextlib.suppress(FileNotFoundError):  # the process ended meanwhile
            total += pss_kb(member)
    return total


class PeakPss:
    """Samples the PSS of this process and of this process with its workers every
    ``interval`` seconds in a thread (PSS has no kernel high-water mark); ``with`` starts it.
    Reading ``smaps_rollup`` walks the page tables, so timed runs do without it."""

    def __init__(self, interval: float = 0.2):
        self.interval = interval
        self.own_kb = self.tree_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        self.own_kb = max(self.own_kb, pss_kb())
        self.tree_kb = max(self.tree_kb, tree_pss_kb())

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> PeakPss:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def with_quick(parser: argparse.ArgumentParser, **quick) -> argparse.Namespace:
    """Parse the arguments, with ``--quick``: a smoke run at small sizes (``quick``: the
    defaults it changes; options given on the command line still win)."""
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: " + ", ".join(f"{k}={v}" for k, v in quick.items())
    )
    if "--quick" in sys.argv[1:]:
        parser.set_defaults(**quick)
    return parser.parse_args()


def demo_corpus(folder: Path, utts: int, utts_per_file: int = 200) -> tuple[Path, Path]:
    """``seqshard.app.demo``'s made-up corpus of ``utts`` utterances (80-dim features drawn from the
    labels) packed into FOLDER/shards, made again when its size differs; returns (the shards'
    folder, the units file)."""
    import shutil

    from seqshard import pack_data
    from seqshard.app.demo import make_corpus
    from seqshard.formats.index import ShardIndex

    shards, kaldi = folder / "shards", folder / "kaldi"
    if not (shards / "index.json").exists() or ShardIndex.load(shards).num_utts != utts:
        shutil.rmtree(kaldi, ignore_errors=True)
        shutil.rmtree(shards, ignore_errors=True)
        make_corpus(kaldi, utts)
        pack_data(kaldi / "feats.scp", kaldi / "text", shards, utts_per_file=utts_per_file, progress=False)
    return shards, kaldi / "units.txt"


def packed_corpus(work: Path, gb: float, name: str = "loader-shards", utts_per_file: int = 2000) -> tuple[Corpus, Path]:
    """The corpus of ``gb`` GB packed with 2 jobs under WORK/NAME (made once, and made again
    when the corpus or the shard size differs from the pack there; WORK/NAME.json says which)."""
    import shutil

    corpus = make_corpus(work / "corpus", int(gb * 1e9))
    shards, stamp = work / name, work / f"{name}.json"
    made = json.dumps({"utts": corpus.num_utts, "utts_per_file": utts_per_file})
    if not (shards / "index.json").exists() or not stamp.exists() or stamp.read_text() != made:
        shutil.rmtree(shards, ignore_errors=True)
        pack = ["-m", "seqshard", "pack", "--scp", str(corpus.scp), "--text", str(corpus.text), "--out", str(shards)]
        pack += ["--utts-per-file", str(utts_per_file), "--quiet", "--jobs", "2"]
        subprocess.run([sys.executable, *pack], check=True, stdout=subprocess.DEVNULL)
        stamp.write_text(made)
    return corpus, shards


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


SPEECH = HERE.parent / "tests" / "realdata" / "audio"
SPEECH_SOURCES = [
    "librispeech/1995-1837-0001.wav",
    "aishell1/BAC009S0724W0121.wav",
    "ami/ES2011a.Headset-0-40s-46s.wav",
]


def speech_corpus(root: Path, minutes: float, seed: int = 0, rate: int = 16000) -> tuple[Path, Path, float]:
    """wav.scp + text of about ``minutes`` of speech: utterances of 2-15 s cut from the real
    16 kHz speech under tests/realdata/audio, each with its own gain, as 16-bit WAV; returns
    (wav.scp, text, seconds)."""
    import numpy as np
    import soundfile

    root.mkdir(parents=True, exist_ok=True)
    pool = np.concatenate([soundfile.read(SPEECH / name, dtype="int16")[0] for name in SPEECH_SOURCES])
    rng = np.random.default_rng(seed)
    scp, text, total = [], [], 0.0
    number = 0
    while total < minutes * 60:
        length = int(rng.uniform(2, 15) * rate)
        start = int(rng.integers(0, len(pool) - min(length, len(pool) - 1)))
        piece = np.resize(np.roll(pool, -start), length) * rng.uniform(0.3, 1.0)
        key = f"utt{number:06d}"
        soundfile.write(root / f"{key}.wav", piece.astype(np.int16), rate, subtype="PCM_16")
        scp.append(f"{key} {root / f'{key}.wav'}\n")
        text.append(f"{key} WORDS OF UTTERANCE {number}\n")
        total += length / rate
        number += 1
    (root / "wav.scp").write_text("".join(scp))
    (root / "text").write_text("".join(text))
    return root / "wav.scp", root / "text", total


RESULTS: dict[str, bool] = {}  # a check script's checks: name -> passed


def check(name: str, passed: bool, detail: str) -> None:
    """One PASS/FAIL line of a check script (bench/selfcheck.py, bench/device_check.py)."""
    RESULTS[name] = bool(passed)
    print(f"{'PASS' if passed else 'FAIL'}  {name:16s} {detail}", flush=True)


def info(name: str, detail: str) -> None:
    print(f"INFO  {name:16s} {detail}", flush=True)


def run_checks(parts, began: float) -> None:
    """Each ``(name, run)`` of ``parts`` (a crash fails its check, and the others still run),
    then the summary line; exits 1 when any check failed."""
    for name, run in parts:
        try:
            run()
        except Exception as error:
            check(name, False, f"raised {type(error).__name__}: {error}")
    failed = [name for name, ok in RESULTS.items() if not ok]
    print(f"{'FAIL' if failed else 'PASS'}  all: {len(RESULTS) - len(failed)}/{len(RESULTS)} passed in "
          f"{time.perf_counter() - began:.0f} s{': failed ' + ', '.join(failed) if failed else ''}")  # fmt: skip
    sys.exit(1 if failed else 0)
