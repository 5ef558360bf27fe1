"""``num_workers="auto"``: as many worker processes as make a batch every ``AUTO_STEP_S``
(the step of a small model on a fast GPU) with room to spare, within the cores this rank may
use (``dist.spare_cores``: its CPU affinity shared by the ranks of its node), one left for
the training process.

A reader's time per batch is measured when the loader is made: reader 0 of a one-reader
loader makes a few batches of the first epoch in this process (after its first, which reads
its first window). The choice decides which batches come out (each worker is a reader), so
every rank must make the same: with several ranks the smallest choice is taken (a collective,
when the process group is up; without one, no measure is taken and the choice is the cores'
alone).
"""

from __future__ import annotations

import logging
import math
import statistics
import time

from ...dist import Collectives, spare_cores
from ...formats.remote.access import RemoteAccess
from ...formats.table import ShardTable
from ...options import LoaderOptions
from ...text.label_override import LabelOverride
from ...text.tokenizers import Tokenizer
from ..loader_sources import MixSetup
from ..workers.runtime import WorkerRuntime
from ..workers.setup import make_setup
from ..workers.worker import Made, ReaderRun

_LOG = logging.getLogger("seqshard")
AUTO_STEP_S = 0.005  # a batch every 5 ms (the small model of bench/README takes 7 ms a step on an H200)
MEASURED_BATCHES = 4


def auto_workers(
    table: ShardTable,
    options: LoaderOptions,
    collectives: Collectives,
    tokenizer: Tokenizer | None,
    override: LabelOverride | None,
    mix: MixSetup | None,
    access: RemoteAccess,
) -> int:
    """The number of worker processes ``num_workers="auto"`` stands for (see the module docstring)."""
    context = collectives.context
    spare = spare_cores()
    seconds = None
    if not context.distributed or collectives.ready():
        setup = make_setup(
            table, options.replace(num_workers=0), context.rank, context.world_size, tokenizer, override, mix, access
        )
        seconds = batch_seconds(ReaderRun(setup, WorkerRuntime(access), 0, 0, {"state": None, "seq": 0}))
    chosen = choose_workers(seconds, spare)
    if context.distributed and collectives.ready():
        (chosen,) = collectives.all_min([chosen])
    _LOG.info(
        "num_workers='auto': %d (%s; %d core(s) for this rank, one left for training)",
        chosen,
        "no batch measured" if seconds is None else f"a reader makes a batch in {1000 * seconds:.1f} ms here",
        spare + 1,
    )
    return chosen


def choose_workers(seconds: float | None, spare: int) -> int:
    """Workers that make a batch every AUTO_STEP_S twice over (at least 2: two readers also
    share each epoch's start), within ``spare`` cores; without a measure, 2 (or ``spare``)."""
    wanted = 2 if seconds is None else max(2, math.ceil(2 * seconds / AUTO_STEP_S))
    return max(1, min(spare, wanted))


def batch_seconds(run: ReaderRun) -> float | None:
    """A reader's time per batch: the median over a few batches after its first (None when
    the reader has too few)."""
    times = []
    for number in range(MEASURED_BATCHES + 1):
        started = time.perf_counter()
        made = run.make()
        if not isinstance(made, Made):
            break
        run.item(made, 0)
        run.prepare()
        if number:
            times.append(time.perf_counter() - started)
    return statistics.median(times) if times else None
