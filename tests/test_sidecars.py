"""Sidecar field shards: add a field without repacking (add-field), read only what is asked,
in sync, with exact and elastic resume; verify and index know them."""

import json
import tarfile

import kaldiio
import numpy as np
import pytest
import torch

from conftest import files_opened, pack_small, read_shards
from seqshard import add_field, make_loader
from seqshard.cli import main
from seqshard.errors import ConfigError, InputError, ShardError, StateMismatchError
from seqshard.formats.index import ShardIndex
from seqshard.formats.selection import select_shards

SMALL = dict(shuffle_window=12, sort_window=8, interleave=2)


def alignments(packed):
    """One int32 label per frame for every utterance (what an alignment looks like)."""
    return {key: (np.arange(len(a)) % 7).astype(np.int32) for key, a in packed.data.arrays.items()}


def write_sources(packed, root, skip=()):
    root.mkdir(exist_ok=True)
    ali = alignments(packed)
    with kaldiio.WriteHelper(f"ark,scp:{root}/ali.ark,{root}/ali.scp") as writer:
        for key, value in ali.items():
            if key not in skip:
                writer(key, value)
    (root / "utt2spk").write_text("".join(f"{k} {k.split('-')[0]}\n" for k in packed.data.keys if k not in skip))
    (root / "meta.jsonl").write_text(
        "".join(json.dumps({"key": k, "speaker": int(k[3:6]), "gender": "f"}) + "\n" for k in packed.data.keys)
    )
    return ali


@pytest.fixture
def with_fields(tmp_path):
    packed = pack_small(tmp_path, utts_per_file=10)
    ali = write_sources(packed, tmp_path / "src")
    add_field(packed.out, "ali", tmp_path / "src" / "ali.scp", progress=False)
    add_field(packed.out, "spk", tmp_path / "src" / "utt2spk", progress=False)
    add_field(packed.out, "meta", tmp_path / "src" / "meta.jsonl", progress=False)
    return packed, ali


def by_key(loader):
    return {k: (b, row) for b in loader for row, k in enumerate(b["keys"])}


def test_fields_from_an_scp_a_text_file_and_json_lines_come_with_the_batches(with_fields):
    packed, ali = with_fields
    index = ShardIndex.load(packed.out)
    assert sorted(index.field_sets) == ["ali", "meta", "spk"]
    assert index.shards[0].sidecars["ali"].name == "fields/ali/data-00000.tar"
    assert [p.name for p in select_shards(packed.pattern).paths] == [f"data-0000{i}.tar" for i in range(5)]
    for workers in (0, 2):
        loader = make_loader(
            packed.pattern, fields=["feats", "txt", "ali", "spk", "meta"], batch_size=4, num_workers=workers, **SMALL
        )
        rows = by_key(loader)
        assert sorted(rows) == sorted(packed.data.keys)
        for key, (batch, row) in rows.items():
            length = int(batch["ali_lens"][row])
            np.testing.assert_array_equal(batch["ali"][row, :length].numpy(), ali[key])
            assert batch["ali"].dtype.is_floating_point is False and length == int(batch["feat_lens"][row])
            assert batch["spk"][row] == key.split("-")[0]
            assert batch["meta"][row] == {"speaker": int(key[3:6]), "gender": "f"}
            assert batch["texts"][row] == packed.data.labels[key]
    default = next(iter(make_loader(packed.pattern, batch_size=4, num_workers=0)))
    assert sorted(default) == ["feat_lens", "feats", "keys", "texts"]  # sidecars are read when asked for


