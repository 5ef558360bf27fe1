"""How an epoch ends across ranks, and how long it is.

An :class:`EpochEnd` is one ``uneven`` mode and an :class:`EpochLength` caps an epoch at a
number of steps, hours of audio or a mixed source's pass; :class:`EpochRules` holds one of each
and decides where the epoch ends:

- ``"stop"``: every rank ends the epoch at the step where the first runs out;
- ``"repeat"``: readers go round their data again; an epoch is ``epoch_steps``,
  ``epoch_hours`` or, for a mix, ``epoch_source`` (the stream goes on across epochs);
- ``"join"``: each rank reads all of its data with no communication (for torch's ``Join``).

The ranks do not meet at every step. They agree on a step that every rank surely reaches
(``RankPosition.agreed``; the first time at an epoch's start), step to it without talking, and
there exchange what they know in one collective (an all-reduce of four integers a rank,
:meth:`EpochRules.agree`): how many
batches each surely still hands out (``counts.surely_left`` on the samples it has not taken,
halved where samples may be dropped as they are read: ``counts.unforeseen``; plus
the batches it took ahead) and whether that is exact (its readers are done); the damaged shards
each met (``skip_bad``'s budget, judged over all ranks); and each one's part of the epoch's
length: the frames (``epoch_hours``) or the epoch's source's utterances (``epoch_source``) it
handed out. The next agreed step is the least of what every rank surely has left and of the
step where the length will be reached at the rate so far (the first time, at the index's mean
length; a little before while it is far). The epoch ends there (``RankPosition.ends``) when a rank whose readers are done has the
least left (``"data"``), or at an agreement where the hours or utterances summed over ranks
have reached the length (``"length"``: an epoch cut by a length is that length or a step or
two more). A rank with fewer than ``LOOKAHEAD`` batches surely left first takes batches ahead
(``MergedStream.hold``), so the end is found in one more exchange; one whose shards' index does
not say what they hold steps ``LOOKAHEAD`` at a time. With an exact count (``epoch_steps``;
fixed ``batch_size`` with nothing dropped unforeseen) the ranks do not talk at all.

Should a rank run out before the agreed step (its shards held less than their index: a shard
found damaged under ``skip_bad`` took more than the half kept in reserve), it hands out its last
batch again up to that step, with a warning and counted (``stats()["repeated"]``), so that the
ranks still end the epoch together.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from ...dist import Collectives
from ...errors import ConfigError, SeqshardError
from ...formats.index_entries import bin_length
from ...options import Epochs
from ..stages.batching import BucketBudgets, FixedSize
from ..workers.recipe import batch_cost
from ..workers.setup import WorkerSetup
from .counts import unforeseen
from .merge import MergedStream, RankPosition

_LOG = logging.getLogger("seqshard")
NEVER = 1 << 62  # an agreed step no epoch reaches
LOOKAHEAD = 16  # batches a rank near its end (or without an index) takes ahead to count them
CAUTION = 0.5  # of its batches surely left that a rank counts on when samples may be dropped as read
BUDGET_CHECKS = 3  # agreements an epoch of epoch_steps holds for skip_bad's budget alone (at least BUDGET_STEPS apart)
BUDGET_STEPS = 16
DROPPING = "skip_bad, check_finite, the label filters, transforms"
CLOSE, SHORT = 8, 1.5  # a length checked more than CLOSE steps ahead is aimed SHORT x its square root before


class EpochEnd:
    """The end-of-epoch rule of one ``uneven`` mode."""

    #: the position carries on into the next epoch instead of starting afresh
    continues_stream = False
    #: ranks gather each other's epoch summary and agree on where epochs end
    gathers_summary = True
    #: the ranks end the epoch together where the first runs out of data
    stops_together = False


class StopTogether(EpochEnd):
    """``"stop"``: all ranks end the epoch at the first step where one has no batch."""

    stops_together = True


class RepeatStream(EpochEnd):
    """``"repeat"``: the data never runs out; epochs are cut by their length."""

    continues_stream = True


class JoinUneven(EpochEnd):
    """``"join"``: each rank reads all of its data, without talking to the others."""

    gathers_summary = False


def epoch_end(mode: str) -> EpochEnd:
    if mode == "stop":
        return StopTogether()
    if mode == "repeat":
        return RepeatStream()
    if mode == "join":
        return JoinUneven()
    raise ConfigError(f"uneven must be 'stop', 'repeat' or 'join', got {mode!r}.")


class EpochLength:
    """No cap: an epoch lasts until the data (or the end rule) ends it."""

    steps: int | None = None  # a cap known to every rank without talking
    target = math.inf  # a cap on an amount summed over ranks
    per_step = math.inf  # about how much of that amount one rank hands out in a step

    def amount(self, position: RankPosition) -> int:
        """This rank's part of the summed amount this epoch."""
        return 0


class StepLimit(EpochLength):
    """An epoch of ``steps`` steps (the same on every rank; no communication)."""

    def __init__(self, steps: int):
        self.steps = steps


