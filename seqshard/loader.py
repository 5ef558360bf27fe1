"""``make_loader``: stream shards into padded training batches, on one GPU or many.

The loader runs a reader pipeline in each DataLoader worker (see ``pipeline/worker.py``) and,
in the training process, merges the workers' batches into one deterministic stream, ends the
epoch together on every rank (``uneven``), and keeps a small position that
``state_dict()``/``load_state_dict()`` save and restore exactly.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from .dist import Collectives, DistContext, discover
from .errors import ConfigError, ShardError, StateMismatchError
from .formats.selection import missing_error
from .formats.tar import count_samples
from .pipeline.collate import to_tensors
from .pipeline.config import LoaderConfig
from .pipeline.labels import UNKNOWN_WARN_AFTER, LabelOverride, Tokenizer, make_tokenizer, unknown_tokens_warning
from .pipeline.merge import Item, MergedStream, RankPosition
from .pipeline.shards import ShardTable, planned_utts
from .pipeline.transfer import BatchSlots
from .pipeline.worker import IterationChannel, WorkerSetup, bucket_bounds

_LOG = logging.getLogger("seqshard")
STATE_VERSION = 1


def make_loader(
    patterns: str | Path | Sequence[str | Path],
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
    ``keys``, ``texts``.

    ``tokenizer``: a SentencePiece ``.model`` or a units file (``token id`` per line,
    ``split="char"`` or ``"word"``, chosen from the units when not given). ``labels``: Kaldi ``text`` file(s) whose labels replace
    the shards' by key. ``rank``/``world_size`` override what ``torch.distributed`` or
    torchrun's environment say. Other options (defaults in ``LoaderConfig``): batching
    (``batch_size`` or ``batch_frames``, ``quadratic_frames``, ``sort_window``,
    ``oversize``), randomness (``shuffle``, ``seed``, ``shuffle_window``, ``interleave``),
    filters (``min_frames``, ``max_frames``, ``max_tokens``, ``min_frames_per_token``,
    ``max_frames_per_token``), labels (``split``, ``strip_spaces``, ``pad_label``), workers
    (``num_workers``, ``prefetch_factor``, ``persistent_workers``, ``pin_memory``), bad data
    (``skip_bad``), and the end of epochs across ranks (``uneven`` = ``"stop"``,
    ``"repeat"`` with ``epoch_steps``/``epoch_hours``, or ``"join"``; ``bucket_sync``).
    """
    unknown = set(options) - set(LoaderConfig.option_names())
    if unknown:
        raise ConfigError(f"unknown loader option(s): {', '.join(sorted(unknown))}.")
    if "batch_size" not in options and "batch_frames" not in options:
        options["batch_frames"] = 20000
    config = LoaderConfig(**options)
    table = ShardTable.from_patterns(patterns)
    if table.missing:
        if not config.skip_bad:
            raise missing_error(table.missing)
        _LOG.warning(
            "%d selected shard(s) are missing and are not read (skip_bad): %s",
            len(table.missing),
            "; ".join(f"{m.path} ({m.why})" for m in table.missing[:5]),
        )
    if not table.shards:
        raise ConfigError("none of the selected shards exists (all are missing).")
    context = discover(rank, world_size)
    override = LabelOverride(labels) if labels is not None else None
    return ShardLoader(
        table,
        config,
        context,
        make_tokenizer(tokenizer, config.split),
        override,
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
    ):
        self.table = table
        self.config = config
        self.context = context
        self.collectives = Collectives(context)
        bounds = bucket_bounds(table, config.num_buckets) if config.bucket_sync else ()
        self._buckets = len(bounds) + 1 if config.bucket_sync else 0
        mp_context = _mp_context(config.multiprocessing_context)
        self._setup = WorkerSetup(
            table,
            config,
            context.rank,
            context.world_size,
            tokenizer,
            override,
            bounds,
            _make_slots(table, config, mp_context),
        )
        self._channel = IterationChannel(mp_context)
        self._iteration = 0
        self._active: weakref.ref | None = None
        self._dataloader: Any = None
        self._epoch = 0
        self._position = RankPosition.fresh(0, self._setup.readers_per_rank, self._buckets)
        self._resume: RankPosition | None = None
        self._timing = {"started": 0.0, "seconds": 0.0}
        self._counted: dict[int, int] = {}  # samples counted in unindexed shards (for what is left)
        self._unknown_tokens_judged = tokenizer is None
        self.last_summary: dict[str, Any] | None = None

    # -- epochs ------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next ``iter()`` runs (its shard order and shuffles)."""
        if self._resume is not None and self._resume.epoch != epoch and self.config.uneven != "repeat":
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
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer labels go through (its ``vocab_size`` sizes an output layer)."""
        return self._setup.tokenizer

    def _start_position(self) -> RankPosition:
        """A loaded position for this epoch, else a fresh epoch; a repeating stream goes on."""
        resumed, self._resume = self._resume, None
        if self.config.uneven == "repeat":
            base = resumed if resumed is not None else self._position
            return base if resumed is not None and resumed.epoch == self._epoch else base.continuing(self._epoch)
        if resumed is not None and resumed.epoch == self._epoch:
            return resumed
        return RankPosition.fresh(self._epoch, self._setup.readers_per_rank, self._buckets)

    # -- iteration ---------------------------------------------------------------------------
    def _loader(self):
        if self._dataloader is None:
            import torch.utils.data

            workers = self.config.num_workers
            from .pipeline.dataset import ReaderDataset

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
        self._iteration += 1
        self._channel.publish(
            {"epoch": position.epoch, "iteration": self._iteration, "workers": position.worker_request()}
        )
        stream = MergedStream(iter(self._loader()), position, self._receive)
        self._timing = {"started": time.perf_counter(), "seconds": 0.0}
        while True:
            item = self._next_item(stream)
            if item is None:
                break
            stream.emit(item)
            self._timing["seconds"] = time.perf_counter() - self._timing["started"]
            if not self._unknown_tokens_judged:
                self._judge_unknown_tokens(position)
            yield item["batch"]
        del stream  # stops non-persistent workers now, not at garbage collection
        if self.config.uneven != "repeat":
            position.completed = True
        self._finish_epoch(position)

    def _next_item(self, stream: MergedStream) -> Item | None:
        """The batch for this step, or None when the epoch ends (on every rank at once,
        except with ``uneven='join'``)."""
        config = self.config
        if config.uneven == "repeat" and self._repeat_epoch_over(stream.position):
            return None
        if config.bucket_sync:
            return self._bucket_step(stream)
        item = stream.pull()
        if config.uneven == "stop" and self.context.distributed:
            (everyone,) = self.collectives.all_min([0 if item is None else 1])
            return item if everyone else None
        if item is None and config.uneven == "repeat":
            raise ConfigError("the data ran out in uneven='repeat' mode (no reader has any data?).")
        return item

    def _repeat_epoch_over(self, position: RankPosition) -> bool:
        if self.config.epoch_steps is not None:
            return position.step >= self.config.epoch_steps
        target = self.config.epoch_hours * 3.6e6 / self.table.frame_shift_ms  # type: ignore[operator]
        (frames,) = self.collectives.all_sum([position.frames])
        return frames >= target

    def _bucket_step(self, stream: MergedStream) -> Item | None:
        """All ranks take a batch of the same length bucket: the one whose smallest queue
        over ranks is longest; when none is common to all, every rank pulls one more."""
        while True:
            mins = self.collectives.all_min(stream.reservoir_counts() + [0 if stream.exhausted else 1])
            common = [b for b in range(self._buckets) if mins[b] > 0]
            if common:
                return stream.take_from_reservoir(max(common, key=lambda b: (mins[b], -b)))
            if mins[-1] == 0:
                if self.config.uneven == "repeat":
                    raise ConfigError("the data ran out in uneven='repeat' mode.")
                return None
            stream.pull_into_reservoir()

    def _receive(self, item: Item) -> Item:
        """Turn a worker's arrays into tensors (copying features out of their shared slot);
        raise the error a worker reported."""
        if "error" in item:
            raise item["error"]
        arrays = item["batch"]
        if arrays is None:
            return item
        pin = self.config.pin_memory and _cuda_available()
        feats = arrays["feats"]
        if isinstance(feats, tuple):
            _, slot, shape = feats
            arrays["feats"] = self._setup.slots.take(slot, shape, pin)  # type: ignore[union-attr]
        batch = to_tensors(arrays)
        if pin:
            batch = {
                k: v.pin_memory() if hasattr(v, "pin_memory") and not v.is_pinned() else v for k, v in batch.items()
            }
        item["batch"] = batch
        return item

    def _judge_unknown_tokens(self, position: RankPosition, final: bool = False) -> None:
        """Warn once when many label tokens are unknown to the tokenizer (a units file of
        words split into characters, labels in another case than a BPE model's, ...)."""
        counters = self._counters(position)
        tokens, unknown = counters.get("tokens", 0), counters.get("unknown_tokens", 0)
        if tokens < UNKNOWN_WARN_AFTER and not final:
            return
        self._unknown_tokens_judged = True
        warning = unknown_tokens_warning(self._setup.tokenizer, tokens, unknown)  # type: ignore[arg-type]
        if warning:
            _LOG.warning("%s", warning)

    # -- end of epoch -------------------------------------------------------------------------
    def _finish_epoch(self, position: RankPosition) -> None:
        if not self._unknown_tokens_judged:
            self._judge_unknown_tokens(position, final=True)
        local = self._rank_summary(position)
        if self.config.uneven == "join":
            self.last_summary = {"ranks": [local]}
            _LOG.info("seqshard epoch %d rank %d: %s", position.epoch, self.context.rank, _describe(local))
            return
        ranks = self.collectives.all_gather(local)
        self.last_summary = {"epoch": position.epoch, "ranks": ranks}
        if self.table.missing:
            self.last_summary["missing_shards"] = [str(m.path) for m in self.table.missing]
        if self.context.rank == 0:
            missing = f"; {len(self.table.missing)} selected shard(s) missing, not read" if self.table.missing else ""
            _LOG.info(
                "seqshard epoch %d: %s%s",
                position.epoch,
                "; ".join(f"rank {r['rank']}: {_describe(r)}" for r in ranks),
                missing,
            )

    def _rank_summary(self, position: RankPosition) -> dict[str, Any]:
        stats = self.stats(position)
        summary = {
            "rank": self.context.rank,
            "steps": position.step,
            "utts": position.utts,
            "dropped": stats["dropped"],
            "filtered": stats["filtered"],
        }
        if self.config.uneven != "repeat":
            units = [self._units_of(position, w) for w in range(len(position.workers))]
            self._count_unindexed(units)
            planned = [planned_utts(self.table, u, self._counted) for u in units]
            if all(p is not None for p in planned):
                total = sum(planned)  # type: ignore[arg-type]
                summary["planned"] = total
                summary["left"] = (
                    total
                    - position.utts
                    - sum(v for k, v in stats["dropped"].items() if k != "damaged_shard")
                    - sum(stats["filtered"].values())
                )
        return summary

    def _count_unindexed(self, units: list[list]) -> None:
        """Count the samples of this rank's unindexed shards (headers only, once per loader),
        so that what an epoch left unread is known for them too."""
        todo = {u.shard for worker in units for u in worker if self.table.shards[u.shard].num_utts is None}
        todo -= set(self._counted)
        if todo:
            _LOG.info("counting the samples of %d unindexed shard(s); `seqshard index` records them", len(todo))
        for shard in sorted(todo):
            try:
                self._counted[shard] = count_samples(self.table.shards[shard].path)
            except ShardError as error:
                _LOG.warning("cannot count the samples of a damaged shard: %s", error)

    def _units_of(self, position: RankPosition, worker: int) -> list:
        units = position.units_of(worker)
        return units if units is not None else self._setup.units(position.epoch, worker)

    # -- stats -------------------------------------------------------------------------------
    def stats(self, position: RankPosition | None = None) -> dict[str, Any]:
        """This rank's progress in the current epoch: utterances (and per second), steps,
        shard units finished, dropped and filtered by reason, padding fraction."""
        position = position or self._position
        counters = self._counters(position)
        seconds = self._timing["seconds"]
        return {
            "epoch": position.epoch,
            "steps": position.step,
            "utts": position.utts,
            "utts_per_second": position.utts / seconds if seconds > 0 else 0.0,
            "units_done": counters.get("units_done", 0),
            "dropped": {k.split(".", 1)[1]: v for k, v in counters.items() if k.startswith("dropped.") and v},
            "filtered": {k.split(".", 1)[1]: v for k, v in counters.items() if k.startswith("filtered.") and v},
            "padding_fraction": 1 - position.frames / position.padded_frames if position.padded_frames else 0.0,
            "tokens": counters.get("tokens", 0),
            "unknown_tokens": counters.get("unknown_tokens", 0),
            "missing_shards": len(self.table.missing),
        }

    @staticmethod
    def _counters(position: RankPosition) -> dict[str, int]:
        """The workers' counters summed."""
        counters: dict[str, int] = {}
        for worker in position.workers:
            for name, value in worker.stats.items():
                counters[name] = counters.get(name, 0) + value
        return counters

    # -- checkpointing ------------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        return {
            "shards": self.table.fingerprint(),
            "num_shards": len(self.table.shards),
            "world_size": self.context.world_size,
            "options": self.config.batch_defining(),
        }

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
            "seqshard_loader_state": STATE_VERSION,
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
        if state.get("seqshard_loader_state") != STATE_VERSION:
            raise StateMismatchError("not a seqshard loader state (or from an incompatible version).")
        differences = _differences(state["identity"], self._identity())
        if differences and (strict or state["identity"]["shards"] != self.table.fingerprint()):
            raise StateMismatchError(
                "the saved loader state does not fit this loader: "
                + "; ".join(differences)
                + ". Resume with the same shards and settings, pass strict=False to resume the epoch elastically (same shards, other ranks/workers/options), or start the epoch afresh."
            )
        if differences:
            self._resume = self._elastic_position(state)
            self._position = RankPosition.from_json(self._resume.to_json())
            self._epoch = self._resume.epoch
            return
        mine = state["ranks"].get(str(self.context.rank))
        if mine is None:
            raise StateMismatchError(
                f"the saved state has no position for rank {self.context.rank} (saved with gather=False on another rank?)."
            )
        self._resume = RankPosition.from_json(mine)
        self._position = RankPosition.from_json(mine)
        self._epoch = self._resume.epoch

    def _elastic_position(self, state: dict[str, Any]) -> RankPosition:
        from .pipeline.elastic import planned_setups, remainder_plan

        identity = state["identity"]
        old_config = LoaderConfig(**identity["options"])
        if "repeat" in (old_config.uneven, self.config.uneven):
            raise StateMismatchError(
                "elastic resume is for epochs that end (uneven='stop' or 'join'), not for uneven='repeat' streams."
            )
        if sorted(state["ranks"], key=int) != [str(r) for r in range(identity["world_size"])]:
            raise StateMismatchError(
                "elastic resume needs the position of every saved rank: save with state_dict(gather=True)."
            )
        positions = [RankPosition.from_json(state["ranks"][str(r)]) for r in range(identity["world_size"])]
        epoch = positions[0].epoch
        if all(p.completed for p in positions):
            return replace(RankPosition.fresh(epoch, self._setup.readers_per_rank, self._buckets), completed=True)
        gather = self.collectives.all_gather if self.context.distributed and _dist_ready() else None
        plan = remainder_plan(
            self.table,
            planned_setups(self._setup, identity["world_size"], old_config),
            positions,
            self.context.world_size,
            self._setup.readers_per_rank,
            self.context.rank,
            gather,
        )
        _LOG.info(
            "elastic resume of epoch %d: %d saved readers' remainder spread over %d ranks x %d workers",
            epoch,
            sum(len(p.workers) for p in positions),
            self.context.world_size,
            self._setup.readers_per_rank,
        )
        return RankPosition.fresh(epoch, self._setup.readers_per_rank, self._buckets, plan[self.context.rank])


