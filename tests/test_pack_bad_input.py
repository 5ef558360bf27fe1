"""Each kind of bad input: a clear error naming file, line and key by default; with
``skip_bad`` a counted skip, and packed + dropped always equals the input."""

import logging
from pathlib import Path

import kaldiio
import numpy as np
import pytest

from conftest import read_shards
from seqshard import pack_data
from seqshard.cli import main
from seqshard.errors import ConfigError, InputError
from seqshard.formats.index import ShardIndex
from seqshard.formats.keys import unescape_key
from seqshard.prep.report import PackReport


def pack_both_ways(data, out: Path, scp=None, text=None, **kwargs):
    """Pack once strictly (returns the error) and once with skip_bad (returns the report)."""
    scp, text = scp or data.scp, text or data.text
    with pytest.raises(InputError) as error:
        pack_data(scp, text, out / "strict", progress=False, **kwargs)
    report = pack_data(scp, text, out / "skip", skip_bad=True, progress=False, **kwargs)
    assert report.packed + sum(report.dropped.values()) == report.input_utts
    assert report.packed == len(read_shards(sorted((out / "skip").rglob("data-*.tar"))))
    return error.value, report


def edit_line(path: Path, number: int, new: str | bytes | None) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    if new is None:
        del lines[number - 1]
    else:
        lines[number - 1] = new if isinstance(new, bytes) else new.encode() + b"\n"
    path.write_bytes(b"".join(lines))


def test_utterance_without_label(tmp_path, kaldi_dir):
    edit_line(kaldi_dir.text, 5, None)
    error, report = pack_both_ways(kaldi_dir, tmp_path)
    assert error.reason == "no_label" and "feats.scp:5 (key 'spk000-utt004')" in str(error)
    assert report.dropped == {"no_label": 1}


def test_label_without_features(tmp_path, kaldi_dir):
    with open(kaldi_dir.text, "a") as stream:
        stream.write("ghost-utt some words\n")
    error, report = pack_both_ways(kaldi_dir, tmp_path)
    assert error.reason == "no_features" and "text:49 (key 'ghost-utt')" in str(error)
    assert report.label_issues == {"no_features": 1} and report.packed == 48


def test_duplicate_keys_across_scp_files_and_in_text(tmp_path, kaldi_dir):
    extra = tmp_path / "extra.scp"
    extra.write_text(kaldi_dir.scp.read_text().splitlines()[2] + "\n")
    error, report = pack_both_ways(kaldi_dir, tmp_path / "a", scp=[kaldi_dir.scp, extra])
    assert error.reason == "duplicate_key" and "extra.scp:1" in str(error) and "feats.scp:3" in str(error)
    assert report.dropped == {"duplicate_key": 1} and report.input_utts == 49
    with open(kaldi_dir.text, "a") as stream:
        stream.write("spk001-utt001 another label\n")
    error, report = pack_both_ways(kaldi_dir, tmp_path / "b")
    assert error.reason == "duplicate_label" and "text:49" in str(error)
    found = read_shards(sorted((tmp_path / "b" / "skip").rglob("*.tar")))
    assert found["spk001-utt001"][1] == kaldi_dir.labels["spk001-utt001"]  # the first label wins


def test_malformed_lines_name_their_line(tmp_path, kaldi_dir):
    edit_line(kaldi_dir.scp, 7, "spk000-utt006")
    error, report = pack_both_ways(kaldi_dir, tmp_path / "a")
    assert error.reason == "malformed_line" and "feats.scp:7" in str(error)
    assert report.dropped == {"malformed_line": 1} and report.input_utts == 48
    # the text line of the utterance that lost its scp entry now has no features
    assert report.label_issues == {"no_features": 1}


def test_missing_ark_and_bad_offset(tmp_path, kaldi_dir):
    lines = kaldi_dir.scp.read_text().splitlines()
    key, location = lines[3].split()
    ark, offset = location.rsplit(":", 1)
    lines[3] = f"{key} {ark}:{int(offset) + 3}"
    lines[10] = f"{lines[10].split()[0]} /nonexistent/raw.ark:10"
    kaldi_dir.scp.write_text("\n".join(lines) + "\n")
    error, report = pack_both_ways(kaldi_dir, tmp_path)
    assert error.reason == "bad_offset" and "feats.scp:4" in str(error)
    assert report.dropped == {"bad_offset": 1, "missing_ark": 1}


