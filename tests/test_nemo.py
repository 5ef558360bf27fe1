"""NeMo manifests and tarred sets: read directly by the loader, packed by `pack --manifest`,
checked on tests/realdata/nemo (a manifest over the real recordings of tests/realdata/audio,
and a tarred set that NeMo's own convert_to_tarred_audio_dataset.py wrote from them)."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile

from conftest import read_audio_shards
from seqshard import make_loader
from seqshard.errors import ConfigError, InputError, SeqshardError, ShardError
from seqshard.formats.peers.nemo_tarred import NemoTarStream, nemo_shard_of
from seqshard.formats.streams import open_samples
from seqshard.prep.pack import pack_data
from seqshard.tools.reindex import rebuild_index

REALDATA = Path(__file__).parent / "realdata"
MANIFEST = REALDATA / "nemo" / "train_manifest.json"
TARRED = REALDATA / "nemo" / "tarred"
AMI = REALDATA / "audio" / "ami" / "ES2011a.Headset-0-40s-46s.wav"
MANIFEST_KEYS = [
    "3_jackson_1",
    "7_jackson_1",
    "ES2011a.Headset-0-40s-46s-000146-000136",  # a cut: STEM-OFFSET-DURATION in 1/100 s, as NeMo's Lhotse adapter
    "ES2011a.Headset-0-40s-46s-000336-000100",
    "2412-153948-0000",
]


def entries(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_all(pattern, **options) -> dict[str, dict]:
    loader = make_loader(pattern, batch_size=1, num_workers=0, shuffle=False, **options)
    found = {}
    for batch in loader:
        key = batch["keys"][0]
        assert key not in found
        found[key] = {
            "text": batch["texts"][0],
            "audio": batch["audio"][0, : batch["audio_lens"][0]].numpy(),
            "rate": int(batch["sample_rate"][0]),
            "speaker": batch.get("speaker", [None])[0],
        }
    return found


def ami_cut(start: float, end: float) -> np.ndarray:
    samples, rate = soundfile.read(AMI, dtype="float32")
    return samples[round(start * rate) : round(end * rate)]


def test_loader_reads_a_manifest_as_nemo_does():
    read = read_all(str(MANIFEST))
    assert sorted(read) == sorted(MANIFEST_KEYS)
    for entry, key in zip(entries(MANIFEST), MANIFEST_KEYS):
        assert read[key]["text"] == entry["text"] and read[key]["speaker"] == entry["speaker"]
        if "offset" in entry:  # NeMo reads `duration` seconds from `offset`
            expected = ami_cut(entry["offset"], entry["offset"] + entry["duration"])
            np.testing.assert_array_equal(read[key]["audio"], expected)
        else:
            assert len(read[key]["audio"]) == round(entry["duration"] * read[key]["rate"])


def test_pack_manifest_keeps_texts_cuts_and_asked_fields(tmp_path):
    report = pack_data(
        None, None, tmp_path / "out", manifest=MANIFEST, escape_keys=True, fields="speaker", progress=False
    )
    assert (report.input_utts, report.packed, report.dropped) == (5, 5, {})
    found = read_audio_shards(sorted((tmp_path / "out").glob("*.tar")))
    assert sorted(found) == sorted(k.replace(".", "%2E") for k in MANIFEST_KEYS)
    cut = found["ES2011a%2EHeadset-0-40s-46s-000336-000100"]
    np.testing.assert_array_equal(cut[0], np.round(ami_cut(3.36, 4.36) * 32768).astype(np.int16))
    assert cut[3] == "YOU CAN CALL ME ABBIE"
    with tarfile.open(next((tmp_path / "out").glob("*.tar"))) as tar:
        speakers = {m.name: tar.extractfile(m).read() for m in tar if m.name.endswith(".speaker.json")}
    assert speakers["7_jackson_1.speaker.json"] == b'"jackson"' and len(speakers) == 5


def test_pack_manifest_lengths_come_from_durations(tmp_path):
    """Length groups are planned from the manifest's durations, without reading audio: a
    duration that disagrees with the whole file is caught when the audio is read."""
    lines = entries(MANIFEST)[:2]
    lines[1]["duration"] = 9.0  # 7_jackson_1 lasts 0.47 s
    manifest = tmp_path / "m.json"
    manifest.write_text(
        "".join(json.dumps({**e, "audio_filepath": str(MANIFEST.parent / e["audio_filepath"])}) + "\n" for e in lines)
    )
    report = pack_data(
        None, None, tmp_path / "out", manifest=manifest, filter_group=["0:1", "1:20"], skip_bad=True, progress=False
    )
    assert report.input_utts == report.packed + sum(report.dropped.values())
    assert report.groups["0_1"].utts == 1 and report.dropped == {"duration_mismatch": 1}


def test_several_manifests_and_nemo_braces(tmp_path):
    for number, entry in enumerate(entries(MANIFEST)[:2]):
        entry["audio_filepath"] = str(MANIFEST.parent / entry["audio_filepath"])
        (tmp_path / f"manifest_{number}.json").write_text(json.dumps(entry) + "\n")
    pattern = str(tmp_path / "manifest__OP_0..1_CL_.json")
    report = pack_data(None, None, tmp_path / "out", manifest=pattern, progress=False)
    assert report.packed == 2
    assert sorted(read_all(pattern)) == ["3_jackson_1", "7_jackson_1"]
    with pytest.raises(ConfigError, match=r"manifest_2\.json does not exist"):
        pack_data(None, None, tmp_path / "o2", manifest=str(tmp_path / "manifest__OP_0..2_CL_.json"), progress=False)


def test_manifest_errors_name_the_line(tmp_path):
    manifest = tmp_path / "bad.json"
    manifest.write_text('{"audio_filepath": "a.wav", "text": "x"}\n')
    with pytest.raises(InputError, match=r"bad.json:1.*\"duration\" must be a positive number"):
        pack_data(None, None, tmp_path / "out", manifest=manifest, progress=False)
    with pytest.raises(ConfigError, match="texts come from the manifest"):
        pack_data(None, MANIFEST, tmp_path / "out", manifest=MANIFEST, progress=False)
    with pytest.raises(ConfigError, match="manifest of a NeMo tarred set"):
        make_loader(str(TARRED / "tarred_audio_manifest.json"), batch_size=1, num_workers=0)


def test_tarred_set_joins_transcripts_by_shard_id():
    """Each tar's samples get their entry's text, cut and fields; the second cut of the AMI
    recording is its `-sub1` entry, stored once in the tar (NeMo's rule)."""
    read = read_all(str(TARRED))
    tarred = entries(TARRED / "tarred_audio_manifest.json")
    assert sorted(read) == sorted(e["audio_filepath"].rsplit(".", 1)[0] for e in tarred)
    assert read["ami_ES2011a_Headset-0-40s-46s-sub1"]["text"] == "YOU CAN CALL ME ABBIE"
    for key, (start, end) in {
        "ami_ES2011a_Headset-0-40s-46s": (1.46, 2.82),
        "ami_ES2011a_Headset-0-40s-46s-sub1": (3.36, 4.36),
    }.items():
        np.testing.assert_array_equal(read[key]["audio"], ami_cut(start, end))  # the tar holds it as FLAC
    assert {read[k]["speaker"] for k in read} == {"jackson", "H01", "H02"}


def test_tarred_set_without_sharded_manifests_and_by_pattern(tmp_path):
    copy = tmp_path / "set"
    shutil.copytree(TARRED, copy)
    shutil.rmtree(copy / "sharded_manifests")
    assert nemo_shard_of(copy / "audio_1.tar") == (1, copy / "tarred_audio_manifest.json")
    assert sorted(read_all(str(copy / "audio__OP_0..1_CL_.tar"))) == sorted(read_all(str(TARRED)))


def test_tarred_stream_resumes_at_every_sample():
    """A sample's offset is its member's header plus its place among the member's cuts."""
    shard, manifest = nemo_shard_of(TARRED / "audio_1.tar")
    with NemoTarStream(TARRED / "audio_1.tar", shard, manifest) as stream:
        positions, keys = [], []
        while True:
            positions.append((stream.resume_offset, stream.ordinal))
            sample = stream.next_sample()
            if sample is None:
                break
            keys.append(sample.key)
    assert len(keys) == 3 and len({p for p, _ in positions}) == 4
    for number, (offset, ordinal) in enumerate(positions):
        with open_samples(str(TARRED / "audio_1.tar"), offset, ordinal) as stream:
            rest = [s.key for s in iter(stream.next_sample, None)]
        assert rest == keys[number:] and stream.ordinal == 3


def test_index_records_manifest_durations(tmp_path):
    copy = tmp_path / "set"
    shutil.copytree(TARRED, copy)
    rebuild_index(copy, progress=False)
    index = json.loads((copy / "index.json").read_text())
    tarred = entries(TARRED / "tarred_audio_manifest.json")
    for shard in index["shards"]:
        mine = [e for e in tarred if f"audio_{e['shard_id']}.tar" == shard["name"]]
        assert shard["num_utts"] == len(mine)
        assert shard["num_frames"] == sum(round(e["duration"] * 100) for e in mine)
    assert sorted(read_all(str(copy))) == sorted(read_all(str(TARRED)))


def test_tarred_set_refuses_a_member_named_twice(tmp_path):
    data = io.BytesIO()
    soundfile.write(data, np.zeros(800, np.int16), 8000, format="WAV")
    with tarfile.open(tmp_path / "audio_0.tar", "w") as tar:
        for _ in range(2):
            info = tarfile.TarInfo("a.wav")
            info.size = len(data.getvalue())
            tar.addfile(info, io.BytesIO(data.getvalue()))
    entry = {"audio_filepath": "a.wav", "duration": 0.1, "text": "x", "shard_id": 0}
    (tmp_path / "tarred_audio_manifest.json").write_text(json.dumps(entry) + "\n")
    with open_samples(str(tmp_path / "audio_0.tar")) as stream:
        assert stream.next_sample().key == "a"
        with pytest.raises(ShardError, match=r"'a\.wav' is in the tar twice"):
            stream.next_sample()


def write_tarred(folder: Path, members: list[str], manifest: list[str]) -> None:
    """A one-tar NeMo set: ``members`` (0.1 s WAVs) in audio_0.tar, entries naming ``manifest``."""
    data = io.BytesIO()
    soundfile.write(data, np.zeros(800, np.int16), 8000, format="WAV")
    with tarfile.open(folder / "audio_0.tar", "w") as tar:
        for name in members:
            info = tarfile.TarInfo(name)
            info.size = len(data.getvalue())
            tar.addfile(info, io.BytesIO(data.getvalue()))
    lines = [json.dumps({"audio_filepath": n, "duration": 0.1, "text": n, "shard_id": 0}) for n in manifest]
    (folder / "tarred_audio_manifest.json").write_text("\n".join(lines) + "\n")


def test_tarred_member_without_entry_is_passed_over_and_said(tmp_path, caplog):
    write_tarred(tmp_path, ["a.wav", "b.wav"], ["b.wav"])
    assert list(read_all(str(tmp_path))) == ["b"]
    assert "1 member without an entry" in caplog.text


def test_tarred_entry_without_member_is_a_damaged_shard(tmp_path):
    write_tarred(tmp_path, ["a.wav"], ["a.wav", "gone.wav"])
    with pytest.raises(ShardError, match=r"holds 1 samples where its index\.json says 2"):
        read_all(str(tmp_path))
    loader = make_loader(str(tmp_path), batch_size=1, num_workers=0, skip_bad=True, max_bad_shards=1.0)
    assert sum(len(b["keys"]) for b in loader) + loader.stats()["dropped"]["damaged"] == 2


@pytest.mark.parametrize("field", ["duration", "offset"])
def test_a_duration_beyond_int32_frames_is_a_malformed_line_not_an_overflow(tmp_path, field):
    """Lengths are int32 counts of 10 ms frames: 1e15 s in a tarred set's manifest ended in an
    OverflowError when the loader planned it."""
    copy = tmp_path / "set"
    shutil.copytree(TARRED, copy)
    for manifest in [copy / "tarred_audio_manifest.json", *(copy / "sharded_manifests").glob("*.json")]:
        lines = entries(manifest)
        lines[0][field] = 1e15
        manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(
        ShardError, match=rf'"{field}" must be a .*number of seconds .* 21474836 \(found 1000000000000000'
    ):
        make_loader(str(copy), batch_size=2, num_workers=0)


@pytest.mark.parametrize("sharded", [True, False])
def test_a_tar_the_manifest_names_but_the_folder_lacks_is_a_missing_shard_not_fewer_samples(tmp_path, sharded):
    """audio_1.tar removed: 3 of 6 entries were served with nothing said (missing_shards 0)."""
    copy = tmp_path / "set"
    shutil.copytree(TARRED, copy)
    (copy / "audio_1.tar").unlink()
    if not sharded:
        shutil.rmtree(copy / "sharded_manifests")
    with pytest.raises(ShardError, match=r"audio_1\.tar \(its shard id has entries in the folder's NeMo manifest"):
        make_loader(str(copy), batch_size=2, num_workers=0)
    loader = make_loader(str(copy), batch_size=2, num_workers=0, skip_bad=True, max_bad_shards=0.5)
    assert sum(len(batch["keys"]) for batch in loader) == 3
    assert loader.stats()["missing_shards"] == 1
    with pytest.raises(ConfigError, match=r"entries of 1 tar the folder lacks \(audio_1\.tar\)"):
        rebuild_index(copy, progress=False)


@pytest.mark.parametrize("skip_bad", [False, True])
def test_a_tarred_entry_listed_twice_is_refused_naming_the_manifest_and_its_lines(tmp_path, skip_bad):
    """An entry listed twice was read twice each epoch (3 samples, 2 distinct), with and
    without skip_bad, and `seqshard index` took it. NeMo makes a sample of every entry naming
    a member, so it would read it twice: seqshard refuses, as it refuses a list's repeated keys."""
    write_tarred(tmp_path, ["a.wav", "b.wav"], ["a.wav", "b.wav", "a.wav"])
    repeated = r"tarred_audio_manifest\.json: lines 1 and 3 are both sample 'a' of shard 0 \('a\.wav'\).*remove the"
    with pytest.raises(ShardError, match=repeated):
        make_loader(str(tmp_path), batch_size=1, num_workers=0, skip_bad=skip_bad, max_bad_shards=1.0)
    with pytest.raises(ShardError, match=repeated):
        rebuild_index(tmp_path, progress=False)
    assert not (tmp_path / "index.json").exists()


def test_two_members_with_one_file_id_are_refused(tmp_path):
    """a.wav and a.flac are both NeMo's file id 'a': two samples of one key."""
    write_tarred(tmp_path, ["a.wav", "a.flac"], ["a.wav", "a.flac"])
    with pytest.raises(ShardError, match=r"lines 1 and 2 are both sample 'a' of shard 0 \('a\.flac'\)"):
        make_loader(str(tmp_path), batch_size=1, num_workers=0)


@pytest.mark.parametrize("copied", [True, False])
def test_a_sharded_manifest_holding_another_shards_entries_names_the_manifest(tmp_path, copied):
    """manifest_0.json holding shard 1's entries blamed the audio options ("these hold:
    unknown"); one stray entry of shard 1 in it was silently left out."""
    copy = tmp_path / "set"
    shutil.copytree(TARRED, copy)
    sharded = copy / "sharded_manifests"
    if copied:
        shutil.copy(sharded / "manifest_1.json", sharded / "manifest_0.json")
    else:
        with open(sharded / "manifest_0.json", "a") as manifest:
            manifest.write((sharded / "manifest_1.json").read_text().splitlines()[0] + "\n")
    line = 1 if copied else 4
    with pytest.raises(
        ShardError,
        match=rf"manifest_0\.json: line {line} is an entry of shard 1 \('fsdd_3_jackson_1\.wav'\), but this sharded "
        r"manifest is the one of shard 0.*Fix: write it again",
    ):
        make_loader(str(copy), batch_size=2, num_workers=0, resample_to=16000, skip_bad=True)
    with pytest.raises(ShardError, match="is an entry of shard 1"):
        rebuild_index(copy, progress=False)


def test_two_tars_of_one_shard_id_are_refused(tmp_path):
    """audio_1.tar and audio_01.tar are both shard 1 by NeMo's rule: each entry of shard 1
    was read from both."""
    copy = tmp_path / "set"
    shutil.copytree(TARRED, copy)
    shutil.copy(copy / "audio_1.tar", copy / "audio_01.tar")
    with pytest.raises(ShardError, match=r"audio_01\.tar and audio_1\.tar are both the tar of shard 1"):
        make_loader(str(copy), batch_size=2, num_workers=0, skip_bad=True)
    with pytest.raises(ShardError, match="both the tar of shard 1"):
        rebuild_index(copy, progress=False)


@pytest.mark.parametrize("shard_id", [-1, True, "0", 0.5])
def test_a_shard_id_that_is_not_a_tar_number_names_the_line(tmp_path, shard_id):
    write_tarred(tmp_path, ["a.wav", "b.wav"], ["a.wav", "b.wav"])
    manifest = tmp_path / "tarred_audio_manifest.json"
    lines = entries(manifest)
    lines[1]["shard_id"] = shard_id
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ShardError, match=r'tarred_audio_manifest\.json: line 2: the line has no "shard_id" number'):
        make_loader(str(tmp_path), batch_size=1, num_workers=0)


