"""Audio on the loader side: waveform batches, resample, speed, noise, fbank, CMVN and
SpecAugment as stages (seeded, resumable), WeNet lists and wav.scp read directly, bad audio."""

import json
import logging
import re
import shutil

import numpy as np
import pytest
import soundfile
import torch

from conftest import REALDATA, write_audio_dir
from seqshard import make_loader, pack_data
from seqshard.cli import main
from seqshard.errors import ConfigError, InputError
from seqshard.features.fbank import FbankOptions, fbank
from seqshard.features.frontend import SpecAugmentOptions, spec_augment
from seqshard.formats.audio import resample
from seqshard.formats.tar import ShardWriter
from seqshard.pipeline.stages.audio_chain import mix

SMALL = dict(shuffle_window=8, sort_window=4, interleave=2)


@pytest.fixture(scope="module")
def audio_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("audio")
    data = write_audio_dir(root / "d", utts=16, seconds=(0.3, 1.2))
    pack_data(None, data.text, root / "shards", wav_scp=data.wav_scp, utts_per_file=5, progress=False)
    return data, root / "shards"


def _masked(batch, name="feats"):
    """The real (unpadded) rows of a padded batch, per sample."""
    lengths = batch[f"{name}_lens" if name != "feats" else "feat_lens"]
    return [value[:length].numpy() for value, length in zip(batch[name], lengths)]


def _assert_resumes_to(full, shards, options, name, epoch=0, cut=2):
    """A loader stopped after ``cut`` batches, its state saved and loaded into a new loader,
    gives the batches ``full`` (those of an uninterrupted epoch), values included."""
    loader = make_loader(shards, **options)
    loader.set_epoch(epoch)
    iterator = iter(loader)
    head = [next(iterator) for _ in range(cut)]
    state = json.loads(json.dumps(loader.state_dict()))
    del iterator
    resumed = make_loader(shards, **options)
    resumed.load_state_dict(state)
    resumed.set_epoch(epoch)
    for a, b in zip(head + list(resumed), full, strict=True):
        assert a["keys"] == b["keys"]
        torch.testing.assert_close(a[name], b[name])


def _all(loader, epoch=0):
    loader.set_epoch(epoch)
    return [batch for batch in loader]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_audio_shards_batch_as_padded_waveforms(audio_shards, num_workers):
    data, shards = audio_shards
    loader = make_loader(shards, batch_size=3, num_workers=num_workers, **SMALL)
    seen = {}
    for batch in _all(loader):
        assert set(batch) == {"keys", "texts", "audio", "audio_lens", "sample_rate"}
        assert batch["audio"].dtype == torch.float32
        for key, text, wave, rate in zip(batch["keys"], batch["texts"], _masked(batch, "audio"), batch["sample_rate"]):
            assert key not in seen and text == data.labels[key] and int(rate) == 16000
            seen[key] = wave
    assert set(seen) == set(data.keys)
    for key, wave in seen.items():
        np.testing.assert_array_equal(np.round(wave * 32768).astype(np.int16), data.audio[key])
    rank = loader.last_summary["ranks"][0]
    assert rank["utts"] == rank["planned"] == 16 and rank["left"] == 0


@pytest.mark.parametrize("num_workers", [0, 2])
def test_fbank_on_the_fly_has_the_keys_feature_shards_give(audio_shards, num_workers):
    data, shards = audio_shards
    loader = make_loader(shards, batch_size=4, num_workers=num_workers, features="fbank", num_mel_bins=40, **SMALL)
    count = 0
    for batch in _all(loader):
        assert set(batch) == {"keys", "texts", "feats", "feat_lens"}
        for key, feats in zip(batch["keys"], _masked(batch)):
            expected = fbank(data.audio[key].astype(np.float32), FbankOptions(num_mel_bins=40))
            np.testing.assert_allclose(feats, expected, atol=1e-5)
            count += 1
    assert count == 16


