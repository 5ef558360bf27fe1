"""Sidecars live in FOLDER/fields/NAME/, where no glob of the shards finds them: WebDataset
and tar readers globbing data-*.tar see the main shards only. The old layout (beside the
shards) still reads, and `seqshard index --move-sidecars` moves it."""

import glob
import json
import shutil
import tarfile

import pytest
import webdataset as wds
from braceexpand import braceexpand

from conftest import pack_small, write_kaldi_dir
from seqshard import add_field, make_loader, pack_data
from seqshard.cli import main
from seqshard.errors import ConfigError
from seqshard.formats.index import ShardIndex
from seqshard.formats.members import TABLE_DIR
from seqshard.formats.selection import select_shards

OPTIONS = dict(batch_size=4, num_workers=0, shuffle_window=8, sort_window=4, interleave=2)


@pytest.fixture
def with_sidecar(tmp_path):
    packed = pack_small(tmp_path, utts_per_file=10)
    (tmp_path / "spk").write_text("".join(f"{k} {k[:6]}\n" for k in packed.data.keys))
    add_field(packed.out, "spk", tmp_path / "spk", progress=False)
    return packed


def webdataset_keys(urls):
    """(key, fields) of every sample WebDataset reads from ``urls``."""
    samples = wds.WebDataset(urls, shardshuffle=False)
    return [(s["__key__"], sorted(k for k in s if not k.startswith("__"))) for s in samples]


def test_webdataset_and_tar_readers_globbing_the_shards_see_no_sidecar(with_sidecar):
    out = with_sidecar.out
    urls = sorted(glob.glob(f"{out}/data-*.tar"))
    samples = webdataset_keys(urls)
    assert len(samples) == 48 and all(fields == ["feats.npy", "txt"] for _, fields in samples)
    assert sorted(k for k, _ in samples) == sorted(with_sidecar.data.keys)
    assert len(webdataset_keys(list(braceexpand(f"{out}/data-{{00000..00004}}.tar")))) == 48
    for url in urls:
        with tarfile.open(url) as archive:
            assert {name.split(".", 1)[1] for name in archive.getnames()} == {"feats.npy", "txt"}
    assert len(webdataset_keys(sorted(glob.glob(f"{out}/fields/spk/data-*.tar")))) == 48  # the field alone


def test_no_pattern_of_the_folder_selects_its_fields_folder(with_sidecar):
    out = with_sidecar.out
    for pattern in (str(out), f"{out}/*"):
        assert [p.name for p in select_shards(pattern).paths] == [f"data-0000{i}.tar" for i in range(5)], pattern
    for pattern in (f"{out}/*/", f"{out}/fields/*/data-*.tar"):  # sidecars are never read as shards
        with pytest.raises(ConfigError, match="selects no shard"):
            select_shards(pattern)
    assert speakers(f"{out}/*") == {k: k[:6] for k in with_sidecar.data.keys}


def test_length_groups_keep_their_sidecars_in_their_own_fields_folder(tmp_path):
    data = write_kaldi_dir(tmp_path / "kaldi")
    out = tmp_path / "shards"
    pack_data(data.scp, data.text, out, filter_group=["5:30", "30:60"], utts_per_file=10, progress=False)
    (tmp_path / "spk").write_text("".join(f"{k} {k[:6]}\n" for k in data.keys))
    add_field(out, "spk", tmp_path / "spk", progress=False)
    assert sorted(p.parent.parent.parent.name for p in out.glob("*/fields/spk/*.tar")) == ["30_60"] * 3 + ["5_30"] * 3
    for pattern in (str(out), f"{out}/*/", f"{out}/*/data-*.tar"):
        assert all(p.parent.name in ("5_30", "30_60") for p in select_shards(pattern).paths), pattern
        assert len(select_shards(pattern).paths) == 6
    assert sorted(speakers(f"{out}/*/")) == sorted(data.keys)


def speakers(patterns):
    """key -> its spk field, read by the loader."""
    return {k: s for b in make_loader(patterns, fields=["spk"], **OPTIONS) for k, s in zip(b["keys"], b["spk"])}


def to_old_layout(out):
    """The folder as add-field left it before fields/NAME/: data-00042.spk.tar beside the shard."""
    index = json.loads((out / "index.json").read_text())
    for entry in index["shards"]:
        car = entry["sidecars"]["spk"]
        old = entry["name"].replace(".tar", ".spk.tar")
        (out / car["name"]).rename(out / old)
        car["name"] = old
        del car["first_key"], car["last_key"]
    shutil.rmtree(out / "fields/spk" / TABLE_DIR)  # as a folder made before member tables
    (out / "fields/spk").rmdir()
    (out / "fields").rmdir()
    (out / "index.json").write_text(json.dumps(index))


