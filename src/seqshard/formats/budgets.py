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
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checks import MAX_BUCKETS, read_number
from ..errors import ConfigError
from .files import read_json, write_json_atomic
from .index_entries import MAX_COUNT, MAX_LENGTH

FORMAT = "seqshard-budgets"
VERSION = 1
MAX_FILE_BYTES = 1 << 20  # a budgets file of MAX_BUCKETS buckets takes under 200 kB


@dataclass(frozen=True)
class LengthBuckets:
    """Length buckets cut at the ascending ``bounds``: ``len(bounds) + 1`` of them."""

    bounds: tuple[int, ...]

    def bucket_of(self, longest: int) -> int:
        """The bucket of a length (a batch's by its longest sample's): how many bounds it reaches."""
        return bisect.bisect_right(self.bounds, longest)


@dataclass(frozen=True)
class Budgets(LengthBuckets):
    """Each length bucket's budget of padded frames (see the module docstring): ``bounds``
    ascending, ``budgets`` and ``longest`` one per bucket (``len(bounds) + 1``)."""

    budgets: tuple[int, ...]
    longest: tuple[int, ...]
    device: str | None = field(default=None, compare=False)  # what they were calibrated on, as the file says

    def __post_init__(self) -> None:
        if len(self.budgets) != len(self.bounds) + 1 or len(self.longest) != len(self.budgets):
            raise ValueError(f"{len(self.bounds)} bounds need {len(self.bounds) + 1} buckets, got {len(self.budgets)}")
        if any(not _whole(b) or b < 1 for b in (*self.bounds, *self.budgets, *self.longest)):
            raise ValueError("bounds, budgets and lengths must be whole numbers >= 1")
        if any(low >= high for low, high in zip(self.bounds, self.bounds[1:])):
            raise ValueError(f"bounds must ascend, got {list(self.bounds)}")

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
        value = _read_file(Path(value))
    if not isinstance(value, dict):
        raise ConfigError(f"budgets must be a budgets file's path or its content (a dict), got {value!r}.")
    if value.get("format") != FORMAT or value.get("version") != VERSION:
        raise ConfigError(
            f"{where} is not a seqshard budgets file of version {VERSION} (format {value.get('format')!r}, version "
            f"{value.get('version')!r}): make it with `seqshard calibrate`."
        )
    try:
        bounds, buckets = value["bounds"], value["buckets"]
        if not isinstance(bounds, list) or not isinstance(buckets, list) or len(buckets) > MAX_BUCKETS:
            raise ValueError(f"bounds and buckets must be lists, of at most {MAX_BUCKETS} buckets")
        return Budgets(
            tuple(_number(f"bounds[{n}]", b, MAX_LENGTH) for n, b in enumerate(bounds)),
            tuple(_number(f"buckets[{n}].budget", b["budget"], MAX_COUNT) for n, b in enumerate(buckets)),
            tuple(_number(f"buckets[{n}].longest", b["longest"], MAX_LENGTH) for n, b in enumerate(buckets)),
            value["device"][:200] if isinstance(value.get("device"), str) else None,
        )
    except (KeyError, TypeError, ValueError) as error:  # NumberError is a ValueError
        raise ConfigError(
            f"{where}: its bounds and buckets are not a budgets file's ({error}): make it again with `seqshard "
            "calibrate`."
        ) from None


def _number(field: str, value: Any, at_most: int) -> int:
    return int(read_number(field, value, whole=True, at_least=1, at_most=at_most))  # type: ignore[arg-type]


def _read_file(path: Path) -> Any:
    """A budgets file's JSON (:func:`~seqshard.formats.files.read_json`, at most MAX_FILE_BYTES)."""
    fix = f"give a budgets file (`seqshard calibrate SHARDS --step MODULE:FUNCTION --out {path}` writes one)."
    return read_json(path, fix, limit=MAX_FILE_BYTES)


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