def test_the_loaders_dim_is_the_fbanks_it_computes_and_sizes_the_trainers_model(audio_shards):
    """The example trainer sizes its model by loader.dim, None for audio shards before (issue 23, item 13)."""
    from seqshard.app.config import build_loaders
    from seqshard.app.ctc_model import SmallCTC
    from seqshard.app.train_setup import input_dim

    option = {"large_dataset": True, "trset": str(audio_shards[1]), "batch_size": 4, "num_workers": 0, **SMALL}
    loader, _ = build_loaders({"train": {"option": {**option, "features": "fbank", "num_mel_bins": 40}}})
    batch = next(iter(loader))
    assert loader.dim == input_dim(loader, "cfg") == batch["feats"].shape[2] == 40
    log_probs, _ = SmallCTC(input_dim(loader, "cfg"), 10, hidden=8, layers=1)(batch["feats"], batch["feat_lens"])
    assert log_probs.shape[-1] == 10
    waves, _ = build_loaders({"train": {"option": option}})
    with pytest.raises(ConfigError, match=r'cfg: the trainer.s model reads feature vectors, .*features to "fbank"'):
        input_dim(waves, "cfg")


@pytest.mark.parametrize(("old", "new"), [(8000, 16000), (22050, 16000), (16000, 8000), (44100, 16000)])
def test_resampling_keeps_a_tone_and_gives_round_n_new_over_old(old, new):
    n = old + 123
    tone = np.sin(2 * np.pi * 440 * np.arange(n) / old).astype(np.float32)
    out = resample(tone, old, new)
    assert len(out) == round(n * new / old)
    spectrum = np.abs(np.fft.rfft(out * np.hanning(len(out))))
    peak = np.fft.rfftfreq(len(out), 1 / new)[np.argmax(spectrum)]
    assert abs(peak - 440) <= new / len(out)  # within one FFT bin


def test_resample_to_in_the_loader_real_ljspeech(tmp_path):
    lj = REALDATA / "audio/ljspeech/LJ002-0020.wav"
    (tmp_path / "data.list").write_text(json.dumps({"key": "lj", "wav": str(lj), "txt": "x"}) + "\n")
    batch = next(iter(make_loader(tmp_path / "data.list", batch_size=1, num_workers=0, resample_to=16000)))
    assert int(batch["sample_rate"][0]) == 16000 and int(batch["audio_lens"][0]) == round(33949 * 16000 / 22050)


def test_speed_perturbation_changes_length_and_pitch_seeded_per_utterance(tmp_path):
    rate = 16000
    tone = (0.5 * np.sin(2 * np.pi * 500 * np.arange(rate) / rate) * 32767).astype(np.int16)
    soundfile.write(tmp_path / "t.wav", tone, rate)
    lines = [json.dumps({"key": f"t{i}", "wav": str(tmp_path / "t.wav"), "txt": "x"}) for i in range(12)]
    (tmp_path / "data.list").write_text("\n".join(lines) + "\n")
    options = dict(batch_size=1, num_workers=0, speed_perturb=[0.9, 1.0, 1.1], seed=5)
    lengths = {}
    for batch in make_loader(tmp_path / "data.list", **options):
        wave = batch["audio"][0, : batch["audio_lens"][0]].numpy()
        factor = rate / len(wave)
        nearest = min((0.9, 1.0, 1.1), key=lambda f: abs(f - factor))
        assert len(wave) == round(rate / nearest)
        peak = np.fft.rfftfreq(len(wave), 1 / rate)[np.argmax(np.abs(np.fft.rfft(wave)))]
        assert abs(peak - 500 * nearest) <= 2  # pitch moves with tempo
        lengths[batch["keys"][0]] = len(wave)
    assert len(set(lengths.values())) == 3  # all three factors were drawn
    again = {b["keys"][0]: int(b["audio_lens"][0]) for b in make_loader(tmp_path / "data.list", **options)}
    assert again == lengths
    other_epoch = make_loader(tmp_path / "data.list", **options)
    other_epoch.set_epoch(1)
    assert {b["keys"][0]: int(b["audio_lens"][0]) for b in other_epoch} != lengths


