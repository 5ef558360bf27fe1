"""Audio end to end: fbank on the fly in the loader, fbank at pack time, and the size of audio
shards, each against a baseline measured in the same run.

    python bench/audio.py [--minutes 90] [--out bench/out/audio] [--quick]

The corpus: utterances of 2-15 s cut from the real 16 kHz speech under tests/realdata/audio
(LibriSpeech, AISHELL-1, AMI), each with its own gain, written as 16-bit WAV + wav.scp + text.

    baseline   kaldi-native-fbank's OnlineFbank fed each utterance, every frame fetched with
               get_frame in a bare Python loop: one core, no IO.
    loader     make_loader over the FLAC shards (and original-WAV shards) with
               features="fbank" (80 bins), and as waveforms, workers 0 and 2, one epoch timed after a warm-up epoch (page cache warm); the per-core
               figure divides by the cores used (workers, or 1 for workers=0).
    pack       seqshard pack --features fbank with 1 and 2 jobs (wall clock).
    size       bytes per hour of audio: FLAC shards, original-bytes shards, float32 fbank shards.

Prints real-time factors (seconds of audio per second) and the ratios; writes OUT/audio.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # figures per core; workers bring their own cores

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import soundfile

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).parent))
from common import speech_corpus as make_corpus
from common import with_quick
from fbank import knf_frames  # bench/fbank.py: the same bare-loop baseline

from seqshard import make_loader, pack_data

UTTS_PER_FILE = 25  # several shards, so that jobs have shards to share


def knf_loop(wav_scp: Path) -> float:
    """Seconds for the bare kaldi-native-fbank loop over every utterance (decoding not timed)."""
    waves = [soundfile.read(line.split()[1], dtype="float32")[0] * 32768 for line in wav_scp.read_text().splitlines()]
    started = time.perf_counter()
    for wave in waves:
        knf_frames(wave)
    return time.perf_counter() - started


def loader_epoch(shards: Path, workers: int, **options) -> tuple[float, int]:
    """Seconds of the second of two epochs, and frames (or samples) it gave."""
    loader = make_loader(shards, batch_size=16, num_workers=workers, persistent_workers=workers > 0, **options)
    seconds = count = 0
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        started = time.perf_counter()
        count = sum(int(b.get("feat_lens", b.get("audio_lens")).sum()) for b in loader)
        seconds = time.perf_counter() - started
    return seconds, count


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.tar"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=90.0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "audio")
    args = with_quick(parser, minutes=3.0, out=Path(__file__).parent / "out" / "quick" / "audio")
    wav_scp, text, seconds = make_corpus(args.out / "corpus", args.minutes)
    hours = seconds / 3600
    results: dict = {"audio_seconds": round(seconds, 1), "cores": os.cpu_count()}
    print(f"corpus: {seconds / 60:.1f} min of 16 kHz speech, {len(wav_scp.read_text().splitlines())} utterances")

    baseline = knf_loop(wav_scp)
    results["knf_loop_rtf"] = round(seconds / baseline)
    print(f"baseline  knf OnlineFbank get_frame loop, 1 core: {baseline:6.2f} s   RTF {seconds / baseline:6.0f}x")

    shards = {}
    for name, options in {"flac": {}, "keep": {"audio_format": "keep"}}.items():
        shards[name] = args.out / f"shards-{name}"
        shutil.rmtree(shards[name], ignore_errors=True)
        pack_data(None, text, shards[name], wav_scp=wav_scp, utts_per_file=UTTS_PER_FILE, progress=False, **options)
    for jobs in (1, 2):
        out = args.out / f"shards-fbank-{jobs}"
        shutil.rmtree(out, ignore_errors=True)
        started = time.perf_counter()
        pack_data(
            None, text, out, wav_scp=wav_scp, features="fbank", jobs=jobs, utts_per_file=UTTS_PER_FILE, progress=False
        )
        wall = time.perf_counter() - started
        results[f"pack_fbank_jobs{jobs}_rtf"] = round(seconds / wall)
        print(
            f"pack --features fbank, {jobs} job(s):             {wall:6.2f} s   RTF {seconds / wall:6.0f}x"
            f"   = {baseline / wall:.2f}x the baseline"
        )
        shards["fbank"] = out

    for workers in (0, 2):
        for label, stored, options in (
            ("fbank-80", "flac", {"features": "fbank"}),
            ("fbank-80", "keep", {"features": "fbank"}),
            ("waveform", "flac", {}),
        ):
            wall, _ = loader_epoch(shards[stored], workers, **options)
            cores = max(workers, 1)
            rtf = seconds / wall
            results[f"loader_{label}_{stored}_w{workers}_rtf"] = round(rtf)
            results[f"loader_{label}_{stored}_w{workers}_rtf_per_core"] = round(rtf / cores)
            print(
                f"loader {label:8s} from {stored:4s}, workers={workers}:     {wall:6.2f} s   RTF {rtf:6.0f}x"
                f" ({rtf / cores:5.0f}x per core = {baseline / wall / cores:.2f}x the baseline per core)"
            )

    for name, folder in shards.items():
        per_hour = folder_bytes(folder) / hours
        results[f"{name}_bytes_per_hour"] = round(per_hour)
        print(f"shards {name:5s}: {per_hour / 1e6:8.1f} MB per hour")
    ratio = results["fbank_bytes_per_hour"] / results["flac_bytes_per_hour"]
    results["fbank_over_flac_bytes"] = round(ratio, 2)
    print(f"float32 fbank-80 shards are {ratio:.1f}x the size of FLAC shards of the same audio")
    (args.out / "audio.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out / 'audio.json'}")


if __name__ == "__main__":
    main()
