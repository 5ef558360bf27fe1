"""Which shards a pattern selects: nothing may be left out without a word (loader, inspect,
verify and index alike)."""

import hashlib
import json
import os
import shutil
import time

import pytest

from conftest import pack_small, write_kaldi_dir
from seqshard import make_loader, pack_data
from seqshard.cli import main
from seqshard.errors import ConfigError, ShardError
from seqshard.formats.selection import select_shards


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    """48 utterances packed into two length groups (5_40 and 40_80), 10 per shard."""
    root = tmp_path_factory.mktemp("grouped")
    data = write_kaldi_dir(root / "kaldi", frames=(5, 80))
    pack_data(data.scp, data.text, root / "shards", filter_group=["5:40", "40:80"], utts_per_file=10, progress=False)
    return data, root / "shards"


def keys_of(loader):
    return [k for batch in loader for k in batch["keys"]]


def test_a_brace_alternative_that_selects_nothing_is_an_error_everywhere(grouped, capsys):
    data, out = grouped
    typo = f"{out}/{{5_40,40_8}}/data-*.tar"
    with pytest.raises(ConfigError, match=r"'.*/40_8/data-\*\.tar' \(from the pattern .*\) selects no shard"):
        make_loader(typo, batch_size=4)
    assert main(["inspect", "--quiet", typo]) == 1
    assert "40_8/data-*.tar" in capsys.readouterr().err
    assert main(["verify", "--quiet", typo]) == 1
    assert "selects no shard" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="40_8"):  # every element of a list, too
        make_loader([f"{out}/5_40/data-*.tar", f"{out}/40_8/data-*.tar"], batch_size=4)
    with pytest.raises(ShardError, match=r"data-00003\.tar \(named in the pattern, but it does not exist\)"):
        make_loader(f"{out}/5_40/data-0000{{0..3}}.tar", batch_size=4)  # the group has 3 shards, not 4
    both = keys_of(make_loader(f"{out}/{{5_40,40_80}}/data-*.tar", batch_size=4, num_workers=0))
    assert sorted(both) == sorted(data.keys)


def test_globs_select_shards_only_not_the_index_or_other_files(grouped, capsys):
    data, out = grouped
    (out / "5_40" / "README").write_text("notes\n")
    table = select_shards(f"{out}/5_40/*")
    assert [p.name for p in table.paths] == ["data-00000.tar", "data-00001.tar", "data-00002.tar"]
    in_group = [k for k in data.keys if 5 <= data.arrays[k].shape[0] < 40]
    assert sorted(keys_of(make_loader(f"{out}/5_40/*", batch_size=4, num_workers=0))) == sorted(in_group)
    assert main(["inspect", "--json", "--quiet", f"{out}/5_40/*"]) == 0
    assert json.loads(capsys.readouterr().out)["num_utts"] == len(in_group)
    assert main(["verify", "--quiet", f"{out}/*/*"]) == 0
    assert "0 damaged, 0 missing" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"index\.json is not a shard"):
        make_loader(f"{out}/5_40/index.json", batch_size=4)
    with pytest.raises(ConfigError, match="selects no shard"):
        make_loader(f"{out}/5_40/*.json", batch_size=4)


