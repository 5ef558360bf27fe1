"""Kaldi's per-speaker CMVN: ``pack --utt2spk --cmvn-scp`` records each utterance's speaker and
its speaker's statistics, and ``make_loader(cmvn="speaker")`` applies them as ``apply-cmvn``.

The statistics are Kaldi's own (``compute-cmvn-stats --spk2utt`` in the realdata dirs). No
Kaldi-applied output is in realdata, so the expected features are Kaldi's ``ApplyCmvn``
(kaldi-asr/kaldi ``src/transform/cmvn.cc``) written here from its source; and, independently of
any formula, every speaker's frames come out with mean 0 (and variance 1 with ``--norm-vars``),
as statistics accumulated over exactly those frames imply."""

from __future__ import annotations

import logging

import kaldiio
import numpy as np
import pytest

from conftest import REALDATA, write_kaldi_dir
from seqshard import ConfigError, InputError, make_loader, pack_data

FSDD = REALDATA / "kaldi/kaldi-pr1626-fsdd-digits"  # 10 utterances of one speaker, MFCC, DM statistics
FSDD_MAP = ["/home/abhilash/kaldi/egs/0_MP_Digits/mfcc/=mfcc/"]
WHOLE = REALDATA / "kaldi/generated_kaldi"  # 5 utterances of 4 speakers, compressed fbank


def kaldi_apply_cmvn(feats: np.ndarray, stats: np.ndarray, norm_vars: bool) -> np.ndarray:
    """``ApplyCmvn``: offset and scale per dimension in double, stored in a float matrix
    (``norm``), then ``feats->MulColsVec(scale)`` (with variances) and
    ``feats->AddVecToRows(1.0, offset)`` on the float features."""
    dim = stats.shape[1] - 1
    count = stats[0, dim]
    norm = np.zeros((2, dim), dtype=np.float32)
    for d in range(dim):
        mean = stats[0, d] / count
        if not norm_vars:
            scale, offset = 1.0, -mean
        else:
            var = max(stats[1, d] / count - mean * mean, 1.0e-20)
            scale = 1.0 / np.sqrt(var)
            offset = -(mean * scale)
        norm[0, d], norm[1, d] = offset, scale
    out = feats.astype(np.float32).copy()
    if norm_vars:
        out *= norm[1]
    out += norm[0]
    return out


def read_utt2spk(path):
    return dict(line.split() for line in path.read_text().splitlines())


def pack_fsdd(out, **speakers):
    """The FSDD data dir packed as it is, its absolute ark paths mapped to realdata."""
    data = FSDD / "data/test"
    return pack_data(
        data / "feats.scp", data / "text", out, path_root=FSDD, path_map=FSDD_MAP, progress=False, **speakers
    )


