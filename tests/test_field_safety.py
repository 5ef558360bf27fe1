"""Fields a shard declares are decoded safely: compressed members within limits, undecoded
members named by their whole suffix, sizes checked before anything is allocated."""

from __future__ import annotations

import gzip
import json
import logging
import tarfile

import numpy as np
import pytest

from seqshard import make_loader
from seqshard.errors import InputError, ShardError
from seqshard.formats.fields import MAX_INFLATION, decode_field, inflate
from seqshard.formats.npy import npy_parts
from seqshard.formats.tar import ShardWriter, TarStream

ZEROS = gzip.compress(bytes(64 << 20), compresslevel=9)  # 64 MB of zeros in about 64 KB


def write_shard(path, samples):
    writer = ShardWriter(path)
    for key, fields in samples:
        writer.add(key, fields)
    writer.commit()


def feats(frames: int) -> list:
    return list(npy_parts(np.ones((frames, 4), dtype=np.float32)))


@pytest.fixture
def bomb_shards(tmp_path):
    """Three utterances; the second carries a small member that inflates to 64 MB, once as
    a field without a decoder (blob.gz) and once as JSON (meta.json.gz)."""
    for name, suffix in (("blob", "blob.gz"), ("json", "meta.json.gz")):
        samples = []
        for number in range(3):
            extra = ZEROS if number == 1 else gzip.compress(b'{"speaker": 3}')
            samples.append((f"utt{number}", [("feats.npy", feats(5 + number)), ("txt", [b"a b"]), (suffix, [extra])]))
        write_shard(tmp_path / name / "data-00000.tar", samples)
    return tmp_path


@pytest.mark.parametrize("workers", [0, 2])
def test_a_member_without_a_decoder_is_never_inflated(bomb_shards, workers):
    batches = list(make_loader(str(bomb_shards / "blob"), batch_size=3, shuffle=False, num_workers=workers))
    by_key = {key: blob for batch in batches for key, blob in zip(batch["keys"], batch["blob.gz"])}
    assert sorted(by_key) == ["utt0", "utt1", "utt2"]
    assert by_key["utt1"] == ZEROS  # handed over as stored: 64 KB, never 64 MB


@pytest.mark.parametrize("workers", [0, 2])
def test_a_member_that_would_inflate_beyond_the_limits_is_a_bad_sample(bomb_shards, workers, caplog):
    with pytest.raises(InputError, match=r"utt1.*meta\.json\.gz is not decoded: .* inflates beyond") as caught:
        list(make_loader(str(bomb_shards / "json"), batch_size=3, shuffle=False, num_workers=workers))
    assert "200x its size" in str(caught.value) and "at most 1073741824 bytes" in str(caught.value)
    caplog.set_level(logging.WARNING, logger="seqshard")
    loader = make_loader(str(bomb_shards / "json"), batch_size=3, shuffle=False, num_workers=workers, skip_bad=True)
    batches = list(loader)
    assert sorted(k for b in batches for k in b["keys"]) == ["utt0", "utt2"]
    assert loader.stats()["dropped"] == {"decompression_limit": 1}
    assert [m["speaker"] for b in batches for m in b["meta"]] == [3, 3]  # the others decode as before


def test_fields_leaves_an_unwanted_compressed_member_unread(bomb_shards):
    loader = make_loader(str(bomb_shards / "json"), batch_size=3, shuffle=False, num_workers=0, fields=["feats", "txt"])
    (batch,) = list(loader)
    assert sorted(batch) == ["feat_lens", "feats", "keys", "texts"]


def test_inflation_is_bounded_before_the_output_is_held():
    assert inflate(gzip.compress(b"x" * 1000)) == b"x" * 1000
    assert inflate(gzip.compress(b"ab") + gzip.compress(b"cd")) == b"abcd"  # members back to back
    with pytest.raises(ValueError, match=rf"inflates beyond {MAX_INFLATION * len(ZEROS)} bytes"):
        inflate(ZEROS)
    with pytest.raises(ValueError, match="not valid gzip"):
        decode_field("txt.gz", b"\x1f\x8b not gzip")


def test_deeply_nested_json_is_a_bad_field_not_a_crash():
    with pytest.raises(ValueError, match="nested too deeply"):
        decode_field("meta.json", b"[" * 100_000 + b"]" * 100_000)
    assert decode_field("meta.json", json.dumps([[1]]).encode()) == [[1]]


def test_foreign_fields_keep_their_whole_suffix_and_fields_takes_what_inspect_lists(tmp_path):
    write_shard(
        tmp_path / "sb" / "shard-000000.tar",
        [(f"u{n}", [("audio.pth", [b"pickled tensor bytes"]), ("language_id", [b"en"])]) for n in range(2)],
    )
    (batch,) = list(make_loader(str(tmp_path / "sb"), batch_size=2, shuffle=False, num_workers=0))
    assert batch["audio.pth"] == [b"pickled tensor bytes"] * 2 and "audio" not in batch
    (batch,) = list(make_loader(str(tmp_path / "sb"), batch_size=2, num_workers=0, fields=["audio.pth"]))
    assert sorted(batch) == ["audio.pth", "keys"]
    write_shard(
        tmp_path / "fe" / "data-00000.tar", [(f"u{n}", [("feats.npy", feats(4)), ("txt", [b"a"])]) for n in range(2)]
    )
    (batch,) = list(make_loader(str(tmp_path / "fe"), batch_size=2, num_workers=0, fields=["feats.npy", "txt"]))
    assert batch["feats"].shape == (2, 4, 4) and batch["texts"] == ["a", "a"]


def _tar_with_declared_size(path, declared: int, compressed: bool = False) -> None:
    """A tar whose one member's header declares ``declared`` bytes but holds 10."""
    info = tarfile.TarInfo("u0.txt")
    info.size = declared
    header = info.tobuf(tarfile.GNU_FORMAT)  # base-256 sizes beyond 8 GB
    data = header + b"0123456789" + bytes(1024)
    path.write_bytes(gzip.compress(data) if compressed else data)


@pytest.mark.parametrize("compressed", [False, True])
def test_a_declared_member_size_is_checked_before_it_is_read(tmp_path, compressed):
    name = "bad.tar.gz" if compressed else "bad.tar"
    _tar_with_declared_size(tmp_path / name, 10**12, compressed)
    expected = r"beyond 1073741824" if compressed else r"declares a member of 1000000000000 bytes but the file has"
    with pytest.raises(ShardError, match=expected), TarStream(tmp_path / name) as stream:
        stream.next_member()


def test_inspect_lists_the_names_fields_takes(tmp_path, capsys):
    from seqshard.cli import main

    write_shard(tmp_path / "sb" / "shard-000000.tar", [("u0", [("audio.pth", [b"x"]), ("feats.npy", feats(3))])])
    assert main(["inspect", str(tmp_path / "sb")]) == 0
    assert "(shard): audio.pth, feats (.feats.npy)" in capsys.readouterr().out