def test_mix_reaches_the_snr():
    rng = np.random.default_rng(0)
    audio = rng.standard_normal(16000).astype(np.float32) * 0.3
    noise = rng.standard_normal(16000).astype(np.float32)
    for snr in (0.0, 5.0, 17.5):
        added = mix(audio, noise, snr) - audio
        measured = 10 * np.log10(np.mean(audio.astype(np.float64) ** 2) / np.mean(added.astype(np.float64) ** 2))
        assert measured == pytest.approx(snr, abs=0.01)


def test_noise_from_its_own_shards_at_the_snr_range_and_resumable(tmp_path, audio_shards):
    _, shards = audio_shards
    noise = write_audio_dir(tmp_path / "noise", utts=3, seconds=(0.2, 0.4), seed=9)
    noise.text.write_text("".join(f"{k} -\n" for k in noise.keys))
    pack_data(None, noise.text, tmp_path / "noise-shards", wav_scp=noise.wav_scp, progress=False)
    clean = {}
    for batch in make_loader(shards, batch_size=4, num_workers=0, **SMALL):
        clean.update(zip(batch["keys"], _masked(batch, "audio")))
    options = dict(batch_size=4, num_workers=0, noise=str(tmp_path / "noise-shards"), noise_snr=(10, 12), **SMALL)
    noisy = [b for b in make_loader(shards, **options)]
    from_scp = make_loader(shards, **{**options, "noise": str(noise.wav_scp)})  # a noise set without texts
    for batch in noisy + list(from_scp):
        for key, wave in zip(batch["keys"], _masked(batch, "audio")):
            added = wave.astype(np.float64) - clean[key]
            snr = 10 * np.log10(np.mean(clean[key].astype(np.float64) ** 2) / np.mean(added**2))
            assert 10 - 0.1 <= snr <= 12 + 0.1
    assert all(
        np.array_equal(a, b)
        for batch in make_loader(shards, **{**options, "noise_prob": 0.0})
        for a, b in zip(_masked(batch, "audio"), (clean[k] for k in batch["keys"]))
    )
    _assert_resumes_to(noisy, shards, options, "audio")