def _differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    found = []
    for key in ("shards", "num_shards", "world_size"):
        if saved.get(key) != current.get(key):
            found.append(f"{key} was {saved.get(key)!r}, now {current.get(key)!r}")
    for key, value in current["options"].items():
        if saved.get("options", {}).get(key) != value:
            found.append(f"option {key} was {saved.get('options', {}).get(key)!r}, now {value!r}")
    return found


def _describe(summary: dict[str, Any]) -> str:
    text = f"{summary['steps']} steps, {summary['utts']} utts"
    if "left" in summary:
        text += f" of {summary['planned']} planned, {summary['left']} left unread"
    for kind in ("dropped", "filtered"):
        if summary[kind]:
            text += f", {kind} " + ", ".join(f"{k}={v}" for k, v in summary[kind].items())
    return text


def _unchanged(item: Any) -> Any:
    return item


def _mp_context(name: str | None):
    import multiprocessing

    return multiprocessing.get_context(name) if name else multiprocessing.get_context()


MAX_SLOT_BYTES = 64 << 20


def _make_slots(table: ShardTable, config: LoaderConfig, context) -> BatchSlots | None:
    """Shared slots for workers' batches, sized for the largest batch the options allow."""
    if config.num_workers == 0 or not table.dim:
        return None
    if config.batch_frames is not None:
        frames = config.batch_frames
    else:
        longest = max((2 ** ((k + 1) / 8) for k, _ in table.length_hist), default=0)
        frames = int(config.batch_size * longest) + 1  # type: ignore[operator]
    values = min(frames * table.dim, MAX_SLOT_BYTES // (2 if config.dtype == "float16" else 4))
    return BatchSlots(config.num_workers, config.prefetch_factor + 2, values, config.dtype, context)


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
