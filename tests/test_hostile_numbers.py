"""Numbers read from files are checked (type, finite, range, consistency with the data), with an
error naming the file, the field and the fix: index.json, PREFIX.json, Lhotse Shar cuts (and
their compressed lines stay within the inflation rule). Never a numpy or Python error that
names nothing, a MemoryError, or counts that are silently wrong."""

import gzip
import json
import shutil
import tracemalloc
from pathlib import Path

import kaldiio
import numpy as np
import pytest

from conftest import pack_small, write_kaldi_dir
from seqshard import make_loader, pack_data
from seqshard.errors import InputError, SeqshardError, ShardError
from seqshard.features.frontend import Cmvn
from seqshard.formats.index import ShardIndex
from seqshard.formats.peers.mmidx import TokenDataset, TokenDatasetWriter, TokenMeta, data_fingerprint
from seqshard.formats.peers.shar import shar_index
from seqshard.tools.reindex import rebuild_index

TEN = 10  # utterances in the shard of the index tests


@pytest.fixture(scope="module")
def one_pack(tmp_path_factory):
    """One shard of 10 utterances with its index.json (left read-only by the tests)."""
    root = tmp_path_factory.mktemp("one")
    return pack_small(root, utts_per_file=TEN, speakers=2, per_speaker=5, dim=3, frames=(2, 5))


@pytest.fixture(scope="module")
def one_shard(one_pack):
    return one_pack.out


def edited_copy(folder, tmp_path, edit):
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    index = json.loads((copy / "index.json").read_text())
    edit(index)
    (copy / "index.json").write_text(json.dumps(index))
    return copy


def set_entry(field, value):
    return lambda index: index["shards"][0].__setitem__(field, value)


@pytest.mark.parametrize(
    "edit, message",
    [
        (set_entry("num_utts", 10**15), r"num_utts is 1000000000000000, not >= 0 and <= \d+"),
        (set_entry("num_utts", -5), r"num_utts is -5, not >= 0"),
        (set_entry("num_utts", "10"), r"num_utts is '10', not a whole number"),
        (set_entry("num_frames", float("nan")), r"num_frames is nan, not a whole number"),
        (set_entry("bytes", "x"), r"bytes is 'x', not a whole number"),
        (set_entry("bytes", 1), r"num_utts is 10 but bytes is 1: a shard holds at most one sample per 512 bytes"),
        (set_entry("max_frames", 1), r"num_frames \d+, min_frames \d+ and max_frames 1 do not fit 10 utterances"),
        (set_entry("max_frames", 2**40), r"max_frames is 1099511627776, not >= 0 and <= 2147483647"),
        (set_entry("length_hist", {"320": 10}), r"length_hist has a bin '320', not a number from 0 to 247"),
        (set_entry("length_hist", {"x": 1}), r"length_hist has a bin 'x'"),
        (set_entry("length_hist", {"20": 11}), r"length_hist\['20'\] is 11, not >= 0 and <= 10"),
        (set_entry("checksum", 7), r"checksum is 7, not a string"),
        (lambda index: index["feature"].__setitem__("dim", "3"), r"feature dim is '3', not a whole number"),
        (
            lambda index: index["feature"].__setitem__("dim", 10**12),
            r"feature dim is 1000000000000, not >= 1 and <= 1048576",
        ),
        (lambda index: index["feature"].__setitem__("frame_shift_ms", 0), r"feature frame_shift_ms is 0, not > 0"),
        (lambda index: index.__setitem__("version", "x"), r"not a seqshard index of version"),
    ],
)
def test_a_hostile_number_in_index_json_is_named_with_its_file_and_field(one_shard, tmp_path, edit, message):
    copy = edited_copy(one_shard, tmp_path, edit)
    with pytest.raises(
        SeqshardError, match=rf"copy/index\.json: (shard entry 0 \(data-00000\.tar\): )?{message}.* [Rr]ebuild it"
    ):
        ShardIndex.load(copy)


def fewer_utterances(index):
    """num_utts 5 for a shard of 10, in an entry without the lengths that would give it away."""
    entry = index["shards"][0]
    entry["num_utts"] = 5
    for field in ("length_hist", "min_frames", "max_frames"):
        del entry[field]


