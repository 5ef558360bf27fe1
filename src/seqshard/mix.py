"""Mixing sources: ``mux([a, b, ...], weights=[...])`` or ``temperature=T``.

A :class:`Mux` says which sources feed one stream and in what proportions; the loaders
decide how a source is read (shard patterns for ``make_loader``, token pairs for
``make_token_loader``). Weights are normalised; ``temperature=T`` gives each source a share
proportional to ``size ** (1 / T)`` (T = 1: by size; larger T flattens towards uniform), sizes
taken from the sources' indexes. Muxes nest: a mux inside a mux takes its parent's share and
divides it by its own weights.

:func:`next_block` is which source each position of a stream takes, a block of
:data:`BLOCK` positions at a time: a function of the seed, the block number and how many
samples each source has given so far (the state a mixed stream keeps anyway), so it is the
same after a resume. Each block holds each source's quota (:func:`block_quotas`: every prefix
of the stream is within one sample of every source's target) in a seeded random order; the
orders of :data:`GROUP` consecutive blocks come from one generator (:func:`block_orders`), so
that a mixed stream pays for seeding a generator once per ``BLOCK * GROUP`` samples, not once
per block.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .checks import check_number
from .errors import ConfigError
from .seeds import Seed, stage_rng

BLOCK = 64  # positions whose order is shuffled together; quotas are exact per block
GROUP = 64  # blocks whose orders one generator draws


@dataclass(frozen=True)
class Mux:
    """Sources mixed by ``weights`` or ``temperature`` (exactly one of them)."""

    sources: tuple[Any, ...]
    weights: tuple[float, ...] | None = None
    temperature: float | None = None

    def shares(self, sizes: Sequence[float]) -> np.ndarray:
        """Each source's share of the stream (sums to 1), given each source's size."""
        if self.weights is not None:
            weights = np.asarray(self.weights, dtype=np.float64)
        else:
            assert self.temperature is not None
            sizes = np.asarray(sizes, dtype=np.float64)
            if (sizes <= 0).any():
                empty = [str(self.sources[i]) for i in np.flatnonzero(sizes <= 0)]
                raise ConfigError(f"temperature mixing needs sizes; these sources are empty: {', '.join(empty)}.")
            weights = sizes ** (1.0 / self.temperature)
        return weights / weights.sum()


def mux(sources: Sequence[Any], weights: Sequence[float] | None = None, temperature: float | None = None) -> Mux:
    """Mix ``sources`` (patterns, token pairs or other muxes) by ``weights`` or by size at a
    ``temperature``; with neither, by size (temperature 1)."""
    if isinstance(sources, (str, bytes, os.PathLike)) or not isinstance(sources, Iterable):
        raise ConfigError(f"mux takes a list of sources (patterns, token pairs or muxes), got {sources!r}.")
    sources = tuple(sources)
    if len(sources) < 1:
        raise ConfigError("mux needs at least one source.")
    for source in sources:
        if source is None or isinstance(source, (bool, numbers.Number, dict)):
            raise ConfigError(
                f"a mux source is a pattern (a path, a glob or a list of them), a token pair or a mux, not {source!r}."
            )
    if weights is not None and temperature is not None:
        raise ConfigError("give mux weights= or temperature=, not both.")
    if weights is not None:
        if isinstance(weights, (str, bytes)) or not isinstance(weights, Iterable):
            raise ConfigError(f"mux weights must be a list of numbers, one per source, got {weights!r}.")
        weights = tuple(float(check_number("mux weights", w, at_least=0)) for w in weights)
        if len(weights) != len(sources):
            raise ConfigError(f"mux has {len(sources)} sources but {len(weights)} weights.")
        if sum(weights) <= 0:
            raise ConfigError(f"mux weights must be >= 0 and not all 0, got {list(weights)}.")
        return Mux(sources, weights=weights)
    temperature = 1.0 if temperature is None else float(check_number("mux temperature", temperature, above=0))
    return Mux(sources, temperature=temperature)


def flatten(mix: Mux, sizes_of: Any) -> tuple[list[Any], np.ndarray]:
    """The leaf sources of a (nested) mux and each one's share of the whole stream.

    ``sizes_of(source)`` gives a leaf source's size (used by temperature mixing; a nested
    mux's size is the sum of its leaves')."""
    leaves: list[Any] = []
    shares: list[float] = []

    def walk(node: Mux, share: float) -> float:
        sizes = []
        spans = []
        for source in node.sources:
            start = len(leaves)
            if isinstance(source, Mux):
                walk(source, 1.0)  # relative shares first; scaled below
                sizes.append(sum(sizes_of(leaf) for leaf in leaves[start:]))
            else:
                leaves.append(source)
                shares.append(1.0)
                sizes.append(sizes_of(source))
            spans.append((start, len(leaves)))
        for (start, end), part in zip(spans, node.shares(sizes)):
            for i in range(start, end):
                shares[i] *= part * share
        return sum(sizes)

    walk(mix, 1.0)
    return leaves, np.asarray(shares, dtype=np.float64)


def next_block(shares: Sequence[float], counts: Sequence[int], seed: int, block: int, *salt: int) -> np.ndarray:
    """The sources of the BLOCK positions after ``counts`` (samples each source has given so
    far): each source's :func:`block_quotas`, in the order :func:`block_orders` gives block
    ``block`` (``seed`` and ``salt``, e.g. epoch, rank, worker, key the orders)."""
    group, row = divmod(block, GROUP)
    return np.asarray(place(block_quotas(shares, counts), block_orders(seed, group, *salt)[row]), dtype=np.int64)


def block_quotas(shares: Sequence[float], counts: Sequence[int]) -> list[int]:
    """How many of the next BLOCK positions each source takes: what brings it nearest its
    share of the stream so far (so every prefix is within about one sample of each target).
    Plain Python: a mixed stream computes this once per block, for a few sources."""
    total = float(sum(counts)) + BLOCK
    deficit = [max(share * total - count, 0.0) for share, count in zip(shares, counts)]  # a source ahead takes nothing
    quotas = [math.floor(d) for d in deficit]
    by_fraction = sorted(range(len(quotas)), key=lambda i: (quotas[i] - deficit[i], i))  # largest first; ties by index
    short = BLOCK - sum(quotas)
    if short > 0:
        for i in by_fraction[:short]:
            quotas[i] += 1
    else:
        for i in reversed(by_fraction):  # too many (a source ahead was not charged): take back
            if short == 0:
                break
            if quotas[i] > 0:
                quotas[i] -= 1
                short += 1
    return quotas


def block_orders(seed: int, group: int, *salt: int) -> list[list[int]]:
    """The orders of blocks ``group * GROUP`` to ``(group + 1) * GROUP - 1``: one row per block,
    each a seeded permutation of the block's positions."""
    rng = stage_rng(seed, Seed.MIX_ORDER, group, *salt)
    return rng.permuted(np.tile(np.arange(BLOCK), (GROUP, 1)), axis=1).tolist()


def place(quotas: Sequence[int], order: Sequence[int]) -> list[int]:
    """Each position's source: ``quotas[i]`` positions of source ``i``, in ``order``."""
    sources: list[int] = []
    for source, quota in enumerate(quotas):
        sources += [source] * quota
    return list(map(sources.__getitem__, order))
