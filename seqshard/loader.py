"""``make_loader``: stream shards into collated training batches, on one GPU or many.

The loader runs a reader pipeline in each DataLoader worker (``pipeline/worker.py``, built
by a recipe: ``pipeline/recipe.py``) and, in the training process, merges the workers'
batches into one deterministic stream (``pipeline/merge.py``), ends the epoch as its
``uneven`` mode says (``pipeline/epochs.py``), and keeps a small position that
``state_dict()``/``load_state_dict()`` save and restore exactly (``pipeline/checkpoint.py``).
"""

from __future__ import annotations

import json
import logging
import os
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from .checks import check_number
from .dist import Collectives, DistContext, discover
from .errors import ConfigError, ShardError, StateMismatchError, option
from .formats import remote
from .formats.cache import ShardCache
from .formats.patterns import Patterns
from .formats.remote import RemoteAccess
from .formats.selection import missing_error
from .formats.table import ShardTable
from .mix import Mux
from .options import LoaderConfig
from .pipeline.plan import Unit, planned_utts
from .pipeline.rank import checkpoint
from .pipeline.rank.accounts import EpochAccounts
from .pipeline.rank.epochs import BucketSync, epoch_end, epoch_length
from .pipeline.rank.merge import MergedStream, RankPosition
from .pipeline.stages.collate import to_tensors
from .pipeline.stages.mixing import MixSetup, mixed_table
from .pipeline.workers.protocol import BatchItem, ErrorItem, Item
from .pipeline.workers.recipe import check_transforms
from .pipeline.workers.setup import make_setup
from .pipeline.workers.transfer import BatchSlots
from .pipeline.workers.worker import IterationChannel
from .text.labels import LabelOverride
from .text.tokenizers import Tokenizer, make_tokenizer

_LOG = logging.getLogger("seqshard")
MAX_SLOT_BYTES = 64 << 20