def test_an_index_counting_fewer_utterances_than_the_shard_holds_is_a_damaged_shard(one_shard, tmp_path):
    with pytest.raises(SeqshardError, match=r"length_hist counts 10 utterances where num_utts is 5"):
        ShardIndex.load(edited_copy(one_shard, tmp_path / "with", set_entry("num_utts", 5)))
    copy = edited_copy(one_shard, tmp_path, fewer_utterances)
    with pytest.raises(ShardError, match=r"data-00000\.tar at byte \d+: it holds more samples than the 5 its index"):
        list(make_loader(copy, batch_size=4, num_workers=0, shuffle=False))
    loader = make_loader(copy, batch_size=4, num_workers=0, shuffle=False, skip_bad=True, max_bad_shards=1)
    assert sum(len(batch["keys"]) for batch in loader) == 5 and loader.stats()["damaged_shards"] == 1


# ---------------------------------------------------------------------------------------------
# PREFIX.json


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """Two sequences of ids up to 11 (eos 2 appended) and the PREFIX.json binarize would write."""
    prefix = tmp_path_factory.mktemp("tokens") / "d"
    writer = TokenDatasetWriter(prefix, np.uint16)
    writer.add_many([[5, 11, 2], [7, 2]])
    writer.finish()
    meta = TokenMeta("megatron", "uint16", 2, 5, data_fingerprint(prefix), 12, 2, True, pad_id=1, unk_id=3)
    meta.write(prefix)
    return prefix


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("pad_id", "1", r"pad_id is '1', not a whole number or None"),
        ("pad_id", [1], r"pad_id is \[1\], not a whole number or None"),
        ("pad_id", 2**70, r"pad_id is 1180591620717411303424, not >= 0 and <= 9223372036854775807"),
        ("eos_id", "x", r"eos_id is 'x', not a whole number or None"),
        ("eos_id", 12, r"eos_id is 12, not >= 0 and <= 11"),
        ("vocab_size", 4, r"vocab_size is 4, but the tokens hold id 11: it does not describe these tokens"),
        ("vocab_size", 2**20, r"vocab_size is 1048576, not >= 1 and <= 65536"),
        ("eos_id", 5, r"eos_appended is true, but sequence 0 does not end with eos_id 5"),
        ("sequences", -1, r"sequences is -1, not >= 0"),
        ("eos_appended", "yes", r"eos_appended is 'yes', not true or false"),
    ],
)
def test_a_hostile_value_in_prefix_json_is_named_with_its_file_and_field(tokens, tmp_path, field, value, message):
    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(tokens.with_suffix(suffix), tmp_path / f"d{suffix}")
    meta = json.loads((tmp_path / "d.json").read_text())
    meta[field] = value
    (tmp_path / "d.json").write_text(json.dumps(meta))
    with pytest.raises(ShardError, match=rf"d\.json: {message}.* Fix: binarize again"):
        TokenDataset(tmp_path / "d").meta  # noqa: B018


# ---------------------------------------------------------------------------------------------
# Lhotse Shar cuts


def write_cuts(folder, lines: list[bytes], name="cuts.000000.jsonl.gz"):
    folder.mkdir(exist_ok=True)
    with (gzip.open if name.endswith(".gz") else open)(folder / name, "wb") as stream:
        stream.write(b"".join(lines))
    return folder


def cut(number, **fields):
    record = {"id": f"cut-{number}", "duration": 1.5, "supervisions": [{"text": f"text {number}", "start": 0}]}
    return (json.dumps({**record, **fields}) + "\n").encode()


