"""The example trainer's checkpoint records the run's settings: a resume names each change,
applies a new learning rate or schedule from the next step, and refuses another model shape or
tokenizer (one of the same size with other ids too) with an error instead of torch's traceback;
a checkpoint it cannot read is named, never run; ``--skip-steps`` ranges add up and stay within
an epoch."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gloo_ranks import kill, start_script
from seqshard.app.train_checkpoint import changes_since, read_checkpoint
from seqshard.app.train_epoch import lr_schedule
from seqshard.app.train_setup import budgets_elsewhere
from seqshard.errors import ConfigError
from seqshard.formats.budgets import Budgets

ROOT = Path(__file__).parent.parent
SETTINGS = {"batch_frames": 3000, "epochs": 1, "save_every": 50, "log_every": 50, "hidden": 32, "layers": 1,
            "lr": 0.004, "warmup_steps": 4, "num_workers": 0}  # fmt: skip
OPTIONS = ["--demo-utts", "60"] + [f"--set={k}={json.dumps(v)}" for k, v in SETTINGS.items()]


def trainer(folder: Path, *args: str | Path) -> subprocess.CompletedProcess:
    """One run of the example trainer (examples/train_ddp.py, which runs seqshard.app.trainer's main)
    without a launcher, in a process forked from tests/gloo_ranks.py's server that has imported
    torch (a fresh interpreter costs 2-4 s of CPU)."""
    logs = folder / f"logs{len(list(folder.glob('logs*')))}"
    command = [*OPTIONS, "--out", str(folder / "run"), *map(str, args)]
    processes = start_script(ROOT / "examples" / "train_ddp.py", command, logs, cwd=folder, stderr_apart=True)
    if processes[0].wait(150) is None:
        kill(processes)
        pytest.fail(f"the trainer still ran after 150 s: {(logs / 'rank0.log').read_text()[-3000:]}")
    output, errors = (logs / "rank0.log").read_text(), (logs / "rank0.err").read_text()
    return subprocess.CompletedProcess(command, processes[0].returncode, output, errors)


def same_size_other_ids(units: Path, out: Path) -> Path:
    """The units file with its characters' ids rotated (same tokens, same vocabulary size)."""
    pairs = [line.split() for line in units.read_text(encoding="utf-8").splitlines()]
    fixed = [p for p in pairs if p[0].startswith("<")]
    moved = [p for p in pairs if not p[0].startswith("<")]
    ids = [i for _, i in moved]
    rotated = [(token, unit_id) for (token, _), unit_id in zip(moved, ids[1:] + ids[:1])]
    out.write_text("".join(f"{t} {i}\n" for t, i in fixed + rotated), encoding="utf-8")
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_resume_applies_a_new_schedule_and_refuses_another_model_or_tokenizer(tmp_path):
    first = trainer(tmp_path, "--stop-after-steps", "3")
    assert first.returncode == 0, first.stdout + first.stderr

    steps = tmp_path / "steps.jsonl"
    changed = trainer(tmp_path, "--set=lr=0.05", "--set=warmup_steps=2", "--stop-after-steps=2", "--steps-file", steps)
    assert changed.returncode == 0, changed.stdout + changed.stderr
    assert (
        "settings changed since the checkpoint, applied from the next step: lr 0.004 -> 0.05; warmup_steps 4 -> 2"
    ) in changed.stdout.splitlines()
    rates = {r["step"]: r["lr"] for r in map(json.loads, steps.read_text().splitlines())}
    assert rates == pytest.approx({4: 0.05 * lr_schedule(3, 2), 5: 0.05 * lr_schedule(4, 2)})  # not the old rate

    other = same_size_other_ids(tmp_path / "run/data/kaldi/units.txt", tmp_path / "other-units.txt")
    refused = trainer(tmp_path, "--set=hidden=64", f"--set=tokenizer={json.dumps(str(other))}")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    named = "ckpt.pt was trained with another model shape or tokenizer: hidden 32 -> 64; tokenizer ids "
    assert named in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr, refused.stderr
    assert "resumed from" not in refused.stdout


def test_changes_named_and_refused_by_section(tmp_path):
    saved = {"model": {"hidden": 32}, "tokenizer": {"tokenizer ids": "a"}, "schedule": {"lr": 0.1}}
    saved["run"] = {"epochs": 2}
    same = json.loads(json.dumps(saved))
    assert changes_since(tmp_path, saved, same) is None
    more = {**same, "run": {"epochs": 4}, "schedule": {"lr": 0.2}}
    assert changes_since(tmp_path, saved, more).endswith("lr 0.1 -> 0.2; epochs 2 -> 4")
    with pytest.raises(ConfigError, match="another model shape or tokenizer: tokenizer ids a -> b"):
        changes_since(tmp_path, saved, {**same, "tokenizer": {"tokenizer ids": "b"}})
    assert "records no settings (saved by an older trainer)" in changes_since(tmp_path, None, same)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_skipped_ranges_add_up_stay_in_their_epoch_and_a_cut_checkpoint_is_named(tmp_path):
    refused = trainer(tmp_path, "--skip-steps", "1-100000")  # the run has 1 epoch of 9 steps
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "error: --skip-steps 1-100000 goes past the end of epoch 0, at step 9 (the run's last epoch: the " in (
        refused.stderr
    )
    assert "finished" not in refused.stdout and not (tmp_path / "run" / "ckpt.pt").exists()

    steps = tmp_path / "steps.jsonl"
    done = trainer(tmp_path, "--skip-steps=2-3", "--skip-steps=3-4", "--skip-steps=6", "--steps-file", steps)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "skipped steps 2-4 (--skip-steps): 3 steps, batches not read" in done.stdout.splitlines()
    assert "skipped steps 6-6 (--skip-steps): 1 step, batches not read" in done.stdout.splitlines()
    assert "lr_scheduler.step()" not in done.stderr  # no warning of torch's: the rate is set from the step
    rates = {r["step"]: r["lr"] for r in map(json.loads, steps.read_text().splitlines())}
    assert sorted(rates) == [1, 5, 7, 8, 9]
    assert rates == pytest.approx({step: 0.004 * lr_schedule(step - 1, 4) for step in rates})

    checkpoint = tmp_path / "run" / "ckpt.pt"
    checkpoint.write_bytes(checkpoint.read_bytes()[:3000])  # a copy cut short
    cut = trainer(tmp_path)
    assert cut.returncode == 1 and "Traceback" not in cut.stderr, cut.stderr
    assert f"error: {checkpoint} cannot be read as a checkpoint (PytorchStreamReader failed reading zip archive" in (
        cut.stderr
    )
    assert f"move it away (mv {checkpoint} {checkpoint}.bad) to train afresh from step 0" in cut.stderr


class Code:
    def __reduce__(self):
        return (os.system, ("touch ran",))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", r"cannot be read as a checkpoint \(EOFError; cut short\?\)"),
        (Code(), "holds other objects than tensors and plain values"),
        ({"model": {}}, "is not a checkpoint of this trainer .it holds no optimizer, loader, epoch, step."),
        ({"model": {}, "optimizer": {}, "loader": {}, "epoch": 0, "step": -3}, "its step is -3, not >= 0"),
        ({"model": {}, "optimizer": {}, "loader": [], "epoch": 0, "step": 3}, "its loader state is a list"),
    ],
)
def test_a_checkpoint_that_is_not_the_trainers_is_named_and_never_run(tmp_path, monkeypatch, content, message):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "ckpt.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    with pytest.raises(ConfigError, match=rf"{path} {message}|{path}: {message}"):
        read_checkpoint(path, torch.device("cpu"))
    assert not (tmp_path / "ran").exists()