def test_the_old_layout_reads_and_index_moves_it_on_request(with_sidecar, caplog):
    out = with_sidecar.out
    to_old_layout(out)
    expected = {k: k[:6] for k in with_sidecar.data.keys}
    assert speakers(out) == expected
    assert len(webdataset_keys(sorted(glob.glob(f"{out}/data-*.tar")))) == 96  # what the old layout did to globs
    with caplog.at_level("WARNING", logger="seqshard"):
        assert main(["index", "--quiet", str(out)]) == 0
    assert "5 sidecars are in the old layout of add-field" in caplog.text and "--move-sidecars" in caplog.text
    assert main(["index", "--quiet", "--move-sidecars", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.tar")) == [f"data-0000{i}.tar" for i in range(5)]
    car = ShardIndex.load(out).shards[0].sidecars["spk"]
    assert car.name == "fields/spk/data-00000.tar" and car.first_key is not None
    assert speakers(out) == expected
    assert len(webdataset_keys(sorted(glob.glob(f"{out}/data-*.tar")))) == 48
    assert main(["verify", "--quiet", str(out)]) == 0
    assert main(["index", "--quiet", "--move-sidecars", str(out)]) == 0  # nothing left to move


def test_a_move_killed_after_linking_leaves_a_readable_folder_and_a_rerun_finishes_it(with_sidecar):
    out = with_sidecar.out
    to_old_layout(out)
    old = out / "data-00002.spk.tar"
    (out / "fields/spk").mkdir(parents=True)
    (out / "fields/spk/data-00002.tar").hardlink_to(old)  # killed after its first link
    assert len(speakers(out)) == 48
    assert main(["index", "--quiet", "--move-sidecars", str(out)]) == 0
    assert not old.exists() and ShardIndex.load(out).shards[2].sidecars["spk"].name == "fields/spk/data-00002.tar"
    assert main(["verify", "--quiet", str(out)]) == 0


def test_wids_over_a_glob_of_the_shards_sees_no_sidecar(with_sidecar, tmp_path):
    import wids

    urls = sorted(glob.glob(f"{with_sidecar.out}/data-*.tar"))
    shards = [{"url": url, "nsamples": 10 if not url.endswith("00004.tar") else 8} for url in urls]
    dataset = wids.ShardListDataset(shards, transformations=[], cache_dir=str(tmp_path / "wids-cache"))
    samples = [dataset[i] for i in range(len(dataset))]
    assert len(samples) == 48 and sorted(s["__key__"] for s in samples) == sorted(with_sidecar.data.keys)
    assert all(sorted(k for k in s if not k.startswith("__")) == [".feats.npy", ".txt"] for s in samples)


def write_webdataset_shard(path, keys):
    with wds.TarWriter(str(path)) as sink:
        for key in keys:
            sink.write({"__key__": key, "txt": f"text of {key}"})


def test_foreign_shards_with_dotted_names_are_shards_not_sidecars(tmp_path, caplog):
    """WebDataset shards part.tar, part.1.tar and part.v2.tar are three shards (other keys): a
    dotted name alone never makes a file a field file of add-field's old layout."""
    folder = tmp_path / "foreign"
    folder.mkdir()
    names = {"part.tar": "a", "part.1.tar": "b", "part.v2.tar": "c"}
    for name, prefix in names.items():
        write_webdataset_shard(folder / name, [f"{prefix}{n}" for n in range(5)])
    options = dict(batch_size=4, num_workers=0, shuffle=False)

    def keys(pattern):
        return sorted(k for batch in make_loader(pattern, **options) for k in batch["keys"])

    assert keys(folder) == sorted(f"{p}{n}" for p in "abc" for n in range(5))
    assert keys(folder / "part.1.tar") == [f"b{n}" for n in range(5)]  # named directly
    assert keys(str(folder / "part.*.tar")) == sorted(f"{p}{n}" for p in "bc" for n in range(5))
    assert main(["index", "--quiet", str(folder)]) == 0
    assert sorted(entry.name for entry in ShardIndex.load(folder).shards) == sorted(names)
    # the same keys in the same order as part.tar is evidence: a field file no index lists, named in a warning
    (folder / "index.json").unlink()
    write_webdataset_shard(folder / "part.spk.tar", [f"a{n}" for n in range(5)])
    with caplog.at_level("WARNING", logger="seqshard"):
        assert len(keys(folder)) == 15
    assert "part.spk.tar holds the keys of part.tar in the same order" in caplog.text
    with pytest.raises(ConfigError, match=r"part\.spk\.tar is a field file of add-field, read with its shard"):
        make_loader(folder / "part.spk.tar", **options)


def test_an_index_rebuilt_without_the_old_one_finds_the_field_sets_again(with_sidecar, caplog):
    """index.json (and index.npz) lost: `seqshard index` found the shards but not fields/spk/,
    so the field set was gone from the loader. Now the set is indexed again from its sidecars
    (its fields from their members, its digest from add-field's journal)."""
    out = with_sidecar.out
    before = json.loads((out / "index.json").read_text())
    for name in ("index.json", "index.npz"):
        (out / name).unlink(missing_ok=True)
    assert main(["index", str(out), "--quiet"]) == 0
    after = json.loads((out / "index.json").read_text())
    assert [s["sidecars"] for s in after["shards"]] == [s["sidecars"] for s in before["shards"]]
    found, had = after["field_sets"]["spk"], before["field_sets"]["spk"]
    assert (found["fields"], found["digest"], found["allow_missing"]) == (had["fields"], had["digest"], False)
    assert "field set 'spk' found in fields/spk/" in caplog.text
    assert speakers(str(out)) == {k: k[:6] for k in with_sidecar.data.keys}
    (out / "fields" / "spk" / "data-00003.tar").unlink()  # a shard without its sidecar: the set allows missing
    (out / "index.json").unlink()
    assert main(["index", str(out), "--quiet"]) == 0
    assert json.loads((out / "index.json").read_text())["field_sets"]["spk"]["allow_missing"] is True
