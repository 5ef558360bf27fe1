"""The shard container: what other tools read, what we read of theirs, and resume offsets."""

import io
import subprocess
import tarfile

import numpy as np
import pytest

from conftest import REALDATA
from seqshard.errors import ShardError
from seqshard.formats.npy import decode_npy, npy_parts
from seqshard.formats.streams import skip_samples
from seqshard.formats.tar import SampleStream, ShardWriter, temporary_path


def write_shard(path, count=12, seed=0, dim=5):
    rng = np.random.default_rng(seed)
    arrays = {}
    writer = ShardWriter(path)
    for i in range(count):
        key = f"utt{i:03d}" + ("x" * 120 if i == 3 else "")  # one name needs a pax header
        array = rng.standard_normal((int(rng.integers(1, 30)), dim)).astype(np.float32)
        arrays[key] = array
        writer.add(key, [("feats.npy", list(npy_parts(array))), ("txt", [f"label {i} é".encode()])])
    writer.commit()
    return arrays, writer


def test_shard_is_invisible_until_committed_and_repacks_byte_identically(tmp_path):
    path = tmp_path / "data-00000.tar"
    writer = ShardWriter(path)
    writer.add("a", [("txt", [b"x"])])
    assert not path.exists() and temporary_path(path).exists()
    writer.abort()
    assert not temporary_path(path).exists()
    write_shard(tmp_path / "one.tar")
    write_shard(tmp_path / "two.tar")
    assert (tmp_path / "one.tar").read_bytes() == (tmp_path / "two.tar").read_bytes()
    assert (tmp_path / "one.tar").stat().st_size % 10240 == 0


def test_gnu_tar_python_tarfile_and_webdataset_read_our_shards(tmp_path):
    import webdataset as wds

    path = tmp_path / "data-00000.tar"
    arrays, writer = write_shard(path)
    listing = subprocess.run(["tar", "tf", str(path)], check=True, capture_output=True, text=True).stdout.split()
    assert listing == [f"{key}.{field}" for key in arrays for field in ("feats.npy", "txt")]
    with tarfile.open(path) as archive:
        member = archive.extractfile("utt000.feats.npy")
        np.testing.assert_array_equal(np.load(io.BytesIO(member.read()), allow_pickle=False), arrays["utt000"])
    samples = list(wds.WebDataset(str(path), shardshuffle=False).decode())
    assert [s["__key__"] for s in samples] == list(arrays)
    for sample in samples:
        np.testing.assert_array_equal(sample["feats.npy"], arrays[sample["__key__"]])
    import zlib

    assert zlib.crc32(path.read_bytes()) == writer.crc32 and path.stat().st_size == writer.size


def test_every_sample_position_can_be_resumed(tmp_path):
    path = tmp_path / "s.tar"
    arrays, _ = write_shard(path)
    with SampleStream(path) as stream:
        checkpoints = []
        while True:
            checkpoints.append((stream.resume_offset, stream.ordinal))
            if stream.next_sample() is None:
                break
        assert stream.ended_cleanly
    keys = list(arrays)
    for position, (offset, ordinal) in enumerate(checkpoints):
        with SampleStream(path, offset, ordinal) as stream:
            rest = list(stream)
        assert [s.key for s in rest] == keys[position:]
        assert [s.ordinal for s in rest] == list(range(position, len(keys)))
        for sample in rest:
            np.testing.assert_array_equal(decode_npy(sample.fields["feats.npy"]), arrays[sample.key])
        assert skip_samples(path, position) == (offset, ordinal)


def test_foreign_shards_wenet_slash_keys_directories_and_gzip():
    wenet = list(SampleStream(REALDATA / "webdataset/wenet-shard/shards_000000000.tar"))
    assert [s.key for s in wenet] == [
        "test/resources/dataset/aishell-BAC009S0724W0121",
        "test/resources/dataset/librispeech-1995-1837-0001",
    ]
    assert set(wenet[0].fields) == {"txt", "wav"} and str(wenet[0].fields["txt"], "utf-8") == "广州市房地产中介协会分析"
    compressed = list(SampleStream(REALDATA / "webdataset/webdataset-testdata/compressed.tar"))
    assert [s.key for s in compressed] == ["compressed/0001", "compressed/0002", "compressed/0003"]
    gz = list(SampleStream(REALDATA / "webdataset/webdataset-testdata/sample.tgz"))
    assert len(gz) == 90 and set(gz[0].fields) == {"cls", "png"}


def test_damage_is_reported_with_the_shard_and_offset(tmp_path):
    path = tmp_path / "s.tar"
    write_shard(path)
    with SampleStream(path) as stream:
        stream.next_sample()
        first_header_of_second_sample = stream.resume_offset
    broken = bytearray(path.read_bytes())
    broken[first_header_of_second_sample + 5] ^= 0x01
    (tmp_path / "bad.tar").write_bytes(broken)
    with pytest.raises(ShardError, match=f"bad.tar at byte {first_header_of_second_sample}: tar header checksum"):
        list(SampleStream(tmp_path / "bad.tar"))
    (tmp_path / "cut.tar").write_bytes(path.read_bytes()[: first_header_of_second_sample + 700])
    with pytest.raises(ShardError, match="truncated"):
        list(SampleStream(tmp_path / "cut.tar"))
    (tmp_path / "short.tar").write_bytes(path.read_bytes()[:first_header_of_second_sample])
    with SampleStream(tmp_path / "short.tar") as stream:
        assert len(list(stream)) == 1 and not stream.ended_cleanly


def test_npy_members_never_unpickle():
    sample = next(iter(SampleStream(REALDATA / "webdataset/speechbrain-lang-shards/shard-000000.tar")))
    assert "audio.pth" in sample.fields  # torch pickles are left as bytes, never loaded
    buffer = io.BytesIO()
    np.save(buffer, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="never unpickles"):
        decode_npy(buffer.getvalue())
