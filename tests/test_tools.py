"""inspect, verify and index, through the command line as users run them."""

import json
import shutil
import tarfile

import pytest
import soundfile

from conftest import REALDATA, write_audio_dir, write_kaldi_dir
from seqshard import ShardIndex, make_loader, pack_data
from seqshard.cli import main
from seqshard.errors import ShardError
from seqshard.formats.tar import ShardWriter


@pytest.fixture
def packed(tmp_path):
    data = write_kaldi_dir(tmp_path / "d", speakers=6, per_speaker=10, frames=(5, 80))
    pack_data(data.scp, data.text, tmp_path / "out", filter_group=["5:40", "40:80"], utts_per_file=8, progress=False)
    return data, tmp_path / "out"


def test_inspect_json_counts_hours_and_groups(packed, capsys, tmp_path):
    data, out = packed
    assert (
        main(["inspect", "--json", "--quiet", f"{out}/{{5_40,40_80}}/data-*.tar", "--plot", str(tmp_path / "len.png")])
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    frames = sum(a.shape[0] for a in data.arrays.values())
    assert summary["num_utts"] == 60 and summary["num_frames"] == frames
    assert summary["num_shards"] == len(list(out.rglob("data-*.tar")))
    assert summary["hours"] == pytest.approx(frames * 0.01 / 3600, abs=1e-4)
    assert [g["folder"].rsplit("/", 1)[1] for g in summary["groups"]] == ["5_40", "40_80"]
    lengths = sorted(a.shape[0] for a in data.arrays.values())
    assert summary["length_percentiles_frames"]["p50"] == pytest.approx(lengths[30], rel=0.1)
    assert (tmp_path / "len.png").read_bytes()[:4] == b"\x89PNG"


def test_inspect_selects_shards_with_brace_ranges(packed, capsys):
    _, out = packed
    assert main(["inspect", "--json", "--quiet", f"{out}/5_40/data-0000{{0..1}}.tar"]) == 0
    assert json.loads(capsys.readouterr().out)["num_shards"] == 2
    assert main(["inspect", "--quiet", f"{out}/nothing-*.tar"]) == 1
    assert "selects no shard" in capsys.readouterr().err


def test_verify_names_each_damaged_shard_and_exits_non_zero(packed, capsys):
    _, out = packed
    assert main(["verify", "--quiet", str(out)]) == 0
    assert "0 damaged" in capsys.readouterr().out
    flipped, cut = out / "5_40" / "data-00000.tar", out / "40_80" / "data-00001.tar"
    data = bytearray(flipped.read_bytes())
    data[3000] ^= 0x40
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:2048])
    (out / "40_80" / "data-00002.tar").unlink()
    assert main(["verify", "--quiet", str(out)]) == 1
    report = capsys.readouterr().out
    assert "2 damaged, 1 missing" in report
    assert f"DAMAGED {flipped}" in report and "checksum" in report
    assert f"DAMAGED {cut}" in report and "utterances, index says" in report
    assert f"MISSING {out / '40_80' / 'data-00002.tar'}" in report and "file is missing" in report


@pytest.mark.parametrize("name", ["first_key", "last_key"])
def test_verify_checks_the_keys_a_loader_checks(packed, capsys, name):
    _, out = packed
    written = json.loads((out / "5_40" / "index.json").read_text())
    written["shards"][1][name] = "zzz"
    (out / "5_40" / "index.json").write_text(json.dumps(written))
    shard = out / "5_40" / written["shards"][1]["name"]
    with pytest.raises(ShardError, match=r"where its index\.json says 'zzz'"):
        list(make_loader(out / "5_40", batch_size=1, num_workers=0))
    assert main(["verify", "--quiet", str(out)]) == 1
    report = capsys.readouterr().out
    assert "1 damaged" in report and f"DAMAGED {shard}" in report
    assert f"{name} '" in report and "index.json says 'zzz'" in report and "`seqshard index`" in report
    assert main(["index", "--quiet", str(out)]) == 0 and main(["verify", "--quiet", str(out)]) == 0


def test_index_rebuilds_a_pack_and_indexes_foreign_shards(packed, tmp_path, capsys):
    _, out = packed
    before = ShardIndex.load(out / "5_40")
    (out / "5_40" / "index.json").unlink()
    assert main(["index", "--quiet", str(out)]) == 0
    after = ShardIndex.load(out / "5_40")
    assert [s.to_json() for s in after.shards] == [s.to_json() for s in before.shards]

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    shutil.copy(REALDATA / "webdataset/wenet-shard/shards_000000000.tar", foreign)
    assert main(["index", "--quiet", str(foreign)]) == 0
    index = ShardIndex.load(foreign)
    assert index.num_utts == 2 and index.shards[0].checksum.startswith("crc32:")
    assert main(["verify", "--quiet", str(foreign)]) == 0


