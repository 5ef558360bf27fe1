"""Language-model blocks: every token of a dataset, in every epoch, in fixed blocks, cut as
Megatron's ``GPTDataset`` cuts them (``block_style="megatron"``, the default) or as fairseq's
``TokenBlockDataset(break_mode="none", include_targets=True)`` (its ``language_modeling``
task; ``block_style="fairseq"``).

- The stream is the ``.bin`` itself: the sequences back to back as stored, so documents are
  joined by the end-of-sentence id each one ends with (``seqshard binarize`` appends it to every
  line, ``fairseq-preprocess`` always, Megatron's ``preprocess_data.py`` with ``--append-eod``);
  nothing is inserted. Without one (``PREFIX.json`` says no eos was appended, or, without
  metadata, the sequences do not all end with one id) the loader warns that documents run into
  each other.
- Megatron's blocks: block k is the ``block_size + 1`` tokens from ``k x block_size``:
  ``input`` its first ``block_size``, ``target`` its last (consecutive blocks share one token,
  as in GPTDataset), so every token after the first is a target exactly once. The
  ``(L - 1) mod block_size`` tokens after the last whole block (fewer than one block) are
  dropped and counted as ``partial_block``.
- fairseq's blocks: block k's ``target`` is the ``block_size`` tokens from ``k x block_size``
  (the last block holds the rest, padded on the right with the pad id and masked), its
  ``input`` the same window shifted right by one: the token before each position, except that
  a block starting where a sequence starts (the stream's start among them) begins with the eos
  id instead, as fairseq's does. Every token is a target exactly once; nothing is dropped.
- Each epoch the blocks are shuffled (seed, epoch) and cut into batches of ``B = max_tokens //
  block_size`` blocks (at most ``max_sentences``); batch g goes to rank g mod W, and the last
  batches (fewer than W) and blocks (fewer than B) are left out so that every rank takes as
  many full batches; being drawn anew each epoch, they are other blocks each time.

The plan is one permutation of the block numbers (8 bytes a block: a billion tokens in blocks
of 1,024 are 7.8 MB); a batch is one gather of B x (block_size + 1) tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..checks import check_fields, check_rule
from ..errors import ConfigError
from ..formats.peers.mmidx import TokenDataset
from ..seeds import Seed, stage_rng
from .ids import SpecialIds

UNREAD_WARN_SHARE = 0.01  # of an epoch's tokens not used as targets before a warning


BLOCK_STYLES = ("megatron", "fairseq")


@dataclass(frozen=True)
class BlockRules:
    """``block_size`` tokens of input per block; ``batch_blocks`` blocks per batch; ``style``:
    whose blocks (see the module docstring)."""

    block_size: int
    batch_blocks: int
    shuffle: bool = True
    seed: int = 0
    style: str = "megatron"

    def __post_init__(self) -> None:
        check_fields(self)
        if self.style not in BLOCK_STYLES:
            raise ConfigError(f"block_style must be one of {', '.join(map(repr, BLOCK_STYLES))}, got {self.style!r}.")


def block_rules(
    block_size: int,
    max_tokens: int,
    max_sentences: int | None,
    max_positions: int | None,
    shuffle: bool,
    seed: int,
    style: str = "megatron",
) -> BlockRules:
    """The rules of ``make_token_loader(..., block_size=N)``: ``max_tokens // N`` blocks per
    batch (at most ``max_sentences``); ``max_positions``, when given, at least ``N``."""
    block_size = check_rule("block_size", block_size)
    max_tokens = check_rule("max_tokens", max_tokens)
    max_sentences = check_rule("max_sentences", max_sentences, optional=True)
    max_positions = check_rule("max_positions", max_positions, optional=True)
    if max_positions is not None and block_size > max_positions:
        raise ConfigError(f"block_size {block_size} is longer than max_positions {max_positions} (the model's).")
    if max_tokens < block_size:
        raise ConfigError(
            f"max_tokens {max_tokens} holds no block of block_size {block_size} tokens: a batch is "
            "max_tokens // block_size blocks."
        )
    return BlockRules(block_size, min(max_tokens // block_size, max_sentences or max_tokens), shuffle, seed, style)


@dataclass
class BlockPlan:
    """An epoch of blocks: ``order`` (block numbers in the order they are batched), each rank's
    batch numbers, the tokens never a target (``dropped``) and the blocks ``left`` out."""

    order: np.ndarray
    batch_blocks: int
    ranks: list[np.ndarray]
    blocks: int
    targets: int
    dropped: dict[str, int]
    left: int

    def batch(self, number: int) -> np.ndarray:
        """Block numbers of batch ``number``."""
        return self.order[number * self.batch_blocks : (number + 1) * self.batch_blocks]

    @property
    def num_batches(self) -> int:
        return len(self.order) // self.batch_blocks


def plan_blocks(num_tokens: int, rules: BlockRules, epoch: int, world_size: int) -> BlockPlan:
    """The blocks of ``epoch`` for ``world_size`` ranks (see the module docstring)."""
    if rules.style == "fairseq":  # every token a target, the last block holding the rest
        targets, partial = num_tokens, 0
        blocks = -(-num_tokens // rules.block_size)
    else:  # every token but the first can be a target
        targets = max(num_tokens - 1, 0)
        blocks, partial = divmod(targets, rules.block_size)
    order = np.arange(blocks, dtype=np.int64)
    if rules.shuffle:
        order = stage_rng(rules.seed, Seed.TOKEN_BLOCKS, epoch).permutation(order)
    usable = blocks // rules.batch_blocks // world_size * world_size
    ranks = [np.arange(rank, usable, world_size, dtype=np.int64) for rank in range(world_size)]
    dropped = {"partial_block": partial} if partial else {}
    return BlockPlan(order, rules.batch_blocks, ranks, blocks, targets, dropped, blocks - usable * rules.batch_blocks)


class BlockBatches:
    """Map-style dataset: batch number -> ``input``/``target`` blocks (runs in DataLoader workers);
    ``pad_id``/``eos_id`` serve fairseq's blocks (the last one's padding, a sequence's start)."""

    def __init__(self, prefix: str, plan: BlockPlan, rules: BlockRules, pad_id: int, eos_id: int):
        self.prefix = prefix
        self.plan = plan
        self.rules = rules
        self.pad_id = pad_id
        self.eos_id = eos_id
        self._dataset: TokenDataset | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_dataset": None}  # workers map the file themselves

    def __getitem__(self, number: int) -> dict[str, Any]:
        return self.__getitems__([number])[0]

    def __getitems__(self, numbers: list[int]) -> list[dict[str, Any]]:
        """The batches ``numbers``: their blocks in one gather of the mapped tokens."""
        if self._dataset is None:
            self._dataset = TokenDataset(self.prefix)
        blocks = np.concatenate([self.plan.batch(number) for number in numbers])
        if self.rules.style == "fairseq":
            inputs, targets, real = fairseq_blocks(
                self._dataset, blocks, self.rules.block_size, self.pad_id, self.eos_id
            )
        else:
            size = self.rules.block_size
            rows = self._dataset.tokens[blocks[:, None] * size + np.arange(size + 1)].astype(np.int64)
            inputs, targets = rows[:, :-1].copy(), rows[:, 1:].copy()
            real = np.ones(inputs.shape, dtype=bool)
        count = self.plan.batch_blocks
        lengths = real.sum(axis=1, dtype=np.int64)
        batches = []
        for at in range(0, len(blocks), count):
            mine = slice(at, at + count)
            batches.append(
                {
                    "id": blocks[mine],
                    "nsentences": count,
                    "ntokens": int(lengths[mine].sum()),
                    "input": inputs[mine],
                    "target": targets[mine],
                    "src_tokens": inputs[mine],  # fairseq's names: net_input = {src_tokens, src_lengths}
                    "src_lengths": lengths[mine],
                    "src_mask": real[mine],
                    "target_mask": real[mine],
                }
            )
        return batches

    def __len__(self) -> int:
        return self.plan.num_batches