def test_keys_made_from_file_names_are_escaped_without_being_asked(tmp_path):
    """ES2011a.Headset-0.wav failed to pack without --escape-keys, though the key is the file's
    stem, which seqshard made: such keys are stored percent-encoded (the index says so), and
    the loader shows the keys it shows when it reads the manifest itself."""
    shutil.copy(AMI, tmp_path / "ES2011a.Headset-0.wav")
    lines = [
        {"audio_filepath": "ES2011a.Headset-0.wav", "offset": 1.46, "duration": 1.36, "text": "one"},
        {"audio_filepath": "ES2011a.Headset-0.wav", "duration": 6.0, "text": "all"},
        {"audio_filepath": "ES2011a.Headset-0.wav", "duration": 6.0, "text": "by id", "id": "a.b/c"},
    ]
    manifest = tmp_path / "m.json"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = pack_data(None, None, tmp_path / "out", manifest=str(manifest), progress=False)
    assert (report.packed, report.dropped) == (3, {})
    assert json.loads((tmp_path / "out" / "index.json").read_text())["keys"] == {"escaped": True}
    stored = read_audio_shards(sorted((tmp_path / "out").glob("*.tar")))
    assert sorted(stored) == ["ES2011a%2EHeadset-0", "ES2011a%2EHeadset-0-000146-000136", "a%2Eb%2Fc"]
    direct, packed = read_all(str(manifest)), read_all(str(tmp_path / "out"))
    assert sorted(direct) == sorted(packed) == ["ES2011a.Headset-0", "ES2011a.Headset-0-000146-000136", "a.b/c"]
    assert {k: v["text"] for k, v in direct.items()} == {k: v["text"] for k, v in packed.items()}


