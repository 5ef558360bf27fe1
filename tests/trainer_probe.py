"""One rank of the example trainer, or of its step runner, with probes; started by
tests/test_example_train.py and tests/test_memory.py (not a test module itself).

    python tests/trainer_probe.py train OUT EVENTS -- TRAINER ARGS   # seqshard.app.trainer.main
    python tests/trainer_probe.py runner OUT                         # StepRunner under DDP

``train`` writes OUT/probe<rank>.jsonl, a line per optimizer step n with what happened from the
start of step n's update to the start of the next's (that step's bookkeeping, then the next
step's batch, forward and backward; step 0: from the start to the first update):

- ``reads``: where seqshard's code read a tensor's value on the host (``item``, ``tolist``,
  ``numpy``, ``cpu``, ``int()``, ``float()``, ``bool()``, ``torch.cuda.synchronize``): on a GPU
  each waits for it; reads by torch itself (Adam's step counts, on the host) and those within
  the loader's iteration (``seqshard.app.train_epoch.timed``, another part's business) are not counted;
- ``all_reduce``: the trainer's calls of ``torch.distributed.all_reduce`` (dtype, size, async);
- ``buckets``: the gradient buckets DDP reduced (a comm hook on every DDP module);
- ``plan``: the trainer's calls of the loader's ``planned_batches`` (a walk of the plan).

EVENTS (JSON): ``{"oom": [rank, step]}`` makes memory run out on that rank in the backward pass
of that step, after the output layer's gradients (an exception raised between the LSTM and the
output layer); ``{"signal": [rank, step]}`` sends SIGTERM to that rank after that step's update.

``runner`` runs :class:`seqshard.app.train_memory.StepRunner` on 2 ranks over a DDP model of several
buckets, with memory running out on rank 1 at each place a step can run out (see
``SCENARIOS``), and writes OUT/runner<rank>.json: each scenario's gradients' largest
difference from the step without it, and what DDP and ``all_reduce`` did.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import seqshard
from seqshard.app.ctc_model import SmallCTC
from seqshard.app.train_memory import MemoryGuard, StepRunner

PACKAGE = Path(seqshard.__file__).parent
TENSOR_CODE = (str(Path(torch.__file__).parent / "_tensor"),)  # Tensor.__format__ and the like: their caller reads
TRAINER = str(PACKAGE / "app" / "train")  # seqshard/app/trainer.py and its train_*.py modules
READS = ("item", "tolist", "numpy", "cpu", "__int__", "__float__", "__bool__", "__index__")


class Boom(torch.autograd.Function):
    """The identity, whose backward pass runs out of memory once when ``armed``."""

    armed = False
    then: Any = None  # called when it runs out

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if Boom.armed:
            Boom.armed = False
            if Boom.then is not None:
                Boom.then()
            raise torch.OutOfMemoryError("the probe's out of memory")
        return grad


def boom_before_lstm(module: nn.Module, inputs: Any) -> Any:
    """A forward pre-hook on an LSTM: its input through :class:`Boom` while it is armed (memory
    runs out in the backward pass once the output layer's and the LSTM's gradients are in)."""
    return (Boom.apply(inputs[0]), *inputs[1:]) if Boom.armed and torch.is_grad_enabled() else inputs


class Window:
    """What happens between two optimizer steps (see the module's text)."""

    def __init__(self, out: Path) -> None:
        self.file = out.open("a", buffering=1)
        self.step = 0
        self.reset()

    def reset(self) -> None:
        self.reads: list[str] = []
        self.all_reduce: list[dict[str, Any]] = []
        self.buckets = 0
        self.plan = 0

    def next_step(self) -> None:
        record = {"step": self.step, "reads": self.reads, "all_reduce": self.all_reduce}
        self.file.write(json.dumps({**record, "buckets": self.buckets, "plan": self.plan}) + "\n")
        self.step += 1
        self.reset()


def seqshard_caller() -> str | None:
    """``file:line`` of seqshard's code that made the read under way (outside the loader's
    iteration), else None."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(TENSOR_CODE):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(str(PACKAGE)):
        return None
    where = f"{Path(frame.f_code.co_filename).relative_to(PACKAGE)}:{frame.f_lineno}"
    while frame is not None:
        if frame.f_code.co_name == "timed" and frame.f_code.co_filename.endswith("train_epoch.py"):
            return None
        frame = frame.f_back
    return where


def install_probes(window: Window) -> None:
    def counting(name: str, original: Any) -> Any:
        def read(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is threading.main_thread():
                where = seqshard_caller()
                if where is not None:
                    window.reads.append(f"{where} {name}")
            return original(*args, **kwargs)

        return read

    for name in READS:
        setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    torch.cuda.synchronize = counting("torch.cuda.synchronize", torch.cuda.synchronize)

    all_reduce = dist.all_reduce

    def counted_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if sys._getframe(1).f_code.co_filename.startswith(TRAINER):
            call = {"dtype": str(tensor.dtype), "size": tensor.numel(), "async": bool(kwargs.get("async_op"))}
            window.all_reduce.append(call)
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counted_all_reduce

    from seqshard.pipeline.rank.shard_loader import ShardLoader

    planned = ShardLoader.planned_batches

    def counted_plan(self: Any) -> Any:
        window.plan += sys._getframe(1).f_code.co_filename.startswith(TRAINER)
        return planned(self)

    ShardLoader.planned_batches = counted_plan
    count_buckets(lambda: setattr(window, "buckets", window.buckets + 1))


def count_buckets(count: Any) -> None:
    """Every DDP module made from now on calls ``count()`` at each bucket it all-reduces."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    made = nn.parallel.DistributedDataParallel.__init__

    def hook(state, bucket):  # (DDP refuses a hook annotated otherwise than torch's way)
        count()
        return allreduce_hook(state, bucket)

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        self.register_comm_hook(None, hook)

    nn.parallel.DistributedDataParallel.__init__ = init


def train(out: Path, events: dict[str, list[int]], args: list[str]) -> None:
    rank = int(os.environ.get("RANK", 0))
    window = Window(out / f"probe{rank}.jsonl")
    install_probes(window)
    oom, stop = events.get("oom"), events.get("signal")
    lstm_init = nn.LSTM.__init__  # every LSTM made gets the hook that runs out of memory when armed

    def lstm_with_boom(self: Any, *a: Any, **k: Any) -> None:
        lstm_init(self, *a, **k)
        self.register_forward_pre_hook(boom_before_lstm)

    nn.LSTM.__init__ = lstm_with_boom

    def before(optimizer: Any, *unused: Any) -> None:
        window.next_step()

    def after(optimizer: Any, *unused: Any) -> None:
        if oom == [rank, window.step + 1]:
            Boom.armed = True
        if stop == [rank, window.step]:
            os.kill(os.getpid(), signal.SIGTERM)

    register_optimizer_step_pre_hook(before)
    register_optimizer_step_post_hook(after)
    from seqshard.app.trainer import main

    main(args)


# -- the step runner on 2 ranks ---------------------------------------------------------------------

SCENARIOS = {
    "none": "no memory runs out",
    "backward": "in the backward pass of the last part, after DDP has sent a bucket",
    "loss": "in the loss, after DDP's forward armed its all-reduce",
    "forward": "in the model's forward, before DDP armed anything",
    "no_sync part": "in the backward pass of the first of 2 parts (under no_sync)",
}


def batch_of(rank: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(rank)
    lengths = torch.randint(12, 40, (6,), generator=generator)
    label_lens = torch.randint(2, 5, (6,), generator=generator)
    feats = torch.randn(6, int(lengths.max()), 8, generator=generator)
    labels = torch.randint(1, 6, (6, int(label_lens.max())), generator=generator)
    return {"keys": [f"u{i}" for i in range(6)], "feats": feats, "feat_lens": lengths, "labels": labels,
            "label_lens": label_lens}  # fmt: skip


def runner(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = SmallCTC(8, 6, hidden=32, layers=1)
    model = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=0.01)  # buckets of 10 kB: several
    ctc = nn.CTCLoss(zero_infinity=True)
    place = {"where": None}

    def loss_of(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        log_probs, lengths = model(batch["feats"], batch["feat_lens"])
        if place["where"] == "loss" and torch.is_grad_enabled():
            place["where"] = None
            raise torch.OutOfMemoryError("the probe's out of memory")
        return ctc(log_probs.transpose(0, 1), batch["labels"], lengths, batch["label_lens"])

    def forward_boom(module: nn.Module, inputs: Any) -> None:
        if place["where"] == "forward":
            place["where"] = None
            raise torch.OutOfMemoryError("the probe's out of memory")

    module.lstm.register_forward_pre_hook(forward_boom)
    module.lstm.register_forward_pre_hook(boom_before_lstm)
    sent: list[int] = []  # per bucket all-reduced: the parameters whose gradients were in by then
    Boom.then = lambda: found[scenario].update({"buckets sent": len(sent)})  # when memory runs out
    calls = []  # seqshard's calls of all_reduce (DDP's comm hook calls it too)
    all_reduce = dist.all_reduce

    def counted_all_reduce(*args: Any, **kwargs: Any) -> Any:
        if sys._getframe(1).f_code.co_filename.startswith(str(PACKAGE)):
            calls.append(1)
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted_all_reduce
    guard = MemoryGuard()
    step = StepRunner(model, loss_of, guard, lambda line: None)

    def hook(state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        sent.append(len(step.taken))
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook)
    batch = batch_of(rank)
    found: dict[str, Any] = {}
    reference = None
    for scenario in [*SCENARIOS, "none again"]:  # DDP is as it was after the others
        found[scenario] = {}
        model.zero_grad(set_to_none=True)
        sent.clear()
        guard.limits.clear()
        if rank == 1 and scenario in SCENARIOS and scenario != "none":
            place["where"] = scenario
            Boom.armed = scenario in ("backward", "no_sync part")
            if scenario == "no_sync part":
                guard.limits[0] = int(batch["feats"].shape[0] * batch["feats"].shape[1]) - 1  # 2 parts
        loss = step.backward(batch)
        gradients = torch.cat([p.grad.reshape(-1) for p in module.parameters()])
        if reference is None:
            reference = gradients
        found[scenario] |= {
            "largest difference": float((gradients - reference).abs().max()),
            "loss": float(loss),
            "sum": float(gradients.double().sum()),
            "sent with": list(sent),
            "out of memory": guard.out_of_memory,
        }
    found["parameters"] = len(step.params)
    found["all_reduce calls"] = len(calls)
    (out / f"runner{rank}.json").write_text(json.dumps(found))
    dist.barrier()


if __name__ == "__main__":
    what, folder = sys.argv[1], Path(sys.argv[2])
    if what == "train":
        split = sys.argv.index("--")
        train(folder, json.loads(sys.argv[3]), sys.argv[split + 1 :])
    else:
        runner(folder)
