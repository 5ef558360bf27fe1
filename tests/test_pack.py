"""``pack_data``: contents, shuffle, groups, dtype, parts/jobs, index and report."""

import json
import zlib
from pathlib import Path

import numpy as np
import pytest

from conftest import read_shards, write_kaldi_dir
from seqshard import ShardIndex, pack_data
from seqshard.errors import ConfigError


def shards_under(folder: Path) -> list[Path]:
    return sorted(folder.rglob("data-*.tar"))


def test_every_utterance_lands_in_exactly_one_shard_unchanged(tmp_path):
    data = write_kaldi_dir(tmp_path / "d", speakers=5, per_speaker=9)
    report = pack_data(data.scp, data.text, tmp_path / "out", utts_per_file=10, progress=False)
    found = read_shards(shards_under(tmp_path / "out"))
    assert sorted(found) == sorted(data.keys)
    for key, (array, label, _) in found.items():
        np.testing.assert_array_equal(array, data.arrays[key])  # float32 is lossless
        assert array.dtype == np.float32 and label == data.labels[key]
    assert report.complete and report.packed == report.input_utts == 45 and report.dropped == {}
    assert [len(read_shards([p])) for p in shards_under(tmp_path / "out")] == [10, 10, 10, 10, 5]


def test_index_describes_each_shard_exactly(tmp_path):
    data = write_kaldi_dir(tmp_path / "d", speakers=3, per_speaker=7, dim=6)
    pack_data(data.scp, data.text, tmp_path / "out", utts_per_file=8, progress=False)
    index = ShardIndex.load(tmp_path / "out")
    assert index.feature["dim"] == 6 and index.feature["dtype"] == "float32" and index.feature["frame_shift_ms"] == 10.0
    assert [s.name for s in index.shards] == ["data-00000.tar", "data-00001.tar", "data-00002.tar"]
    for entry in index.shards:
        path = tmp_path / "out" / entry.name
        contents = read_shards([path])
        assert entry.num_utts == len(contents)
        assert entry.num_frames == sum(a.shape[0] for a, _, _ in contents.values())
        assert entry.bytes == path.stat().st_size
        assert entry.checksum == f"crc32:{zlib.crc32(path.read_bytes()):08x}"
        assert sum(entry.length_hist.values()) == entry.num_utts
    assert index.num_utts == 21 and "pack" in index.created_by and index.source["seed"] == 0


def test_speaker_sorted_input_gives_shards_that_each_sample_the_whole_corpus(tmp_path):
    data = write_kaldi_dir(tmp_path / "d", speakers=10, per_speaker=40, dim=2, frames=(2, 4))
    pack_data(data.scp, data.text, tmp_path / "shuf", utts_per_file=40, progress=False)
    pack_data(data.scp, data.text, tmp_path / "seq", utts_per_file=40, shuffle=False, progress=False)
    for folder, expect_mixed in (("shuf", True), ("seq", False)):
        found = read_shards(shards_under(tmp_path / folder))
        speakers_per_shard = {}
        for key, (_, _, shard) in found.items():
            speakers_per_shard.setdefault(shard, set()).add(data.speaker_of[key])
        counts = [len(s) for s in speakers_per_shard.values()]
        if expect_mixed:
            # 40 random draws from 10 speakers x 40 utts: about 9.9 distinct speakers expected
            assert min(counts) >= 7, counts
        else:
            assert counts == [1] * 10  # --no-shuffle keeps the scp order: one speaker per shard


def test_same_seed_same_bytes_other_seed_other_shards(tmp_path):
    data = write_kaldi_dir(tmp_path / "d")
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        pack_data(data.scp, data.text, tmp_path / name, utts_per_file=10, seed=seed, progress=False)
    bytes_of = {n: [p.read_bytes() for p in shards_under(tmp_path / n)] for n in "abc"}
    assert bytes_of["a"] == bytes_of["b"]
    assert bytes_of["a"] != bytes_of["c"]


def test_length_groups_are_half_open_subfolders_and_the_rest_is_counted(tmp_path):
    data = write_kaldi_dir(tmp_path / "d", speakers=4, per_speaker=20, frames=(5, 60))
    report = pack_data(
        data.scp, data.text, tmp_path / "out", filter_group=["10:30", "30:50"], utts_per_file=7, progress=False
    )
    lengths = {k: a.shape[0] for k, a in data.arrays.items()}
    for name, low, high in (("10_30", 10, 30), ("30_50", 30, 50)):
        found = read_shards(shards_under(tmp_path / "out" / name))
        assert sorted(found) == sorted(k for k, n in lengths.items() if low <= n < high)
        assert ShardIndex.load(tmp_path / "out" / name).num_utts == len(found)
        assert report.groups[name].utts == len(found)
    outside = sum(1 for n in lengths.values() if not 10 <= n < 50)
    assert report.dropped == {"outside_groups": outside}
    assert report.packed + outside == report.input_utts == 80


def test_overlapping_or_malformed_groups_are_refused(tmp_path):
    data = write_kaldi_dir(tmp_path / "d")
    with pytest.raises(ConfigError, match="overlap"):
        pack_data(data.scp, data.text, tmp_path / "o", filter_group=["10:100", "50:200"], progress=False)
    with pytest.raises(ConfigError, match="LOW:HIGH"):
        pack_data(data.scp, data.text, tmp_path / "o2", filter_group=["100"], progress=False)


