"""Sizes that audio headers and Kaldi ark headers declare are checked against the bytes that
exist before anything is allocated for them: a hostile header is a clear InputError naming the
file and offset (counted with skip_bad), never a MemoryError nor a multi-GB allocation."""

import io
import struct
import tracemalloc

import numpy as np
import pytest
import soundfile

from seqshard import pack_data
from seqshard.errors import InputError, Where
from seqshard.formats.audio import decode_audio, parse_wav_location, read_location
from seqshard.formats.peers.kaldi import MatrixReader, parse_location

MB = 1 << 20


def peak_bytes(call):
    """``call()``'s result (or the exception it raised) and the most memory it held at once."""
    tracemalloc.start()
    try:
        try:
            result = call()
        except Exception as error:
            result = error
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def tone(rate=16000, seconds=1.0, fmt="WAV"):
    samples = (0.3 * np.sin(np.arange(int(rate * seconds)) / 5)).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt, subtype="PCM_16")
    return buffer.getvalue()


def flac_declaring(frames: int) -> bytes:
    """A real 1 s FLAC (16,000 frames) whose STREAMINFO says it holds ``frames``."""
    data = bytearray(tone(fmt="FLAC"))
    field = slice(8 + 10, 8 + 18)  # sample rate, channels, bits, then the 36-bit frame count
    value = (int.from_bytes(data[field], "big") & ~((1 << 36) - 1)) | frames
    data[field] = value.to_bytes(8, "big")
    return bytes(data)


# ---------------------------------------------------------------------------------------
# audio


def test_a_wav_in_ark_whose_riff_size_says_2_gb_is_refused_before_reading(tmp_path):
    wav = tone()
    ark = tmp_path / "wav.ark"
    ark.write_bytes(b"utt1 " + wav[:4] + struct.pack("<I", 0x7FFFFFFF) + wav[8:])
    where = Where(tmp_path / "wav.scp", 1, "utt1")
    error, peak = peak_bytes(lambda: read_location(parse_wav_location(f"{ark}:5", where), where))
    assert isinstance(error, InputError) and error.reason == "unreadable_audio", error
    assert f"{ark}:5 declares 2147483647 bytes" in str(error) and "wav.scp:1" in str(error)
    assert peak < 16 * MB

    (tmp_path / "wav.scp").write_text(f"utt1 {ark}:5\n")
    (tmp_path / "text").write_text("utt1 x\n")
    for groups in (None, ["0:100"]):  # lengths from the header, then the full read
        with pytest.raises(InputError, match="declares 2147483647 bytes"):
            pack_data(None, tmp_path / "text", tmp_path / "o", wav_scp=tmp_path / "wav.scp", filter_group=groups,
                      overwrite=True, progress=False)  # fmt: skip


# 256 GiB as float32 (more than its bytes can hold); 200 MB (could be: refused once decoded)
@pytest.mark.parametrize("frames", [(1 << 36) - 1, 50_000_000])
def test_a_flac_header_declaring_more_frames_than_it_holds_allocates_only_what_decodes(tmp_path, frames):
    where = Where(tmp_path / "wav.scp", 1, "big")
    error, peak = peak_bytes(lambda: decode_audio(flac_declaring(frames), where))
    assert isinstance(error, InputError) and error.reason == "unreadable_audio", error
    assert f"FLAC header declares {frames} frames" in str(error) and "wav.scp:1 (key 'big')" in str(error)
    assert peak < 64 * MB


def test_a_flac_header_declaring_2_to_36_frames_is_not_taken_as_a_length(tmp_path):
    hostile = flac_declaring((1 << 36) - 1)

    (tmp_path / "big.flac").write_bytes(hostile)
    (tmp_path / "ok.flac").write_bytes(tone(fmt="FLAC"))
    (tmp_path / "wav.scp").write_text(f"big {tmp_path / 'big.flac'}\nok {tmp_path / 'ok.flac'}\n")
    (tmp_path / "text").write_text("big x\nok y\n")
    report = pack_data(None, tmp_path / "text", tmp_path / "out", wav_scp=tmp_path / "wav.scp",
                       filter_group=["0:100"], skip_bad=True, progress=False)  # fmt: skip
    # the header's 49 days are not taken as the length (they put it outside the group, unread)
    assert report.packed == 1 and report.dropped == {"unreadable_audio": 1}


def test_the_loader_counts_a_shard_member_with_such_a_header_as_a_bad_sample(tmp_path):
    from seqshard import make_loader
    from seqshard.formats.tar import ShardWriter

    writer = ShardWriter(tmp_path / "a.tar")
    for key, audio in (("ok1", tone(fmt="FLAC")), ("big", flac_declaring((1 << 36) - 1)), ("ok2", tone())):
        writer.add(key, [("flac" if audio.startswith(b"fLaC") else "wav", [audio]), ("txt", [b"x"])])
    writer.commit()
    loader = make_loader(str(tmp_path / "a.tar"), batch_size=2, skip_bad=True, num_workers=0)
    assert [key for batch in loader for key in batch["keys"]] == ["ok1", "ok2"]
    assert loader.stats()["dropped"] == {"unreadable_audio": 1}


