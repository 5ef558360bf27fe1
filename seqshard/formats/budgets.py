"""Batch budgets per length bucket: what ``seqshard calibrate`` finds a model can take and
``make_loader(..., budgets=...)`` cuts batches by.

A budgets file (JSON) holds the buckets' upper bounds, each bucket's budget in padded frames
(B x T: the batch's samples times its longest length) and the longest length it was found at,
and what it was calibrated on (device, step function, memory limit, date)::

    {"format": "seqshard-budgets", "version": 1, "unit": "frames",
     "bounds": [400, 800], "buckets": [{"longest": 400, "budget": 120000, "batch_size": 300, "peak_bytes": ...}, ...],
     "device": "cuda:0 (NVIDIA H100 80GB HBM3)", "step": "mymodel:train_step", "memory_limit": ..., "date": "..."}

A batch belongs to the bucket of its longest sample: bucket ``b`` holds longest lengths in
``[bounds[b-1], bounds[b])`` (the first from 0, the last to any length).
"""

from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .files import write_json_atomic

FORMAT = "seqshard-budgets"
VERSION = 1


@dataclass(frozen=True)
class Budgets:
    """Each length bucket's budget of padded frames (see the module docstring): ``bounds``
    ascending, ``budgets`` and ``longest`` one per bucket (``len(bounds) + 1``)."""

    bounds: tuple[int, ...]
    budgets: tuple[int, ...]
    longest: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.budgets) != len(self.bounds) + 1 or len(self.longest) != len(self.budgets):
            raise ValueError(f"{len(self.bounds)} bounds need {len(self.bounds) + 1} buckets, got {len(self.budgets)}")
        if any(not _whole(b) or b < 1 for b in (*self.bounds, *self.budgets, *self.longest)):
            raise ValueError("bounds, budgets and lengths must be whole numbers >= 1")
        if any(low >= high for low, high in zip(self.bounds, self.bounds[1:])):
            raise ValueError(f"bounds must ascend, got {list(self.bounds)}")

    def bucket_of(self, longest: int) -> int:
        """The bucket of a batch whose longest sample has ``longest`` frames."""
        return bisect.bisect_right(self.bounds, longest)

    def budget_of(self, longest: int) -> int:
        """The budget of padded frames of a batch whose longest sample has ``longest`` frames."""
        return self.budgets[self.bucket_of(longest)]

    def to_json(self) -> dict[str, Any]:
        """What the loader's identity records (a state saved with other budgets is refused)."""
        return {"bounds": list(self.bounds), "budgets": list(self.budgets)}


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def budgets_from(value: Any) -> Budgets:
    """``make_loader(budgets=...)``'s value as Budgets: a budgets file's path, its content as a
    dict, or Budgets; ConfigError naming the file and what is wrong otherwise."""
    if isinstance(value, Budgets):
        return value
    where = "budgets"
    if isinstance(value, (str, os.PathLike)):
        where = str(value)
        try:
            value = json.loads(Path(value).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(
                f"budgets: {where} does not exist (`seqshard calibrate SHARDS --step MODULE:FUNCTION --out {where}` "
                "writes it)."
            ) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ConfigError(f"budgets: {where} cannot be read as JSON ({error}).") from None
    if not isinstance(value, dict):
        raise ConfigError(f"budgets must be a budgets file's path or its content (a dict), got {value!r}.")
    if value.get("format") != FORMAT or value.get("version") != VERSION:
        raise ConfigError(
            f"{where} is not a seqshard budgets file of version {VERSION} (format {value.get('format')!r}, version "
            f"{value.get('version')!r}): make it with `seqshard calibrate`."
        )
    try:
        buckets = value["buckets"]
        return Budgets(
            tuple(value["bounds"]), tuple(b["budget"] for b in buckets), tuple(b["longest"] for b in buckets)
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ConfigError(f"{where}: its bounds and buckets are not a budgets file's ({error}).") from None


def save_budgets(path: str | Path, budgets: Budgets, rows: list[dict[str, Any]], about: dict[str, Any]) -> Path:
    """Write ``budgets`` with a row of facts per bucket (``rows``) and what they were found on
    (``about``: device, step, memory limit, date), atomically."""
    buckets = [{"longest": n, "budget": b, **row} for n, b, row in zip(budgets.longest, budgets.budgets, rows)]
    document = {"format": FORMAT, "version": VERSION, "unit": "frames", "bounds": list(budgets.bounds)}
    document.update(buckets=buckets, **about)
    if any(isinstance(v, float) and not math.isfinite(v) for row in rows for v in row.values()):
        raise ValueError("a bucket's facts hold a number that is not finite")
    write_json_atomic(Path(path), document)
    return Path(path)
