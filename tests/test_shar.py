"""Lhotse Shar folders read as one dataset (issue 16 #6): one sample per cut, the field files
read in lock step, checked against lhotse's own reader (``CutSet.from_shar``) on the realdata
folder and on folders written here by lhotse's ``SharWriter``.

The walk-through docs/from-lhotse.md is run here too (its ``python`` blocks, and its ``sh``
lines that call ``seqshard``), by a small runner of this file's own.
"""

import io
import json
import re
import shlex
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import soundfile

from conftest import files_opened
from gloo_ranks import run_ranks
from seqshard import make_loader
from seqshard.cli import main
from seqshard.errors import ConfigError, InputError, ShardError
from seqshard.formats.fields import AudioBytes
from seqshard.formats.npy import npy_parts
from seqshard.formats.selection import select_shards
from seqshard.formats.table import ShardInfo, ShardTable
from seqshard.formats.tar import ShardWriter
from seqshard.pipeline.epoch_plan import Unit
from seqshard.pipeline.stages.fieldplan import plan_fields
from seqshard.pipeline.stages.reader import ShardReader
from seqshard.testing import assert_resumes_everywhere

ROOT = Path(__file__).parent.parent
LSMIX = ROOT / "tests/realdata/lhotse-shar/lsmix"
CUTS = ["cuts.000000.jsonl.gz", "cuts.000001.jsonl.gz", "cuts.000002.jsonl.gz"]


def make_cuts(count: int, without: dict[str, set[str]] | None = None, seed: int = 0) -> list:
    """Cuts with real FLAC audio, features, an alignment array and a speaker number, and two
    supervisions each, the later one first; ``without`` names the cuts that lack a field."""
    from lhotse import AudioSource, Features, MonoCut, Recording, SupervisionSegment
    from lhotse.features.io import MemoryRawWriter

    without = without or {}
    rng = np.random.default_rng(seed)
    cuts = []
    for i in range(count):
        cut_id = "utt-003.x" if i == 3 else f"utt-{i:03d}"  # a '.' in an id: lhotse keeps it
        seconds = round(0.2 + 0.05 * (i % 5), 2)
        frames = round(seconds * 100)
        audio = io.BytesIO()
        soundfile.write(
            audio, (rng.standard_normal(int(16000 * seconds)) * 0.1).astype(np.float32), 16000, format="FLAC"
        )
        source = AudioSource(type="memory", channels=[0], source=audio.getvalue())
        recording = Recording(f"rec{i}", [source], 16000, int(16000 * seconds), seconds)
        supervisions = [
            SupervisionSegment(f"s{i}b", recording.id, seconds / 2, seconds / 2, text=f" later {i}"),
            SupervisionSegment(f"s{i}a", recording.id, 0.0, seconds / 2, text=f"first {i} "),
        ]
        cut = MonoCut(cut_id, 0.0, seconds, 0, recording=recording, supervisions=supervisions)
        if cut_id not in without.get("features", ()):
            array = rng.standard_normal((frames, 8)).astype(np.float32)
            cut.features = Features(
                type="fbank",
                num_frames=frames,
                num_features=8,
                frame_shift=0.01,
                sampling_rate=16000,
                start=0.0,
                duration=seconds,
                storage_type=MemoryRawWriter.name,
                storage_path="",
                storage_key=MemoryRawWriter().write(cut_id, array),
                recording_id=recording.id,
                channels=0,
            )
        if cut_id not in without.get("ali", ()):
            cut = cut.attach_tensor("ali", (np.arange(frames) % 7).astype(np.int32), frame_shift=0.01, temporal_dim=0)
        if cut_id not in without.get("speaker", ()):
            cut.custom = {**(cut.custom or {}), "speaker": 100 + i}
        cuts.append(cut)
    return cuts


def write_shar(folder: Path, cuts: list, shard_size: int = 4) -> Path:
    from lhotse.shar import SharWriter

    folder.mkdir(parents=True)
    fields = {"recording": "flac", "features": "numpy", "ali": "numpy", "speaker": "jsonl"}
    with SharWriter(folder, fields=fields, shard_size=shard_size) as writer:
        for cut in cuts:
            writer.write(cut)
    return folder


