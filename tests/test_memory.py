"""Memory: calibrated budgets per length bucket stay under what a step can take, a batch split
into parts keeps its samples and its gradients, and a step that runs out of memory runs in
parts (its bucket's limit lowered) instead of losing its batch."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from trainer_probe import SCENARIOS

from conftest import pack_small
from gloo_ranks import start_script, wait_for
from seqshard import build_loaders, make_loader
from seqshard.app.ctc_model import SmallCTC
from seqshard.app.train_memory import MemoryGuard, StepRunner, largest_part
from seqshard.cli import main
from seqshard.errors import ConfigError, InputError
from seqshard.extend import split_batch

PROBE = Path(__file__).parent / "trainer_probe.py"
LIMIT = 40_000  # B x T^2 a step takes before it runs out of memory
CALLS: list[tuple[int, int]] = []


def step_under_limit(batch):
    """A training step whose memory grows with B x T^2 (attention), out of memory above LIMIT."""
    size, longest, _ = batch["feats"].shape
    CALLS.append((size, longest))
    if size * longest * longest > LIMIT:
        raise torch.OutOfMemoryError(f"{size} x {longest}^2 is over {LIMIT}")


FRAME_BYTES = 16 << 10  # host memory a step takes per padded frame
FRAME_SECONDS = 1e-5  # and time


def step_on_cpu(batch):
    """A CPU step that really takes FRAME_BYTES of memory and FRAME_SECONDS per padded frame (the
    machine's own out-of-memory stood for by a MemoryError past 256 MiB)."""
    frames = batch["feats"].shape[0] * batch["feats"].shape[1]
    if frames * FRAME_BYTES > 256 << 20:
        raise MemoryError
    torch.ones(frames * FRAME_BYTES, dtype=torch.uint8)  # written: resident
    time.sleep(frames * FRAME_SECONDS)


def slow_step(batch):
    time.sleep(0.3)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """200 utterances of 5-79 frames."""
    return pack_small(tmp_path_factory.mktemp("memory"), utts_per_file=25, speakers=10, per_speaker=20, frames=(5, 80))


def test_calibrated_budgets_never_exceed_the_limit_and_use_most_of_it(shards, tmp_path, capsys):
    out = tmp_path / "budgets.json"
    code = main(["calibrate", shards.pattern, "--step", "test_memory:step_under_limit", "--out", str(out)]
                + ["--device", "cpu", "--buckets", "6"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    table = capsys.readouterr().out.splitlines()
    written = json.loads(out.read_text())
    assert (
        table[0].split() == ["bucket", "longest", "batch", "size", "budget", "peak", "bound"]
        and len(table) == 1 + 6 + 1
    )
    assert all(line.split()[-1] == "memory" for line in table[1:-1]), table
    assert written["device"] == "cpu" and written["step"] == "test_memory:step_under_limit" and written["date"]
    for bucket in written["buckets"]:  # the largest batch at the bucket's longest length, to within 1/64
        largest = LIMIT // bucket["longest"] ** 2
        assert largest * 63 / 64 <= bucket["batch_size"] <= largest
        assert bucket["budget"] == bucket["batch_size"] * bucket["longest"]
    loader = make_loader(shards.pattern, budgets=str(out), num_workers=0, seed=1)
    used = []
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        used += [len(batch["keys"]) * int(batch["feat_lens"].max()) ** 2 / LIMIT for batch in loader]
    assert max(used) <= 1 and sum(used) / len(used) >= 0.5, (max(used), sum(used) / len(used))


def test_budgets_are_checked_where_they_are_given(shards, tmp_path):
    with pytest.raises(InputError, match=r"none\.json: no such file.*seqshard calibrate"):
        make_loader(shards.pattern, budgets=str(tmp_path / "none.json"))
    (tmp_path / "other.json").write_text('{"format": "other"}')
    with pytest.raises(ConfigError, match=r"other\.json is not a seqshard budgets file"):
        make_loader(shards.pattern, budgets=str(tmp_path / "other.json"))
    budgets = {"format": "seqshard-budgets", "version": 1, "bounds": [30], "buckets": [{"longest": 29, "budget": 600}]}
    with pytest.raises(ConfigError, match="1 bounds need 2 buckets"):
        make_loader(shards.pattern, budgets=budgets)
    budgets["buckets"].append({"longest": 79, "budget": 400})
    with pytest.raises(ConfigError, match="without batch_size, batch_frames"):
        make_loader(shards.pattern, budgets=budgets, batch_frames=1000)
    loader, _ = build_loaders(
        {"train": {"option": {"large_dataset": True, "trset": shards.pattern, "budgets": budgets}}}
    )
    assert loader.options.batching.budgets.budgets == (600, 400)  # hyper-p.json takes them too
    for batch in make_loader(shards.pattern, budgets=budgets, num_workers=0):
        longest = int(batch["feat_lens"].max())
        assert len(batch["keys"]) * longest <= (600 if longest < 30 else 400)


@pytest.fixture(scope="module")
def batch(shards):
    """A batch of 9 utterances, with labels (the loader's texts split into characters)."""
    units = shards.out.parent / "units.txt"
    letters = sorted({c for text in shards.data.labels.values() for c in text if c != " "})
    units.write_text("".join(f"{c} {n + 1}\n" for n, c in enumerate(letters)) + f"<unk> {len(letters) + 1}\n")
    return next(iter(make_loader(shards.pattern, tokenizer=units, split="char", batch_size=9, num_workers=0)))


def test_split_batch_keeps_keys_and_frames_exactly(batch):
    for parts in (1, 2, 4, 9, 20):
        pieces = split_batch(batch, parts)
        assert len(pieces) == min(parts, 9)
        assert [key for piece in pieces for key in piece["keys"]] == batch["keys"]
        assert [text for piece in pieces for text in piece["texts"]] == batch["texts"]
        row = 0
        for piece in pieces:
            for name, lengths in (("feats", "feat_lens"), ("labels", "label_lens")):
                assert piece[name].shape[1] == int(piece[lengths].max())  # padded to its own longest
            for feats, count, labels, tokens in zip(
                piece["feats"], piece["feat_lens"], piece["labels"], piece["label_lens"]
            ):
                assert torch.equal(feats[:count], batch["feats"][row, :count])
                assert torch.equal(labels[:tokens], batch["labels"][row, :tokens])
                row += 1
        assert row == 9


@pytest.fixture
def trainable(batch):
    """The batch with labels short enough for CTC to align them to the model's 4x fewer frames."""
    label_lens = torch.minimum(batch["label_lens"], (batch["feat_lens"] + 3) // 4 // 2)
    return {**batch, "label_lens": label_lens, "labels": batch["labels"][:, : int(label_lens.max())]}


def _ctc_loss():
    ctc = nn.CTCLoss(zero_infinity=True)

    def loss_of(model, batch):
        log_probs, lengths = model(batch["feats"], batch["feat_lens"])
        return ctc(log_probs.transpose(0, 1), batch["labels"], lengths, batch["label_lens"])

    return loss_of


def _gradients(model):
    found = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return found


def test_gradients_of_a_batch_in_parts_equal_the_whole(trainable):
    torch.manual_seed(0)
    model = SmallCTC(trainable["feats"].shape[2], int(trainable["labels"].max()) + 1, hidden=32, layers=1)
    with torch.no_grad():
        model.normalise.bias.fill_(0.5)  # padding frames normalise to this: the model must mask them
    guard = MemoryGuard()
    runner = StepRunner(model, _ctc_loss(), guard, print)
    whole_loss = float(runner.backward(trainable))
    whole = _gradients(model)
    assert 0 < whole_loss < float("inf") and whole.count_nonzero() > len(whole) // 2
    lengths, longest = trainable["feat_lens"], trainable["feats"].shape[1]
    for parts, pieces in ((2, 2), (4, 4), (16, 9)):  # the limit of a bucket that ran out of memory splits its batches
        guard.limits[0] = largest_part(lengths, pieces)
        assert guard.parts_for(lengths, longest) == parts
        assert float(runner.backward(trainable)) == pytest.approx(whole_loss, rel=1e-6)
        assert (_gradients(model) - whole).abs().max() <= 1e-5


def test_a_step_that_runs_out_of_memory_runs_in_parts_and_lowers_its_buckets_limit(trainable):
    batch = trainable
    torch.manual_seed(0)
    model = SmallCTC(batch["feats"].shape[2], int(batch["labels"].max()) + 1, hidden=32, layers=1)
    loss_of = _ctc_loss()
    limit = batch["feats"].shape[0] * batch["feats"].shape[1] // 3  # padded frames

    def limited(model, part):
        if part["feats"].shape[0] * part["feats"].shape[1] > limit:
            raise torch.OutOfMemoryError("over the limit")
        return loss_of(model, part)

    StepRunner(model, loss_of, MemoryGuard(), print).backward(batch)
    whole = _gradients(model)
    guard, said = MemoryGuard((20, 60)), []
    runner = StepRunner(model, limited, guard, said.append)
    runner.backward(batch)
    assert (_gradients(model) - whole).abs().max() <= 1e-5  # nothing lost: the whole batch's update
    assert guard.out_of_memory == 2 and said[-1].endswith("running it in 4 parts")
    bucket = guard.bucket_of(int(batch["feat_lens"].max()))
    assert 0 < guard.limits[bucket] <= limit
    runner.backward(batch)  # the bucket's lowered limit splits it before it runs out
    assert guard.out_of_memory == 2 and guard.largest[bucket] == (9, int(batch["feat_lens"].max()))


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_memory_running_out_anywhere_in_a_ddp_step_gives_every_rank_the_whole_batchs_update(tmp_path):
    """2 gloo ranks, a model of several DDP buckets; memory runs out on rank 1 (probe's SCENARIOS):
    both ranks end each step with the gradients of the step where it does not, DDP all-reduces
    them during the backward pass, and no all_reduce of the trainer's own runs."""
    wait_for(start_script(PROBE, ["runner", str(tmp_path)], tmp_path, world_size=2), 120)
    ranks = [json.loads((tmp_path / f"runner{rank}.json").read_text()) for rank in range(2)]
    scenarios = [*SCENARIOS, "none again"]
    for rank, found in enumerate(ranks):
        assert found["all_reduce calls"] == 0  # gradients averaged by DDP alone, also after running out
        for number, scenario in enumerate(scenarios):
            assert found[scenario]["largest difference"] <= 1e-6, (rank, scenario, found[scenario])
            assert found[scenario]["loss"] == pytest.approx(found["none"]["loss"], rel=1e-6), (rank, scenario)
            assert found[scenario]["sum"] == ranks[0][scenario]["sum"], scenario  # the same gradients on both ranks
            ran_out = min(number, len(SCENARIOS) - 1) if rank == 1 else 0
            assert found[scenario]["out of memory"] == ran_out, (rank, scenario, found[scenario])
    sent = ranks[0]["none again"]["sent with"]  # per bucket: the parameters whose gradients were in when it went
    assert len(sent) > 2 and sent[0] < ranks[0]["parameters"], sent  # all-reduced during the backward pass
    assert ranks[1]["backward"]["buckets sent"] >= 1  # a bucket had gone when memory ran out


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("buckets", 0, "buckets must be >= 1"),
        ("dim", 0, "dim must be >= 1"),  # synthetic batches of 0 columns: budgets of nothing
        ("vocab_size", 1, "vocab_size must be a whole number >= 2"),  # label ids from 1 would be out of range
        ("max_memory", -5, "max_memory must be >= 1"),
        ("memory_fraction", 2.0, "memory_fraction must be > 0 and <= 1"),  # on CPU it went unread
        ("buckets", 10**9, "buckets must be >= 1 and <= 1024"),  # cutting 10**9 bounds took hours
        ("max_batch_size", 10**6, "max_batch_size must be >= 1 and <= 16384"),
        ("vocab_size", 10**30, "vocab_size must be a whole number >= 2 and <= 2147483647"),
        ("time_limit", 0, "time_limit must be > 0"),
        ("max_step_seconds", float("nan"), "max_step_seconds must be a finite number"),
        ("out", "/", "out='/' is a folder"),  # found before calibrating, not when writing
        ("out", "no/such/folder/b.json", "is in no folder that exists"),
    ],
)
@pytest.mark.timeout(60)
def test_calibrate_refuses_settings_that_would_calibrate_nothing(shards, option, value, message):
    from seqshard.tools.calibrate import calibrate

    with pytest.raises(ConfigError, match=message):
        calibrate(shards.pattern, step_under_limit, device="cpu", **{option: value})


def resident_bytes() -> int:
    """This process's resident memory, what it had freed given back first (as calibrate does:
    objects collected, then the heap trimmed; without the collection a CI run's baseline held
    ~27 MB that calibrate then freed, and its budgets passed the cap by that much)."""
    import gc

    from seqshard.tools.calibrate import trim_heap

    gc.collect()
    trim_heap()
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


@pytest.mark.timeout(60)
def test_a_cpu_calibration_keeps_under_its_memory_cap_and_step_time_and_ends_in_time(shards, tmp_path, capsys):
    cap = 48 << 20  # bytes above what the process holds now
    out = tmp_path / "budgets.json"
    started = time.monotonic()
    args = ["calibrate", shards.pattern, "--step", "test_memory:step_on_cpu", "--out", str(out), "--device", "cpu"]
    code = main([*args, "--buckets", "3", "--max-memory", str(resident_bytes() + cap), "--time-limit", "30"])
    assert code == 0, capsys.readouterr().err
    assert time.monotonic() - started < 30
    written = json.loads(out.read_text())
    assert written["buckets"] and all(b["bound"] == "memory" for b in written["buckets"]), written
    for bucket in written["buckets"]:  # under the cap (2 MiB: what the process holds may shrink), and most of it
        assert cap / 3 <= bucket["budget"] * FRAME_BYTES <= cap + (2 << 20), bucket
        assert bucket["peak_bytes"] <= written["memory_limit"]

    # a step's time bounds it too: a step of more than 0.1 s does not fit
    code = main([*args, "--buckets", "2", "--max-step-seconds", "0.1", "--max-batch-size", "2000"])
    assert code == 0, capsys.readouterr().err
    written = json.loads(out.read_text())
    assert all(b["bound"] == "time" and b["budget"] * FRAME_SECONDS <= 0.1 for b in written["buckets"]), written
    assert written["step_seconds"] == 0.1


@pytest.mark.timeout(60)
def test_a_calibration_ends_at_its_time_limit(shards, tmp_path, capsys):
    started = time.monotonic()
    code = main(["calibrate", shards.pattern, "--step", "test_memory:slow_step", "--out", str(tmp_path / "b.json")]
                + ["--device", "cpu", "--time-limit", "1", "--max-step-seconds", "10"])  # fmt: skip
    assert time.monotonic() - started < 10
    error = capsys.readouterr().err
    assert code == 1 and "--time-limit 1.0 ran out at bucket 0 of 8" in error, error
    assert not (tmp_path / "b.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there")
def test_calibrate_on_a_device_torch_does_not_have_is_refused(shards, tmp_path, capsys):
    args = ["calibrate", shards.pattern, "--step", "test_memory:step_under_limit", "--out", str(tmp_path / "b.json")]
    assert main([*args, "--device", "cuda"]) == 1
    assert "--device cuda, and torch finds 0 CUDA device(s) here" in capsys.readouterr().err
    assert main([*args, "--device", "tpu"]) == 1
    assert "device must be None, 'cpu', 'cuda' or 'cuda:N', got 'tpu'" in capsys.readouterr().err


def test_the_step_is_a_module_or_a_file_of_its_own(shards, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "my steps"
    folder.mkdir()
    (folder / "helper.py").write_text("LIMIT = 20_000\n")
    (folder / "step.py").write_text(
        "import torch\nfrom helper import LIMIT\n\n"
        "def train_step(batch):\n"
        "    if batch['feats'].shape[0] * batch['feats'].shape[1] > LIMIT:\n"
        "        raise torch.OutOfMemoryError('over')\n"
    )
    (folder / "broken.py").write_text("def train_step(batch:\n")
    (tmp_path / "dir.py").mkdir()
    monkeypatch.chdir(tmp_path)
    args = ["calibrate", shards.pattern, "--out", str(tmp_path / "b.json"), "--device", "cpu", "--buckets", "2"]
    assert main([*args, "--step", "my steps/step.py:train_step"]) == 0, capsys.readouterr().err
    written = json.loads((tmp_path / "b.json").read_text())
    assert written["step"] == "my steps/step.py:train_step"
    assert all(b["budget"] <= 20_000 for b in written["buckets"]), written
    forms = "give MODULE:FUNCTION (a module imported from the working folder or the path, e.g. mymodel:train_step) or "
    for step, message in [
        ("../../evil:x", "--step ../../evil:x: '../../evil' is neither a module's name nor a .py file: " + forms),
        ("my steps/missing.py:train_step", "my steps/missing.py does not exist: " + forms),
        ("dir.py:train_step", "dir.py is not a regular file: " + forms),
        ("my steps/step.py:other", "my steps/step.py has no function 'other'"),
        ("my steps/broken.py:train_step", "my steps/broken.py cannot be imported ("),
        ("my steps/step.py", "--step my steps/step.py: " + forms),
        ("no_such_module:step", "cannot import no_such_module (No module named 'no_such_module')"),
    ]:
        assert main([*args, "--step", step]) == 1, step
        error = capsys.readouterr().err
        assert message in error and "Traceback" not in error, error


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("big.json", "1" + "0" * 400, r"buckets\[1\]\.budget is 1000.*, not >= 1 and <= 9007199254740992"),
        ("inf.json", "1e400", r"buckets\[1\]\.budget is inf, not a whole number"),
        ("digits.json", "1" * 5000, "cannot be read as JSON"),
        ("deep.json", "[" * 100_000 + "]" * 100_000, "nest deeper than Python reads"),
    ],
)
def test_a_budgets_file_that_is_no_budgets_file_is_named(shards, tmp_path, name, text, message):
    budgets = {"format": "seqshard-budgets", "version": 1, "bounds": [30], "buckets": [{"longest": 29, "budget": 600}]}
    budgets["buckets"].append({"longest": 79, "budget": "BUDGET"})
    path = tmp_path / name
    path.write_text(json.dumps(budgets).replace('"BUDGET"', text))
    with pytest.raises((ConfigError, InputError), match=rf"{name}.*{message}.*seqshard calibrate"):
        make_loader(shards.pattern, budgets=str(path), num_workers=0)
