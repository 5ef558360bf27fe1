"""Running a per-shard function over many shards with a process pool and a progress bar."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from ..progress import Progress

T = TypeVar("T")
R = TypeVar("R")


def map_shards(
    function: Callable[[T], R], items: Sequence[T], jobs: int, description: str, progress: bool
) -> Iterator[R]:
    """``function`` over ``items`` in order, in ``jobs`` processes when jobs > 1."""
    if not items:
        return
    with Progress(progress) as bars:
        advance = bars.bar(description, len(items), unit="shard")
        if jobs <= 1 or len(items) <= 1:
            for item in items:
                result = function(item)
                advance(1)  # before yielding: a consumer may stop taking after the last item
                yield result
            return
        with mp.get_context("spawn").Pool(min(jobs, len(items))) as pool:
            for result in pool.imap(function, items):
                advance(1)
                yield result
