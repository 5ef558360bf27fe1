"""Sentences (or source/target pairs) batched by a token budget, collated as fairseq's
``LanguagePairDataset`` does: the epoch plans of ``plan.py``, the batches they name, what an
epoch leaves unread and why."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from .ids import SpecialIds
from .pair_collate import CollateRules, collate_group
from .pair_sources import EpochSources
from .pairs import OpenPair
from .token_epochs import BatchRules, EpochPlan, plan_epoch

UNREAD_WARN_SHARE = 0.01  # of an epoch's sentences dropped or left out before a warning


class SentenceBatches:
    """Map-style dataset: batch number -> collated batch (runs in DataLoader workers);
    ``__getitems__`` builds several batches with one gather per source for all of them.
    ``source`` in a batch numbers the loader's sources (a mux's leaves, a data_bin's
    directions) when there are several."""

    def __init__(self, plan: EpochPlan, rules: CollateRules, mixed: bool):
        self.pairs = list(plan.read.pairs)
        self.leaf_of = plan.read.leaf_of
        self.plan = plan
        self.rules = rules
        self.mixed = mixed
        self._open: list[OpenPair] | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": None}  # workers map the files themselves

    def __getitem__(self, number: int) -> dict[str, Any]:
        return self.__getitems__([number])[0]

    def __getitems__(self, numbers: Sequence[int]) -> list[dict[str, Any]]:
        """The batches ``numbers``, built together: their rows' positions in one gather from
        the plan, each source's rows of all of them at once (``collate.collate_group``)."""
        if self._open is None:
            self._open = [OpenPair(p) for p in self.pairs]
        chosen = np.asarray(numbers, dtype=np.int64)
        starts = self.plan.bounds[chosen]
        counts = self.plan.bounds[chosen + 1] - starts
        total = int(counts.sum())
        positions = self.plan.order[np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(total)]
        # rows longest source first, as fairseq's collater sorts them (pack_padded_sequence needs it)
        positions = positions[np.lexsort((-self.plan.src_len[positions], np.repeat(np.arange(len(counts)), counts)))]
        indices = self.plan.index[positions]
        sources = self.plan.source[positions] if len(self.pairs) > 1 else None
        if sources is None:
            groups = [(self._open[0], np.arange(total))]
        else:  # the rows of each source, found with one sort
            order = np.argsort(sources, kind="stable")
            cuts = np.searchsorted(sources[order], np.arange(len(self._open) + 1))
            groups = [(self._open[s], order[a:b]) for s, (a, b) in enumerate(itertools.pairwise(cuts)) if b > a]
        src = [pair.rows("src", rows, indices[rows]) for pair, rows in groups]
        tgt = (
            [pair.rows("tgt", rows, indices[rows]) for pair, rows in groups] if self._open[0].tgt is not None else None
        )
        leaves = None
        if self.mixed:
            leaves = self.leaf_of[sources] if sources is not None else np.full(total, self.leaf_of[0])
        return collate_group(counts, indices, src, tgt, self.rules, leaves)

    def __len__(self) -> int:
        return self.plan.num_batches


def unread_warning(plan: EpochPlan, rules: BatchRules, epoch: int, world_size: int) -> str | None:
    """A warning when the plan leaves more than UNREAD_WARN_SHARE of the epoch's sentences
    unread, naming the option behind each part (max_positions, max_tokens, the rank count)."""
    total = len(plan.index)
    unread = plan.left + sum(plan.dropped.values())
    if not total or unread / total <= UNREAD_WARN_SHARE:
        return None
    parts = []
    if plan.dropped.get("too_long"):
        parts.append(
            f"{plan.dropped['too_long']} longer than max_positions={rules.max_positions} dropped (raise "
            "max_positions; for language-model data, make_token_loader(prefix, block_size=N) uses every token)"
        )
    if plan.dropped.get("over_max_tokens"):
        parts.append(
            f"{plan.dropped['over_max_tokens']} longer than max_tokens={rules.max_tokens} alone dropped "
            "(raise max_tokens)"
        )
    if plan.left:
        parts.append(
            f"{plan.left} in the last batches, left out so that each of {world_size} ranks takes as many "
            "(a smaller max_tokens or max_sentences, or fewer ranks, leave fewer)"
        )
    return (
        f"seqshard token epoch {epoch}: {unread} of {total} sentences ({unread / total:.0%}) are not read: "
        + "; ".join(parts)
        + "."
    )


class SentenceBatching:
    """What the token loader asks of a way of batching: the plan of an epoch, the dataset of
    its batches, a warning about what it leaves unread, an identity for states, and counts."""

    def __init__(self, sources: EpochSources, rules: BatchRules, collate: CollateRules, ids: SpecialIds):
        self.sources = sources
        self.rules = rules
        self.collate = collate
        self.ids = ids

    def plan(self, epoch: int, world_size: int) -> EpochPlan:
        read = self.sources.epoch(epoch)
        plan = plan_epoch(self.sources.open(read.pairs), read.shares, self.rules, epoch, world_size)
        plan.read = read
        return plan

    def batches(self, plan: EpochPlan) -> SentenceBatches:
        return SentenceBatches(plan, self.collate, len(self.sources.leaves) > 1 or self.sources.shares is not None)

    def warning(self, plan: EpochPlan, epoch: int, world_size: int) -> str | None:
        return unread_warning(plan, self.rules, epoch, world_size)

    def identity(self) -> dict[str, Any]:
        shares = self.sources.shares
        return {
            "pairs": self.sources.identity(),
            "shares": None if shares is None else [round(float(s), 12) for s in shares],
            "rules": {k: getattr(self.rules, k) for k in self.rules.__dataclass_fields__},
        }

    @staticmethod
    def new_counts() -> dict[str, int]:
        return {"sentences": 0, "src_tokens": 0, "tgt_tokens": 0, "src_padded": 0, "tgt_padded": 0}

    @staticmethod
    def count(counts: dict[str, int], batch: dict[str, Any]) -> None:
        counts["sentences"] += batch["nsentences"]
        counts["src_tokens"] += int(batch["src_lengths"].sum())
        counts["src_padded"] += batch["src_tokens"].size
        if "target" in batch:
            counts["tgt_tokens"] += batch["ntokens"]
            counts["tgt_padded"] += batch["target"].size

    def stats(self, plan: EpochPlan, counts: dict[str, int]) -> dict[str, Any]:
        """Sentences, tokens and padding so far; the plan's sentences per source, drops and
        leftovers; the pad and eos ids and where they came from."""
        padding = {
            side: 1 - counts[f"{side}_tokens"] / counts[f"{side}_padded"]
            for side in ("src", "tgt")
            if counts.get(f"{side}_padded")
        }
        per_leaf = np.bincount(plan.read.leaf_of[plan.source], minlength=len(self.sources.names))
        per_source = {name: int(count) for name, count in zip(self.sources.names, per_leaf)}
        return {
            **{k: v for k, v in counts.items() if not k.endswith("_padded")},
            "padding_fraction": padding,
            "epoch_sentences": len(plan.index),
            "epoch_sentences_per_source": per_source,
            "dropped": dict(plan.dropped),
            "left": plan.left,
            "ids": asdict(self.ids),
        }