def test_asking_only_for_sidecar_fields_never_opens_the_shards(with_fields):
    packed, _ = with_fields
    loader = make_loader(packed.pattern, fields=["spk"], batch_size=5, num_workers=0, **SMALL)
    for shard in packed.out.glob("data-0000?.tar"):
        shard.write_bytes(b"\0" * 10)  # the main shards are gone; only the sidecars remain
    with files_opened() as opened:
        batches = list(loader)
    assert sorted(k for b in batches for k in b["keys"]) == sorted(packed.data.keys)
    assert sorted(batches[0]) == ["keys", "spk"]
    shards = [p for p in opened if p.startswith(str(packed.out)) and ".tar" in p]
    assert shards and all("/fields/spk/" in p for p in shards)
    with pytest.raises(ConfigError, match=r"fields: no field set holds 'speed'.*spk \(spk\)"):
        make_loader(packed.pattern, fields=["speed"])


def test_field_files_out_of_step_are_an_error_naming_both_files_and_the_key(with_fields):
    packed, _ = with_fields
    sidecar = packed.out / "fields/spk/data-00001.tar"
    with tarfile.open(sidecar) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    members[2], members[3] = members[3], members[2]  # two samples swapped in the sidecar
    with tarfile.open(sidecar, "w", format=tarfile.PAX_FORMAT) as tar:
        for member, data in members:
            tar.addfile(member, __import__("io").BytesIO(data))
    with pytest.raises(
        ShardError,
        match=r"fields/spk/data-00001\.tar at byte \d+: field files disagree: sample 2 is '.*' in .*data-00001\.tar but '.*' here",
    ):
        list(make_loader(packed.pattern, fields=["feats", "spk"], batch_size=4, num_workers=0, shuffle=False))
    assert main(["verify", "--quiet", str(packed.out)]) == 1


def test_missing_keys_are_an_error_or_absent_with_allow_missing(tmp_path):
    packed = pack_small(tmp_path, utts_per_file=10)
    gone = next(k for k, (_, _, shard) in read_shards([packed.out / "data-00003.tar"]).items())
    write_sources(packed, tmp_path / "src", skip={gone})
    with pytest.raises(InputError, match=rf"data-00\d+\.tar \(key '{gone}'\): the source .* has no value for this key"):
        add_field(packed.out, "ali", tmp_path / "src" / "ali.scp", progress=False)
    assert "ali" not in ShardIndex.load(packed.out).field_sets  # the index is updated last
    report = add_field(packed.out, "ali", tmp_path / "src" / "ali.scp", allow_missing=True, progress=False)
    assert report.samples == 48 == report.filled + report.missing and report.missing == 1
    assert report.written_now == 2  # the 3 sidecars finished before the error were kept
    rows = by_key(make_loader(packed.pattern, fields=["feats", "ali"], batch_size=4, num_workers=0))
    batch, row = rows[gone]
    assert int(batch["ali_lens"][row]) == -1
    assert all(int(b["ali_lens"][r]) > 0 for k, (b, r) in rows.items() if k != gone)


def test_resume_and_elastic_resume_keep_their_guarantees_with_sidecars(with_fields):
    packed, _ = with_fields
    options = dict(fields=["feats", "ali", "spk"], batch_size=3, seed=5, **SMALL)
    full = [b["keys"] for b in make_loader(packed.pattern, num_workers=2, **options)]
    loader = make_loader(packed.pattern, num_workers=2, **options)
    iterator = iter(loader)
    head = [next(iterator)["keys"] for _ in range(4)]
    state = json.loads(json.dumps(loader.state_dict()))
    del iterator
    resumed = make_loader(packed.pattern, num_workers=2, **options)
    resumed.load_state_dict(state)
    assert head + [b["keys"] for b in resumed] == full
    other = make_loader(packed.pattern, num_workers=0, **{**options, "fields": ["ali", "spk"], "batch_size": 5})
    with pytest.raises(StateMismatchError, match="fields"):
        other.load_state_dict(state)
    other.load_state_dict(state, strict=False)
    rest = [k for b in other for k in b["keys"]]
    assert sorted([k for h in head for k in h] + rest) == sorted(packed.data.keys)


