"""The cache removes only files it wrote: it lives in a folder of its own inside ``cache_dir``,
leaves other files alone (and out of its limit), counts fetches under way in the limit, and
removes the partial files of fetches that died."""

import fcntl
import os
import subprocess

import pytest
from http_server import ShardServer

from conftest import write_kaldi_dir
from seqshard import make_loader, pack_data
from seqshard.errors import ConfigError
from seqshard.formats.remote.cache import FOLDER, TAG, ShardCache

OPTIONS = dict(batch_size=4, shuffle_window=16, sort_window=8, seed=1, num_workers=0)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """8 shards of 6 utterances (48 in all), indexed."""
    root = tmp_path_factory.mktemp("cache-files")
    data = write_kaldi_dir(root / "kaldi", speakers=6, per_speaker=8)
    pack_data(data.scp, data.text, root / "shards", utts_per_file=6, progress=False)
    return root / "shards"


def keys_of(loader):
    loader.set_epoch(0)
    return [key for batch in loader for key in batch["keys"]]


def shard_size(packed):
    return max(p.stat().st_size for p in packed.glob("data-*.tar"))


def cached_shards(cache_dir):
    return [p for p in (cache_dir / FOLDER).iterdir() if p.is_file() and p.name != TAG and ".part-" not in p.name]


def test_other_files_in_cache_dir_are_never_removed(packed, tmp_path):
    """A user's notes and another tool's cache, older than any shard, beside a tight limit."""
    cache_dir = tmp_path / "cache"
    theirs = {
        cache_dir / "notes.txt": b"my notes\n",
        cache_dir / "0123456789abcdef-data-00000.tar": b"a file named like a cached shard",
        cache_dir / "other-tool" / "blob.bin": os.urandom(5000),
    }
    for path, data in theirs.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.utime(path, (1, 1))  # least recently used of all
    size = shard_size(packed)
    with ShardServer(packed.parent) as server:
        loader = make_loader(f"{server.url}/shards/", cache_dir=str(cache_dir), cache_limit=2 * size + 10, **OPTIONS)
        assert len(keys_of(loader)) == 48 and loader.stats()["damaged_shards"] == 0
    assert {path: path.read_bytes() for path in theirs} == theirs
    assert (cache_dir / FOLDER / TAG).read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55")
    kept = cached_shards(cache_dir)
    assert 1 <= len(kept) <= 2 and sum(p.stat().st_size for p in kept) <= 2 * size + 10


def test_a_cache_folder_that_seqshard_did_not_make_is_refused(tmp_path):
    (tmp_path / FOLDER).mkdir()
    (tmp_path / FOLDER / "thesis.tex").write_text("\\begin{document}")
    with pytest.raises(ConfigError, match=rf"{FOLDER} holds files that seqshard's cache did not write"):
        ShardCache(tmp_path, "1GB")
    assert (tmp_path / FOLDER / "thesis.tex").is_file()


def dead_pid():
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_partial_files_count_while_fetched_and_go_when_their_fetch_died(packed, tmp_path):
    """``HASH-NAME.part-PID`` of a killed fetch is removed (with a limit or without); one whose
    fetch still holds its lock (here: this process, as another reader would) counts in the limit."""
    size = shard_size(packed)
    caches = {"limited": ShardCache(tmp_path / "limited"), "unlimited": ShardCache(tmp_path / "unlimited")}
    stale = {name: cache.root / f"{'1' * 16}-data-00042.tar.part-{dead_pid()}" for name, cache in caches.items()}
    for path in stale.values():
        path.write_bytes(b"\0" * size)
    live = caches["limited"].root / f"{'2' * 16}-data-00043.tar.part-{os.getpid()}"
    live.write_bytes(b"\0" * 2 * size)
    with open(caches["limited"].root / ".locks" / live.name.split(".part-")[0], "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with ShardServer(packed.parent) as server:
            url = f"{server.url}/shards/"
            limited = make_loader(url, cache_dir=str(tmp_path / "limited"), cache_limit=3 * size + 10, **OPTIONS)
            unlimited = make_loader(url, cache_dir=str(tmp_path / "unlimited"), **OPTIONS)
            assert len(keys_of(limited)) == len(keys_of(unlimited)) == 48
    assert not stale["limited"].exists() and not stale["unlimited"].exists() and live.exists()
    assert len(cached_shards(tmp_path / "limited")) == 1  # with 2 shards' worth being fetched, 1 more fits in 3
    assert len(cached_shards(tmp_path / "unlimited")) == 8


class _Source:
    """A byte source over bytes, as ``open_source()`` gives over a remote object."""

    def __init__(self, data):
        self.data, self.at = data, 0

    def read(self, n):
        chunk = self.data[self.at : self.at + n]
        self.at += len(chunk)
        return chunk

    def close(self):
        pass


def test_threads_opening_a_damaged_copy_at_once_all_get_the_fetched_one(tmp_path):
    """A reader and the prefetch thread both find a damaged copy: the one that removes it to
    fetch again must not pull the name from under the other's check (FileNotFoundError)."""
    import threading
    import zlib

    good = os.urandom(256 << 10)
    expected = (len(good), f"crc32:{zlib.crc32(good):08x}")
    cache = ShardCache(tmp_path)
    url = "http://host/shards/data-00000.tar"
    for _ in range(30):
        bad = bytearray(good)
        bad[1000] ^= 0xFF
        cache.path_for(url).write_bytes(bytes(bad))
        barrier, errors, crcs = threading.Barrier(4), [], []

        def read(barrier=barrier, errors=errors, crcs=crcs):
            barrier.wait()
            try:
                with cache.open(url, expected, lambda: _Source(good), 1 << 16) as file:
                    crcs.append(zlib.crc32(file.read()))
            except Exception as error:  # collected for the assertion
                errors.append(error)

        threads = [threading.Thread(target=read) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == [] and crcs == [zlib.crc32(good)] * 4


@pytest.mark.parametrize("link", [FOLDER, f"{FOLDER}/.locks"])
def test_the_cache_never_writes_through_a_link(tmp_path, link):
    """A link planted in cache_dir (its folder, its locks) leads nothing out of it."""
    from seqshard.errors import OutputError

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cache_dir = tmp_path / "cache"
    (cache_dir / link).parent.mkdir(parents=True, exist_ok=True)
    (cache_dir / link).symlink_to(elsewhere)
    with pytest.raises(OutputError, match="symbolic link"):
        ShardCache(cache_dir)
    assert list(elsewhere.iterdir()) == []


def test_a_fifo_at_a_cached_shards_marker_is_passed_over(tmp_path):
    """The marker that spares a cached shard its CRC check was read with read_text: a FIFO
    there held the reader forever. Now the shard is checked as if it had no marker."""
    import zlib

    good = os.urandom(64 << 10)
    expected = (len(good), f"crc32:{zlib.crc32(good):08x}")
    cache = ShardCache(tmp_path)
    url = "http://host/shards/data-00000.tar"
    with cache.open(url, expected, lambda: _Source(good), 1 << 16) as file:
        assert file.read() == good
    marker = cache.path_for(url).parent / ".locks" / f"{cache.path_for(url).name}.ok"
    marker.unlink()
    os.mkfifo(marker)
    with cache.open(url, expected, lambda: _Source(b"not fetched again"), 1 << 16) as file:
        assert file.read() == good