FEATURES = {"type": "array", "frame_shift": 0.01, "num_features": 80}


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"duration": float("inf")}, r"its duration \(seconds\) is inf, not a finite number"),
        ({"duration": float("nan")}, r"its duration \(seconds\) is nan, not a finite number"),
        ({"duration": -1}, r"its duration \(seconds\) is -1, not >= 0"),
        ({"duration": "x"}, r"its duration \(seconds\) is 'x', not a number"),
        ({"duration": 1e12}, r"its duration \(seconds\) is 1000000000000.0, not >= 0 and <= 21474836.47"),
        (
            {"duration": 1e6, "features": {**FEATURES, "frame_shift": 1e-4}},
            r"lasts 1000000.0 s, 10000000000 frames of 0.1 ms: beyond 2147483647 frames",
        ),
        ({"features": {**FEATURES, "frame_shift": 0}}, r"frame_shift \(seconds\) is 0, not > 0"),
        ({"features": {**FEATURES, "frame_shift": "x"}}, r"frame_shift \(seconds\) is 'x', not a number"),
        ({"features": {**FEATURES, "num_features": 2.5}}, r"num_features is 2.5, not a whole number"),
    ],
)
def test_a_hostile_number_in_shar_cuts_is_named_with_its_file_line_and_field(tmp_path, fields, message):
    folder = write_cuts(tmp_path / "shar", [cut(0), cut(1, **fields)])
    with pytest.raises(
        ShardError, match=rf"cuts\.000000\.jsonl\.gz at byte \d+: (cut 'cut-1' \(line 2\): )?.*{message}"
    ):
        shar_index(folder)


@pytest.mark.parametrize("duration", [float("inf"), float("nan"), -1, "x", 1e12])
def test_with_skip_bad_a_cut_whose_duration_is_not_one_is_counted_and_the_others_read(tmp_path, duration):
    """It refused the whole folder at make_loader, skip_bad or not."""
    folder = write_cuts(tmp_path / "shar", [cut(0), cut(1, duration=duration), cut(2)])
    with pytest.raises(ShardError, match=r"cut 'cut-1' \(line 2\): its duration \(seconds\) is"):
        make_loader(folder, batch_size=2, num_workers=0)
    loader = make_loader(folder, batch_size=2, num_workers=0, shuffle=False, fields=["txt"], skip_bad=True)
    assert [text for batch in loader for text in batch["texts"]] == ["text 0", "text 2"]
    rank = loader.last_summary["ranks"][0]
    assert rank["dropped"] == {"bad_duration": 1} and rank["planned"] == 3 == rank["utts"] + 1


def test_shar_cuts_are_read_and_counted(tmp_path):
    folder = write_cuts(tmp_path / "shar", [cut(n, features=FEATURES) for n in range(3)])
    index = shar_index(folder)
    assert (index.num_utts, index.num_frames, index.feature["frame_shift_ms"]) == (3, 450, 10.0)
    loader = make_loader(folder, batch_size=2, num_workers=0, shuffle=False, fields=["txt"])
    assert [text for batch in loader for text in batch["texts"]] == ["text 0", "text 1", "text 2"]


def test_a_small_cuts_file_inflating_to_a_long_line_is_refused_within_its_bound(tmp_path):
    """16 MB of spaces gzip to about 16 kB: the line is refused once 200x the file is read
    (3.2 MB), not held whole."""
    folder = write_cuts(tmp_path / "shar", [cut(0), b'{"id": "cut-1",' + b" " * (16 << 20) + b"}\n"])
    tracemalloc.start()
    try:
        with pytest.raises(ShardError) as error:
            shar_index(folder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20
    assert "cuts.000000.jsonl.gz at byte" in str(error.value)
    assert "line 2 is not read: it inflates beyond" in str(error.value)


def test_a_line_longer_than_the_line_bound_is_refused(tmp_path, monkeypatch):
    from seqshard.formats import inflation

    monkeypatch.setattr(inflation, "MAX_LINE_BYTES", 1000)
    folder = write_cuts(tmp_path / "shar", [cut(0), cut(1, note="x" * 2000)], name="cuts.000000.jsonl")
    with pytest.raises(ShardError, match=r"jsonl at byte \d+: line 2 is not read: a line is longer than 1000 bytes"):
        shar_index(folder)


# ---------------------------------------------------------------------------------------------
# other files seqshard reads: a pack's plan and run, list files, units files


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"groups": []}', r"not a pack's plan"),
        (
            b'{"groups": {"": [["data-00009.tar", "x"]]}}',
            r"the utterances of data-00009\.tar is 'x', not a whole number",
        ),
        (
            b'{"groups": {"": [["data-00009.tar", 1e300]]}}',
            r"the utterances of data-00009\.tar is 1e\+300, not a whole number",
        ),
        (b'{"groups": {"": [["data-00009.tar", 10, 3]]}}', r"a planned shard is \['data-00009.tar', 10, 3\]"),
        (b"\xff", r"not UTF-8 text \(byte 0\)"),
        (b"[" * 100000, r"its lists or objects nest deeper"),
    ],
)
def test_a_hostile_plan_of_an_unfinished_pack_is_named(one_shard, tmp_path, content, message):
    copy = tmp_path / "copy"
    shutil.copytree(one_shard, copy)
    (copy / "index.json").unlink()  # a pack that has not finished: the loader reads its plan
    (copy / ".seqshard-pack" / "planned.json").write_bytes(content)
    with pytest.raises(SeqshardError, match=rf"planned\.json: {message}.* pack again into a new folder"):
        make_loader(copy, batch_size=2, num_workers=0)