def make_loader(
    patterns: Patterns | Mux,
    tokenizer: str | Path | Tokenizer | None = None,
    *,
    labels: str | Path | Sequence[str | Path] | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    **options: Any,
) -> ShardLoader:
    """A loader over the shards named by ``patterns`` (brace + glob, str or list).

    Batches are dicts: ``feats`` (B x T x D float tensor, zero padded), ``feat_lens``,
    ``labels`` (B x L, padded with ``pad_label``; when a tokenizer is given), ``label_lens``,
    ``keys``, ``texts``; any other field read is collated by its kind (arrays padded into
    ``NAME`` + ``NAME_lens``, numbers stacked, other values listed).

    ``tokenizer``: a SentencePiece ``.model`` or a units file (``token id`` per line,
    ``split="char"`` or ``"word"``, chosen from the units when not given). ``labels``: Kaldi
    ``text`` file(s) whose labels replace the shards' by key. ``rank``/``world_size``
    override what ``torch.distributed`` or torchrun's environment say. Other options
    (defaults in ``LoaderConfig``): batching (``batch_size`` or ``batch_frames``,
    ``quadratic_frames``, ``sort_window``, ``oversize``), randomness (``shuffle``, ``seed``,
    ``shuffle_window``, ``interleave``), fields (``fields``, ``feature_field``), the
    pipeline (``transforms``, ``recipe``), filters (``min_frames``, ``max_frames``,
    ``max_tokens``, ``min_frames_per_token``, ``max_frames_per_token``), labels (``split``,
    ``strip_spaces``, ``pad_label``), workers (``num_workers``, ``prefetch_factor``,
    ``persistent_workers``, ``pin_memory``), bad data (``skip_bad``), and epochs across
    ranks (``uneven`` = ``"stop"``, ``"repeat"`` or ``"join"``; ``epoch_steps`` or
    ``epoch_hours``; ``bucket_sync``), audio (``features``, ``resample_to``, ...: README).

    ``patterns`` may be a :func:`seqshard.mux` of patterns (nested muxes too): each source is
    an endless stream of its own shards, mixed by weights or temperature; the stream goes on
    across epochs, an epoch being ``epoch_steps``, ``epoch_hours`` or ``epoch_source`` (one
    pass's worth of that source's utterances).
    """
    unknown = set(options) - set(LoaderConfig.option_names())
    if unknown:
        raise ConfigError(f"unknown loader option(s): {', '.join(sorted(unknown))}.")
    if "batch_size" not in options and "batch_frames" not in options:
        options["batch_frames"] = 20000
    if callable(options.get("transforms")):
        options["transforms"] = (options["transforms"],)  # one transform given alone
    for name in ("fields", "transforms", "speed_perturb", "noise_snr"):
        if isinstance(options.get(name), Iterable) and not isinstance(options[name], (str, bytes, dict)):
            options[name] = tuple(options[name])  # other values are refused by name in LoaderConfig
    mix = None
    if isinstance(patterns, Mux):
        if options.get("uneven", "repeat") != "repeat":
            raise ConfigError(
                "a mux is an endless stream of its sources: its epochs are cut by epoch_steps, epoch_hours or "
                f"epoch_source, not by uneven={options['uneven']!r}."
            )
        options["uneven"] = "repeat"
        if all(options.get(n) is None for n in ("epoch_steps", "epoch_hours", "epoch_source")):
            raise ConfigError(
                "a mux never runs out: give epoch_steps, epoch_hours or epoch_source (one pass's worth of one source)."
            )
    elif options.get("epoch_source") is not None:
        raise ConfigError("epoch_source is for mixed sources (make_loader(seqshard.mux([...]), ...)).")
    config = LoaderConfig(**options)
    check_transforms(config.transforms)
    check_number("rank", rank, whole=True, at_least=0, optional=True)
    check_number("world_size", world_size, whole=True, at_least=1, optional=True)
    if labels is not None and not all(isinstance(f, (str, os.PathLike)) for f in _listed(labels)):
        raise ConfigError(f"labels must be a Kaldi text file or a list of them, got {labels!r}.")
    remote.use(remote_access(options))
    if isinstance(patterns, Mux):
        table, mix = mixed_table(patterns)
    else:
        table = ShardTable.from_patterns(patterns)
    if table.missing:
        if not config.skip_bad:
            raise missing_error(table.missing)
        budget = config.bad_shard_budget(len(table.shards) + len(table.missing))
        if len(table.missing) > budget:
            raise ShardError(
                "the selected shards",
                None,
                f"{len(table.missing)} of {len(table.shards) + len(table.missing)} shards are missing, more than "
                f"{option('max_bad_shards', config.max_bad_shards)} allows ({budget}): "
                f"{'; '.join(str(m.path) for m in table.missing[:5])}. Restore them, or raise max_bad_shards.",
            )
        _LOG.warning(
            "%d selected shard(s) are missing and are not read (skip_bad): %s",
            len(table.missing),
            "; ".join(f"{m.path} ({m.why})" for m in table.missing[:5]),
        )
    if not table.shards:
        raise ConfigError("none of the selected shards exists (all are missing).")
    override = LabelOverride(labels) if labels is not None else None
    return ShardLoader(
        table, config, discover(rank, world_size), make_tokenizer(tokenizer, config.split), override, mix
    )