def test_spec_augment_masks_stay_in_bounds_and_repeat_with_the_seed():
    options = SpecAugmentOptions(freq_masks=2, max_freq_width=5, time_masks=3, max_time_width=8, max_time_ratio=0.2)
    feats = np.random.default_rng(0).uniform(1, 2, (60, 40)).astype(np.float32)
    for seed in range(20):
        out = spec_augment(feats, options, np.random.default_rng(seed))
        zero_bins = np.flatnonzero((out == 0).all(axis=0))
        zero_frames = np.flatnonzero((out == 0).all(axis=1))
        assert len(zero_bins) <= 2 * 5 and len(zero_frames) <= 3 * min(8, int(60 * 0.2))
        untouched = (out != 0) | (feats == 0)
        assert np.array_equal(out[untouched], feats[untouched])  # only masks change values
        np.testing.assert_array_equal(out, spec_augment(feats, options, np.random.default_rng(seed)))
    assert not np.array_equal(
        spec_augment(feats, options, np.random.default_rng(1)), spec_augment(feats, options, np.random.default_rng(2))
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_spec_augment_in_the_loader_is_seeded_and_resumes(audio_shards, num_workers):
    _, shards = audio_shards
    options = dict(batch_size=3, num_workers=num_workers, features="fbank", spec_augment=True, seed=4, **SMALL)
    full = _all(make_loader(shards, **options), 1)
    assert any((f == 0).all(axis=0).any() for b in full for f in _masked(b))  # some band is masked
    _assert_resumes_to(full, shards, options, "feats", epoch=1)


def test_cmvn_command_and_option_normalise_the_features(audio_shards, tmp_path, capsys):
    _, shards = audio_shards
    out = tmp_path / "cmvn.json"
    assert main(["cmvn", str(shards), "-o", str(out), "--features", "fbank", "--num-mel-bins", "40"]) == 0
    assert "over 16 utterances" in capsys.readouterr().out
    stats = json.loads(out.read_text())
    assert len(stats["mean"]) == len(stats["std"]) == 40 and stats["utterances"] == 16
    loader = make_loader(shards, batch_size=4, num_workers=2, features="fbank", num_mel_bins=40, cmvn=str(out))
    frames = np.concatenate([f for b in loader for f in _masked(b)])
    assert len(frames) == stats["frames"]
    np.testing.assert_allclose(frames.mean(axis=0), 0, atol=1e-3)
    np.testing.assert_allclose(frames.std(axis=0), 1, atol=1e-3)
    with pytest.raises(InputError, match="80 dimensions, the CMVN statistics 40"):
        list(make_loader(shards, batch_size=4, num_workers=0, features="fbank", cmvn=str(out)))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a file written by `seqshard cmvn`"):
        make_loader(shards, batch_size=4, features="fbank", cmvn=str(tmp_path / "bad.json"))


def test_cmvn_over_feature_shards(tmp_path):
    from conftest import write_kaldi_dir

    data = write_kaldi_dir(tmp_path / "k", speakers=3, per_speaker=4)
    pack_data(data.scp, data.text, tmp_path / "s", progress=False)
    assert main(["cmvn", str(tmp_path / "s"), "-o", str(tmp_path / "c.json")]) == 0
    stats = json.loads((tmp_path / "c.json").read_text())
    frames = np.concatenate(list(data.arrays.values())).astype(np.float64)
    np.testing.assert_allclose(stats["mean"], frames.mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(stats["std"], frames.std(axis=0), rtol=1e-4)
    assert stats["frames"] == len(frames) and stats["utterances"] == 12


def test_wenet_shard_list_and_raw_list_load(tmp_path):
    shard = tmp_path / "shards/shards_000000000.tar"
    shard.parent.mkdir()
    shutil.copy(REALDATA / "webdataset/wenet-shard/shards_000000000.tar", shard)
    (tmp_path / "data.shards.list").write_text("shards/shards_000000000.tar\n")
    batch = next(iter(make_loader(tmp_path / "data.shards.list", batch_size=2, num_workers=0, features="fbank")))
    assert sorted(k.rsplit("/", 1)[1] for k in batch["keys"]) == [
        "aishell-BAC009S0724W0121",
        "librispeech-1995-1837-0001",
    ]
    assert batch["feats"].shape[2] == 80 and "广州市房地产中介协会分析" in batch["texts"]

    ami = REALDATA / "audio/ami/ES2011a.Headset-0-40s-46s.wav"
    records = [
        {"key": "seg", "wav": str(ami), "txt": "I'M ABIGAIL CLAFLIN", "start": 1.46, "end": 2.82},
        {"key": "flac", "wav": str(REALDATA / "audio/librispeech/2412-153948-0000.flac"), "txt": "IF THE READER"},
    ]
    (tmp_path / "data.list").write_text("".join(json.dumps(r) + "\n" for r in records))
    for num_workers in (0, 2):
        batches = list(make_loader(tmp_path / "data.list", batch_size=2, num_workers=num_workers))
        waves = {k: w for b in batches for k, w in zip(b["keys"], _masked(b, "audio"))}
        recording, _ = soundfile.read(ami, dtype="float32")
        np.testing.assert_array_equal(waves["seg"], recording[round(1.46 * 16000) : round(2.82 * 16000)])
        assert len(waves["flac"]) == soundfile.info(records[1]["wav"]).frames


def test_kaldi_wav_scp_loads_with_labels_from_text_and_says_when_it_has_none(tmp_path, caplog):
    data = write_audio_dir(tmp_path / "d", utts=6)
    loader = make_loader(data.wav_scp, labels=data.text, batch_size=2, num_workers=2)
    texts = {k: t for b in loader for k, t in zip(b["keys"], b["texts"])}
    assert texts == data.labels and "wav.scp" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="seqshard"):
        batches = list(make_loader(data.wav_scp, batch_size=2, num_workers=0))
    assert (
        "texts" not in batches[0] and caplog.text.count("wav.scp holds KEY PATH lines (a wav.scp) and no labels") == 1
    )
    assert "pass labels= the Kaldi text file of the same keys" in caplog.text  # said once, not a word before


def test_a_wav_scp_of_paths_relative_to_another_folder_reads_with_path_root(tmp_path):
    data = write_audio_dir(tmp_path / "corpus/wav", utts=3)  # a data dir made elsewhere: paths from corpus/
    scp = tmp_path / "lists/wav.scp"
    scp.parent.mkdir()
    scp.write_text("".join(f"{key} wav/{key}.wav\n" for key in data.audio))
    with pytest.raises(InputError, match=r"cannot open 'wav/utt000\.wav'") as error:
        list(make_loader(scp, labels=data.text, batch_size=3, num_workers=0))
    assert error.value.reason == "missing_audio"
    (batch,) = list(make_loader(scp, labels=data.text, batch_size=3, num_workers=0, path_root=tmp_path / "corpus"))
    assert {k: a[: int(n)].tolist() for k, a, n in zip(batch["keys"], batch["audio"], batch["audio_lens"])} == {
        k: (v / 32768).astype(np.float32).tolist() for k, v in data.audio.items()
    }
    with pytest.raises(InputError, match=re.escape(f"path_root={tmp_path}")):
        list(make_loader(scp, labels=data.text, batch_size=3, num_workers=0, path_root=tmp_path))
    with pytest.raises(ConfigError, match="path_root must be a folder"):
        make_loader(scp, path_root=tmp_path / "nowhere")


def test_bad_lists_and_bad_audio_at_load(tmp_path):
    good = write_audio_dir(tmp_path / "d", utts=4)
    (tmp_path / "shards.list").write_text("a.tar\nmissing.tar\n")
    ShardWriter(tmp_path / "a.tar").commit()
    with pytest.raises(Exception, match=r"missing.tar \(named in .*shards.list, but it does not exist\)"):
        make_loader(tmp_path / "shards.list", batch_size=2)
    (tmp_path / "odd.list").write_text("a.tar\nnot a shard\n")
    with pytest.raises(ConfigError, match=r"odd.list line 2: 'not a shard' is not a shard path"):
        make_loader(tmp_path / "odd.list", batch_size=2)
    lines = [json.dumps({"key": k, "wav": str(good.root / f"{k}.wav"), "txt": "x"}) for k in good.keys]
    lines.insert(1, json.dumps({"key": "gone", "wav": str(tmp_path / "gone.wav"), "txt": "x"}))
    (tmp_path / "corrupt.wav").write_bytes(
        (REALDATA / "kaldi/kaldi-pr1626-fsdd-digits/corrupt/digits_audio/test/Speaker1/3_jackson_1.wav").read_bytes()
    )
    lines.insert(3, json.dumps({"key": "corrupt", "wav": str(tmp_path / "corrupt.wav"), "txt": "x"}))
    lines.insert(4, json.dumps({"key": "late", "wav": str(good.root / "utt000.wav"), "start": 5.0, "end": 6.0}))
    (tmp_path / "data.list").write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=r"data.list sample 2 \(key 'gone'\): cannot open") as error:
        list(make_loader(tmp_path / "data.list", batch_size=2, num_workers=0))
    assert "skip_bad" in str(error.value)
    loader = make_loader(tmp_path / "data.list", batch_size=2, num_workers=2, skip_bad=True)
    keys = sorted(k for b in loader for k in b["keys"])
    assert keys == sorted(good.keys)
    rank = loader.last_summary["ranks"][0]
    assert rank["dropped"] == {"missing_audio": 1, "unreadable_audio": 1, "bad_segment": 1}
    assert rank["planned"] == 7 == rank["utts"] + sum(rank["dropped"].values())
    listed = json.dumps({"key": "l", "wav": str(good.root / "utt000.wav"), "txt": ["a", "b"]})  # was "['a', 'b']"
    bad_lines = [lines[0], "{not json", '{"key": "k"}', '{"key": "s", "wav": "x.wav", "start": null}', listed, lines[2]]
    (tmp_path / "bad.list").write_text("\n".join(bad_lines) + "\n")
    with pytest.raises(InputError, match=r"bad.list sample 2 \(key 'line-2'\): the line is not JSON"):
        list(make_loader(tmp_path / "bad.list", batch_size=2, num_workers=0))
    loader = make_loader(tmp_path / "bad.list", batch_size=2, num_workers=0, skip_bad=True)
    assert sorted(k for b in loader for k in b["keys"]) == sorted([good.keys[0], good.keys[1]])
    assert loader.last_summary["ranks"][0]["dropped"] == {"malformed_line": 4}