def long_line_manifest(path: Path, long_line: bytes | None = None) -> Path:
    """A manifest of three whole-file entries whose second line is ``long_line`` (a line of
    70 MB, most of it a hole in a sparse file, when None)."""
    good = [{**e, "audio_filepath": str(MANIFEST.parent / e["audio_filepath"])} for e in entries(MANIFEST)[:2]]
    with open(path, "wb") as manifest:
        manifest.write(json.dumps(good[0]).encode() + b"\n")
        if long_line is None:
            manifest.write(b'{"text": "')
            manifest.seek(70 << 20, io.SEEK_CUR)
            manifest.write(b'"}\n')
        else:
            manifest.write(long_line + b"\n")
        manifest.write(json.dumps(good[1]).encode() + b"\n")
    return path


def test_a_manifest_line_beyond_the_line_bound_is_a_malformed_line_in_pack(tmp_path):
    """A 1.6 GB manifest line was a bare MemoryError in pack: it is a malformed line (named,
    or counted with skip_bad), passed over without being held (here 70 MB against 64 MiB)."""
    manifest = long_line_manifest(tmp_path / "m.json")
    with pytest.raises(InputError, match=r"m\.json:2.*a line is longer than 67108864 bytes"):
        pack_data(None, None, tmp_path / "out", manifest=str(manifest), progress=False)
    report = pack_data(None, None, tmp_path / "skip", manifest=str(manifest), skip_bad=True, progress=False)
    assert (report.input_utts, report.packed, report.dropped) == (3, 2, {"malformed_line": 1})