def test_add_field_on_the_command_line_index_rebuild_and_foreign_readers(with_fields, tmp_path, capsys):
    packed, _ = with_fields
    assert main(["verify", "--quiet", str(packed.out)]) == 0

    def facts():
        return {n: (f.fields, f.digest, f.layout) for n, f in ShardIndex.load(packed.out).field_sets.items()}

    added = facts()
    (packed.out / "index.json").unlink()
    assert main(["index", "--quiet", str(packed.out)]) == 0  # without the old index: sidecars known by name
    assert facts() == added and sorted(added) == ["ali", "meta", "spk"]  # found again in fields/NAME/
    assert ShardIndex.load(packed.out).num_utts == 48
    code = main(
        [
            "add-field",
            str(packed.out),
            "--name",
            "spk",
            "--from",
            str(tmp_path / "src" / "utt2spk"),
            "--quiet",
            "--overwrite",
        ]
    )
    assert code == 0 and "48 with the field, 0 without" in capsys.readouterr().out
    assert main(["index", "--quiet", str(packed.out)]) == 0  # with it: field sets kept
    assert facts() == added
    again = ["add-field", str(packed.out), "--name", "spk", "--from", str(tmp_path / "src" / "utt2spk"), "--quiet"]
    assert main(again) == 0  # the same source again: nothing to do, as a rerun of pack
    assert "0 written by this run" in capsys.readouterr().out
    spk = tmp_path / "src" / "utt2spk"
    spk.write_text(spk.read_text().replace("spk0", "SPK0"))
    assert main(again) == 1
    err = capsys.readouterr().err
    assert "already has field set 'spk'" in err and "pass --overwrite to replace it" in err and "skip" not in err
    assert main([*again, "--from", str(tmp_path / "nope")]) == 1
    assert "--from " in capsys.readouterr().err
    import webdataset as wds

    keys = [s["__key__"] for s in wds.WebDataset(str(packed.out / "data-00000.tar"), shardshuffle=False)]
    with tarfile.open(packed.out / "fields/spk/data-00000.tar") as tar:
        names = tar.getnames()
    assert names == [f"{k}.spk.txt" for k in keys]


def test_a_sidecar_left_by_a_killed_add_field_is_not_taken_for_a_shard(tmp_path):
    packed = pack_small(tmp_path, utts_per_file=10)
    write_sources(packed, tmp_path / "src")
    add_field(packed.out, "spk", tmp_path / "src" / "utt2spk", progress=False)
    index = (packed.out / "index.json").read_text()
    add_field(packed.out, "ali", tmp_path / "src" / "ali.scp", progress=False)
    (packed.out / "index.json").write_text(index)  # as if killed before the index was updated
    assert [p.name for p in select_shards(str(packed.out)).paths] == [f"data-0000{i}.tar" for i in range(5)]
    assert sorted(k for b in make_loader(packed.out, batch_size=8, num_workers=0) for k in b["keys"]) == sorted(
        packed.data.keys
    )
    assert main(["verify", "--quiet", str(packed.out)]) == 0
    report = add_field(packed.out, "ali", tmp_path / "src" / "ali.scp", progress=False)  # the rerun finishes it
    assert report.written_now == 0 and "ali" in ShardIndex.load(packed.out).field_sets