def test_a_nemo_manifest_given_as_a_list_names_what_it_holds_and_what_a_list_must(tmp_path):
    """Audio options over it said "these hold: read_error.txt" (issue 23, item 20)."""
    wav = REALDATA / "audio/librispeech/1995-1837-0001.wav"
    record = {"audio_filepath": str(wav), "duration": 1.2, "text": "hello"}
    (tmp_path / "train.list").write_text(json.dumps(record) + "\n")
    loader = make_loader(tmp_path / "train.list", features="fbank", batch_size=2, num_workers=0)
    with pytest.raises(InputError, match=r'train.list sample 1 .*holds keys "audio_filepath", "duration", "text"; a '
                       r'line of a sample list .* "key" and "wav" strings') as error:  # fmt: skip
        list(loader)
    assert "read_error" not in str(error.value) and "give the file a .json or .jsonl name" in str(error.value)
    (tmp_path / "train.list").rename(tmp_path / "train.json")  # as that name says, NeMo's
    assert [b["texts"] for b in make_loader(tmp_path / "train.json", batch_size=2, num_workers=0)] == [["hello"]]


def test_channel_and_rate_problems_at_load(tmp_path):
    soundfile.write(tmp_path / "st.wav", np.zeros((800, 2), np.int16) + 5, 8000)
    (tmp_path / "wav.scp").write_text(f"st {tmp_path / 'st.wav'}\n")
    with pytest.raises(InputError, match="channel 3 does not exist"):
        list(make_loader(tmp_path / "wav.scp", batch_size=1, num_workers=0, channel=3))
    with pytest.raises(InputError, match=r"8000 Hz where fbank is set for 16000 Hz. Fix: pass resample_to=16000"):
        list(make_loader(tmp_path / "wav.scp", batch_size=1, num_workers=0, features="fbank"))
    batch = next(
        iter(make_loader(tmp_path / "wav.scp", batch_size=1, num_workers=0, features="fbank", resample_to=16000))
    )
    assert batch["feats"].shape[1] == (1600 - 400) // 160 + 1
    with pytest.raises(ConfigError, match="speed_perturb factors"):
        make_loader(tmp_path / "wav.scp", batch_size=1, speed_perturb=[3.0])
    with pytest.raises(ConfigError, match="spec_augment: unknown option"):
        make_loader(tmp_path / "wav.scp", batch_size=1, spec_augment={"masks": 2})
    with pytest.raises(ConfigError, match=r"need shards that hold audio .*these hold: feats.npy, txt"):
        make_loader(_feature_shards(tmp_path), batch_size=1, num_workers=0, features="fbank")


