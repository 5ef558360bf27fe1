"""``seqshard inspect``: what a set of shards holds (counts, hours, lengths, per group)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..formats.index import ShardEntry, ShardIndex, bin_bounds, histogram_percentile, merge_histograms
from ..formats.patterns import expand_patterns, group_by_folder
from .parallel import map_shards
from .scan import scan_shard

PERCENTILES = (1, 5, 25, 50, 75, 95, 99)


@dataclass
class FolderSummary:
    """The matched shards of one folder; totals come from :class:`ShardIndex`."""

    folder: str
    indexed: bool
    frame_shift_ms: float
    selected: ShardIndex = field(default_factory=lambda: ShardIndex([]))

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
    def hours(self) -> float:
        return self.num_frames * self.frame_shift_ms / 3.6e6

    @property
    def histogram(self) -> dict[int, int]:
        return merge_histograms(e.length_hist for e in self.entries)


def summarize(patterns: str | list[str], jobs: int = 1, progress: bool = True) -> list[FolderSummary]:
    """One summary per folder of the matched shards (from the index; unindexed shards are read)."""
    folders = []
    for folder, shards in group_by_folder(expand_patterns(patterns)).items():
        index = ShardIndex.load(folder)
        summary = FolderSummary(
            str(folder), index is not None, float((index.feature if index else {}).get("frame_shift_ms") or 10.0)
        )
        missing = []
        for shard in shards:
            entry = index.entry(shard.name) if index else None
            if entry is None:
                missing.append(shard)
            else:
                summary.entries.append(entry)
        summary.entries.extend(
            scan.entry for scan in map_shards(scan_shard, missing, jobs, f"read unindexed shards in {folder}", progress)
        )
        folders.append(summary)
    return folders


def to_json(folders: list[FolderSummary]) -> dict[str, Any]:
    histogram = merge_histograms(f.histogram for f in folders)
    shift = folders[0].frame_shift_ms if folders else 10.0
    return {
        "num_shards": sum(len(f.entries) for f in folders),
        "num_utts": sum(f.num_utts for f in folders),
        "num_frames": sum(f.num_frames for f in folders),
        "hours": round(sum(f.hours for f in folders), 4),
        "bytes": sum(e.bytes for f in folders for e in f.entries),
        "frame_shift_ms": shift,
        "length_percentiles_frames": {f"p{q}": round(histogram_percentile(histogram, q), 1) for q in PERCENTILES},
        "groups": [
            {
                "folder": f.folder,
                "indexed": f.indexed,
                "num_shards": len(f.entries),
                "num_utts": f.num_utts,
                "num_frames": f.num_frames,
                "hours": round(f.hours, 4),
                "median_frames": round(histogram_percentile(f.histogram, 50), 1),
            }
            for f in folders
        ],
        "length_hist": {str(k): v for k, v in histogram.items()},
    }


def format_text(summary: dict[str, Any]) -> str:
    lines = [
        f"{summary['num_shards']} shards, {summary['num_utts']} utterances, {summary['num_frames']} frames = "
        f"{summary['hours']:.2f} hours at {summary['frame_shift_ms']:g} ms/frame, {summary['bytes'] / 1e9:.2f} GB",
        "length percentiles (frames): "
        + "  ".join(f"{k}={v:g}" for k, v in summary["length_percentiles_frames"].items()),
        f"{'folder':<40} {'shards':>7} {'utts':>10} {'hours':>9} {'median':>7}  index",
    ]
    for group in summary["groups"]:
        lines.append(
            f"{group['folder']:<40} {group['num_shards']:>7} {group['num_utts']:>10} {group['hours']:>9.2f} {group['median_frames']:>7g}  {'yes' if group['indexed'] else 'no'}"
        )
    return "\n".join(lines)


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
    axes.set_xlabel("utterance length (s)")
    axes.set_ylabel("utterances")
    axes.set_title(f"{summary['num_utts']} utterances, {summary['hours']:.1f} h")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
