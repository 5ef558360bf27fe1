"""`pack --hf`: Hugging Face datasets packed from the files `datasets` wrote (tests/realdata/hf),
checked against `datasets` itself: the same ids, texts and decoded samples."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
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
        ("audio", {"bytes": None, "path": "a" * 5000}, {"bytes": _wav(1600), "path": "b"}, "missing_audio"),
        ("audio", {"bytes": None, "path": "a\0.wav"}, {"bytes": _wav(1600), "path": "b"}, "missing_audio"),
        ("id", None, "b", "bad_key"),
        ("score", float("nan"), 1.0, "bad_field"),
    ],
)
def test_a_hostile_cell_is_a_counted_skip_never_garbage_or_a_traceback(tmp_path, column, bad, good, reason):
    """Row 0 holds the hostile cell, row 1 a good one: a named, counted skip of row 0 (before:
    tracebacks from bytes() of a string, float() of 'x', libsndfile's int of the rate and a
    path too long or holding NUL; NaN
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
    if reason != "bad_key":  # named by the dataset's file, batch and row (it was rows.jsonl's line)
        with pytest.raises(InputError, match=r"x\.parquet, batch 0, row 0 \(key 'a'\): "):
            pack_data(None, None, tmp_path / "again", hf=str(tmp_path / "x.parquet"), fields=["score"], progress=False)


@pytest.mark.parametrize(
    ("column", "cells", "message", "reason"),
    [
        ("id", [[1], [2]], r"its id \(column id\) is \[1\], not a string", "bad_key"),
        ("id", [{"a": 1}, {"a": 2}], r"its id \(column id\) is .*'a': 1.*, not a string", "bad_key"),
        ("id", [1.5, 2.5], r"its id \(column id\) is 1\.5, not a string", "bad_key"),
        ("id", [True, False], r"its id \(column id\) is True, not a string", "bad_key"),
        ("text", [["x", "y"], ["z"]], r"its text \(column text\) is \['x', 'y'\], not a string", "bad_label"),
    ],
    ids=["list id", "struct id", "float id", "bool id", "list text"],
)
def test_ids_and_texts_that_are_lists_or_bytes_are_refused_not_their_str(tmp_path, column, cells, message, reason):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rows = {"id": ["a", "b"], "audio": [{"bytes": _wav(1600), "path": "a.wav"}] * 2, "text": ["ok", "ok"]}
    pq.write_table(pa.table({**rows, column: cells}), tmp_path / "x.parquet")
    with pytest.raises(InputError, match=r"x\.parquet, batch 0, row 0: " + message) as error:
        pack_data(None, None, tmp_path / "out", hf=str(tmp_path / "x.parquet"), progress=False)
    assert error.value.reason == reason


def test_number_ids_and_texts_pack_as_their_strings_and_fields_refuse_what_json_cannot_hold(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    from seqshard.errors import Where
    from seqshard.prep.inputs import field_members

    audio = [{"bytes": _wav(1600), "path": "a.wav"}] * 2
    pq.write_table(pa.table({"id": [7, 8], "audio": audio, "text": [12, 13]}), tmp_path / "x.parquet")
    pack_data(None, None, tmp_path / "out", hf=str(tmp_path / "x.parquet"), progress=False)
    assert {key: text for key, (_, text) in packed(tmp_path / "out").items()} == {"7": "12", "8": "13"}
    where = Where("rows.jsonl", 4)
    assert field_members({"s": [1, "x"]}, ["s", "t"], where) == [("s.json", [b'[1, "x"]']), ("t.nodata", [b""])]
    for bad in (b"\xff", float("inf"), {"x": float("nan")}):
        with pytest.raises(InputError, match=r"field 's' is .*, which JSON cannot hold") as error:
            field_members({"s": bad}, ["s"], where)
        assert error.value.reason == "bad_field"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("dataset_dict.json", "{x"), r"dataset_dict\.json:1: not JSON"),
        (("train/state.json", '{"_data_files": ' + "[" * 100_000), r"state\.json: its lists or objects nest deeper"),
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
    with pytest.raises((ConfigError, InputError), match=message):
        pack_data(None, None, tmp_path / "out", hf=str(tmp_path / "saved"), split="train", progress=False)


def _seqshard(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The command line in a process of its own: a crash (SIGSEGV, abort) or a hang fails the
    test, never pytest."""
    return subprocess.run(
        [sys.executable, "-m", "seqshard", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def _audio_table(ids, texts=None):
    pa = pytest.importorskip("pyarrow")
    texts = texts if texts is not None else ["x"] * len(ids)
    audio = [{"bytes": _wav(1600 + 160 * i), "path": f"{key}.wav"} for i, key in enumerate(ids)]
    return pa.table({"id": ids, "audio": audio, "text": pa.array(texts, pa.string())})


def _arrow_with_lying_offsets(path: Path, offsets, kind: str) -> None:
    """An Arrow file (``file``: IPC file; ``stream``: as datasets writes) of two batches whose
    first batch's audio bytes have ``offsets`` (a function of the true ones) instead."""
    pa = pytest.importorskip("pyarrow")
    first, second = _audio_table(["a", "b"]), _audio_table(["c"])
    with pa.OSFile(str(path), "wb") as sink:
        writer = pa.ipc.new_file(sink, first.schema) if kind == "file" else pa.ipc.new_stream(sink, first.schema)
        with writer:
            writer.write_table(first)
            writer.write_table(second)
    data = bytearray(path.read_bytes())
    sizes = [len(cell["bytes"]) for cell in first.column("audio").to_pylist()]
    true = np.array([0, sizes[0], sizes[0] + sizes[1]], np.int32).tobytes()
    at = data.index(true)
    data[at : at + len(true)] = np.array(offsets(sizes), np.int64).astype(np.int32).tobytes()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["file", "stream"])
@pytest.mark.parametrize(
    "offsets",
    [
        lambda s: [0, s[0], s[0] + s[1] + (1 << 30)],  # 1 GB past the buffer: SIGSEGV before
        lambda s: [0, -5, s[0] + s[1]],  # negative: std::length_error, an abort
        lambda s: [0, s[0] + s[1], s[0]],  # decreasing: an abort
        lambda s: [0, s[0], s[0] + s[1] + 200],  # 200 bytes past: packed 200 stray bytes, exit 0
    ],
    ids=["1GB-past", "negative", "decreasing", "200-past"],
)
def test_arrow_offsets_that_lie_are_a_named_error_or_a_counted_skip(tmp_path, kind, offsets):
    """In a process of its own (the crash before would end pytest): each row of the lying
    batch is named and counted, the other batch packed."""
    path = tmp_path / "data.arrow"
    _arrow_with_lying_offsets(path, offsets, kind)
    skipped = _seqshard("pack", "--hf", str(path), "--out", str(tmp_path / "b"), "--quiet", "--skip-bad", "--json")
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert re.search(
        r"data\.arrow, batch 0, row 1 \(key 'b'\): column 'audio' does not hold what it declares .*Fix: download",
        skipped.stderr,
    )
    report = json.loads(skipped.stdout)
    assert (report["packed"], report["dropped"]) == (1, {"damaged_batch": 2})
    assert list(packed(tmp_path / "b")) == ["c"]


def test_arrow_offsets_that_lie_are_refused_by_name_without_skip_bad(tmp_path):
    """In this process: 200 bytes past the buffer, which was packed as stray bytes before."""
    _arrow_with_lying_offsets(tmp_path / "data.arrow", lambda s: [0, s[0], s[0] + s[1] + 200], "stream")
    with pytest.raises(InputError, match=r"data\.arrow, batch 0, row 0 \(key 'a'\): column 'audio' does not") as error:
        pack_data(None, None, tmp_path / "out", hf=str(tmp_path / "data.arrow"), progress=False)
    assert error.value.reason == "damaged_batch" and "Fix: download or save the file again" in str(error.value)


def test_text_that_is_not_utf8_is_named_by_file_batch_row_and_column(tmp_path):
    """Before: a raw UnicodeDecodeError (Arrow), or the bytes packed as they were (parquet)."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    texts = pa.array([b"fine", b"caf\xe9", b"ok"], pa.binary()).view(pa.string())  # latin-1, not UTF-8
    table = _audio_table(["a", "b", "c"]).set_column(2, "text", texts)
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    pq.write_table(table, tmp_path / "t.parquet")
    for name, place in (("t.arrow", "batch 0"), ("t.parquet", "row group 0")):
        with pytest.raises(InputError, match=rf"{name}, {place}: column 'text', row 1: its text is not UTF-8") as error:
            pack_data(None, None, tmp_path / f"{name}-out", hf=str(tmp_path / name), progress=False)
        assert error.value.reason == "damaged_batch" and "write the text as UTF-8" in str(error.value)
    pq.write_table(pa.concat_tables([table, _audio_table(["d"])]), tmp_path / "two.parquet", row_group_size=3)
    report = pack_data(None, None, tmp_path / "skip", hf=str(tmp_path / "two.parquet"), skip_bad=True, progress=False)
    assert report.dropped == {"damaged_batch": 1} and report.packed == 1  # the first row group, counted once
    assert report.label_issues == {} and list(packed(tmp_path / "skip")) == ["d"]


def test_a_parquet_value_whose_length_lies_is_a_counted_skip(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    table = _audio_table(["a", "b"], ["hello", "world"])
    pq.write_table(table.slice(0, 1), tmp_path / "train-0.parquet", compression="none", use_dictionary=False)
    data = bytearray((tmp_path / "train-0.parquet").read_bytes())
    at = data.index(b"\x05\x00\x00\x00hello")  # the PLAIN length of the text value
    data[at : at + 4] = (0x7FFFFF00).to_bytes(4, "little")
    (tmp_path / "train-0.parquet").write_bytes(bytes(data))
    with pytest.raises(InputError, match=r"train-0\.parquet, row group 0: it cannot be read \(.*BYTE_ARRAY"):
        pack_data(None, None, tmp_path / "a", hf=str(tmp_path / "train-0.parquet"), progress=False)
    pq.write_table(table.slice(1), tmp_path / "train-1.parquet")
    report = pack_data(None, None, tmp_path / "b", hf=str(tmp_path / "*.parquet"), skip_bad=True, progress=False)
    assert (report.input_utts, report.packed, report.dropped) == (2, 1, {"damaged_batch": 1})


def test_a_recursive_glob_does_not_follow_a_link_loop(tmp_path):
    """Before: glob.glob followed d/up -> .. (twice over) without end, its memory growing."""
    import shutil

    data = tmp_path / "ds" / "data"
    data.mkdir(parents=True)
    shutil.copy(HF / "hub/data/train-00000-of-00001.parquet", data / "train-00000-of-00001.parquet")
    for name in ("up", "again"):
        (data / name).symlink_to("..")
    done = _seqshard(
        "pack", "--hf", f"{tmp_path}/ds/**/*.parquet", "--out", str(tmp_path / "out"), "--json", timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["packed"] == 3  # the file once


def test_a_pattern_naming_too_many_files_is_refused_by_name(tmp_path, monkeypatch):
    from seqshard.formats.peers import hf

    for name in ("train-0.parquet", "train-1.parquet"):
        (tmp_path / name).write_bytes(b"PAR1")
    monkeypatch.setattr(hf, "MAX_FILES", 1)
    with pytest.raises(ConfigError, match=r"names more than 1 parquet or arrow files"):
        dataset_files(tmp_path / "*.parquet")


def test_keys_without_an_id_column_are_row_numbers_whichever_way_the_split_is_chosen(tmp_path):
    """One rule (README, guide, code): row-000000042, counted across the split's files; it was
    SPLIT-... when the split was chosen and row-... when not, for the same rows."""
    pq = pytest.importorskip("pyarrow.parquet")
    for number, ids in enumerate((["a", "b"], ["c"])):
        (tmp_path / "hub" / "data").mkdir(parents=True, exist_ok=True)
        pq.write_table(
            _audio_table(ids).drop_columns(["id"]), tmp_path / f"hub/data/train-0000{number}-of-00002.parquet"
        )
    pq.write_table(_audio_table(["d"]).drop_columns(["id"]), tmp_path / "hub/data/test-00000-of-00001.parquet")
    expected = ["row-000000000", "row-000000001", "row-000000002"]
    for name, split in (("folder", "train"), ("glob", None)):
        source = tmp_path / "hub" if split else tmp_path / "hub/data/train-*.parquet"
        pack_data(None, None, tmp_path / name, hf=str(source), split=split, progress=False)
        assert sorted(packed(tmp_path / name)) == expected


BOMB = """
import json, resource, sys
import pyarrow, soundfile, seqshard.prep.pack
from seqshard.prep.pack import pack_data

def peak():
    return max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) * 1024