class ShardLoader:
    """Iterate it once per epoch (after ``set_epoch``); see :func:`make_loader`."""

    def __init__(
        self,
        table: ShardTable,
        config: LoaderConfig,
        context: DistContext,
        tokenizer: Tokenizer | None,
        override: LabelOverride | None,
        mix: MixSetup | None = None,
    ):
        self.table = table
        self.config = config
        self.context = context
        self.collectives = Collectives(context)
        self.mix = mix
        mp_context = _mp_context(config.multiprocessing_context)
        self._setup = make_setup(table, config, context.rank, context.world_size, tokenizer, override, mix)
        self._setup.slots = _make_slots(table, config, mp_context)
        self._setup.remote = remote.current()
        self._buckets = len(self._setup.bucket_bounds) + 1 if config.bucket_sync else 0
        self._end = epoch_end(config.uneven, self.collectives)
        self._length = epoch_length(
            config.epoch_steps, config.epoch_hours, table.frame_shift_ms, self.collectives, _source_rule(config, mix)
        )
        self._bucket_sync = BucketSync(self._buckets, self.collectives) if config.bucket_sync else None
        self._channel = IterationChannel(mp_context)
        self._iteration = 0
        self._active: weakref.ref | None = None
        self._dataloader: Any = None
        self._epoch = 0
        self._position = self._fresh_position(0)
        self._resume: RankPosition | None = None
        self._timing = {"started": 0.0, "seconds": 0.0}
        self._accounts = EpochAccounts(self._setup, self._end, self.collectives)
        self._ranks_agree = False
        self.last_summary: dict[str, Any] | None = None

    def _fresh_position(self, epoch: int, plan: list[list[Unit]] | None = None) -> RankPosition:
        return RankPosition.fresh(epoch, self._setup.readers_per_rank, self._buckets, plan)

    # -- epochs ------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next ``iter()`` runs (its shard order and shuffles)."""
        if self._resume is not None and self._resume.epoch != epoch and not self._end.continues_stream:
            _LOG.warning(
                "the loaded state is for epoch %d; set_epoch(%d) starts epoch %d from its beginning",
                self._resume.epoch,
                epoch,
                epoch,
            )
            self._resume = None
        self._epoch = epoch

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def holds_audio(self) -> bool:
        """Whether the shards hold audio (batched as waveforms unless ``features="fbank"``)."""
        return self._setup.fields.audio is not None

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer labels go through (its ``vocab_size`` sizes an output layer)."""
        return self._setup.tokenizer

    def _start_position(self) -> RankPosition:
        """A loaded position for this epoch, else a fresh epoch; a continuing stream goes on."""
        resumed, self._resume = self._resume, None
        if resumed is not None and resumed.epoch == self._epoch:
            return resumed
        if self._end.continues_stream:
            return (resumed or self._position).continuing(self._epoch)
        return self._fresh_position(self._epoch)

    # -- iteration ---------------------------------------------------------------------------
    def _loader(self):
        if self._dataloader is None:
            import torch.utils.data

            from .pipeline.workers.dataset import ReaderDataset

            workers = self.config.num_workers
            self._dataloader = torch.utils.data.DataLoader(
                ReaderDataset(self._setup, self._channel),
                batch_size=None,
                num_workers=workers,
                collate_fn=_unchanged,
                pin_memory=False,  # batches are pinned as they are received (see _receive)
                persistent_workers=self.config.persistent_workers and workers > 0,
                prefetch_factor=self.config.prefetch_factor if workers > 0 else None,
                multiprocessing_context=self.config.multiprocessing_context if workers > 0 else None,
                timeout=self.config.timeout,
            )
        return self._dataloader

    def __iter__(self) -> Iterator[dict[str, Any]]:
        previous = self._active() if self._active is not None else None
        if previous is not None:
            previous.close()  # an abandoned iteration: stop its workers before slots are reused
        iteration = self._iterate()
        self._active = weakref.ref(iteration)
        return iteration

    def _iterate(self) -> Iterator[dict[str, Any]]:
        position = self._start_position()
        self._position = position
        if position.completed:  # a state saved at the end of this epoch: nothing is left
            return
        self._check_ranks_agree()
        self._accounts.start_bad_shard_count(position)
        self._iteration += 1
        self._channel.publish(
            {"epoch": position.epoch, "iteration": self._iteration, "workers": position.worker_request()}
        )
        stream = MergedStream(iter(self._loader()), position, self._receive)
        self._timing = {"started": time.perf_counter(), "seconds": 0.0}
        while True:
            cut = self._length.over(stream.position)  # the epoch's length reached, not the data's end
            item = None if cut else self._next_item(stream)
            if item is None:
                break
            stream.emit(item)
            self._timing["seconds"] = time.perf_counter() - self._timing["started"]
            self._accounts.judge_unknown_tokens(position)
            self._accounts.check_bad_shards(position)
            yield item.batch
        del stream  # stops non-persistent workers now, not at garbage collection
        self._accounts.check_bad_shards(position)
        if not self._end.continues_stream:
            position.completed = True
        self._finish_epoch(position, cut)

    def _check_ranks_agree(self) -> None:
        """Once, where the ranks talk anyway: every rank must read the same shards with the
        same options (a rank given other shards would otherwise go unnoticed)."""
        if self._ranks_agree or not self.context.distributed or not self._end.gathers_summary:
            return
        identities = self.collectives.all_gather(json.dumps(self._identity(), sort_keys=True))
        differing = [rank for rank, identity in enumerate(identities) if identity != identities[0]]
        if differing:
            raise ConfigError(
                f"rank(s) {differing} made their loader with other shards or options than rank 0 "
                f"({'; '.join(checkpoint.differences(json.loads(identities[differing[0]]), json.loads(identities[0])))}). "
                "Give every rank the same patterns and options."
            )
        self._ranks_agree = True

    def _next_item(self, stream: MergedStream) -> BatchItem | None:
        """The batch for this step, or None when the data ends the epoch (on every rank at
        once, except with ``uneven='join'``)."""
        if self._bucket_sync is not None:
            return self._end.settle(self._bucket_sync.next(stream), agreed=True)
        return self._end.settle(stream.pull(), agreed=False)

    def _receive(self, item: Item) -> Item:
        """Turn a worker's arrays into tensors (those in a shared slot are that memory, not a
        copy); raise the error a worker reported."""
        if isinstance(item, ErrorItem):
            # Raised without a reference cycle (error -> traceback -> this frame -> item -> error),
            # which would keep the DataLoader iterator alive until a garbage collection; one that
            # ran in a worker forked later stopped workers not its own ("Exception ignored ...
            # can only test a child process"). Freed with the error, the iterator stops its workers.
            error, item.error = item.error, None
            try:
                raise error
            finally:
                del error
        if not isinstance(item, BatchItem):
            return item
        pin = self.config.pin_memory and _cuda_available()
        batch = item.batch
        if item.slot is not None:
            places = {k: v for k, v in batch.items() if not isinstance(v, list)}
            batch.update(self._setup.slots.receive(item.slot, places, pin))  # type: ignore[union-attr]
        else:
            batch = to_tensors(batch)
            if pin:
                batch = {k: v.pin_memory() if hasattr(v, "pin_memory") else v for k, v in batch.items()}
        item.batch = batch
        return item

    # -- stats and the end of an epoch -------------------------------------------------------
    @property
    def dim(self) -> int | None:
        """The feature dimension the index records (None for shards without features)."""
        return self.table.dim

    def planned_utts(self) -> int | None:
        """Utterances this rank's plan holds for the current epoch, less those a loaded state
        had already handed out (for progress bars); None when unknown (shards without an
        index, streams that go on across epochs)."""
        if self._end.continues_stream or self.mix is not None:
            return None
        counts = [
            planned_utts(self.table, self._setup.units(self._epoch, worker))
            for worker in range(self._setup.readers_per_rank)
        ]
        if any(c is None for c in counts):
            return None
        done = self._resume.utts if self._resume is not None and self._resume.epoch == self._epoch else 0
        return max(0, sum(counts) - done)  # type: ignore[arg-type]

    def stats(self, position: RankPosition | None = None) -> dict[str, Any]:
        """This rank's progress in the current epoch: utterances (and per second), steps,
        shard units finished, dropped and filtered by reason, padding fraction, label tokens
        (and how many were unknown to the tokenizer), selected shards that are missing."""
        return self._accounts.stats(position or self._position, self._timing["seconds"])

    def _finish_epoch(self, position: RankPosition, cut: bool) -> None:
        self.last_summary = self._accounts.finish(position, self._timing["seconds"], cut)

    # -- checkpointing ------------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        return checkpoint.identity(self.table, self.config, self.context.world_size, self.mix)

    def state_dict(self, gather: bool = True) -> dict[str, Any]:
        """The loader's position: a small JSON-safe dict (no sample data).

        With several ranks and ``gather=True`` (the default) this is a collective: call it on
        every rank at the same step; every rank gets every rank's position, so rank 0 can save
        one dict for all. ``gather=False`` returns this rank's alone.
        """
        local = self._position.to_json()
        ranks = self.collectives.all_gather(local) if gather else [local]
        numbered = {str(self.context.rank): local} if not gather else {str(r): s for r, s in enumerate(ranks)}
        return {
            "seqshard_loader_state": checkpoint.STATE_VERSION,
            "identity": self._identity(),
            "epoch": self._position.epoch,
            "ranks": numbered,
        }

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Continue from ``state`` at the next ``iter()`` (after ``set_epoch`` of its epoch).

        A state saved with other shards, world size, workers or batch-defining options is
        refused with StateMismatchError naming what differs. With ``strict=False`` a state
        saved with another world size, worker count or options (same shards) is resumed
        elastically: the utterances that epoch had not yet handed out are spread over the
        new ranks and workers, each read exactly once (other batches than an uninterrupted
        run would give). That needs the state of every rank (``state_dict(gather=True)``).
        """
        checkpoint.check_state(state)
        differences = checkpoint.differences(state["identity"], self._identity())
        if differences and (strict or state["identity"]["shards"] != self.table.fingerprint()):
            raise StateMismatchError(
                "the saved loader state does not fit this loader: "
                + "; ".join(differences)
                + ". Resume with the same shards and settings, pass strict=False to resume the epoch elastically (same shards, other ranks/workers/options), or start the epoch afresh."
            )
        if differences:
            resumed = self._elastic_position(state)
        else:
            mine = state["ranks"].get(str(self.context.rank))
            if mine is None:
                raise StateMismatchError(
                    f"the saved state has no position for rank {self.context.rank} (saved with gather=False on another rank?)."
                )
            resumed = RankPosition.from_json(mine)
        self._resume = resumed
        self._position = RankPosition.from_json(resumed.to_json())
        self._epoch = resumed.epoch

    def _elastic_position(self, state: dict[str, Any]) -> RankPosition:
        from .pipeline.rank.elastic import remainder_plan

        old_config = checkpoint.saved_config(state, self.config)
        if self._end.continues_stream or old_config.uneven == "repeat":
            raise StateMismatchError(
                "elastic resume is for epochs that end (uneven='stop' or 'join'), not for uneven='repeat' streams "
                "or mixes (seqshard.mux); resume those with the same ranks, workers and options."
            )
        positions = checkpoint.saved_positions(state)
        epoch = positions[0].epoch
        if all(p.completed for p in positions):
            return replace(self._fresh_position(epoch), completed=True)
        old_world = state["identity"]["world_size"]
        setup = self._setup
        old_setups = [
            make_setup(self.table, old_config, rank, old_world, setup.tokenizer, setup.override)
            for rank in range(old_world)
        ]
        gather = self.collectives.all_gather if self.context.distributed and _dist_ready() else None
        plan = remainder_plan(
            self.table,
            old_setups,
            positions,
            self.context.world_size,
            setup.readers_per_rank,
            self.context.rank,
            gather,
        )
        _LOG.info(
            "elastic resume of epoch %d: %d saved readers' remainder spread over %d ranks x %d workers",
            epoch,
            sum(len(p.workers) for p in positions),
            self.context.world_size,
            setup.readers_per_rank,
        )
        return self._fresh_position(epoch, plan[self.context.rank])