def test_a_hostile_index_list_units_or_run_file_is_named(one_shard, tmp_path):
    from seqshard.errors import ConfigError
    from seqshard.formats.peers.lists import shard_list
    from seqshard.text.tokenizers import UnitsTokenizer
    from seqshard.tools.reindex import rebuild_index

    copy = tmp_path / "copy"
    shutil.copytree(one_shard, copy)
    for content in (b"\xff{", b"[" * 100000):
        (copy / "index.json").write_bytes(content)
        with pytest.raises(
            InputError, match=r"index\.json: (not UTF-8|its lists).* Fix: rebuild it with `seqshard index"
        ):
            ShardIndex.load(copy)
    (tmp_path / "a.list").write_bytes(b"\xff\xfeshard.tar\n")
    with pytest.raises(ConfigError, match=r"a\.list: not UTF-8 text"):
        shard_list(tmp_path / "a.list")
    for unit_id in ("\u00b2", "-5", "9" * 5000):
        (tmp_path / "units.txt").write_text(f"<unk> 0\na {unit_id}\n")
        with pytest.raises(ConfigError, match=r"units\.txt:2: expected 'TOKEN ID' with an ID from 0 to 2147483647"):
            UnitsTokenizer(tmp_path / "units.txt")
    (copy / ".seqshard-pack" / "run.json").write_text('["not", "a", "run"]')
    with pytest.raises(InputError, match=r"run\.json: holds \['not', 'a', 'run'\], not a JSON object"):
        rebuild_index(copy, progress=False)


@pytest.mark.parametrize("content", ["nan\n", "0\n", "x\n", "inf"])
def test_a_hostile_kaldi_frame_shift_file_is_named_not_written_into_the_index(tmp_path, content):
    """It was read as NaN or 0 ms into index.json (which its own loader then refused), or
    silently taken as 10 ms."""
    from conftest import write_kaldi_dir
    from seqshard import pack_data
    from seqshard.errors import ConfigError

    data = write_kaldi_dir(tmp_path / "k", speakers=1, per_speaker=2, dim=2, frames=(2, 4))
    (data.root / "frame_shift").write_text(content)
    with pytest.raises(ConfigError, match=r"frame_shift: .* is not a frame shift in seconds"):
        pack_data(data.scp, data.text, tmp_path / "out", progress=False)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("bytes", "x", r"bytes is 'x', not a whole number"),
        ("num_utts", 10**9, r"num_utts is 1000000000 but bytes is \d+: a shard holds at most one sample per 512"),
        ("name", "../data-01234.tar", r"is named '\.\./data-01234\.tar', not a plain file name"),
        ("length_hist", "zero-padded", None),  # bins not as seqshard writes them ("07"), still numbers: read
    ],
)
def test_a_hostile_entry_deep_in_a_large_index_is_named_as_in_a_small_one(one_shard, tmp_path, field, value, message):
    """An index of many entries is checked in bulk, and read again entry by entry only to name
    a bad one; its table (index.npz, written before the edit) is not read instead."""
    folder = tmp_path / "large"
    folder.mkdir()
    data = json.loads((one_shard / "index.json").read_text())
    entry = data["shards"][0]
    data["shards"] = [{**entry, "name": f"data-{n:05d}.tar", "checksum": f"crc32:{n:08x}"} for n in range(1500)]
    ShardIndex.from_json(data, folder, "test").save(folder)
    assert (folder / "index.npz").is_file()
    if value == "zero-padded":
        value = {f"0{bin_}": count for bin_, count in entry["length_hist"].items()}
    data["shards"][1234][field] = value
    (folder / "index.json").write_text(json.dumps(data))
    if message is None:
        found = ShardIndex.load(folder).entry("data-01234.tar").length_hist
        assert found == {int(bin_): count for bin_, count in entry["length_hist"].items()}
        return
    with pytest.raises(SeqshardError, match=rf"large/index\.json: shard entry 1234( \(data-01234\.tar\))?:? {message}"):
        ShardIndex.load(folder)