HUGE = "9" * 20  # past any ark (and past a seek's int64); 5000 digits are past int()'s 4300
MANY = "9" * 5000


@pytest.mark.parametrize(
    ("location", "reason"),
    [
        (f"ark:{HUGE}", "bad_offset"),
        (f"{{ark}}:{HUGE}", "bad_offset"),
        (f"{{ark}}:{MANY}", "bad_offset"),
        (f"{{ark}}:{{offset}}[0:{MANY}]", "bad_range"),
    ],
)
def test_an_scp_number_no_ark_can_hold_is_named_not_a_failed_task(tmp_path, kaldi_dir, location, reason):
    """Such a number failed the scan task (OverflowError, or int()'s ValueError past 4300
    digits), reported as a task to run again."""
    lines = kaldi_dir.scp.read_text().splitlines()
    key, value = lines[3].split()
    ark, offset = value.rsplit(":", 1)
    lines[3] = f"{key} {location.format(ark=ark, offset=offset)}"
    kaldi_dir.scp.write_text("\n".join(lines) + "\n")
    error, report = pack_both_ways(kaldi_dir, tmp_path)
    assert error.reason == reason and f"feats.scp:4 (key '{key}')" in str(error) and "Fix:" in str(error)
    assert "no ark is that large" in str(error) or "no matrix is that large" in str(error)
    assert report.dropped == {reason: 1} and report.packed == 47


@pytest.mark.parametrize("offset", [HUGE, MANY])
def test_a_wav_scp_offset_no_ark_can_hold_is_named_not_a_failed_task(tmp_path, offset):
    """It failed the write task (``cannot fit 'int' into an offset-sized integer``) or the scan
    task (int() past 4300 digits)."""
    from conftest import write_audio_dir

    audio = write_audio_dir(tmp_path / "audio", utts=3, seconds=(0.2, 0.3))
    lines = audio.wav_scp.read_text().splitlines()
    key = lines[1].split()[0]
    lines[1] = f"{key} {tmp_path / 'audio' / 'w.ark'}:{offset}"
    audio.wav_scp.write_text("\n".join(lines) + "\n")
    text = tmp_path / "text"
    text.write_text("".join(f"{line.split()[0]} words\n" for line in lines))
    with pytest.raises(InputError) as error:
        pack_data(None, text, tmp_path / "strict", wav_scp=audio.wav_scp, progress=False)
    assert error.value.reason == "bad_offset" and f"wav.scp:2 (key '{key}')" in str(error.value)
    assert "no ark is that large" in str(error.value) and "wav-copy" in str(error.value)
    report = pack_data(None, text, tmp_path / "skip", wav_scp=audio.wav_scp, skip_bad=True, progress=False)
    assert (report.input_utts, report.packed, report.dropped) == (3, 2, {"bad_offset": 1})