@dataclass
class Shar:
    folder: Path
    cuts: dict  # cut id -> the cut as CutSet.from_shar reads it back


def read_by_lhotse(folder: Path) -> dict:
    from lhotse import CutSet

    return {cut.id: cut for cut in CutSet.from_shar(in_dir=folder)}


@pytest.fixture(scope="module")
def shar(tmp_path_factory) -> Shar:
    """11 cuts in 3 shards (4, 4, 3), every field present (left read-only by the tests)."""
    folder = write_shar(tmp_path_factory.mktemp("shar") / "shar", make_cuts(11))
    return Shar(folder, read_by_lhotse(folder))


def copy_of(shar: Shar, tmp_path: Path) -> Path:
    return Path(shutil.copytree(shar.folder, tmp_path / "copy"))


def joined_text(cut) -> str:
    """The supervisions' texts in time order, as the loader's ``texts``."""
    ordered = sorted(cut.supervisions, key=lambda s: s.start)
    return " ".join(s.text.strip() for s in ordered if s.text and s.text.strip())


def rows(loader) -> dict[str, dict]:
    """Every sample of an epoch by key, each field cut out of its batch (None when absent);
    a key read twice fails."""
    out: dict[str, dict] = {}
    for batch in loader:
        for row, key in enumerate(batch["keys"]):
            sample = {}
            for name, value in batch.items():
                if name == "keys" or name.endswith("_lens"):
                    continue
                lengths = batch.get("feat_lens" if name == "feats" else f"{name}_lens")
                if lengths is not None:
                    length = int(lengths[row])
                    sample[name] = None if length < 0 else value[row, :length].numpy()
                else:
                    sample[name] = value[row] if isinstance(value, list) else value[row].item()
            assert key not in out, f"{key} read twice"
            out[key] = sample
    return out


