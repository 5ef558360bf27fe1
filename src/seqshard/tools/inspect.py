"""``seqshard inspect``: what a set of shards holds (counts, hours, lengths, per group)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import counted, redact
from ..formats.fields import field_name
from ..formats.index import ShardIndex
from ..formats.index_entries import ShardEntry, bin_bounds, histogram_percentile, merge_histograms
from ..formats.peers.shar import is_shar_index
from ..formats.selection import MissingShard
from ..formats.table import select_folders, size_problem
from .parallel import map_shards
from .scan import scan_shard

PERCENTILES = (1, 5, 25, 50, 75, 95, 99)


@dataclass
class FolderSummary:
    """The matched shards of one folder; totals come from :class:`ShardIndex`."""

    folder: str
    indexed: bool
    frame_shift_ms: float
    has_features: bool = True  # False for shards without a feature array (frames unknown)
    shar: bool = False  # a Lhotse Shar folder (frames from its cuts' durations)
    selected: ShardIndex = field(default_factory=lambda: ShardIndex([]))
    fields: dict[str, list[str]] = field(
        default_factory=dict
    )  # member suffixes: of the shards ("") and of each sidecar set

    @property
    def entries(self) -> list[ShardEntry]:
        return self.selected.shards

    @property
    def num_utts(self) -> int:
        return self.selected.num_utts

    @property
    def num_frames(self) -> int:
        return self.selected.num_frames

    @property
    def hours(self) -> float | None:
        return self.num_frames * self.frame_shift_ms / 3.6e6 if self.has_features else None

    @property
    def histogram(self) -> dict[int, int]:
        return merge_histograms(e.length_hist for e in self.entries)


@dataclass
class Summary:
    """What ``inspect`` found: a summary per folder, the selected shards that are missing, and
    the unindexed shards that could not be read to their end (their counts cover what was read)."""

    folders: list[FolderSummary]
    missing: list[MissingShard] = field(default_factory=list)
    damaged: dict[str, list[str]] = field(default_factory=dict)  # shard path -> problems

    @property
    def complete(self) -> bool:
        """True when every selected shard was there and read cleanly."""
        return not self.missing and not self.damaged


def summarize(patterns: str | list[str], jobs: int = 1, progress: bool = True) -> Summary:
    """One summary per folder of the matched shards (from the index; unindexed shards are read)."""
    selected, missing = select_folders(patterns)
    folders = []
    damaged: dict[str, list[str]] = {}
    for folder in selected:
        index = folder.index
        feature = index.feature if index else {}
        summary = FolderSummary(folder.name, index is not None, float(feature.get("frame_shift_ms") or 10.0))
        summary.shar = is_shar_index(index)
        unindexed = []
        for shard in folder.shards:
            entry = index.entry(shard.rstrip("/").rsplit("/", 1)[-1]) if index else None
            if entry is None:
                unindexed.append(shard)
            else:
                summary.entries.append(entry)
                problem = size_problem(shard, entry.bytes)
                if problem is not None:
                    damaged[shard] = [f"{problem} (`seqshard verify` checks it whole)"]
        scans = list(map_shards(scan_shard, unindexed, jobs, f"read unindexed shards in {folder.name}", progress))
        summary.entries.extend(scan.entry for scan in scans)
        damaged.update({shard: scan.problems for shard, scan in zip(unindexed, scans) if scan.problems})
        summary.has_features = summary.shar or (
            (feature.get("field") is not None if index else True)
            and all(scan.feature_field is not None for scan in scans)
        )
        main = index.fields if index and index.fields else [s for scan in scans for s in scan.fields]
        summary.fields = {"": list(dict.fromkeys(main))}
        summary.fields.update({name: list(fs.fields) for name, fs in (index.field_sets.items() if index else [])})
        folders.append(summary)
    return Summary(folders, missing, damaged)


def length_percentiles(entries: list[ShardEntry], histogram: dict[int, int]) -> dict[str, float]:
    """Percentiles from the length histograms (8 bins per octave: about 4% resolution), kept
    within the exact shortest and longest lengths when the index records them."""
    low, high = length_range(entries, histogram)
    return {f"p{q}": round(min(max(histogram_percentile(histogram, q), low), high), 1) for q in PERCENTILES}


def length_range(entries: list[ShardEntry], histogram: dict[int, int]) -> tuple[float, float]:
    """Shortest and longest length: exact when every entry records them, else the bounds of
    the outer histogram bins."""
    if not histogram:
        return 0.0, 0.0
    filled = [e for e in entries if e.num_utts]
    if filled and all(e.min_frames is not None and e.max_frames is not None for e in filled):
        return float(min(e.min_frames for e in filled)), float(max(e.max_frames for e in filled))  # type: ignore[type-var]
    return bin_bounds(min(histogram))[0], bin_bounds(max(histogram))[1]


def to_json(summary: Summary) -> dict[str, Any]:
    """What ``inspect`` prints (``--json`` as is); URLs are shown redacted."""
    folders = summary.folders
    entries = [e for f in folders for e in f.entries]
    histogram = merge_histograms(f.histogram for f in folders)
    shift = folders[0].frame_shift_ms if folders else 10.0
    hours = [f.hours for f in folders]
    known = None not in hours
    low, high = length_range(entries, histogram) if known else (None, None)
    return {
        "num_shards": len(entries),
        "num_utts": sum(f.num_utts for f in folders),
        "num_frames": sum(f.num_frames for f in folders),
        "hours": None if None in hours else round(sum(hours), 4),  # type: ignore[arg-type]
        "bytes": sum(e.bytes for e in entries),
        "frame_shift_ms": shift,
        "min_frames": low,
        "max_frames": high,
        "length_percentiles_frames": length_percentiles(entries, histogram) if known else {},
        "percentiles_exact": False,
        "groups": [
            {
                "folder": redact(f.folder),
                "format": "lhotse-shar" if f.shar else "seqshard",
                "indexed": f.indexed,
                "num_shards": len(f.entries),
                "num_utts": f.num_utts,
                "num_frames": f.num_frames,
                "hours": None if f.hours is None else round(f.hours, 4),
                "median_frames": length_percentiles(f.entries, f.histogram)["p50"] if f.has_features else None,
                "fields": {
                    name or "shard": [{"member": s, "field": field_name(s)} for s in suffixes]
                    for name, suffixes in f.fields.items()
                },
            }
            for f in folders
        ],
        "missing_shards": [
            {"path": redact(str(m.path)), "why": m.why, "num_utts": m.num_utts} for m in summary.missing
        ],
        "damaged_shards": [
            {"path": redact(path), "problems": [redact(p) for p in problems]}
            for path, problems in summary.damaged.items()
        ],
        "complete": summary.complete,
        "length_hist": {str(k): v for k, v in histogram.items()},
    }


def format_text(summary: dict[str, Any]) -> str:
    hours = "unknown hours (no feature field)" if summary["hours"] is None else f"{summary['hours']:.2f} hours"
    lines = [
        f"{counted(summary['num_shards'], 'shard')}, {counted(summary['num_utts'], 'utterance')}, "
        f"{counted(summary['num_frames'], 'frame')} = "
        f"{hours} at {summary['frame_shift_ms']:g} ms/frame, {summary['bytes'] / 1e9:.2f} GB",
        _lengths_line(summary),
        f"{'folder':<40} {'shards':>7} {'utts':>10} {'hours':>9} {'median':>7}  index",
    ]
    for group in summary["groups"]:
        group_hours = "?" if group["hours"] is None else f"{group['hours']:.2f}"
        median = "?" if group["median_frames"] is None else f"{group['median_frames']:g}"
        lines.append(
            f"{group['folder']:<40} {group['num_shards']:>7} {group['num_utts']:>10} {group_hours:>9} {median:>7}  {_index_column(group)}"
        )
    for group in summary["groups"]:
        if group["format"] == "lhotse-shar":
            shown = ", ".join(name for name in group["fields"] if name != "shard")
            lines.append(
                f"{group['folder']} is a Lhotse Shar folder: {counted(group['num_utts'], 'cut')} in "
                f"{counted(group['num_shards'], 'shard')}, "
                f"read as one sample per cut (hours from the cut durations); field files: {shown or 'none'}"
            )
    for group in summary["groups"]:
        for where, members in group["fields"].items():
            if members:
                shown = ", ".join(
                    m["field"] if m["field"] == m["member"] else f"{m['field']} (.{m['member']})" for m in members
                )
                lines.append(f"fields of {group['folder']} ({where}): {shown}")
    for missing in summary["missing_shards"]:
        lines.append(f"MISSING {missing['path']}: {missing['why']}")
    for damaged in summary["damaged_shards"]:
        lines.append(f"DAMAGED {damaged['path']}: " + "; ".join(damaged["problems"]))
    if not summary["complete"]:
        lines.append(
            "INCOMPLETE: the counts above cover only the shards and samples that could be read "
            "(`seqshard verify` checks shards fully)"
        )
    return "\n".join(lines)


def _index_column(group: dict[str, Any]) -> str:
    if group["format"] == "lhotse-shar":
        return "shar"
    return "yes" if group["indexed"] else "no"


def _lengths_line(summary: dict[str, Any]) -> str:
    if summary["min_frames"] is None:
        return "length (frames): unknown (no feature field)"
    return (
        f"length (frames): min {summary['min_frames']:g}, max {summary['max_frames']:g}; percentiles (approximate, "
        "from 8-per-octave histograms): "
        + "  ".join(f"{k}={v:g}" for k, v in summary["length_percentiles_frames"].items())
    )


def plot_lengths(summary: dict[str, Any], path: str | Path) -> None:
    """Histogram of utterance lengths (seconds, log scale) as an image."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'seqshard[plot]'") from None
    shift_s = summary["frame_shift_ms"] / 1000
    histogram = {int(k): v for k, v in summary["length_hist"].items()}
    figure, axes = plt.subplots(figsize=(8, 4))
    for index, count in sorted(histogram.items()):
        low, high = bin_bounds(index)
        axes.bar(low * shift_s, count, width=(high - low) * shift_s, align="edge", color="tab:blue", edgecolor="white")
    axes.set_xscale("log")
    ticks = length_ticks(*axes.get_xlim())
    axes.set_xticks(ticks, [f"{tick:g}" for tick in ticks])  # plain numbers, never 3x10^-1 next to 4x10^-1
    axes.xaxis.set_minor_formatter(plt.NullFormatter())
    axes.set_xlabel("utterance length (s)")
    axes.set_ylabel("utterances")
    hours = "unknown hours" if summary["hours"] is None else f"{summary['hours']:.1f} h"
    axes.set_title(f"{summary['num_utts']} utterances, {hours}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def length_ticks(low: float, high: float, most: int = 8) -> list[float]:
    """Tick values from ``low`` to ``high`` on a log axis: the densest of 1-2-3-5-like steps per
    decade that gives at most ``most`` ticks, so that their labels stay apart."""
    decades = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
    for steps in ((1, 1.5, 2, 3, 4, 5, 6, 8), (1, 2, 3, 5), (1, 2, 5), (1, 3), (1,)):
        ticks = [step * 10.0**decade for decade in decades for step in steps if low <= step * 10.0**decade <= high]
        if len(ticks) <= most:
            break
    if len(ticks) < 2:  # a range within one step: its ends, rounded
        ticks = sorted({float(f"{low:.2g}"), float(f"{high:.2g}")})
    return ticks
