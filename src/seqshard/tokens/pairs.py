"""A token source: one memory-mapped dataset (language modelling) or an aligned source/target
pair of them (translation), with optional language tokens prepended to each side."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..formats.peers.mmidx import TokenDataset
from .pair_collate import Rows


@dataclass(frozen=True)
class TokenPair:
    """``src`` (and ``tgt``) dataset prefixes; ``src_lang_id``/``tgt_lang_id``: token ids
    prepended to every source/target sequence (NLLB's ``__eng_Latn__``), or None."""

    src: str
    tgt: str | None = None
    src_lang_id: int | None = None
    tgt_lang_id: int | None = None

    def __str__(self) -> str:
        return self.src if self.tgt is None else f"{self.src} -> {self.tgt}"


class OpenPair:
    """A :class:`TokenPair` with its datasets mapped and lengths (language tokens included)."""

    def __init__(self, pair: TokenPair):
        self.pair = pair
        self.src = TokenDataset(pair.src)
        self.tgt = TokenDataset(pair.tgt) if pair.tgt is not None else None
        if self.tgt is not None and len(self.tgt) != len(self.src):
            raise ConfigError(
                f"{pair.src} holds {len(self.src)} sequences but {pair.tgt} {len(self.tgt)}: a translation pair "
                "needs one target per source line (binarize both sides of the same parallel files)."
            )
        self.src_sizes = self.src.sizes.astype(np.int32) + (pair.src_lang_id is not None)
        self.tgt_sizes = (
            self.tgt.sizes.astype(np.int32) + (pair.tgt_lang_id is not None) if self.tgt is not None else None
        )

    def __len__(self) -> int:
        return len(self.src)

    def rows(self, side: str, rows: np.ndarray, indices: np.ndarray) -> Rows:
        """Batch rows ``rows`` holding sequences ``indices`` of the ``"src"`` or ``"tgt"`` side."""
        dataset = self.src if side == "src" else self.tgt
        assert dataset is not None
        lang = self.pair.src_lang_id if side == "src" else self.pair.tgt_lang_id
        starts = dataset.pointers[indices] // dataset.dtype.itemsize  # from the mapped index: no table per worker
        return Rows(rows, dataset.tokens, starts, dataset.sizes[indices], lang)


def as_pair(source: TokenPair | str | Path | tuple) -> TokenPair:
    """A pair from a TokenPair, a prefix (monolingual) or a ``(src, tgt)`` tuple."""
    if isinstance(source, TokenPair):
        return source
    if isinstance(source, (str, Path)):
        return TokenPair(str(source))
    if isinstance(source, tuple) and len(source) == 2:
        return TokenPair(str(source[0]), str(source[1]))
    raise ConfigError(f"a token source is a TokenPair, a dataset prefix or a (src, tgt) tuple, not {source!r}.")
