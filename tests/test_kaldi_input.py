"""Reading what real Kaldi writes, and refusing what would silently give wrong data."""

import itertools
import json
from collections import Counter
from pathlib import Path

import kaldiio
import numpy as np
import pytest

from conftest import REALDATA, read_shards
from seqshard import pack_data
from seqshard.errors import InputError, Where, command_line_flags
from seqshard.formats.keys import key_problem
from seqshard.formats.peers.kaldi import MatrixReader, iter_lines, parse_line, parse_location

GENERATED = REALDATA / "kaldi" / "generated_kaldi"
EXPECTED = json.loads((REALDATA / "kaldi" / "EXPECTED.json").read_text())


def read_scp(scp: Path, root: Path, **kwargs):
    out = {}
    with MatrixReader(**{k: v for k, v in kwargs.items() if k == "allow_pipes"}) as reader:
        for number, _, raw in iter_lines(scp):
            where = Where(scp, number)
            key, value = parse_line(raw, where, needs_value=True)
            location = parse_location(value, where, kwargs.get("path_map", ()), root)
            out[key] = (reader.read(location, where), reader.shape(location, where))
    return out


@pytest.mark.parametrize("method", range(1, 8))
def test_every_kaldi_compression_method_decodes_as_kaldi_does(method):
    ark = f"kaldi/generated_kaldi/feats/fbank80_method{method}.ark"
    got = read_scp(GENERATED / f"feats/fbank80_method{method}.scp", GENERATED)
    for key, expected in EXPECTED[ark]["utts"].items():
        array, shape = got[key]
        decoded = expected["kaldi_decoded"]
        assert list(array.shape) == decoded["shape"] == list(shape)
        assert array.min() == pytest.approx(decoded["min"], abs=1e-4)
        assert array.max() == pytest.approx(decoded["max"], abs=1e-4)
        np.testing.assert_allclose(array.reshape(-1)[:3], decoded["first"], atol=1e-4)
        assert float(array.sum(dtype=np.float64)) == pytest.approx(decoded["sum"], rel=1e-6, abs=1e-2)


def test_short_matrix_written_as_cm2_by_kaldi_default_reads():
    got = read_scp(GENERATED / "feats/short_segment_auto.scp", GENERATED)
    ((array, shape),) = got.values()
    assert array.shape == shape == (7, 80)


def test_kaldi_ranges_are_inclusive_and_checked():
    got = read_scp(GENERATED / "feats/ranged_hand_written.scp", GENERATED)
    shapes = {key: array.shape for key, (array, _) in got.items()}
    assert shapes == {
        "1995-1837-0001-rows0to99": (100, 80),
        "BAC009S0724W0121-rows100to199-cols0to39": (100, 40),
        "BAC009S0764W0122-cols40to79": (410, 40),
    }
    resolved = dict(kaldiio.load_ark(str(GENERATED / "feats/ranged_resolved_by_kaldi.ark")))
    for key, (array, _) in got.items():
        np.testing.assert_allclose(array, resolved[key], atol=1e-5)


def test_out_of_range_columns_fail_like_kaldi_not_clipped_like_kaldiio():
    root = REALDATA / "kaldi" / "kaldi-io-for-python"
    scp = root / "tests/data/feats_ascii.scp"
    lines = list(iter_lines(scp))
    with MatrixReader() as reader:
        key, value = parse_line(lines[3][2], Where(scp, 4), True)  # [0:5] -> 6 rows, text ark
        assert reader.read(parse_location(value, Where(scp, 4), root=root), Where(scp, 4)).shape == (6, 13)
        key, value = parse_line(lines[4][2], Where(scp, 5, "x"), True)
        with pytest.raises(InputError) as error:
            reader.read(parse_location(value, Where(scp, 5), root=root), Where(scp, 5, key))
    assert error.value.reason == "bad_range"
    assert "feats_ascii.scp:5" in str(error.value) and "199x13" in str(error.value)


