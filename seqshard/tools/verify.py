"""``seqshard verify``: read every shard fully and check it against its folder's index."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..formats.index import ShardIndex
from ..formats.patterns import expand_patterns, group_by_folder
from .parallel import map_shards
from .scan import scan_shard


@dataclass
class VerifyResult:
    checked: int = 0
    damaged: dict[str, list[str]] = field(default_factory=dict)  # shard path -> problems
    unindexed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.damaged


def verify(patterns: str | list[str], jobs: int = 1, progress: bool = True) -> VerifyResult:
    """Check every shard named by ``patterns``: tar structure, arrays, count and checksum
    against ``index.json``; index entries whose file is gone count as damaged."""
    result = VerifyResult()
    for folder, shards in group_by_folder(expand_patterns(patterns)).items():
        index = ShardIndex.load(folder)
        for shard, scan in zip(shards, map_shards(scan_shard, shards, jobs, f"verify {folder}", progress)):
            result.checked += 1
            problems = list(scan.problems)
            entry = index.entry(shard.name) if index else None
            if index is not None and entry is None:
                result.unindexed.append(str(shard))
            if entry is not None:
                if scan.entry.bytes != entry.bytes:
                    problems.append(f"size {scan.entry.bytes} bytes, index says {entry.bytes}")
                if scan.entry.checksum != entry.checksum:
                    problems.append(f"checksum {scan.entry.checksum}, index says {entry.checksum}")
                if scan.entry.num_utts != entry.num_utts:
                    problems.append(f"{scan.entry.num_utts} utterances, index says {entry.num_utts}")
            if problems:
                result.damaged[str(shard)] = problems
        if index is not None:
            present = {s.name for s in shards}
            for entry in index.shards:
                if entry.name not in present and not (folder / entry.name).exists():
                    result.damaged[str(folder / entry.name)] = ["listed in index.json but the file is missing"]
    return result


def format_result(result: VerifyResult) -> str:
    lines = [f"checked {result.checked} shards: {len(result.damaged)} damaged"]
    for shard, problems in result.damaged.items():
        lines.append(f"DAMAGED {shard}")
        lines.extend(f"    {problem}" for problem in problems)
    for shard in result.unindexed:
        lines.append(f"not in its folder's index.json (run `seqshard index`): {shard}")
    return "\n".join(lines)
