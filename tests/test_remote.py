"""Shards over HTTP (a stdlib server on loopback started by the tests) and S3 (moto's server):
the same batches as from local disk, faults retried or skipped and counted, the failure budget,
and the local cache (served from disk the second time, limited, repaired, shared by processes)."""

import itertools
import multiprocessing as mp
import shutil
import zlib

import numpy as np
import pytest
from http_server import ShardServer

from conftest import write_kaldi_dir
from seqshard import make_loader, pack_data
from seqshard.errors import ConfigError, ShardError
from seqshard.formats.remote import access as remote
from seqshard.formats.remote.cache import TAG

OPTIONS = dict(batch_size=4, shuffle_window=16, sort_window=8, seed=1)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """8 shards of 6 utterances (48 in all), indexed."""
    root = tmp_path_factory.mktemp("remote")
    data = write_kaldi_dir(root / "kaldi", speakers=6, per_speaker=8)
    pack_data(data.scp, data.text, root / "shards", utts_per_file=6, progress=False)
    return root / "shards"


def keys_of(loader, epoch=0):
    loader.set_epoch(epoch)
    return [key for batch in loader for key in batch["keys"]]


def shard_names(folder):
    return sorted(p.name for p in folder.glob("data-*.tar"))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_http_gives_what_local_disk_gives(packed, num_workers):
    local = keys_of(make_loader(str(packed), num_workers=num_workers, **OPTIONS))
    with ShardServer(packed.parent) as server:
        by_folder = make_loader(f"{server.url}/shards/", num_workers=num_workers, **OPTIONS)
        assert keys_of(by_folder) == local and len(local) == 48
        names = shard_names(packed)
        braces = f"{server.url}/shards/data-{{00000..{len(names) - 1:05d}}}.tar"
        assert keys_of(make_loader(braces, num_workers=num_workers, **OPTIONS)) == local
        assert all(rng is not None for method, _, rng in server.requests if method == "GET" and ".tar" in _)


def test_a_list_file_mixes_urls_and_local_paths(packed, tmp_path):
    names = shard_names(packed)
    local = keys_of(make_loader(str(packed), num_workers=0, **OPTIONS))
    with ShardServer(packed.parent) as server:
        listing = tmp_path / "data.list"
        lines = [f"{server.url}/shards/{n}" if i % 2 else str(packed / n) for i, n in enumerate(names)]
        listing.write_text("\n".join(lines) + "\n")
        assert sorted(keys_of(make_loader(str(listing), num_workers=0, **OPTIONS))) == sorted(local)


def test_a_pattern_that_selects_nothing_remotely_is_an_error(packed):
    with ShardServer(packed.parent) as server:
        with pytest.raises(ConfigError, match="selects no shard"):
            make_loader(f"{server.url}/nothing-here/", num_workers=0, **OPTIONS)
        with pytest.raises(ConfigError, match="cannot be listed"):
            make_loader(f"{server.url}/shards/data-*.tar", num_workers=0, **OPTIONS)


def test_transient_faults_are_retried(packed):
    local = keys_of(make_loader(str(packed), num_workers=0, **OPTIONS))
    names = shard_names(packed)
    with ShardServer(packed.parent) as server:
        server.faults[names[0]] = ["500", "500"]
        server.faults[names[1]] = ["truncate"]
        server.faults[names[2]] = ["slow:1.5"]
        loader = make_loader(f"{server.url}/shards/", num_workers=0, remote_timeout=0.5, **OPTIONS)
        assert keys_of(loader) == local
        assert loader.stats()["damaged_shards"] == 0
        assert server.gets(names[0]) == 3 and server.gets(names[1]) == 2 and server.gets(names[2]) == 2


