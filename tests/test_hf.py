"""`pack --hf`: Hugging Face datasets packed from the files `datasets` wrote (tests/realdata/hf),
checked against `datasets` itself: the same ids, texts and decoded samples."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile

from conftest import read_audio_shards
from seqshard.errors import ConfigError, InputError
from seqshard.formats.peers.hf import Batches, dataset_files
from seqshard.prep.pack import pack_data

HF = Path(__file__).parent / "realdata" / "hf"


@pytest.fixture(scope="module")
def datasets():
    """The reference reader, imported by the test process that runs a test needing it (it
    takes a second or two, which every test process would spend on collecting this file)."""
    return pytest.importorskip("datasets")


def reference(dataset) -> dict[str, tuple[np.ndarray, str]]:
    """id -> (int16 samples, text) as `datasets` holds them (decoded with soundfile: decoding
    in `datasets` itself needs torchcodec)."""
    from datasets import Audio

    rows = dataset.cast_column("audio", Audio(decode=False))
    return {
        row["id"]: (soundfile.read(io.BytesIO(row["audio"]["bytes"]), dtype="int16")[0], row["sentence"])
        for row in rows
    }


def packed(out: Path) -> dict[str, tuple[np.ndarray, str]]:
    return {key: (samples, text) for key, (samples, _, _, text) in read_audio_shards(sorted(out.glob("*.tar"))).items()}


def assert_same(found, expected):
    assert sorted(found) == sorted(expected)
    for key, (samples, text) in expected.items():
        assert found[key][1] == text
        np.testing.assert_array_equal(found[key][0], samples)


@pytest.mark.parametrize(
    ("source", "split"),
    [
        ("saved", None),
        ("saved", "test"),
        ("saved/train/data-00000-of-00001.arrow", None),
        ("hub", None),
        ("hub/data/test-*.parquet", None),
    ],
)
def test_pack_matches_datasets(datasets, tmp_path, source, split):
    """A save_to_disk folder (the split asked for, else train), one of its arrow files and
    the Hub's parquet layout (a folder, a glob) give the rows `datasets` reads."""
    report = pack_data(None, None, tmp_path / "out", hf=str(HF / source), split=split, progress=False)
    expected_split = split or ("test" if "test" in source else "train")
    if source.startswith("saved"):
        expected = reference(datasets.load_from_disk(str(HF / "saved"))[expected_split])
    else:
        expected = reference(datasets.Dataset.from_parquet(str(HF / f"hub/data/{expected_split}-*.parquet")))
    assert report.input_utts == report.packed == len(expected)
    assert_same(packed(tmp_path / "out"), expected)


def test_decoded_arrays_are_stored_losslessly_as_flac(datasets, tmp_path):
    pack_data(None, None, tmp_path / "out", hf=str(HF / "decoded.parquet"), progress=False)
    row = datasets.Dataset.from_parquet(str(HF / "decoded.parquet"))[0]
    found = read_audio_shards(sorted((tmp_path / "out").glob("*.tar")))
    samples, rate, suffix, text = found["row-000000000"]  # no id column: keys by row number
    assert (rate, suffix, text) == (row["audio"]["sampling_rate"], "flac", row["transcription"])
    np.testing.assert_array_equal(samples / 32768, np.asarray(row["audio"]["array"], dtype=np.float32))


def test_fields_keep_other_columns(tmp_path):
    pack_data(None, None, tmp_path / "out", hf=str(HF / "saved"), fields=["speaker"], progress=False)
    with tarfile.open(next((tmp_path / "out").glob("*.tar"))) as tar:
        speakers = {m.name: tar.extractfile(m).read() for m in tar if m.name.endswith(".speaker.json")}
    assert speakers == {f"{n}_jackson_1.speaker.json": b'"jackson"' for n in (5, 6, 7)}


def test_row_groups_are_read_one_at_a_time(datasets, tmp_path):
    """Memory follows one row group: a parquet file of one-row groups packs the same rows."""
    import pyarrow.parquet as pq

    table = pq.read_table(HF / "hub/data/train-00000-of-00001.parquet")
    pq.write_table(table, tmp_path / "train.parquet", row_group_size=1)
    dataset = dataset_files(tmp_path / "train.parquet")
    assert [batch.num_rows for _, _, batch in Batches(dataset).all(["id"])] == [1, 1, 1]
    pack_data(None, None, tmp_path / "out", hf=str(tmp_path / "train.parquet"), progress=False)
    assert_same(packed(tmp_path / "out"), reference(datasets.Dataset.from_parquet(str(tmp_path / "train.parquet"))))
    rows = [json.loads(line)["at"] for line in (tmp_path / "out/.seqshard-pack/rows.jsonl").read_text().splitlines()]
    assert rows == [[0, 0, 0], [0, 1, 0], [0, 2, 0]]


def test_wrong_split_or_column_names_what_there_is(tmp_path):
    with pytest.raises(ConfigError, match=r"no split 'valid' \(it has: train, test\)"):
        pack_data(None, None, tmp_path / "a", hf=str(HF / "saved"), split="valid", progress=False)
    with pytest.raises(ConfigError, match="no such column"):
        pack_data(None, None, tmp_path / "b", hf=str(HF / "saved"), text_column="words", progress=False)
    import pyarrow.parquet as pq

    pq.write_table(pq.read_table(HF / "decoded.parquet").drop_columns(["transcription"]), tmp_path / "x.parquet")
    with pytest.raises(ConfigError, match="none of the text columns"):
        pack_data(None, None, tmp_path / "c", hf=str(tmp_path / "x.parquet"), progress=False)


