"""What a rank's epoch did: its stats, its summary (planned, read, dropped, filtered, left),
the budget of bad shards, and warnings drawn from the counters (too many unknown label tokens)
and the summary (much of an epoch left unread).

Everything comes from the workers' counters in the rank's position and from the plan, so a
summary is right after a resume too. What an epoch left unread is counted also for shards
without an index (their samples are counted from their headers, once per loader).

For every rank, and summed over ranks, ``utts + skipped + dropped + filtered + left = planned``, where
``planned`` is what the epoch's plan gives the rank. The first rank (rank 0) also carries
what no rank reads: the utterances of missing shards (``planned`` and ``dropped["missing"]``,
where an index records them) and, after an elastic resume, what the saved readers had done
before it (``planned``, ``utts``, ``dropped``, ``filtered``: the resumed epoch as a whole, as
after an exact resume); the other ranks count what they were given and did after the resume.
"""

from __future__ import annotations

import logging
from typing import Any

from ...dist import Collectives
from ...errors import ShardError, counted, option, redact
from ...formats.remote.access import RemoteAccess
from ...formats.streams import count_samples
from ...options import LoaderOptions
from ...text.tokenizers import UNKNOWN_WARN_AFTER, unknown_tokens_warning
from ..epoch_plan import Unit, planned_utts
from ..stages.reader import DAMAGED, DAMAGED_TABLE
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
        self.bad_shards = BadShardBudget(setup, end, collectives)

    def stats(self, position: RankPosition, seconds: float) -> dict[str, Any]:
        counters = position.counters()
        dropped = by_reason(counters, "dropped.")
        if self._missing_utts():
            dropped["missing"] = self._missing_utts()
        found = {
            "epoch": position.epoch,
            "steps": position.step,
            "utts": position.utts,
            "utts_per_second": position.utts / seconds if seconds > 0 else 0.0,
            "units_done": counters.get("units_done", 0),
            "dropped": dropped,
            "filtered": by_reason(counters, "filtered."),
            "padding_fraction": 1 - position.frames / position.padded_frames if position.padded_frames else 0.0,
            "tokens": counters.get("tokens", 0),
            "unknown_tokens": counters.get("unknown_tokens", 0),
            "damaged_shards": len(shard_numbers(counters, DAMAGED)),
            "damaged_tables": len(shard_numbers(counters, DAMAGED_TABLE)),
            "duplicate_keys": counters.get("duplicate_keys", 0),
            "missing_shards": len(self.table.missing),
            "skipped": {"batches": position.skipped_batches, "utts": position.skipped_utts},
            "repeated": position.repeated,
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

    def _missing_utts(self) -> int:
        """Utterances of the missing shards (those an index records), counted on the first rank
        in epochs that follow a plan (a stream has no planned epoch to count them against)."""
        if self.setup.rank != 0 or self.end.continues_stream:
            return 0
        return sum(m.num_utts or 0 for m in self.table.missing)

    def judge_unknown_tokens(self, position: RankPosition, final: bool = False) -> None:
        """Warn once when many label tokens are unknown to the tokenizer (a units file of
        words split into characters, labels in another case than a BPE model's, ...)."""
        if self._tokens_judged:
            return
        counters = position.counters()
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
        self.bad_shards.check(position)
        rank = self.setup.rank
        local = self._rank_summary(position, seconds)
        gathered = self.end.gathers_summary
        if gathered:
            both = self.collectives.all_gather([local, sorted(self.bad_shards.damaged(position))])
            ranks = [pair[0] for pair in both]
            self.bad_shards.judge_gathered([pair[1] for pair in both])
        else:
            ranks = [local]
        summary: dict[str, Any] = {"epoch": position.epoch, "ranks": ranks}
        missing = self.table.missing
        if missing:
            summary["missing_shards"] = [redact(str(m.path)) for m in missing]
        if not gathered:
            _LOG.info("seqshard epoch %d rank %d: %s", position.epoch, rank, describe(local))
            return summary
        if rank == 0:
            _LOG.info(
                "seqshard epoch %d: %s%s",
                position.epoch,
                "; ".join(f"rank {r['rank']}: {describe(r)}" for r in ranks),
                f"; {counted(len(missing), 'selected shard')} missing, not read" if missing else "",
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
            "skipped": position.skipped_utts,
            "dropped": stats["dropped"],
            "filtered": stats["filtered"],
        }
        if position.repeated:
            summary["repeated"] = position.repeated
        if self.end.continues_stream:
            return summary
        units = [self.units_of(position, worker) for worker in range(len(position.workers))]
        self._count_unindexed(units)
        planned = [planned_utts(self.table, u, self._counted) for u in units]
        if all(p is not None for p in planned):
            total = sum(planned) + position.before_planned + self._missing_utts()  # type: ignore[arg-type]
            summary["planned"] = total
            summary["left"] = (
                total
                - position.utts
                - position.skipped_utts
                - sum(stats["dropped"].values())
                - sum(stats["filtered"].values())
            )
        return summary

    def planned_utts(self, position: RankPosition) -> int | None:
        """Utterances ``position``'s plan holds for this rank, less those it had taken (handed
        out, dropped, filtered; after an elastic resume, what it gave this rank); None when a
        shard's size is unknown."""
        counts = [planned_utts(self.table, self.units_of(position, w)) for w in range(len(position.workers))]
        if any(c is None for c in counts):
            return None
        return max(0, sum(counts) + position.before_planned - position.taken())  # type: ignore[arg-type]

    def units_of(self, position: RankPosition, worker: int) -> list[Unit]:
        """The units of ``worker`` in ``position``'s epoch: the epoch's plan, or an elastic resume's."""
        units = position.units_of(worker)
        return units if units is not None else self.setup.units(position.epoch, worker)

    def _count_unindexed(self, units: list[list[Unit]]) -> None:
        todo = {u.shard for worker in units for u in worker if self.table.shards[u.shard].num_utts is None}
        todo -= set(self._counted)
        if todo:
            _LOG.info(
                "counting the samples of %s; `seqshard index` records them", counted(len(todo), "unindexed shard")
            )
        for shard in sorted(todo):
            try:
                self._counted[shard] = count_samples(self.table.shards[shard].path, self.access)
            except ShardError as error:
                _LOG.warning("cannot count the samples of a damaged shard: %s", error)


def describe(summary: dict[str, Any]) -> str:
    text = f"{counted(summary['steps'], 'step')}, {counted(summary['utts'], 'utt')}"
    if summary.get("skipped"):
        text += f" ({summary['skipped']} more skipped unread)"
    if "left" in summary:
        text += f" of {summary['planned']} planned, {summary['left']} left unread"
    if summary.get("repeated"):
        text += f", its last batch handed out {counted(summary['repeated'], 'more time')} (it ran out early)"
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


def by_reason(counters: dict[str, int], prefix: str) -> dict[str, int]:
    """The counters under ``prefix`` (``dropped.``, ``filtered.``) that are not 0, by reason."""
    return {name[len(prefix) :]: count for name, count in counters.items() if name.startswith(prefix) and count}


def shard_numbers(counters: dict[str, int], prefix: str) -> set[int]:
    """The table numbers of the shards counted under ``prefix`` (``damaged.``, ``damaged_table.``)."""
    return {int(name[len(prefix) :]) for name, count in counters.items() if name.startswith(prefix) and count}


class BadShardBudget:
    """``max_bad_shards`` over one rank's epoch: the shards found damaged this epoch and the
    missing ones, judged against the budget of all the selected shards, whatever the world
    size; by this rank alone when it does not talk to the others (one rank, ``uneven="join"``),
    else by all ranks together where they agree (:meth:`judge_together`) and at the epoch's end
    (:meth:`judge_gathered`)."""

    def __init__(self, setup: WorkerSetup, end: EpochEnd, collectives: Collectives):
        self.options, self.table, self.end, self.collectives = setup.options.bad_data, setup.table, end, collectives
        self._before: set[int] = set()  # damaged shards a stream had counted when this epoch began
        self.talks = False  # the ranks talk, and judge their bad shards together
        self._summed = self._distinct = 0  # damaged shards summed over ranks, and how many distinct

    def start(self, position: RankPosition) -> None:
        """Bad shards are budgeted per epoch: remember what a stream that goes on across epochs
        had counted before this one (an epoch's readers count afresh), and whether the ranks
        judge theirs together (they talk; not with ``uneven="join"``)."""
        continuing = self.end.continues_stream
        self._before = shard_numbers(position.counters(), DAMAGED) if continuing else set()
        context = self.collectives.context
        self.talks = context.distributed and self.end.gathers_summary and self.collectives.ready()
        self._summed = self._distinct = 0

    def check(self, position: RankPosition) -> None:
        """Stop the run when too many shards were bad, where this rank judges its own (when a
        reader met a newly damaged shard, and at the epoch's end)."""
        if self.options.skip_bad and not self.talks:
            self._judge(len(self.damaged(position)))

    def damaged_count(self, position: RankPosition) -> int:
        """This rank's damaged shards this epoch (what it tells the other ranks)."""
        return len(self.damaged(position)) if self.options.skip_bad else 0

    def judge_together(self, position: RankPosition, summed: int) -> None:
        """The budget where the ranks agree (on every rank at the same step): ``summed``, every
        rank's damaged shards added up, while that fits; else how many distinct ones (a shard
        split between ranks may be met on both: a collective)."""
        if not (self.options.skip_bad and self.talks):
            return
        room = self._budget() - len(self.table.missing)
        if summed > room and summed != self._summed:
            self._summed = summed
            self._distinct = _distinct(self.collectives.all_gather(sorted(self.damaged(position))))
        self._judge(summed if summed <= room else self._distinct)

    def judge_gathered(self, damaged: list[list[int]]) -> None:
        """The budget at the epoch's end over every rank's ``damaged`` shards (every rank
        judges the same, at once)."""
        if self.options.skip_bad and self.talks:
            self._judge(_distinct(damaged))

    def damaged(self, position: RankPosition) -> set[int]:
        """This rank's damaged shards this epoch."""
        return shard_numbers(position.counters(), DAMAGED) - self._before

    def _budget(self) -> int:
        return self.options.shard_budget(len(self.table.shards) + len(self.table.missing))

    def _judge(self, damaged: int) -> None:
        missing = len(self.table.missing)
        if damaged + missing > self._budget():
            shards = len(self.table.shards) + missing
            raise ShardError("the selected shards", None, self.options.over_budget(damaged, missing, shards))


def _distinct(shards: list[list[int]]) -> int:
    """How many distinct shards the ranks' lists name."""
    return len(set().union(*(set(s) for s in shards)))
