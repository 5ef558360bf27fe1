"""Member tables (formats/members.py): written with every shard and sidecar, built by
`seqshard index` for shards other tools wrote, read to the same samples, states and errors as
parsing the headers, and checked against the file they describe."""

import json
import logging
import os
import re
import shutil
import tarfile

import numpy as np
import pytest

from conftest import pack_small
from seqshard import add_field, make_loader
from seqshard.errors import ShardError
from seqshard.formats.members import TABLE_DIR, TableBuilder, load_table, table_path
from seqshard.formats.sliced import SlicedSampleStream
from seqshard.formats.streams import open_samples, skip_samples
from seqshard.formats.tar import SampleStream, member_table
from seqshard.tools.reindex import rebuild_index
from seqshard.tools.verify import verify

OPTIONS = dict(batch_frames=100, num_workers=0, seed=3, shuffle_window=12, sort_window=8, interleave=2)


@pytest.fixture
def packed_with_words(tmp_path):
    packed = pack_small(tmp_path, utts_per_file=10)
    (tmp_path / "words").write_text("".join(f"{k} w{i}\n" for i, k in enumerate(packed.data.keys)))
    add_field(packed.out, "words", tmp_path / "words", progress=False)
    return packed


def records(stream):
    found = []
    while (record := stream.next_sample()) is not None:
        fields = {name: bytes(data) for name, data in record.fields.items()}
        found.append((record.key, fields, record.offset, record.ordinal, stream.resume_offset))
    return found, stream.ended_cleanly, stream.resume_offset


def batches(loader):
    return [(batch["keys"], batch["feats"].numpy().copy()) for batch in loader]


def test_pack_and_add_field_write_a_table_beside_each_shard_and_sidecar(packed_with_words):
    out = packed_with_words.out
    shards = sorted(out.glob("data-*.tar"))
    sidecars = sorted(out.glob("fields/words/*.tar"))
    assert len(shards) == len(sidecars) == 5
    for path in shards + sidecars:
        assert table_path(path).parent.name == TABLE_DIR
        assert load_table(path).same_as(member_table(path))  # the writer's table is the headers' table
        with tarfile.open(path) as tar:
            assert not any(TABLE_DIR in name for name in tar.getnames())  # the tar is untouched
    table = load_table(shards[0])
    assert table.num_samples == 10 and set(table.suffixes) == {"feats.npy", "txt"}


def test_a_table_reads_the_same_records_as_the_headers_from_any_position(packed_with_words):
    for path in [*packed_with_words.out.glob("data-*.tar"), *packed_with_words.out.glob("fields/words/*.tar")]:
        with SampleStream(path) as headers:
            expected = records(headers)
        with open_samples(path) as stream:
            assert isinstance(stream, SlicedSampleStream)
            assert records(stream) == expected
        for count in (1, 4, 10, 12):
            offset, ordinal = skip_samples(path, count)
            with SampleStream(path, read_data=False) as walk:
                for _ in range(count):
                    walk.next_sample()
                assert (offset, ordinal) == (walk.resume_offset, walk.ordinal)
            with open_samples(path, offset, ordinal) as stream, SampleStream(path, offset, ordinal) as headers:
                assert records(stream) == records(headers)


