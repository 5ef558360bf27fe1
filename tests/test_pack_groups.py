"""Pack options out of range (length groups that are not finite numbers, audio options) are
refused naming the option, before anything is written."""

import pytest

from seqshard.errors import ConfigError
from seqshard.prep.job import parse_groups


@pytest.mark.parametrize("spec", ["nan:5", "0:inf", "1e400:1e401", "-inf:3"])
def test_bounds_that_are_not_finite_are_refused(spec):
    with pytest.raises(ConfigError, match=rf"filter_group={spec!r}: expected 'LOW:HIGH' in seconds"):
        parse_groups([spec], seconds=True)
    assert parse_groups(["0.5:2.5"], seconds=True)[0].high == 250


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"resample_to": 0},
            r"resample_to must be a sample rate in Hz \(a whole number >= 1000\), got 0",
        ),  # was ignored
        ({"resample_to": -5}, "resample_to must be a sample rate"),  # was soxr's ValueError
        ({"channel": -1}, "channel must be >= 0, got -1"),  # was a bad_channel per utterance
        ({"features": "fbank", "num_mel_bins": 0}, "num_mel_bins must be >= 3, got 0"),
    ],
)
def test_audio_options_out_of_range_are_refused_before_packing(tmp_path, options, message):
    from conftest import write_audio_dir
    from seqshard import pack_data

    data = write_audio_dir(tmp_path / "d", utts=1)
    with pytest.raises(ConfigError, match=message):
        pack_data(None, data.text, tmp_path / "o", wav_scp=data.wav_scp, progress=False, **options)
    assert not (tmp_path / "o").exists()
