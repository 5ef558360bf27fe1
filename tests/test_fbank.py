"""seqshard.features.fbank against Kaldi's own compute-fbank-feats output and against kaldi-native-fbank."""

import wave

import kaldi_native_fbank as knf
import kaldiio
import numpy as np
import pytest

from conftest import REALDATA
from seqshard.features.fbank import FbankOptions, fbank, num_frames

GENERATED = REALDATA / "kaldi" / "generated_kaldi"
AUDIO = REALDATA / "audio"
WAVS = {
    "1995-1837-0001": AUDIO / "librispeech" / "1995-1837-0001.wav",
    "BAC009S0724W0121": AUDIO / "aishell1" / "BAC009S0724W0121.wav",
}
# Measured: 4.7e-4 (1995-1837-0001) and 1.8e-4 (BAC009S0724W0121); kaldi-native-fbank gets
# 1.2e-3 and 1.6e-4 on the same pair. Both differ from Kaldi only by float32 rounding.
KALDI_TOL = 1e-3
# Against kaldi-native-fbank on the synthetic cases below the worst measured difference is
# 1.5e-4 (log mel and log energy), and linear outputs agree to 7.5e-5 relative.
KNF_TOL = 5e-4
KNF_RTOL_LINEAR = 3e-4


def read_wav(path):
    """Samples of a 16-bit PCM wav in Kaldi's scale (int16 values, not divided by 32768)."""
    with wave.open(str(path)) as f:
        assert f.getsampwidth() == 2 and f.getnchannels() == 1
        return f.getframerate(), np.frombuffer(f.readframes(f.getnframes()), dtype="<i2")


def kaldi_feats(scp_name):
    """Matrices from a feats scp whose paths are relative to generated_kaldi/."""
    feats = {}
    for line in (GENERATED / "feats" / scp_name).read_text().splitlines():
        key, path = line.split()
        feats[key] = kaldiio.load_mat(str(GENERATED / path))
    return feats


@pytest.mark.parametrize("key", sorted(WAVS))
def test_matches_kaldi_compute_fbank_feats(key):
    if not WAVS[key].exists():
        pytest.skip(f"{WAVS[key].relative_to(REALDATA)} not copied into tests/realdata yet")
    # The ark was written with this config and Kaldi's defaults otherwise.
    assert (GENERATED / "conf" / "fbank.conf").read_text().split() == [
        "--num-mel-bins=80",
        "--dither=0.0",
        "--sample-frequency=16000",
    ]
    expected = kaldi_feats("fbank80_fm.scp")[key]
    rate, samples = read_wav(WAVS[key])
    got = fbank(samples, FbankOptions(sample_rate=rate, num_mel_bins=80, dither=0.0))
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.abs(got - expected).max() < KALDI_TOL


def knf_fbank(samples, opts):
    """kaldi-native-fbank's features for the same options, frame by frame."""
    o = knf.FbankOptions()
    frame = o.frame_opts
    frame.samp_freq = opts.sample_rate
    frame.frame_length_ms = opts.frame_length_ms
    frame.frame_shift_ms = opts.frame_shift_ms
    frame.dither = 0.0
    frame.preemph_coeff = opts.preemphasis
    frame.remove_dc_offset = opts.remove_dc_offset
    frame.window_type = opts.window
    frame.round_to_power_of_two = opts.round_to_power_of_two
    frame.snip_edges = opts.snip_edges
    o.mel_opts.num_bins = opts.num_mel_bins
    o.mel_opts.low_freq = opts.low_freq
    o.mel_opts.high_freq = opts.high_freq
    o.use_energy = opts.use_energy
    o.energy_floor = opts.energy_floor
    o.use_log_fbank = opts.use_log_fbank
    o.use_power = opts.use_power
    computer = knf.OnlineFbank(o)
    computer.accept_waveform(opts.sample_rate, samples.astype(np.float32))
    computer.input_finished()
    frames = [computer.get_frame(i) for i in range(computer.num_frames_ready)]
    return np.stack(frames) if frames else np.zeros((0, opts.dim), np.float32)


def synthetic(kind, rate, length, seed=0):
    """int16-valued test audio: noise, or two tones over quiet noise, both with a DC offset."""
    rng = np.random.default_rng(seed)
    noise = rng.normal(0.0, 800.0 if kind == "noise" else 30.0, length)
    t = np.arange(length) / rate
    tones = 0.0 if kind == "noise" else 6000 * np.sin(2 * np.pi * 440 * t) + 2000 * np.sin(2 * np.pi * 2500 * t + 1)
    return np.clip(np.round(noise + tones + 150), -32768, 32767).astype(np.int16)


KNF_CASES = {
    "16k-noise-3s": ("noise", 16000, 49_999, {}),
    "16k-tones-23bins": ("tones", 16000, 16_000, {"num_mel_bins": 23}),
    "8k-tones-hamming": ("tones", 8000, 5_841, {"window": "hamming", "num_mel_bins": 40}),
    "8k-noise-hanning-no-snip": ("noise", 8000, 7_777, {"window": "hanning", "snip_edges": False}),
    "16k-tones-rect-energy": ("tones", 16000, 12_345, {"window": "rectangular", "use_energy": True}),
    "16k-noise-energy-floor": ("noise", 16000, 8_000, {"use_energy": True, "energy_floor": 1e12}),
    "16k-one-frame": ("tones", 16000, 400, {}),
    "16k-shorter-than-a-frame": ("noise", 16000, 399, {}),
    "16k-short-no-snip": ("tones", 16000, 399, {"snip_edges": False}),
    "16k-tiny-no-snip-repeated-mirror": ("noise", 16000, 90, {"snip_edges": False, "use_energy": True}),
    "8k-no-preemph-no-dc-no-pow2": (
        "tones",
        8000,
        4_000,
        {"preemphasis": 0.0, "remove_dc_offset": False, "round_to_power_of_two": False, "num_mel_bins": 23},
    ),
    "16k-band-and-odd-shift": (
        "noise",
        16000,
        10_007,
        {"low_freq": 64.0, "high_freq": -400.0, "frame_shift_ms": 12.5, "frame_length_ms": 20.0},
    ),
    "16k-explicit-high-freq": ("tones", 16000, 6_000, {"high_freq": 7000.0, "num_mel_bins": 64}),
}


