"""Which token pairs an epoch reads, and each one's share: fixed pairs (a dataset, a pair, a
mux of pairs), or data_bin directions (``databin.py``) whose files change with the epoch."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from .databin import Direction
from .pairs import OpenPair, TokenPair

Leaf = TokenPair | Direction


@dataclass(frozen=True)
class EpochPairs:
    """What one epoch reads: ``pairs``, each one's ``share`` of a mixed epoch (None: each read
    whole, in order), and the source (leaf) each pair belongs to."""

    pairs: list[TokenPair]
    shares: np.ndarray | None
    leaf_of: np.ndarray


class EpochSources:
    """The leaves of a loader (token pairs or directions) and their shares (None: every
    sentence read once); :meth:`epoch` gives what an epoch reads. A direction's share is
    divided among the parts the epoch reads by their sizes; parts without a sentence are left
    out."""

    def __init__(self, leaves: list[Leaf], shares: np.ndarray | None, opened: dict[TokenPair, OpenPair]):
        self.leaves = leaves
        self.shares = shares
        self.names = [str(leaf) for leaf in leaves]
        self._opened = opened  # the fixed pairs, opened once; a direction's parts as its epochs come
        self.fixed = all(isinstance(leaf, TokenPair) for leaf in leaves)

    def epoch(self, epoch: int) -> EpochPairs:
        pairs: list[TokenPair] = []
        shares: list[float] = []
        leaf_of: list[int] = []
        for number, leaf in enumerate(self.leaves):
            if isinstance(leaf, TokenPair):
                parts = [(leaf, 1)]
            else:
                parts = [(part.pair, part.size) for part in leaf.parts(epoch) if part.size]
            total = sum(size for _, size in parts)
            for pair, size in parts:
                pairs.append(pair)
                leaf_of.append(number)
                if self.shares is not None:
                    shares.append(float(self.shares[number]) * size / total)
        if not pairs:
            raise ConfigError(f"epoch {epoch} reads no sentence: every part of {', '.join(self.names)} is empty.")
        mixed = None
        if self.shares is not None:
            mixed = np.asarray(shares, dtype=np.float64)
            mixed /= mixed.sum()  # the shares of leaves with nothing to read go to the others
        return EpochPairs(pairs, mixed, np.asarray(leaf_of, dtype=np.int64))

    def open(self, pairs: list[TokenPair]) -> list[OpenPair]:
        """The pairs mapped: the fixed ones as opened at first, a direction's parts each time
        their epoch comes (the maps of an earlier epoch's parts are let go)."""
        if not self.fixed:
            self._opened = {pair: self._opened.get(pair) or OpenPair(pair) for pair in pairs}
        return [self._opened[pair] for pair in pairs]

    def identity(self) -> str:
        """A digest of what the leaves read (the fixed pairs' as it has always been)."""
        digest = hashlib.sha256()
        for leaf in self.leaves:
            if isinstance(leaf, TokenPair):
                opened = self._opened[leaf]
                digest.update(f"{opened.pair}\0{len(opened)}\0{opened.src.num_tokens}\n".encode())
            else:
                digest.update(f"direction {leaf.fingerprint()}\n".encode())
        return digest.hexdigest()[:16]
