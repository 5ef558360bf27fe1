"""`seqshard demo`, the README's first command, at a smaller size: it packs, inspects, streams,
resumes and trains with 2 processes, and says where its outputs are."""

import pytest

from seqshard.cli import main as cli


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_the_demo_runs_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "demo"
    assert cli(["demo", "--out", str(out), "--utts", "240", "--train-epochs", "2"]) == 0
    printed = capsys.readouterr().out
    assert "240 distinct of 240 packed" in printed
    assert "identical to the uninterrupted run: True" in printed
    assert "finished: 2 epochs" in printed and "data-wait" in printed and "dev loss" in printed
    assert "demo OK" in printed and "next:" in printed
    assert (out / "train" / "ckpt.pt").is_file() and (out / "hyper-p.json").is_file()
    assert cli(["config", str(out / "hyper-p.json")]) == 0