def test_a_shard_that_keeps_failing_is_named_or_skipped_and_counted(packed):
    names = shard_names(packed)
    with ShardServer(packed.parent) as server:
        server.faults[names[3]] = ["500"] * 10
        url = f"{server.url}/shards/"
        with pytest.raises(ShardError, match=rf"{names[3]}.*failed after 2 attempt"):
            keys_of(make_loader(url, num_workers=0, remote_retries=1, **OPTIONS))
        server.faults[names[3]] = ["500"] * 10
        server.missing.add(names[5])
        loader = make_loader(url, num_workers=2, remote_retries=1, skip_bad=True, max_bad_shards=2, **OPTIONS)
        seen = keys_of(loader)
        stats = loader.stats()
        assert stats["damaged_shards"] == 2
        assert len(seen) == 48 - 12 == len(set(seen))
        assert len(seen) + stats["dropped"]["damaged"] == 48


def test_the_failure_budget_stops_the_run(packed):
    names = shard_names(packed)
    with ShardServer(packed.parent) as server:
        for name in names[:2]:
            server.missing.add(name)
        loader = make_loader(f"{server.url}/shards/", num_workers=0, skip_bad=True, max_bad_shards=1, **OPTIONS)
        with pytest.raises(ShardError, match=r"\(2 damaged, 0 missing\): more than the 1 that max_bad_shards=1 allows"):
            keys_of(loader)
        fraction = make_loader(f"{server.url}/shards/", num_workers=0, skip_bad=True, max_bad_shards=0.25, **OPTIONS)
        assert len(keys_of(fraction)) == 48 - 12  # 2 of 8 shards is within 25%


def test_the_cache_serves_the_second_epoch_without_the_server(packed, tmp_path):
    local = keys_of(make_loader(str(packed), num_workers=2, **OPTIONS), epoch=1)
    with ShardServer(packed.parent) as server:
        loader = make_loader(f"{server.url}/shards/", num_workers=2, cache_dir=str(tmp_path / "cache"), **OPTIONS)
        keys_of(loader, epoch=0)
        shard_gets = sum(server.gets(n) for n in shard_names(packed))
        assert shard_gets == len(shard_names(packed))  # each fetched once, whole (one chunk)
        assert keys_of(loader, epoch=1) == local
        assert sum(server.gets(n) for n in shard_names(packed)) == shard_gets
        cached = [p for p in (tmp_path / "cache" / "seqshard-cache").iterdir() if p.is_file() and p.name != TAG]
        assert sorted(p.name.split("-", 1)[1] for p in cached) == shard_names(packed)
        assert not list((tmp_path / "cache" / "seqshard-cache").glob("*.part-*"))


def test_a_damaged_cache_file_is_fetched_again(packed, tmp_path):
    names = shard_names(packed)
    with ShardServer(packed.parent) as server:
        url = f"{server.url}/shards/"
        first = make_loader(url, num_workers=0, cache_dir=str(tmp_path / "cache"), **OPTIONS)
        expected = keys_of(first)
        victim = next(p for p in (tmp_path / "cache" / "seqshard-cache").iterdir() if p.name.endswith(names[4]))
        data = bytearray(victim.read_bytes())
        data[700] ^= 0xFF  # inside the first member's data: same size, other bytes
        victim.write_bytes(bytes(data))
        before = server.gets(names[4])
        again = make_loader(url, num_workers=0, cache_dir=str(tmp_path / "cache"), **OPTIONS)
        assert keys_of(again) == expected
        assert server.gets(names[4]) == before + 1
        assert zlib.crc32(victim.read_bytes()) == zlib.crc32((packed / names[4]).read_bytes())


def test_the_cache_keeps_to_its_limit(packed, tmp_path):
    size = (packed / shard_names(packed)[0]).stat().st_size
    with ShardServer(packed.parent) as server:
        loader = make_loader(
            f"{server.url}/shards/", num_workers=0, cache_dir=str(tmp_path / "c"), cache_limit=3 * size + 100, **OPTIONS
        )
        assert len(keys_of(loader)) == 48
        kept = [p for p in (tmp_path / "c" / "seqshard-cache").iterdir() if p.is_file() and p.name != TAG]
        assert 1 <= len(kept) <= 3 and sum(p.stat().st_size for p in kept) <= 3 * size + 100