def test_a_shard_listed_in_the_index_but_missing_is_named_or_counted(tmp_path, capsys):
    packed = pack_small(tmp_path, utts_per_file=10)
    gone = packed.out / "data-00002.tar"
    gone.unlink()
    for pattern in (packed.pattern, str(packed.out), f"{packed.out}/data-0000[0-4].tar"):
        with pytest.raises(
            ShardError, match=r"1 selected shard is missing: data-00002\.tar \(listed in its folder's index\.json"
        ):
            make_loader(pattern, batch_size=4)
    with pytest.raises(
        ShardError,
        match=r"1 of 5 selected shards was bad this epoch \(0 damaged, 1 missing\): more than the 0 that max_bad_shards=0\.05 allows",
    ):
        make_loader(packed.pattern, batch_size=4, num_workers=2, skip_bad=True)
    loader = make_loader(packed.pattern, batch_size=4, num_workers=2, skip_bad=True, max_bad_shards=0.2)
    keys = keys_of(loader)
    assert len(keys) == 48 - 10 and len(set(keys)) == len(keys)
    assert loader.stats()["missing_shards"] == 1
    assert loader.last_summary["missing_shards"] == [str(gone)]
    assert main(["verify", "--quiet", str(packed.out)]) == 1
    assert f"MISSING {gone}" in capsys.readouterr().out
    assert main(["inspect", "--quiet", packed.pattern]) == 1
    assert f"MISSING {gone}" in capsys.readouterr().out
    # a pattern that names only other shards is not concerned
    assert len(keys_of(make_loader(f"{packed.out}/data-0000[01].tar", batch_size=4, num_workers=0))) == 20


def test_an_unfinished_multi_part_pack_is_not_read_or_indexed_as_if_complete(tmp_path, capsys):
    data = write_kaldi_dir(tmp_path / "kaldi")
    out = tmp_path / "shards"
    pack_data(data.scp, data.text, out, utts_per_file=10, num_parts=2, part=0, progress=False)
    for name in ("index.json", "data-00001.tar", "data-00003.tar"):  # as parts that have not all run leave it
        (out / name).unlink()
    assert sorted(p.name for p in out.glob("*.tar")) == ["data-00000.tar", "data-00002.tar", "data-00004.tar"]
    with pytest.raises(
        ShardError,
        match=r"2 selected shards are missing: data-00001\.tar \(planned by a pack that has not finished",
    ):
        make_loader(f"{out}/data-*.tar", batch_size=4)
    loader = make_loader(str(out), batch_size=4, num_workers=0, skip_bad=True, max_bad_shards=2)
    assert len(keys_of(loader)) == 10 + 10 + 8 and loader.stats()["missing_shards"] == 2
    assert main(["index", "--quiet", str(out)]) == 1
    err = capsys.readouterr().err
    assert "unfinished: 2 of its 5 planned shards are not written yet" in err and "data-00003.tar" in err
    assert not (out / "index.json").exists()
    report = pack_data(data.scp, data.text, out, utts_per_file=10, num_parts=2, part=1, progress=False)
    assert report.complete and (out / "index.json").exists()
    assert sorted(keys_of(make_loader(f"{out}/data-*.tar", batch_size=4, num_workers=0))) == sorted(data.keys)
    assert main(["index", "--quiet", str(out)]) == 0


@pytest.mark.parametrize("pattern", ["{folder}", "{folder}/*.tar", "{folder}/part-{{0,1}}.tar"])
def test_a_dangling_link_named_like_a_shard_is_a_missing_shard(tmp_path, pattern):
    """A folder of foreign shards (no index) linked from a disk that is not mounted: the link
    was passed over and the other shards read as if they were all."""
    folder = tmp_path / "foreign"
    folder.mkdir()
    (folder / "part-0.tar").write_bytes(b"\0" * 1024)
    (folder / "part-1.tar").symlink_to(tmp_path / "unmounted/part-1.tar")
    (folder / "notes.txt").symlink_to(tmp_path / "unmounted/notes.txt")  # not named like a shard: not one
    selection = select_shards(pattern.format(folder=folder))
    assert selection.paths == [folder / "part-0.tar"]
    assert [(m.path, m.why) for m in selection.missing] == [
        (folder / "part-1.tar", f"a link to {tmp_path / 'unmounted/part-1.tar'}, which does not exist")
    ]
    assert select_shards(str(folder / "part-0.tar")).missing == []  # a shard named alone: the link is not asked for


