"""Packing audio: wav.scp (files, wav-in-ark, pipes), segments, FLAC/original bytes/fbank,
length groups in seconds, and every bad input, on audio written here and on real speech."""

import io
import json
import shutil

import numpy as np
import pytest
import soundfile

from conftest import REALDATA, read_audio_shards, read_shards, write_audio_dir
from seqshard import ShardIndex, make_loader, pack_data
from seqshard.cli import main
from seqshard.errors import ConfigError, InputError
from seqshard.features.fbank import FbankOptions, fbank

AMI = REALDATA / "audio/ami"


def _pack(data, out, **options):
    return pack_data(None, data.text, out, wav_scp=data.wav_scp, progress=False, **options)


def test_audio_packs_to_lossless_flac_with_durations_in_the_index(tmp_path):
    data = write_audio_dir(tmp_path / "d")
    report = _pack(data, tmp_path / "out", utts_per_file=5)
    assert report.input_utts == report.packed == 12 and not report.dropped
    found = read_audio_shards(sorted((tmp_path / "out").glob("data-*.tar")))
    assert set(found) == set(data.keys)
    for key, (samples, rate, suffix, label) in found.items():
        assert suffix == "flac" and rate == 16000 and label == data.labels[key]
        np.testing.assert_array_equal(samples, data.audio[key])
    index = ShardIndex.load(tmp_path / "out")
    assert index.feature["kind"] == "audio" and index.feature["frame_shift_ms"] == 10.0
    assert index.num_utts == 12
    assert index.num_frames == sum(round(len(a) / 16000 * 100) for a in data.audio.values())
    flac_bytes = sum(p.stat().st_size for p in (tmp_path / "out").glob("*.tar"))
    assert flac_bytes < sum((data.root / f"{k}.wav").stat().st_size for k in data.keys)


def test_keep_stores_the_original_bytes(tmp_path):
    data = write_audio_dir(tmp_path / "d", utts=4)
    _pack(data, tmp_path / "out", audio_format="keep")
    from seqshard.formats.tar import SampleStream

    with SampleStream(next((tmp_path / "out").glob("*.tar"))) as stream:
        for sample in stream:
            assert bytes(sample.fields["wav"]) == (data.root / f"{sample.key}.wav").read_bytes()


@pytest.mark.parametrize(("subtype", "stored"), [("PCM_24", "flac"), ("FLOAT", "wav"), ("PCM_32", "wav")])
def test_other_sample_formats_are_stored_losslessly(tmp_path, subtype, stored):
    rng = np.random.default_rng(1)
    samples = (rng.uniform(-0.5, 0.5, 8000)).astype(np.float32)
    soundfile.write(tmp_path / "a.wav", samples, 8000, subtype=subtype)
    expected, _ = soundfile.read(tmp_path / "a.wav", dtype="float32")
    (tmp_path / "wav.scp").write_text(f"a {tmp_path / 'a.wav'}\n")
    (tmp_path / "text").write_text("a hello\n")
    pack_data(None, tmp_path / "text", tmp_path / "out", wav_scp=tmp_path / "wav.scp", progress=False)
    from seqshard.formats.tar import SampleStream

    with SampleStream(next((tmp_path / "out").glob("*.tar"))) as stream:
        sample = next(iter(stream))
    assert stored in sample.fields
    decoded, rate = soundfile.read(io.BytesIO(bytes(sample.fields[stored])), dtype="float32")
    assert rate == 8000
    np.testing.assert_array_equal(decoded, expected)


def test_channels_mix_down_by_default_or_one_is_chosen(tmp_path):
    left = np.full(1600, 0.25, dtype=np.float32)
    right = np.full(1600, -0.75, dtype=np.float32)
    soundfile.write(tmp_path / "st.wav", np.stack([left, right], 1), 16000, subtype="PCM_16")
    (tmp_path / "wav.scp").write_text(f"st {tmp_path / 'st.wav'}\n")
    (tmp_path / "text").write_text("st stereo\n")

    def packed(**options):
        out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
        pack_data(None, tmp_path / "text", out, wav_scp=tmp_path / "wav.scp", progress=False, **options)
        (samples, _, _, _) = read_audio_shards(out.glob("*.tar"))["st"]
        return samples / 32768

    np.testing.assert_allclose(packed(), -0.25, atol=1e-3)
    np.testing.assert_allclose(packed(channel=1), -0.75, atol=1e-3)
    with pytest.raises(InputError, match=r"channel 2 does not exist: the audio has 2 channel") as error:
        packed(channel=2)
    assert "wav.scp" in str(error.value) and "'st'" in str(error.value)


