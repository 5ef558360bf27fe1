"""A window's samples read again from their origins, so that a restore does not read the window
again (``stages/held.py``; issue 32, item 5).

:func:`attach` gives each window stage of a reader's pipeline a ``replay`` where what the window
holds are samples made from what a shard reader read by stages that look at the sample alone:
decoding, labels, the audio and feature stages, the loader's function transforms and filters
(``Map``, ``Filter``, ``Labels``: their randomness comes from ``reader.sample_rng``, the same for
a sample whenever it is read). A :class:`Replay` is a second copy of those stages (the recipe
built again) over a :class:`~..stages.reader.SampleFetcher` instead of the shard reader: it makes
a sample again from its origin, as it was made when first read. Its stages count apart from the
pipeline's (the samples were counted when first read). A window over anything else (a Stage of
the user's, noise mixed in, a mix of sources), and a window stage of the user's (its outputs may
not be made again from the record alone: ``WINDOWS``), is restored by reading it again, as before.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from ...errors import SeqshardError
from ..stages.base import Filter, Map, Stage, WindowStage
from ..stages.batching import SortBatch
from ..stages.buckets import BucketSortBatch
from ..stages.held import Origin
from ..stages.labels import Labels
from ..stages.sample import Sample
from ..stages.shuffle import WindowShuffle

REPLAYABLE = (Map, Filter, Labels)  # exactly these classes: a subclass of the user's may keep state
# windows whose outputs their record makes again (a subclass of the user's may not; bucket sync's
# only hands a window's batches out in another order, which the record keeps)
WINDOWS = (WindowShuffle, SortBatch, BucketSortBatch)


def attach(pipeline: Stage, rebuild: Callable[[], Stage]) -> int:
    """Give the window stages of ``pipeline`` whose items can be made again a :class:`Replay`
    (``rebuild()``: the same pipeline built again, reading nothing); how many were given one."""
    chain = stages_of(pipeline)
    given = 0
    for depth, stage in enumerate(chain):
        if type(stage) in WINDOWS and _replayable(chain[depth + 1 :]):
            stage.replay = Replay(rebuild, depth)
            given += 1
    return given


def stages_of(stage: Stage | None) -> list[Stage]:
    """``stage`` and its sources, down to the first stage."""
    found = []
    while stage is not None:
        found.append(stage)
        stage = stage.source
    return found


def _replayable(below: list[Stage]) -> bool:
    """Whether the items of the stages ``below`` a window (down to the source) can be made
    again one by one: a source that can read them again (``fetcher()``: a shard reader's
    :class:`~..stages.reader.SampleFetcher`), and between it and the window only stages of
    ``REPLAYABLE`` (and shuffle windows, which hand their items on as they are)."""
    if not below or getattr(below[-1], "fetcher", None) is None:
        return False
    return all(type(stage) in REPLAYABLE or type(stage) is WindowShuffle for stage in below[:-1])


class Replay:
    """Samples made again from their origins by a copy of the stages under window stage number
    ``depth`` of the pipeline ``rebuild()`` makes (built at the first call)."""

    def __init__(self, rebuild: Callable[[], Stage], depth: int):
        self._rebuild, self._depth = rebuild, depth
        self._top: Stage | None = None
        self._fetcher: Any = None

    def __call__(self, origins: list[Origin]) -> list[Sample]:
        if self._top is None:
            self._build()
        assert self._top is not None and self._fetcher is not None
        self._fetcher.queue(origins)
        made = []
        for origin in origins:
            try:
                sample = self._top.next()
            except StopIteration:
                sample = None
            if sample is None or (sample.shard, sample.ordinal) != (origin.shard, origin.ordinal):
                self._fetcher.reset()
                raise SeqshardError(
                    f"sample {origin.ordinal + 1} of shard {origin.shard}, held by a saved window, did not come out "
                    "again as it was (its shard changed since the state was saved?)."
                )
            made.append(sample)
        return made

    def _build(self) -> None:
        below = [s for s in stages_of(self._rebuild())[self._depth + 1 :] if not isinstance(s, WindowStage)]
        fetcher = below[-1].fetcher()  # type: ignore[attr-defined]
        stages = [*below[:-1], fetcher]
        for upper, lower in itertools.pairwise(stages):
            upper.source = lower  # the windows in between left out: they hand their items on as they are
        stages[0].reset()
        self._top, self._fetcher = stages[0], fetcher