def test_index_refuses_a_folder_with_a_dangling_link_named_like_a_shard(tmp_path):
    """An index of the other shards would hide the linked one for good."""
    from seqshard.errors import ConfigError
    from seqshard.tools.reindex import rebuild_index

    folder = tmp_path / "foreign"
    folder.mkdir()
    (folder / "part-0.tar").write_bytes(b"\0" * 1024)
    (folder / "part-1.tar").symlink_to(tmp_path / "unmounted/part-1.tar")
    with pytest.raises(ConfigError, match=r"part-1.tar -> .*unmounted/part-1.tar\): mount or restore"):
        rebuild_index(folder, progress=False)
    assert not (folder / "index.json").exists()
    for number in range(2, 9):  # a long list: its first five named, and how many more (was 3 and "...")
        (folder / f"part-{number}.tar").symlink_to(tmp_path / f"unmounted/part-{number}.tar")
    with pytest.raises(ConfigError, match=r"\(part-\d\.tar -> [^,]*(, part-\d\.tar -> [^,]*){4} and 3 more\): mount"):
        rebuild_index(folder, progress=False)


BRACES = [
    "a",
    "{a,b}",
    "x{1..3}y",
    "{01..10}",
    "{4..1}",
    "{2..-1}",
    "{-05..05..5}",
    "{a..g..2}",
    "{Z..c}",
    "{a..A}",
    "python{2.{5..7},3.{2,3}}",
    "index.html{,.backup}",
    r"{1\{2,3}",
    r"\{1,2}",
    r"b.{,b\\}\\",
    r"1{.\\}.",
    "a}b{c",
    "}{",
    "{}",
    "{a{1,2}}",
    "{,,}",
    "{1..10..3}{a,b}",
    "{1..3..0}",
    "{{a,b},{c,d}}/{0..2}.tar",
]


@pytest.mark.parametrize("escape", [True, False])
def test_braces_expand_as_braceexpand_expands_them(escape):
    """seqshard expands braces itself (lazily, after counting them), by braceexpand's rules."""
    from braceexpand import UnbalancedBracesError, braceexpand

    from seqshard.formats.patterns import expand_braces

    for pattern in BRACES:
        try:
            expected = list(braceexpand(pattern, escape=escape))
        except UnbalancedBracesError:
            with pytest.raises(ConfigError, match="has unbalanced braces"):
                expand_braces(pattern, escape=escape)
            continue
        assert list(expand_braces(pattern, escape=escape)) == expected, pattern


@pytest.mark.parametrize(
    "pattern", ["m_{0..9999999}.json", "manifest__OP_0..99999999_CL_.json", "s{0..9999}/d{0..9999}.tar"]
)
def test_a_pattern_of_millions_of_alternatives_is_refused_at_once(tmp_path, pattern):
    """m_{0..9999999}.json kept the loader busy for minutes (each alternative made and looked
    up); 10^8 of them ended in a MemoryError."""
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=r"expands to 10(0?),000,000 alternatives, more than the 2,000,000"):
        make_loader(str(tmp_path / pattern), batch_size=4)
    assert time.perf_counter() - started < 5


def test_unbalanced_braces_and_a_missing_folder_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"the pattern '.*data-\{0\.\.3\.tar' has unbalanced braces"):
        make_loader(f"{tmp_path}/data-{{0..3.tar", batch_size=4)  # an UnbalancedBracesError
    with pytest.raises(ConfigError, match="has a range with an end too long to be a number"):
        make_loader(f"{tmp_path}/data-{{0..{'9' * 5000}}}.tar", batch_size=4)  # a ValueError
    with pytest.raises(ShardError, match=r"1 selected shard is missing: data-0\.tar \(named in the pattern"):
        make_loader(f"{tmp_path}/gone/data-0.tar", batch_size=4)  # a FileNotFoundError