# ---------------------------------------------------------------------------------------------
# Damaged JSON files: one reader, one error (the file, the line, the fix) on every route


def _pack_again(copy, packed, tokens):
    pack_data(packed.data.scp, packed.data.text, copy, utts_per_file=TEN, progress=False)


def _unfinished(copy, packed, tokens):
    for name in ("index.json", "index.npz"):
        (copy / name).unlink(missing_ok=True)
    make_loader(copy, batch_size=2, num_workers=0)


def _remote_groups(copy, packed, tokens):
    from http_server import ShardServer

    for name in ("index.json", "index.npz"):
        (copy / name).unlink(missing_ok=True)
    with ShardServer(copy.parent) as server:
        make_loader(f"{server.url}/copy/", batch_size=2, num_workers=0)


def _token_meta(copy, packed, tokens):
    for suffix in (".bin", ".idx"):
        shutil.copy(tokens.with_suffix(suffix), copy / f"PREFIX{suffix}")
    TokenDataset(copy / "PREFIX").meta  # noqa: B018


@pytest.mark.parametrize(
    ("name", "route"),
    [
        (".seqshard-pack/run.json", _pack_again),  # a raw JSONDecodeError before
        ("pack_report.json", _remote_groups),  # before: no shards found, the damage unsaid
        (".seqshard-pack/run.json", lambda copy, *_: rebuild_index(copy, progress=False)),
        (".seqshard-pack/planned.json", _unfinished),
        ("index.json", lambda copy, *_: ShardIndex.load(copy)),
        ("b.json", lambda copy, *_: make_loader(str(copy), budgets=str(copy / "b.json"))),
        ("cmvn.json", lambda copy, *_: Cmvn.load(copy / "cmvn.json")),
        ("PREFIX.json", _token_meta),
    ],
)
def test_a_damaged_json_file_is_named_with_its_line_and_the_fix(one_pack, tokens, tmp_path, name, route):
    copy = tmp_path / "copy"
    shutil.copytree(one_pack.out, copy)
    (copy / name).write_bytes(b'{"format": 1,\n oops')
    with pytest.raises(InputError, match=rf"{Path(name).name}:2: not JSON \(.*, column 2\)\. Fix: \w") as error:
        route(copy, one_pack, tokens)
    assert error.value.reason == "bad_json" and not error.value.skippable


def test_a_matrix_too_wide_to_be_a_feature_vector_is_refused_by_pack(tmp_path):
    """feature dim is checked where pack learns it, so pack never writes an index it would refuse."""
    data = write_kaldi_dir(tmp_path / "k", speakers=1, per_speaker=2, dim=2, frames=(2, 4))
    with kaldiio.WriteHelper(f"ark,scp:{tmp_path / 'wide.ark'},{tmp_path / 'wide.scp'}") as writer:
        for key in data.arrays:
            writer[key] = np.zeros((1, (1 << 20) + 1), dtype=np.float32)
    with pytest.raises(InputError, match=r"wide\.scp:1 .*1048577 columns, more than the 1048576 .* Fix: check"):
        pack_data(tmp_path / "wide.scp", data.text, tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "index.json").exists()