def _source_rule(config: LoaderConfig, mix: MixSetup | None) -> tuple[int, int] | None:
    """(source, utterances) of ``epoch_source``: one pass's worth of that source."""
    if config.epoch_source is None or mix is None:
        return None
    source = mix.source_of(config.epoch_source)
    size = mix.sizes[source]
    name = mix.names[source]
    if size is None:
        raise ConfigError(
            f"epoch_source {name!r} has shards without an index, so its size is unknown: "
            "run `seqshard index` on its folder."
        )
    if not size or not mix.shares[source]:
        problem = (
            "holds no utterances, so every epoch would be empty"
            if not size
            else "has weight 0 in the mux, so none of it is read and an epoch would never end"
        )
        raise ConfigError(
            f"epoch_source {name!r} {problem}: choose a source the mux reads, or give epoch_steps or epoch_hours."
        )
    return source, size


def _listed(value: Any) -> list[Any]:
    """``value`` as a list: the items of a list or tuple, else the value alone."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _unchanged(item: Any) -> Any:
    return item


def _mp_context(name: str | None):
    import multiprocessing

    return multiprocessing.get_context(name) if name else multiprocessing.get_context()


def remote_access(options: dict[str, Any]) -> RemoteAccess:
    """How this loader reads remote shards: fsspec options and the local cache, if any."""
    cache_dir = options.get("cache_dir")
    cache = ShardCache(cache_dir, options.get("cache_limit")) if cache_dir is not None else None
    return RemoteAccess(
        storage_options=dict(options.get("storage_options") or {}),
        retries=int(options.get("remote_retries", 4)),
        timeout_s=float(options.get("remote_timeout", 60.0)),
        cache=cache,
        allow_pipes=options.get("allow_pipes") is True,
    )


def _make_slots(table: ShardTable, config: LoaderConfig, context) -> BatchSlots | None:
    """Shared slots for workers' batches, sized for the largest batch the options allow
    (feature arrays, plus room for labels and other fields)."""
    if not config.shared_slots:
        return None
    itemsize = 2 if config.dtype == "float16" else 4
    if config.batch_frames is not None:
        frames = config.batch_frames
    else:
        longest = max((2 ** ((k + 1) / 8) for k, _ in table.length_hist), default=2000)
        frames = int(config.batch_size * longest) + 1  # type: ignore[operator]
    feature_bytes = frames * (table.dim or 80) * itemsize
    slot_bytes = min(MAX_SLOT_BYTES, int(feature_bytes * 1.25) + (1 << 20))
    if config.num_workers == 0:  # batches made in this process: a ring for what training still holds
        return BatchSlots(1, 4, slot_bytes, context)
    return BatchSlots(config.num_workers, config.prefetch_factor + 3, slot_bytes, context)


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
