"""`seqshard demo`, the README's first command, at a smaller size: it packs, inspects, streams,
resumes and trains with 2 processes, and says where its outputs are."""

import importlib.util
import re
import shlex

import pytest

from seqshard.app.demo import where_next
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
    for epoch in range(2):  # its bar was "25/19 batch (131.6%)", then "done" again
        bar = [line for line in printed.splitlines() if line.lstrip().startswith(f"epoch {epoch}: ")]
        assert sum("done in" in line for line in bar) == 1, bar
        assert all(float(p) <= 100 for line in bar for p in re.findall(r"\(([\d.]+)%\)", line)), bar
    assert (out / "train" / "ckpt.pt").is_file() and (out / "hyper-p.json").is_file()
    assert cli(["config", str(out / "hyper-p.json")]) == 0


def test_the_demos_next_steps_run_from_an_installed_package(tmp_path):
    from torch.distributed.run import get_args_parser

    from seqshard.app.trainer import parse_args

    text = where_next(tmp_path, f"{tmp_path}/shards/*/data-*.tar", None, train_epochs=2)
    line = next(line for line in text.splitlines() if "torchrun" in line)
    command, note = line.split("   (")
    assert "examples/train_ddp.py runs the same trainer" in note  # the script exists only in a clone
    words = shlex.split(command)
    launcher = get_args_parser().parse_args(words[1:])
    assert launcher.module and launcher.training_script == "seqshard.app.trainer"  # it was examples/train_ddp.py
    assert importlib.util.find_spec(launcher.training_script) is not None
    assert parse_args(launcher.training_script_args).config == f"{tmp_path}/hyper-p.json"
    assert "hyper-p.json" not in where_next(tmp_path, "p", None, train_epochs=0)  # no training, no config