def fairseq_blocks(
    dataset: TokenDataset, blocks: np.ndarray, size: int, pad_id: int, eos_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(input, target, real)`` of fairseq's blocks ``blocks`` (see the module docstring), each
    ``len(blocks) x size``, int64, padded on the right past the stream's end."""
    total = dataset.num_tokens
    places = blocks[:, None] * size + np.arange(size)
    real = places < total
    window = dataset.tokens[np.clip(places[:, :1] - 1 + np.arange(size + 1), 0, total - 1)]  # one gather: the
    targets = np.where(real, window[:, 1:], pad_id).astype(np.int64)  # inputs are the targets shifted right
    inputs = np.where(real, window[:, :-1], pad_id).astype(np.int64)
    starts = dataset.starts  # ascending: where each sequence starts in the stream
    first = places[:, 0]
    at = np.minimum(np.searchsorted(starts, first), len(starts) - 1)
    inputs[starts[at] == first, 0] = eos_id  # a block that starts a sequence starts with eos
    return inputs, targets, real


def separator_warning(dataset: TokenDataset) -> str | None:
    """A warning when the documents of ``dataset`` would run into each other in blocks: its
    metadata says no end-of-sentence id was appended, or (without metadata) its sequences do
    not all end with one id."""
    meta = dataset.meta
    if meta is not None:
        ends = meta.eos_appended
    else:
        last = dataset.starts + dataset.sizes.astype(np.int64) - 1
        ends = len(np.unique(dataset.tokens[last[dataset.sizes > 0]])) <= 1
    if ends:
        return None
    return (
        f"{str(dataset.bin_path)[:-4]}: its sequences do not end with an end-of-sentence id, so in language-model "
        "blocks each document runs into the next (binarize without --no-eos, or Megatron's preprocess_data.py "
        "with --append-eod)."
    )


class BlockBatching:
    """The token loader's way of batching language-model blocks of one dataset (the same
    methods as :class:`~seqshard.tokens.sentences.SentenceBatching`)."""

    def __init__(self, prefix: str, dataset: TokenDataset, rules: BlockRules, ids: SpecialIds):
        self.prefix = prefix
        self.dataset = dataset
        self.rules = rules
        self.ids = ids

    def plan(self, epoch: int, world_size: int) -> BlockPlan:
        return plan_blocks(self.dataset.num_tokens, self.rules, epoch, world_size)

    def batches(self, plan: BlockPlan) -> BlockBatches:
        return BlockBatches(self.prefix, plan, self.rules, self.ids.pad_id, self.ids.eos_id)

    def warning(self, plan: BlockPlan, epoch: int, world_size: int) -> str | None:
        """A warning when more than UNREAD_WARN_SHARE of the epoch's tokens are no target,
        naming the option behind each part."""
        partial = plan.dropped.get("partial_block", 0)
        left = plan.left * self.rules.block_size
        if not plan.targets or (partial + left) / plan.targets <= UNREAD_WARN_SHARE:
            return None
        parts = []
        if partial:
            parts.append(f"{partial} after the last whole block of block_size={self.rules.block_size}")
        if left:
            parts.append(
                f"{plan.left} blocks ({left} tokens) left out so that each of {world_size} ranks takes as many "
                f"batches of {self.rules.batch_blocks} blocks (max_tokens // block_size, or max_sentences: "
                "fewer blocks per batch or fewer ranks leave fewer)"
            )
        unread = partial + left
        return (
            f"seqshard token epoch {epoch}: {unread} of {plan.targets} tokens ({unread / plan.targets:.1%}) are "
            "no target: " + "; ".join(parts) + "."
        )

    def identity(self) -> dict[str, Any]:
        digest = hashlib.sha256(f"{self.prefix}\0{len(self.dataset)}\0{self.dataset.num_tokens}\n".encode())
        rules = {k: getattr(self.rules, k) for k in self.rules.__dataclass_fields__}
        if rules["style"] == "megatron":  # the style is named only when not the default: older states still load
            del rules["style"]
        return {"blocks": digest.hexdigest()[:16], "rules": rules}

    @staticmethod
    def new_counts() -> dict[str, int]:
        return {"blocks": 0, "tokens": 0}

    @staticmethod
    def count(counts: dict[str, int], batch: dict[str, Any]) -> None:
        counts["blocks"] += batch["nsentences"]
        counts["tokens"] += batch["ntokens"]

    def stats(self, plan: BlockPlan, counts: dict[str, int]) -> dict[str, Any]:
        """Blocks and target tokens so far; the epoch's blocks, tokens, drops and leftovers."""
        return {
            **counts,
            "epoch_blocks": plan.blocks,
            "epoch_tokens": plan.targets,
            "epoch_documents": len(self.dataset.doc_index) - 1,
            "dropped": dict(plan.dropped),
            "left": plan.left,
            **({"ids": asdict(self.ids)} if self.rules.style == "fairseq" else {}),
        }
