"""The source stage of a mix (``make_loader(seqshard.mux([...], weights=[...]))``).

Each leaf source of the mux is an endless stream of passes over its own shards (each pass a
new plan of that source's shards over the readers); :class:`Mix` takes the next sample from
the source that :func:`seqshard.mix.next_block` names, and every later stage of the recipe
(labels, audio, transforms, filters, the shuffle window, batching) works on the mixed stream
as on one source. The stream goes on across epochs (an epoch is ``epoch_steps``,
``epoch_hours`` or, with ``epoch_source``, one pass's worth of one source's utterances).

State: the block number, how many samples each source has given, and each source's stream
state (its pass number and position): a resume continues exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...mix import GROUP, block_orders, block_quotas, place
from .base import Stage, State, merge_counts
from .sample import Sample


class Mix(Stage[Sample]):
    """Takes each sample from the source :func:`seqshard.mix.next_block` names; tags it with
    its source (``sample.stream``). Counters ``mix.<source>`` count the samples taken.

    ``next()`` runs per sample and does only that: the samples taken per source are derived
    from the counts when the block began and the picks taken of it when they are asked for.
    """

    def __init__(self, streams: Sequence[Stage[Sample]], shares: Sequence[float], seed: int, *position: int):
        super().__init__(None)
        self.streams = list(streams)
        self.shares = [float(share) for share in shares]
        self.seed = seed
        self.position = position
        self._names = [f"mix.{source}" for source in range(len(self.streams))]
        self._block = -1
        self._picks: list[int] = []  # the current block's sources (plain lists: next() is per sample)
        self._offset = 0  # how many of them were taken
        self._at_block = [0] * len(self.streams)  # samples taken per source when the current block began
        self._orders_group = -1  # the group of blocks whose orders are in _orders
        self._orders: list[list[int]] = []

    def reset(self, state: State | None = None) -> None:
        super().reset(state)
        state = state or {}
        self._block = int(state.get("block", -1))
        self._offset = int(state.get("offset", 0))
        self._at_block = [int(c) for c in state.get("at_block", state.get("counts", [0] * len(self.streams)))]
        self._picks = self._block_picks() if self._block >= 0 else []
        streams = state.get("streams") or [None] * len(self.streams)
        for stream, stream_state in zip(self.streams, streams):
            stream.reset(stream_state)

    def taken(self) -> list[int]:
        """How many samples each source has given."""
        done = self._picks[: self._offset]
        return [count + done.count(source) for source, count in enumerate(self._at_block)]

    def _block_picks(self) -> list[int]:
        """``next_block`` of the current block, its group's orders drawn once per group."""
        group, row = divmod(self._block, GROUP)
        if group != self._orders_group:
            self._orders, self._orders_group = block_orders(self.seed, group, *self.position), group
        return place(block_quotas(self.shares, self._at_block), self._orders[row])

    def _next_block(self) -> None:
        self._at_block = self.taken()
        self._block += 1
        self._offset = 0
        self._picks = self._block_picks()

    def next(self) -> Sample:
        if self._offset == len(self._picks):
            self._next_block()
        source = self._picks[self._offset]
        sample = self.streams[source].next()  # endless: a StopIteration here is a real end
        self._offset += 1
        sample.stream = source
        return sample

    def get_state(self) -> State:
        return {
            "block": self._block,
            "offset": self._offset,
            "counts": self.taken(),
            "at_block": list(self._at_block),
            "streams": [stream.get_state() for stream in self.streams],
        }

    def stats(self) -> dict[str, int]:
        return merge_counts(dict(zip(self._names, self.taken())), *(stream.stats() for stream in self.streams))

    def pending(self) -> list[Any]:
        return [item for stream in self.streams for item in stream.pending()]

    def prepare(self) -> None:
        for stream in self.streams:
            stream.prepare()

    def read_further(self, until: float) -> bool:
        return all([stream.read_further(until) for stream in self.streams])


def per_source_counts(samples: Sequence[Sample], lengths: Sequence[int], sources: int) -> list[list[int]]:
    """[utterances, summed length] per source of a batch's samples."""
    utts, summed = [0] * sources, [0] * sources
    for sample, length in zip(samples, lengths):
        utts[sample.stream] += 1
        summed[sample.stream] += length
    return [[count, int(total)] for count, total in zip(utts, summed)]
