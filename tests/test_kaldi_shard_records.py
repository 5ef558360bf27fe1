"""What the pack journal records per shard (read back by ``seqshard inspect`` and the index)."""

import json

import pytest

from conftest import read_shards, write_kaldi_dir
from seqshard import pack_data
from seqshard.errors import SeqshardError
from seqshard.prep.journal import finished_shards


def test_journal_records_exact_min_and_max_frames_per_shard(tmp_path):
    data = write_kaldi_dir(tmp_path / "data", frames=(5, 200))
    pack_data(data.scp, data.text, tmp_path / "out", utts_per_file=7, filter_group=["1:60", "60:400"], progress=False)
    records = finished_shards(tmp_path / "out")
    assert len(records) > 2
    for relative, record in records.items():
        lengths = [array.shape[0] for array, _, _ in read_shards([tmp_path / "out" / relative]).values()]
        assert (record["min_frames"], record["max_frames"]) == (min(lengths), max(lengths))
        assert isinstance(record["min_frames"], int) and isinstance(record["max_frames"], int)


def test_a_shard_whose_utterances_all_failed_records_zero_lengths(tmp_path):
    data = write_kaldi_dir(tmp_path / "data", speakers=1, per_speaker=2, arks=1)
    data.scp.write_text(data.scp.read_text().replace(":", ":1", 1))  # the first offset shifted
    lines = data.scp.read_text().splitlines()
    data.scp.write_text(lines[0] + "\n")
    with pytest.raises(SeqshardError, match=r"nothing was packed: all 1 utterances were dropped \(bad_offset=1\)"):
        pack_data(data.scp, data.text, tmp_path / "out", skip_bad=True, progress=False)
    report = json.loads((tmp_path / "out" / "pack_report.json").read_text())
    assert report["packed"] == 0 and report["dropped"] == {"bad_offset": 1}
    (record,) = finished_shards(tmp_path / "out").values()
    assert (record["num_utts"], record["min_frames"], record["max_frames"]) == (0, 0, 0)
