"""An epoch of token batches: which sentences, cut into which batches, dealt to which rank.

Everything is a pure function of (seed, epoch, world size), computed the same on every rank,
so a rank's state is the number of batches it has taken.

1. The epoch's sentences: every sentence of a single source; for a mix, a virtual epoch of
   ``virtual_size`` sentences, each source's count its share (largest remainder), its
   sentences drawn without repetition until the source is used up, then again (seed 05).
2. Filter: a pair longer than ``max_positions`` on either side, or that cannot fit
   ``max_tokens`` alone, is dropped and counted.
3. Sort by the longer side, then target, then source length; cut greedily into batches whose
   count x longest side stays within ``max_tokens`` (so B x max source length and B x max
   target length both do) and within ``max_sentences``.
4. Deal: batch j (short to long) goes to rank j mod W, so every rank gets its share of every
   length range; the last K mod W batches are left out so that every rank takes the same
   number of steps (their sentences are counted as ``left``). Each rank's batches are then
   shuffled (seed, epoch, rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..checks import check_flag, check_number
from ..errors import ConfigError
from ..seeds import Seed, stage_rng
from .pairs import OpenPair


@dataclass(frozen=True)
class BatchRules:
    """How sentences become batches (the options of ``make_token_loader`` that shape them)."""

    max_tokens: int = 4096
    max_sentences: int | None = None
    max_positions: int = 1024
    shuffle: bool = True
    seed: int = 0
    virtual_size: int | None = None

    def __post_init__(self) -> None:
        checked = {
            "max_tokens": check_number("max_tokens", self.max_tokens, whole=True),
            "max_positions": check_number("max_positions", self.max_positions, whole=True),
            "max_sentences": check_number("max_sentences", self.max_sentences, whole=True, at_least=1, optional=True),
            "virtual_size": check_number("virtual_size", self.virtual_size, whole=True, at_least=1, optional=True),
            "seed": check_number("seed", self.seed, whole=True, at_least=0),
        }
        if self.max_tokens < 1 or self.max_positions < 1:
            raise ConfigError(
                f"max_tokens and max_positions must be >= 1, got {self.max_tokens}, {self.max_positions}."
            )
        check_flag("shuffle", self.shuffle)
        for name, value in checked.items():  # numpy's numbers as Python's: the rules go into JSON states
            object.__setattr__(self, name, value)


@dataclass
class EpochPlan:
    """The epoch's sentences (``source``, ``index`` into it, lengths), its batches (``order``
    cut at ``bounds``) and each rank's batch numbers in the order it takes them."""

    source: np.ndarray
    index: np.ndarray
    src_len: np.ndarray
    tgt_len: np.ndarray | None
    order: np.ndarray
    bounds: np.ndarray
    ranks: list[np.ndarray]
    dropped: dict[str, int] = field(default_factory=dict)
    left: int = 0

    def batch(self, number: int) -> np.ndarray:
        """Positions (into ``source``/``index``) of batch ``number``."""
        return self.order[self.bounds[number] : self.bounds[number + 1]]

    @property
    def num_batches(self) -> int:
        return len(self.bounds) - 1


def plan_epoch(
    pairs: list[OpenPair], shares: np.ndarray | None, rules: BatchRules, epoch: int, world_size: int
) -> EpochPlan:
    """The plan of ``epoch`` for ``world_size`` ranks (see the module docstring)."""
    source, index = _sentences(pairs, shares, rules, epoch)
    src_len = np.empty(len(index), dtype=np.int32)
    tgt_len = np.empty(len(index), dtype=np.int32) if pairs[0].tgt_sizes is not None else None
    for number, pair in enumerate(pairs):
        mine = source == number
        src_len[mine] = pair.src_sizes[index[mine]]
        if tgt_len is not None:
            tgt_len[mine] = pair.tgt_sizes[index[mine]]  # type: ignore[index]
    longest = src_len if tgt_len is None else np.maximum(src_len, tgt_len)
    dropped = {
        "too_long": int(np.count_nonzero(longest > rules.max_positions)),
        "over_max_tokens": int(np.count_nonzero((longest <= rules.max_positions) & (longest > rules.max_tokens))),
    }
    keep = np.flatnonzero(longest <= min(rules.max_positions, rules.max_tokens))
    keys = [src_len[keep]] + ([tgt_len[keep]] if tgt_len is not None else []) + [longest[keep]]
    order = keep[np.lexsort(keys)]
    bounds = cut_batches(longest[order], rules.max_tokens, rules.max_sentences)
    usable = (len(bounds) - 1) // world_size * world_size
    left = int(bounds[-1] - bounds[usable])
    ranks = []
    for rank in range(world_size):
        numbers = np.arange(rank, usable, world_size)
        if rules.shuffle:
            numbers = stage_rng(rules.seed, Seed.TOKEN_BATCH_ORDER, epoch, rank).permutation(numbers)
        ranks.append(numbers)
    return EpochPlan(
        source, index, src_len, tgt_len, order, bounds, ranks, {k: v for k, v in dropped.items() if v}, left
    )


def _sentences(
    pairs: list[OpenPair], shares: np.ndarray | None, rules: BatchRules, epoch: int
) -> tuple[np.ndarray, np.ndarray]:
    sizes = np.array([len(p) for p in pairs], dtype=np.int64)
    if shares is None:  # one source, read whole
        return np.zeros(sizes[0], dtype=np.int16), np.arange(sizes[0], dtype=np.int64)
    total = rules.virtual_size or int(sizes.sum())
    counts = largest_remainder(shares, total)
    sources, indices = [], []
    for number, (count, size) in enumerate(zip(counts, sizes)):
        rng = stage_rng(rules.seed, Seed.TOKEN_VIRTUAL, epoch, number)
        whole, rest = divmod(int(count), int(size))
        chosen = [rng.permutation(size) for _ in range(whole)] + [rng.permutation(size)[:rest]]
        indices.append(np.concatenate(chosen).astype(np.int64))
        sources.append(np.full(count, number, dtype=np.int16))
    return np.concatenate(sources), np.concatenate(indices)


def largest_remainder(shares: np.ndarray, total: int) -> np.ndarray:
    """``shares x total`` rounded to whole numbers that sum to ``total``."""
    exact = shares * total
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


def cut_batches(lengths: np.ndarray, max_tokens: int, max_sentences: int | None = None) -> np.ndarray:
    """Bounds of greedy batches over ascending ``lengths``: each batch as long as its count
    times its longest (last) length stays within ``max_tokens``."""
    bounds = [0]
    start, total = 0, len(lengths)
    cap_sentences = max_sentences or max_tokens
    while start < total:
        window = lengths[start : start + min(max_tokens // max(int(lengths[start]), 1), cap_sentences)]
        cost = np.arange(1, len(window) + 1) * window
        taken = max(int(np.searchsorted(cost, max_tokens, side="right")), 1)
        start += taken
        bounds.append(start)
    return np.asarray(bounds, dtype=np.int64)
