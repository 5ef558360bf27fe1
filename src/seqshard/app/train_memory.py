"""A step's memory: batches that run out of it run in parts, per length bucket, under DDP;
the epoch's heaviest batches tried before training (the preflight)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from ..formats.budgets import LengthBuckets
from ..pipeline.stages.split import split_batch
from ..pipeline.workers.setup import bucket_bounds
from ..tools.calibrate import free_memory, peak_memory, reset_peak, synthetic_batch, within_memory


def largest_part(lengths: torch.Tensor, parts: int) -> int:
    """Padded frames (samples x longest) of the largest of ``parts`` parts of a batch whose
    utterances have ``lengths`` (cut as :func:`seqshard.extend.split_batch` cuts)."""
    return max(
        len(part["feat_lens"]) * int(part["feat_lens"].max()) for part in split_batch({"feat_lens": lengths}, parts)
    )


class MemoryGuard:
    """Per length bucket (cut at ``bounds``), the padded frames (batch size x longest length)
    above which a batch runs in parts: lowered when a step runs out of memory and kept in the
    checkpoint (``memory``), so that the rest of the run, resumed or not, splits such batches
    before they run out again. Also the largest batch seen per bucket, and how many times a
    step ran out of memory."""

    def __init__(self, bounds: Sequence[int] = ()):
        self.bounds = tuple(int(bound) for bound in bounds)
        self.bucket_of = LengthBuckets(self.bounds).bucket_of  # a batch's bucket by its longest length
        self.limits: dict[int, int] = {}
        self.largest: dict[int, tuple[int, int]] = {}  # bucket -> (samples, longest) of its largest batch
        self.out_of_memory = 0

    def parts_for(self, lengths: torch.Tensor, longest: int) -> int:
        """How many parts a batch of utterances of ``lengths``, the longest of ``longest`` frames,
        runs in: 1, or the fewest (doubling) whose largest is within its bucket's limit (the
        lengths are read only in a bucket that has one: after it ran out of memory)."""
        limit = self.limits.get(self.bucket_of(longest))
        parts = 1
        while limit is not None and parts < len(lengths) and largest_part(lengths, parts) > limit:
            parts *= 2
        return parts

    def lower(self, longest: int, padded: int) -> None:
        """A batch whose longest has ``longest`` frames ran (in parts) with ``padded`` frames at most."""
        bucket = self.bucket_of(longest)
        self.limits[bucket] = min(self.limits.get(bucket, padded), padded)

    def note(self, size: int, longest: int) -> None:
        bucket = self.bucket_of(longest)
        samples, frames = self.largest.get(bucket, (0, 0))
        if size * longest > samples * frames:
            self.largest[bucket] = (size, longest)

    def describe_largest(self) -> str:
        return " ".join(f"{bucket}:{size}x{longest}" for bucket, (size, longest) in sorted(self.largest.items()))

    def state(self, device: torch.device) -> dict[str, Any]:
        """What the checkpoint keeps: each bucket's limit, the lowest any rank found (a collective)."""
        unset = 2**62
        limits = torch.tensor([self.limits.get(b, unset) for b in range(len(self.bounds) + 1)], device=device)
        if dist.get_world_size() > 1:
            dist.all_reduce(limits, op=dist.ReduceOp.MIN)
        self.limits = {b: int(v) for b, v in enumerate(limits.tolist()) if v != unset}
        return {"bounds": list(self.bounds), "limits": {str(b): v for b, v in self.limits.items()}}

    def load(self, state: Any) -> None:
        """The limits of a checkpoint (none kept where its buckets are not these: they are
        learnt again at the first out-of-memory step)."""
        limits = state.get("limits") if isinstance(state, dict) and state.get("bounds") == list(self.bounds) else None
        if isinstance(limits, dict) and all(str(b).isdigit() and isinstance(v, int) for b, v in limits.items()):
            self.limits = {int(b): int(v) for b, v in limits.items()}


