"""Credentials in URLs (``user:password@``, signed query parameters) never reach an error, a log
line, ``stats()``, a progress line, or what ``seqshard inspect``/``verify`` print."""

import logging
import shutil

import pytest
from http_server import ShardServer

from conftest import write_kaldi_dir
from seqshard import make_loader, mux, pack_data
from seqshard.cli import main
from seqshard.errors import ShardError, redact

OPTIONS = dict(batch_size=4, shuffle_window=16, sort_window=8, seed=1, num_workers=0)
PASSWORD, SIGNATURE, TOKEN = "pw-4f1a9", "sig-77c0e", "tok-e3b2d"
SECRETS = (PASSWORD, SIGNATURE, TOKEN)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """8 indexed shards under ``shards/``; a copy under ``damaged/`` whose second shard has a
    broken tar header."""
    root = tmp_path_factory.mktemp("secrets")
    data = write_kaldi_dir(root / "kaldi", speakers=6, per_speaker=8)
    pack_data(data.scp, data.text, root / "shards", utts_per_file=6, progress=False)
    shutil.copytree(root / "shards", root / "damaged")
    broken = root / "damaged" / "data-00001.tar"
    data = bytearray(broken.read_bytes())
    data[150] ^= 0xFF  # the first header's checksum field
    broken.write_bytes(bytes(data))
    return root


def secret_url(server, path):
    return server.url.replace("http://", f"http://alice:{PASSWORD}@") + path


def signed(server, name):
    return secret_url(server, f"/shards/{name}?sig={SIGNATURE}&token={TOKEN}&n=1")


def assert_hidden(text):
    assert not [secret for secret in SECRETS if secret in text], text


def keys_of(loader):
    loader.set_epoch(0)
    return [key for batch in loader for key in batch["keys"]]


def test_redact_keeps_names_and_hides_values():
    url = "https://alice:pw@host:8/a/data-0.tar?X-Amz-Credential=AK%2F1&X-Amz-Signature=ab12&X-Amz-Date=2024&n=1"
    assert redact(url) == "https://***@host:8/a/data-0.tar?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Date=2024&n=1"
    sas = "https://a.blob.core.windows.net/c/x.tar?sv=2022-11-02&se=2030-01-01&sp=r&sig=Zm9v%3D"
    assert redact(sas) == "https://a.blob.core.windows.net/c/x.tar?sv=2022-11-02&se=2030-01-01&sp=r&sig=***"
    for name in ("X-Goog-Signature", "X-Amz-Security-Token", "access_token", "api_key", "password", "Signature"):
        assert redact(f"http://h/x.tar?{name}=v4lue") == f"http://h/x.tar?{name}=***"
    assert redact('pipe:curl -H "Authorization: Bearer abc" https://t0ken@h/x') == (
        'pipe:curl -H "Authorization: Bearer ***" https://***@h/x'
    )
    plain = "max_tokens=5, skip_bad=True, alice@example.org, s3://bucket/key@v2/data-0.tar"
    assert redact(plain) == plain
    assert redact(redact(url)) == redact(url)


def test_failures_and_skips_never_show_credentials(served, caplog):
    caplog.set_level(logging.INFO, "seqshard")
    with ShardServer(served) as server:
        braces = signed(server, "data-{00000..00009}.tar")  # the server has 8 of them
        with pytest.raises(ShardError) as missing:
            make_loader(braces, **OPTIONS)
        assert "2 selected shards are missing" in str(missing.value)
        skipping = make_loader(braces, skip_bad=True, max_bad_shards=2, **OPTIONS)
        assert len(keys_of(skipping)) == 48

        server.faults["data-00003.tar"] = ["500"] * 10
        with pytest.raises(ShardError) as failing:
            keys_of(make_loader(secret_url(server, "/shards/"), remote_retries=1, **OPTIONS))
        assert "failed after 2 attempts" in str(failing.value)
        server.faults["data-00003.tar"] = ["500"] * 10
        failing_signed = make_loader(signed(server, "data-{00000..00007}.tar"), remote_retries=1, **OPTIONS)
        with pytest.raises(ShardError) as failing_again:
            keys_of(failing_signed)

        server.faults.clear()
        server.missing.add("data-00002.tar")
        damaged = make_loader(secret_url(server, "/damaged/"), skip_bad=True, max_bad_shards=2, **OPTIONS)
        assert len(keys_of(damaged)) == 36 and damaged.stats()["damaged_shards"] == 2
    for error in (missing.value, failing.value, failing_again.value):
        assert_hidden(str(error) + repr(error))
    for loader in (skipping, damaged):
        assert_hidden(repr(loader.stats()) + repr(loader.last_summary))
    assert "are missing and not read" in caplog.text and "skipping (the rest of) a damaged shard" in caplog.text
    assert "retrying in" in caplog.text and "http://alice:***@" not in caplog.text and "http://***@" in caplog.text
    assert_hidden(caplog.text)


def test_stats_of_a_mix_never_show_credentials(served):
    with ShardServer(served) as server:
        sources = [signed(server, "data-{00000..00003}.tar"), signed(server, "data-{00004..00007}.tar")]
        loader = make_loader(mux(sources, weights=[1, 1]), epoch_steps=3, **OPTIONS)
        assert len(keys_of(loader)) == 12
        stats = loader.stats()
    assert len(stats["sources"]) == 2 and all("***" in name for name in stats["sources"])
    assert_hidden(repr(stats))


def test_inspect_and_verify_never_show_credentials(served, capsys):
    with ShardServer(served) as server:
        server.missing.add("data-00005.tar")
        assert main(["inspect", signed(server, "data-{00000..00009}.tar")]) == 1
        inspected = capsys.readouterr()
        assert main(["inspect", "--json", secret_url(server, "/shards/data-{00000..00009}.tar")]) == 1
        as_json = capsys.readouterr()
        assert main(["verify", secret_url(server, "/damaged/")]) == 1
        verified = capsys.readouterr()
    assert "MISSING http://***@" in inspected.out and "data-00009.tar" in as_json.out
    assert "DAMAGED http://***@" in verified.out and "verify http://***@" in verified.err  # its progress lines
    for shown in (inspected, as_json, verified):
        assert_hidden(shown.out + shown.err)


def test_the_debug_lines_of_fsspec_never_show_credentials(served, caplog):
    """fsspec's http logs each URL it fetches at DEBUG (issue 23, item 20); seqshard makes its
    http requests itself now, but its other methods (and other backends) still log."""
    caplog.set_level(logging.DEBUG, "fsspec")
    caplog.set_level(logging.DEBUG, "aiohttp")
    with ShardServer(served) as server:
        assert len(keys_of(make_loader(signed(server, "data-{00000..00001}.tar"), **OPTIONS))) == 12
        logging.getLogger("fsspec.http").debug("Fetch: %s, %s", signed(server, "data-00001.tar"), {})  # as fsspec does
    shown = [r.getMessage() for r in caplog.records if r.name.startswith("fsspec")]
    assert any("/shards/data-00001.tar?sig=***&token=***&n=1" in line for line in shown), shown[:5]
    assert_hidden(caplog.text)
