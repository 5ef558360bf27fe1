"""What a rank's epoch did: its stats, its summary (planned, read, dropped, filtered, left),
and warnings drawn from the counters (too many unknown label tokens) and the summary (much of
an epoch left unread).

Everything comes from the workers' counters in the rank's position and from the plan, so a
summary is right after a resume too. What an epoch left unread is counted also for shards
without an index (their samples are counted from their headers, once per loader).
"""

from __future__ import annotations

import logging
from typing import Any

from ...dist import Collectives
from ...errors import ShardError, option, redact
from ...formats.remote import RemoteAccess
from ...formats.streams import count_samples
from ...options import LoaderOptions
from ...text.tokenizers import UNKNOWN_WARN_AFTER, unknown_tokens_warning
from ..plan import Unit, planned_utts
from ..stages.reader import DAMAGED
from ..workers.setup import WorkerSetup
from .epochs import EpochEnd
from .merge import RankPosition

_LOG = logging.getLogger("seqshard")
UNREAD_WARN_SHARE = 0.05  # of the epoch's planned utterances left unread when the ranks stop


class EpochAccounts:
    """The bookkeeping of one rank's epochs for a loader."""

    def __init__(self, setup: WorkerSetup, end: EpochEnd, collectives: Collectives, access: RemoteAccess | None = None):
        self.setup = setup
        self.access = access
        self.table = setup.table
        self.end = end
        self.collectives = collectives
        self._counted: dict[int, int] = {}  # samples counted in unindexed shards
        self._tokens_judged = setup.tokenizer is None
        self._bad_before = 0  # damaged shards the stream had counted when this epoch began

    def stats(self, position: RankPosition, seconds: float) -> dict[str, Any]:
        counters = counters_of(position)
        found = {
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
            "damaged_shards": damaged_shards(counters),
            "duplicate_keys": counters.get("duplicate_keys", 0),
            "missing_shards": len(self.table.missing),
        }
        if self.setup.mix is not None:
            found["sources"] = self.source_stats(position)
        return found

    def source_stats(self, position: RankPosition) -> dict[str, dict[str, Any]]:
        """Per source of a mix, on this rank: utterances and hours this epoch, utterances since
        the stream began, and how many passes' worth of the source that is."""
        mix = self.setup.mix
        assert mix is not None
        hours_per_unit = self.table.frame_shift_ms / 3.6e6 if self.setup.length.unit == "frames" else None
        found = {}
        for number, name in enumerate(mix.names):
            utts, length = position.sources[number] if position.sources else (0, 0)
            total = position.sources_all[number][0] if position.sources_all else 0
            size = mix.sizes[number]
            found[redact(name)] = {  # a source named by a URL may carry credentials
                "utts": utts,
                "hours": length * hours_per_unit if hours_per_unit is not None else None,
                "utts_total": total,
                "passes": total / size if size else None,
            }
        return found

    def start_bad_shard_count(self, position: RankPosition) -> None:
        """Bad shards are budgeted per epoch: remember what the stream had counted before."""
        self._bad_before = damaged_shards(counters_of(position))

    def check_bad_shards(self, position: RankPosition) -> None:
        """Stop the run when this rank skipped more damaged shards this epoch than its share
        of ``max_bad_shards`` (what missing shards left of it, split evenly over the ranks)."""
        bad_data = self.setup.options.bad_data
        if not bad_data.skip_bad:
            return
        damaged = damaged_shards(counters_of(position)) - self._bad_before
        shards = len(self.table.shards) + len(self.table.missing)
        budget = bad_data.shard_budget(shards)
        share = (budget - len(self.table.missing)) / self.setup.world_size
        if damaged > share:
            raise ShardError(
                "the selected shards",
                None,
                f"{damaged} damaged shard(s) skipped on rank {self.setup.rank} this epoch"
                + (f" (and {len(self.table.missing)} missing)" if self.table.missing else "")
                + f": more than {option('max_bad_shards', bad_data.max_bad_shards)} allows ({budget} of {shards} shards"
                + (f", {share:g} per rank" if self.setup.world_size > 1 else "")
                + "). The warnings above name them; repair or re-upload them, or raise max_bad_shards.",
            )

    def judge_unknown_tokens(self, position: RankPosition, final: bool = False) -> None:
        """Warn once when many label tokens are unknown to the tokenizer (a units file of
        words split into characters, labels in another case than a BPE model's, ...)."""
        if self._tokens_judged:
            return
        counters = counters_of(position)
        tokens, unknown = counters.get("tokens", 0), counters.get("unknown_tokens", 0)
        if tokens < UNKNOWN_WARN_AFTER and not final:
            return
        self._tokens_judged = True
        warning = unknown_tokens_warning(self.setup.tokenizer, tokens, unknown)  # type: ignore[arg-type]
        if warning:
            _LOG.warning("%s", warning)

    def finish(self, position: RankPosition, seconds: float, cut: bool = False) -> dict[str, Any]:
        """The epoch's summary (every rank's, gathered, unless the ranks do not talk); logged,
        with a warning when much was left unread (unless ``cut``: the epoch's length, not the
        data, ended it)."""
        self.judge_unknown_tokens(position, final=True)
        rank = self.setup.rank
        local = self._rank_summary(position, seconds)
        if not self.end.gathers_summary:
            _LOG.info("seqshard epoch %d rank %d: %s", position.epoch, rank, describe(local))
            return {"ranks": [local]}
        ranks = self.collectives.all_gather(local)
        summary: dict[str, Any] = {"epoch": position.epoch, "ranks": ranks}
        missing = self.table.missing
        if missing:
            summary["missing_shards"] = [redact(str(m.path)) for m in missing]
        if rank == 0:
            _LOG.info(
                "seqshard epoch %d: %s%s",
                position.epoch,
                "; ".join(f"rank {r['rank']}: {describe(r)}" for r in ranks),
                f"; {len(missing)} selected shard(s) missing, not read" if missing else "",
            )
            warning = None if cut else unread_warning(position.epoch, ranks, self.setup.options)
            if warning:
                _LOG.warning("%s", warning)
        return summary

    def _rank_summary(self, position: RankPosition, seconds: float) -> dict[str, Any]:
        stats = self.stats(position, seconds)
        summary = {
            "rank": self.setup.rank,
            "steps": position.step,
            "utts": position.utts,
            "dropped": stats["dropped"],
            "filtered": stats["filtered"],
        }
        if self.end.continues_stream:
            return summary
        units = [self._units_of(position, worker) for worker in range(len(position.workers))]
        self._count_unindexed(units)
        planned = [planned_utts(self.table, u, self._counted) for u in units]
        if all(p is not None for p in planned):
            total = sum(planned)  # type: ignore[arg-type]
            summary["planned"] = total
            summary["left"] = total - position.utts - sum(stats["dropped"].values()) - sum(stats["filtered"].values())
        return summary

    def _units_of(self, position: RankPosition, worker: int) -> list[Unit]:
        units = position.units_of(worker)
        return units if units is not None else self.setup.units(position.epoch, worker)

    def _count_unindexed(self, units: list[list[Unit]]) -> None:
        todo = {u.shard for worker in units for u in worker if self.table.shards[u.shard].num_utts is None}
        todo -= set(self._counted)
        if todo:
            _LOG.info("counting the samples of %d unindexed shard(s); `seqshard index` records them", len(todo))
        for shard in sorted(todo):
            try:
                self._counted[shard] = count_samples(self.table.shards[shard].path, self.access)
            except ShardError as error:
                _LOG.warning("cannot count the samples of a damaged shard: %s", error)