def test_indexing_a_shard_names_a_member_whose_header_declares_too_much(tmp_path):
    from seqshard.formats.tar import ShardWriter
    from seqshard.tools.scan import scan_shard

    writer = ShardWriter(tmp_path / "a.tar")
    writer.add("big", [("flac", [flac_declaring((1 << 36) - 1)]), ("txt", [b"x"])])
    writer.commit()
    (problem,) = scan_shard(tmp_path / "a.tar").problems
    assert problem.startswith("big.flac: its header declares 68719476735 frames, more than")


def test_decoding_in_blocks_gives_the_same_samples_without_holding_spare_blocks():
    long = tone(rate=8000, seconds=300)  # 2.4 M samples: three blocks
    samples, _ = soundfile.read(io.BytesIO(long), dtype="float32")
    audio = decode_audio(long, Where("x"))
    np.testing.assert_array_equal(audio.samples, samples)
    short = decode_audio(tone(seconds=0.1), Where("x"))
    assert short.samples.base is None or short.samples.base.nbytes == short.samples.nbytes


# ---------------------------------------------------------------------------------------
# Kaldi arks


def fm_value(rows: int, cols: int) -> bytes:
    return b"\0BFM \x04" + struct.pack("<i", rows) + b"\x04" + struct.pack("<i", cols) + bytes(4 * 3 * cols)


def cm_value(rows: int, cols: int) -> bytes:
    return b"\0BCM " + struct.pack("<ffii", 0.0, 1.0, rows, cols) + bytes(8 * cols + 3 * cols)


def int_vector(count: int) -> bytes:
    return b"\0B\x04" + struct.pack("<i", count) + b"\x04\x01\x00\x00\x00" * 3


@pytest.mark.parametrize(
    ("value", "vectors"),
    [
        (fm_value(10**9, 80), False),  # what kaldiio would ask for: 320 GB
        (fm_value(20_000_000, 10), False),  # 800 MB: an allocation that succeeds, then reads 120 bytes
        (cm_value(10**8, 8), False),
        (int_vector(10**8), True),
    ],
    ids=["fm-320GB", "fm-800MB", "cm", "int-vector"],
)
def test_an_ark_value_whose_header_claims_more_than_the_ark_holds(tmp_path, value, vectors):
    ark = tmp_path / "feats.ark"
    ark.write_bytes(b"utt1 " + value)
    where = Where(tmp_path / "feats.scp", 1, "utt1")
    with MatrixReader() as reader:
        error, peak = peak_bytes(lambda: reader.read(parse_location(f"{ark}:5", where), where, vectors=vectors))
        assert isinstance(error, InputError) and error.reason == "damaged_value", error
        assert f"byte 5 of ark {str(ark)!r}" in str(error) and "past the end of the ark" in str(error)
        assert peak < 16 * MB
        if not vectors:
            with pytest.raises(InputError, match="past the end of the ark"):
                reader.shape(parse_location(f"{ark}:5", where), where)


def test_a_matrix_header_claiming_10_to_9_rows_is_dropped_when_lengths_are_planned(tmp_path):
    ark = tmp_path / "feats.ark"
    good = b"\0BFM \x04" + struct.pack("<i", 20) + b"\x04" + struct.pack("<i", 3) + bytes(4 * 60)
    ark.write_bytes(b"good " + good + b"bad " + fm_value(10**9, 3))
    (tmp_path / "feats.scp").write_text(f"good {ark}:5\nbad {ark}:{5 + len(good) + 4}\n")
    (tmp_path / "text").write_text("good x\nbad y\n")
    report = pack_data(tmp_path / "feats.scp", tmp_path / "text", tmp_path / "out", filter_group=["10:1000"],
                       skip_bad=True, progress=False)  # fmt: skip
    # not taken at its word (10^9 frames: outside the group, never read)
    assert report.packed == 1 and report.dropped == {"damaged_value": 1}


# ---------------------------------------------------------------------------------------
# lengths declared by utt2num_frames and utt2dur


def test_lengths_beyond_int32_in_length_files_are_malformed_lines_not_wrapped(tmp_path):
    from conftest import write_audio_dir, write_kaldi_dir

    data = write_kaldi_dir(tmp_path / "k", speakers=1, per_speaker=3, frames=(20, 40))
    lengths = [f"{key} {len(array)}\n" for key, array in data.arrays.items()]
    lengths[0] = f"{data.keys[0]} {2**32 + len(data.arrays[data.keys[0]])}\n"  # int32 would read its true length
    lengths[1] = f"{data.keys[1]} {3 * 10**9}\n"  # int32 would read -1294967296: "unknown"
    (data.root / "utt2num_frames").write_text("".join(lengths))
    report = pack_data(data.scp, data.text, tmp_path / "f", filter_group=["1:1000"], skip_bad=True, progress=False)
    assert report.frames_file_issues == {"malformed_line": 2} and report.packed == 3

    audio = write_audio_dir(tmp_path / "a", utts=2)
    (audio.root / "utt2dur").write_text(f"utt000 {'9' * 400}\nutt001 1.0\n")  # float: inf
    with pytest.raises(
        InputError, match=r"utt2dur:1 \(key 'utt000'\): the duration \(seconds\) is inf, not a finite number"
    ):
        pack_data(None, audio.text, tmp_path / "a_out", wav_scp=audio.wav_scp, filter_group=["0:100"], progress=False)