def _read_through_cache(url, cache, barrier):
    from seqshard.formats.remote.access import RemoteAccess
    from seqshard.formats.remote.cache import ShardCache

    access = RemoteAccess(cache=ShardCache(cache))
    barrier.wait()
    access.cached_copy(url).close()


def test_two_processes_do_not_fetch_one_shard_twice(packed, tmp_path):
    name = shard_names(packed)[0]
    with ShardServer(packed.parent, latency=0.3) as server:
        url = f"{server.url}/shards/{name}"
        context = mp.get_context("spawn")
        barrier = context.Barrier(2)
        workers = [context.Process(target=_read_through_cache, args=(url, str(tmp_path / "c"), barrier)) for _ in "ab"]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
        assert [w.exitcode for w in workers] == [0, 0]
        assert server.gets(name) == 1


def test_s3_through_moto(packed, tmp_path, monkeypatch):
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    import boto3

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        for name, value in {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            monkeypatch.setenv(name, value)
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket="speech")
        for path in packed.iterdir():
            if path.is_file():
                client.upload_file(str(path), "speech", f"train/{path.name}")
        local = keys_of(make_loader(str(packed), num_workers=0, **OPTIONS))
        assert keys_of(make_loader("s3://speech/train/", num_workers=0, **OPTIONS)) == local
        globbed = make_loader("s3://speech/train/data-*.tar", num_workers=0, **OPTIONS)
        assert [s.path for s in globbed.table.shards] == [f"s3://speech/train/{n}" for n in shard_names(packed)]
        assert keys_of(globbed) == local
        local_w2 = keys_of(make_loader(str(packed), num_workers=2, **OPTIONS))
        assert keys_of(make_loader("s3://speech/train/", num_workers=2, **OPTIONS)) == local_w2
    finally:
        server.stop()


def test_inspect_and_verify_read_urls_and_index_says_it_needs_a_folder(packed, tmp_path):
    from seqshard.tools.inspect import summarize
    from seqshard.tools.reindex import rebuild_index
    from seqshard.tools.verify import verify

    names = shard_names(packed)
    copy = tmp_path / "copy"
    shutil.copytree(packed, copy)
    data = bytearray((copy / names[1]).read_bytes())
    data[700] ^= 0xFF
    (copy / names[1]).write_bytes(bytes(data))
    with ShardServer(tmp_path) as server:
        summary = summarize(f"{server.url}/copy/", progress=False)
        assert [f.num_utts for f in summary.folders] == [48]
        result = verify(f"{server.url}/copy/data-{{00000..{len(names) - 1:05d}}}.tar", progress=False)
        assert result.checked == len(names)
        assert list(result.damaged) == [f"{server.url}/copy/{names[1]}"]
        assert "checksum" in " ".join(result.damaged[f"{server.url}/copy/{names[1]}"])
        server.missing.add(names[2])
        gone = verify(f"{server.url}/copy/", progress=False)
        assert (
            f"{server.url}/copy/{names[2]}" in gone.damaged
            and "not found" in gone.damaged[f"{server.url}/copy/{names[2]}"][0]
        )
        with pytest.raises(ConfigError, match="needs a local folder"):
            rebuild_index(f"{server.url}/copy/")