def length_buckets(loader: Any) -> tuple[int, ...]:
    """The bounds of the loader's length buckets: its budgets', else ``num_buckets`` of equal
    mass from the shards' length histogram, else one bucket."""
    options, table = getattr(loader, "options", None), getattr(loader, "table", None)
    if options is None:  # a map-style or token loader: one bucket
        return ()
    if options.batching.budgets is not None:
        return options.batching.budgets.bounds
    if table is not None and table.length_hist:
        return bucket_bounds(table, options.batching.num_buckets)
    return ()


def memory_line(guard: MemoryGuard, device: torch.device) -> str:
    """The peak memory since the last line (CUDA's allocations; on CPU the process's peak RSS)
    and the largest batch so far per length bucket (``bucket:samples x longest``)."""
    peak = peak_memory(device)
    reset_peak(device)
    line = f"peak-mem {peak / 2**20:.0f} MiB largest {guard.describe_largest() or '-'}"
    return line + (f" out-of-memory {guard.out_of_memory}" if guard.out_of_memory else "")


class StepRunner:
    """A training step's forward and backward passes under DDP. A batch runs in the parts its
    bucket's limit (:class:`MemoryGuard`) says: all but the last under ``no_sync`` (their
    gradients add up on this rank), the last with DDP's all-reduce, which sends each bucket of
    gradients as the backward pass fills it. When memory runs out before DDP's forward of the
    last part has armed its all-reduce, the batch runs again in twice as many parts; after it
    (in the loss or that backward pass, when buckets may have gone and the other ranks wait for
    the rest), the gradients DDP has not taken yet are computed again in smaller parts apart
    from DDP and handed to its hooks, so that the all-reduce ends as it would have: with the
    whole batch's gradients on every rank, and no rank but this one learns of it. Either way the
    bucket's limit is lowered; never a batch skipped. ``loss_of(model, batch)``: the batch's
    mean loss through ``model`` (the DDP module, or the model it wraps)."""

    def __init__(self, model: nn.Module, loss_of: Any, guard: MemoryGuard, report: Any):
        self.model, self.loss_of, self.guard, self.report = model, loss_of, guard, report
        self.module = getattr(model, "module", model)  # the model DDP wraps
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.taken: set[int] = set()  # ids of the parameters whose gradient this backward pass has accumulated
        self.armed = False  # DDP's forward has armed its all-reduce for the backward pass to come
        for param in self.params:
            param.register_post_accumulate_grad_hook(lambda p: self.taken.add(id(p)))
        model.register_forward_hook(self._forwarded)

    def _forwarded(self, model: nn.Module, inputs: Any, output: Any) -> None:
        self.armed = torch.is_grad_enabled() and getattr(model, "require_backward_grad_sync", False)

    def backward(self, batch: dict[str, Any], sync: bool = True) -> torch.Tensor:
        """The batch's loss (on the device, not read) and its gradients in the parameters:
        averaged over the ranks by DDP, or (``sync`` False: the preflight) this rank's alone."""
        size, longest = batch["feats"].shape[:2]  # the padded batch's shape: its lengths are not read
        parts = self.guard.parts_for(batch["feat_lens"], longest)
        ran_out = False
        while (loss := self._attempt(batch, parts, sync, longest)) is None:
            if parts >= size:
                raise torch.OutOfMemoryError(f"one utterance of {longest} frames does not fit in memory")
            self.model.zero_grad(set_to_none=True)
            free_memory()
            parts, ran_out = min(parts * 2, size), True
            self._ran_out(size, longest, f"running it in {parts} parts")
        if ran_out:
            self.guard.lower(longest, largest_part(batch["feat_lens"], parts))
        self.guard.note(size, longest)
        return loss

    def _attempt(self, batch: dict[str, Any], parts: int, sync: bool, longest: int) -> torch.Tensor | None:
        """The batch run in ``parts``: its loss, or None when memory ran out before DDP's
        all-reduce was armed (the gradients so far are to be dropped)."""
        pieces = split_batch(batch, parts) if parts > 1 else [batch]
        size, total = len(batch["keys"]), None
        for number, piece in enumerate(pieces, 1):
            synced = sync and number == len(pieces)
            self.taken.clear()
            self.armed = False
            with contextlib.nullcontext() if synced else getattr(self.model, "no_sync", contextlib.nullcontext)():
                fitted, loss = within_memory(self._piece, piece, size)
            if not fitted and not self.armed:
                return None
            if not fitted:
                loss = self._hand_over(piece, size, longest)
            total = loss if total is None else total + loss
        return total

    def _piece(self, piece: dict[str, Any], size: int) -> torch.Tensor:
        loss = self.loss_of(self.model, piece) * (len(piece["keys"]) / size)
        loss.backward()
        return loss.detach()

    def _hand_over(self, piece: dict[str, Any], size: int, longest: int) -> torch.Tensor:
        """Memory ran out with DDP's all-reduce armed: the gradients of ``piece`` for the
        parameters DDP has not taken, computed again in 2, 4, ... parts through the wrapped
        model (``torch.autograd.grad`` runs none of DDP's hooks), then accumulated as the
        backward pass would have, which runs DDP's hooks: the buckets it owes go out. The
        piece's loss."""
        waiting = [p for p in self.params if id(p) not in self.taken]
        count = len(piece["keys"])
        parts = min(2, count)
        while not (found := within_memory(self._gradients, piece, size, parts, waiting))[0]:
            if parts >= count:
                raise torch.OutOfMemoryError(f"one utterance of {longest} frames does not fit in memory")
            parts = min(parts * 2, count)
        loss, gradients = found[1]
        if waiting:
            torch.autograd.backward(waiting, gradients)
        self._ran_out(len(piece["keys"]), longest, f"its gradients computed again in {parts} parts")
        self.guard.lower(longest, largest_part(piece["feat_lens"], parts))
        return loss

    def _gradients(
        self, piece: dict[str, Any], size: int, parts: int, params: list[nn.Parameter]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The loss of ``piece`` and its gradients for ``params``, in ``parts``, apart from DDP."""
        loss, sums = None, None
        for part in split_batch(piece, parts) if parts > 1 else [piece]:
            value = self.loss_of(self.module, part) * (len(part["keys"]) / size)
            found = torch.autograd.grad(value, params, materialize_grads=True) if params else ()
            sums = list(found) if sums is None else [total.add_(more) for total, more in zip(sums, found)]
            loss = value.detach() if loss is None else loss + value.detach()
        return loss, sums  # type: ignore[return-value]

    def _ran_out(self, size: int, longest: int, then: str) -> None:
        self.guard.out_of_memory += 1
        self.report(f"out of memory on a batch of {size} x {longest} frames: {then}")


def preflight(loader: Any, runner: StepRunner, dim: int, vocab_size: int, device: torch.device, say: Any) -> None:
    """One step (forward and backward, no update) on a synthetic batch of the shape of the
    epoch's heaviest batch by padded frames and of its longest, so that a batch that does not
    fit shows now, not hours into the run (it runs in parts, and its bucket's limit is lowered)."""
    try:
        planned = loader.heaviest_batches(2**31 - 1, by="padded")
    except (AttributeError, ConfigError) as error:  # a map-style loader has no plan; a plan may be refused
        say(
            f"preflight skipped: {error if isinstance(error, ConfigError) else 'the loader has no plan of its batches'}"
        )
        return
    if not planned:
        return
    shapes = dict.fromkeys((b.size, b.longest) for b in (planned[0], max(planned, key=lambda b: b.longest)))
    before = runner.guard.out_of_memory
    for size, longest in shapes:
        runner.backward(synthetic_batch(size, longest, dim, vocab_size, device), sync=False)  # ranks apart: no update
        runner.model.zero_grad(set_to_none=True)
    shown = ", ".join(f"{size} x {longest}" for size, longest in shapes)
    verdict = "fit" if runner.guard.out_of_memory == before else "ran out of memory: such batches run in parts"
    say(f"preflight: the epoch's heaviest batches ({shown} frames) {verdict}")