@pytest.mark.parametrize("case", sorted(KNF_CASES))
def test_matches_kaldi_native_fbank(case):
    kind, rate, length, extra = KNF_CASES[case]
    opts = FbankOptions(sample_rate=rate, **extra)
    samples = synthetic(kind, rate, length)
    got, expected = fbank(samples, opts), knf_fbank(samples, opts)
    assert got.shape == expected.shape == (num_frames(length, opts), opts.dim)
    if len(got):
        assert np.abs(got - expected).max() < KNF_TOL


@pytest.mark.parametrize("extra", [{"use_log_fbank": False}, {"use_log_fbank": False, "use_power": False}])
def test_linear_outputs_match_kaldi_native_fbank(extra):
    opts = FbankOptions(num_mel_bins=40, **extra)
    samples = synthetic("tones", 16000, 8_000)
    np.testing.assert_allclose(fbank(samples, opts), knf_fbank(samples, opts), rtol=KNF_RTOL_LINEAR)


@pytest.mark.parametrize("snip_edges", [True, False])
def test_num_frames_matches_kaldi_native_fbank(snip_edges):
    opts = FbankOptions(sample_rate=8000, num_mel_bins=23, snip_edges=snip_edges)
    for length in [0, 1, 39, 40, 41, 199, 200, 201, 279, 280, 281, 1000]:
        samples = synthetic("noise", 8000, length)
        assert num_frames(length, opts) == len(knf_fbank(samples, opts)) == len(fbank(samples, opts)), length


@pytest.mark.parametrize(
    ("changes", "option"),
    [
        ({"sample_rate": 0}, "sample_rate"),
        ({"num_mel_bins": 2}, "num_mel_bins"),
        ({"num_mel_bins": 80.0}, "num_mel_bins"),
        ({"sample_rate": 8000, "num_mel_bins": 200}, "num_mel_bins"),
        ({"frame_length_ms": 0.0}, "frame_length_ms"),
        ({"frame_length_ms": float("nan")}, "frame_length_ms"),
        ({"frame_length_ms": 25.0625, "round_to_power_of_two": False}, "frame_length_ms"),
        ({"frame_shift_ms": 0.01}, "frame_shift_ms"),
        ({"dither": -1.0}, "dither"),
        ({"preemphasis": 1.5}, "preemphasis"),
        ({"window": "blackman"}, "window"),
        ({"low_freq": 8000.0}, "low_freq"),
        ({"low_freq": -1.0}, "low_freq"),
        ({"high_freq": 9000.0}, "high_freq"),
        ({"high_freq": -7990.0}, "high_freq"),
        ({"energy_floor": -1.0}, "energy_floor"),
    ],
)
def test_bad_options_name_the_option(changes, option):
    with pytest.raises(ValueError, match=option):
        FbankOptions(**changes)


def test_frame_geometry_is_kaldis():
    assert (FbankOptions().window_size, FbankOptions().window_shift, FbankOptions().fft_size) == (400, 160, 512)
    opts = FbankOptions(sample_rate=8000, num_mel_bins=23, round_to_power_of_two=False)
    assert (opts.window_size, opts.window_shift, opts.fft_size) == (200, 80, 200)
    assert FbankOptions(use_energy=True).dim == 81


def test_bad_waveforms_are_rejected():
    with pytest.raises(ValueError, match="1-D"):
        fbank(np.zeros((2, 400)), FbankOptions())
    with pytest.raises(ValueError, match="rng"):
        fbank(np.zeros(400), FbankOptions(dither=1.0))


@pytest.mark.parametrize("length", [0, 1, 399])
def test_shorter_than_a_frame_gives_no_frames(length):
    for opts in [FbankOptions(), FbankOptions(use_energy=True)]:
        got = fbank(np.ones(length, np.int16), opts)
        assert got.shape == (0, opts.dim) and got.dtype == np.float32


def test_dither_is_reproducible_with_the_same_rng():
    samples = synthetic("noise", 16000, 30_000)
    opts = FbankOptions(dither=1.0)
    first = fbank(samples, opts, np.random.default_rng(7))
    assert np.array_equal(first, fbank(samples, opts, np.random.default_rng(7)))
    assert not np.array_equal(first, fbank(samples, opts, np.random.default_rng(8)))
    # dither 1.0 is tiny next to noise of std 800: only a small perturbation of the features
    assert np.abs(first - fbank(samples, FbankOptions())).max() < 0.05


def test_int16_and_float_input_agree():
    samples = synthetic("tones", 16000, 5_000)
    assert np.array_equal(fbank(samples, FbankOptions()), fbank(samples.astype(np.float64), FbankOptions()))
