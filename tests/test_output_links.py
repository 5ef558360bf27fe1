"""No file seqshard writes lands outside the folder it writes, whatever links that folder holds:
each writer, given a symbolic link that leads out, refuses it by name before it writes, and the
user's file where the link points is left as it was."""

import shutil

import numpy as np
import pytest

from seqshard import add_field, pack_data
from seqshard.errors import OutputError
from seqshard.prep.binarize import binarize
from seqshard.tools.cmvn import CmvnStats, write_cmvn
from seqshard.tools.index import rebuild_index

USERS = b"the user's own file\n"


def _pack(packed, shards, **options):
    pack_data(packed.data.scp, packed.data.text, shards, utts_per_file=10, progress=False, **options)


def _copy(packed, shards):
    shutil.copytree(packed.out, shards)


def _units(root):
    (root / "units").write_text("<unk> 0\nA 1\nB 2\n")
    (root / "lines.txt").write_text("A B\nB A A\n")


# (the link, relative to the folder written; the name the writer would give the user's file; set-up; the writer)
WRITERS = {
    "pack: member tables": (".members", "data-00000.tar.npz", None, lambda p, s: _pack(p, s)),
    "pack: its state folder": (".seqshard-pack", "run.json", None, lambda p, s: _pack(p, s)),
    "pack: a length group": ("1_1000", "data-00000.tar", None, lambda p, s: _pack(p, s, filter_group=["1:1000"])),
    "index: member tables": (".members", "data-00000.tar.npz", "index", lambda p, s: rebuild_index(s, progress=False)),
    "add-field: sidecars": ("fields", "data-00000.tar", "copy", lambda p, s: add_field(s, "spk", p.out / "spk")),
    "add-field: its journal": (".seqshard-pack", "field-spk-1.jsonl", "copy", lambda p, s: add_field(s, "spk", p.out / "spk")),
    "binarize: the .bin": ("train.bin", None, "units", lambda p, s: binarize(s / "lines.txt", s / "train", s / "units", append_eos=False, progress=False)),
    "binarize: its temporary": (".train.bin.partial", None, "units", lambda p, s: binarize(s / "lines.txt", s / "train", s / "units", append_eos=False, progress=False)),
    "cmvn: its output": ("cmvn.json", None, "copy", lambda p, s: write_cmvn(CmvnStats(np.zeros(2), np.ones(2), 1, 1, {}, 0), s / "cmvn.json")),
}  # fmt: skip


@pytest.fixture(scope="module")
def spk_source(packed):
    source = packed.out / "spk"
    source.write_text("".join(f"{key} {packed.data.speaker_of[key]}\n" for key in packed.data.keys))
    return source


@pytest.mark.parametrize("case", WRITERS)
def test_a_writer_refuses_a_link_out_of_its_folder_and_leaves_the_users_file(tmp_path, packed, spk_source, case):
    link_name, file_name, setup, write = WRITERS[case]
    shards, victim = tmp_path / "shards", tmp_path / "victim"
    victim.mkdir()
    if setup in ("copy", "index"):
        _copy(packed, shards)
        for remove in [".members", "index.json", ".seqshard-pack"] if setup == "index" else []:
            shutil.rmtree(shards / remove) if (shards / remove).is_dir() else (shards / remove).unlink()
    else:
        shards.mkdir()
        if setup == "units":
            _units(shards)
    if file_name is None:  # the link is the file itself
        target = victim / "precious"
        target.write_bytes(USERS)
        (shards / link_name).symlink_to(target)
    else:
        (victim / file_name).write_bytes(USERS)
        shutil.rmtree(shards / link_name, ignore_errors=True)
        (shards / link_name).symlink_to(victim)
    before = sorted(p.name for p in victim.iterdir())

    with pytest.raises(OutputError, match=rf"{link_name}: is a symbolic link .*victim.*Fix: replace the link") as error:
        write(packed, shards)

    assert str(victim) in str(error.value)
    assert sorted(p.name for p in victim.iterdir()) == before  # nothing new there, nothing gone
    assert all(p.read_bytes() == USERS for p in victim.iterdir())
