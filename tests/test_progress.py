"""Progress: plain periodic lines when stderr is a log file, tqdm bars on a terminal."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import write_kaldi_dir
from seqshard.progress import Progress

LINE = re.compile(r"^pack: (\d+)/(\d+) utt \((\d+\.\d)%\)")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def assert_plain(text: str) -> list[str]:
    assert "\x1b" not in text and "\r" not in text, repr(text[:300])
    assert text.endswith("\n")
    return text.splitlines()


def test_log_file_gets_plain_lines_and_a_final_one(capsys):
    clock = FakeClock()
    with Progress(interval=0, clock=clock) as bars:
        advance = bars.bar("pack", 4800, unit="utt")
        for _ in range(4):
            clock.now += 1.0
            advance(1200)
    lines = assert_plain(capsys.readouterr().err)
    assert lines[0] == "pack: 1200/4800 utt (25.0%), 1200 utt/s, about 3.0 s left"
    assert lines[-1] == "pack: 4800/4800 utt (100.0%), 1200 utt/s, done in 4.0 s"
    assert len(lines) == 4  # reaching the total wrote the final line; closing adds none


def test_interval_throttles_and_close_writes_the_true_final_count(capsys):
    clock = FakeClock()
    with Progress(interval=10, clock=clock) as bars:
        advance = bars.bar("pack", 3000, unit="utt")
        for _ in range(20):  # 20 s of advances, one per second
            clock.now += 1.0
            advance(100)
    lines = assert_plain(capsys.readouterr().err)
    # one line after 10 s, one after 20 s, then the line closing the bar at 2000 of 3000
    assert [LINE.match(line).group(1) for line in lines] == ["1000", "2000", "2000"]
    assert lines[1].endswith("about 10 s left")
    assert lines[2] == "pack: 2000/3000 utt (66.7%), 100 utt/s, stopped after 20 s"
    capsys.readouterr()

    with Progress(interval=10, clock=clock) as bars:
        advance = bars.bar("pack", 3000, unit="utt")
        for _ in range(25):
            clock.now += 1.0
            advance(100)
    lines = assert_plain(capsys.readouterr().err)
    assert [LINE.match(line).group(1) for line in lines] == ["1000", "2000", "2500"]
    assert lines[-1] == "pack: 2500/3000 utt (83.3%), 100 utt/s, stopped after 25 s"


def test_final_line_comes_when_the_total_is_reached_not_at_the_end_of_all_bars(capsys):
    clock = FakeClock()
    with Progress(clock=clock) as bars:
        scan = bars.bar("scan inputs", 250_000_000, unit="B")
        clock.now += 2.0
        scan(250_000_000)
        pack = bars.bar("pack", 10, unit="utt")
        clock.now += 5.0
        pack(10)
    assert assert_plain(capsys.readouterr().err) == [
        "scan inputs: 250.0/250.0 MB (100.0%), 125.0 MB/s, done in 2.0 s",
        "pack: 10/10 utt (100.0%), 2 utt/s, done in 5.0 s",
    ]


def test_an_estimated_total_shows_no_percentage_and_done_once(capsys):
    clock = FakeClock()
    with Progress(interval=0, clock=clock) as bars:
        advance = bars.bar("epoch 0", 19, unit="batch", exact=False)
        for _ in range(25):
            clock.now += 1.0
            advance(1)
    lines = assert_plain(capsys.readouterr().err)
    assert lines[0] == "epoch 0: 1/~19 batch, 1 batch/s, about 18 s left"
    assert lines[19] == "epoch 0: 20 batch, 1 batch/s"  # past the estimate: the count alone
    assert lines[-1] == "epoch 0: 25 batch, 1 batch/s, done in 25 s"  # it was 25/19 batch (131.6%)
    assert not any("%" in line for line in lines) and sum("done" in line for line in lines) == 1
    capsys.readouterr()
    with Progress(interval=100, clock=clock) as bars:
        bars.bar("epoch 1", 19, unit="batch", exact=False)(17)
    assert assert_plain(capsys.readouterr().err) == ["epoch 1: 17 batch, done in 0.0 s"]


def test_a_count_past_an_exact_total_never_shows_more_than_100_percent(capsys):
    clock = FakeClock()
    with Progress(interval=0, clock=clock) as bars:
        advance = bars.bar("epoch 0", 32, unit="batch")
        clock.now += 1.0
        advance(32)
        advance(1)
    lines = assert_plain(capsys.readouterr().err)
    assert lines == [
        "epoch 0: 32/32 batch (100.0%), 32 batch/s, done in 1.0 s",
        "epoch 0: 33/33 batch (100.0%), 33 batch/s, 1 more than the 32 planned",
    ]  # it was 33/32 batch (103.1%) and a second "done"


def test_a_terminal_bar_grows_its_total_and_ends_an_estimate_at_the_true_count(capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with Progress() as bars:
        bars.bar("epoch 0", 19, unit="batch", exact=False)(25)
        bars.bar("epoch 1", 19, unit="batch", exact=False)(17)
    err = capsys.readouterr().err
    assert "25/25" in err and "25/19" not in err and "17/17" in err
    assert not re.search(r"(1\d[1-9]|1[1-9]\d|[2-9]\d\d)%", err)  # nothing above 100%


def test_bytes_in_gigabytes(capsys):
    clock = FakeClock()
    with Progress(interval=0, clock=clock) as bars:
        advance = bars.bar("read", 3_000_000_000, unit="B")
        clock.now += 10.0
        advance(1_500_000_000)
    lines = assert_plain(capsys.readouterr().err)
    assert lines[0] == "read: 1.50/3.00 GB (50.0%), 150.0 MB/s, about 10 s left"
    assert lines[1] == "read: 1.50/3.00 GB (50.0%), 150.0 MB/s, stopped after 10 s"


def test_terminal_gets_tqdm(capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with Progress(interval=0) as bars:
        advance = bars.bar("pack", 100, unit="utt")
        for _ in range(100):
            advance(1)
    err = capsys.readouterr().err
    assert "\r" in err and "100/100" in err and "|" in err  # tqdm redraws its bar in place


def test_disabled_writes_nothing(capsys):
    with Progress(enabled=False, interval=0) as bars:
        bars.bar("pack", 10)(10)
    assert capsys.readouterr().err == ""


def test_pack_command_with_stderr_to_a_file(tmp_path: Path):
    data = write_kaldi_dir(tmp_path / "kaldi", speakers=4, per_speaker=10)
    log = tmp_path / "pack.log"
    for jobs in (1, 2):
        with open(log, "w") as stderr:
            subprocess.run(
                [sys.executable, "-m", "seqshard", "pack", "--scp", str(data.scp), "--text", str(data.text)]
                + ["--out", str(tmp_path / f"shards{jobs}"), "--utts-per-file", "7", "--jobs", str(jobs)],
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                check=True,
                timeout=120,
            )
        lines = assert_plain(log.read_text())
        packed = [line for line in lines if line.startswith("pack")]
        assert packed, lines
        assert re.match(r"^pack( \(2 workers\))?: 40/40 utt \(100\.0%\), .*, done in ", packed[-1]), packed
        assert any(line.startswith("scan: ") and "(100.0%)" in line for line in lines), lines


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
