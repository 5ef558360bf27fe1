"""Shared helpers: tiny Kaldi data dirs written with kaldiio inside each test."""

from __future__ import annotations

import os

# One math thread per process: `pytest -n 2` runs two test processes, each starting workers and
# ranks of their own, on machines of a few cores; torch's default of one thread per core made
# them take turns (set before anything imports torch, so that subprocesses inherit it too).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import contextlib
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import kaldiio
import numpy as np
import pytest

from seqshard.testing import assert_resumes_everywhere  # noqa: F401 (shared with the tests)

REALDATA = Path(__file__).parent / "realdata"

_RECORDERS: list[list[str]] = []  # the lists of files_opened() now recording
_HOOKED: list[bool] = []  # whether the audit hook is installed in this process


def _record_open(event: str, args: tuple) -> None:
    if event == "open" and _RECORDERS and isinstance(args[0], (str, bytes, os.PathLike)):
        for opened in _RECORDERS:
            opened.append(os.fsdecode(args[0]))


@contextlib.contextmanager
def files_opened() -> Iterator[list[str]]:
    """The paths this process opens in the ``with`` block (Python's audit event ``open``: every
    ``open()``, ``os.open()``, ``io.open_code()``), in order."""
    if not _HOOKED:  # once, in a test process that needs it: a hook stays for the process's life
        sys.addaudithook(_record_open)
        _HOOKED.append(True)
    opened: list[str] = []
    _RECORDERS.append(opened)
    try:
        yield opened
    finally:
        _RECORDERS.remove(opened)


@dataclass
class KaldiDir:
    """A data dir made by :func:`write_kaldi_dir`; ``arrays`` are what kaldiio reads back."""

    root: Path
    scp: Path
    text: Path
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    speaker_of: dict[str, int] = field(default_factory=dict)

    @property
    def keys(self) -> list[str]:
        return list(self.arrays)


def write_kaldi_dir(
    root: Path,
    speakers: int = 6,
    per_speaker: int = 8,
    dim: int = 8,
    frames: tuple[int, int] = (5, 60),
    compression_method: int | None = None,
    seed: int = 0,
    arks: int = 2,
    prefix: str = "spk",
) -> KaldiDir:
    """A speaker-sorted feats.scp over ``arks`` arks plus a ``text`` file, like make_fbank.sh."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    data = KaldiDir(root, root / "feats.scp", root / "text")
    items = []
    for speaker in range(speakers):
        for utt in range(per_speaker):
            key = f"{prefix}{speaker:03d}-utt{utt:03d}"
            length = int(rng.integers(frames[0], frames[1]))
            items.append((key, speaker, (rng.standard_normal((length, dim)) * 3 + speaker).astype(np.float32)))
    per_ark = -(-len(items) // arks)
    scp_lines = []
    for ark_index in range(arks):
        chunk = items[ark_index * per_ark : (ark_index + 1) * per_ark]
        ark = root / f"raw_feats.{ark_index + 1}.ark"
        part_scp = root / f"raw_feats.{ark_index + 1}.scp"
        with kaldiio.WriteHelper(f"ark,scp:{ark},{part_scp}", compression_method=compression_method) as writer:
            for key, _, array in chunk:
                writer(key, array)
        scp_lines.append(part_scp.read_text())
    data.scp.write_text("".join(scp_lines))
    with open(data.text, "w", encoding="utf-8") as stream:
        for key, speaker, _ in items:
            label = f"word{speaker} token{len(key) % 5} {key.upper()}"
            stream.write(f"{key} {label}\n")
            data.labels[key] = label
            data.speaker_of[key] = speaker
    for key, array in kaldiio.load_scp_sequential(str(data.scp)):
        data.arrays[key] = np.asarray(array)
    return data


@pytest.fixture
def kaldi_dir(tmp_path: Path) -> KaldiDir:
    return write_kaldi_dir(tmp_path / "data")


def read_shards(paths) -> dict[str, tuple[np.ndarray, str, str]]:
    """key -> (features, label, shard name) for every sample of the given shards."""
    from seqshard.formats.npy import decode_npy
    from seqshard.formats.tar import SampleStream

    found: dict[str, tuple[np.ndarray, str, str]] = {}
    for path in paths:
        with SampleStream(path) as stream:
            for sample in stream:
                assert sample.key not in found, f"{sample.key} in two shards"
                found[sample.key] = (
                    decode_npy(sample.fields["feats.npy"]),
                    str(sample.fields["txt"], "utf-8"),
                    Path(path).name,
                )
    return found


@dataclass
class Packed:
    data: KaldiDir
    out: Path

    @property
    def pattern(self) -> str:
        return f"{self.out}/data-*.tar"


def pack_small(root: Path, utts_per_file: int = 10, **kaldi_kwargs) -> Packed:
    from seqshard import pack_data

    data = write_kaldi_dir(root / "kaldi", **kaldi_kwargs)
    pack_data(data.scp, data.text, root / "shards", utts_per_file=utts_per_file, progress=False)
    return Packed(data, root / "shards")


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Packed:
    """6 speakers x 8 utterances in 5 shards of 10 (the last holds 8)."""
    return pack_small(tmp_path_factory.mktemp("packed"))


@dataclass
class AudioDir:
    """A data dir made by :func:`write_audio_dir`: ``wav.scp`` + ``text`` over WAV files
    written with soundfile; ``audio`` is each utterance's int16 samples."""

    root: Path
    wav_scp: Path
    text: Path
    rate: int
    audio: dict[str, np.ndarray] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def keys(self) -> list[str]:
        return list(self.audio)