def test_scp_offsets_damaged_by_git_are_detected_not_decoded():
    root = REALDATA / "kaldi" / "kaldi-pr1626-fsdd-digits"
    scp = root / "corrupt/mfcc/raw_mfcc_train.1.scp"
    path_map = (("/home/abhilash/kaldi/egs/0_MP_Digits/mfcc/", "corrupt/mfcc/"),)
    entries = []
    for number, _, raw in iter_lines(scp):
        where = Where(scp, number)
        key, value = parse_line(raw, where, True)
        entries.append((key, parse_location(value, where, path_map, root), Where(scp, number, key)))
    # the next value the scp lists in the ark, as the pack's plan gives it to the reader
    by_offset = sorted(entries, key=lambda entry: entry[1].offset)
    successor = {a[0]: (b[1].offset, b[0]) for a, b in itertools.pairwise(by_offset)}
    good, bad = 0, []
    with MatrixReader() as reader:
        for key, location, where in entries:
            try:
                reader.read(location, where, successor.get(key))
                good += 1
            except InputError as error:
                bad.append(error)
    # git removed one CR inside line 10's value: read by its header's size, the value runs one
    # byte into the next key; the 79 values after it are one byte before their scp offsets
    assert (good, len(bad)) == (9, 80)
    assert Counter(e.reason for e in bad) == {"bad_offset": 79, "damaged_value": 1}
    assert bad[0].reason == "damaged_value" and "raw_mfcc_train.1.scp:10 (key 'Speaker10_9')" in str(bad[0])
    assert "byte 7095" in str(bad[0]) and "'Speaker2_0'" in str(bad[0]) and "raw_mfcc_train.1.ark" in str(bad[0])
    assert "raw_mfcc_train.1.scp:11" in str(bad[1])


def test_absolute_paths_from_another_machine_are_remapped():
    root = REALDATA / "kaldi" / "kaldi-pr1626-fsdd-digits"
    got = read_scp(
        root / "data/test/feats.scp", root, path_map=(("/home/abhilash/kaldi/egs/0_MP_Digits/mfcc/", "mfcc/"),)
    )
    assert len(got) == 10 and all(a.shape[1] == 13 for a, _ in got.values())


def test_vectors_pickles_and_pipes_are_refused(tmp_path):
    conf = REALDATA / "kaldi" / "kaldi-io-for-python"
    with MatrixReader() as reader:
        _, _, raw = next(iter_lines(conf / "tests/data/conf.scp"))
        key, value = parse_line(raw, Where("conf.scp", 1), True)
        with pytest.raises(InputError) as error:
            reader.read(parse_location(value, Where("conf.scp", 1), root=conf), Where("conf.scp", 1, key))
        assert error.value.reason == "not_a_matrix"

        kaldiio.save_ark(
            str(tmp_path / "p.ark"), {"k": np.zeros((2, 2))}, scp=str(tmp_path / "p.scp"), write_function="pickle"
        )
        value = (tmp_path / "p.scp").read_text().split()[1]
        with pytest.raises(InputError, match="never unpickles") as error:
            reader.read(parse_location(value, Where("p.scp", 1)), Where("p.scp", 1, "k"))

        marker = tmp_path / "ran"
        pipe = parse_location(f"touch {marker} |", Where("x", 1))
        with pytest.raises(InputError, match="allow_pipes=True") as error:
            reader.read(pipe, Where("x", 1, "k"))
        assert error.value.reason == "pipe_refused" and not marker.exists()
        with command_line_flags({}):  # as run from the command line
            with pytest.raises(InputError) as error:
                reader.read(pipe, Where("x", 1, "k"))
            assert "or pass --allow-pipes. Or pass --skip-bad to count" in str(error.value)


def test_pipes_run_when_allowed(tmp_path):
    kaldiio.save_mat(str(tmp_path / "m.mat"), np.ones((3, 4), np.float32))  # one keyless object, as Kaldi pipes give
    with MatrixReader(allow_pipes=True) as reader:
        array = reader.read(parse_location(f"cat {tmp_path / 'm.mat'} |", Where("x", 1)), Where("x", 1))
    assert array.shape == (3, 4)


