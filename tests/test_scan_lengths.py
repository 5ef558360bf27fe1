"""`seqshard index`/`inspect` measure every sample of a foreign shard, whatever its audio format:
a shard mixing WAV and FLAC members was counted from its WAV samples alone (its hours, splits
and length buckets wrong, without a word)."""

from __future__ import annotations

import io

import numpy as np
import soundfile

from seqshard.formats.tar import ShardWriter
from seqshard.tools.scan import scan_shard


def audio(seconds: int, fmt: str) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(16000 * seconds, dtype=np.int16), 16000, format=fmt)
    return buffer.getvalue()


def test_every_sample_is_measured_whatever_its_audio_format(tmp_path):
    writer = ShardWriter(tmp_path / "mixed.tar")
    for number, fmt in enumerate(["WAV", "FLAC", "WAV", "FLAC"]):
        writer.add(f"u{number}", [(fmt.lower(), [audio(number + 1, fmt)]), ("txt", [b"a"])])
    writer.commit()
    scan = scan_shard(tmp_path / "mixed.tar")
    assert scan.problems == [] and scan.entry.num_utts == 4
    assert scan.entry.num_frames == 100 + 200 + 300 + 400 and sum(scan.entry.length_hist.values()) == 4


def test_a_sample_without_the_length_field_is_a_problem_not_a_silent_undercount(tmp_path):
    writer = ShardWriter(tmp_path / "gap.tar")
    writer.add("u0", [("wav", [audio(1, "WAV")])])
    writer.add("u1", [("txt", [b"no audio"])])
    writer.commit()
    (problem,) = scan_shard(tmp_path / "gap.tar").problems
    assert "u1: no wav member" in problem
