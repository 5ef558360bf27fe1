"""How pack stores audio by default: integer PCM as FLAC; lossy and float audio as its original
bytes (a re-encoding cannot make it better); audio that must change (resampled, cut, one
channel) encoded without clipping; the report counts each way; the loader decodes them all."""

import io
import json

import numpy as np
import pytest
import soundfile

from conftest import REALDATA, read_shards
from seqshard import make_loader, pack_data
from seqshard.cli import main
from seqshard.formats.audio import resample
from seqshard.formats.tar import SampleStream

COMMON_VOICE = REALDATA / "audio/commonvoice/common_voice_en_651325.mp3"


def members(out) -> dict[str, dict[str, bytes]]:
    found = {}
    for shard in sorted(out.glob("*.tar")):
        with SampleStream(shard) as stream:
            for sample in stream:
                found[sample.key] = {name: bytes(value) for name, value in sample.fields.items()}
    return found


def audio_of(fields: dict[str, bytes]) -> tuple[str, np.ndarray, int]:
    (name,) = [n for n in fields if n != "txt"]
    samples, rate = soundfile.read(io.BytesIO(fields[name]), dtype="float32", always_2d=True)
    return name, samples, rate


def data_dir(tmp_path, files: dict[str, object], segments: str | None = None):
    (tmp_path / "wav.scp").write_text("".join(f"{key} {path}\n" for key, path in files.items()))
    keys = [line.split()[0] for line in segments.splitlines()] if segments else list(files)
    (tmp_path / "text").write_text("".join(f"{key} words\n" for key in keys))
    if segments:
        (tmp_path / "segments").write_text(segments)
    return tmp_path / "wav.scp", tmp_path / "text"


def write(path, samples, rate, fmt, subtype):
    soundfile.write(path, samples, rate, format=fmt, subtype=subtype)
    return path


def square(rate, seconds=0.5, channels=1):
    """A 0.99 full-scale square wave: lossy decoders and resamplers overshoot it beyond 1.0."""
    wave = 0.99 * np.sign(np.sin(2 * np.pi * 440 * np.arange(int(rate * seconds)) / rate)).astype(np.float32)
    return wave if channels == 1 else np.stack([wave * (c + 1) / channels for c in range(channels)], axis=1)


def test_real_common_voice_mp3_keeps_its_bytes_and_the_loader_decodes_them(tmp_path, capsys):
    wav_scp, text = data_dir(tmp_path, {"cv": COMMON_VOICE})
    out = tmp_path / "out"
    assert main(["pack", "--wav-scp", str(wav_scp), "--text", str(text), "--out", str(out), "--quiet"]) == 0
    assert "audio stored     : 1 kept mp3 (kept: the original bytes)" in capsys.readouterr().out
    assert json.loads((out / "pack_report.json").read_text())["audio_stored"] == {"kept mp3": 1}
    found = members(out)["cv"]
    assert found["mp3"] == COMMON_VOICE.read_bytes()  # 19 KB, not a 456 KB float WAV

    decoded, rate = soundfile.read(COMMON_VOICE, dtype="float32")
    (batch,) = make_loader(str(out), batch_size=1, num_workers=0)
    assert int(batch["sample_rate"][0]) == rate == 48000
    np.testing.assert_array_equal(batch["audio"][0, : int(batch["audio_lens"][0])].numpy(), decoded)

    # fbank on the fly from the kept MP3 equals fbank computed while packing the MP3
    pack_data(None, text, tmp_path / "fbank", wav_scp=wav_scp, features="fbank", resample_to=16000, progress=False)
    at_pack = read_shards((tmp_path / "fbank").glob("*.tar"))["cv"][0]
    (batch,) = make_loader(str(out), batch_size=1, num_workers=0, features="fbank", resample_to=16000)
    np.testing.assert_allclose(batch["feats"][0, : int(batch["feat_lens"][0])].numpy(), at_pack, atol=1e-4)


def test_a_lossy_input_that_must_change_becomes_16_bit_flac_counted_in_the_report(tmp_path):
    wav_scp, text = data_dir(tmp_path, {"cv": COMMON_VOICE})
    report = pack_data(None, text, tmp_path / "out", wav_scp=wav_scp, resample_to=16000, progress=False)
    assert report.audio_stored == {"mp3 -> flac": 1}
    fields = members(tmp_path / "out")["cv"]
    name, stored, rate = audio_of(fields)
    assert (name, rate, soundfile.info(io.BytesIO(fields["flac"])).subtype) == ("flac", 16000, "PCM_16")
    decoded, _ = soundfile.read(COMMON_VOICE, dtype="float32")
    np.testing.assert_allclose(stored[:, 0], resample(decoded, 48000, 16000), atol=1 / 32768)
    assert len(fields["flac"]) < 2 * COMMON_VOICE.stat().st_size  # a float WAV would be 6x