def test_table_lines_are_split_like_kaldi_and_errors_name_the_line(tmp_path):
    text = tmp_path / "text"
    text.write_bytes("a  甚至  出现 \n\nb\n".encode() + b"c \xff\xfe\n")
    rows = list(iter_lines(text))
    assert parse_line(rows[0][2], Where(text, 1), False) == ("a", "甚至  出现")
    with pytest.raises(InputError, match=r"text:2: the line is empty"):
        parse_line(rows[1][2], Where(text, 2), False)
    assert parse_line(rows[2][2], Where(text, 3), False) == ("b", "")
    with pytest.raises(InputError, match=r"text:3 \(key 'b'\).*nothing after it"):
        parse_line(rows[2][2], Where(text, 3), True)
    with pytest.raises(InputError, match="text:4: the line is not valid UTF-8") as error:
        parse_line(rows[3][2], Where(text, 4), False)
    assert error.value.reason == "non_utf8"


def test_missing_ark_and_offset_past_the_end(tmp_path):
    kaldiio.save_ark(str(tmp_path / "a.ark"), {"k": np.ones((3, 4), np.float32)})
    with MatrixReader() as reader:
        with pytest.raises(InputError, match="cannot open ark") as error:
            reader.read(parse_location(f"{tmp_path}/nope.ark:5", Where("s", 1)), Where("s", 1, "k"))
        assert error.value.reason == "missing_ark"
        with pytest.raises(InputError) as error:
            reader.read(parse_location(f"{tmp_path}/a.ark:99999", Where("s", 2)), Where("s", 2, "k"))
        assert error.value.reason == "bad_offset"


def test_table_lines_split_on_ascii_whitespace_only_as_kaldi_does(tmp_path):
    # Kaldi splits at the first run of " \t\n\r\v\f"; a no-break space (U+00A0), an ideographic
    # space (U+3000) or U+0085 belongs to the token, and the value keeps its inner whitespace.
    raw = "spk1\u00a0utt\u30001\x85é \t value\u00a0with\tinner  spaces\u00a0 \r\n".encode()
    key, value = parse_line(raw, Where("text", 1), True)
    assert key == "spk1\u00a0utt\u30001\x85é"
    assert value == "value\u00a0with\tinner  spaces\u00a0"
    assert parse_line("\u00a0x\n".encode(), Where("text", 2), False) == ("\u00a0x", "")
    with pytest.raises(InputError, match="nothing after it"):  # one token: no value
        parse_line("key\u00a0value\n".encode(), Where("feats.scp", 3), True)
    assert key_problem("spk1\u00a0utt1-ü-語") is None
    assert key_problem("a\tb") == key_problem("a\vb") == "the key contains whitespace"
    # scp offsets and ranges are ASCII digits only (int() would also take other digits and "_")
    location = parse_location("a.ark:١٢", Where("feats.scp", 4))
    assert (location.path, location.offset) == ("a.ark:١٢", None)
    assert parse_location("a.ark:12\u00a0", Where("feats.scp", 5)).offset is None
    with pytest.raises(InputError, match="bad range"):
        parse_location("a.ark:12[1_0:20]", Where("feats.scp", 6))


def test_keys_with_a_no_break_space_pack_verbatim(tmp_path):
    keys = ["spk1\u00a0utt1", "ключ-ü-語\u00a0x", "plain-utt"]
    arrays = {key: np.full((3 + i, 4), i, np.float32) for i, key in enumerate(keys)}
    kaldiio.save_ark(str(tmp_path / "a.ark"), arrays, scp=str(tmp_path / "feats.scp"))
    labels = {key: f"label\u00a0{i} with  inner\tspace" for i, key in enumerate(keys)}
    (tmp_path / "text").write_text("".join(f"{key} {label}\n" for key, label in labels.items()), encoding="utf-8")
    report = pack_data(tmp_path / "feats.scp", tmp_path / "text", tmp_path / "out", progress=False)
    assert (report.packed, report.dropped, report.label_issues) == (3, {}, {})
    found = read_shards(sorted((tmp_path / "out").glob("*.tar")))
    assert {key: label for key, (_, label, _) in found.items()} == labels
    for key, array in arrays.items():
        np.testing.assert_array_equal(found[key][0], array)