def test_many_names_in_one_folder_are_looked_up_with_one_listing(tmp_path, monkeypatch):
    """Users name 5*10^5 shards by one brace pattern: their folder is listed once, not each
    name stat'ed (over a network file system, a round trip each)."""
    import pathlib

    folder = tmp_path / "shards"
    folder.mkdir()
    for number in range(0, 3000, 2):
        (folder / f"part-{number:05d}.tar").write_bytes(b"")
    stat, calls = pathlib.Path.stat, []
    monkeypatch.setattr(pathlib.Path, "stat", lambda self, **kw: calls.append(self) or stat(self, **kw))
    selection = select_shards(f"{folder}/part-{{00000..02999}}.tar")
    assert [p.name for p in selection.paths] == [f"part-{n:05d}.tar" for n in range(0, 3000, 2)]
    assert [m.path.name for m in selection.missing] == [f"part-{n:05d}.tar" for n in range(1, 3000, 2)]
    assert {m.why for m in selection.missing} == {"named in the pattern, but it does not exist"}
    assert len(calls) < 50


@pytest.mark.parametrize("pattern", ["data-(0..4).tar", "data-[0..4].tar", "data-<0,1>.tar", "(a,b)/data-0.tar"])
def test_nemo_bracket_braces_in_a_shard_pattern_are_refused_by_name(grouped, pattern):
    """NeMo reads (…), […] and <…> as braces; seqshard's patterns do not ([…] is a wildcard):
    such a pattern selected nothing, or other files, with no word of NeMo's reading."""
    _, out = grouped
    with pytest.raises(ConfigError, match=r"holds NeMo's spelling of braces.*Fix: write braces"):
        make_loader(f"{out}/5_40/{pattern}", batch_size=4)
    assert len(select_shards(f"{out}/5_40/data-0000[0-2].tar").paths) == 3  # a wildcard [...] is one still


def test_a_name_holding_brackets_is_a_name_where_it_exists(grouped, tmp_path):
    _, out = grouped
    shutil.copytree(out / "5_40", tmp_path / "run(1,2)")
    assert len(select_shards(f"{tmp_path}/run(1,2)/data-*.tar").paths) == 3


MANY = 1_200  # shards of a folder large enough for its index to get a table (index_table.TABLE_FROM)
PER_SHARD = 20  # utterances: MANY of them make an epoch too large to walk batch by batch (counts.EXACT_UTTS)


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """A folder of MANY shards: hard links of one packed shard of 20 utterances (with its member
    table), each listed in the index under its own name and checksum, as a pack writes it."""
    from seqshard.formats.index import ShardIndex

    root = tmp_path_factory.mktemp("many")
    seed = pack_small(root, utts_per_file=PER_SHARD, speakers=4, per_speaker=5, frames=(5, 60)).out
    folder = root / "many"
    (folder / ".members").mkdir(parents=True)
    index = json.loads((seed / "index.json").read_text())
    entries = []
    for number in range(MANY):
        name = f"data-{number:05d}.tar"
        os.link(seed / "data-00000.tar", folder / name)
        os.link(seed / ".members" / "data-00000.tar.npz", folder / ".members" / f"{name}.npz")
        entries.append({**index["shards"][0], "name": name, "checksum": f"crc32:{number:08x}"})
    ShardIndex.from_json({**index, "shards": entries}, folder, "test").save(folder)
    return folder


def test_a_folder_of_many_shards_is_read_with_a_listing_not_calls_or_objects_a_shard(many, monkeypatch):
    """5e5 shards a folder (10^9 utterances): a rank's start must not make a system call or a
    Python object a shard (it did: realpath and a stat a file, a ShardEntry and a ShardInfo a
    shard)."""
    from seqshard.formats import index, table

    assert (many / "index.npz").is_file()
    calls = {"stat": 0, "entries": 0, "infos": 0}

    def counted(name, real, of_shards=False):
        def call(*args, **kwargs):
            calls[name] += not of_shards or str(args[0]).startswith(str(many))  # a shard's, not a module's
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(os, "stat", counted("stat", os.stat, of_shards=True))
    monkeypatch.setattr(os, "lstat", counted("stat", os.lstat, of_shards=True))
    monkeypatch.setattr(index.ShardEntry, "__init__", counted("entries", index.ShardEntry.__init__))
    monkeypatch.setattr(table.ShardInfo, "__init__", counted("infos", table.ShardInfo.__init__))
    loader = make_loader(str(many), batch_size=4, num_workers=0, rank=7, world_size=8)
    loader.planned_batches()
    assert calls["stat"] < 50 and calls["entries"] == 0 and calls["infos"] == 0, calls
    assert len(loader.table.shards) == MANY and loader.table.num_utts == PER_SHARD * MANY


