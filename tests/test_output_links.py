"""No file seqshard writes lands outside the folder it writes, whatever links that folder holds:
each writer, given a symbolic link that leads out, refuses it by name before it writes, and the
user's file where the link points is left as it was."""

import os
import re
import shutil

import numpy as np
import pytest

from seqshard import add_field, pack_data
from seqshard.errors import OutputError
from seqshard.formats.files import open_output
from seqshard.formats.lock import FolderLock
from seqshard.formats.tar import ShardWriter
from seqshard.prep.binarize import binarize
from seqshard.prep.journal import Journal
from seqshard.tools.cmvn import CmvnStats, write_cmvn
from seqshard.tools.reindex import rebuild_index

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


# (the name in the folder written that is a hard link to the user's file; set-up; the writer)
HARD_LINKED = {
    "pack: the lock": (".seqshard.lock", None, lambda p, s: _pack(p, s)),
    "add-field: the lock": (".seqshard.lock", "copy", lambda p, s: add_field(s, "spk", p.out / "spk")),
    "index: the lock": (".seqshard.lock", "copy", lambda p, s: rebuild_index(s, progress=False)),
    "add-field: its journal": (".seqshard-pack/field-spk-1.jsonl", "copy", lambda p, s: Journal(s, "1", "field-spk").append({"a": 1})),
    "binarize: its temporary": (".train.bin.partial", "units", lambda p, s: binarize(s / "lines.txt", s / "train", s / "units", append_eos=False, progress=False)),
}  # fmt: skip


@pytest.mark.parametrize("case", HARD_LINKED)
def test_a_writer_refuses_a_hard_link_to_a_users_file_and_leaves_it(tmp_path, packed, spk_source, case):
    name, setup, write = HARD_LINKED[case]
    shards, users = tmp_path / "shards", tmp_path / "users-file"
    if setup == "copy":
        _copy(packed, shards)
    else:
        shards.mkdir()
        if setup == "units":
            _units(shards)
    users.write_bytes(USERS)
    (shards / name).parent.mkdir(exist_ok=True)
    os.link(users, shards / name)

    with pytest.raises(
        OutputError,
        match=rf"{re.escape(name)}: is a file with 2 names \(hard links\).*Fix: remove this name \(the file's other names keep",
    ):
        write(packed, shards)

    assert users.read_bytes() == USERS and os.stat(users).st_nlink == 2


@pytest.mark.parametrize("resume", [True, False])
def test_a_partial_shard_that_has_other_names_is_neither_resumed_nor_emptied(tmp_path, resume):
    users = tmp_path / "users-file"
    writer = ShardWriter(tmp_path / "data-00000.tar")
    writer.add("a", [("txt", [b"x"])])
    part = writer.written()
    writer.close()
    os.replace(writer.temp_path, users)
    os.link(users, writer.temp_path)
    before = users.read_bytes()

    with pytest.raises(OutputError, match=r"is a file with 2 names"):
        ShardWriter(tmp_path / "data-00000.tar", resume=part if resume else None)

    assert users.read_bytes() == before


def test_a_lock_or_output_that_is_a_fifo_is_refused_without_waiting_for_a_reader(tmp_path):
    lock = tmp_path / ".seqshard.lock"
    os.mkfifo(lock)
    with pytest.raises(
        OutputError, match=r"\.seqshard\.lock: is a FIFO \(named pipe\).* Fix: remove it; seqshard"
    ) as refused:
        FolderLock(tmp_path, "seqshard index").acquire()
    assert "hard link" not in str(refused.value)
    with pytest.raises(OutputError, match=r"\.seqshard\.lock: is a FIFO \(named pipe\)"):
        open_output(lock)
