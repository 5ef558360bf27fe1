"""Packing what real Kaldi wrote (tests/realdata): multi-ark scps, every compression kind,
data dirs from another machine, damaged arks."""

import json

import numpy as np

from conftest import REALDATA, read_shards
from seqshard import ShardIndex, pack_data

KALDI = REALDATA / "kaldi"
EXPECTED = json.loads((KALDI / "EXPECTED.json").read_text())


def test_kaldi_data_dir_with_scp_over_two_compressed_arks(tmp_path):
    root = KALDI / "generated_kaldi"
    report = pack_data(
        root / "data/whole/feats.scp",
        root / "data/whole/text",
        tmp_path / "out",
        path_root=root,
        filter_group=["0:500", "500:2000"],
        progress=False,
    )
    assert report.packed == 5 and report.groups["0_500"].utts == 3 and report.groups["500_2000"].utts == 2
    found = read_shards(sorted((tmp_path / "out").rglob("*.tar")))
    lengths = {k: a.shape[0] for k, (a, _, _) in found.items()}
    assert lengths == {
        "1995-1837-0001": 871,
        "2412-153948-0000": 1164,
        "BAC009S0724W0121": 426,
        "BAC009S0764W0121": 418,
        "BAC009S0764W0122": 410,
    }
    assert found["BAC009S0764W0121"][1] == "甚至 出现 交易 几乎 停滞 的 情况"
    # the frame counts came from utt2num_frames (Kaldi writes a trailing space after each)
    assert ShardIndex.load(tmp_path / "out" / "0_500").feature["dim"] == 80


def test_every_compression_method_packs_to_kaldis_own_decoding(tmp_path):
    root = KALDI / "generated_kaldi"
    text = tmp_path / "text"
    text.write_text("1995-1837-0001 A\nBAC009S0724W0121 B\n")
    for method in range(1, 8):
        out = tmp_path / f"m{method}"
        pack_data(root / f"feats/fbank80_method{method}.scp", text, out, path_root=root, progress=False)
        found = read_shards(out.glob("*.tar"))
        for key, expected in EXPECTED[f"kaldi/generated_kaldi/feats/fbank80_method{method}.ark"]["utts"].items():
            decoded = expected["kaldi_decoded"]
            assert list(found[key][0].shape) == decoded["shape"]
            np.testing.assert_allclose(found[key][0].reshape(-1)[:3], decoded["first"], atol=1e-4)
            assert abs(float(found[key][0].sum(dtype=np.float64)) - decoded["sum"]) < 1e-6 * abs(decoded["sum"]) + 1e-2


def test_make_mfcc_output_uses_its_frame_shift_file(tmp_path):
    root = KALDI / "lhotse-mini_librispeech2"
    pack_data(root / "feats.scp", root / "text", tmp_path / "out", path_root=root, progress=False)
    index = ShardIndex.load(tmp_path / "out")
    assert index.num_frames == 1987 + 693 + 969 and index.feature["dim"] == 13
    assert index.feature["frame_shift_ms"] == 10.0


def test_recipe_from_another_machine_with_a_git_damaged_ark(tmp_path):
    root = KALDI / "kaldi-pr1626-fsdd-digits"
    remap = ["/home/abhilash/kaldi/egs/0_MP_Digits/mfcc/=mfcc/"]
    good = pack_data(
        root / "data/test/feats.scp",
        root / "data/test/text",
        tmp_path / "good",
        path_root=root,
        path_map=remap,
        progress=False,
    )
    assert good.packed == 10 and good.dropped == {}

    bad_scp = tmp_path / "train.scp"
    bad_scp.write_text((root / "corrupt/mfcc/raw_mfcc_train.1.scp").read_text())
    text = tmp_path / "text"
    text.write_text("".join(f"{line.split()[0]} digit\n" for line in bad_scp.read_text().splitlines()))
    report = pack_data(
        bad_scp,
        text,
        tmp_path / "bad",
        path_root=root,
        path_map=["/home/abhilash/kaldi/egs/0_MP_Digits/mfcc/=corrupt/mfcc/"],
        skip_bad=True,
        progress=False,
    )
    assert report.packed == 9 and report.dropped == {"bad_offset": 79, "damaged_value": 1}


def test_text_ark_ranges_and_repeated_keys_from_kaldi_io(tmp_path):
    root = KALDI / "kaldi-io-for-python"
    text = tmp_path / "text"
    keys = [line.split()[0] for line in (root / "tests/data/feats_ascii.scp").read_text().splitlines()]
    text.write_text("".join(f"{k} x\n" for k in dict.fromkeys(keys)))
    report = pack_data(
        root / "tests/data/feats_ascii.scp", text, tmp_path / "out", path_root=root, skip_bad=True, progress=False
    )
    # 6 lines, one key given three times: the first ([0:5], 6 rows, inclusive) is kept and the
    # two repeats (one of them with Kaldi's out-of-range column range) are counted
    assert (report.input_utts, report.packed, report.dropped) == (6, 4, {"duplicate_key": 2})
    found = read_shards((tmp_path / "out").glob("*.tar"))
    assert found["AMI_ES2011a_H00_FEE041_0003714_0003915_slice2"][0].shape == (6, 13)
