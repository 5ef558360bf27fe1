"""``seqshard calibrate``: the largest batch a training step takes at each length bucket.

For each length bucket of the shards (buckets of equal mass cut from the index's length
histogram), a synthetic batch at the bucket's longest length is given to the user's step
function (forward and backward, as in training) with more and more samples: the batch fits
when the step raises no out-of-memory error, its peak memory stays under the limit and it
takes at most ``max_step_seconds``. The peak is, on a GPU, ``torch.cuda.max_memory_allocated``
after ``reset_peak_memory_stats`` (limit: a fraction of the card's memory, or a number of
bytes); on CPU the process's peak resident memory (``VmHWM``, reset through
``/proc/self/clear_refs`` before each step; limit: the resident memory at the start plus a
fraction of the memory still available, or a number of bytes). The batches are made on the
device (the step's copy to it is then none). The largest batch that fits, found by doubling
then bisecting from the previous bucket's, gives the bucket's budget of padded frames (batch
size x longest length); ``make_loader(..., budgets=FILE)`` cuts each bucket's batches under its
own. No step starts after ``time_limit`` seconds (the calibration stops there with an error).
The same helpers (a synthetic batch, what counts as out of memory, the peak) serve the example
trainer's preflight and its out-of-memory splits.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime as _dt
import gc
import importlib
import importlib.util
import math
import os
import re
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checks import MAX_BUCKETS, check_number
from ..device import check_device, is_cuda, require_device
from ..errors import ConfigError, option
from ..formats.budgets import Budgets, save_budgets
from ..formats.index_entries import MAX_DIM, MAX_LENGTH, bin_bounds
from ..formats.patterns import Patterns
from ..formats.table import ShardTable
from ..options import BudgetWindow
from ..pipeline.workers.setup import bucket_bounds
from ..seeds import torch_generator

Step = Callable[[dict[str, Any]], Any]
OUT_OF_MEMORY_TEXTS = ("out of memory", "can't allocate memory")  # torch's CPU allocator raises RuntimeError
DEFAULT_FRACTION = {"cuda": 0.9, "cpu": 0.5}  # of the card's memory; of the memory available on CPU
TRIALS_PER_BUCKET = 16  # the default time of a step: time_limit / (TRIALS_PER_BUCKET x buckets)
STEP_FORMS = (
    "MODULE:FUNCTION (a module imported from the working folder or the path, e.g. mymodel:train_step) or "
    "FILE.py:FUNCTION (a Python file of yours, e.g. models/step.py:train_step)"
)


@dataclass(frozen=True)
class Bucket:
    """One calibrated bucket: its ``longest`` length, the largest ``batch_size`` that fitted
    there, its ``budget`` (padded frames), the step's ``peak`` memory (bytes) and what bound
    the batch (``bound``: "memory", "time" or "max batch size")."""

    longest: int
    batch_size: int
    budget: int
    peak: int | None
    bound: str = "memory"


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` says memory ran out (torch.OutOfMemoryError, MemoryError, or the
    RuntimeError of torch's CPU allocator)."""
    import torch

    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in OUT_OF_MEMORY_TEXTS)


def free_memory() -> None:
    """Give back what a failed step left (after its exception is gone): on a GPU tensors held
    in reference cycles are collected and the allocator's cache emptied; on CPU tensors go
    with their last reference, and the C allocator's free pages go back to the system."""
    import torch

    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
    trim_heap()


def trim_heap() -> None:
    """Give the C allocator's free pages back to the system (glibc's ``malloc_trim``; nothing
    elsewhere): freed tensors then no longer count in the process's resident memory."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _libc() -> Any:
    """The C library's functions (None where it cannot be loaded)."""
    global _LIBC
    if _LIBC is False:
        try:
            _LIBC = ctypes.CDLL(None)
        except OSError:
            _LIBC = None
    return _LIBC


_LIBC: Any = False