before = peak()
report = pack_data(None, None, sys.argv[2], hf=sys.argv[1], skip_bad=True, progress=False)
print(json.dumps({"grew": peak() - before, "packed": report.packed, "dropped": report.dropped}))
"""


def test_a_parquet_bomb_is_refused_before_it_is_decompressed(tmp_path):
    """A few kB of zstd holding a 128 MiB cell (the issue's: 40,953 bytes holding 1 GiB took
    pack to 5.3 GB before the row was dropped): refused from the row group's metadata, in a
    process whose memory grows by far less than the cell."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    bomb = pa.table({"id": ["a"], "audio": [{"bytes": bytes(128 << 20), "path": "a.wav"}], "text": ["x"]})
    pq.write_table(bomb, tmp_path / "train-0.parquet", compression="zstd")
    del bomb
    pq.write_table(_audio_table(["b"]), tmp_path / "train-1.parquet", compression="zstd")
    assert (tmp_path / "train-0.parquet").stat().st_size < 64 << 10
    with pytest.raises(
        InputError,
        match=r"train-0\.parquet, row group 0: it declares \d+ bytes once read, from \d+: beyond the \d+ allowed",
    ):
        pack_data(None, None, tmp_path / "a", hf=str(tmp_path / "train-0.parquet"), progress=False)
    done = subprocess.run(
        [sys.executable, "-c", BOMB, str(tmp_path / "*.parquet"), str(tmp_path / "b")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert (found["packed"], found["dropped"]) == (1, {"decompression_limit": 1})
    assert found["grew"] < 48 << 20, found


def test_a_text_only_dataset_is_sent_to_binarize(tmp_path):
    """Before: "Fix: name it with --audio-column", which a dataset without audio cannot follow."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"id": ["a"], "text": ["hello"]}), tmp_path / "train.parquet")
    with pytest.raises(
        ConfigError, match=r"no audio column \(its columns: id, text\).* packs speech.*seqshard binarize --in FILE"
    ):
        pack_data(None, None, tmp_path / "out", hf=str(tmp_path / "train.parquet"), progress=False)


def _decoded_by_datasets(dataset) -> dict[str, np.ndarray]:
    """id -> samples as `datasets` decodes the column: live where torchcodec (its decoder) is
    installed, else as datasets 5.2.0 with torchcodec 0.13 (FFmpeg 5.1) decoded these rows,
    recorded in realdata/hf/train-16k.npz (int16 of the float samples)."""
    try:
        import torchcodec  # noqa: F401
    except ImportError:
        with np.load(HF / "train-16k.npz") as recorded:
            return {key: recorded[key] / 32768 for key in recorded.files}
    return {row["id"]: row["audio"].get_all_samples().data.numpy()[0] for row in dataset}


@pytest.mark.parametrize("layout", ["save_to_disk", "parquet"])
def test_a_declared_sampling_rate_is_honoured_as_datasets_decodes_it(datasets, tmp_path, layout):
    """8 kHz files in a column cast to Audio(sampling_rate=16000): `datasets` decodes them at
    16 kHz, and so does the loader now (before: 8 kHz, without a word). Tolerance: soxr (pack's
    resampler) and FFmpeg's (torchcodec's) differ by their filters near the band edge, -40 dB
    here (RMS of the difference 1.2 % of the signal's, at most 0.006 of full scale): asserted
    below 3 % and 0.015; a resampler that is not applied, or a wrong rate, is off by ~100 %."""
    from seqshard import make_loader

    cast = datasets.load_from_disk(str(HF / "saved"))["train"].cast_column("audio", datasets.Audio(sampling_rate=16000))
    source = tmp_path / ("saved" if layout == "save_to_disk" else "train.parquet")
    cast.save_to_disk(str(source)) if layout == "save_to_disk" else cast.to_parquet(str(source))
    written = (
        datasets.load_from_disk(str(source)) if layout == "save_to_disk" else datasets.Dataset.from_parquet(str(source))
    )
    assert written.features["audio"].sampling_rate == 16000  # what datasets reads back from the files
    pack_data(None, None, tmp_path / "out", hf=str(source), progress=False)
    expected = _decoded_by_datasets(cast)
    loader = make_loader(str(tmp_path / "out"), batch_size=1, num_workers=0, seed=0)
    found = {}
    for batch in loader:
        assert int(batch["sample_rate"][0]) == 16000
        found[batch["keys"][0]] = batch["audio"][0, : int(batch["audio_lens"][0])].numpy()
    assert sorted(found) == sorted(expected)
    for key, samples in expected.items():
        assert len(found[key]) == len(samples)
        difference = found[key] - samples
        assert np.sqrt(np.mean(difference**2)) < 0.03 * np.sqrt(np.mean(samples**2)), key
        assert np.abs(difference).max() < 0.015, key
    with pytest.raises(
        InputError,
        match=r"at 8000 Hz, but column 'audio' is Audio\(sampling_rate=16000\).*Fix: pack with audio_format='flac'",
    ) as error:
        pack_data(None, None, tmp_path / "keep", hf=str(source), audio_format="keep", progress=False)
    assert error.value.reason == "sample_rate_mismatch"


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        (b'{"info": ' + b"[" * 100_000, r"huggingface schema metadata \(the dataset's features\) is not JSON"),
        (b"not json", r"is not JSON"),
        (b'{"info": {"features": {"audio": {"_type": "Audio", "sampling_rate": 1e400}}}}', r"sampling_rate is inf"),
        (b'{"info": {"features": {"audio": {"_type": "Audio", "sampling_rate": -8000}}}}', r"sampling_rate is -8000"),
    ],
)
def test_schema_metadata_that_is_not_json_or_not_a_rate_is_named(tmp_path, metadata, message):
    """Before: a RecursionError for metadata nested 100,000 deep; metadata that is not JSON was
    ignored (it now says the column's declared rate)."""
    pq = pytest.importorskip("pyarrow.parquet")
    table = _audio_table(["a"])
    pq.write_table(table.replace_schema_metadata({"huggingface": metadata}), tmp_path / "train.parquet")
    with pytest.raises(ConfigError, match=rf"train\.parquet: .*{message}.*Fix: write the file again"):
        pack_data(None, None, tmp_path / "out", hf=str(tmp_path / "train.parquet"), progress=False)


def test_an_arrow_bomb_is_refused_from_its_message_header_before_it_is_decompressed(tmp_path):
    """An Arrow stream written with IPC compression (zstd) whose first batch holds a 64 MiB cell
    in 3 kB: refused from the sizes its header declares, never read; pyarrow cannot read a
    stream past a batch, so the batch after it is counted too (before: both decompressed)."""
    pa = pytest.importorskip("pyarrow")
    bomb = pa.table({"id": ["a"], "audio": [{"bytes": bytes(64 << 20), "path": "a.wav"}], "text": ["x"]})
    good = _audio_table(["b"]).cast(bomb.schema)
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    sink = pa.OSFile(str(tmp_path / "data.arrow"), "wb")
    with sink, pa.ipc.new_stream(sink, bomb.schema, options=options) as writer:
        for table in (good, bomb, _audio_table(["c"]).cast(bomb.schema)):
            writer.write_table(table)
    del bomb
    assert (tmp_path / "data.arrow").stat().st_size < 64 << 10
    with pytest.raises(
        InputError, match=r"data\.arrow, batch 1: its buffers declare \d+ bytes once read, from \d+: beyond"
    ):
        pack_data(None, None, tmp_path / "a", hf=str(tmp_path / "data.arrow"), progress=False)
    report = pack_data(None, None, tmp_path / "b", hf=str(tmp_path / "data.arrow"), skip_bad=True, progress=False)
    assert (report.input_utts, report.packed, report.dropped) == (3, 1, {"decompression_limit": 2})


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_a_dictionary_bomb_is_refused_before_it_is_expanded(tmp_path, kind):
    """One 1 MiB value and 300 indices to it (a parquet file of 1 MiB whose audio column
    expands to 300 MiB once read: its metadata declares 1 MiB, so only the expansion tells;
    an Arrow stream whose text column does the same): refused from the dictionary's lengths,
    in a process whose memory grows by far less (before: 300 MiB and more)."""
    import os

    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rows = 300
    value = os.urandom(1 << 20)
    repeated = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array([value], pa.binary()))
    ids = [f"k{i}" for i in range(rows)]
    if kind == "parquet":
        audio = pa.StructArray.from_arrays([repeated.cast(pa.binary()), pa.array(["a.wav"] * rows)], ["bytes", "path"])
        table = pa.table({"id": ids, "audio": audio, "text": ["x"] * rows})
        pq.write_table(table, tmp_path / "train-0.parquet", store_schema=False)  # no Arrow schema: read as binary
        pq.write_table(_audio_table(["b"]), tmp_path / "train-1.parquet")
        expected = (1, {"decompression_limit": rows})  # the scan lists them, each row's audio is refused
    else:
        texts = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array([value.hex()[: 1 << 20]]))
        audio = [{"bytes": _wav(16), "path": "a.wav"}] * rows
        table = pa.table({"id": ids, "audio": audio, "text": texts})
        with pa.OSFile(str(tmp_path / "data.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
            writer.write_table(_audio_table(["b"]).cast(table.schema))
        expected = (1, {"decompression_limit": 1})  # its ids and texts cannot be listed: the batch, once
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            BOMB,
            str(tmp_path / ("*.parquet" if kind == "parquet" else "data.arrow")),
            str(tmp_path / "b"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert (found["packed"], found["dropped"]) == expected
    assert found["grew"] < 100 << 20, found


def test_a_column_name_that_is_not_utf8_is_named(tmp_path):
    """Before: a raw UnicodeDecodeError from pyarrow's schema.names (found by fuzzing)."""
    pa = pytest.importorskip("pyarrow")
    table = _audio_table(["a"])
    with pa.OSFile(str(tmp_path / "data.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    data = (tmp_path / "data.arrow").read_bytes()
    (tmp_path / "data.arrow").write_bytes(data.replace(b"text", b"\xffext", 1))
    with pytest.raises(ConfigError, match=r"data\.arrow cannot be read as arrow \('utf-8' codec can't decode"):
        pack_data(None, None, tmp_path / "out", hf=str(tmp_path / "data.arrow"), progress=False)


def test_column_metadata_that_aborts_pyarrow_is_never_read(tmp_path):
    """A parquet footer whose `path` column says BOOLEAN while its chunks keep byte-array size
    statistics: pyarrow aborts the process (std::terminate) when that chunk's metadata is
    read (found by fuzzing, once the inflation check read it); its row group is a named,
    counted skip."""
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(_audio_table(["a"]), tmp_path / "train-0.parquet")
    pq.write_table(_audio_table(["b"]), tmp_path / "train-1.parquet")
    data = (tmp_path / "train-0.parquet").read_bytes()
    element = bytes.fromhex("150c2502") + b"\x18\x04path"  # type BYTE_ARRAY, optional, name "path"
    assert data.count(element) == 1
    (tmp_path / "train-0.parquet").write_bytes(data.replace(element, bytes.fromhex("15002502") + b"\x18\x04path"))
    done = _seqshard(
        "pack", "--hf", str(tmp_path / "*.parquet"), "--out", str(tmp_path / "out"), "--skip-bad", "--json"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert (report["packed"], report["dropped"]) == (1, {"damaged_batch": 1})
