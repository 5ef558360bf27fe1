"""One rank's shard loader: its readers (``workers/``), their batches merged into one
deterministic stream (``merge.py``), epochs that end as the options say (``epochs.py``), and a
small position saved and restored exactly (``checkpoint.py``, ``elastic.py``). It follows the
:class:`seqshard.protocol.Loader` shape; :func:`seqshard.make_loader` makes it.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from ...checks import check_number
from ...dist import Collectives, DistContext
from ...errors import ConfigError
from ...formats.remote.access import RemoteAccess
from ...formats.table import ShardTable
from ...options import LoaderOptions
from ...protocol import PlannedBatches, length_of
from ...text.label_override import LabelOverride
from ...text.tokenizers import Tokenizer
from ..loader_sources import MixSetup
from ..transport.delivery import Delivery
from ..transport.wire import Take
from ..workers.pool import WorkerPool
from ..workers.setup import WorkerSetup, make_setup
from . import batch_plan, checkpoint
from .accounts import EpochAccounts
from .auto import auto_workers
from .batch_plan import PlannedBatch
from .counts import certain_lengths, planned_batches, surely_left
from .cursor import EpochCursor
from .epochs import EpochRules, epoch_rules
from .feed import WAIT_WARN_AFTER, FeedMeter
from .merge import MergedStream, RankPosition

_LOG = logging.getLogger("seqshard")

_BATCH_MEASURES: dict[str, Callable[[PlannedBatch], float]] = {
    "cost": lambda batch: batch.cost,
    "padded": lambda batch: batch.padded,
    "longest": lambda batch: batch.longest,
    "size": lambda batch: batch.size,
}


class ShardLoader:
    """Iterate it once per epoch (``set_epoch`` chooses which); see :func:`seqshard.make_loader`."""

    def __init__(
        self,
        table: ShardTable,
        options: LoaderOptions,
        context: DistContext,
        tokenizer: Tokenizer | None,
        override: LabelOverride | None,
        mix: MixSetup | None,
        access: RemoteAccess,
    ):
        self.table, self.context, self.mix = table, context, mix
        self.collectives = Collectives(context)
        self._access = access
        self._made_from = (tokenizer, override)
        self._auto = options.workers.num_workers == "auto"  # chosen now, or taken from a loaded state
        resolved = options  # the options given, with the worker count measured for "auto"
        if self._auto:
            chosen = auto_workers(table, options, self.collectives, tokenizer, override, mix, access)
            resolved = options.replace(num_workers=chosen)
        self._build(resolved)

    def _build(self, options: LoaderOptions) -> None:
        """The loader's parts for ``options`` (again when a loaded state chose the workers)."""
        table, context, mix, access = self.table, self.context, self.mix, self._access
        self.options = options
        self._planned: tuple[str, PlannedBatches] | None = None  # the last count and the start it is of
        self._setup = make_setup(table, options, context.rank, context.world_size, *self._made_from, mix, access)
        self._pool = WorkerPool(self._setup, access)
        source = (
            mix.epoch_source(options.epochs.epoch_source) if mix and options.epochs.epoch_source is not None else None
        )
        self._rules = epoch_rules(self._setup, self.collectives, source)
        readers = self._setup.readers_per_rank
        self._cursor = EpochCursor(lambda e: RankPosition.fresh(e, readers), self._rules.end.continues_stream)
        self._accounts = EpochAccounts(self._setup, self._rules.end, self.collectives, access)
        self._runner = EpochRunner(self._setup, self._pool, self._rules, self._accounts, self._identity)

    # -- epochs and their size -----------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._cursor.epoch

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next ``iter()`` runs (its shard order and shuffles)."""
        self._cursor.set_epoch(epoch)

    def planned_batches(self) -> PlannedBatches:
        """The batches of the epoch the next iteration runs on this rank, from where it starts
        (a loaded state's position; the next epoch after a state saved at an epoch's end), exact
        or estimated (``protocol.py``)."""
        start = self._cursor.peek()
        key = json.dumps(start.to_json(), sort_keys=True)  # asked again for the same start: the same count
        if self._planned is None or self._planned[0] != key:
            self._planned = key, planned_batches(self._setup, start.epoch, start)
        return self._planned[1]

    def __len__(self) -> int:
        return length_of(self.planned_batches(), "shard loader")

    def planned_utts(self) -> int | None:
        """Utterances this rank's plan holds for the rest of the epoch the next iteration runs,
        for progress bars; None when unknown (shards without an index, streams that go on
        across epochs)."""
        if self._rules.end.continues_stream:
            return None
        return self._accounts.planned_utts(self._cursor.peek())

    @property
    def dim(self) -> int | None:
        """Columns of the batches' ``feats``: the fbank's the loader computes (``features="fbank"``),
        else what the shards' index records; None for batches without features."""
        return self._setup.dim

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer labels go through (its ``vocab_size`` sizes an output layer)."""
        return self._setup.tokenizer

    @property
    def holds_audio(self) -> bool:
        """Whether the shards hold audio (batched as waveforms unless ``features="fbank"``)."""
        return self._setup.fields.audio is not None

    # -- iteration -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self._runner.start(self._cursor.start())

    @property
    def last_summary(self) -> dict[str, Any] | None:
        """The last epoch's summary (``accounts.py``): every rank's, once the epoch ended."""
        return self._runner.summary

    def stats(self, position: RankPosition | None = None) -> dict[str, Any]:
        """This rank's progress in the epoch: utterances (and per second), steps, units done,
        dropped and filtered by reason, padding, label tokens (unknown ones), missing shards,
        and the share of the epoch's time the consumer waited for batches (``data_wait``)."""
        meter = self._runner.meter
        found = self._accounts.stats(position or self._cursor.position, meter.seconds)
        found["data_wait"] = meter.share()
        return found

    def close(self) -> None:
        """Stop worker processes (an iteration after this starts them again)."""
        self._runner.close()

    # -- the plan: batches known before reading ---------------------------------------------
    def heaviest_batches(self, k: int = 1, by: str | Callable[[PlannedBatch], float] = "cost") -> list[PlannedBatch]:
        """The ``k`` costliest batches the next iteration hands out on this rank (the epoch's, or
        its rest after a resume), costliest first: each a batch the epoch will yield, found from
        the shards' member tables without reading a sample. ``by``: ``"cost"`` (the loader's
        batch cost), ``"padded"`` (size x longest), ``"longest"``, ``"size"``, or a function of a
        :class:`~.batch_plan.PlannedBatch`. Raises NotPlannable (a ConfigError) naming what the
        plan cannot see (README, Batches known before reading)."""
        check_number("k", k, whole=True, at_least=1)
        key = by if callable(by) else _BATCH_MEASURES.get(by)
        if key is None:
            raise ConfigError(f"by must be one of {', '.join(_BATCH_MEASURES)} or a function, got {by!r}.")
        batches = batch_plan.rest_of_epoch(self._setup, self._cursor.peek())
        return sorted(batches, key=lambda batch: (-key(batch), batch.step))[:k]

    def skip_batches(self, n: int) -> int:
        """Move the next iteration's start ``n`` batches on without reading them (fewer at
        the epoch's end): call it on every rank with the same ``n``, after ``load_state_dict``
        (or before an epoch's first ``iter()``). The batches are those an uninterrupted run
        would have handed out next; they count as steps, and ``stats()["skipped"]`` counts them
        and their utterances (kept in the state). Returns how many it skipped. Raises
        NotPlannable as :meth:`heaviest_batches` does."""
        check_number("n", n, whole=True, at_least=0)
        self._runner.close_active()
        start = self._cursor.peek()
        moved = batch_plan.skip(self._setup, start, n)
        self._cursor.load(moved)
        return moved.step - start.step

    # -- checkpointing ------------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        return checkpoint.identity(self.table, self.options, self.context.world_size, self.mix)

    def state_dict(self, gather: bool = True) -> dict[str, Any]:
        """The loader's position: a small JSON-safe dict (no sample data).

        With several ranks and ``gather=True`` (the default) this is a collective: call it on
        every rank at the same step; every rank gets every rank's position, so rank 0 can save
        one dict for all. ``gather=False`` returns this rank's alone.
        """
        return checkpoint.state(self._cursor.position, self._identity(), self.collectives, gather)

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Continue from ``state`` at the next ``iter()``; a state saved at an epoch's end goes
        on with the next epoch. A state saved with other shards, world size, workers or
        batch-defining options is refused with StateMismatchError naming what differs; with
        ``strict=False`` a state of the same shards saved with another world size, worker count
        or options is resumed elastically: what the saved ranks had not handed out is spread
        over the new ranks and workers, each utterance read once (other batches than an
        uninterrupted run would give). That needs every rank's state (``gather=True``).

        A loader made with ``num_workers="auto"`` takes the worker count the state was saved
        with (its readers decide the batches), so an exact resume does not depend on what the
        measure chose this time."""
        saved = state.get("identity", {}).get("options", {}).get("num_workers") if isinstance(state, dict) else None
        if self._auto and isinstance(saved, int) and saved != self.options.workers.num_workers:
            self.close()
            before = self._runner
            self._build(self.options.replace(num_workers=saved))
            self._runner.summary, self._runner.warned_overlap = before.summary, before.warned_overlap
        self._cursor.load(
            checkpoint.restore(state, self._identity(), self._setup, self._access, self.collectives, strict)
        )
        if self.options.workers.num_workers:  # they restore it while the caller goes on (loading a model, ...)
            self._runner.start_early(self._cursor.peek())


class EpochRunner:
    """This rank's iterations, one at a time: the workers' batches merged in a fixed turn, the
    epoch rules asked where the epoch ends, the consumer's waits timed, the accounts kept."""

    def __init__(
        self,
        setup: WorkerSetup,
        pool: WorkerPool,
        rules: EpochRules,
        accounts: EpochAccounts,
        identity: Callable[[], dict[str, Any]],
    ):
        self.setup, self.pool, self.rules, self.accounts = setup, pool, rules, accounts
        self.identity = identity  # the loader's, which the ranks check they share
        self.collectives = accounts.collectives
        self.meter = FeedMeter(setup.options.workers, setup.rank)
        self.summary: dict[str, Any] | None = None  # the last epoch's
        self.warned_overlap = False
        self._ranks_agree = False
        self._active: weakref.ref | None = None
        self._primed: tuple[RankPosition, Take] | None = None  # workers started on a loaded position
        self.delivery = Delivery(setup.options, setup.audio)

    def start(self, position: RankPosition) -> Iterator[dict[str, Any]]:
        """An iteration from ``position`` (ending one still running: its slots are reused)."""
        self.close_active(warn=True)
        iteration = self._iterate(position)
        self._active = weakref.ref(iteration)
        return iteration

    def start_early(self, position: RankPosition) -> None:
        """Start the workers on a loaded ``position`` now: the next iteration takes their
        batches if it starts there (else it sends them where it starts instead)."""
        self._primed = None
        self._primed = position, self.pool.start(position.epoch, position.worker_request())

    def _iterate(self, position: RankPosition) -> Iterator[dict[str, Any]]:
        if position.completed:  # a state saved at the end of the epoch set_epoch chose: nothing is left
            return
        rules, accounts, meter, setup = self.rules, self.accounts, self.meter, self.setup
        bad_shards = accounts.bad_shards
        if not self._ranks_agree and self.collectives.context.distributed and rules.end.gathers_summary:
            self._ranks_agree = checkpoint.check_ranks_agree(self.identity(), self.collectives)
        bad_shards.start(position)
        meter.begin()
        damaged = [0] * len(position.workers)  # damaged shards each reader reported
        clock = time.perf_counter
        try:
            primed, self._primed = self._primed, None
            started = primed[1] if primed is not None and primed[0] is position else None
            take = self.delivery.take(
                started or self.pool.start(position.epoch, position.worker_request()), len(position.workers)
            )
            # A consumer may stop after len() batches: the epoch's summary is then made at the
            # last one, where every rank knows it without walking the plan or drawing orders of
            # lengths (which would delay each epoch's first batch: 50-500 ms at 12,000
            # utterances); otherwise the summary comes when the consumer asks for one more batch.
            planned = planned_batches(setup, position.epoch, position, estimate=False)
            exact = planned.total if planned.exact else None
            # the data's own count (epoch_steps caps an epoch, it does not make the data last)
            rules.start(position, exact if rules.talks and setup.options.epochs.epoch_steps is None else None)
            last = exact if not rules.talks else None  # the ranks that talk know it from the agreement
            stream, left, batch = MergedStream(take, position), self._surely_left(position), None
            due, over, next_item, emit = rules.due, rules.over, stream.next, stream.emit
            while True:
                asked = clock()
                if due(position):
                    judge = lambda summed: bad_shards.judge_together(position, summed)  # noqa: E731
                    rules.agree(position, stream, left, bad_shards.damaged_count(position) if rules.talks else 0, judge)
                if over(position):
                    break
                item = next_item()
                if item is None:
                    if rules.ran_out(position, batch, setup.rank):
                        break
                    stream.emit_again()
                    batch = dict(batch)  # type: ignore[arg-type]
                else:
                    emit(item)
                    batch = item.batch
                    meter.busy += item.busy
                    if item.damaged != damaged[item.worker] or meter.steps == 0:  # a newly damaged shard
                        damaged[item.worker] = item.damaged
                        bad_shards.check(position)
                meter.waited += clock() - asked
                steps = meter.steps = meter.steps + 1
                if steps == 1:
                    meter.first = meter.waited
                elif steps % WAIT_WARN_AFTER == 0:
                    meter.judge()
                    accounts.judge_unknown_tokens(position)
                if position.step == last or (position.ends and position.step == position.agreed):
                    self._finish(position, position.ends == "length")
                yield batch
            del stream
            if not position.completed:
                self._finish(position, rules.over(position) and position.ends == "length")
        finally:
            self.delivery.finish()  # batches copied ahead are dropped (the position never counted them)
            self.pool.finish()  # stops workers that do not persist now, not at garbage collection

    def _surely_left(self, position: RankPosition) -> Callable[[int], int | None]:
        """What this rank's samples not yet taken, less ``held`` ones, surely still make in
        batches (``counts.surely_left``; None when its shards' index does not say); where samples
        may be dropped as they are read, at the share of those taken so far that were kept (the
        rest of a damaged shard aside: it does not make the next shards worse)."""
        setup, accounts, cautious = self.setup, self.accounts, self.rules.cautious
        certain: list = []  # found at the first agreement that needs it

        def left(held: int) -> int | None:
            if not certain:
                workers = range(len(position.workers))
                certain.append(certain_lengths(setup, [u for w in workers for u in accounts.units_of(position, w)]))
            remaining = accounts.planned_utts(position)
            if certain[0] is None or remaining is None:
                return None
            found = surely_left(setup, certain[0], remaining - held)
            taken = position.taken() - position.counters().get("dropped.damaged", 0)  # a damaged shard: once
            if not cautious or taken <= 0:
                return found
            return math.floor(found * min(1.0, (position.utts + position.skipped_utts) / taken))

        return left

    def _finish(self, position: RankPosition, cut: bool) -> None:
        """The epoch is complete (on every rank at the same step: the summary is a collective)."""
        self.meter.end()
        position.completed = True
        self.summary = self.accounts.finish(position, self.meter.seconds, cut)

    def close(self) -> None:
        """End the running iteration and stop worker processes."""
        self.close_active()
        self._primed = None
        self.pool.close()

    def close_active(self, warn: bool = False) -> None:
        """End the iteration still running, if any (``warn``: say so when its loop was still
        reading, once per loader: its loop stops as if the epoch were over)."""
        previous = self._active() if self._active is not None else None
        if previous is None:
            return
        if warn and not self.warned_overlap and inspect.getgeneratorstate(previous) == inspect.GEN_SUSPENDED:
            self.warned_overlap = True
            _LOG.warning(
                "a new iteration of this loader began while an earlier one was still being read: the earlier "
                "one ends here, its loop stops as if the epoch were over. A loader reads one iteration at a "
                "time: finish or drop the first loop, or make a second loader to read both at once."
            )
        previous.close()