def within_memory(function: Callable[..., Any], *args: Any) -> tuple[bool, Any]:
    """``function(*args)``: ``(True, its result)``, or ``(False, None)`` when it ran out of
    memory (what it held given back); any other error is raised."""
    try:
        return True, function(*args)
    except BaseException as error:
        if not is_out_of_memory(error):
            raise
    free_memory()  # outside the except block: the exception, and the frames it holds, are gone
    return False, None


def reset_peak(device: Any) -> bool:
    """Start measuring the peak memory of ``device`` afresh: CUDA's peak allocation, or on CPU
    the process's peak resident memory (``/proc/self/clear_refs``, Linux). False where it
    cannot be reset: the peak on CPU is then the process's since it started."""
    import torch

    if is_cuda(str(device)):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as control:
            control.write("5")  # resets VmHWM to the resident memory now
    except OSError:
        return False
    return True


def peak_memory(device: Any) -> int:
    """Bytes: CUDA's peak allocation since :func:`reset_peak`, else the process's peak
    resident memory (since :func:`reset_peak` where it could reset it)."""
    import torch

    if is_cuda(str(device)):
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # kilobytes on Linux


def _status_bytes(name: str) -> int | None:
    """A ``kB`` line of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes; None without it."""
    found = re.search(rf"^{name}:\s+(\d+) kB", _read_text("/proc/self/status"), re.MULTILINE)
    return int(found[1]) * 1024 if found else None