def test_a_manifest_line_beyond_the_line_bound_is_a_bad_sample_in_the_loader(tmp_path, monkeypatch):
    from seqshard.formats import inflation

    monkeypatch.setattr(inflation, "MAX_LINE_BYTES", 4096)
    manifest = long_line_manifest(tmp_path / "m.json", b'{"text": "' + b"x" * 100_000 + b'"}')
    with pytest.raises(InputError, match=r"m\.json sample 2.*a line is longer than 4096 bytes"):
        read_all(str(manifest))
    loader = make_loader(str(manifest), batch_size=1, num_workers=0, shuffle=False, skip_bad=True)
    assert [k for batch in loader for k in batch["keys"]] == ["3_jackson_1", "7_jackson_1"]
    assert loader.stats()["dropped"] == {"malformed_line": 1}
    first = tmp_path / "first.json"
    first.write_bytes(b'{"text": "' + b"x" * 100_000 + b'"}\n')
    with pytest.raises(ConfigError, match=r"first\.json line 1: a line is longer than 4096 bytes"):
        make_loader(str(first), batch_size=1, num_workers=0)


def test_a_tarred_manifest_line_beyond_the_line_bound_names_the_line(tmp_path, monkeypatch):
    from seqshard.formats import inflation

    monkeypatch.setattr(inflation, "MAX_LINE_BYTES", 4096)
    write_tarred(tmp_path, ["a.wav", "b.wav"], ["a.wav", "b.wav"])
    manifest = tmp_path / "tarred_audio_manifest.json"
    lines = entries(manifest)
    lines[1]["text"] = "x" * 100_000
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ShardError, match=r"tarred_audio_manifest\.json: line 2: a line is longer than 4096 bytes"):
        make_loader(str(tmp_path), batch_size=1, num_workers=0, skip_bad=True)