def test_segments_are_cut_at_pack_time_real_ami(tmp_path):
    (tmp_path / "wav.scp").write_text(f"AMI_ES2011a_H00_40s46s {AMI / 'ES2011a.Headset-0-40s-46s.wav'}\n")
    report = pack_data(
        None, AMI / "text", tmp_path / "out", wav_scp=tmp_path / "wav.scp", segments=AMI / "segments", progress=False
    )
    assert report.input_utts == report.packed == 2
    recording, rate = soundfile.read(AMI / "ES2011a.Headset-0-40s-46s.wav", dtype="int16")
    found = read_audio_shards((tmp_path / "out").glob("*.tar"))
    for line in (AMI / "segments").read_text().splitlines():
        key, _, start, end = line.split()
        samples, found_rate, _, label = found[key]
        assert found_rate == rate and label == (AMI / "text").read_text().split(key + " ")[1].split("\n")[0]
        np.testing.assert_array_equal(samples, recording[round(float(start) * rate) : round(float(end) * rate)])
    assert ShardIndex.load(tmp_path / "out").num_frames == 136 + 100


def test_wav_in_ark_real_kaldi(tmp_path):
    root = REALDATA / "kaldi/generated_kaldi"
    text = tmp_path / "text"
    text.write_text("".join(f"{line.split()[0]} x\n" for line in (root / "wav/wav_zh.scp").read_text().splitlines()))
    report = pack_data(
        None,
        text,
        tmp_path / "out",
        wav_scp=root / "wav/wav_zh.scp",
        path_root=root,
        audio_format="keep",
        progress=False,
    )
    assert report.packed == 3
    found = read_audio_shards((tmp_path / "out").glob("*.tar"))
    original, _ = soundfile.read(REALDATA / "audio/aishell1/BAC009S0724W0121.wav", dtype="int16")
    np.testing.assert_array_equal(found["BAC009S0724W0121"][0], original)


def test_pipes_run_only_when_allowed(tmp_path):
    data = write_audio_dir(tmp_path / "d", utts=2)
    marker = tmp_path / "ran"
    lines = data.wav_scp.read_text().splitlines()
    key, path = lines[0].split()
    data.wav_scp.write_text(f"{key} touch {marker}; cat {path} |\n{lines[1]}\n")
    with pytest.raises(InputError, match=r"shell command.*--allow-pipes|allow_pipes") as error:
        _pack(data, tmp_path / "out")
    assert f"{data.wav_scp}:1 (key {key!r})" in str(error.value) and "skip" not in str(error.value)
    assert not marker.exists()
    with pytest.raises(InputError, match="shell command"):  # not a bad-data skip: the user must decide
        _pack(data, tmp_path / "out2", skip_bad=True)
    assert not marker.exists()
    report = _pack(data, tmp_path / "out3", allow_pipes=True)
    assert report.packed == 2 and marker.exists()
    np.testing.assert_array_equal(read_audio_shards((tmp_path / "out3").glob("*.tar"))[key][0], data.audio[key])