def _read_text(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def available_memory() -> int:
    """Bytes this process may still take: ``MemAvailable`` of ``/proc/meminfo`` (else the
    machine's memory), or less where a cgroup (a container, a Slurm job) caps it lower."""
    found = re.search(r"^MemAvailable:\s+(\d+) kB", _read_text("/proc/meminfo"), re.MULTILINE)
    room = [int(found[1]) * 1024 if found else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    for line in _read_text("/proc/self/cgroup").splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0":  # cgroup v2
            root, files = Path("/sys/fs/cgroup"), ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):  # cgroup v1
            root, files = Path("/sys/fs/cgroup/memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        folder = root / path.lstrip("/")
        for level in (folder, *[f for f in folder.parents if f.is_relative_to(root)]):  # a limit may sit above
            limit, used = (_read_text(level / name).strip() for name in files)
            if limit.isdigit() and used.isdigit():
                room.append(int(limit) - int(used))
    return max(0, min(room))


def synthetic_batch(
    size: int, longest: int, dim: int, vocab_size: int = 2, device: Any = "cpu", seed: int = 0
) -> dict[str, Any]:
    """A batch shaped as ``make_loader`` yields it: ``size`` utterances of ``longest`` frames
    of ``dim`` features (normal noise), labels of ``longest // 8`` tokens (ids cycling from 1,
    so a CTC model with 4x subsampling can align them), keys and texts; its tensors made on
    ``device`` (a batch of millions of frames is made in a blink on a GPU, in seconds on CPU)."""
    import torch

    generator = torch_generator(seed, device)
    tokens = max(1, longest // 8)
    ids = torch.arange(tokens, device=device) % max(1, vocab_size - 1) + 1
    return {
        "feats": torch.randn(size, longest, dim, generator=generator, device=device),
        "feat_lens": torch.full((size,), longest, dtype=torch.int64, device=device),
        "labels": ids.repeat(size, 1),
        "label_lens": torch.full((size,), tokens, dtype=torch.int64, device=device),
        "keys": [f"synthetic-{n}" for n in range(size)],
        "texts": [""] * size,
    }


def batch_bytes(size: int, longest: int, dim: int) -> int:
    """About the bytes of :func:`synthetic_batch` (its features, labels, lengths and keys)."""
    return size * (longest * dim * 4 + (longest // 8 + 2) * 8 + 100)


def load_step(spec: str | Step) -> Step:
    """``MODULE:FUNCTION``, ``FILE.py:FUNCTION`` (or a function) as the step to calibrate; a
    file is run as a module of its own, its folder first on the path (as ``python FILE``
    does)."""
    if callable(spec):
        return spec
    source, _, function = str(spec).rpartition(":")
    named = option("step", spec)
    if not source or not function.isidentifier():
        raise ConfigError(f"{named}: give {STEP_FORMS}.")
    if source.endswith(".py"):
        module = _module_of_file(named, Path(source))
    elif re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", source):
        try:
            module = importlib.import_module(source)
        except ImportError as error:
            raise ConfigError(f"{named}: cannot import {source} ({error}): give {STEP_FORMS}.") from None
    else:
        raise ConfigError(f"{named}: {source!r} is neither a module's name nor a .py file: give {STEP_FORMS}.")
    found = getattr(module, function, None)
    if not callable(found):
        raise ConfigError(f"{named}: {source} has no function {function!r}.")
    return found


def _module_of_file(named: str, path: Path) -> Any:
    """The module a user's Python file makes (its code run: the user named it as the step's)."""
    if not path.is_file():
        problem = "is not a regular file" if path.exists() else "does not exist"
        raise ConfigError(f"{named}: {path} {problem}: give {STEP_FORMS}.")
    name = "seqshard_step_" + re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.path.insert(0, str(path.resolve().parent))
    sys.modules[name] = module  # for what looks itself up there (dataclasses, pickle)
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except (ImportError, SyntaxError) as error:
        del sys.modules[name]
        raise ConfigError(f"{named}: {path} cannot be imported ({error}).") from None
    return module


def bucket_lengths(table: ShardTable, buckets: int) -> tuple[tuple[int, ...], list[int]]:
    """Bucket bounds of equal mass from the shards' length histogram, and each bucket's
    longest possible length (the last bucket's: the top of the histogram)."""
    if table.dim is None or not table.length_hist:
        raise ConfigError(
            "calibrate makes batches of feature frames sized by the shards' index.json (its dim and length "
            "histogram); these shards have none: index them (`seqshard index`), or give dim."
        )
    bounds = bucket_bounds(table, buckets)
    top = math.ceil(bin_bounds(max(k for k, _ in table.length_hist))[1]) - 1
    return bounds, [bound - 1 for bound in bounds] + [max(top, *bounds, 1)]


def calibrate(
    shards: Patterns,
    step: str | Step,
    *,
    out: str | Path | None = None,
    device: str | None = None,
    memory_fraction: float | None = None,
    max_memory: int | None = None,
    buckets: int = 8,
    dim: int | None = None,
    vocab_size: int = 2,
    max_batch_size: int | None = None,
    max_step_seconds: float | None = None,
    time_limit: float = 600.0,
    report: Callable[[str], None] | None = None,
) -> tuple[Budgets, list[Bucket]]:
    """Calibrate ``step`` (``MODULE:FUNCTION``, ``FILE.py:FUNCTION`` or a function of a batch)
    on the buckets of ``shards`` (see the module docstring); write the budgets to ``out`` when
    given. A batch fits under ``max_memory`` bytes, else ``memory_fraction`` (default 0.9 of a
    card's memory, 0.5 of the memory available on CPU), of at most ``max_batch_size`` samples,
    when its step takes at most ``max_step_seconds`` (default: ``time_limit`` over 16 steps a
    bucket); past ``time_limit`` seconds calibration stops with ConfigError. ``report`` gets a
    line per bucket."""
    _check_arguments(locals())
    _check_out(out)
    device = _device(device)
    limit = _memory_limit(device, memory_fraction, max_memory)
    table = ShardTable.from_patterns(shards)
    if dim is not None:
        table = dataclasses.replace(table, dim=dim)
    bounds, longest = bucket_lengths(table, buckets)
    seconds = max_step_seconds or time_limit / (TRIALS_PER_BUCKET * len(longest))
    deadline = time.monotonic() + time_limit
    most = max_batch_size or BudgetWindow().max_samples
    trials = Trials(load_step(step), table.dim, vocab_size, device, limit, seconds, most, deadline)  # type: ignore[arg-type]
    found: list[Bucket] = []
    guess = 1
    for number, length in enumerate(longest):
        try:
            size, peak, bound = trials.largest(length, guess)
        except _OutOfTime:
            raise ConfigError(_out_of_time(number, len(longest), time_limit, trials)) from None
        if size == 0:
            raise ConfigError(_not_even_one(length, number, bounds, bound, trials, time_limit))
        found.append(Bucket(length, size, size * length, peak, bound))
        if report is not None:
            report(describe_bucket(number, found[-1]))
        guess = size
    budgets = Budgets(bounds, tuple(b.budget for b in found), tuple(b.longest for b in found), device_name(device))
    if out is not None:
        about = {
            "device": budgets.device,
            "step": step if isinstance(step, str) else f"{trials.step.__module__}:{trials.step.__qualname__}",
            "memory_limit": limit,
            "step_seconds": seconds,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        rows = [{"batch_size": b.batch_size, "peak_bytes": b.peak, "bound": b.bound} for b in found]
        save_budgets(out, budgets, rows, about)
    return budgets, found


ARGUMENT_RULES: dict[str, dict[str, Any]] = {
    "buckets": dict(whole=True, at_least=1, at_most=MAX_BUCKETS),
    "dim": dict(whole=True, at_least=1, at_most=MAX_DIM, optional=True),
    "vocab_size": dict(
        whole=True,
        at_least=2,
        at_most=MAX_LENGTH,
        what=f"a whole number >= 2 and <= {MAX_LENGTH} (ids from 1, 0 the blank)",
    ),
    "max_batch_size": dict(whole=True, at_least=1, at_most=BudgetWindow().max_samples, optional=True),
    "max_memory": dict(whole=True, at_least=1, optional=True),
    "memory_fraction": dict(above=0, at_most=1, optional=True),
    "max_step_seconds": dict(above=0, optional=True),
    "time_limit": dict(above=0),
}


def _check_arguments(given: dict[str, Any]) -> None:
    for name, rule in ARGUMENT_RULES.items():
        check_number(name, given[name], **rule)


class _OutOfTime(Exception):
    """The calibration's time limit has passed (raised before a step)."""


def _device(device: str | None) -> str:
    """The device to calibrate on (default: a GPU when torch finds one), checked."""
    import torch

    check_device("device", device)
    require_device(device)
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def _not_even_one(length: int, number: int, bounds: tuple[int, ...], bound: str, trials: Trials, limit: float) -> str:
    cut = bounds[number - 1] if number else length
    if bound == "time":
        return (
            f"calibrate: a step on one utterance of {length} frames (bucket {number}) takes more than "
            f"{option('max_step_seconds', trials.seconds)} (by default {option('time_limit', limit)} over "
            f"{TRIALS_PER_BUCKET} steps a bucket): allow more, or train without the longest utterances "
            f"(max_frames={cut})."
        )
    return (
        f"calibrate: one utterance of {length} frames does not fit (bucket {number}): train without the longest "
        f"utterances (max_frames={cut}) or on more memory."
    )


def _out_of_time(number: int, total: int, limit: float, trials: Trials) -> str:
    return (
        f"calibrate: {option('time_limit', limit)} ran out at bucket {number} of {total} (the buckets before it are "
        f"done): allow more time, calibrate fewer buckets, or cap the batches (now {option('max_batch_size', trials.most)}) "
        f"or a step's time (now {option('max_step_seconds', trials.seconds)})."
    )


def _check_out(out: str | Path | None) -> None:
    """ConfigError, before calibrating, when the budgets file cannot be written where asked."""
    if out is not None and (Path(out).is_dir() or not Path(out).parent.is_dir()):
        problem = "is a folder" if Path(out).is_dir() else "is in no folder that exists"
        raise ConfigError(f"calibrate: {option('out', out)} {problem}: give the budgets file's path in a folder.")


def describe_bucket(number: int, bucket: Bucket) -> str:
    peak = "-" if bucket.peak is None else f"{bucket.peak / 2**30:.2f} GiB"
    return f"{number:>6} {bucket.longest:>8} {bucket.batch_size:>10} {bucket.budget:>10} {peak:>11} {bucket.bound}"


HEADER = f"{'bucket':>6} {'longest':>8} {'batch size':>10} {'budget':>10} {'peak':>11} bound"


def _memory_limit(device: str, fraction: float | None, max_memory: int | None) -> int:
    """Bytes a step may peak at on ``device``: on a GPU, allocated; on CPU, the process's
    resident memory (ConfigError where its peak cannot be measured)."""
    import torch

    cpu = not is_cuda(device)
    if cpu and not reset_peak(device):
        raise ConfigError(
            "calibrate measures a step's memory on CPU by the process's peak resident memory, reset before each "
            "step (/proc/self/clear_refs, Linux), which this system does not allow: calibrate on a GPU."
        )
    if max_memory is not None:
        return int(max_memory)
    share = DEFAULT_FRACTION["cpu" if cpu else "cuda"] if fraction is None else fraction
    if cpu:
        return int(_status_bytes("VmRSS") or 0) + int(available_memory() * share)
    return int(torch.cuda.get_device_properties(torch.device(device)).total_memory * share)


def device_name(device: str) -> str:
    """``cpu``, or ``cuda:N (the GPU's name)``: what budgets record they were found on."""
    import torch

    if is_cuda(str(device)):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device


@dataclass
class Trials:
    """Steps on synthetic batches (``dim`` features, label ids below ``vocab``) at one length
    after another: which batch sizes fit (:meth:`fits`: a peak within ``limit`` bytes, a step
    within ``seconds``) and the largest (:meth:`largest`, at most ``most`` samples), until the
    ``deadline`` (``time.monotonic``)."""

    step: Step
    dim: int
    vocab: int
    device: str
    limit: int
    seconds: float
    most: int
    deadline: float
    peaks: dict[int, int] = dataclasses.field(default_factory=dict)

    def fits(self, size: int, length: int) -> str | None:
        """None when a batch of ``size`` x ``length`` fits, else what bounds it: "memory" (out
        of memory, a peak over the limit, or a batch alone over it) or "time" (a step longer
        than ``seconds``). Past the deadline, _OutOfTime."""
        if time.monotonic() > self.deadline:
            raise _OutOfTime
        trim_heap()  # what earlier steps freed does not count in this one's peak
        base = 0 if is_cuda(self.device) else int(_status_bytes("VmRSS") or 0)
        if base + batch_bytes(size, length, self.dim) > self.limit:
            return "memory"  # not made: the batch alone is over the limit
        reset_peak(self.device)
        started = time.monotonic()
        batch = lambda: synthetic_batch(size, length, self.dim, self.vocab, self.device)  # noqa: E731
        if not within_memory(lambda: self.step(batch()))[0]:
            return "memory"
        took = time.monotonic() - started
        self.peaks[size] = peak_memory(self.device)
        if self.peaks[size] > self.limit:
            return "memory"
        return "time" if took > self.seconds else None

    def largest(self, length: int, guess: int) -> tuple[int, int | None, str]:
        """The largest batch size at ``length`` that fits (0: not even one), its step's peak
        memory and what bounds it: from ``guess``, doubled until a size fails (or reaches the
        most) or halved until one fits, then bisected to within 1/64."""
        self.peaks.clear()
        low, high = 0, self.most + 1  # low fits (0: nothing yet), high does not
        size, bound = max(1, min(guess, self.most)), "max batch size"
        while low == 0 or high > self.most:  # bracket the largest size that fits
            why = self.fits(size, length)
            if why is None:
                low = size
                if size == self.most:
                    return low, self.peaks[low], "max batch size"
                size = min(size * 2, self.most)
            else:
                high, bound = size, why
                if size == 1:
                    return 0, None, bound
                size //= 2
        while high - low > max(1, low // 64):
            size = (low + high) // 2
            why = self.fits(size, length)
            if why is None:
                low = size
            else:
                high, bound = size, why
        return low, self.peaks[low], bound
