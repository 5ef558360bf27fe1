"""A shard whose planned utterances are all dropped while writing is never written under its
final name: the journal, the index, the report, reruns, parts and `seqshard index` agree."""

import json
from pathlib import Path

import pytest

from conftest import REALDATA, read_shards, write_kaldi_dir
from seqshard import ShardIndex, make_loader, pack_data
from seqshard.cli import main
from seqshard.errors import SeqshardError

FSDD = REALDATA / "kaldi" / "kaldi-pr1626-fsdd-digits"
FSDD_MAP = ["/home/abhilash/kaldi/egs/0_MP_Digits/mfcc/=corrupt/mfcc/"]


def test_a_pack_that_keeps_nothing_leaves_no_shard_real_git_damaged_ark(tmp_path, capsys):
    # Speaker10_9 onwards: the value git changed and the 79 values after it, all found bad
    # only while writing (offsets are checked against the ark when a value is read)
    scp = tmp_path / "train.scp"
    scp.write_text("".join((FSDD / "corrupt/mfcc/raw_mfcc_train.1.scp").read_text().splitlines(True)[9:]))
    text = tmp_path / "text"
    text.write_text("".join(f"{line.split()[0]} digit\n" for line in scp.read_text().splitlines()))
    out = tmp_path / "out"
    args = ["pack", "--scp", str(scp), "--text", str(text), "--out", str(out), "--path-root", str(FSDD)]
    args += ["--path-map", *FSDD_MAP, "--skip-bad", "--quiet"]
    for _ in range(2):  # the rerun finds the empty shard finished and still writes no file
        assert main(args) == 1
        assert "nothing was packed: all 80 utterances were dropped" in capsys.readouterr().err
        assert not list(out.rglob("*.tar")) and not list(out.rglob("*.partial"))
    report = json.loads((out / "pack_report.json").read_text())
    assert report["dropped"] == {"bad_offset": 79, "damaged_value": 1} and report["packed"] == 0
    assert (report["shards_done"], report["shards_empty"], report["groups"][""]["shards"]) == (1, 1, 0)
    assert report["dtype"] == "float32"  # a feature pack, even when no matrix could be read
    assert ShardIndex.load(out).shards == []


def damaged_middle_shard(tmp_path: Path):
    """30 utterances in shards of 10 (scp order); every value of the second shard is found bad
    only while writing (its scp offsets point one byte into the value)."""
    data = write_kaldi_dir(tmp_path / "d", speakers=3, per_speaker=10, arks=1)
    lines = data.scp.read_text().splitlines()
    for number in range(10, 20):
        head, _, offset = lines[number].rpartition(":")
        lines[number] = f"{head}:{int(offset) + 1}"
    data.scp.write_text("\n".join(lines) + "\n")
    return data


def test_a_shard_that_loses_every_utterance_is_not_written_while_the_others_are(tmp_path, capsys):
    data = damaged_middle_shard(tmp_path)
    out = tmp_path / "out"
    options = dict(utts_per_file=10, shuffle=False, skip_bad=True, progress=False)
    with pytest.raises(SeqshardError, match="is not the start of a value"):
        pack_data(data.scp, data.text, out, **{**options, "skip_bad": False})
    report = pack_data(data.scp, data.text, out, **options)  # the fix the error suggests, same folder
    assert (report.packed, report.dropped, report.shards_empty) == (20, {"bad_offset": 10}, 1)
    assert report.groups[""].shards == 2 and report.shards_done == 3
    assert report.shards_written_now == 1  # the strict run had finished data-00000.tar
    assert "empty shards     :        1" in report.format_text()
    assert sorted(p.name for p in out.glob("*.tar")) == ["data-00000.tar", "data-00002.tar"]
    index = ShardIndex.load(out)
    assert [e.name for e in index.shards] == ["data-00000.tar", "data-00002.tar"] and index.num_utts == 20
    assert sorted(read_shards(out.glob("*.tar"))) == sorted(data.keys[:10] + data.keys[20:])
    keys = [k for batch in make_loader(str(out), batch_size=4, num_workers=0, seed=0) for k in batch["keys"]]
    assert sorted(keys) == sorted(data.keys[:10] + data.keys[20:])

    shards = {p.name: p.read_bytes() for p in out.glob("*.tar")}
    rerun = pack_data(data.scp, data.text, out, **options)
    assert rerun.shards_written_now == 0 and rerun.shards_empty == 1 and rerun.packed == 20
    assert {p.name: p.read_bytes() for p in out.glob("*.tar")} == shards

    capsys.readouterr()
    assert main(["index", str(out), "--quiet"]) == 0  # a finished pack: nothing is missing
    assert [e.name for e in ShardIndex.load(out).shards] == ["data-00000.tar", "data-00002.tar"]
    assert main(["verify", str(out), "--quiet"]) == 0


def test_parts_agree_on_an_empty_shard(tmp_path):
    data = damaged_middle_shard(tmp_path)
    options = dict(utts_per_file=10, shuffle=False, skip_bad=True, progress=False)
    whole = pack_data(data.scp, data.text, tmp_path / "whole", **options)
    first = pack_data(data.scp, data.text, tmp_path / "parts", num_parts=2, part=1, **options)  # alone: all tasks
    assert first.complete and first.shards_empty == 1 and not (tmp_path / "parts/data-00001.tar").exists()
    last = pack_data(data.scp, data.text, tmp_path / "parts", num_parts=2, part=0, **options)
    assert last.complete and last.shards_written_now == 0
    assert (last.packed, last.dropped, last.shards_empty) == (whole.packed, whole.dropped, 1)
    for name in ("data-00000.tar", "data-00002.tar"):
        assert (tmp_path / "parts" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()
    assert ShardIndex.load(tmp_path / "parts").shards == ShardIndex.load(tmp_path / "whole").shards


def test_a_file_left_under_an_empty_shards_name_is_removed(tmp_path):
    data = damaged_middle_shard(tmp_path)
    out = tmp_path / "out"
    (out / ".seqshard-pack").mkdir(parents=True)  # an earlier pack here planned it and left an empty tar
    (out / ".seqshard-pack/planned.json").write_text(json.dumps({"groups": {"": [["data-00001.tar", 10]]}}))
    (out / "data-00001.tar").write_bytes(bytes(10240))
    pack_data(data.scp, data.text, out, utts_per_file=10, shuffle=False, skip_bad=True, progress=False)
    assert not (out / "data-00001.tar").exists()


def test_after_a_pack_that_kept_nothing_the_fixed_inputs_pack_into_the_same_folder(tmp_path):
    data = damaged_middle_shard(tmp_path)
    text = data.text.read_text().splitlines(keepends=True)
    scp = data.scp.read_text().splitlines(keepends=True)
    data.scp.write_text("".join(scp[10:20]))  # only the damaged values: nothing is packed
    data.text.write_text("".join(text[10:20]))
    out = tmp_path / "out"
    options = dict(utts_per_file=10, shuffle=False, skip_bad=True, progress=False)
    with pytest.raises(SeqshardError, match="nothing was packed"):
        pack_data(data.scp, data.text, out, **options)
    data.scp.write_text("".join(scp[:10]))  # the user gives the intact part instead
    data.text.write_text("".join(text[:10]))
    report = pack_data(data.scp, data.text, out, **options)  # the empty data-00000.tar is not "finished"
    assert (report.packed, report.shards_empty) == (10, 0)
    assert sorted(read_shards(out.glob("*.tar"))) == sorted(data.keys[:10])
