"""``make_token_loader``: batches of token sequences by a token budget (translation), or
fixed blocks of a token stream (language models).

Each epoch's plan (``tokens/token_epochs.py`` for sentences, ``tokens/blocks.py`` for blocks) is a pure
function of (seed, epoch, world size), so every rank computes it alone and the loader's state
is how many batches each rank took. Batches are built GROUP_BATCHES at a time (one gather per
source for all of them: ``collate.py``), in DataLoader workers with ``num_workers``, in the
plan's order; a state saved mid-epoch resumes at the next batch, and with another world
size (``strict=False``) the batches no rank had taken are dealt again to the new ranks, none
lost and none repeated. The loader follows :class:`seqshard.protocol.Loader`.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..checks import check_flag, check_number, check_rule
from ..device import CudaCopier, check_device, is_cuda, one_ahead, require_device
from ..dist import Collectives, DistContext, discover
from ..errors import ConfigError, StateMismatchError
from ..mix import Mux, flatten
from ..protocol import PlannedBatches, length_of
from ..seeds import Seed, stage_rng
from ..text.fairseq_dict import FairseqDictionary
from .blocks import BlockBatching, BlockRules, block_rules, separator_warning
from .databin import DataBin, Direction
from .ids import SpecialIds, special_ids
from .pair_collate import CollateRules, as_tensors, with_net_input
from .pair_sources import EpochSources
from .pairs import OpenPair, TokenPair, as_pair
from .sentences import SentenceBatching
from .token_epochs import BatchRules

_LOG = logging.getLogger("seqshard")
STATE_VERSION = 1
DEFAULT_MAX_POSITIONS = 1024
GROUP_BATCHES = 16  # batches built together (one gather per source for all of them)


def make_token_loader(
    src: str | Path | TokenPair | Mux | DataBin,
    tgt: str | Path | None = None,
    *,
    block_size: int | None = None,
    block_style: str = "megatron",
    max_tokens: int = 4096,
    max_sentences: int | None = None,
    max_positions: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    virtual_size: int | None = None,
    src_lang_id: int | None = None,
    tgt_lang_id: int | None = None,
    pad_id: int | None = None,
    eos_id: int | None = None,
    left_pad_source: bool = True,
    num_workers: int = 0,
    device: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> TokenLoader:
    """A loader of fairseq-style batches from ``src`` (a ``.bin``/``.idx`` prefix) and
    ``tgt`` (a prefix, or None for one side), or from a :func:`seqshard.mux` of
    :class:`TokenPair`s (a virtual epoch of ``virtual_size`` sentences, shares by weights or
    temperature, drawn anew each epoch), or from a data_bin's directions
    (:func:`seqshard.token_pairs`): each epoch reads what each direction's epoch reads (one
    shard folder per epoch, as fairseq's multilingual task), every sentence once, or sampled by
    ``seqshard.mux(data_bin, temperature=T)``; ``source`` in a batch is the direction's number.

    Batches never hold more than ``max_tokens`` padded tokens on either side (B x longest),
    nor more than ``max_sentences``; pairs longer than ``max_positions`` (default 1024) are
    dropped and counted. Language token ids (``src_lang_id``/``tgt_lang_id``, or per pair) are
    prepended. Every rank gets the same number of batches, drawn from every length range.

    ``block_size=N`` (one dataset, language modelling) reads every token instead, ``max_tokens //
    N`` blocks a batch (see ``tokens/blocks.py``): ``block_style="megatron"`` cuts the stream
    into blocks of N + 1 tokens as Megatron's ``GPTDataset`` (``input``/``target`` shifted by
    one, the last partial block dropped); ``"fairseq"`` as fairseq's ``TokenBlockDataset``
    (``target`` the N tokens from k x N, ``input`` the same shifted right with eos at a
    sequence's start, the last block kept and padded).

    ``pad_id``/``eos_id`` None: from the datasets' ``PREFIX.json``, else fairseq's 1 and 2, the
    pad only if it never occurs in the data (``tokens/ids.py``); batches carry ``src_mask`` /
    ``target_mask`` and lengths, so any pad id works.

    ``device="cuda"``: batches come on the GPU, each copied on a side stream while the step
    before it runs (``seqshard/device.py``).
    """
    check_rule("pad_id", pad_id, optional=True)
    check_rule("eos_id", eos_id, optional=True)
    check_rule("num_workers", num_workers)
    device = check_device("device", device)
    require_device(device)
    context = discover(rank, world_size)
    batching: BlockBatching | SentenceBatching
    if block_size is not None:
        if isinstance(src, (Mux, DataBin)) or tgt is not None or src_lang_id is not None or tgt_lang_id is not None:
            raise ConfigError("block_size reads one language-model dataset: no target, mux, data_bin or language ids.")
        pair = as_pair(src)
        if pair.tgt is not None:
            raise ConfigError(f"block_size reads one language-model dataset, not the pair {pair}.")
        rules = block_rules(block_size, max_tokens, max_sentences, max_positions, shuffle, seed, block_style)
        batching = _block_batching(pair, rules, pad_id, eos_id, warn=context.rank == 0)
    else:
        if block_style != "megatron":
            raise ConfigError(f"block_style={block_style!r} cuts language-model blocks: give block_size=N with it.")
        leaves, mixed = _leaves_of(src, tgt, src_lang_id, tgt_lang_id)
        check_flag("left_pad_source", left_pad_source)
        positions = DEFAULT_MAX_POSITIONS if max_positions is None else max_positions
        rules = BatchRules(max_tokens, max_sentences, positions, shuffle, seed, virtual_size)
        batching = _sentence_batching(src, leaves, mixed, rules, pad_id, eos_id, left_pad_source)
    return TokenLoader(batching, num_workers, context, device)


def _block_batching(
    pair: TokenPair, rules: BlockRules, pad_id: int | None, eos_id: int | None, warn: bool
) -> BlockBatching:
    """One language-model dataset read in blocks (``warn``: log what its separators say)."""
    dataset = OpenPair(pair).src
    warning = separator_warning(dataset)
    if warning and warn:
        _LOG.warning("%s", warning)
    ids = special_ids([dataset], pad_id, eos_id, pads=rules.style == "fairseq")  # Megatron's are never padded
    return BlockBatching(pair.src, dataset, rules, ids)


def _leaves_of(
    src: str | Path | TokenPair | Mux | DataBin,
    tgt: str | Path | None,
    src_lang_id: int | None,
    tgt_lang_id: int | None,
) -> tuple[list[TokenPair | Direction], np.ndarray | None]:
    """What ``src`` reads: a mux's or a data_bin's leaves and shares (:func:`_leaves`), or one
    pair, with the target and language ids given beside it put in it; every pair's language
    ids checked."""
    given = tgt is not None or src_lang_id is not None or tgt_lang_id is not None
    if isinstance(src, (Mux, DataBin)):
        if given:
            raise ConfigError("with a mux or a data_bin, give targets and language ids in each TokenPair.")
        leaves, mixed = _leaves(src)
    else:
        pair = as_pair(src)
        if given:
            pair = TokenPair(
                pair.src,
                str(tgt) if tgt is not None else pair.tgt,
                src_lang_id if src_lang_id is not None else pair.src_lang_id,
                tgt_lang_id if tgt_lang_id is not None else pair.tgt_lang_id,
            )
        leaves, mixed = [pair], None
    for leaf in leaves:
        for pair in _pairs_of(leaf):
            check_rule("src_lang_id", pair.src_lang_id, optional=True)
            check_rule("tgt_lang_id", pair.tgt_lang_id, optional=True)
    return leaves, mixed


def _sentence_batching(
    src: Any,
    leaves: list[TokenPair | Direction],
    mixed: np.ndarray | None,
    rules: BatchRules,
    pad_id: int | None,
    eos_id: int | None,
    left_pad_source: bool,
) -> SentenceBatching:
    """Sentence batches of ``leaves`` (with ``mixed`` shares); pad and eos ids from a
    data_bin's dictionaries, the datasets' ``PREFIX.json`` or fairseq's defaults."""
    fixed = {leaf: OpenPair(leaf) for leaf in leaves if isinstance(leaf, TokenPair)}
    sources = EpochSources(leaves, mixed, fixed)
    first = sources.open(sources.epoch(0).pairs)
    if len({o.tgt is None for o in first}) > 1:
        raise ConfigError("mix pairs with targets or pairs without, not both.")
    if _of_data_bin(src):  # fairseq's dictionaries: <pad> 1, </s> 2
        ids = SpecialIds(
            FairseqDictionary.pad_id if pad_id is None else pad_id,
            FairseqDictionary.eos_id if eos_id is None else eos_id,
            "dictionary" if pad_id is None else "given",
            "dictionary" if eos_id is None else "given",
        )
    else:
        ids = special_ids([d for o in first for d in (o.src, o.tgt) if d is not None], pad_id, eos_id)
    return SentenceBatching(sources, rules, CollateRules(ids.pad_id, ids.eos_id, left_pad_source), ids)


def _leaves(src: Mux | DataBin) -> tuple[list[TokenPair | Direction], np.ndarray | None]:
    """A mux's leaves (token pairs or data_bin directions) and their shares, or a data_bin's
    directions read whole (no shares: fairseq's ``concat`` sampling)."""
    if isinstance(src, DataBin):
        return list(src.directions), None
    if any(isinstance(source, DataBin) for source in src.sources):
        raise ConfigError("mux(data_bin, ...) takes the data_bin alone (its directions are the sources).")
    leaves, shares = flatten(src, _size)
    return [leaf if isinstance(leaf, Direction) else as_pair(leaf) for leaf in leaves], shares


def _size(leaf: TokenPair | Direction | str | Path | tuple) -> int:
    """A mux leaf's size for temperature sampling: sentences of a pair, or of every shard a
    direction is read from."""
    return len(leaf) if isinstance(leaf, Direction) else len(OpenPair(as_pair(leaf)))


def _pairs_of(leaf: TokenPair | Direction) -> list[TokenPair]:
    if isinstance(leaf, TokenPair):
        return [leaf]
    return [part.pair for parts in leaf.shards for part in parts]


def _of_data_bin(src: Any) -> bool:
    """A data_bin, or a mux of its directions alone: ids from its fairseq dictionaries."""
    if isinstance(src, DataBin):
        return True
    return isinstance(src, Mux) and all(isinstance(source, Direction) for source in src.sources)


class TokenBatching(Protocol):
    """What :class:`TokenLoader` asks of a way of batching (sentences or blocks)."""

    rules: Any  # with ``shuffle`` and ``seed``

    def plan(self, epoch: int, world_size: int) -> Any: ...

    def batches(self, plan: Any) -> Any: ...  # a map-style dataset with ``__getitems__(numbers)``

    def warning(self, plan: Any, epoch: int, world_size: int) -> str | None: ...

    def identity(self) -> dict[str, Any]: ...

    def new_counts(self) -> dict[str, int]: ...

    def count(self, counts: dict[str, int], batch: dict[str, Any]) -> None: ...

    def stats(self, plan: Any, counts: dict[str, int]) -> dict[str, Any]: ...


def _as_built(batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return batches


def _built(dataset: Any, numbers: list[int], num_workers: int) -> Iterator[dict[str, Any]]:
    """The batches ``numbers`` of ``dataset`` (built in groups: in this process, or by
    ``num_workers`` processes of a DataLoader, which stop when the iterator goes)."""
    import torch.utils.data

    groups = [numbers[at : at + GROUP_BATCHES] for at in range(0, len(numbers), GROUP_BATCHES)]
    if num_workers == 0:  # batches cost a fraction of a millisecond: no DataLoader in between
        return (batch for group in groups for batch in dataset.__getitems__(group))
    # each worker builds whole groups (the DataLoader calls __getitems__ with each)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=groups, num_workers=num_workers, collate_fn=_as_built)
    return (batch for group in loader for batch in group)


def _handed_over(
    built: Iterator[dict[str, Any]], copier: CudaCopier | None
) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """Each batch's arrays with the batch handed over: tensors over the arrays, or with a
    ``copier`` on the GPU, the next batch's copy started before one is handed over."""
    if copier is None:
        return ((arrays, as_tensors(arrays)) for arrays in built)

    def start(arrays: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        host = as_tensors(arrays)
        del host["net_input"]  # made again from the copied tensors
        return arrays, copier.start(host)

    def finish(started: tuple[dict[str, Any], Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        arrays, copy = started
        return arrays, with_net_input(copier.finish(copy))

    return one_ahead(built, start, finish)


def _dealt_again(
    lists: list[np.ndarray], history: list[dict[str, Any]], world: int, rules: Any, epoch: int
) -> list[np.ndarray]:
    """Every rank's batch numbers after resumes with other world sizes (``history``: the deals
    of the epoch before the current one, ``lists`` the first one's): the batches no rank had
    taken, dealt again (in order, then shuffled) to the ranks of the next deal."""
    for number, deal in enumerate(history):
        after = int(history[number + 1]["world_size"]) if number + 1 < len(history) else world
        rest = np.sort(np.concatenate([lists[r][int(step) :] for r, step in enumerate(deal["steps"])]))
        equal = len(rest) // after
        lists = []
        for rank in range(after):
            mine = rest[rank::after][:equal]
            if rules.shuffle:
                mine = stage_rng(rules.seed, Seed.TOKEN_REDEAL, epoch, number, rank).permutation(mine)
            lists.append(mine)
    return lists


class TokenLoader:
    """Iterate it once per epoch; see :func:`make_token_loader` and :class:`seqshard.protocol.Loader`."""

    def __init__(self, batching: TokenBatching, num_workers: int, context: DistContext, device: str | None = None):
        self.batching = batching
        self.rules = batching.rules
        self.num_workers = num_workers
        self.context = context
        self.collectives = Collectives(context)
        self._epoch = 0
        self._plans: dict[tuple[int, int], Any] = {}
        self._step = 0  # batches of this epoch this rank has taken
        self._start = 0  # where the next iteration starts in this rank's list (after a resume)
        self._history: list[dict[str, Any]] | None = None  # deals of this epoch before the current one
        self._finished = False  # the epoch's last batch was taken: the next iter() runs the next epoch
        self._running: weakref.ref | None = None  # the open iteration (weak: a dropped one stops its workers at once)
        self._counts = batching.new_counts()
        self._skipped = 0  # batches of this epoch moved past unread (skip_batches), counted in _step
        self.device = device
        self._copier: CudaCopier | None = None

    # -- plans ---------------------------------------------------------------------------
    def plan(self, epoch: int | None = None, world_size: int | None = None) -> Any:
        """The plan of ``epoch`` (default: the current one) for ``world_size`` ranks."""
        key = (self._epoch if epoch is None else epoch, world_size or self.context.world_size)
        if key not in self._plans:
            self._plans = {key: self.batching.plan(*key)}  # keep one
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
        self._finished = False
        self._step = self._start

    @property
    def dim(self) -> None:
        """Token batches hold no feature vectors (the Loader protocol's ``dim``)."""
        return None

    @property
    def epoch(self) -> int:
        return self._epoch

    def planned_batches(self) -> PlannedBatches:
        """Batches of the current epoch on this rank (exact): ``total``, and ``remaining``: those
        not taken yet (after a loaded state, those it had not taken; after the last batch, 0)."""
        mine = len(self._lists()[self.context.rank])
        taken_before = sum(max(int(s) for s in deal["steps"] if s is not None) for deal in self._history or [])
        return PlannedBatches(taken_before + mine, 0 if self._finished else mine - self._step)

    def __len__(self) -> int:
        """Batches of the current epoch on this rank."""
        return length_of(self.planned_batches(), "token loader")

    def _lists(self) -> list[np.ndarray]:
        """Every rank's batch numbers for this epoch: the plan's, or after resumes with other
        world sizes, the batches no rank had taken, dealt again (in order, then shuffled)."""
        history, world = self._history or [], self.context.world_size
        lists = self.plan(world_size=int(history[0]["world_size"]) if history else world).ranks
        return _dealt_again(lists, history, world, self.rules, self._epoch)

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.close()  # an iteration still open ends here (its workers stop)
        self._next_epoch_if_finished()
        if self._start == 0:
            self._skipped = 0
        if self.context.rank == 0 and self._start == 0 and self._history is None:
            warning = self.batching.warning(self.plan(), self._epoch, self.context.world_size)
            if warning:
                _LOG.warning("%s", warning)
        numbers = self._lists()[self.context.rank][self._start :]
        self._step, self._start = self._start, 0
        self._counts = self.batching.new_counts()
        running = self._batches([int(n) for n in numbers], self._step + len(numbers))
        self._running = weakref.ref(running)
        return running

    def _next_epoch_if_finished(self) -> None:
        if self._finished:  # without set_epoch, the next epoch (never the same order again by accident)
            self._epoch += 1
            self._finished = False

    def skip_batches(self, n: int) -> int:
        """Move the next iteration's start ``n`` batches on (fewer at the epoch's end) without
        building them: call it on every rank with the same ``n``, after ``load_state_dict`` (or
        before an epoch's first ``iter()``). They count as steps taken, and as ``skipped`` in
        ``stats()`` and the state. Returns how many it skipped."""
        check_number("n", n, whole=True, at_least=0)
        self.close()
        self._next_epoch_if_finished()
        if self._start == 0:
            self._skipped = 0
        mine = len(self._lists()[self.context.rank])
        taken = max(0, min(n, mine - self._start))
        self._start += taken
        self._skipped += taken
        self._step = self._start
        return taken

    def _batches(self, numbers: list[int], end: int) -> Iterator[dict[str, Any]]:
        """The batches ``numbers``, the last of them this rank's ``end``-th of the epoch."""
        built = _built(self.batching.batches(self.plan()), numbers, self.num_workers)
        if is_cuda(self.device) and self._copier is None:
            self._copier = CudaCopier(self.device)  # type: ignore[arg-type]
        delivered = _handed_over(built, self._copier)
        try:
            for arrays, batch in delivered:
                self._step += 1
                self.batching.count(self._counts, arrays)
                self._finished = self._step == end  # a state saved now starts the next epoch
                yield batch
            self._history = None  # the epoch is done: the next starts from its plan
            self._finished = True
        finally:
            del built, delivered  # a DataLoader iterator's workers stop when it goes
            if self._copier is not None:
                self._copier.close()

    def close(self) -> None:
        """Stop the workers of an iteration still open (iterating again starts them anew)."""
        running = self._running() if self._running is not None else None
        self._running = None
        if running is not None:
            running.close()

    def stats(self) -> dict[str, Any]:
        """This epoch so far: ``epoch``, ``steps`` (batches taken), ``steps_in_epoch``, the
        batching's counts and the plan's drops and leftovers."""
        return {
            "epoch": self._epoch,
            "steps": self._step,
            "skipped": self._skipped,
            "steps_in_epoch": self.planned_batches().total,
            **self.batching.stats(self.plan(), self._counts),
        }

    # -- checkpointing -------------------------------------------------------------------
    def state_dict(self, gather: bool = True) -> dict[str, Any]:
        """How many batches each rank took this epoch: a collective with ``gather=True``;
        ``gather=False`` fills in this rank's alone (enough to resume it with as many ranks).
        Saved after the epoch's last batch, the state starts the next epoch."""
        if gather:
            steps: list[int | None] = [int(s) for s in self.collectives.all_gather(self._step)]
        else:
            steps = [None] * self.context.world_size
            steps[self.context.rank] = self._step
        epoch, history, skipped = self._epoch, self._history or [], self._skipped
        if self._finished:
            epoch, history, steps, skipped = epoch + 1, [], [0 if s is not None else None for s in steps], 0
        return {
            "seqshard_token_loader_state": STATE_VERSION,
            "identity": self.batching.identity(),
            "epoch": epoch,
            "deals": [*history, {"world_size": self.context.world_size, "steps": steps}],
            "skipped": skipped,
        }

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Continue from ``state`` at the next ``iter()`` of its epoch; ``strict=False`` allows
        another world size (the batches no rank had taken are dealt again to the new ranks)."""
        if state.get("seqshard_token_loader_state") != STATE_VERSION:
            raise StateMismatchError("not a token loader state of this version (seqshard_token_loader_state).")
        mine = self.batching.identity()
        for name in sorted(set(mine) | set(state["identity"])):
            if state["identity"].get(name) != mine.get(name):
                raise StateMismatchError(
                    f"the state was saved with other {name} ({state['identity'].get(name)} != {mine.get(name)})."
                )
        *earlier, last = state["deals"]
        world = self.context.world_size
        if int(last["world_size"]) == world:
            step = last["steps"][self.context.rank]
            if step is None:
                raise StateMismatchError(
                    f"the state holds no step for rank {self.context.rank} (saved with gather=False?)."
                )
            self._history, self._start = earlier, int(step)
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
        self._finished = False
        self._step = self._start
        self._skipped = int(state.get("skipped", 0))