def _pack_of_kind(kind, root):
    """A pack of ``kind`` in two length groups (``root/out``), from data made here."""
    groups = dict(filter_group=["0:1", "1:20"], progress=False)  # seconds of audio, frames of features
    if kind == "features":
        data = write_kaldi_dir(root / "d", speakers=2, per_speaker=5, frames=(1, 20))
        groups["filter_group"] = ["0:10", "10:20"]
        pack_data(data.scp, data.text, root / "out", **groups)
        return root / "out"
    data = write_audio_dir(root / "d", utts=6, seconds=(1.4, 1.6) if kind == "segments" else (0.5, 1.6))
    options = {"keep": dict(audio_format="keep"), "fbank": dict(features="fbank", num_mel_bins=23)}.get(kind, {})
    wav_scp = data.wav_scp
    if kind == "segments":
        ends = dict(zip(data.keys[:4], (0.45, 1.3, 0.45, 1.3)))
        (root / "segments").write_text("".join(f"{key}-a {key} 0.1 {end}\n" for key, end in ends.items()))
        (root / "text").write_text("".join(f"{key}-a words of {key}\n" for key in ends))
        pack_data(None, root / "text", root / "out", wav_scp=wav_scp, segments=root / "segments", **groups)
        return root / "out"
    if kind == "wav_in_ark":
        wav_scp, lines = root / "wav_ark.scp", []
        with open(root / "wav.ark", "wb") as ark:  # as wav-copy writes: "KEY " and the wav file's bytes
            for key in data.keys:
                ark.write(f"{key} ".encode())
                lines.append(f"{key} {root / 'wav.ark'}:{ark.tell()}\n")
                ark.write((data.root / f"{key}.wav").read_bytes())
        wav_scp.write_text("".join(lines))
    pack_data(None, data.text, root / "out", wav_scp=wav_scp, **options, **groups)
    return root / "out"


def _batches(folder):
    loader = make_loader(folder, batch_size=2, num_workers=0, shuffle_window=4, sort_window=4)
    return [{k: v.tolist() if hasattr(v, "tolist") else v for k, v in batch.items()} for batch in loader]


@pytest.mark.parametrize("kind", ["features", "flac", "keep", "fbank", "segments", "wav_in_ark"])
def test_index_of_a_pack_writes_the_facts_the_pack_wrote(tmp_path, kind, capsys):
    out = _pack_of_kind(kind, tmp_path)
    folders = sorted(p.parent for p in out.glob("*/index.json"))
    assert len(folders) == 2
    before = {f: json.loads((f / "index.json").read_text()) for f in folders}
    batches = {f: _batches(f) for f in folders}
    for _ in range(2):  # and again on the index it wrote
        assert main(["index", "--quiet", str(out)]) == 0
        for folder in folders:
            after = json.loads((folder / "index.json").read_text())
            for name in ("feature", "fields", "keys", "totals", "shards"):
                assert after[name] == before[folder][name], (folder, name)
            assert _batches(folder) == batches[folder]
    assert main(["verify", "--quiet", str(out)]) == 0 and main(["inspect", "--quiet", str(out)]) == 0
    capsys.readouterr()

    damaged = folders[0] / "index.json"  # as `seqshard index` of 0.1.0 left an audio pack: index repairs it
    written = json.loads(damaged.read_text())
    written["feature"].setdefault("dim", 0)
    written["fields"].append("feats.npy")
    damaged.write_text(json.dumps(written))
    assert main(["index", "--quiet", str(out)]) == 0
    repaired = json.loads(damaged.read_text())
    assert repaired["feature"] == before[folders[0]]["feature"] and repaired["fields"] == before[folders[0]]["fields"]
    assert _batches(folders[0]) == batches[folders[0]]