def test_a_waveform_batch_at_two_rates_gives_each_samples_rate_and_says_so(tmp_path, caplog):
    rates = {"low": 8000, "high": 22050, "high2": 22050}
    for key, rate in rates.items():
        soundfile.write(tmp_path / f"{key}.wav", np.zeros(rate // 10, np.int16) + 5, rate)
    (tmp_path / "wav.scp").write_text("".join(f"{key} {tmp_path / key}.wav\n" for key in rates))
    with caplog.at_level("WARNING", logger="seqshard"):
        (batch,) = list(make_loader(tmp_path / "wav.scp", batch_size=3, num_workers=0))
    assert dict(zip(batch["keys"], batch["sample_rate"].tolist())) == rates  # one rate per sample, (B,)
    assert batch["audio_lens"].tolist() == [rates[key] // 10 for key in batch["keys"]]
    warnings = [r.getMessage() for r in caplog.records if "sample rates" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once, not per sample; it mixed them without a word
    assert re.search(
        r"key '(high2?|low)'\): the audio is at (8000|22050) Hz, but '(high2?|low)' .* at (8000|22050) Hz", warnings[0]
    )
    assert "'low'" in warnings[0] and re.search(r"Pass resample_to=(8000|22050)", warnings[0])
    caplog.clear()
    with caplog.at_level("WARNING", logger="seqshard"):
        (batch,) = list(make_loader(tmp_path / "wav.scp", batch_size=3, num_workers=0, resample_to=16000))
    assert batch["sample_rate"].tolist() == [16000] * 3 and not [r for r in caplog.records if "rate" in r.getMessage()]


def _feature_shards(tmp_path):
    from conftest import write_kaldi_dir

    data = write_kaldi_dir(tmp_path / "k", speakers=1, per_speaker=2)
    pack_data(data.scp, data.text, tmp_path / "fs", progress=False)
    return tmp_path / "fs"


def test_a_list_with_a_pipe_is_refused_even_with_skip_bad(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / "wav.scp").write_text(f"p touch {marker}; cat x.wav |\n")
    for skip_bad in (False, True):
        with pytest.raises(InputError, match="does not run commands found in data"):
            list(make_loader(tmp_path / "wav.scp", batch_size=1, num_workers=0, skip_bad=skip_bad))
    assert not marker.exists()


def test_lists_with_repeated_keys_tabs_or_a_bom(tmp_path):
    data = write_audio_dir(tmp_path / "d", utts=3)
    lines = data.wav_scp.read_text().splitlines()
    (tmp_path / "dup.scp").write_text("\n".join([*lines, lines[1]]) + "\n")
    with pytest.raises(ConfigError, match=r"dup.scp: samples 2, 4 have the same key"):
        make_loader(tmp_path / "dup.scp", batch_size=1)
    (tmp_path / "tabs.scp").write_text("\ufeff" + "\n".join(line.replace(" ", "\t", 1) for line in lines) + "\n")
    keys = sorted(k for b in make_loader(tmp_path / "tabs.scp", batch_size=1, num_workers=0) for k in b["keys"])
    assert keys == sorted(data.keys)  # the BOM is not part of the first key; tabs split like spaces
    (tmp_path / "empty.list").write_text("\n")
    with pytest.raises(ConfigError, match="holds no samples"):
        make_loader(tmp_path / "empty.list", batch_size=1)


def test_feature_stages_need_features(audio_shards, tmp_path, capsys):
    _, shards = audio_shards
    with pytest.raises(ConfigError, match="cmvn and spec_augment work on features, and these shards hold audio"):
        make_loader(shards, batch_size=2, spec_augment=True)
    assert main(["cmvn", str(shards), "-o", str(tmp_path / "c.json")]) != 0
    assert "these shards hold audio: compute features for the statistics with --features" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()
    with pytest.raises(ConfigError, match="noise: 1 file"):
        make_loader(shards, batch_size=2, noise=str(tmp_path / "nowhere.scp"))


def test_bad_noise_files_are_skipped_with_skip_bad(audio_shards, tmp_path):
    _, shards = audio_shards
    noise = write_audio_dir(tmp_path / "noise", utts=2, seconds=(0.2, 0.3), seed=4)
    (noise.root / "utt000.wav").write_bytes(b"RIFF damaged")
    options = dict(batch_size=4, num_workers=0, noise=str(noise.wav_scp))
    with pytest.raises(InputError, match="cannot be decoded"):
        list(make_loader(shards, **options))
    loader = make_loader(shards, skip_bad=True, **options)
    assert sum(len(b["keys"]) for b in loader) == 16
