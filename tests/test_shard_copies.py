"""Copies of a shard in one selection are an error naming both; one file named twice is read
once; keys read twice by one reader in an epoch are counted and warned about, and passes of
uneven="repeat" and of mixes are not taken for repeats."""

import logging
import os
import shutil

import pytest

from conftest import pack_small
from seqshard import make_loader, mux
from seqshard.errors import ConfigError
from seqshard.formats.tar import ShardWriter
from seqshard.pipeline.stages.reader import KeyRepeats

OPTIONS = dict(batch_size=4, num_workers=0, shuffle_window=8, sort_window=4, interleave=2)


def keys_read(loader):
    return [k for batch in loader for k in batch["keys"]]


def text_shard(path, keys, text):
    writer = ShardWriter(path)
    for key in keys:
        writer.add(key, [("txt", [text])])
    writer.commit()


@pytest.mark.parametrize("indexed", [True, False])
def test_a_folder_copied_beside_its_original_is_an_error_naming_both_copies(tmp_path, indexed):
    packed = pack_small(tmp_path, utts_per_file=10)
    shutil.copytree(packed.out, tmp_path / "copy")
    if not indexed:
        for folder in (packed.out, tmp_path / "copy"):
            (folder / "index.json").unlink()
            shutil.rmtree(folder / ".seqshard-pack")
    both = f"{tmp_path}/{{shards,copy}}/data-*.tar"
    check = "CRC-32" if indexed else "first sample"
    copies = rf"shards/data-00000\.tar and .*copy/data-00000\.tar are copies of one shard \(the same size and {check}\)"
    with pytest.raises(ConfigError, match=rf"{copies}.*Fix: select one of them"):
        make_loader(both, **OPTIONS)


def test_one_folder_named_twice_under_two_paths_is_read_once(tmp_path, caplog):
    packed = pack_small(tmp_path, utts_per_file=10)
    os.symlink(packed.out, tmp_path / "link")
    patterns = [packed.pattern, f"{tmp_path}/link/data-*.tar", f"{packed.out}/../shards/data-00001.tar"]
    with caplog.at_level(logging.WARNING, logger="seqshard"):
        keys = keys_read(make_loader(patterns, **OPTIONS))
    assert sorted(keys) == sorted(packed.data.keys)
    assert "read twice" not in caplog.text


def test_shards_of_the_same_keys_and_size_with_other_content_are_read_and_their_keys_counted(tmp_path, caplog):
    clean, noisy = tmp_path / "clean", tmp_path / "noisy"  # e.g. a noise-augmented copy of a set
    text_shard(clean / "data-0.tar", ["a", "b", "c"], b"clean")
    text_shard(noisy / "data-0.tar", ["a", "b", "c"], b"noisy")
    assert (clean / "data-0.tar").stat().st_size == (noisy / "data-0.tar").stat().st_size
    loader = make_loader(f"{tmp_path}/{{clean,noisy}}/data-0.tar", **OPTIONS)
    with caplog.at_level(logging.WARNING, logger="seqshard"):
        keys = keys_read(loader)
    assert sorted(keys) == ["a", "a", "b", "b", "c", "c"]
    assert loader.stats()["duplicate_keys"] == 3
    assert caplog.text.count("was read twice by one reader in one epoch") == 1
    assert "duplicate_keys" in caplog.text


def test_passes_of_repeat_and_of_a_mix_are_not_repeats(tmp_path, caplog):
    small = pack_small(tmp_path / "a", utts_per_file=16, speakers=3, per_speaker=16)  # 3 shards of 16
    other = pack_small(tmp_path / "b", utts_per_file=16, speakers=3, per_speaker=16, prefix="b")
    with caplog.at_level(logging.WARNING, logger="seqshard"):
        for patterns, options in [
            (small.pattern, dict(uneven="repeat")),
            (mux([small.pattern, other.pattern], weights=[3, 1]), {}),
        ]:
            loader = make_loader(patterns, epoch_steps=40, **{**OPTIONS, **options})
            keys = keys_read(loader)
            assert len(keys) == 160 and max(keys.count(k) for k in small.data.keys) >= 2  # several passes
            assert loader.stats()["duplicate_keys"] == 0
    assert "read twice" not in caplog.text


def test_repeats_are_found_within_and_across_merges_of_the_latest_keys(monkeypatch):
    monkeypatch.setattr(KeyRepeats, "MERGE_EVERY", 7)
    repeats = KeyRepeats()
    keys = [f"k{i}" for i in range(200)]
    order = keys + keys[150:] + keys[:3] + ["k5", "k5"]  # 56 repeats, some of them in one merge
    found = [r for key in order for r in repeats.add(key, "shard.tar")] + repeats.merge()
    assert sorted(key for key, _ in found) == sorted(keys[150:] + keys[:3] + ["k5", "k5"])