def test_cut_or_one_channel_of_lossy_audio_is_encoded_and_samples_beyond_full_scale_are_not_clipped(tmp_path):
    ogg = write(tmp_path / "sq.ogg", square(16000, channels=2), 16000, "OGG", "VORBIS")
    decoded, _ = soundfile.read(ogg, dtype="float32", always_2d=True)
    assert np.abs(decoded).max() > 1.1  # the codec's overshoot: 16-bit PCM would clip it

    wav_scp, text = data_dir(tmp_path, {"sq": ogg})
    whole = pack_data(None, text, tmp_path / "whole", wav_scp=wav_scp, progress=False)
    assert whole.audio_stored == {"kept ogg": 1} and members(tmp_path / "whole")["sq"]["ogg"] == ogg.read_bytes()
    (batch,) = make_loader(str(tmp_path / "whole"), batch_size=1, num_workers=0)  # mixed down as pack would
    np.testing.assert_array_equal(batch["audio"][0].numpy(), decoded.mean(axis=1, dtype=np.float32))

    one = pack_data(None, text, tmp_path / "one", wav_scp=wav_scp, channel=1, progress=False)
    assert one.audio_stored == {"ogg -> wav": 1}
    name, stored, _ = audio_of(members(tmp_path / "one")["sq"])
    assert name == "wav" and np.array_equal(stored[:, 0], decoded[:, 1])  # float WAV: nothing clipped

    quiet = write(tmp_path / "quiet.ogg", 0.1 * square(16000), 16000, "OGG", "VORBIS")
    wav_scp, text = data_dir(tmp_path, {"rec": quiet}, segments="seg rec 0.1 0.3\n")
    cut = pack_data(None, text, tmp_path / "cut", wav_scp=wav_scp, segments=tmp_path / "segments", progress=False)
    assert cut.audio_stored == {"ogg -> flac": 1}
    name, stored, _ = audio_of(members(tmp_path / "cut")["seg"])
    recording, _ = soundfile.read(quiet, dtype="float32")
    np.testing.assert_allclose(stored[:, 0], recording[1600:4800], atol=1 / 32768)


def test_resampled_pcm_beyond_full_scale_is_stored_as_float_not_clipped(tmp_path):
    pcm = write(tmp_path / "sq.wav", square(16000), 16000, "WAV", "PCM_16")
    wav_scp, text = data_dir(tmp_path, {"sq": pcm})
    report = pack_data(None, text, tmp_path / "out", wav_scp=wav_scp, resample_to=22050, progress=False)
    assert report.audio_stored == {"wav -> wav": 1}
    _, stored, rate = audio_of(members(tmp_path / "out")["sq"])
    assert rate == 22050 and np.abs(stored).max() > 1.1


@pytest.mark.parametrize(
    ("fmt", "subtype", "how", "member"),
    [
        ("WAV", "PCM_32", "kept wav", "wav"),  # every bit of the 32-bit integers
        ("WAV", "ULAW", "kept wav", "wav"),  # 8 bits a sample, not a float WAV of 32
        ("NIST", "ULAW", "kept sph", "sph"),  # named so that the loader decodes it
        ("WAV", "PCM_U8", "wav -> flac", "flac"),  # 8-bit WAV is unsigned, FLAC's is signed
    ],
)
def test_other_sample_formats_are_stored_exactly_and_load(tmp_path, fmt, subtype, how, member):
    rng = np.random.default_rng(0)
    path = tmp_path / f"a.{fmt.lower()}"
    if subtype == "PCM_32":
        soundfile.write(path, rng.integers(-(2**31), 2**31, 8000, dtype=np.int32), 8000, format=fmt, subtype=subtype)
    else:
        write(path, rng.uniform(-0.5, 0.5, 8000).astype(np.float32), 8000, fmt, subtype)
    wav_scp, text = data_dir(tmp_path, {"a": path})
    report = pack_data(None, text, tmp_path / "out", wav_scp=wav_scp, progress=False)
    assert report.audio_stored == {how: 1}
    fields = members(tmp_path / "out")["a"]
    assert set(fields) == {member, "txt"}
    dtype = "int32" if subtype == "PCM_32" else "float32"
    expected, _ = soundfile.read(path, dtype=dtype)
    np.testing.assert_array_equal(soundfile.read(io.BytesIO(fields[member]), dtype=dtype)[0], expected)
    (batch,) = make_loader(str(tmp_path / "out"), batch_size=1, num_workers=0)
    np.testing.assert_array_equal(batch["audio"][0].numpy(), soundfile.read(path, dtype="float32")[0])