def write_audio_dir(
    root: Path, utts: int = 12, rate: int = 16000, seconds: tuple[float, float] = (0.3, 2.0), seed: int = 0
) -> AudioDir:
    """Tones with a little noise, of random lengths, as 16-bit WAV files named by ``wav.scp``."""
    import soundfile

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    data = AudioDir(root, root / "wav.scp", root / "text", rate)
    scp, text = [], []
    for number in range(utts):
        key = f"utt{number:03d}"
        length = int(rng.uniform(*seconds) * rate)
        t = np.arange(length) / rate
        wave = 0.3 * np.sin(2 * np.pi * (200 + 37 * number) * t) + 0.02 * rng.standard_normal(length)
        samples = np.round(wave * 32767).astype(np.int16)
        soundfile.write(root / f"{key}.wav", samples, rate, subtype="PCM_16")
        data.audio[key] = samples
        data.labels[key] = f"word{number % 3} tone {number}"
        scp.append(f"{key} {root / f'{key}.wav'}\n")
        text.append(f"{key} {data.labels[key]}\n")
    data.wav_scp.write_text("".join(scp))
    data.text.write_text("".join(text))
    return data


def read_audio_shards(paths) -> dict[str, tuple[np.ndarray, int, str, str]]:
    """key -> (int16 samples, sample rate, member suffix, label) for every sample."""
    import io

    import soundfile

    from seqshard.formats.tar import SampleStream

    found: dict[str, tuple[np.ndarray, int, str, str]] = {}
    for path in paths:
        with SampleStream(path) as stream:
            for sample in stream:
                assert sample.key not in found, f"{sample.key} in two shards"
                suffix = next(s for s in sample.fields if s in ("wav", "flac"))
                samples, rate = soundfile.read(io.BytesIO(bytes(sample.fields[suffix])), dtype="int16")
                found[sample.key] = (samples, rate, suffix, str(sample.fields["txt"], "utf-8"))
    return found


def pytest_collection_modifyitems(config, items):
    """Slow end-to-end tests first: with `pytest -n 2` they start at once and the quick tests
    fill the other process, instead of one long test running alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With `pytest -n N`, xdist's "load" hands each process a first quarter of its share in a
    row: every slow test (sorted first) went to one process, which ends last once they are near
    half of the suite's time. Work stealing instead: an idle process takes half of what another
    has left. An explicit `--dist` (or `-d`) is kept."""
    given = [
        *config.invocation_params.args,
        *shlex.split(os.environ.get("PYTEST_ADDOPTS", "")),
        *config.getini("addopts"),
    ]
    if config.getvalue("dist") != "load" or any(a.startswith("--dist") or a == "-d" for a in given):
        return None
    from xdist.scheduler import WorkStealingScheduling

    return WorkStealingScheduling(config, log)
