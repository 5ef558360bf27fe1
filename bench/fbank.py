"""Real-time factor of seqshard's vectorized fbank against kaldi-native-fbank, one core.

    python bench/fbank.py [--seconds 60] [--out bench/out/fbank.json] [--quick] [WAV ...]

About a minute of 16 kHz speech: the 16-bit wavs given (default: the LibriSpeech and AISHELL
wavs under tests/realdata/audio), concatenated and repeated; synthetic speech-like audio when
none is there. Kaldi's fbank config (80 bins, dither 0). Timed with perf_counter, best of 5
after a warm-up, every library limited to one thread:

    (a) seqshard.features.fbank over the whole waveform;
    (b) kaldi-native-fbank's OnlineFbank: accept_waveform once, then get_frame for every frame
        in a Python loop (its only way out of frames);
    (c) kaldi-native-fbank's compute alone: accept_waveform + input_finished, no frame fetched.
        knf has no bulk getter, so this bounds from above what any bulk API could reach; fed a
        float32 array as documented, and a ready-made Python list (conversion not timed).

Prints RTF (seconds of audio per second of compute) and (a) / (b), and writes them to OUT.
Needs kaldi-native-fbank.
"""

from __future__ import annotations

import os

# Before numpy loads: one thread for BLAS and OpenMP, so that the figures are per core.
os.environ["OMP_NUM_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"

import argparse
import json
import sys
import time
import wave
from pathlib import Path

import kaldi_native_fbank as knf
import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).parent))
from common import with_quick

from seqshard.features.fbank import FbankOptions, fbank

RATE = 16000
AUDIO = Path(__file__).parent.parent / "tests" / "realdata" / "audio"
DEFAULT_WAVS = [AUDIO / "librispeech" / "1995-1837-0001.wav", AUDIO / "aishell1" / "BAC009S0724W0121.wav"]
OPTIONS = FbankOptions(sample_rate=RATE, num_mel_bins=80, dither=0.0)


def read_wav(path: Path) -> np.ndarray:
    """A mono 16 kHz 16-bit wav as int16 samples."""
    with wave.open(str(path)) as f:
        if (f.getsampwidth(), f.getnchannels(), f.getframerate()) != (2, 1, RATE):
            raise SystemExit(f"{path}: need mono 16-bit {RATE} Hz")
        return np.frombuffer(f.readframes(f.getnframes()), dtype="<i2")


def speech_like(seconds: float, seed: int = 0) -> np.ndarray:
    """Syllable-rate bursts of a harmonic voice with a gliding pitch, over quiet noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    pitch = 120 + 30 * np.sin(2 * np.pi * 0.5 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / RATE
    voice = sum(np.sin(k * phase) / k for k in range(1, 20))
    envelope = np.clip(np.sin(2 * np.pi * 4 * t), 0, None)
    return np.clip(3000 * envelope * voice + rng.normal(0, 50, t.size), -32768, 32767).astype(np.int16)


def audio(paths: list[Path], seconds: float) -> tuple[np.ndarray, str]:
    """``seconds`` of int16 audio and where it came from."""
    found = [p for p in paths if p.exists()]
    if not found:
        return speech_like(seconds), "synthetic speech-like audio"
    joined = np.concatenate([read_wav(p) for p in found])
    repeats = -(-int(seconds * RATE) // len(joined))
    return np.tile(joined, repeats)[: int(seconds * RATE)], ", ".join(p.name for p in found) + " (repeated)"


def best_of(fn, rounds: int = 5) -> float:
    """Fastest of ``rounds`` timed calls, after one untimed warm-up."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def knf_options() -> knf.FbankOptions:
    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0.0
    opts.mel_opts.num_bins = OPTIONS.num_mel_bins
    return opts


def knf_frames(samples: np.ndarray) -> np.ndarray:
    """(b): the whole waveform in, then every frame out through get_frame."""
    computer = knf.OnlineFbank(knf_options())
    computer.accept_waveform(RATE, samples)
    computer.input_finished()
    return np.stack([computer.get_frame(i) for i in range(computer.num_frames_ready)])


def knf_compute(samples) -> int:
    """(c): the whole waveform in; frames computed but not fetched."""
    computer = knf.OnlineFbank(knf_options())
    computer.accept_waveform(RATE, samples)
    computer.input_finished()
    return computer.num_frames_ready


def fft_precisions(samples: np.ndarray) -> str:
    """numpy's rfft over a (frames, 512) matrix in float64 and in float32, the main cost."""
    frames = np.lib.stride_tricks.sliding_window_view(samples.astype(np.float64), 400)[::160]
    frames64 = np.array(frames)
    frames32 = frames64.astype(np.float32)
    t64 = best_of(lambda: np.fft.rfft(frames64, n=512))
    t32 = best_of(lambda: np.fft.rfft(frames32, n=512))
    return f"numpy rfft of all {len(frames64)} frames: float64 {t64 * 1e3:.1f} ms, float32 {t32 * 1e3:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wavs", nargs="*", type=Path, default=DEFAULT_WAVS)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "fbank.json")
    args = with_quick(parser, seconds=5.0, out=Path(__file__).parent / "out" / "quick" / "fbank.json")
    samples, source = audio(args.wavs, args.seconds)
    floats = samples.astype(np.float32)
    as_list = floats.tolist()
    duration = len(samples) / RATE
    print(f"{duration:.1f} s of {source}; numpy {np.__version__}, knf {knf.__version__}, one thread")

    mismatch = np.abs(fbank(samples, OPTIONS) - knf_frames(floats)).max()
    timings = {
        "(a) seqshard fbank, vectorized": best_of(lambda: fbank(samples, OPTIONS)),
        "(b) knf OnlineFbank, get_frame loop": best_of(lambda: knf_frames(floats)),
        "(c) knf compute only, float32 array in": best_of(lambda: knf_compute(floats)),
        "(c) knf compute only, Python list in": best_of(lambda: knf_compute(as_list)),
    }
    for name, seconds in timings.items():
        print(f"{name:42s} {seconds * 1e3:8.1f} ms   RTF {duration / seconds:7.0f}x real time")
    ratio = timings["(b) knf OnlineFbank, get_frame loop"] / timings["(a) seqshard fbank, vectorized"]
    print(f"(a) / (b) speed: {ratio:.2f}x   (goals: (a) >= 1000x real time, >= 3x (b))")
    print(f"max |(a) - (b)| = {mismatch:.2e}")
    print(fft_precisions(samples))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = {
        "audio_seconds": round(duration, 1),
        "ms": {name: round(seconds * 1e3, 2) for name, seconds in timings.items()},
        "rtf": {name: round(duration / seconds) for name, seconds in timings.items()},
        "seqshard_over_knf_loop": round(ratio, 2),
        "max_abs_difference": float(mismatch),
    }
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
