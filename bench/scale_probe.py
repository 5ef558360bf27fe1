"""bench/pack_scale.py's probe: a pack's scan and bucket waves and its shards' layout, run in
this process as the driver, the tasks on an executor, each task's peak memory measured by itself."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from common import vm_kb


def _with_peak(fn: Any, *args: Any, **kwargs: Any) -> dict:
    record = dict(fn(*args, **kwargs))
    record["peak_kb"] = vm_kb("VmHWM")
    return record


class Measured:
    """Runs each task through :func:`_with_peak` on ``executor``."""

    def __init__(self, executor: Any):
        self.executor = executor
        self._max_workers = getattr(executor, "_max_workers", 0)
        self.peaks: list[int] = []

    def submit(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return _Noted(self.executor.submit(_with_peak, fn, *args, **kwargs), self.peaks)


class _Noted:
    """A future whose result's peak is noted."""

    def __init__(self, future: Any, peaks: list[int]):
        self.future, self.peaks = future, peaks

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> Any:
        record = self.future.result()
        self.peaks.append(record.pop("peak_kb"))
        return record


def plan(folder: Path, spec: str, before_kb: int) -> dict:
    from seqshard.prep.executors import open_executor
    from seqshard.prep.inputs import FeatureSource
    from seqshard.prep.job import PackJob, PackOptions, parse_groups
    from seqshard.prep.layout import group_orders
    from seqshard.prep.waves import Waves, plan_chunks, with_buckets
    from seqshard.progress import Progress

    out = folder / "out"
    shutil.rmtree(out, ignore_errors=True)
    options = PackOptions(groups=parse_groups(["0:1000", "1000:2000"]))
    source = FeatureSource([folder / "feats.scp"], options)
    job = PackJob(out, options, source, (folder / "text",), (folder / "utt2num_frames",), False, 1, run="bench")
    imported_kb = vm_kb("VmHWM")
    with open_executor(spec) as executor, Progress(False) as bars:
        measured = Measured(executor)
        chunks = plan_chunks(job, bars.bar)
        job = with_buckets(job, chunks)
        waves = Waves(job, chunks, measured, bars)
        started = time.perf_counter()
        scans = waves.scan()
        scanned = time.perf_counter()
        buckets = waves.buckets()
        bucketed = time.perf_counter()
        orders = group_orders(buckets, len(options.groups))
        shards = sum(-(-order.size // options.utts_per_file) for order in orders)
    del scans
    peaks = measured.peaks
    table_bytes = sum(c.end - c.start for c in chunks if c.table == "utts")
    shutil.rmtree(out, ignore_errors=True)
    return {
        "driver_mb": vm_kb("VmHWM") / 1024,
        "driver_growth_mb": (vm_kb("VmHWM") - imported_kb) / 1024,
        "imports_mb": (imported_kb - before_kb) / 1024,
        "task_mb": max(peaks) / 1024 if peaks else 0.0,
        "chunks": len(chunks),
        "buckets": job.buckets,
        "shards": shards,
        "planned": sum(order.size for order in orders),
        "scan_s": scanned - started,
        "buckets_s": bucketed - scanned,
        "table_bytes": table_bytes,
    }