def test_nan_inf_and_zero_length_matrices(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    arrays = {f"u{i}": np.ones((4, 3), np.float32) * i for i in range(6)}
    arrays["u1"][2, 1] = np.nan
    arrays["u3"][0, 0] = np.inf
    arrays["u4"] = np.zeros((0, 3), np.float32)
    kaldiio.save_ark(str(root / "a.ark"), arrays, scp=str(root / "feats.scp"))
    (root / "text").write_text("".join(f"{k} label {k}\n" for k in arrays))

    class Dir:
        scp, text = root / "feats.scp", root / "text"

    error, report = pack_both_ways(Dir, tmp_path / "out")
    assert error.reason == "non_finite" and "(key 'u1')" in str(error) and "frame 2" in str(error)
    assert report.dropped == {"non_finite": 2, "zero_length": 1} and report.packed == 3
    # with length groups the zero-length matrix is found while planning, from its header
    _, grouped = pack_both_ways(Dir, tmp_path / "grouped", filter_group=["1:10"])
    assert grouped.dropped == {"non_finite": 2, "zero_length": 1}


def test_non_utf8_text(tmp_path, kaldi_dir):
    edit_line(kaldi_dir.text, 2, b"spk000-utt001 caf" + b"\xe9\n")  # latin-1
    error, report = pack_both_ways(kaldi_dir, tmp_path)
    assert error.reason == "non_utf8" and "text:2" in str(error) and "iconv" in str(error)
    assert report.label_issues == {"non_utf8": 1} and report.dropped == {"no_label": 1}


def test_empty_inputs(tmp_path, kaldi_dir):
    empty = tmp_path / "empty.scp"
    empty.write_text("")
    with pytest.raises(InputError, match="no entries") as error:
        pack_data(empty, kaldi_dir.text, tmp_path / "out", progress=False)
    assert error.value.reason == "empty_input"
    with pytest.raises(InputError, match="does not exist"):
        pack_data(tmp_path / "nope.scp", kaldi_dir.text, tmp_path / "out2", progress=False)


def test_keys_that_break_the_member_convention(tmp_path, kaldi_dir):
    for path in (kaldi_dir.scp, kaldi_dir.text):
        path.write_text(path.read_text().replace("spk002-utt003", "spk002.utt/003"))
    error, report = pack_both_ways(kaldi_dir, tmp_path)
    assert error.reason == "bad_key" and "'.'" in str(error) and "escape_keys=True" in str(error)
    assert report.dropped == {"bad_key": 1}
    escaped = pack_data(kaldi_dir.scp, kaldi_dir.text, tmp_path / "esc", escape_keys=True, progress=False)
    found = read_shards(sorted((tmp_path / "esc").glob("*.tar")))
    assert escaped.packed == 48 and "spk002.utt/003" in {unescape_key(k) for k in found}


def test_stale_utt2num_frames_is_caught_when_writing(tmp_path, kaldi_dir):
    lengths = {k: a.shape[0] for k, a in kaldi_dir.arrays.items()}
    lengths["spk001-utt002"] += 1
    (kaldi_dir.root / "utt2num_frames").write_text("".join(f"{k} {n}\n" for k, n in lengths.items()))
    error, report = pack_both_ways(kaldi_dir, tmp_path, filter_group=["1:1000"])
    assert error.reason == "frames_mismatch" and "utt2num_frames says" in str(error)
    assert report.dropped == {"frames_mismatch": 1}


def test_malformed_utt2num_frames_line_is_counted_and_the_header_used(tmp_path, kaldi_dir):
    lengths = {k: a.shape[0] for k, a in kaldi_dir.arrays.items()}
    lines = [f"{k} {n}\n" for k, n in lengths.items()]
    lines[2] = "spk000-utt002 twelve\n"
    n = lengths["spk000-utt005"]
    lines[5] = f"spk000-utt005 {n // 10}_{n % 10}\n"  # Python's int() reads "3_4" as 34; Kaldi does not
    lines[7] = f"spk000-utt007 {'9' * 5000}\n"  # int() refuses past 4300 digits: it failed the scan task
    frames_file = kaldi_dir.root / "utt2num_frames"
    frames_file.write_text("".join(lines))
    error, report = pack_both_ways(kaldi_dir, tmp_path, filter_group=["1:1000"])
    assert error.reason == "malformed_line" and f"{frames_file}:3" in str(error) and "'twelve'" in str(error)
    # the utterances are packed all the same, their lengths read from their matrix headers
    assert report.packed == 48 and report.dropped == {} and report.label_issues == {}
    assert report.frames_file_issues == {"malformed_line": 3}
    found = read_shards(sorted((tmp_path / "skip").rglob("*.tar")))
    assert found["spk000-utt002"][0].shape[0] == lengths["spk000-utt002"]
    index = ShardIndex.load(tmp_path / "skip" / "1_1000")
    assert sum(s.num_frames for s in index.shards) == sum(lengths.values())


def test_report_shows_frames_file_issues_apart_from_drops():
    report = PackReport(
        output="out", complete=True, input_utts=3, packed=3, dropped={}, label_issues={}, num_labels=3, groups={},
        shards_total=1, shards_done=1, shards_written_now=1, bytes_written_now=10, wall_seconds=1.0, dim=4,
        dtype="float32", frames_file_issues={"malformed_line": 2},
    )  # fmt: skip
    assert report.to_json()["frames_file_issues"] == {"malformed_line": 2}
    assert "frames file issue:        2  malformed_line" in report.format_text()
    assert "dropped" not in report.format_text()


def test_messages_name_options_as_the_user_wrote_them(tmp_path, kaldi_dir, capsys):
    for path in (kaldi_dir.scp, kaldi_dir.text):
        path.write_text(path.read_text().replace("spk002-utt003", "spk002.utt003"))
    with open(kaldi_dir.scp, "a") as stream:
        stream.write(kaldi_dir.scp.read_text().splitlines()[0] + "\n")  # a duplicate key
    with pytest.raises(InputError) as error:
        pack_data(kaldi_dir.scp, kaldi_dir.text, tmp_path / "py", progress=False)
    message = str(error.value)
    assert error.value.reason == "bad_key" and "escape_keys=True" in message and "--" not in message
    assert message.count("skip_bad=True") == 1
    # from the command line: the flags, and the skip hint once (added by InputError)
    argv = ["pack", "--scp", str(kaldi_dir.scp), "--text", str(kaldi_dir.text), "--out", str(tmp_path / "cli")]
    assert main([*argv, "--escape-keys", "--quiet"]) == 1
    stderr = capsys.readouterr().err
    assert "duplicate" in stderr and "(skipping keeps that first entry)" in stderr
    assert stderr.count("--skip-bad") == 1 and "skip_bad" not in stderr and "utils/fix_data_dir.sh)." in stderr
    assert main([*argv, "--quiet"]) == 1
    stderr = capsys.readouterr().err
    assert "pass --escape-keys to store it" in stderr and stderr.count("--skip-bad") == 1
    assert main([*argv, "--quiet", "--filter-group", "10-20"]) == 1
    assert "--filter-group 10-20: expected 'LOW:HIGH'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"filter_group='10:30' and filter_group='20:40' overlap"):
        pack_data(kaldi_dir.scp, kaldi_dir.text, tmp_path / "o", filter_group=["10:30", "20:40"], progress=False)
    # an error that skipping cannot skip says nothing of skipping
    empty = tmp_path / "empty.scp"
    empty.write_text("")
    with pytest.raises(InputError) as error:
        pack_data(empty, kaldi_dir.text, tmp_path / "e", progress=False)
    assert error.value.reason == "empty_input" and "skip" not in str(error.value)


def test_utterances_outside_the_length_groups_are_named_at_info(tmp_path, kaldi_dir, caplog):
    lengths = {k: a.shape[0] for k, a in kaldi_dir.arrays.items()}
    outside = [k for k, n in lengths.items() if not 10 <= n < 40]
    assert len(outside) > 20
    with caplog.at_level(logging.INFO, logger="seqshard"):
        report = pack_data(kaldi_dir.scp, kaldi_dir.text, tmp_path, filter_group=["10:40"], progress=False)
    assert report.dropped == {"outside_groups": len(outside)}
    named = [r.getMessage() for r in caplog.records if "dropped (outside_groups)" in r.getMessage()]
    assert len(named) == 21
    for key, message in zip(outside[:20], named):
        assert f"(key {key!r}): {lengths[key]} frames, outside every length group ([10, 40))" in message
    assert named[20].endswith(f"{len(outside) - 20} more utterances outside every length group")


def test_a_byte_order_mark_is_not_part_of_the_first_key(tmp_path, kaldi_dir, caplog):
    kaldi_dir.text.write_bytes(b"\xef\xbb\xbf" + kaldi_dir.text.read_bytes())  # as some editors save
    with caplog.at_level("WARNING", logger="seqshard"):
        report = pack_data(kaldi_dir.scp, kaldi_dir.text, tmp_path / "out", progress=False)
    assert report.packed == 48 and report.label_issues == {}
    assert "starts with a UTF-8 byte order mark" in caplog.text


def _nul_key_inputs(root: Path, route: str) -> dict:
    """pack_data's inputs with one utterance key (of three) holding a NUL character, by route."""
    from conftest import write_audio_dir

    keys = ["u0", "u\x001", "u2"]
    text = root / "text"
    text.write_text("".join(f"{key} words {n}\n" for n, key in enumerate(keys)))
    if route == "feats.scp":
        with kaldiio.WriteHelper(f"ark,scp:{root / 'f.ark'},{root / 'feats.scp'}") as writer:
            for n, key in enumerate(keys):
                writer(key, np.full((3 + n, 2), n, dtype=np.float32))
        return dict(f_scps=root / "feats.scp", f_labels=text)
    audio = write_audio_dir(root / "audio", utts=3, seconds=(0.2, 0.3))
    wavs = [line.split(" ", 1)[1] for line in audio.wav_scp.read_text().splitlines()]
    wav_scp = root / "wav.scp"
    if route == "wav.scp":
        wav_scp.write_text("".join(f"{key} {wav}\n" for key, wav in zip(keys, wavs)))
        return dict(f_scps=None, f_labels=text, wav_scp=wav_scp)
    wav_scp.write_text("".join(f"rec{n} {wav}\n" for n, wav in enumerate(wavs)))
    (root / "segments").write_text("".join(f"{key} rec{n} 0.0 0.15\n" for n, key in enumerate(keys)))
    return dict(f_scps=None, f_labels=text, wav_scp=wav_scp, segments=root / "segments")


@pytest.mark.parametrize("route", ["feats.scp", "wav.scp", "segments"])
def test_a_key_holding_nul_is_a_bad_key_on_every_route(tmp_path, route):
    """Such a key ended its member names (and the member table's keys) early: pack reported it
    packed and wrote a shard its own loader refused, all its utterances lost."""
    from seqshard import make_loader

    inputs = _nul_key_inputs(tmp_path, route)
    scp = inputs.pop("f_scps")
    with pytest.raises(InputError) as error:
        pack_data(scp, inputs.pop("f_labels"), tmp_path / "strict", progress=False, **inputs)
    assert error.value.reason == "bad_key" and "NUL character" in str(error.value)
    assert "(key 'u\\x001')" in str(error.value) and "escape_keys=True" in str(error.value)
    report = pack_data(scp, tmp_path / "text", tmp_path / "skip", skip_bad=True, progress=False, **inputs)
    assert (report.input_utts, report.packed, report.dropped) == (3, 2, {"bad_key": 1})
    loader = make_loader(tmp_path / "skip", batch_size=2, num_workers=0, shuffle=False)
    assert sorted(k for batch in loader for k in batch["keys"]) == ["u0", "u2"]
    assert loader.stats()["damaged_shards"] == 0
    escaped = pack_data(scp, tmp_path / "text", tmp_path / "esc", escape_keys=True, progress=False, **inputs)
    loader = make_loader(tmp_path / "esc", batch_size=2, num_workers=0, shuffle=False)
    assert escaped.packed == 3 and sorted(k for batch in loader for k in batch["keys"]) == sorted(
        ["u0", "u\x001", "u2"]
    )


def test_a_key_too_long_for_a_tar_header_is_a_bad_key_even_escaped():
    from seqshard.formats.keys import MAX_KEY_BYTES, key_problem

    assert key_problem("a" * MAX_KEY_BYTES) is None
    assert "beyond the 65536" in key_problem("é" * MAX_KEY_BYTES)
    assert "bytes long escaped" in key_problem("." * (MAX_KEY_BYTES // 2), escaped=True)


@pytest.mark.parametrize("table", ["scp", "text"])
def test_a_line_beyond_the_line_bound_is_a_malformed_line(tmp_path, kaldi_dir, monkeypatch, table):
    """Kaldi tables are read by the bounded line reader of NeMo manifests and Shar files: a
    line of hundreds of MB was held whole (a MemoryError at 1.6 GB)."""
    from seqshard.formats import inflation

    monkeypatch.setattr(inflation, "MAX_LINE_BYTES", 4096)
    edit_line(getattr(kaldi_dir, table), 2, "utt " + "x" * 100_000)
    error, report = pack_both_ways(kaldi_dir, tmp_path)
    assert f"{table}:2" in str(error) and "a line is longer than 4096 bytes" in str(error)
    if table == "scp":
        assert report.dropped == {"malformed_line": 1}
    else:  # the text line is a label issue; its utterance has no label
        assert (report.label_issues, report.dropped) == ({"malformed_line": 1}, {"no_label": 1})
