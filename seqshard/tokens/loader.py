"""``make_token_loader``: batches of token sequences by a token budget, for translation and LMs.

Each epoch's plan (``tokens/plan.py``) is a pure function of (seed, epoch, world size), so
every rank computes it alone and the loader's state is how many batches each rank took.
Batches are collated in DataLoader workers (``num_workers``) in the plan's order; a state saved
mid-epoch resumes at the next batch, and with another world size (``strict=False``) the
batches no rank had taken are dealt again to the new ranks, none lost and none repeated.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..checks import MAX_WORKERS, check_flag, check_number
from ..dist import Collectives, DistContext, discover
from ..errors import ConfigError, StateMismatchError
from ..mix import Mux, flatten
from ..seeds import Seed, stage_rng
from .collate import CollateRules, as_tensors, collate_batch, padded
from .pairs import OpenPair, TokenPair, as_pair
from .plan import BatchRules, EpochPlan, plan_epoch

_LOG = logging.getLogger("seqshard")
STATE_VERSION = 1
UNREAD_WARN_SHARE = 0.05  # of an epoch's sentences dropped or left out before a warning


def make_token_loader(
    src: str | Path | TokenPair | Mux,
    tgt: str | Path | None = None,
    *,
    max_tokens: int = 4096,
    max_sentences: int | None = None,
    max_positions: int = 1024,
    shuffle: bool = True,
    seed: int = 0,
    virtual_size: int | None = None,
    src_lang_id: int | None = None,
    tgt_lang_id: int | None = None,
    pad_id: int = 1,
    eos_id: int = 2,
    left_pad_source: bool = True,
    num_workers: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
) -> TokenLoader:
    """A loader of fairseq-style batches from ``src`` (a ``.bin``/``.idx`` prefix) and
    ``tgt`` (a prefix, or None for one side), or from a :func:`seqshard.mux` of
    :class:`TokenPair`s (a virtual epoch of ``virtual_size`` sentences, shares by weights or
    temperature, drawn anew each epoch).

    Batches never hold more than ``max_tokens`` padded tokens on either side (B x longest),
    nor more than ``max_sentences``; pairs longer than ``max_positions`` are dropped and
    counted. Language token ids (``src_lang_id``/``tgt_lang_id``, or per pair) are prepended.
    Every rank gets the same number of batches, drawn from every length range.
    """
    if isinstance(src, Mux):
        if tgt is not None or src_lang_id is not None or tgt_lang_id is not None:
            raise ConfigError("with a mux, give targets and language ids in each TokenPair.")
        leaves, shares = flatten(src, lambda pair: len(OpenPair(as_pair(pair))))
        pairs: list[TokenPair] = [as_pair(leaf) for leaf in leaves]
        mixed: np.ndarray | None = shares
    else:
        pair = as_pair(src)
        if tgt is not None or src_lang_id is not None or tgt_lang_id is not None:
            pair = TokenPair(
                pair.src,
                str(tgt) if tgt is not None else pair.tgt,
                src_lang_id if src_lang_id is not None else pair.src_lang_id,
                tgt_lang_id if tgt_lang_id is not None else pair.tgt_lang_id,
            )
        pairs, mixed = [pair], None
    for pair in pairs:
        check_number("src_lang_id", pair.src_lang_id, whole=True, at_least=0, optional=True)
        check_number("tgt_lang_id", pair.tgt_lang_id, whole=True, at_least=0, optional=True)
    check_number("pad_id", pad_id, whole=True, at_least=0)
    check_number("eos_id", eos_id, whole=True, at_least=0)
    check_flag("left_pad_source", left_pad_source)
    check_number("num_workers", num_workers, whole=True, at_least=0, at_most=MAX_WORKERS)
    check_number("rank", rank, whole=True, at_least=0, optional=True)
    check_number("world_size", world_size, whole=True, at_least=1, optional=True)
    rules = BatchRules(max_tokens, max_sentences, max_positions, shuffle, seed, virtual_size)
    return TokenLoader(
        pairs, mixed, rules, CollateRules(pad_id, eos_id, left_pad_source), num_workers, discover(rank, world_size)
    )


class _Batches:
    """Map-style dataset: batch number -> collated batch (runs in DataLoader workers)."""

    def __init__(self, pairs: Sequence[TokenPair], plan: EpochPlan, rules: CollateRules, mixed: bool):
        self.pairs = list(pairs)
        self.plan = plan
        self.rules = rules
        self.mixed = mixed
        self._open: list[OpenPair] | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": None}  # workers map the files themselves

    def __getitem__(self, number: int) -> dict[str, Any]:
        if self._open is None:
            self._open = [OpenPair(p) for p in self.pairs]
        positions = self.plan.batch(number)
        sources = self.plan.source[positions]
        indices = self.plan.index[positions]
        size = len(positions)
        if len(self._open) == 1:
            groups = [(self._open[0], np.arange(size))]
        else:  # the rows of each source, found with one sort
            order = np.argsort(sources, kind="stable")
            cuts = np.searchsorted(sources[order], np.arange(len(self._open) + 1))
            groups = [(self._open[s], order[a:b]) for s, (a, b) in enumerate(itertools.pairwise(cuts)) if b > a]
        src = padded(
            [pair.rows("src", rows, indices[rows]) for pair, rows in groups],
            size,
            self.rules.pad_id,
            self.rules.left_pad_source,
        )
        tgt = None
        if self._open[0].tgt is not None:
            tgt = padded(
                [pair.rows("tgt", rows, indices[rows]) for pair, rows in groups], size, self.rules.pad_id, False
            )
        return collate_batch(indices, src, tgt, self.rules, sources if self.mixed else None)

    def __len__(self) -> int:
        return self.plan.num_batches


def unread_warning(plan: EpochPlan, epoch: int, world_size: int) -> str | None:
    """A warning when the plan leaves more than UNREAD_WARN_SHARE of the epoch's sentences
    unread (dropped as too long, or left out so that every rank takes as many batches)."""
    total = len(plan.index)
    unread = plan.left + sum(plan.dropped.values())
    if not total or unread / total <= UNREAD_WARN_SHARE:
        return None
    parts = []
    if plan.dropped:
        dropped = ", ".join(f"{reason}={count}" for reason, count in plan.dropped.items())
        parts.append(f"dropped {dropped} (raise max_positions or max_tokens, or leave them out when binarizing)")
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


def _as_built(batch: dict[str, Any]) -> dict[str, Any]:
    return batch


class TokenLoader:
    """Iterate it once per epoch (after ``set_epoch``); see :func:`make_token_loader`."""

    def __init__(
        self,
        pairs: list[TokenPair],
        shares: np.ndarray | None,
        rules: BatchRules,
        collate: CollateRules,
        num_workers: int,
        context: DistContext,
    ):
        self.pairs = pairs
        self.opened = [OpenPair(p) for p in pairs]
        if len({o.tgt is None for o in self.opened}) > 1:
            raise ConfigError("mix pairs with targets or pairs without, not both.")
        self.shares = shares
        self.rules = rules
        self.collate = collate
        self.num_workers = num_workers
        self.context = context
        self.collectives = Collectives(context)
        self._epoch = 0
        self._plans: dict[tuple[int, int], EpochPlan] = {}
        self._step = 0  # batches of this epoch this rank has taken
        self._start = 0  # where the next iteration starts in this rank's list (after a resume)
        self._history: list[dict[str, Any]] | None = None  # deals of this epoch before the current one
        self._counts: dict[str, Any] = {}

    # -- plans ---------------------------------------------------------------------------
    def plan(self, epoch: int | None = None, world_size: int | None = None) -> EpochPlan:
        key = (self._epoch if epoch is None else epoch, world_size or self.context.world_size)
        if key not in self._plans:
            self._plans = {key: plan_epoch(self.opened, self.shares, self.rules, *key)}  # keep one
        return self._plans[key]

    def set_epoch(self, epoch: int) -> None:
        if epoch != self._epoch and self._history is not None:
            _LOG.warning(
                "the loaded state is for epoch %d; set_epoch(%d) starts that epoch from its beginning",
                self._epoch,
                epoch,
            )
            self._history, self._start = None, 0
        self._epoch = epoch

    @property
    def epoch(self) -> int:
        return self._epoch

    def __len__(self) -> int:
        """Batches this rank has still to take in the current epoch."""
        return len(self._lists()[self.context.rank]) - self._start

    def _lists(self) -> list[np.ndarray]:
        """Every rank's batch numbers for this epoch: the plan's, or after resumes with other
        world sizes, the batches no rank had taken, dealt again (short to long, then shuffled)."""
        history = self._history or []
        world = self.context.world_size
        lists = self.plan(world_size=int(history[0]["world_size"]) if history else world).ranks
        for number, deal in enumerate(history):
            after = int(history[number + 1]["world_size"]) if number + 1 < len(history) else world
            rest = np.sort(np.concatenate([lists[r][int(step) :] for r, step in enumerate(deal["steps"])]))
            equal = len(rest) // after
            lists = []
            for rank in range(after):
                mine = rest[rank::after][:equal]
                if self.rules.shuffle:
                    mine = stage_rng(self.rules.seed, Seed.TOKEN_REDEAL, self._epoch, number, rank).permutation(mine)
                lists.append(mine)
        return lists

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        import torch.utils.data

        if self.context.rank == 0 and self._start == 0 and self._history is None:
            warning = unread_warning(self.plan(), self._epoch, self.context.world_size)
            if warning:
                _LOG.warning("%s", warning)
        numbers = self._lists()[self.context.rank][self._start :]
        self._step, self._start = self._start, 0
        dataset = _Batches(self.pairs, self.plan(), self.collate, self.shares is not None)
        if self.num_workers == 0:  # batches cost a fraction of a millisecond: no DataLoader in between
            built: Iterator[dict[str, Any]] = (dataset[int(n)] for n in numbers)
        else:
            built = iter(
                torch.utils.data.DataLoader(
                    dataset,
                    batch_size=None,
                    sampler=[int(n) for n in numbers],
                    num_workers=self.num_workers,
                    collate_fn=_as_built,  # batches are built whole by _Batches
                )
            )
        self._counts = {"sentences": 0, "src_tokens": 0, "tgt_tokens": 0, "src_padded": 0, "tgt_padded": 0}
        for arrays in built:
            self._step += 1
            self._count(arrays)
            yield as_tensors(arrays)
        self._history = None  # the epoch is done: the next starts from its plan

    def _count(self, batch: dict[str, Any]) -> None:
        counts = self._counts
        counts["sentences"] += batch["nsentences"]
        counts["src_tokens"] += int(batch["src_lengths"].sum())
        counts["src_padded"] += batch["src_tokens"].size
        if "target" in batch:
            counts["tgt_tokens"] += batch["ntokens"]
            counts["tgt_padded"] += batch["target"].size

    def stats(self) -> dict[str, Any]:
        """This epoch so far: steps, sentences, tokens, padding; the plan's drops and leftovers."""
        plan = self.plan()
        counts = self._counts
        padding = {
            side: 1 - counts[f"{side}_tokens"] / counts[f"{side}_padded"]
            for side in ("src", "tgt")
            if counts.get(f"{side}_padded")
        }
        per_source: dict[str, int] = {}
        for number, pair in enumerate(self.pairs):
            per_source[str(pair)] = int(np.count_nonzero(plan.source == number))
        return {
            "epoch": self._epoch,
            "steps": self._step,
            "steps_in_epoch": len(plan.ranks[self.context.rank]),
            **{k: v for k, v in counts.items() if not k.endswith("_padded")},
            "padding_fraction": padding,
            "epoch_sentences": len(plan.index),
            "epoch_sentences_per_source": per_source,
            "dropped": dict(plan.dropped),
            "left": plan.left,
        }

    # -- checkpointing -------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        digest = hashlib.sha256()
        for opened in self.opened:
            digest.update(f"{opened.pair}\0{len(opened)}\0{opened.src.num_tokens}\n".encode())
        return {
            "pairs": digest.hexdigest()[:16],
            "shares": None if self.shares is None else [round(float(s), 12) for s in self.shares],
            "rules": {k: getattr(self.rules, k) for k in self.rules.__dataclass_fields__},
        }

    def state_dict(self, gather: bool = True) -> dict[str, Any]:
        """How many batches each rank took this epoch: a collective with ``gather=True``;
        ``gather=False`` fills in this rank's alone (enough to resume it with as many ranks)."""
        if gather:
            steps: list[int | None] = [int(s) for s in self.collectives.all_gather(self._step)]
        else:
            steps = [None] * self.context.world_size
            steps[self.context.rank] = self._step
        current = {"world_size": self.context.world_size, "steps": steps}
        return {
            "seqshard_token_loader_state": STATE_VERSION,
            "identity": self._identity(),
            "epoch": self._epoch,
            "deals": [*(self._history or []), current],
        }

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Continue from ``state`` at the next ``iter()`` of its epoch; ``strict=False`` allows
        another world size (the batches no rank had taken are dealt again to the new ranks)."""
        if state.get("seqshard_token_loader_state") != STATE_VERSION:
            raise StateMismatchError("not a token loader state of this version (seqshard_token_loader_state).")
        mine = self._identity()
        for name in ("pairs", "shares", "rules"):
            if state["identity"].get(name) != mine[name]:
                raise StateMismatchError(
                    f"the state was saved with other {name} ({state['identity'].get(name)} != {mine[name]})."
                )
        *earlier, last = state["deals"]
        world = self.context.world_size
        if int(last["world_size"]) == world:
            mine = last["steps"][self.context.rank]
            if mine is None:
                raise StateMismatchError(
                    f"the state holds no step for rank {self.context.rank} (saved with gather=False?)."
                )
            self._history, self._start = earlier, int(mine)
        elif any(step is None for step in last["steps"]):
            raise StateMismatchError("resuming with another world size needs every rank's step: save with gather=True.")
        elif strict:
            raise StateMismatchError(
                f"the state was saved by {last['world_size']} ranks and this loader has {world}; "
                "pass strict=False to deal the rest of the epoch to the new ranks."
            )
        else:
            self._history, self._start = [*earlier, last], 0
        self._epoch = int(state["epoch"])
