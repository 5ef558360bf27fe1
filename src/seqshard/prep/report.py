"""What a pack did: utterances packed per group, dropped by reason, shards, bytes, speed."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import counted
from ..formats.index_entries import merge_histograms
from .journal import shard_written


@dataclass
class GroupTotals:
    utts: int = 0
    shards: int = 0
    frames: int = 0
    bytes: int = 0


@dataclass
class PackReport:
    """The outcome of ``pack_data``; ``complete`` is False while parts are still missing.

    ``input_utts`` counts every scp line. When ``complete``, ``packed + sum(dropped) ==
    input_utts``: each entry either went into exactly one shard or is counted under a reason.
    ``frames_file_issues`` counts skipped ``utt2num_frames`` lines by reason; they drop no
    utterance (its length is then read from its matrix header). ``shards_empty`` counts the
    finished shards that lost every utterance while writing: they have no file and no index
    entry (``shards_done`` includes them). ``audio_stored`` counts packed utterances of audio by
    how their audio was stored: ``kept mp3`` (the original bytes), ``wav -> flac`` (decoded,
    encoded), ... ``resumed_utts`` counts the utterances of this run's shards that the partial
    files of a killed run already held (continued from their last checkpoint, not read again).
    """

    output: str
    complete: bool
    input_utts: int
    packed: int
    dropped: dict[str, int]
    label_issues: dict[str, int]
    num_labels: int
    groups: dict[str, GroupTotals]
    shards_total: int
    shards_done: int
    shards_written_now: int
    bytes_written_now: int
    wall_seconds: float
    dim: int
    dtype: str
    float16_saved_bytes: int = 0
    shards_empty: int = 0
    audio_stored: dict[str, int] = field(default_factory=dict)
    length_hist: dict[int, int] = field(default_factory=dict)
    frames_file_issues: dict[str, int] = field(default_factory=dict)
    resumed_utts: int = 0

    @property
    def mb_per_s(self) -> float:
        return self.bytes_written_now / 1e6 / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["mb_per_s"] = round(self.mb_per_s, 1)
        data["length_hist"] = {str(k): v for k, v in self.length_hist.items()}
        return data

    def format_text(self) -> str:
        lines = [
            f"seqshard pack -> {self.output}" + ("" if self.complete else "  (INCOMPLETE: other parts still to run)")
        ]
        lines.append(f"  input utterances : {self.input_utts}")
        lines.append(f"  packed           : {self.packed}")
        for reason, count in sorted(self.dropped.items()):
            lines.append(f"  dropped          : {count:>8}  {reason}")
        for reason, count in sorted(self.label_issues.items()):
            lines.append(f"  label issue      : {count:>8}  {reason} (of {self.num_labels} label lines)")
        for reason, count in sorted(self.frames_file_issues.items()):
            lines.append(f"  frames file issue: {count:>8}  {reason} (lengths read from the matrix headers instead)")
        for name, group in self.groups.items():
            lines.append(
                f"  group {name or '(all)':<11}: {counted(group.utts, 'utt')} in {counted(group.shards, 'shard')}, "
                f"{counted(group.frames, 'frame')}, {group.bytes / 1e6:.1f} MB"
            )
        lines.append(
            f"  shards           : {self.shards_done}/{self.shards_total} done, {self.shards_written_now} written by this run"
        )
        if self.resumed_utts:
            lines.append(
                f"  continued        : {self.resumed_utts:>8}  utterances already in the partial shards of a killed run"
            )
        if self.shards_empty:
            lines.append(
                f"  empty shards     : {self.shards_empty:>8}  (every utterance dropped while writing: no file, not indexed)"
            )
        lines.append(
            f"  this run         : {self.bytes_written_now / 1e6:.1f} MB in {self.wall_seconds:.1f} s = {self.mb_per_s:.1f} MB/s"
        )
        if self.audio_stored:
            stored = ", ".join(f"{count} {how}" for how, count in self.audio_stored.items())
            kept = any(how.startswith("kept ") for how in self.audio_stored)
            lines.append(f"  audio stored     : {stored}" + (" (kept: the original bytes)" if kept else ""))
        if self.dtype == "float16":
            lines.append(f"  float16 saved    : {self.float16_saved_bytes / 1e6:.1f} MB against float32")
        return "\n".join(lines)


def summarize_records(
    records: list[dict[str, Any]],
) -> tuple[dict[str, GroupTotals], dict[str, int], dict[int, int], dict[str, int]]:
    """Per-group totals, write-time skips by reason, the length histogram and the counts of
    how audio was stored, of journal records."""
    groups: dict[str, GroupTotals] = {}
    skipped: dict[str, int] = {}
    stored: dict[str, int] = {}
    for record in records:
        totals = groups.setdefault(record["group"], GroupTotals())
        totals.utts += record["num_utts"]
        totals.shards += shard_written(record)
        totals.frames += record["num_frames"]
        totals.bytes += record["bytes"]
        for reason, count in record.get("skipped", {}).items():
            skipped[reason] = skipped.get(reason, 0) + count
        for how, count in record.get("audio_stored", {}).items():
            stored[how] = stored.get(how, 0) + count
    histogram = merge_histograms({int(k): v for k, v in r["length_hist"].items()} for r in records)
    return groups, skipped, histogram, dict(sorted(stored.items(), key=lambda item: (-item[1], item[0])))
