"""Names read from data (an index, a pack's plan) never point outside the dataset's folder:
refused when read, and writers check the real path; lists keep naming shards anywhere."""

import json
import shutil

import pytest

from conftest import pack_small
from seqshard import add_field, make_loader
from seqshard.errors import SeqshardError
from seqshard.formats.index import ShardIndex
from seqshard.formats.selection import select_shards


@pytest.fixture
def dataset(tmp_path):
    packed = pack_small(tmp_path, utts_per_file=10)
    (tmp_path / "spk").write_text("".join(f"{k} {k[:6]}\n" for k in packed.data.keys))
    victim = tmp_path / "victim"
    victim.mkdir()
    shutil.copy(packed.out / "data-00000.tar", victim / "data-00000.tar")
    return packed, tmp_path


def edit_index(folder, change):
    index = json.loads((folder / "index.json").read_text())
    change(index)
    (folder / "index.json").write_text(json.dumps(index))


def rename_shard(index):
    index["shards"][0]["name"] = "../victim/data-00000.tar"


def test_an_index_naming_a_shard_outside_its_folder_is_refused_before_add_field_writes(dataset):
    packed, root = dataset
    edit_index(packed.out, rename_shard)
    with pytest.raises(SeqshardError, match=r"index\.json: shard entry 0 is named '\.\./victim/data-00000\.tar'"):
        add_field(packed.out, "spk", root / "spk", progress=False)
    assert sorted(p.name for p in (root / "victim").rglob("*")) == ["data-00000.tar"]  # nothing written there
    with pytest.raises(SeqshardError, match=r"shard entry 0 is named .*rebuild it with `seqshard index"):
        make_loader(packed.pattern, batch_size=4, num_workers=0)


@pytest.mark.parametrize(
    "name", ["../../victim/data-00000.tar", "/etc/passwd", "fields/spk/../../../victim/data-00000.tar"]
)
def test_a_sidecar_name_other_than_its_layout_is_refused_before_it_is_read(dataset, name):
    packed, root = dataset
    add_field(packed.out, "spk", root / "spk", progress=False)
    sidecar = ShardIndex.load(packed.out).shards[0].sidecars["spk"].name
    shutil.copy(packed.out / sidecar, root / "victim/data-00000.tar")  # readable where the name points

    def point_outside(index):
        index["shards"][0]["sidecars"]["spk"]["name"] = name

    edit_index(packed.out, point_outside)
    with pytest.raises(SeqshardError, match=r"shard entry 0 \(data-00000\.tar\) puts its field set 'spk' in"):
        make_loader(packed.pattern, fields=["spk"], batch_size=4, num_workers=0)


def test_a_field_set_name_from_an_index_is_checked(dataset):
    packed, root = dataset
    add_field(packed.out, "spk", root / "spk", progress=False)

    def rename_set(index):
        index["field_sets"]["../x"] = index["field_sets"].pop("spk")

    edit_index(packed.out, rename_set)
    with pytest.raises(SeqshardError, match=r"a field set is named '\.\./x'"):
        make_loader(packed.pattern, batch_size=4, num_workers=0)


def test_names_in_a_pack_plan_are_checked(dataset):
    packed, _ = dataset
    planned = packed.out / ".seqshard-pack/planned.json"
    plan = json.loads(planned.read_text())
    plan["groups"][""][0][0] = "../victim/data-00000.tar"
    planned.write_text(json.dumps(plan))
    (packed.out / "index.json").unlink()  # a pack still being written: its plan is read
    with pytest.raises(SeqshardError, match=r"planned\.json: a planned shard is named '\.\./victim/data-00000\.tar'"):
        select_shards(str(packed.out))


def test_add_field_does_not_write_through_a_link_out_of_the_folder(dataset):
    packed, root = dataset
    (packed.out / "fields").symlink_to(root / "victim")
    with pytest.raises(SeqshardError, match=r"fields: is a symbolic link to .*victim, outside .*writes only inside"):
        add_field(packed.out, "spk", root / "spk", progress=False)
    assert sorted(p.name for p in (root / "victim").rglob("*")) == ["data-00000.tar"]


def test_a_list_still_names_shards_anywhere_for_reading(dataset):
    packed, root = dataset
    listed = root / "elsewhere" / "data.list"
    listed.parent.mkdir()
    listed.write_text("".join(f"{p}\n" for p in sorted(packed.out.glob("data-*.tar"))))  # absolute paths
    keys = [k for b in make_loader(listed, batch_size=8, num_workers=0) for k in b["keys"]]
    assert sorted(keys) == sorted(packed.data.keys)