def test_add_field_reads_kaldi_text_int_vectors_and_says_no_skip(tmp_path):
    packed = pack_small(tmp_path, utts_per_file=10)
    ali = alignments(packed)
    root = tmp_path / "src"
    root.mkdir()
    lines = [f"{k} {' '.join(map(str, v))}\n" for k, v in ali.items()]  # copy-int-vector ark,t
    (root / "ali.txt.ark").write_text("".join(lines))
    offset, scp = 0, []
    for key, line in zip(ali, lines):
        scp.append(f"{key} {root / 'ali.txt.ark'}:{offset + len(key) + 1}\n")
        offset += len(line.encode())
    (root / "ali.scp").write_text("".join(scp))
    add_field(packed.out, "ali", root / "ali.scp", progress=False)
    rows = by_key(make_loader(packed.pattern, fields=["feats", "ali"], batch_size=4, num_workers=0))
    for key, (batch, row) in rows.items():
        np.testing.assert_array_equal(batch["ali"][row, : int(batch["ali_lens"][row])].numpy(), ali[key])
    (root / "dup.scp").write_text(scp[0] + scp[0])
    with pytest.raises(InputError) as error:
        add_field(packed.out, "ali2", root / "dup.scp", progress=False)
    assert "skip" not in str(error.value)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_field_asked_for_is_in_every_batch_even_where_no_sample_has_it(tmp_path, workers):
    """add-field --allow-missing with a few keys (and with none): every batch carries the field
    and its lengths (-1 where absent), shaped as where it is present; texts as None."""
    packed = pack_small(tmp_path, utts_per_file=10)
    kept = set(packed.data.keys[:3])
    ali = write_sources(packed, tmp_path / "src", skip=set(packed.data.keys) - kept)
    add_field(packed.out, "ali", tmp_path / "src" / "ali.scp", allow_missing=True, progress=False)
    add_field(packed.out, "spk", tmp_path / "src" / "utt2spk", allow_missing=True, progress=False)
    none = tmp_path / "none"
    write_sources(packed, none, skip=set(packed.data.keys))
    add_field(packed.out, "nothing", none / "ali.scp", allow_missing=True, progress=False)
    options = dict(fields=["feats", "ali", "spk", "nothing"], batch_size=4, num_workers=workers, **SMALL)
    batches = list(make_loader(packed.pattern, **options))
    assert sum(len(b["keys"]) for b in batches) == len(packed.data.keys)
    without = [b for b in batches if not kept & set(b["keys"])]
    assert without, "some batch must hold none of the kept keys"
    for batch in batches:
        size = len(batch["keys"])
        assert batch["ali"].shape[0] == batch["ali_lens"].shape[0] == size and batch["ali"].dtype == torch.int32
        assert (
            batch["ali"].ndim == 2
            and batch["nothing"].shape == (size, 0)
            and list(batch["nothing_lens"]) == [-1] * size
        )
        for row, key in enumerate(batch["keys"]):
            if key in kept:
                length = int(batch["ali_lens"][row])
                np.testing.assert_array_equal(batch["ali"][row, :length], ali[key])
                assert batch["spk"][row] == key.split("-")[0]
            else:
                assert int(batch["ali_lens"][row]) == -1 and batch["spk"][row] is None


def test_a_batch_without_any_value_of_an_added_field_has_its_recorded_dtype_and_shape(tmp_path):
    """add-field records an array field's dtype and shape after its first axis in the index,
    so that even the first batch of a reader, holding none of its values, is shaped as the rest."""
    packed = pack_small(tmp_path, utts_per_file=10)
    options = dict(batch_size=4, num_workers=0, shuffle=False, interleave=1)
    first = list(make_loader(packed.pattern, **options))[-1]["keys"][0]  # a key of the last batch
    (tmp_path / "src").mkdir()
    with kaldiio.WriteHelper(f"ark,scp:{tmp_path}/src/pos.ark,{tmp_path}/src/pos.scp") as writer:
        writer(first, np.arange(12, dtype=np.float64).reshape(4, 3))
    add_field(packed.out, "pos", tmp_path / "src" / "pos.scp", allow_missing=True, progress=False)
    assert ShardIndex.load(packed.out).field_sets["pos"].layout == {"dtype": "float64", "shape": [3]}
    batches = list(make_loader(packed.pattern, fields=["feats", "pos"], **options))
    assert first not in batches[0]["keys"]
    for batch in batches:
        assert batch["pos"].dtype == torch.float64 and batch["pos"].ndim == 3 and batch["pos"].shape[2] == 3
    row = next((b, list(b["keys"]).index(first)) for b in batches if first in b["keys"])
    np.testing.assert_array_equal(row[0]["pos"][row[1], :4].numpy(), np.arange(12).reshape(4, 3))