def test_budgets_found_on_another_device_are_named():
    def loader(device):
        budgets = Budgets((30,), (600, 400), (29, 79), device)
        return SimpleNamespace(options=SimpleNamespace(batching=SimpleNamespace(budgets=budgets)))

    cpu = torch.device("cpu")
    assert budgets_elsewhere(loader("cpu"), cpu) is None and budgets_elsewhere(loader(None), cpu) is None
    note = budgets_elsewhere(loader("cuda:0 (NVIDIA H100 80GB HBM3)"), cpu)
    assert note.startswith(
        "note: the budgets were calibrated on cuda:0 (NVIDIA H100 80GB HBM3) and this run trains on cpu"
    )


@pytest.mark.parametrize("where", ["steps file", "checkpoint"])
def test_what_only_rank_0_writes_failing_stops_every_rank_with_a_message(tmp_path, where):
    """``--steps-file`` (opened by rank 0 alone) naming a folder, or a checkpoint rank 0 cannot
    write (a hard link at its temporary's name): rank 1 stops naming rank 0, rather than dying
    in gloo with a C++ trace when rank 0 has gone."""
    (tmp_path / "a-folder").mkdir()
    command = [*OPTIONS, "--out", str(tmp_path / "run"), "--stop-after-steps", "2"]
    if where == "steps file":
        command += ["--steps-file", str(tmp_path / "a-folder")]
    else:
        (tmp_path / "run").mkdir()
        (tmp_path / "users-file").write_text("the user's")
        os.link(tmp_path / "users-file", tmp_path / "run" / "ckpt.pt.partial")
    processes = start_script(
        ROOT / "examples" / "train_ddp.py", command, tmp_path / "logs", world_size=2, stderr_apart=True
    )
    if any(process.wait(150) is None for process in processes):
        kill(processes)
        pytest.fail("a rank still ran after 150 s")
    errors = [(tmp_path / "logs" / f"rank{rank}.err").read_text() for rank in (0, 1)]
    assert [process.returncode for process in processes] == [1, 1], errors
    said, doing = {
        "steps file": ("cannot be written", "set up"),
        "checkpoint": ("is a file with 2 names", "save the checkpoint"),
    }[where]
    assert said in errors[0], errors[0]
    assert errors[1].strip().endswith(f"error: rank 0 could not {doing} (its error says why); this rank stops too."), (
        errors[1]
    )
    assert (tmp_path / "users-file").read_text() == "the user's" if where == "checkpoint" else True