def test_pack_command_line_reports_and_fails_cleanly(tmp_path, capsys):
    data = write_kaldi_dir(tmp_path / "d")
    assert (
        main(
            [
                "pack",
                "--scp",
                str(data.scp),
                "--text",
                str(data.text),
                "--out",
                str(tmp_path / "o"),
                "--utts-per-file",
                "20",
                "--quiet",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["packed"] == 48 and report["shards_total"] == 3
    data.text.write_text("\n".join(data.text.read_text().splitlines()[1:]) + "\n")
    assert (
        main(["pack", "--scp", str(data.scp), "--text", str(data.text), "--out", str(tmp_path / "o2"), "--quiet"]) == 1
    )
    error = capsys.readouterr().err
    assert "feats.scp:1 (key 'spk000-utt000')" in error and "Traceback" not in error


def test_inspect_percentiles_stay_within_the_exact_shortest_and_longest(tmp_path, capsys):
    from conftest import write_kaldi_dir
    from seqshard import pack_data

    data = write_kaldi_dir(tmp_path / "d", speakers=3, per_speaker=10, frames=(1150, 1165))
    pack_data(data.scp, data.text, tmp_path / "out", utts_per_file=10, progress=False)
    assert main(["inspect", "--json", "--quiet", str(tmp_path / "out")]) == 0
    summary = json.loads(capsys.readouterr().out)
    lengths = sorted(a.shape[0] for a in data.arrays.values())
    assert summary["min_frames"] == lengths[0] and summary["max_frames"] == lengths[-1]
    for value in summary["length_percentiles_frames"].values():
        assert lengths[0] <= value <= lengths[-1]  # the histogram bin alone reached 1194.8
    assert summary["percentiles_exact"] is False
    assert main(["inspect", "--quiet", str(tmp_path / "out")]) == 0
    assert "percentiles (approximate" in capsys.readouterr().out


def test_foreign_audio_shards_are_indexed_with_their_hours(tmp_path, capsys):
    foreign = tmp_path / "wenet"
    foreign.mkdir()
    shard = REALDATA / "webdataset/wenet-shard/shards_000000000.tar"
    shutil.copy(shard, foreign)
    with tarfile.open(shard) as archive:
        seconds = [
            soundfile.info(archive.extractfile(m)).duration for m in archive.getmembers() if m.name.endswith(".wav")
        ]
    assert main(["index", "--quiet", str(foreign)]) == 0
    index = ShardIndex.load(foreign)
    assert index.feature["kind"] == "audio" and index.shards[0].num_frames == sum(round(s * 100) for s in seconds)
    capsys.readouterr()
    assert main(["inspect", "--json", "--quiet", str(foreign)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_utts"] == 2
    assert summary["hours"] == pytest.approx(sum(seconds) / 3600, abs=1e-4)  # shown to 4 decimals


def test_shards_without_features_or_audio_say_their_hours_are_unknown(tmp_path, capsys, caplog):
    folder = tmp_path / "texts"
    writer = ShardWriter(folder / "texts-00000.tar")
    for key in ("a", "b"):
        writer.add(key, [("txt", [b"hello"])])
    writer.commit()
    with caplog.at_level("WARNING", logger="seqshard"):
        assert main(["index", "--quiet", str(folder)]) == 0
    assert "hold no feature field" in caplog.text
    capsys.readouterr()
    assert main(["inspect", "--json", "--quiet", str(folder)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_utts"] == 2 and summary["hours"] is None and summary["groups"][0]["hours"] is None
    assert main(["inspect", "--quiet", str(folder)]) == 0
    assert "unknown hours (no feature field)" in capsys.readouterr().out


def test_inspect_gives_exact_lengths_for_unindexed_and_reindexed_shards(packed, tmp_path, capsys):
    data, out = packed
    copy = tmp_path / "copy"
    copy.mkdir()
    for shard in (out / "5_40").glob("*.tar"):
        shutil.copy(shard, copy)
    in_group = sorted(a.shape[0] for a in data.arrays.values() if 5 <= a.shape[0] < 40)
    for _ in range(2):  # unindexed, then indexed by `seqshard index`
        assert main(["inspect", "--json", "--quiet", str(copy)]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert (summary["min_frames"], summary["max_frames"]) == (in_group[0], in_group[-1])
        assert main(["index", "--quiet", str(copy)]) == 0
        capsys.readouterr()


def test_inspect_of_a_cut_short_unindexed_shard_says_damaged_and_exits_non_zero(packed, tmp_path, capsys):
    _, out = packed
    copy = tmp_path / "cut"
    copy.mkdir()
    whole = (out / "5_40" / "data-00000.tar").read_bytes()
    (copy / "data-00000.tar").write_bytes(whole[: len(whole) * 55 // 100])
    assert main(["inspect", "--quiet", str(copy)]) == 1
    output = capsys.readouterr()
    assert f"DAMAGED {copy / 'data-00000.tar'}" in output.out and "truncated" in output.out
    assert "INCOMPLETE" in output.out and "damaged or cut short" in output.err
    assert main(["inspect", "--json", "--quiet", str(copy)]) == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["complete"] is False and 0 < summary["num_utts"] < 8  # what could be read is still counted
    assert summary["damaged_shards"][0]["path"] == str(copy / "data-00000.tar")


def test_inspect_of_an_indexed_shard_cut_short_says_damaged_and_exits_non_zero(packed, capsys):
    _, out = packed
    shard = out / "5_40" / "data-00000.tar"
    assert main(["inspect", "--quiet", str(out / "5_40")]) == 0
    capsys.readouterr()
    shard.write_bytes(shard.read_bytes()[:2048])
    assert main(["inspect", "--quiet", str(out / "5_40")]) == 1
    printed = capsys.readouterr().out
    assert f"DAMAGED {shard}: the file has 2048 bytes where its index.json says" in printed