NEMO_PATTERNS = {  # a manifest path as NeMo's expand_sharded_filepaths expands it
    "m_{0..1}.json": ["m_0.json", "m_1.json"],
    "m__OP_0..1_CL_.json": ["m_0.json", "m_1.json"],
    "m_(0..1).json": ["m_0.json", "m_1.json"],
    "m_[0..1].json": ["m_0.json", "m_1.json"],
    "m_<0..1>.json": ["m_0.json", "m_1.json"],
    "m_(0,1).json": ["m_0.json", "m_1.json"],
    "m_[0,1]_<a,b>.json": ["m_0_a.json", "m_0_b.json", "m_1_a.json", "m_1_b.json"],
    "m_{00..01}.json": ["m_00.json", "m_01.json"],
    "m_(0..1]_x.json": ["m_0_x.json", "m_1_x.json"],
    "m__OP_a,b_CL__(1..2).json": ["m_a_1.json", "m_a_2.json", "m_b_1.json", "m_b_2.json"],
    "m_0.json": ["m_0.json"],
    "m\\_(0,1).json": ["m\\_0.json", "m\\_1.json"],  # no escapes: a backslash is part of the name
}


def test_manifest_paths_expand_as_nemo_expands_them(tmp_path, monkeypatch):
    """NeMo reads (…), […] and <…> as braces too, and expands without escapes: 4 of these 12
    agreed before (the others named files that do not exist)."""
    from seqshard.formats.peers.nemo import manifest_files

    monkeypatch.chdir(tmp_path)
    audio = str(MANIFEST.parent / entries(MANIFEST)[0]["audio_filepath"])
    for name in {name for names in NEMO_PATTERNS.values() for name in names}:
        Path(name).write_text(json.dumps({"audio_filepath": audio, "duration": 0.4695, "text": name, "id": name}))
    for pattern, names in NEMO_PATTERNS.items():
        assert manifest_files(pattern) == [Path(name) for name in names], pattern
    assert pack_data(None, None, "out", manifest="m_(0..1]_x.json", progress=False).packed == 2
    with pytest.raises(ConfigError, match=r"manifest='m_\*\.json': m_\*\.json does not exist.*wildcards are not"):
        manifest_files("m_*.json")
    with pytest.raises(ConfigError, match=r"manifest=.*expands to 100,000,000 alternatives, more than the"):
        manifest_files("manifest__OP_0..99999999_CL_.json")


