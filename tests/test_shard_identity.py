"""A shard or sidecar replaced by a copy of another (same size, same count) is caught: the
index records each file's first and last key, and readers check them when they read a
file's first sample and when it ends."""

import json
import logging
import shutil

import pytest
from http_server import ShardServer

from conftest import pack_small
from seqshard import add_field, make_loader
from seqshard.errors import ShardError
from seqshard.formats.index import ShardIndex
from seqshard.formats.members import TABLE_DIR
from seqshard.formats.table import ShardTable
from seqshard.formats.tar import ShardWriter
from seqshard.pipeline.epoch_plan import Unit
from seqshard.pipeline.stages.reader import ShardReader
from seqshard.tools.reindex import rebuild_index

OPTIONS = dict(batch_size=4, num_workers=0, shuffle_window=8, sort_window=4, interleave=2)


@pytest.fixture
def same_size(tmp_path):
    """5 shards of 10 utterances of 20 frames (the last holds 8): shards 0-3 are the same size."""
    packed = pack_small(tmp_path, utts_per_file=10, frames=(20, 21))
    (tmp_path / "spk").write_text("".join(f"{k} {k[:6]}\n" for k in packed.data.keys))
    add_field(packed.out, "spk", tmp_path / "spk", progress=False)
    sizes = {(packed.out / f"data-0000{i}.tar").stat().st_size for i in range(4)}
    assert len(sizes) == 1
    return packed


def keys_read(loader):
    return [k for batch in loader for k in batch["keys"]]


def test_the_index_records_each_file_s_first_and_last_key(same_size):
    entry = ShardIndex.load(same_size.out).shards[1]
    keys = [line.split()[0] for line in (same_size.out.parent / "kaldi" / "text").read_text().splitlines()]
    assert entry.first_key in keys and entry.last_key in keys and entry.first_key != entry.last_key
    assert (entry.sidecars["spk"].first_key, entry.sidecars["spk"].last_key) == (entry.first_key, entry.last_key)


@pytest.mark.parametrize("fields", [None, ["feats", "txt", "spk"]])
def test_a_shard_copied_over_another_is_an_error_naming_it(same_size, fields):
    out = same_size.out
    shutil.copy(out / "data-00000.tar", out / "data-00001.tar")
    replaced = r"data-00001\.tar at byte 0: its first sample is '.*' where its index\.json says"
    with pytest.raises(ShardError, match=replaced):
        keys_read(make_loader(same_size.pattern, fields=fields, **OPTIONS))


def test_a_sidecar_copied_over_another_is_an_error_naming_it(same_size):
    out = same_size.out
    sidecars = [entry.sidecars["spk"].name for entry in ShardIndex.load(out).shards]
    shutil.copy(out / sidecars[2], out / sidecars[3])
    with pytest.raises(ShardError, match=rf"{sidecars[3]} at byte 0: its first sample .*replaced"):
        keys_read(make_loader(same_size.pattern, fields=["spk"], **OPTIONS))


def test_with_skip_bad_a_replaced_shard_is_a_counted_damaged_shard_named_in_the_warning(same_size, caplog):
    out = same_size.out
    shutil.copy(out / "data-00000.tar", out / "data-00001.tar")
    loader = make_loader(same_size.pattern, skip_bad=True, max_bad_shards=1, **OPTIONS)
    with caplog.at_level(logging.WARNING, logger="seqshard"):
        keys = keys_read(loader)
    assert len(keys) == len(set(keys)) == 38  # shard 1's own keys are not read; shard 0's once
    assert loader.stats()["damaged_shards"] == 1 and loader.stats()["dropped"] == {"damaged": 10}
    assert "data-00001.tar at byte 0: its first sample" in caplog.text


def test_a_reader_that_starts_inside_a_replaced_shard_checks_its_last_key(same_size):
    out = same_size.out
    shutil.copy(out / "data-00002.tar", out / "data-00001.tar")
    table = ShardTable.from_patterns(same_size.pattern)
    number = next(i for i, s in enumerate(table.shards) if s.path.endswith("data-00001.tar"))
    reader = ShardReader(table, [Unit(number, start=3)])  # the second part of a split shard
    with pytest.raises(ShardError, match=r"data-00001\.tar: its last sample is '.*' where its index\.json says"):
        list(reader)


def test_an_index_without_keys_still_loads_unchecked(same_size):
    out = same_size.out
    index = json.loads((out / "index.json").read_text())
    for entry in index["shards"]:
        del entry["first_key"], entry["last_key"]
    (out / "index.json").write_text(json.dumps(index))
    assert ShardIndex.load(out).shards[0].first_key is None
    shutil.copy(out / "data-00000.tar", out / "data-00001.tar")
    loader = make_loader(same_size.pattern, **OPTIONS)  # the member table written at pack time tells
    assert len(keys_read(loader)) == 48  # what the headers hold: the copy, read by its headers
    assert (loader.stats()["damaged_tables"], loader.stats()["duplicate_keys"]) == (1, 10)  # counted, warned
    shutil.rmtree(out / TABLE_DIR)  # as a folder packed before member tables
    loader = make_loader(same_size.pattern, **OPTIONS)
    assert len(keys_read(loader)) == 48 and loader.stats()["damaged_tables"] == 0  # what an older index allows


def test_foreign_shards_indexed_by_seqshard_index_are_checked_too(tmp_path):
    folder = tmp_path / "foreign"
    for number, keys in enumerate([("a", "b", "c"), ("d", "e", "f")]):
        writer = ShardWriter(folder / f"shard-{number}.tar")
        for key in keys:
            writer.add(key, [("txt", [b"some text"])])
        writer.commit()
    rebuild_index(folder, progress=False)
    assert [(s.first_key, s.last_key) for s in ShardIndex.load(folder).shards] == [("a", "c"), ("d", "f")]
    shutil.copy(folder / "shard-0.tar", folder / "shard-1.tar")
    replaced = r"shard-1\.tar at byte 0: its first sample is 'a' where its index\.json says 'd'"
    with pytest.raises(ShardError, match=replaced):
        keys_read(make_loader(folder, **OPTIONS))


def test_over_http_without_a_cache_a_replaced_copy_on_the_server_is_caught(same_size):
    out = same_size.out
    shutil.copy(out / "data-00002.tar", out / "data-00003.tar")  # same size: the server's size check passes
    with ShardServer(out.parent) as server, pytest.raises(ShardError, match=r"/shards/data-00003\.tar.*first sample"):
        keys_read(make_loader(f"{server.url}/shards/", **OPTIONS))