class HoursLimit(EpochLength):
    """An epoch of ``hours`` hours of audio summed over all ranks (``per_step``: about the
    frames of a batch)."""

    def __init__(self, hours: float, frame_shift_ms: float, per_step: float = math.inf):
        self.target = hours * 3.6e6 / frame_shift_ms
        self.per_step = per_step

    def amount(self, position: RankPosition) -> int:
        return position.frames


class SourceRead(EpochLength):
    """An epoch in which source ``source`` of a mix gave ``utts`` utterances (its size: one
    pass's worth), summed over all ranks (``per_step``: about the source's samples in a batch)."""

    def __init__(self, source: int, utts: int, per_step: float = math.inf):
        self.source = source
        self.target = utts
        self.per_step = per_step

    def amount(self, position: RankPosition) -> int:
        return position.sources[self.source][0] if position.sources else 0


class EpochRules:
    """One loader's epoch rules: how an epoch ends across ranks (``end``), how long it is
    (``length``), and where the ranks agree on both (see the module docstring). ``cautious``:
    samples may be dropped as they are read, so a rank counts on only ``CAUTION`` of the
    batches its samples left would make; ``budget``: ``skip_bad``'s budget is judged where
    they agree, a few times an epoch at least."""

    def __init__(
        self,
        end: EpochEnd,
        length: EpochLength,
        collectives: Collectives,
        cautious: bool = False,
        budget: bool = False,
    ):
        self.end = end
        self.length = length
        self.collectives = collectives
        self.cautious = cautious
        self.budget = budget  # skip_bad's budget of damaged shards is judged where ranks agree
        distributed = collectives.context.distributed
        self.talks = distributed and end.gathers_summary  # the ranks agree on where epochs end
        self.together = distributed and end.stops_together  # ... and on where the data ends them
        self.summed = length.target < math.inf  # a length summed over ranks
        self._warned = False

    def start(self, position: RankPosition, exact: int | None) -> None:
        """Settle, without talking, what an iteration starting at ``position`` knows: the
        epoch's exact batch count on every rank (``exact``, or None; else the ranks agree at
        once). A resumed position keeps what the ranks had agreed."""
        self._warned = False
        if position.ends or position.agreed > position.step:
            return
        data_at, data_final = NEVER, False
        if exact is not None:
            data_at, data_final = exact, True
        elif self.together:
            data_at = position.step
        self._settle(position, data_at, data_final, self._first_length_check(position.step), False)

    def agree(
        self,
        position: RankPosition,
        stream: MergedStream,
        left: Callable[[int], int | None],
        damaged: int,
        judge: Callable[[int], None],
    ) -> None:
        """At the agreed step: every rank says what it surely has left (``left(utts)``: the
        batches its samples not taken still make, less ``utts`` taken ahead; None unknown),
        whether its readers are done, its ``damaged`` shards and its part of the length (one
        collective when ranks talk); ``judge`` gets the damaged shards summed over ranks; the
        position gets the next agreed step, and whether the epoch ends there."""
        surely, done = self._surely_left(stream, left) if self.together else (NEVER, False)
        rows = self.collectives.gather_ints([surely, int(done), damaged, self.length.amount(position)])
        judge(sum(row[2] for row in rows))
        position.agreements += 1
        step = position.step
        least = min(row[0] for row in rows)
        data_final = any(row[1] and row[0] == least for row in rows)
        total = sum(row[3] for row in rows)
        reached = total >= self.length.target
        length_at = step if reached else self._next_length_check(step, total, position.agreements)
        self._settle(position, step + least, data_final, length_at, reached)

    def _surely_left(self, stream: MergedStream, left: Callable[[int], int | None]) -> tuple[int, bool]:
        """The batches this rank surely still hands out, and whether that is exact (its
        readers are done): those held ahead, and what its samples left make; with fewer than
        ``LOOKAHEAD`` of these, it first takes batches ahead."""
        if self.cautious and not stream.held:  # a batch in hand, to hand out again should it run out early
            stream.hold(1)
        if not stream.exhausted and self._from_samples(stream, left) < LOOKAHEAD:
            stream.hold(LOOKAHEAD)
        if stream.exhausted:
            return len(stream.held), True
        return len(stream.held) + self._from_samples(stream, left), False

    def _from_samples(self, stream: MergedStream, left: Callable[[int], int | None]) -> int:
        """The batches this rank's samples not taken (nor held) surely still make."""
        found = left(sum(item.size for item in stream.held))
        return 0 if found is None else math.floor(found * (CAUTION if self.cautious else 1))

    def _first_length_check(self, step: int) -> int:
        """Where an iteration starting at ``step`` first compares the summed length: at once
        when alone (free) or resumed, else a little before where the index's lengths say the
        ranks reach it."""
        if not self.summed:
            return self._budget_check(step)
        if not self.collectives.context.distributed or step:
            return step
        steps = self.length.target / (self.collectives.context.world_size * self.length.per_step)
        return max(1, math.floor(steps - SHORT * math.sqrt(steps)))

    def _next_length_check(self, step: int, total: int, agreements: int) -> int:
        """Where the summed length is next compared (every step for a rank alone): where the
        rate so far reaches it, a little before while that is far and the epoch's agreements
        allow one more (the rate's error grows with the distance), else right there (twice as
        far when nothing was counted yet)."""
        if not self.summed:
            return self._budget_check(step)
        if not self.collectives.context.distributed:
            return step + 1
        if step <= 0:
            return self._first_length_check(step)
        if total <= 0:
            return 2 * step
        left = (self.length.target - total) * step / total
        allowed = max(4, (step + left) / 16) - 1  # an epoch's collectives, less its summary
        if left > CLOSE and agreements + 3 <= allowed:  # room for this one, the exact one and one more
            return step + max(1, math.floor(left - SHORT * math.sqrt(left)))
        return step + max(1, math.ceil(left))

    def _budget_check(self, step: int) -> int:
        """An epoch of ``epoch_steps`` whose ranks talk only for ``skip_bad``'s budget: a few
        agreements an epoch."""
        steps = self.length.steps
        if not self.budget or steps is None or not self.talks or self.together:
            return NEVER
        return step + max(BUDGET_STEPS, steps // BUDGET_CHECKS)

    def _settle(self, position: RankPosition, data_at: int, data_final: bool, length_at: int, reached: bool) -> None:
        """The next agreed step: the least of where the data surely lasts, where the length is
        next looked at (or reached) and ``epoch_steps``; whether the epoch ends there."""
        steps = self.length.steps if self.length.steps is not None else NEVER
        at = min(data_at, length_at, steps)
        if (reached and length_at <= data_at) or (self.length.steps is not None and steps <= min(data_at, length_at)):
            position.ends = "length"
        elif data_final and data_at <= length_at:
            position.ends = "data"
        position.agreed = at

    def over(self, position: RankPosition) -> bool:
        """Whether the epoch ended at this step (on every rank that talks at once)."""
        return bool(position.ends) and position.step >= position.agreed

    def due(self, position: RankPosition) -> bool:
        """Whether the ranks agree anew before this step."""
        return not position.ends and position.step >= position.agreed

    def ran_out(self, position: RankPosition, last: dict | None, rank: int) -> bool:
        """This rank's readers are done at this step: True when that ends its epoch (a rank
        alone or under ``"join"``), False when it must hand out ``last`` again to reach the
        agreed step with the others (warned once an epoch)."""
        if self.end.continues_stream:
            raise ConfigError("the data ran out in uneven='repeat' mode (no reader has any data?).")
        if not self.together:
            return True
        if last is None:
            raise SeqshardError(
                f"rank {rank} has no batch for step {position.step} of epoch {position.epoch}, which every rank "
                f"surely reaches by what they agreed, and none to hand out again: its readers ran out early "
                f"(samples dropped as they were read took more than its reserve: {DROPPING}), or this "
                "state was saved while it repeated its last batch. Resume from a state saved before that, "
                "with strict=False, or train with uneven='join' under torch's Join."
            )
        if not self._warned:
            self._warned = True
            _LOG.warning(
                "seqshard epoch %d rank %d: its readers ran out at step %d, before step %d that every rank "
                "surely reaches by the lower bound of its batches (samples dropped as they were read took more "
                f"than its reserve: {DROPPING}): it hands out its last batch again up to that step, so "
                "that every rank ends the epoch together (stats()['repeated'] counts them).",
                position.epoch,
                rank,
                position.step,
                position.agreed,
            )
        return False


def per_batch(setup: WorkerSetup, samples: bool) -> float:
    """About the frames (``samples``: samples) of a batch, from the index's mean length (a
    budget's batches: its frames, as if full); infinite without a length histogram."""
    histogram = setup.table.length_hist
    count = sum(n for _, n in histogram)
    if not count:
        return math.inf
    mean = sum(bin_length(key + 0.5) * n for key, n in histogram) / count
    cost = batch_cost(setup.options.batching)
    if isinstance(cost, FixedSize):
        return cost.size if samples else cost.size * mean
    budget = max(cost.budgets.budgets) if isinstance(cost, BucketBudgets) else cost.budget  # type: ignore[union-attr]
    return budget / mean if samples else budget


def epoch_rules(setup: WorkerSetup, collectives: Collectives, source: tuple[int, int] | None = None) -> EpochRules:
    """The rules ``setup``'s options describe (``source``: ``epoch_source``'s (index,
    utterances) for a mix)."""
    epochs: Epochs = setup.options.epochs
    if epochs.epoch_steps is not None:
        length: EpochLength = StepLimit(epochs.epoch_steps)
    elif epochs.epoch_hours is not None:
        length = HoursLimit(epochs.epoch_hours, setup.table.frame_shift_ms, per_batch(setup, False))
    elif source is not None:
        assert setup.mix is not None
        length = SourceRead(*source, per_batch(setup, True) * setup.mix.shares[source[0]])
    else:
        length = EpochLength()
    cautious = bool(unforeseen(setup))
    return EpochRules(epoch_end(epochs.uneven), length, collectives, cautious, setup.options.bad_data.skip_bad)