def test_add_field_refuses_a_tarred_set_whose_fields_are_its_manifests_keys(tmp_path):
    """add-field read a tarred set's tars as plain tars: one sample per member (a file cut by
    -sub1 entries is one), keyed up to the first '.', so its sidecars matched no sample."""
    from seqshard.prep.add_field import add_field

    copy = tmp_path / "set"
    shutil.copytree(TARRED, copy)
    rebuild_index(copy, progress=False)
    source = tmp_path / "spk.txt"
    source.write_text("".join(f"{key} x\n" for key in read_all(str(copy))))
    with pytest.raises(ConfigError, match=r"set is a NeMo tarred set: .*add the field to the entries of its manifests"):
        add_field(copy, "spk", source, progress=False)
    assert not (copy / "fields").exists()


def test_an_entry_past_the_end_of_its_recording_points_at_the_manifest(tmp_path):
    """A manifest entry whose offset + duration runs past its file: the fix names the manifest's
    offset and duration (it said 'fix the segments file'); skipped and counted under skip_bad."""
    shutil.copy(AMI, tmp_path / "rec.wav")
    lines = [
        {"audio_filepath": "rec.wav", "offset": 1.0, "duration": 1.0, "text": "fits"},
        {"audio_filepath": "rec.wav", "offset": 1.0, "duration": 3600.0, "text": "past the end"},
    ]
    manifest = tmp_path / "m.json"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(
        InputError, match=r"m\.json:2 .*runs past the end of its recording.* Fix: fix the entry's offset"
    ):
        pack_data(None, None, tmp_path / "out", manifest=str(manifest), progress=False)
    report = pack_data(None, None, tmp_path / "kept", manifest=str(manifest), skip_bad=True, progress=False)
    assert (report.packed, report.dropped) == (1, {"bad_segment": 1})
    with pytest.raises(
        SeqshardError, match=r"runs past the end of its recording.* a manifest entry's offset and duration"
    ):
        read_all(str(manifest))  # the loader reading the manifest itself