def test_the_table_beside_index_json_gives_what_index_json_gives(many, tmp_path):
    """The same shards, facts, lengths, plans and counts from index.npz as from index.json
    (read in bulk), and as index.json read entry by entry."""
    from seqshard.formats.index import ShardIndex
    from seqshard.formats.index_entries import ShardEntry
    from seqshard.formats.table import ShardTable

    def described(pattern):
        table = ShardTable.from_patterns(pattern)
        loader = make_loader(pattern, num_workers=2, rank=2, world_size=3, max_frames=40)
        return (
            [tuple(vars(shard).items()) for shard in table.shards],
            table.fingerprint(),
            table.length_hist,
            table.lengths.counts.tolist(),
            str(loader.planned_batches()),
            loader.planned_utts(),
        )

    from_table = described(str(many))
    data = json.loads((many / "index.json").read_text())
    assert ShardIndex.load(many).shards == [ShardEntry.from_json(entry) for entry in data["shards"]]  # one by one
    moved = tmp_path / "index.npz"
    shutil.move(many / "index.npz", moved)
    try:
        assert described(str(many)) == from_table
    finally:
        shutil.move(moved, many / "index.npz")


def test_a_table_that_does_not_go_with_its_index_json_is_not_read(many, tmp_path):
    """index.json edited after the table was written (by hand, by another tool): the table is
    stale and index.json is read; a table whose values break the index's rules is not read."""
    from seqshard.formats.index import ShardIndex
    from seqshard.formats.index_table import ShardColumns, write_table

    folder = tmp_path / "edited"
    shutil.copytree(many, folder, copy_function=os.link)
    data = json.loads((folder / "index.json").read_text())
    data["shards"][5]["checksum"] = "crc32:0badc0de"
    (folder / "index.json").write_text(json.dumps(data))
    assert (folder / "index.npz").is_file()
    assert ShardIndex.load(folder).entry("data-00005.tar").checksum == "crc32:0badc0de"

    index = ShardIndex.load(folder)
    columns = ShardColumns.of(index.shards)
    columns.numbers["num_utts"][3] = 10**6  # more utterances than the shard's bytes hold
    digest = hashlib.sha256((folder / "index.json").read_bytes()).hexdigest()
    with open(folder / "index.npz", "wb") as stream:
        write_table(stream, columns, {k: v for k, v in index.to_json().items() if k != "shards"}, digest)
    assert ShardIndex.load(folder).entry("data-00003.tar").num_utts == PER_SHARD  # index.json's
    index.shards = index.shards[:3]  # an index of few shards: no table, and the stale one goes
    index.save(folder)
    assert not (folder / "index.npz").exists() and ShardIndex.load(folder).num_utts == 3 * PER_SHARD


def test_a_pattern_naming_a_fifo_or_a_device_says_what_it_is(tmp_path):
    """It said the FIFO 'does not exist' (it is there, and no shard)."""
    os.mkfifo(tmp_path / "data-00000.tar")
    with pytest.raises(
        ShardError, match=r"data-00000\.tar \(named in the pattern, but it is a FIFO \(named pipe\), not a shard"
    ):
        make_loader(str(tmp_path / "data-00000.tar"), batch_size=4, num_workers=0)
    with pytest.raises(
        ShardError, match=r"zero \(named in the pattern, but it is a character device, not a shard file\)"
    ):
        make_loader("/dev/zero", batch_size=4, num_workers=0)
