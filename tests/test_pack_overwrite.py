"""`pack --overwrite` removes what the previous pack in the folder recorded as its own (its
shards, tables, sidecars, index, report, state) and nothing else: another corpus kept in the
folder, a link to one elsewhere and a user's notes stay as they were, and a pack never writes
over a file that no pack there wrote."""

import shutil

import pytest

from conftest import read_shards, write_kaldi_dir
from seqshard import ShardIndex, add_field, pack_data
from seqshard.errors import ConfigError


def _files(*folders):
    """Every file under ``folders`` (links not followed) with its bytes."""
    return {path: path.read_bytes() for folder in folders for path in sorted(folder.rglob("*")) if path.is_file()}


def _corpus_copy(packed, folder):
    """Another corpus as another tool keeps it: shards and an index, no pack state."""
    folder.mkdir(parents=True)
    for path in [*packed.out.glob("data-*.tar"), packed.out / "index.json"]:
        shutil.copy(path, folder)


def test_overwrite_removes_only_the_previous_pack(tmp_path, packed):
    out = tmp_path / "out"
    shutil.copytree(packed.out, out)  # the previous pack, with its state
    (tmp_path / "spk").write_text("".join(f"{key} {packed.data.speaker_of[key]}\n" for key in packed.data.keys))
    add_field(out, "spk", tmp_path / "spk", progress=False)  # its sidecars are its own too
    _corpus_copy(packed, out / "librispeech")
    _corpus_copy(packed, tmp_path / "elsewhere")
    (out / "linked").symlink_to(tmp_path / "elsewhere")
    (out / "notes.txt").write_text("which corpus is which\n")
    others = _files(out / "librispeech", tmp_path / "elsewhere")
    others[out / "notes.txt"] = (out / "notes.txt").read_bytes()
    second = write_kaldi_dir(tmp_path / "second", speakers=3, seed=1)

    with pytest.raises(ConfigError, match="holds shards packed from other inputs") as refused:
        pack_data(second.scp, second.text, out, utts_per_file=10, progress=False)
    message = str(refused.value)
    assert "also holds what no pack here wrote" in message
    assert f"{out / 'librispeech'}/ (5 shard files, index.json)" in message
    assert f"{out / 'linked'} -> {tmp_path / 'elsewhere'}" in message and f"{out / 'notes.txt'}" in message

    report = pack_data(second.scp, second.text, out, utts_per_file=10, overwrite=True, progress=False)

    assert report.packed == 24 and report.shards_total == 3
    assert {path: path.read_bytes() for path in others} == others  # the other corpora and the notes, as they were
    assert (out / "linked").is_symlink()
    assert sorted(p.name for p in out.glob("data-*.tar")) == ["data-00000.tar", "data-00001.tar", "data-00002.tar"]
    assert sorted(p.name for p in (out / ".members").iterdir()) == [f"data-0000{i}.tar.npz" for i in range(3)]
    assert not (out / "fields").exists()  # the previous pack's sidecars went with it
    assert sorted(read_shards(out.glob("data-*.tar"))) == sorted(second.keys)
    assert ShardIndex.load(out).field_sets == {}


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_pack_never_writes_over_a_corpus_it_did_not_write(tmp_path, packed, overwrite):
    out = tmp_path / "out"
    _corpus_copy(packed, out)
    before = _files(out)

    with pytest.raises(
        ConfigError, match=r"would write over or mix its shards with, and that no pack here wrote: .*data-00000\.tar"
    ) as error:
        pack_data(packed.data.scp, packed.data.text, out, utts_per_file=10, overwrite=overwrite, progress=False)

    assert "index.json" in str(error.value) and "move them elsewhere" in str(error.value)
    assert _files(out) == before


def test_an_index_table_goes_with_its_pack_and_a_foreign_one_is_not_written_over(tmp_path, packed, monkeypatch):
    """index.npz (the shards of index.json as arrays, written for folders of many shards) is
    the pack's own: removed with it by --overwrite; one no pack here wrote is named, not replaced."""
    from seqshard.formats import index_table

    monkeypatch.setattr(index_table, "TABLE_FROM", 1)  # a table for this pack of 5 shards
    out = tmp_path / "out"
    pack_data(packed.data.scp, packed.data.text, out, utts_per_file=10, progress=False)
    first = (out / "index.npz").read_bytes()
    second = write_kaldi_dir(tmp_path / "second", speakers=3, seed=1)
    pack_data(second.scp, second.text, out, utts_per_file=10, overwrite=True, progress=False)
    assert (out / "index.npz").read_bytes() != first
    tables, read_table = [], index_table.read_table
    monkeypatch.setattr(index_table, "read_table", lambda *args: tables.append(read_table(*args)) or tables[-1])
    assert ShardIndex.load(out).num_utts == 24 and tables[0] is not None  # read from the table

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "index.npz").write_bytes(b"another tool's arrays")
    with pytest.raises(ConfigError, match=r"index\.npz"):
        pack_data(packed.data.scp, packed.data.text, foreign, utts_per_file=10, progress=False)
    assert (foreign / "index.npz").read_bytes() == b"another tool's arrays"