def test_pipe_sources_run_only_when_allowed(packed, tmp_path):
    names = shard_names(packed)
    marker = tmp_path / "ran"
    pattern = f"pipe:touch {marker} && cat {packed}/data-{{00000..{len(names) - 1:05d}}}.tar"
    with pytest.raises(ConfigError, match="allow_pipes=True"):
        make_loader(pattern, num_workers=0, **OPTIONS)
    assert not marker.exists()
    expected = sorted(keys_of(make_loader(str(packed), num_workers=0, **OPTIONS)))
    for workers in (0, 2):
        loader = make_loader(pattern, num_workers=workers, allow_pipes=True, **OPTIONS)
        assert sorted(keys_of(loader)) == expected
    assert marker.exists()
    with pytest.raises(ConfigError, match="exited with status 3"):
        make_loader(f"pipe:head -c 3000 {packed}/{names[0]}; exit 3", num_workers=0, allow_pipes=True, **OPTIONS)
    half = (packed / names[0]).stat().st_size // 2
    failing = make_loader(
        f"pipe:head -c {half} {packed}/{names[0]}; exit 3", num_workers=0, allow_pipes=True, **OPTIONS
    )
    with pytest.raises(ShardError, match="exited with status 3"):
        keys_of(failing)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_tight_cache_limit_loses_nothing(packed, tmp_path, num_workers):
    """Readers fetch, prefetch and evict concurrently; a copy evicted before its reader read
    it must still be read (it was opened first)."""
    size = max(p.stat().st_size for p in packed.glob("data-*.tar"))
    with ShardServer(packed.parent) as server:
        url = f"{server.url}/shards/"
        tight = make_loader(
            url, num_workers=num_workers, cache_dir=str(tmp_path / "c"), cache_limit=size + 10, **OPTIONS
        )
        for epoch in range(3):
            seen = keys_of(tight, epoch)
            assert len(seen) == len(set(seen)) == 48 and tight.stats()["damaged_shards"] == 0
        tiny = make_loader(url, num_workers=0, cache_dir=str(tmp_path / "d"), cache_limit=size // 2, **OPTIONS)
        with pytest.raises(ConfigError, match="raise cache_limit"):
            keys_of(tiny)


def test_a_shard_changed_on_the_server_since_its_index_is_not_read(packed, tmp_path):
    names = shard_names(packed)
    copy = tmp_path / "copy"
    shutil.copytree(packed, copy)
    (copy / names[2]).write_bytes((copy / names[3]).read_bytes()[:-1024])  # other content, other size
    with ShardServer(tmp_path) as server:
        url = f"{server.url}/copy/"
        with pytest.raises(ShardError, match=rf"{names[2]}.*changed since it was indexed"):
            keys_of(make_loader(url, num_workers=0, **OPTIONS))
        loader = make_loader(url, num_workers=2, skip_bad=True, max_bad_shards=1, **OPTIONS)
        seen = keys_of(loader)
        assert len(seen) == len(set(seen)) == 42 and loader.stats()["damaged_shards"] == 1


def test_reads_across_the_pieces_of_fetched_chunks_give_the_bytes(monkeypatch):
    """A fetched chunk is kept in the pieces the socket gave it in, not joined (issue 30 item
    21: a copy of every byte): a read within a piece is a view of it, one across pieces or
    chunks joins its parts."""
    data = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    url = "http://shards.example/data-00000.tar"
    access = remote.RemoteAccess(chunk_bytes=1000, expected={url: (len(data), None)})

    def fetch(url, start, end, abandoned=None):
        cuts = sorted({start, end, *range(start, end, 7 + start % 13)})  # uneven pieces
        return remote.FetchedRange([data[a:b] for a, b in itertools.pairwise(cuts)])

    monkeypatch.setattr(access, "fetch", fetch)
    monkeypatch.setattr(access, "ranges", lambda url: True)  # the server serves ranges
    monkeypatch.setattr(access, "server_size", lambda url, abandoned=None: len(data))
    source = remote.RemoteBytes(url, access)
    rng = np.random.default_rng(1)
    position = 0
    for _ in range(400):
        if rng.random() < 0.2:
            position = int(rng.integers(0, len(data)))
            source.seek(position)
        size = int(rng.integers(0, 300))
        assert bytes(source.read(size)) == data[position : position + size]
        position = min(position + size, len(data))
    source.close()