def swap_first_two_cuts(tar_path: Path) -> None:
    """Rewrite a Shar field tar with its first two cuts (data + manifest) swapped."""
    with tarfile.open(tar_path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    members[0:2], members[2:4] = members[2:4], members[0:2]
    with tarfile.open(tar_path, "w") as tar:
        for member, data in members:
            tar.addfile(member, io.BytesIO(data))


def test_the_realdata_shar_folder_reads_as_lhotse_reads_it():
    expected = read_by_lhotse(LSMIX)
    loader = make_loader(LSMIX, batch_size=1, num_workers=0)
    got = rows(loader)
    assert sorted(got) == sorted(expected) and len(got) == 2
    for key, row in got.items():
        cut = expected[key]
        np.testing.assert_array_equal(row["feats"], cut.load_features())
        np.testing.assert_array_equal(row["source_feats"], cut.load_custom("source_feats"))
        assert row["texts"] == joined_text(cut)
        assert row["cut"]["id"] == key and row["cut"]["duration"] == cut.duration
        assert len(row["cut"]["supervisions"]) == len(cut.supervisions)
        assert row["features_meta"]["num_frames"] == cut.features.num_frames == len(row["feats"])
        assert "recording" not in row  # recording.000000.tar holds only .nodata/.nometa
    assert got["24a97854-afcd-492f-85b7-0870994e9829"]["texts"].startswith("BY THIS MANOEUVRE WE DON'T LET ANYBODY")
    stats = loader.stats()
    assert stats["utts"] == 2 and stats["dropped"] == {} and stats["duplicate_keys"] == 0


def test_patterns_select_the_cuts_files_and_never_the_field_files(shar):
    folder = shar.folder
    for pattern in (
        folder,
        f"{folder}/*",
        f"{folder}/cuts.*.jsonl.gz",
        [f"{folder}/cuts.00000{{0,1}}.jsonl.gz", folder],
    ):
        assert [p.name for p in select_shards(pattern).paths] == CUTS
    assert [p.name for p in select_shards(f"{folder}/cuts.000001.jsonl.gz").paths] == [CUTS[1]]
    table = ShardTable.from_patterns(folder)
    assert [s.num_utts for s in table.shards] == [4, 4, 3]
    frames = [round(cut.duration * 100) for cut in shar.cuts.values()]
    assert [s.num_frames for s in table.shards] == [sum(frames[:4]), sum(frames[4:8]), sum(frames[8:])]
    assert dict(table.shards[2].sidecars) == {
        name: f"{folder}/{name}.000002.{'jsonl.gz' if name == 'speaker' else 'tar'}"
        for name in ("ali", "features", "recording", "speaker")
    }
    assert table.dim == 8 and table.frame_shift_ms == 10.0


@pytest.mark.parametrize("workers", [0, 2])
def test_every_cut_comes_once_an_epoch_with_the_data_lhotse_reads(shar, workers):
    loader = make_loader(shar.folder, batch_size=3, num_workers=workers, seed=3)
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        got = rows(loader)
        assert sorted(got) == sorted(shar.cuts)
    for key, row in got.items():
        cut = shar.cuts[key]
        np.testing.assert_array_equal(row["feats"], cut.load_features())
        np.testing.assert_array_equal(row["ali"], cut.load_custom("ali"))
        number = int(key[4:7])
        assert row["texts"] == joined_text(cut) == f"first {number} later {number}"  # in time order
        assert row["speaker"] == cut.speaker
        assert isinstance(row["recording"], AudioBytes) and row["recording"].format == "flac"
        audio, rate = soundfile.read(io.BytesIO(row["recording"].data), dtype="float32")
        np.testing.assert_array_equal(audio, cut.load_audio()[0])
        assert rate == 16000
        assert row["recording_meta"]["sampling_rate"] == 16000
        assert row["ali_meta"]["array"]["shape"] == list(row["ali"].shape)
    assert loader.stats()["dropped"] == {}


def test_audio_alone_is_decoded_and_batched_by_its_duration(shar):
    loader = make_loader(shar.folder, fields=["recording", "txt"], batch_frames=100, num_workers=0)
    got = rows(loader)
    assert sorted(got) == sorted(shar.cuts)
    for key, row in got.items():
        np.testing.assert_allclose(row["audio"], shar.cuts[key].load_audio()[0], atol=1e-6)
        assert row["sample_rate"] == 16000 and "feats" not in row
    for batch in loader:
        assert len(batch["keys"]) == 1 or int(batch["audio_lens"].max()) * len(batch["keys"]) <= 100 * 160


@pytest.mark.distributed
def test_two_ranks_read_every_cut_once_between_them(shar, tmp_path):
    options = dict(batch_size=2, num_workers=1, uneven="join", seed=1)
    ranks = run_ranks(2, {"pattern": str(shar.folder), "options": options, "epochs": [0, 1]}, tmp_path / "run")
    for epoch in range(2):
        per_rank = [[k for step in r["epochs"][epoch]["steps"] for k in step["keys"]] for r in ranks]
        assert all(per_rank) and sorted(per_rank[0] + per_rank[1]) == sorted(shar.cuts)


def test_a_resumed_loader_gives_the_batches_of_an_uninterrupted_run(shar):
    options = dict(batch_size=2, num_workers=2, seed=7, shuffle_window=4, sort_window=4, interleave=2)
    full = [b["keys"] for b in make_loader(shar.folder, **options)]
    loader = make_loader(shar.folder, **options)
    iterator = iter(loader)
    head = [next(iterator)["keys"] for _ in range(2)]
    state = json.loads(json.dumps(loader.state_dict()))
    del iterator
    resumed = make_loader(shar.folder, **options)
    resumed.load_state_dict(state)
    assert head + [b["keys"] for b in resumed] == full
    assert sorted(k for keys in full for k in keys) == sorted(shar.cuts)


def test_the_reader_resumes_inside_cuts_files_and_field_tars_at_every_position(shar):
    table = ShardTable.from_patterns(shar.folder)
    sets = plan_fields(table, None, None, False).sets
    assert sets == ("", "ali", "features", "recording", "speaker")
    units = [Unit(0), Unit(1, start=1, step=2), Unit(2, start=1)]  # whole, every other, from the second
    keys = assert_resumes_everywhere(lambda: ShardReader(table, units, interleave=2, field_sets=sets))
    ids = list(shar.cuts)
    assert sorted(keys) == sorted(ids[0:4] + ids[5:8:2] + ids[9:11])


def test_a_cut_without_a_field_has_it_absent(tmp_path):
    without = {"features": {"utt-001"}, "ali": {"utt-002"}, "speaker": {"utt-004"}}
    folder = write_shar(tmp_path / "gappy", make_cuts(6, without), shard_size=3)
    with pytest.raises(
        InputError, match=r"cuts\.000000\.jsonl\.gz@\d+ \(key 'utt-001'\): the sample has no 'features'"
    ):
        list(make_loader(folder, batch_size=2, num_workers=0, shuffle=False))
    loader = make_loader(folder, batch_size=2, num_workers=0, skip_bad=True)
    got = rows(loader)
    assert sorted(got) == ["utt-000", "utt-002", "utt-003.x", "utt-004", "utt-005"]
    assert loader.stats()["dropped"] == {"no_features": 1}
    assert (
        got["utt-002"]["ali"] is None
        and got["utt-002"].get("ali_meta") is None
        and got["utt-004"].get("speaker") is None
    )
    assert got["utt-000"]["ali"] is not None and got["utt-000"]["speaker"] == 100
    without_features = rows(make_loader(folder, fields=["ali", "txt"], batch_size=2, num_workers=0))
    assert sorted(without_features) == ["utt-000", "utt-001", "utt-002", "utt-003.x", "utt-004", "utt-005"]


def test_a_missing_field_file_or_one_in_another_order_is_an_error_naming_both_files(shar, tmp_path):
    folder = copy_of(shar, tmp_path)
    moved = (folder / "ali.000001.tar").rename(tmp_path / "ali.000001.tar")
    with pytest.raises(
        ConfigError, match=r"copy/cuts\.000001\.jsonl\.gz has no field file ali\.000001\.tar .*copy/ali\.000000\.tar"
    ):
        make_loader(folder, batch_size=2)
    moved.rename(folder / "ali.000001.tar")
    swap_first_two_cuts(folder / "features.000002.tar")
    ids = list(shar.cuts)
    with pytest.raises(
        ShardError,
        match=rf"features\.000002\.tar at byte 0: field files disagree: sample 0 is '{ids[8]}' in \S+cuts\.000002\.jsonl\.gz "
        rf"but '{ids[9]}' here \(write the field again with lhotse's SharWriter",
    ):
        list(make_loader(folder, batch_size=2, num_workers=0, shuffle=False))
    skipping = make_loader(folder, batch_size=2, num_workers=0, skip_bad=True, max_bad_shards=1)
    assert sorted(rows(skipping)) == sorted(ids[:8])  # the damaged shard is left, counted as a seqshard shard is
    assert skipping.stats()["damaged_shards"] == 1 and skipping.stats()["dropped"] == {"damaged": 3}
    assert main(["verify", "--quiet", str(folder)]) == 1
    (folder / CUTS[1]).write_bytes((folder / CUTS[1]).read_bytes()[:-20])  # a cuts file cut short
    with pytest.raises(ShardError, match=r"cuts\.000001\.jsonl\.gz at byte \d+: cannot be read from here"):
        make_loader(folder, batch_size=2)


def test_fields_names_shar_fields_and_only_their_files_are_opened(shar):
    loader = make_loader(shar.folder, fields=["ali"], batch_size=4, num_workers=0)
    with files_opened() as opened:  # what reading opens (making the loader looks at the first tar of each field)
        got = rows(loader)
    assert sorted(got) == sorted(shar.cuts) and all(list(row) == ["ali"] for row in got.values())
    shards = {Path(p).name for p in opened if Path(p).parent == shar.folder and ".tar" in p}
    assert sorted(shards) == ["ali.000000.tar", "ali.000001.tar", "ali.000002.tar"]
    with pytest.raises(ConfigError, match=r"fields: no field set holds 'speed'.*features \(features\)"):
        make_loader(shar.folder, fields=["speed"])


def test_inspect_says_what_a_shar_folder_is_and_index_leaves_it_alone(shar, tmp_path, capsys):
    assert main(["inspect", "--quiet", str(shar.folder)]) == 0
    out = capsys.readouterr().out
    assert "is a Lhotse Shar folder: 11 cuts in 3 shards" in out
    assert "field files: ali, features, recording, speaker" in out
    assert main(["inspect", "--json", "--quiet", str(shar.folder)]) == 0
    summary = json.loads(capsys.readouterr().out)
    hours = sum(cut.duration for cut in shar.cuts.values()) / 3600
    assert summary["num_utts"] == 11 and summary["hours"] == pytest.approx(hours, abs=1e-4)
    assert summary["groups"][0]["format"] == "lhotse-shar"
    assert summary["groups"][0]["fields"]["recording"] == [
        {"member": "recording.flac", "field": "recording"},
        {"member": "recording_meta.json", "field": "recording_meta"},
    ]
    assert main(["verify", "--quiet", str(shar.folder)]) == 0
    folder = copy_of(shar, tmp_path)
    assert main(["index", "--quiet", str(folder)]) == 1
    assert "is a Lhotse Shar folder" in capsys.readouterr().err and not (folder / "index.json").exists()


def test_lilcom_features_are_decoded_or_the_error_says_what_to_install(shar, tmp_path):
    try:
        import lilcom
    except ImportError:
        lilcom = None
    folder = copy_of(shar, tmp_path)
    for path in folder.glob("features.*.tar"):
        with tarfile.open(path) as tar:
            members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
        with tarfile.open(path, "w") as tar:
            for member, data in members:
                if member.name.endswith(".npy"):  # as lhotse writes features="lilcom"
                    member.name = member.name[: -len("npy")] + "llc"
                    data = lilcom.compress(np.load(io.BytesIO(data))) if lilcom else b"llc"
                    member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
    loader = make_loader(folder, fields=["features"], batch_size=4, num_workers=0)
    if lilcom is None:
        with pytest.raises(ImportError, match=r"lilcom-compressed arrays .*pip install lilcom"):
            list(loader)
    else:
        for key, row in rows(loader).items():
            np.testing.assert_allclose(row["feats"], shar.cuts[key].load_features(), atol=0.05)


# -- docs/from-lhotse.md, run as written --------------------------------------------------------------
BLOCK = re.compile(r"^```(python|sh)\n(.*?)^```", re.S | re.M)


def test_the_from_lhotse_walk_through_runs_as_written(monkeypatch):
    text = (ROOT / "docs/from-lhotse.md").read_text()
    blocks = BLOCK.findall(text)
    assert [kind for kind, _ in blocks].count("python") >= 3
    monkeypatch.chdir(ROOT)
    namespace: dict = {}
    for kind, code in blocks:
        if kind == "python":
            exec(compile(code, "docs/from-lhotse.md", "exec"), namespace)
            continue
        for line in code.splitlines():
            if line.startswith("seqshard "):
                assert main(shlex.split(line)[1:]) == 0, line


# -- found on the way: defects that a Shar folder's default read (every field) ran into --------------


def test_a_field_set_is_opened_once_when_fields_name_the_shards_own_and_a_sidecars():
    table = ShardTable(
        (ShardInfo("data-00000.tar", 1024, sidecars=(("ali", "fields/ali/data-00000.tar"),)),),
        field_sets=(("", ("feats.npy", "txt")), ("ali", ("ali.npy",))),
    )
    assert plan_fields(table, ["feats", "ali"], None, False).sets == ("", "ali")  # was ("", "", "ali")


def test_encoded_audio_read_beside_features_crosses_to_the_training_process(tmp_path):
    writer = ShardWriter(tmp_path / "data-00000.tar")
    audio = io.BytesIO()
    soundfile.write(audio, np.zeros(800, np.float32), 16000, format="FLAC")
    for i in range(4):
        writer.add(
            f"k{i}", [("feats.npy", list(npy_parts(np.zeros((5, 2), np.float32)))), ("flac", [audio.getvalue()])]
        )
    writer.commit()
    got = rows(make_loader(tmp_path, batch_size=2, num_workers=2))
    assert sorted(got) == ["k0", "k1", "k2", "k3"]
    assert all(isinstance(row["flac"], AudioBytes) and row["flac"].data == audio.getvalue() for row in got.values())