@pytest.fixture(scope="module")
def fsdd(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdd") / "shards"
    data = FSDD / "data/test"
    report = pack_fsdd(out, utt2spk=data / "utt2spk", cmvn_scp=data / "cmvn.scp")
    assert report.packed == 10 and report.dropped == {}
    raw = {
        line.split()[0]: kaldiio.load_mat(str(FSDD / "mfcc" / line.split()[1].rsplit("/", 1)[1]))
        for line in (data / "feats.scp").read_text().splitlines()
    }
    stats = kaldiio.load_mat(str(FSDD / "mfcc/cmvn_test.ark:9"))  # the scp's entry for Speaker1
    return out, raw, stats


def batch_of(pattern, **options):
    loader = make_loader(pattern, batch_size=100, shuffle=False, num_workers=0, **options)
    batch = next(iter(loader))
    return {key: batch["feats"][row, : batch["feat_lens"][row]].numpy() for row, key in enumerate(batch["keys"])}, batch


@pytest.mark.parametrize("norm_vars", [False, True])
def test_kaldis_statistics_applied_as_apply_cmvn_does(fsdd, norm_vars):
    out, raw, stats = fsdd
    assert stats.dtype == np.float64 and stats.shape == (2, 14)
    assert stats[0, -1] == sum(len(m) for m in raw.values())  # the speaker's frames: all ten utterances
    normalized, batch = batch_of(out, cmvn="speaker", cmvn_norm_vars=norm_vars)
    assert batch["spk"] == ["Speaker1"] * 10 and "cmvn" not in batch  # the statistics leave the sample
    for key, feats in normalized.items():
        assert np.array_equal(feats, kaldi_apply_cmvn(raw[key], stats, norm_vars)), key
    frames = np.concatenate(list(normalized.values())).astype(np.float64)
    assert np.abs(frames.mean(axis=0)).max() < 1e-4
    if norm_vars:
        assert np.abs(frames.std(axis=0) - 1).max() < 1e-4


def test_four_speakers_of_compressed_features_each_by_its_own_statistics(tmp_path):
    data = WHOLE / "data/whole"
    pack_data(
        data / "feats.scp",
        data / "text",
        tmp_path / "shards",
        path_root=WHOLE,
        utt2spk=data / "utt2spk",
        cmvn_scp=data / "cmvn.scp",
        progress=False,
    )
    normalized, batch = batch_of(tmp_path / "shards", cmvn="speaker", fields=["feats"])
    assert set(batch) == {"keys", "feats", "feat_lens"}  # fields= asked for none of spk and cmvn: read, then gone
    speaker_of = read_utt2spk(data / "utt2spk")
    assert len(set(speaker_of.values())) == 4
    for speaker in set(speaker_of.values()):
        frames = np.concatenate([f for key, f in normalized.items() if speaker_of[key] == speaker])
        assert np.abs(frames.astype(np.float64).mean(axis=0)).max() < 1e-3, speaker  # CM decoding: 1e-5 off Kaldi's


def test_a_cmvn_scp_by_utterance_without_utt2spk(fsdd, tmp_path):
    _, raw, stats = fsdd
    by_utterance = tmp_path / "cmvn.scp"  # apply-cmvn without --utt2spk looks statistics up by utterance
    by_utterance.write_text("".join(f"{key} {FSDD}/mfcc/cmvn_test.ark:9\n" for key in raw))
    pack_fsdd(tmp_path / "shards", cmvn_scp=by_utterance)
    normalized, batch = batch_of(tmp_path / "shards", cmvn="speaker")
    assert "spk" not in batch
    assert all(np.array_equal(f, kaldi_apply_cmvn(raw[k], stats, False)) for k, f in normalized.items())


@pytest.mark.parametrize(
    "damage, reason, named",
    [
        ("utt2spk", "no_speaker", "utt2spk"),
        ("cmvn.scp", "no_cmvn", "cmvn.scp"),
        ("dim", "bad_cmvn", "cmvn.scp:2"),
        ("mean", "bad_cmvn", r"cmvn.scp:2 \(key 'spk001'\): the statistics give a mean of 1e\+30"),
    ],
)
def test_a_missing_speaker_or_bad_statistics_stop_the_pack_before_a_shard_or_are_counted(
    kaldi_dir, tmp_path, damage, reason, named
):
    utt2spk = tmp_path / "utt2spk"
    speakers = {key: key.split("-")[0] for key in kaldi_dir.keys}
    utt2spk.write_text(
        "".join(f"{k} {s}\n" for k, s in speakers.items() if damage != "utt2spk" or k != kaldi_dir.keys[3])
    )
    stats = {}
    for speaker in sorted(set(speakers.values())):
        frames = np.concatenate([kaldi_dir.arrays[k] for k, s in speakers.items() if s == speaker]).astype(np.float64)
        dim = frames.shape[1] - (damage == "dim" and speaker == "spk001")
        stats[speaker] = np.stack(
            [np.append(frames[:, :dim].sum(0), len(frames)), np.append((frames[:, :dim] ** 2).sum(0), 0)]
        )
        if damage == "mean" and speaker == "spk001":
            stats[speaker][0, 0] = 1e30 * len(frames)  # was packed, and applied as it is
    if damage == "cmvn.scp":
        del stats["spk002"]
    kaldiio.save_ark(str(tmp_path / "cmvn.ark"), stats, scp=str(tmp_path / "cmvn.scp"))
    options = dict(utt2spk=utt2spk, cmvn_scp=tmp_path / "cmvn.scp", progress=False)
    with pytest.raises(InputError, match=named) as error:
        pack_data(kaldi_dir.scp, kaldi_dir.text, tmp_path / "stop", **options)
    assert error.value.reason == reason and not list((tmp_path / "stop").glob("*.tar"))
    report = pack_data(kaldi_dir.scp, kaldi_dir.text, tmp_path / "skip", skip_bad=True, **options)
    dropped = (
        1
        if damage == "utt2spk"
        else sum(s == ("spk002" if damage == "cmvn.scp" else "spk001") for s in speakers.values())
    )
    assert report.dropped == {reason: dropped} and report.packed + dropped == report.input_utts == len(speakers)


def test_the_loader_refuses_what_cannot_normalize(fsdd, packed):
    with pytest.raises(ConfigError, match=r"--utt2spk utt2spk --cmvn-scp cmvn\.scp"):
        make_loader(packed.pattern, cmvn="speaker", num_workers=0)
    with pytest.raises(ConfigError, match="cmvn_norm_vars is Kaldi's --norm-vars for cmvn='speaker'"):
        make_loader(fsdd[0], cmvn_norm_vars=True, num_workers=0)


@pytest.mark.parametrize(
    ("mean", "square", "norm_vars", "named"),
    [
        (1e300, 1.0, False, r"a mean of 1e\+300 in dimension 0 \(of 3 beyond 1e\+10\)"),
        (1e30, 1e60, False, r"a mean of 1e\+30 in dimension 0"),  # was applied as it is
        (1e30, 1e60, True, r"a mean of 1e\+30 in dimension 0"),
        (3.0, 1e24, True, r"a standard deviation of 1e\+12 in dimension 0"),
        (3.0, 1e24, False, None),  # means only: the squares play no part
        (-3.0, 3.0, True, None),  # a negative variance: floored, as Kaldi floors it
    ],
)
def test_statistics_beyond_any_features_are_refused_not_applied(mean, square, norm_vars, named):
    from seqshard.features.speaker_cmvn import SpeakerCmvn, stats_problem

    count, dim = 10.0, 3
    stats = np.array([[mean * count] * dim + [count], [square * count] * dim + [0.0]])
    feats = np.ones((4, dim), dtype=np.float32)
    if named is None:
        assert stats_problem(stats, dim) is None
        assert np.abs(SpeakerCmvn(norm_vars).normalize(feats, stats)).max() < 1e11
        return
    with pytest.raises(ValueError, match=named):
        SpeakerCmvn(norm_vars).normalize(feats, stats)
    assert (stats_problem(stats, dim) is None) == ("deviation" in named)  # pack refuses absurd means


def _speaker_shards(tmp_path, edit):
    """A Kaldi dir of 3 speakers ``flooredNNN`` packed with utt2spk and each speaker's exact
    statistics, changed by ``edit(stats)`` first; returns the dir and the shards."""
    data = write_kaldi_dir(tmp_path / "d", speakers=3, per_speaker=3, prefix="floored")
    speakers = {key: key.split("-")[0] for key in data.keys}
    (tmp_path / "utt2spk").write_text("".join(f"{k} {s}\n" for k, s in speakers.items()))
    stats = {}
    for speaker in sorted(set(speakers.values())):
        frames = np.concatenate([data.arrays[k] for k, s in speakers.items() if s == speaker]).astype(np.float64)
        stats[speaker] = np.stack([np.append(frames.sum(0), len(frames)), np.append((frames**2).sum(0), 0)])
    edit(stats)
    kaldiio.save_ark(str(tmp_path / "cmvn.ark"), stats, scp=str(tmp_path / "cmvn.scp"))
    pack_data(
        data.scp, data.text, tmp_path / "shards", utt2spk=tmp_path / "utt2spk", cmvn_scp=tmp_path / "cmvn.scp",
        progress=False,
    )  # fmt: skip
    return data, stats, tmp_path / "shards"


def test_a_zero_sum_of_squares_is_floored_as_kaldi_does_and_said_once_naming_the_speaker(tmp_path, caplog):
    """It was applied without a word (features up to 9.5e10)."""

    def zero_squares(stats):
        stats["floored001"][1, :3] = 0.0  # dimensions 0-2: a negative variance, floored at 1e-20

    data, stats, shards = _speaker_shards(tmp_path, zero_squares)
    with caplog.at_level(logging.WARNING, logger="seqshard"):
        normalized, _ = batch_of(shards, cmvn="speaker", cmvn_norm_vars=True)
    for key, feats in normalized.items():
        np.testing.assert_array_equal(feats, kaldi_apply_cmvn(data.arrays[key], stats[key.split("-")[0]], True))
    said = [r.getMessage() for r in caplog.records if "floored at 1e-20" in r.getMessage()]
    assert len(said) == 1, said  # once for the speaker's 3 utterances
    assert "speaker 'floored001' give dimension(s) 0, 1, 2 a variance below 1e-20" in said[0]
    assert "multiplied by 1e+10" in said[0] and "compute-cmvn-stats" in said[0]


def test_an_absurd_variance_is_refused_by_the_loader_or_counted(tmp_path):
    def absurd(stats):
        stats["floored002"][1, 4] = 1e30 * stats["floored002"][0, -1]  # a standard deviation of 1e15

    _, _, shards = _speaker_shards(tmp_path, absurd)
    with pytest.raises(InputError, match=r"standard deviation of 1e\+15 in dimension 4") as error:
        batch_of(shards, cmvn="speaker", cmvn_norm_vars=True)
    assert error.value.reason == "bad_cmvn"
    loader = make_loader(shards, batch_size=100, num_workers=0, cmvn="speaker", cmvn_norm_vars=True, skip_bad=True)
    assert sum(len(batch["keys"]) for batch in loader) == 6
    assert loader.last_summary["ranks"][0]["dropped"] == {"bad_cmvn": 3}
    assert sum(len(b["keys"]) for b in make_loader(shards, batch_size=100, num_workers=0, cmvn="speaker")) == 9
