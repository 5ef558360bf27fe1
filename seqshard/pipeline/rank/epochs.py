"""How an epoch ends across ranks, and how long it is.

An :class:`EpochEnd` decides, step by step, whether this rank goes on (one per ``uneven``
mode); an :class:`EpochLength` caps an epoch at a number of steps or hours of audio; a
:class:`BucketSync` makes every rank take a batch of the same length bucket at each step.
The loader combines one of each (see ``ShardLoader._iterate``):

- ``"stop"``: every rank ends the epoch at the step where any rank runs out (one all-reduce
  of one integer per step);
- ``"repeat"``: readers go round their data again; an epoch is ``epoch_steps``,
  ``epoch_hours`` or, for a mix, ``epoch_source`` (the stream goes on across epochs);
- ``"join"``: each rank reads all of its data with no communication (for torch's ``Join``).
"""

from __future__ import annotations

from ...dist import Collectives
from ...errors import ConfigError
from ...options import Epochs
from ..workers.protocol import BatchItem
from .merge import MergedStream, RankPosition


class EpochEnd:
    """The end-of-epoch rule of one ``uneven`` mode."""

    #: the position carries on into the next epoch instead of starting afresh
    continues_stream = False
    #: ranks gather each other's epoch summary (a collective at the end of an epoch)
    gathers_summary = True

    def settle(self, item: BatchItem | None, agreed: bool) -> BatchItem | None:
        """The item this rank hands out at this step (None ends its epoch), given its own
        next ``item`` (None: out of data); ``agreed`` when every rank already decided together."""
        raise NotImplementedError


class StopTogether(EpochEnd):
    """``"stop"``: all ranks end the epoch at the first step where one has no batch."""

    def __init__(self, collectives: Collectives):
        self.collectives = collectives
        self._alone = not collectives.context.distributed

    def settle(self, item: BatchItem | None, agreed: bool) -> BatchItem | None:
        if agreed or self._alone:
            return item
        (everyone,) = self.collectives.all_min([0 if item is None else 1])
        return item if everyone else None


class RepeatStream(EpochEnd):
    """``"repeat"``: the data never runs out; epochs are cut by their length."""

    continues_stream = True

    def settle(self, item: BatchItem | None, agreed: bool) -> BatchItem | None:
        if item is None:
            raise ConfigError("the data ran out in uneven='repeat' mode (no reader has any data?).")
        return item


class JoinUneven(EpochEnd):
    """``"join"``: each rank reads all of its data, without talking to the others."""

    gathers_summary = False

    def settle(self, item: BatchItem | None, agreed: bool) -> BatchItem | None:
        return item


def epoch_end(mode: str, collectives: Collectives) -> EpochEnd:
    if mode == "stop":
        return StopTogether(collectives)
    if mode == "repeat":
        return RepeatStream()
    if mode == "join":
        return JoinUneven()
    raise ConfigError(f"uneven must be 'stop', 'repeat' or 'join', got {mode!r}.")


class EpochLength:
    """No cap: an epoch lasts until the data (or the end rule) ends it."""

    def over(self, position: RankPosition) -> bool:
        return False


class StepLimit(EpochLength):
    """An epoch of ``steps`` steps (the same on every rank; no communication)."""

    def __init__(self, steps: int):
        self.steps = steps

    def over(self, position: RankPosition) -> bool:
        return position.step >= self.steps


class HoursLimit(EpochLength):
    """An epoch of ``hours`` hours of audio summed over all ranks (one all-reduce per step)."""

    def __init__(self, hours: float, frame_shift_ms: float, collectives: Collectives):
        self.frames = hours * 3.6e6 / frame_shift_ms
        self.collectives = collectives

    def over(self, position: RankPosition) -> bool:
        (frames,) = self.collectives.all_sum([position.frames])
        return frames >= self.frames


class SourceRead(EpochLength):
    """An epoch in which source ``source`` of a mix gave ``utts`` utterances (its size: one
    pass's worth), summed over all ranks (one all-reduce per step)."""

    def __init__(self, source: int, utts: int, collectives: Collectives):
        self.source = source
        self.utts = utts
        self.collectives = collectives

    def over(self, position: RankPosition) -> bool:
        mine = position.sources[self.source][0] if position.sources else 0
        (utts,) = self.collectives.all_sum([mine])
        return utts >= self.utts


def epoch_length(
    steps: int | None,
    hours: float | None,
    frame_shift_ms: float,
    collectives: Collectives,
    source: tuple[int, int] | None = None,
) -> EpochLength:
    """The rule for ``epoch_steps``, ``epoch_hours`` or (``source`` = (index, utterances))
    ``epoch_source``; without any, no cap."""
    if steps is not None:
        return StepLimit(steps)
    if hours is not None:
        return HoursLimit(hours, frame_shift_ms, collectives)
    if source is not None:
        return SourceRead(*source, collectives)
    return EpochLength()


class BucketSync:
    """Every rank takes a batch of the same length bucket at each step: the bucket whose
    smallest queue over ranks is longest; when none is common to all, every rank pulls one
    more batch into its queues. Returns None (on every rank) once a rank has run out."""

    def __init__(self, buckets: int, collectives: Collectives):
        self.buckets = buckets
        self.collectives = collectives

    def next(self, stream: MergedStream) -> BatchItem | None:
        while True:
            mins = self.collectives.all_min(stream.reservoir_counts() + [0 if stream.exhausted else 1])
            common = [b for b in range(self.buckets) if mins[b] > 0]
            if common:
                return stream.take_from_reservoir(max(common, key=lambda b: (mins[b], -b)))
            if mins[-1] == 0:
                return None
            stream.pull_into_reservoir()


class EpochRules:
    """One loader's epoch rules together: how an epoch ends across ranks (``end``), how long it
    is (``length``), and whether the ranks take batches of one length bucket at each step."""

    def __init__(self, end: EpochEnd, length: EpochLength, bucket_sync: BucketSync | None = None):
        self.end = end
        self.length = length
        self.bucket_sync = bucket_sync

    @property
    def capped(self) -> bool:
        """Whether an epoch has a length of its own (steps, hours, a source's pass)."""
        return type(self.length) is not EpochLength

    def over(self, position: RankPosition) -> bool:
        """Whether the epoch's length is reached (not the data's end)."""
        return self.length.over(position)

    def next_item(self, stream: MergedStream) -> BatchItem | None:
        """The batch for this step, or None when the data ends the epoch (on every rank at
        once, except with ``uneven='join'``)."""
        if self.bucket_sync is not None:
            return self.end.settle(self.bucket_sync.next(stream), agreed=True)
        return self.end.settle(stream.pull(), agreed=False)


def epoch_rules(
    epochs: Epochs,
    frame_shift_ms: float,
    collectives: Collectives,
    buckets: int = 0,
    source: tuple[int, int] | None = None,
) -> EpochRules:
    """The rules the ``epochs`` options describe (``buckets``: length buckets synchronised over
    ranks, 0 for none; ``source``: ``epoch_source``'s (index, utterances) for a mix)."""
    return EpochRules(
        epoch_end(epochs.uneven, collectives),
        epoch_length(epochs.epoch_steps, epochs.epoch_hours, frame_shift_ms, collectives, source),
        BucketSync(buckets, collectives) if buckets else None,
    )
