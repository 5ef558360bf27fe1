"""``seqshard calibrate``: the largest batch a training step takes at each length bucket.

For each length bucket of the shards (buckets of equal mass cut from the index's length
histogram), a synthetic batch at the bucket's longest length is given to the user's step
function (forward and backward, as in training) with more and more samples: the batch fits
when the step raises no out-of-memory error and, on a GPU, its peak memory
(``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``) stays under the limit
(a fraction of the card's memory, or a number of bytes); the batches are made on the device
(the step's copy to it is then none). The largest batch that fits, found by
doubling then bisecting from the previous bucket's, gives the bucket's budget of padded frames
(batch size x longest length); ``make_loader(..., budgets=FILE)`` cuts each bucket's batches
under its own. The same helpers (a synthetic batch, what counts as out of memory, the peak)
serve the example trainer's preflight and its out-of-memory splits.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import gc
import importlib
import math
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checks import check_number
from ..device import is_cuda
from ..errors import ConfigError
from ..formats.budgets import Budgets, save_budgets
from ..formats.index import bin_bounds
from ..formats.patterns import Patterns
from ..formats.table import ShardTable
from ..options import BudgetWindow
from ..pipeline.workers.setup import bucket_bounds
from ..seeds import torch_generator

Step = Callable[[dict[str, Any]], Any]
OUT_OF_MEMORY_TEXTS = ("out of memory", "can't allocate memory")  # torch's CPU allocator raises RuntimeError


@dataclass(frozen=True)
class Bucket:
    """One calibrated bucket: its ``longest`` length, the largest ``batch_size`` that fitted
    there, its ``budget`` (padded frames) and the step's ``peak`` memory (bytes; None on CPU)."""

    longest: int
    batch_size: int
    budget: int
    peak: int | None


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` says memory ran out (torch.OutOfMemoryError, MemoryError, or the
    RuntimeError of torch's CPU allocator)."""
    import torch

    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in OUT_OF_MEMORY_TEXTS)


def free_memory() -> None:
    """Give a GPU back what a failed step left (after its exception is gone): tensors held in
    reference cycles are collected, and the allocator's cache emptied. On CPU, tensors go with
    their last reference."""
    import torch

    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


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


def reset_peak(device: Any) -> None:
    """Start measuring the peak memory of ``device`` afresh (CUDA only)."""
    import torch

    if is_cuda(str(device)):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: Any) -> int:
    """Bytes: CUDA's peak allocation since :func:`reset_peak`, else the process's peak RSS."""
    import torch

    if is_cuda(str(device)):
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # kilobytes on Linux


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


def load_step(spec: str | Step) -> Step:
    """``MODULE:FUNCTION`` (or a function) as the step to calibrate."""
    if callable(spec):
        return spec
    module_name, _, function = str(spec).partition(":")
    if not module_name or not function:
        raise ConfigError(f"--step must be MODULE:FUNCTION (a function of a batch dict), got {spec!r}.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"--step {spec}: cannot import {module_name} ({error}).") from None
    found = getattr(module, function, None)
    if not callable(found):
        raise ConfigError(f"--step {spec}: {module_name} has no function {function!r}.")
    return found


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
    memory_fraction: float | None = 0.9,
    max_memory: int | None = None,
    buckets: int = 8,
    dim: int | None = None,
    vocab_size: int = 2,
    max_batch_size: int = BudgetWindow().max_samples,
    report: Callable[[str], None] | None = None,
) -> tuple[Budgets, list[Bucket]]:
    """Calibrate ``step`` (``MODULE:FUNCTION`` or a function of a batch) on the buckets of
    ``shards`` (see the module docstring); write the budgets to ``out`` when given. On CUDA a
    batch fits under ``max_memory`` bytes, or else ``memory_fraction`` of the card's memory; on
    CPU when it raises no out-of-memory error. ``report`` gets a line per bucket."""
    import torch

    for name, value in (
        ("buckets", buckets),
        ("dim", dim),
        ("max_batch_size", max_batch_size),
        ("max_memory", max_memory),
    ):
        check_number(name, value, whole=True, at_least=1, optional=name in ("dim", "max_memory"))
    check_number("vocab_size", vocab_size, whole=True, at_least=2, what="a whole number >= 2 (ids from 1, 0 the blank)")
    check_number("memory_fraction", memory_fraction, above=0, at_most=1, optional=True)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    limit = _memory_limit(device, memory_fraction, max_memory)
    table = ShardTable.from_patterns(shards)
    if dim is not None:
        table = dataclasses.replace(table, dim=dim)
    bounds, longest = bucket_lengths(table, buckets)
    function = load_step(step)
    found: list[Bucket] = []
    guess = 1
    for number, length in enumerate(longest):
        size, peak = _largest_batch(function, length, table.dim, vocab_size, device, limit, guess, max_batch_size)  # type: ignore[arg-type]
        if size == 0:
            raise ConfigError(
                f"calibrate: one utterance of {length} frames does not fit (bucket {number}): train without the "
                f"longest utterances (max_frames={bounds[number - 1] if number else length}) or on more memory."
            )
        found.append(Bucket(length, size, size * length, peak))
        if report is not None:
            report(describe_bucket(number, found[-1]))
        guess = size
    budgets = Budgets(bounds, tuple(b.budget for b in found), tuple(b.longest for b in found))
    if out is not None:
        about = {
            "device": _device_name(device),
            "step": step if isinstance(step, str) else f"{function.__module__}:{function.__qualname__}",
            "memory_limit": limit,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        rows = [{"batch_size": b.batch_size, "peak_bytes": b.peak} for b in found]
        save_budgets(out, budgets, rows, about)
    return budgets, found


def describe_bucket(number: int, bucket: Bucket) -> str:
    peak = "-" if bucket.peak is None else f"{bucket.peak / 2**30:.2f} GiB"
    return f"{number:>6} {bucket.longest:>8} {bucket.batch_size:>10} {bucket.budget:>10} {peak:>11}"


HEADER = f"{'bucket':>6} {'longest':>8} {'batch size':>10} {'budget':>10} {'peak':>11}"


def _memory_limit(device: str, fraction: float | None, max_memory: int | None) -> int | None:
    """Bytes a step may peak at on ``device`` (None on CPU: only out-of-memory errors count)."""
    import torch

    if not is_cuda(str(device)):
        return None
    if max_memory is not None:
        return int(max_memory)
    if fraction is None:  # its range was checked with the other arguments
        raise ConfigError("on a GPU, give memory_fraction (0, 1] or max_memory.")
    return int(torch.cuda.get_device_properties(torch.device(device)).total_memory * fraction)


def _device_name(device: str) -> str:
    import torch

    if is_cuda(str(device)):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device


def _largest_batch(
    step: Step, length: int, dim: int, vocab: int, device: str, limit: int | None, guess: int, most: int
) -> tuple[int, int | None]:
    """The largest batch size at ``length`` that fits (0: not even one) and its step's peak
    memory: from ``guess``, doubled until a size fails (or reaches ``most``) or halved until
    one fits, then bisected to within 1/64."""

    def fits(size: int) -> bool:
        reset_peak(device)
        if not within_memory(lambda: step(synthetic_batch(size, length, dim, vocab, device)))[0]:
            return False
        peaks[size] = peak_memory(device) if limit is not None else None
        return limit is None or peaks[size] <= limit  # type: ignore[operator]

    peaks: dict[int, int | None] = {}
    low, high = 0, most + 1  # low fits (0: nothing yet), high does not
    size = max(1, min(guess, most))
    while low == 0 or high > most:  # bracket the largest size that fits
        if fits(size):
            low = size
            if size == most:
                return low, peaks[low]
            size = min(size * 2, most)
        else:
            high = size
            if size == 1:
                return 0, None
            size //= 2
    while high - low > max(1, low // 64):
        size = (low + high) // 2
        if fits(size):
            low = size
        else:
            high = size
    return low, peaks[low]