@pytest.mark.parametrize("fields", [None, ["feats", "words"]])
def test_a_loader_gives_the_same_batches_and_states_with_tables_and_without(packed_with_words, tmp_path, fields):
    with_tables = packed_with_words.out
    without = tmp_path / "without"
    shutil.copytree(with_tables, without)
    for folder in (without, without / "fields" / "words"):
        shutil.rmtree(folder / TABLE_DIR)
    options = dict(OPTIONS, fields=fields)
    full = batches(make_loader(with_tables, **options))
    reference = batches(make_loader(without, **options))
    assert [keys for keys, _ in full] == [keys for keys, _ in reference]
    for (_, ours), (_, theirs) in zip(full, reference):
        np.testing.assert_array_equal(ours, theirs)
    keys = [keys for keys, _ in full]
    for cut in (1, len(full) // 2):
        states = []
        for folder in (with_tables, without):
            loader = make_loader(folder, **options)
            iterator = iter(loader)
            for _ in range(cut):
                next(iterator)
            state = json.loads(json.dumps(loader.state_dict()))
            del iterator
            resumed = make_loader(folder, **options)
            resumed.load_state_dict(state)
            assert keys[:cut] + [keys for keys, _ in batches(resumed)] == keys, (folder, cut)
            states.append(json.dumps(state).replace(str(folder), "FOLDER"))
        assert _positions(states[0]) == _positions(states[1])  # the same byte offsets and ordinals


def _positions(dumped):
    """Every number in a dumped state (the shard list's fingerprint left out)."""
    return _numbers(json.loads(dumped))


def _numbers(value):
    if isinstance(value, dict):
        return [n for key, item in sorted(value.items()) if key != "fingerprint" for n in _numbers(item)]
    if isinstance(value, list):
        return [n for item in value for n in _numbers(item)]
    return [value] if isinstance(value, int | float) else []


@pytest.mark.parametrize("writer", ["webdataset", "tarfile"])
def test_seqshard_index_builds_tables_for_tars_other_tools_wrote(tmp_path, writer):
    folder = tmp_path / "foreign"
    folder.mkdir()
    arrays = {f"utt{i}": np.full((3 + i, 4), i, dtype=np.float32) for i in range(7)}
    for number in range(2):
        path = folder / f"shard-{number}.tar"
        chosen = list(arrays.items())[number::2]
        if writer == "webdataset":
            wds = pytest.importorskip("webdataset")
            with wds.TarWriter(str(path)) as sink:
                for key, array in chosen:
                    sink.write({"__key__": key, "feats.npy": array, "txt": f"text of {key}"})
        else:
            import io

            with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
                for key, array in chosen:
                    for suffix, data in (("feats.npy", _npy(array)), ("txt", f"text of {key}".encode())):
                        info = tarfile.TarInfo(f"{key}.{suffix}")
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
    assert not (folder / TABLE_DIR).exists()
    rebuild_index(folder, progress=False)
    for path in sorted(folder.glob("*.tar")):
        assert load_table(path).same_as(member_table(path))
        with SampleStream(path) as headers, open_samples(path) as stream:
            assert isinstance(stream, SlicedSampleStream)
            assert records(stream) == records(headers)
    found = {}
    for batch in make_loader(folder, batch_size=2, num_workers=0, shuffle=False):
        for row, key in enumerate(batch["keys"]):
            found[key] = batch["feats"][row, : batch["feat_lens"][row]].numpy()
    assert sorted(found) == sorted(arrays)
    for key, array in found.items():
        np.testing.assert_array_equal(array, arrays[key])


def _npy(array):
    import io

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _rename_a_sample_in_place(path, old_key, new_key):
    """Change a sample's key in its members' ustar headers (same length) and fix the header
    checksums, so that the headers read cleanly but the file differs from its table."""
    assert len(old_key) == len(new_key)
    with tarfile.open(path) as tar:
        offsets = [m.offset for m in tar.getmembers() if m.name.startswith(old_key + ".")]
    data = bytearray(path.read_bytes())
    for offset in offsets:
        header = data[offset : offset + 512]
        assert header[: len(old_key)] == old_key.encode()
        header[: len(new_key)] = new_key.encode()
        header[148:156] = b" " * 8
        header[148:156] = b"%06o\0 " % sum(header)
        data[offset : offset + 512] = header
    path.write_bytes(bytes(data))


def test_a_shard_edited_after_its_table_is_read_by_its_headers_and_its_table_counted(packed_with_words, caplog):
    out = packed_with_words.out
    path = out / "data-00002.tar"
    key = load_table(path).keys[5]
    renamed = key[:-1] + ("x" if key[-1] != "x" else "y")
    _rename_a_sample_in_place(path, key, renamed)
    with caplog.at_level(logging.WARNING, logger="seqshard"):
        loader = make_loader(out, **dict(OPTIONS, interleave=1))
        keys = [k for keys, _ in batches(loader) for k in keys]
        batches(loader)  # a second epoch: no second warning
    assert len(keys) == 48 and renamed in keys and key not in keys  # what the headers say
    assert (loader.stats()["damaged_tables"], loader.stats()["damaged_shards"]) == (1, 0)
    warned = [r.getMessage() for r in caplog.records if "member table" in r.getMessage()]
    assert len(warned) == 1 and "data-00002.tar: the headers of its samples" in warned[0]
    problems = [p for shard, found in verify(str(out), progress=False).damaged.items() for p in found]
    assert (
        f"its member table {table_path(path)} differs from its headers: rebuild it with `seqshard index` on its folder"
        in problems
    )
    rebuild_index(out, progress=False)  # the edit was on purpose: the table follows the file
    assert load_table(path).same_as(member_table(path))
    loader = make_loader(out, **OPTIONS)
    assert len([k for keys, _ in batches(loader) for k in keys]) == 48
    assert loader.stats()["damaged_tables"] == 0


@pytest.fixture(scope="module", params=["short", "long"])
def one_shard_of_70(request, tmp_path_factory):
    """70 samples in one shard (two blocks of checked headers); long keys need pax headers."""
    prefix = "spk" if request.param == "short" else "s" * 120
    root = tmp_path_factory.mktemp("seventy")
    return pack_small(root, utts_per_file=100, speakers=2, per_speaker=35, dim=3, frames=(2, 5), prefix=prefix)


def _swap_two_keys(stored, number):
    keys = bytes(stored["keys"]).split(b"\0")
    keys[number], keys[number + 1] = keys[number + 1], keys[number]
    stored["keys"] = np.frombuffer(b"\0".join(keys), dtype=np.uint8)


def _shorten_a_label(stored, number):
    member = int(stored["first_member"][number]) + 1  # a sample's members: feats.npy, txt
    stored["sizes"][member] = 1


def _forge_without(path, numbers):
    """A table of ``path`` without samples ``numbers``, consistent in itself and with header
    checksums the file matches (as a forger would make it): only the headers tell."""
    builder = TableBuilder()
    with SampleStream(path, read_data=False, where=True) as stream:
        while (sample := stream.next_sample()) is not None:
            if sample.ordinal not in numbers:
                builder.add_sample(sample.key, sample.offset, sample.members)
        end = stream.resume_offset
    builder.finish(path, end).save(path)


@pytest.mark.parametrize(
    ("one_shard_of_70", "numbers"), [("short", {0}), ("long", {40}), ("short", {69})], indirect=["one_shard_of_70"]
)
def test_a_forged_table_leaving_out_a_sample_never_hides_it(one_shard_of_70, tmp_path, numbers):
    out = tmp_path / "shards"
    shutil.copytree(one_shard_of_70.out, out)
    _forge_without(out / "data-00000.tar", numbers)
    loader = make_loader(out, batch_size=7, shuffle=False, num_workers=0)
    assert sorted(k for batch in loader for k in batch["keys"]) == sorted(one_shard_of_70.data.keys)
    assert loader.stats()["damaged_tables"] == 1


@pytest.mark.parametrize(
    ("one_shard_of_70", "edit", "number"),
    [  # in the first block of 64 samples and in the second; ustar names, and pax ones (long keys)
        ("short", _swap_two_keys, 66),
        ("short", _shorten_a_label, 3),
        ("long", _swap_two_keys, 3),
        ("long", _shorten_a_label, 66),
    ],
    indirect=["one_shard_of_70"],
)
def test_a_table_with_other_keys_or_sizes_than_the_headers_never_serves_them(one_shard_of_70, tmp_path, edit, number):
    out = tmp_path / "shards"
    shutil.copytree(one_shard_of_70.out, out)
    path = out / "data-00000.tar"
    stored = dict(np.load(table_path(path)))
    edit(stored, number)
    with open(table_path(path), "wb") as stream:
        np.savez(stream, **stored)
    loader = make_loader(out, batch_size=7, shuffle=False, num_workers=0)
    found = {}
    for batch in loader:
        for row, key in enumerate(batch["keys"]):
            found[key] = (batch["feats"][row, : batch["feat_lens"][row]].numpy(), batch["texts"][row])
    data = one_shard_of_70.data
    assert sorted(found) == sorted(data.keys)
    for key, (feats, text) in found.items():
        np.testing.assert_array_equal(feats, data.arrays[key])
        assert text == data.labels[key]
    assert (loader.stats()["damaged_tables"], loader.stats()["damaged_shards"]) == (1, 0)


def test_a_good_table_of_long_keys_is_checked_by_a_walk_over_its_headers(one_shard_of_70):
    path = one_shard_of_70.out / "data-00000.tar"
    table = load_table(path)
    with open(path, "rb") as stream:
        data = stream.read()
    long_keys = len(table.keys[0]) > 100
    assert [table.headers_agree(block, memoryview(data)) for block in (0, 1)] == [not long_keys] * 2
    loader = make_loader(one_shard_of_70.out, batch_size=7, shuffle=False, num_workers=0)
    assert sum(len(batch["keys"]) for batch in loader) == 70
    assert loader.stats()["damaged_tables"] == 0


def test_a_truncated_shard_with_a_table_fails_as_it_does_without(packed_with_words):
    out = packed_with_words.out
    path = out / "data-00001.tar"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    errors = []
    for drop_table in (False, True):
        if drop_table:
            table_path(path).unlink()
        with pytest.raises(ShardError) as error:
            batches(make_loader(out, **dict(OPTIONS, interleave=1, shuffle=False)))
        errors.append(str(error.value))
    assert errors[0] == errors[1] and "data-00001.tar" in errors[0]


@pytest.mark.parametrize("kind", ["damaged", "a FIFO", "a device"])
def test_an_unreadable_table_is_a_damaged_shard_naming_it(packed_with_words, caplog, kind):
    """A FIFO or /dev/zero at a table's name held the loader, verify and index (zipfile read it)."""
    out = packed_with_words.out
    table = table_path(out / "data-00003.tar")
    table.unlink()
    if kind == "damaged":
        table.write_bytes(b"not a table")
    elif kind == "a FIFO":
        os.mkfifo(table)
    else:
        table.symlink_to("/dev/zero")
    with pytest.raises(ShardError, match=r"data-00003\.tar: its member table .* cannot be read"):
        batches(make_loader(out, **OPTIONS))
    with caplog.at_level(logging.WARNING, logger="seqshard"):
        loader = make_loader(out, skip_bad=True, max_bad_shards=1, **OPTIONS)
        keys = [k for keys, _ in batches(loader) for k in keys]
    assert len(keys) == 38 and loader.stats()["damaged_shards"] == 1


def test_a_shard_cut_short_since_it_was_indexed_fails_before_any_of_its_samples(packed_with_words):
    """With or without a member table: no sample of a shard whose size is not its index's
    reaches training (a shard cut at a member boundary would give its first samples, then fail)."""
    out = packed_with_words.out
    path = out / "data-00001.tar"
    table_path(path).unlink(missing_ok=True)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2 // 512 * 512])
    options = dict(OPTIONS, interleave=1, shuffle=False, num_workers=0)
    first = [k for keys, _ in batches(make_loader(str(out / "data-00000.tar"), **options)) for k in keys]
    seen = []
    with pytest.raises(ShardError, match=r"data-00001\.tar: .*bytes where its index\.json says") as error:
        for keys, _ in batches(make_loader(str(out / "data-0000{0,1}.tar"), **options)):
            seen.extend(keys)
    assert "seqshard verify" in str(error.value)
    assert set(seen) <= set(first)  # nothing of the cut shard


def _npy_header(shape, dtype="<i8"):
    """The bytes of an .npy header declaring an array of ``shape``."""
    import io

    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


@pytest.mark.parametrize("one_shard_of_70", ["short"], indirect=True)
@pytest.mark.parametrize("compression", ["stored", "deflated"])
def test_a_table_declaring_a_4_gib_array_is_refused_before_it_is_allocated(one_shard_of_70, tmp_path, compression):
    """The .npy header of a table's array declares 2**29 int64 (4 GiB); the entry holds 4 MB of
    zeros (deflated: 1000x) or 16 bytes (stored). Refused, naming the table, allocating nothing."""
    import tracemalloc
    import zipfile

    out = tmp_path / "shards"
    shutil.copytree(one_shard_of_70.out, out)
    path = table_path(out / "data-00000.tar")
    with zipfile.ZipFile(path) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    method = zipfile.ZIP_DEFLATED if compression == "deflated" else zipfile.ZIP_STORED
    entries["sizes.npy"] = _npy_header((1 << 29,)) + bytes(4 << 20 if compression == "deflated" else 16)
    with zipfile.ZipFile(path, "w", method) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    tracemalloc.start()
    try:
        with pytest.raises(ShardError) as error:
            load_table(out / "data-00000.tar")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20  # 4 GiB before
    assert re.search(
        r"data-00000\.tar: its member table \S+ cannot be read \(array 'sizes' .*declares", str(error.value)
    )