def _damage(data, tmp_path):
    """Break utterances 0..5 in six ways; returns the reason each is counted under."""
    keys = data.keys
    (data.root / f"{keys[0]}.wav").unlink()  # missing file
    soundfile.write(data.root / f"{keys[1]}.wav", np.zeros(0, np.int16), 16000)  # zero-length
    (data.root / f"{keys[2]}.wav").write_bytes(b"RIFF not audio at all")  # unreadable
    shutil.copy(  # a real file that lost a byte to git's CR LF conversion
        REALDATA / "kaldi/kaldi-pr1626-fsdd-digits/corrupt/digits_audio/test/Speaker1/3_jackson_1.wav",
        data.root / f"{keys[3]}.wav",
    )
    whole = (data.root / f"{keys[4]}.wav").read_bytes()
    (data.root / f"{keys[4]}.wav").write_bytes(whole[: len(whole) // 2])  # cut short
    return {"missing_audio": 1, "zero_length": 1, "unreadable_audio": 3}


def test_bad_audio_is_an_error_naming_the_key_or_a_counted_skip(tmp_path):
    data = write_audio_dir(tmp_path / "d", utts=10)
    expected = _damage(data, tmp_path)
    for key in data.keys[:5]:
        single, text = tmp_path / f"{key}.scp", tmp_path / f"{key}.txt"
        single.write_text(next(line for line in data.wav_scp.read_text().splitlines() if line.startswith(key + " ")))
        text.write_text(f"{key} {data.labels[key]}\n")
        with pytest.raises(InputError) as error:
            pack_data(None, text, tmp_path / f"out-{key}", wav_scp=single, progress=False)
        message = str(error.value)
        assert f"{single}:1 (key {key!r})" in message
        assert "--skip-bad" in message or "skip_bad" in message
        assert not list((tmp_path / f"out-{key}").glob("*.tar"))
    report = _pack(data, tmp_path / "out", skip_bad=True)
    assert report.dropped == expected
    assert report.input_utts == 10 == report.packed + sum(report.dropped.values())
    assert set(read_audio_shards((tmp_path / "out").glob("*.tar"))) == set(data.keys[5:])
    saved = json.loads((tmp_path / "out/pack_report.json").read_text())
    assert saved["dropped"] == expected


@pytest.mark.parametrize(
    ("segment", "reason", "message"),
    [
        ("seg a 1.0 9.0", "bad_segment", "runs past the end of its recording"),
        ("seg a 0.5 0.5", "bad_segment", "empty or negative"),
        ("seg a 0.8 0.2", "bad_segment", "empty or negative"),
        # NaN, infinity or seconds past any utterance's length failed the write task (ValueError,
        # OverflowError), reported as a task to run again
        ("seg a nan 1", "bad_segment", "its start is nan, not a finite number"),
        ("seg a 0 nan", "bad_segment", "its end is nan, not a finite number"),
        ("seg a 0 1e308", "bad_segment", "its end is 1e\\+308, not <= "),
        ("seg a 0 inf", "bad_segment", "its end is inf, not a finite number"),
        ("seg a 0 -inf", "bad_segment", "its end is -inf, not a finite number"),
        ("seg nosuch 0.0 0.5", "no_recording", "nosuch"),
    ],
)
def test_bad_segments(tmp_path, segment, reason, message, caplog):
    soundfile.write(tmp_path / "a.wav", np.zeros(16000, np.int16) + 100, 16000)
    (tmp_path / "wav.scp").write_text(f"a {tmp_path / 'a.wav'}\n")
    (tmp_path / "segments").write_text(f"ok a 0.0 0.5\n{segment}\n")
    (tmp_path / "text").write_text("ok fine\nseg words\n")
    options = dict(wav_scp=tmp_path / "wav.scp", segments=tmp_path / "segments", progress=False)
    with pytest.raises(InputError, match=message) as error:
        pack_data(None, tmp_path / "text", tmp_path / "out", **options)
    assert f"{tmp_path / 'segments'}:2" in str(error.value)
    with caplog.at_level("WARNING", logger="seqshard"):
        report = pack_data(None, tmp_path / "text", tmp_path / "out2", skip_bad=True, **options)
    assert report.packed == 1 and report.dropped == {reason: 1} and report.input_utts == 2
    assert report.label_issues == {}  # its label was counted again, as no_features
    assert "no_features" not in caplog.text and "seg" in caplog.text  # one warning, under the real reason


def test_length_groups_take_seconds_for_audio(tmp_path):
    data = write_audio_dir(tmp_path / "d", utts=20, seconds=(0.2, 3.0))
    report = _pack(data, tmp_path / "out", filter_group=["0.5:1.5", "1.5:2.5"])
    seconds = {k: len(a) / 16000 for k, a in data.audio.items()}
    for folder, (low, high) in (("0.5_1.5", (0.5, 1.5)), ("1.5_2.5", (1.5, 2.5))):
        found = read_audio_shards((tmp_path / "out" / folder).glob("*.tar"))
        assert set(found) == {k for k, s in seconds.items() if low <= round(s * 100) / 100 < high}
    assert report.packed + sum(report.dropped.values()) == 20 and report.dropped


def test_fbank_at_pack_time_equals_fbank_on_the_fly(tmp_path):
    data = write_audio_dir(tmp_path / "d", utts=6)
    _pack(data, tmp_path / "audio")
    report = _pack(data, tmp_path / "feats", features="fbank", num_mel_bins=40)
    assert report.packed == 6 and report.dim == 40
    packed = read_shards((tmp_path / "feats").glob("*.tar"))
    for key, samples in data.audio.items():
        direct = fbank(samples.astype(np.float32), FbankOptions(num_mel_bins=40))
        np.testing.assert_array_equal(packed[key][0], direct)
    loader = make_loader(tmp_path / "audio", batch_size=2, features="fbank", num_mel_bins=40, num_workers=0)
    seen = 0
    for batch in loader:
        for key, feats, length in zip(batch["keys"], batch["feats"], batch["feat_lens"]):
            np.testing.assert_array_equal(feats[:length].numpy(), packed[key][0])
            seen += 1
    assert seen == 6
    index = ShardIndex.load(tmp_path / "feats")
    assert index.feature["dim"] == 40 and index.num_frames == sum(len(a[0]) for a in packed.values())


def test_fbank_needs_one_sample_rate_or_resample_to(tmp_path):
    data = write_audio_dir(tmp_path / "d", utts=2)
    shutil.copy(REALDATA / "audio/ljspeech/LJ002-0020.wav", data.root / "lj.wav")  # 22,050 Hz
    with open(data.wav_scp, "a") as stream:
        stream.write(f"lj {data.root / 'lj.wav'}\n")
    with open(data.text, "a") as stream:
        stream.write("lj in eighteen thirteen\n")
    with pytest.raises(InputError, match=r"22050 Hz.*16000 Hz. Fix: pass resample_to=16000") as error:
        _pack(data, tmp_path / "out", features="fbank")
    assert "'lj'" in str(error.value)
    report = _pack(data, tmp_path / "ok", features="fbank", resample_to=16000)
    assert report.packed == 3
    lj = read_shards((tmp_path / "ok").glob("*.tar"))["lj"][0]
    assert lj.shape[0] == (round(33949 * 16000 / 22050) - 400) // 160 + 1


def test_real_speech_in_every_format_packs(tmp_path):
    files = {
        "flac": REALDATA / "audio/librispeech/2412-153948-0000.flac",
        "wav22k": REALDATA / "audio/ljspeech/LJ002-0020.wav",
        "mp3": REALDATA / "audio/commonvoice/common_voice_en_651325.mp3",
        "aishell": REALDATA / "audio/aishell1/BAC009S0724W0121.wav",
    }
    (tmp_path / "wav.scp").write_text("".join(f"{k} {p}\n" for k, p in files.items()))
    (tmp_path / "text").write_text("".join(f"{k} words\n" for k in files))
    report = pack_data(None, tmp_path / "text", tmp_path / "out", wav_scp=tmp_path / "wav.scp", progress=False)
    assert report.packed == 4
    index = ShardIndex.load(tmp_path / "out")
    expected = sum(round(soundfile.info(p).duration * 100) for p in files.values())
    assert abs(index.num_frames - expected) <= 1


def test_pack_command_line_for_audio(tmp_path, capsys):
    data = write_audio_dir(tmp_path / "d", utts=5)
    out = tmp_path / "out"
    args = ["pack", "--wav-scp", str(data.wav_scp), "--text", str(data.text), "--out", str(out), "--quiet"]
    assert main(args) == 0
    assert len(read_audio_shards(out.glob("*.tar"))) == 5
    capsys.readouterr()
    assert main(["inspect", "--json", "--quiet", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["hours"] == pytest.approx(sum(len(a) for a in data.audio.values()) / 16000 / 3600, abs=1e-4)
    assert main(["pack", "--text", str(data.text), "--out", str(tmp_path / "none")]) != 0
    assert "--wav-scp" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="either"):
        pack_data(tmp_path / "feats.scp", data.text, tmp_path / "both", wav_scp=data.wav_scp, progress=False)


def test_options_that_change_audio_apply_or_are_refused(tmp_path):
    data = write_audio_dir(tmp_path / "d", utts=3)
    for options in ({"channel": 0}, {"resample_to": 8000}):
        with pytest.raises(ConfigError, match="stores each file's original bytes, so it cannot apply"):
            _pack(data, tmp_path / "keep", audio_format="keep", **options)
    _pack(data, tmp_path / "8k", resample_to=8000)
    for key, (samples, rate, suffix, _) in read_audio_shards((tmp_path / "8k").glob("*.tar")).items():
        assert rate == 8000 and suffix == "flac" and len(samples) == int(len(data.audio[key]) / 2 + 0.5)
    with pytest.raises(ConfigError, match="for audio input; give the audio with wav_scp"):
        pack_data(data.wav_scp, data.text, tmp_path / "f", resample_to=8000, progress=False)


def test_keep_names_a_member_by_what_it_holds(tmp_path):
    flac = REALDATA / "audio/librispeech/2412-153948-0000.flac"
    shutil.copy(flac, tmp_path / "named.wav")  # a FLAC file named .wav
    (tmp_path / "wav.scp").write_text(f"a {tmp_path / 'named.wav'}\n")
    (tmp_path / "text").write_text("a words\n")
    pack_data(
        None, tmp_path / "text", tmp_path / "out", wav_scp=tmp_path / "wav.scp", audio_format="keep", progress=False
    )
    from seqshard.formats.tar import SampleStream

    with SampleStream(next((tmp_path / "out").glob("*.tar"))) as stream:
        assert set(next(iter(stream)).fields) == {"flac", "txt"}


def test_wrong_kind_of_input_is_named(tmp_path):
    from conftest import write_kaldi_dir

    features = write_kaldi_dir(tmp_path / "k", speakers=1, per_speaker=2)
    with pytest.raises(InputError, match=r"it starts a Kaldi matrix \(is this a feats.scp\?\)\. Fix: pack features"):
        pack_data(None, features.text, tmp_path / "o", wav_scp=features.scp, progress=False)
    (tmp_path / "empty.wav").write_bytes(b"")
    (tmp_path / "wav.scp").write_text(f"e {tmp_path / 'empty.wav'}\n")
    (tmp_path / "text").write_text("e x\n")
    with pytest.raises(InputError, match=r"the file is empty \(0 bytes\)") as error:
        pack_data(None, tmp_path / "text", tmp_path / "o2", wav_scp=tmp_path / "wav.scp", progress=False)
    assert "_io.BytesIO" not in str(error.value)


def test_a_wav_header_declaring_a_rate_no_audio_has_is_a_named_error_or_counted(tmp_path):
    data = write_audio_dir(tmp_path / "d", utts=4)
    damaged = data.root / f"{data.keys[1]}.wav"
    raw = bytearray(damaged.read_bytes())
    raw[24:28] = (8_404_608).to_bytes(4, "little")  # the fmt chunk's sample rate
    damaged.write_bytes(bytes(raw))
    with pytest.raises(InputError, match=r"declares 8404608 Hz, no rate audio is recorded at") as error:
        _pack(data, tmp_path / "strict")
    assert error.value.reason == "unreadable_audio" and data.keys[1] in str(error.value)
    report = _pack(data, tmp_path / "skip", skip_bad=True)
    assert report.dropped == {"unreadable_audio": 1} and report.packed == 3
