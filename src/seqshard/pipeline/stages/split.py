"""Splitting a collated batch into smaller ones (``seqshard.extend.split_batch``), so that a step
that ran out of memory can run again on parts of its batch with nothing lost.

A part is a run of consecutive samples (a loader's batch is in length order, so each run is
padded only to its own longest): padded arrays (``feats`` with ``feat_lens``, ``labels`` with
``label_lens``, ``NAME`` with ``NAME_lens``) are cut to the part's samples and trimmed to its
longest, per-sample values (``keys``, ``texts``, stacked numbers) are cut to its samples.
"""

from __future__ import annotations

import itertools
from typing import Any

LENGTHS_SUFFIX = "_lens"


def split_batch(batch: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """``batch`` (a dict as ``make_loader`` yields it, of torch tensors or numpy arrays) as
    ``parts`` batches (fewer when it holds fewer samples) that together hold exactly its samples,
    in order, each padded only to its own longest. A value whose first axis is not the batch's
    (a number, say) goes into every part as it is; the parts are views, not copies."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be a whole number >= 1, got {parts!r}")
    nested = [key for key, value in batch.items() if isinstance(value, dict)]
    if nested:
        raise ValueError(f"split_batch splits flat batch dicts (make_loader's); {nested[0]!r} holds a dict")
    size = _batch_size(batch)
    padded = _padded_arrays(batch, size)
    count = min(parts, size) if size else 1
    bounds = [round(size * n / count) for n in range(count + 1)]
    found = []
    for low, high in itertools.pairwise(bounds):
        part = {key: _cut(value, size, low, high) for key, value in batch.items()}
        for name, lengths in padded.items():
            longest = max(0, int(part[lengths].max())) if high > low else 0
            part[name] = part[name][:, :longest]
        found.append(part)
    return found


def _batch_size(batch: dict[str, Any]) -> int:
    """How many samples ``batch`` holds (its keys, else its first array's first axis)."""
    if "keys" in batch:
        return len(batch["keys"])
    for value in batch.values():
        shape = getattr(value, "shape", None)
        if shape:
            return int(shape[0])
    raise ValueError("split_batch needs a batch with keys or arrays to tell its size")


def _padded_arrays(batch: dict[str, Any], size: int) -> dict[str, str]:
    """Padded array -> its lengths key (``feat_lens`` pads ``feats``, ``NAME_lens`` ``NAME``)."""
    found = {}
    for key in batch:
        if not key.endswith(LENGTHS_SUFFIX):
            continue
        stem = key[: -len(LENGTHS_SUFFIX)]
        name = next((n for n in (stem, stem + "s") if n in batch), None)
        shape = getattr(batch.get(name), "shape", ())
        if name is not None and len(shape) >= 2 and shape[0] == size:
            found[name] = key
    return found


def _cut(value: Any, size: int, low: int, high: int) -> Any:
    """Samples ``low:high`` of a per-sample ``value``; any other value as it is."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return value[low:high] if len(shape) >= 1 and shape[0] == size else value
    if isinstance(value, (list, tuple)) and len(value) == size:
        return value[low:high]
    return value