def counters_of(position: RankPosition) -> dict[str, int]:
    """The workers' counters summed."""
    counters: dict[str, int] = {}
    for worker in position.workers:
        for name, value in worker.stats.items():
            counters[name] = counters.get(name, 0) + value
    return counters


def describe(summary: dict[str, Any]) -> str:
    text = f"{summary['steps']} steps, {summary['utts']} utts"
    if "left" in summary:
        text += f" of {summary['planned']} planned, {summary['left']} left unread"
    for kind in ("dropped", "filtered"):
        if summary[kind]:
            text += f", {kind} " + ", ".join(f"{k}={v}" for k, v in summary[kind].items())
    return text


def unread_warning(epoch: int, ranks: list[dict[str, Any]], options: LoaderOptions) -> str | None:
    """A warning when the ranks, stopping together, left more than UNREAD_WARN_SHARE of the
    epoch's planned utterances unread (``ranks``: every rank's summary; ``options``: the
    loader's options), naming what would leave less; else None."""
    if not ranks or any("left" not in r for r in ranks):
        return None
    planned = sum(r["planned"] for r in ranks)
    left = sum(r["left"] for r in ranks)
    if not planned or left / planned <= UNREAD_WARN_SHARE:
        return None
    worst = max(ranks, key=lambda r: r["left"] / r["planned"] if r["planned"] else 0.0)
    split = options.shuffling.split_shards
    remedies = [] if split else [f"{option('split_shards', True)} (shards spread evenly over readers)"]
    if options.workers.num_workers > 1:
        remedies.append("fewer num_workers")
    remedies.append(f"a smaller {'batch_size' if options.batching.batch_size is not None else 'batch_frames'}")
    return (
        f"seqshard epoch {epoch}: {left} of {planned} planned utterances ({left / planned:.0%}) were left unread "
        f"(rank {worst['rank']}: {worst['left']} of its {worst['planned']}). With {option('uneven', 'stop')} all "
        "ranks end the epoch at the step where the first runs out of batches, so what other ranks hold beyond "
        f"that step is not read. To leave less: {', '.join(remedies)} (each reader, rank x worker, ends its "
        f"data on a part batch); or {option('uneven', 'join')} (each rank reads all of its data, under torch's "
        f"Join) or {option('uneven', 'repeat')} with epoch_steps (readers go round their data)."
    )


def damaged_shards(counters: dict[str, int]) -> int:
    """How many distinct shards the readers found damaged (a shard split between readers, or
    met again in a later pass, counts once)."""
    return sum(1 for name, count in counters.items() if name.startswith(DAMAGED) and count)