def test_float16_halves_the_payload_and_reports_the_saving(tmp_path):
    data = write_kaldi_dir(tmp_path / "d", dim=40, frames=(50, 100))
    full = pack_data(data.scp, data.text, tmp_path / "f32", progress=False)
    half = pack_data(data.scp, data.text, tmp_path / "f16", dtype="float16", progress=False)
    found = read_shards(shards_under(tmp_path / "f16"))
    for key, (array, _, _) in found.items():
        assert array.dtype == np.float16
        np.testing.assert_allclose(array, data.arrays[key], rtol=1e-3, atol=1e-2)
    frames = sum(a.shape[0] for a in data.arrays.values())
    assert half.float16_saved_bytes == frames * 40 * 2
    saved = sum(p.stat().st_size for p in shards_under(tmp_path / "f32")) - sum(
        p.stat().st_size for p in shards_under(tmp_path / "f16")
    )
    assert abs(saved - half.float16_saved_bytes) < 20 * 1024  # the rest is tar padding
    assert ShardIndex.load(tmp_path / "f16").feature["dtype"] == "float16"
    assert full.float16_saved_bytes == 0


def test_report_is_saved_next_to_the_shards(tmp_path):
    data = write_kaldi_dir(tmp_path / "d")
    report = pack_data(data.scp, data.text, tmp_path / "out", progress=False)
    saved = json.loads((tmp_path / "out" / "pack_report.json").read_text())
    assert saved["packed"] == report.packed == 48 and saved["complete"] is True
    assert saved["groups"][""]["shards"] == 1 and saved["mb_per_s"] >= 0
    for needle in ("packed", "shards", "MB/s"):
        assert needle in report.format_text()


def test_parts_and_jobs_write_the_same_bytes_as_one_process(tmp_path):
    data = write_kaldi_dir(tmp_path / "d", speakers=6, per_speaker=10)
    common = dict(utts_per_file=6, filter_group=["5:30", "30:60"], progress=False)
    pack_data(data.scp, data.text, tmp_path / "one", **common)
    for part in range(3):  # a part alone runs every task no live part holds: the first does all
        report = pack_data(data.scp, data.text, tmp_path / "parts", num_parts=3, part=part, **common)
        assert report.complete and report.shards_written_now == (0 if part else report.shards_total)
    pack_data(data.scp, data.text, tmp_path / "jobs", jobs=3, max_open=2, **common)
    reference = {p.relative_to(tmp_path / "one"): p.read_bytes() for p in shards_under(tmp_path / "one")}
    for name in ("parts", "jobs"):
        got = {p.relative_to(tmp_path / name): p.read_bytes() for p in shards_under(tmp_path / name)}
        assert got == reference, name
        for group in ("5_30", "30_60"):
            ours = ShardIndex.load(tmp_path / name / group)
            theirs = ShardIndex.load(tmp_path / "one" / group)
            assert [s.to_json() for s in ours.shards] == [s.to_json() for s in theirs.shards]


def test_a_folder_packed_from_other_inputs_is_refused_unless_overwritten(tmp_path):
    first = write_kaldi_dir(tmp_path / "a", seed=1)
    second = write_kaldi_dir(tmp_path / "b", seed=2, speakers=2)
    pack_data(first.scp, first.text, tmp_path / "out", utts_per_file=5, progress=False)
    with pytest.raises(ConfigError, match="other inputs or options"):
        pack_data(second.scp, second.text, tmp_path / "out", progress=False)
    with pytest.raises(ConfigError, match="other inputs or options"):
        pack_data(first.scp, first.text, tmp_path / "out", seed=5, progress=False)
    with pytest.raises(ConfigError, match="num_parts"):
        pack_data(second.scp, second.text, tmp_path / "out", overwrite=True, num_parts=2, progress=False)
    report = pack_data(second.scp, second.text, tmp_path / "out", overwrite=True, progress=False)
    assert report.packed == 16 and [p.name for p in shards_under(tmp_path / "out")] == ["data-00000.tar"]
    assert sorted(read_shards(shards_under(tmp_path / "out"))) == sorted(second.keys)


def test_bad_fmt_and_options_are_refused_naming_the_option(tmp_path):
    data = write_kaldi_dir(tmp_path / "d")
    with pytest.raises(ConfigError, match="fmt"):
        pack_data(data.scp, data.text, tmp_path / "o", fmt="data.tar", progress=False)
    with pytest.raises(ConfigError, match="utts_per_file"):
        pack_data(data.scp, data.text, tmp_path / "o", utts_per_file=0, progress=False)
    with pytest.raises(ConfigError, match="part"):
        pack_data(data.scp, data.text, tmp_path / "o", num_parts=2, part=2, progress=False)


def test_webdataset_reads_a_packed_shard_back_to_the_source_arrays(tmp_path):
    import webdataset as wds

    data = write_kaldi_dir(tmp_path / "d", compression_method=2)
    pack_data(data.scp, data.text, tmp_path / "out", progress=False)
    samples = list(wds.WebDataset(str(tmp_path / "out" / "data-00000.tar"), shardshuffle=False).decode())
    assert sorted(s["__key__"] for s in samples) == sorted(data.keys)
    for sample in samples:
        np.testing.assert_array_equal(sample["feats.npy"], data.arrays[sample["__key__"]])
        assert sample["txt"] == data.labels[sample["__key__"]]