def _wav(samples: int) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(samples, dtype=np.int16), 16000, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("column", "bad", "good", "reason"),
    [
        ("audio", {"bytes": "RIFF", "path": "a.wav"}, {"bytes": _wav(1600).decode("latin-1"), "path": "b"}, None),
        (
            "audio",
            {"array": [0.1, float("nan")], "sampling_rate": 16000},
            {"array": [0.1], "sampling_rate": 8000},
            "non_finite",
        ),
        (
            "audio",
            {"array": ["x", "y"], "sampling_rate": 16000},
            {"array": ["0.5"], "sampling_rate": 8000},
            "unreadable_audio",
        ),
        (
            "audio",
            {"array": [0.1, 0.2], "sampling_rate": 2**62},
            {"array": [0.1], "sampling_rate": 8000},
            "unreadable_audio",
        ),
        ("id", None, "b", "bad_key"),
        ("score", float("nan"), 1.0, "bad_field"),
    ],
)
def test_a_hostile_cell_is_a_counted_skip_never_garbage_or_a_traceback(tmp_path, column, bad, good, reason):
    """Row 0 holds the hostile cell, row 1 a good one: a named, counted skip of row 0 (before:
    tracebacks from bytes() of a string, float() of 'x' and libsndfile's int of the rate; NaN
    audio, the key 'None' and NaN in a .json field packed as they were)."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rows = [{"id": "a", "audio": {"bytes": _wav(1600), "path": "a.wav"}, "text": "ok", "score": 1.0} for _ in "ab"]
    rows[0][column], rows[1][column], rows[1]["id"] = bad, good, "b"
    if column == "audio" and "array" in bad:
        rows[1]["audio"] = {**good, "array": good["array"] * 1600}
    pq.write_table(pa.table({name: [row[name] for row in rows] for name in rows[0]}), tmp_path / "x.parquet")
    if reason is None:  # a string column of audio: both rows refused, by name
        with pytest.raises(InputError, match=r"the audio cell's \"bytes\" are 'RIFF', not the bytes"):
            pack_data(None, None, tmp_path / "out", hf=str(tmp_path / "x.parquet"), progress=False)
        return
    report = pack_data(
        None, None, tmp_path / "out", hf=str(tmp_path / "x.parquet"), fields=["score"], skip_bad=True, progress=False
    )
    assert report.dropped == {reason: 1} and report.packed == 1 and report.input_utts == 2
    assert list(packed(tmp_path / "out")) == ["b"]


def test_ids_texts_and_fields_that_are_lists_or_bytes_are_refused_not_their_str():
    from seqshard.errors import Where
    from seqshard.prep.hf_source import _parse_row, _parse_text, _row
    from seqshard.prep.sources import field_members

    def line(key, text):
        return json.dumps(_row(key, text, ("id", "text"), [0, 0, 3], Path("x.parquet"))).encode()

    where = Where("rows.jsonl", 4)
    assert _parse_row(line(7, 12), where, True)[0] == "7" and _parse_text(line(7, 12), where, False) == ("7", "12")
    for bad in ([1], {"a": 1}, 1.5, True):
        with pytest.raises(
            InputError, match=r"x\.parquet, batch 0, row 3: its id \(column id\) is .*, not a string"
        ) as error:
            _parse_row(line(bad, "t"), where, True)
        assert error.value.reason == "bad_key"
    with pytest.raises(InputError, match=r"its text \(column text\) is \['x', 'y'\], not a string") as error:
        _parse_text(line("a", ["x", "y"]), where, False)
    assert error.value.reason == "bad_label"
    assert field_members({"s": [1, "x"]}, ["s", "t"], where) == [("s.json", [b'[1, "x"]']), ("t.nodata", [b""])]
    for bad in (b"\xff", float("inf"), {"x": float("nan")}):
        with pytest.raises(InputError, match=r"field 's' is .*, which JSON cannot hold") as error:
            field_members({"s": bad}, ["s"], where)
        assert error.value.reason == "bad_field"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("dataset_dict.json", "{x"), r"dataset_dict\.json cannot be read as JSON"),
        (("dataset_dict.json", '{"splits": "train"}'), r"dataset_dict\.json has no list 'splits' \(found 'train'\)"),
        (("dataset_dict.json", '{"splits": ["../../etc"]}'), r"splits names '\.\./\.\./etc', not a file or folder"),
        (("train/state.json", '{"_data_files": 5}'), r"state\.json has no list '_data_files'"),
        (("train/state.json", '{"_data_files": [{"filename": "/etc/passwd"}]}'), r"names '/etc/passwd', not a file"),
        (("train/data-00000-of-00001.arrow", b"\xff" * 2000), r"\.arrow cannot be read as arrow \(.*an Arrow file"),
    ],
)
def test_a_hostile_save_to_disk_folder_is_named_not_a_traceback(tmp_path, edit, message):
    """Tracebacks before: JSONDecodeError, KeyError, TypeError, pyarrow's OSError; a split of
    "train" given as a string matched by substring, and '..' read a folder outside."""
    import shutil

    shutil.copytree(HF / "saved", tmp_path / "saved")
    name, content = edit
    target = tmp_path / "saved" / name
    target.write_bytes(content) if isinstance(content, bytes) else target.write_text(content)
    with pytest.raises(ConfigError, match=message):
        pack_data(None, None, tmp_path / "out", hf=str(tmp_path / "saved"), split="train", progress=False)
