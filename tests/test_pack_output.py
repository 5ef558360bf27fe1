"""The pack's output folder: resuming after a failure with the flag the error suggested, file
modes, a full or read-only disk."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import kaldiio
import numpy as np
import pytest

from conftest import read_shards, write_kaldi_dir
from seqshard import pack_data
from seqshard.cli import main
from seqshard.errors import ConfigError, InputError, OutputError


def test_a_failed_pack_can_be_rerun_with_the_fix_its_error_suggests(tmp_path, capsys):
    data = write_kaldi_dir(tmp_path / "kaldi")
    moved = tmp_path / "moved"
    shutil.move(str(data.root), str(moved))  # the data dir was made elsewhere: its scp names old paths
    out = tmp_path / "shards"
    args = ["pack", "--scp", str(moved / "feats.scp"), "--text", str(moved / "text"), "--out", str(out), "--quiet"]
    args += ["--utts-per-file", "10"]
    assert main(args) == 1
    assert "missing_ark" not in capsys.readouterr().err  # reasons are tags for reports, the message says it
    assert main([*args, "--path-map", f"{data.root}={moved}"]) == 0
    assert sorted(read_shards(out.glob("*.tar"))) == sorted(data.keys)

    (moved / "text").touch()  # same content, new mtime: still the same pack
    assert main([*args, "--path-map", f"{data.root}={moved}"]) == 0
    assert "0 written by this run" in capsys.readouterr().out

    text = (moved / "text").read_text().replace("word1", "WORD1")
    (moved / "text").write_text(text)
    assert main([*args, "--path-map", f"{data.root}={moved}"]) == 1
    err = capsys.readouterr().err
    assert "holds shards packed from other inputs or options" in err and "text changed" in err and "--overwrite" in err


def test_a_rerun_with_skip_bad_continues_a_pack_stopped_by_bad_data(tmp_path):
    root = tmp_path / "kaldi"
    root.mkdir()
    keys = [f"utt{i:03d}" for i in range(40)]
    with kaldiio.WriteHelper(f"ark,scp:{root}/a.ark,{root}/feats.scp") as writer:
        for i, key in enumerate(keys):
            array = np.full((8, 3), i, dtype=np.float32)
            if i == 39:
                array[2, 1] = np.nan  # found only when the last shard is written
            writer(key, array)
    (root / "text").write_text("".join(f"{k} label {k}\n" for k in keys))
    out = tmp_path / "shards"
    options = dict(utts_per_file=10, shuffle=False, progress=False)
    with pytest.raises(InputError, match=r"NaN or Inf.*Or pass skip_bad=True"):
        pack_data(root / "feats.scp", root / "text", out, **options)
    finished = sorted(p.name for p in out.glob("*.tar"))
    assert finished == ["data-00000.tar", "data-00001.tar", "data-00002.tar"]
    report = pack_data(root / "feats.scp", root / "text", out, skip_bad=True, **options)
    assert report.complete and report.shards_written_now == 1
    assert report.packed == 39 and report.dropped == {"non_finite": 1}
    assert report.packed + sum(report.dropped.values()) == report.input_utts


def test_a_plan_changed_by_skip_bad_is_refused_when_shards_exist(tmp_path, kaldi_dir):
    out = tmp_path / "shards"
    pack_data(kaldi_dir.scp, kaldi_dir.text, out, utts_per_file=10, progress=False)
    lines = kaldi_dir.text.read_text().splitlines(keepends=True)
    kaldi_dir.text.write_text("".join(lines[:-1]))  # an utterance loses its label: the plan changes
    with pytest.raises(ConfigError, match="other inputs or options"):
        pack_data(kaldi_dir.scp, kaldi_dir.text, out, utts_per_file=10, skip_bad=True, progress=False)


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_every_output_file_gets_the_mode_the_umask_gives(tmp_path, kaldi_dir, umask):
    from seqshard.formats.files import default_file_mode

    old = os.umask(umask)
    default_file_mode.cache_clear()
    try:
        out = tmp_path / "shards"
        pack_data(kaldi_dir.scp, kaldi_dir.text, out, utts_per_file=10, filter_group=["0:30", "30:100"], progress=False)
        assert main(["index", "--quiet", str(out)]) == 0
        files = [p for p in out.rglob("*") if p.is_file()]
        assert {p.name for p in files} >= {
            "index.json",
            "pack_report.json",
            "run.json",
            "planned.json",
            "data-00000.tar",
        }
        assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: oct(0o666 & ~umask) for p in files}
    finally:
        os.umask(old)
        default_file_mode.cache_clear()


def test_temporary_files_left_by_killed_runs_are_removed(tmp_path, kaldi_dir):
    out = tmp_path / "shards"
    pack_data(kaldi_dir.scp, kaldi_dir.text, out, utts_per_file=10, progress=False)
    stale = [out / ".index.json.k2j3.partial", out / ".seqshard-pack" / ".run.json.x8a.partial"]
    recent = out / ".pack_report.json.now1.partial"
    for path in [*stale, recent]:
        path.write_text("{")
    for path in stale:
        os.utime(path, (time.time() - 3600, time.time() - 3600))
    pack_data(kaldi_dir.scp, kaldi_dir.text, out, utts_per_file=10, progress=False)
    assert not any(p.exists() for p in stale)
    assert recent.exists()  # another process may be about to rename it


def test_a_failed_shard_write_names_the_file_and_leaves_no_partial_file(tmp_path, kaldi_dir, monkeypatch):
    import errno

    calls = {"n": 0}
    real_writev = os.writev

    def disk_fills_up(fd, buffers):
        calls["n"] += 1
        if calls["n"] > 30:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_writev(fd, buffers)

    monkeypatch.setattr(os, "writev", disk_fills_up)
    out = tmp_path / "shards"
    with pytest.raises(
        OutputError, match=r"\.data-0000\d\.tar\.partial: cannot write: No space left on device\. Fix: free space"
    ):
        pack_data(kaldi_dir.scp, kaldi_dir.text, out, utts_per_file=10, progress=False)
    assert not list(out.glob(".*.partial"))


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unshare -rm (user and mount namespaces) to mount a tmpfs")
@pytest.mark.parametrize("mount", ["size=200k", "ro"])
def test_a_full_or_read_only_disk_is_a_clear_error_on_the_command_line(tmp_path, mount):
    data = write_kaldi_dir(tmp_path / "kaldi", speakers=6, per_speaker=20, dim=40, frames=(50, 100))
    disk = tmp_path / "disk"
    disk.mkdir()
    command = (
        f"mount -t tmpfs -o {mount} tmpfs {disk} && "
        f"{sys.executable} -m seqshard pack --scp {data.scp} --text {data.text} --out {disk}/out --utts-per-file 20 --quiet; "
        f"echo exit=$?; find {disk} -name '*.partial'"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")}
    result = subprocess.run(["unshare", "-rm", "sh", "-c", command], capture_output=True, text=True, env=env)
    assert "exit=1" in result.stdout, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert f"seqshard pack: error: {disk}/out" in result.stderr
    if mount == "ro":
        assert "Read-only file system. Fix: choose an output folder you can write to." in result.stderr
    else:
        assert "No space left on device. Fix: free space on that disk" in result.stderr
        assert ".partial" not in result.stdout  # no half-written shard stays on the full disk


def test_command_line_messages_name_flags_not_python_parameters(tmp_path, kaldi_dir, capsys):
    out = tmp_path / "out"
    assert main(["pack", "--scp", str(kaldi_dir.root), "--text", str(kaldi_dir.text), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"{kaldi_dir.root} is a folder; --scp ... takes files (e.g. {kaldi_dir.root / 'feats.scp'}" in err
    assert main(["pack", "--scp", str(tmp_path / "nope.scp"), "--text", str(kaldi_dir.text), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "the file does not exist. Fix: check --scp" in err and "f_scps" not in err and "skip" not in err
    with pytest.raises(ConfigError, match=r"overwrite=True cannot be combined with num_parts=2"):
        pack_data(kaldi_dir.scp, kaldi_dir.text, out, num_parts=2, overwrite=True, progress=False)
    args = ["pack", "--scp", str(kaldi_dir.scp), "--text", str(kaldi_dir.text), "--out", str(out), "--quiet"]
    assert main([*args, "--num-parts", "2", "--overwrite"]) == 1
    assert "--overwrite cannot be combined with --num-parts 2" in capsys.readouterr().err


def test_inputs_that_are_not_plain_files_and_an_output_that_is_a_file(tmp_path, kaldi_dir, capsys):
    args = ["pack", "--scp", str(kaldi_dir.scp), "--text", str(kaldi_dir.text), "--quiet"]
    assert main([*args, "--out", str(tmp_path / "o"), "--num-frames", str(tmp_path / "nofile")]) == 1
    assert "the file does not exist. Fix: check --num-frames" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert main([*args, "--out", str(tmp_path / "afile")]) == 1
    assert "is a file, not a folder" in capsys.readouterr().err
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert main(["pack", "--scp", str(kaldi_dir.scp), "--text", str(fifo), "--out", str(tmp_path / "o2")]) == 1
    assert "is not a regular file (a pipe?)" in capsys.readouterr().err


def test_empty_labels_are_counted_and_packed(tmp_path, kaldi_dir, caplog):
    lines = kaldi_dir.text.read_text().splitlines()
    lines[3] = lines[3].split()[0]  # a key alone: an empty transcript
    kaldi_dir.text.write_text("\n".join(lines) + "\n")
    with caplog.at_level("WARNING", logger="seqshard"):
        report = pack_data(kaldi_dir.scp, kaldi_dir.text, tmp_path / "out", progress=False)
    assert report.packed == 48 and report.label_issues == {"empty_label": 1}
    assert "1 label is empty" in caplog.text
