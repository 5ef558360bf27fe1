"""``seqshard verify``: read every shard fully and check it against its folder's index."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ShardError, counted, redact
from ..formats.index_entries import ShardEntry, SidecarEntry
from ..formats.members import load_table, table_path
from ..formats.remote import access as remote
from ..formats.table import REPLACED, select_folders
from .parallel import map_shards
from .scan import ShardScan, scan_shard


@dataclass
class VerifyResult:
    checked: int = 0
    damaged: dict[str, list[str]] = field(default_factory=dict)  # shard path -> problems
    missing: dict[str, str] = field(default_factory=dict)  # shard path -> why it should be there
    unindexed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.damaged and not self.missing


def verify(patterns: str | list[str], jobs: int = 1, progress: bool = True) -> VerifyResult:
    """Check every shard named by ``patterns``: tar structure, arrays, count and checksum
    against ``index.json``; selected shards that are missing (listed in an index, or planned
    by an unfinished pack) count as damaged."""
    result = VerifyResult()
    folders, missing = select_folders(patterns)
    for folder in folders:
        index = folder.index
        scans = map_shards(scan_shard, folder.shards, jobs, f"verify {folder.name}", progress)
        for shard, scan in zip(folder.shards, scans):
            result.checked += 1
            problems = list(scan.problems)
            entry = index.entry(scan.entry.name) if index else None
            if index is not None and entry is None:
                result.unindexed.append(shard)
            if entry is not None:
                if scan.entry.bytes != entry.bytes:
                    problems.append(f"size {scan.entry.bytes} bytes, index says {entry.bytes}")
                if entry.checksum and scan.entry.checksum != entry.checksum:  # none for a Lhotse Shar folder
                    problems.append(f"checksum {scan.entry.checksum}, index says {entry.checksum}")
                if scan.entry.num_utts != entry.num_utts:
                    problems.append(f"{scan.entry.num_utts} utterances, index says {entry.num_utts}")
                problems.extend(_key_problems("", scan.entry, entry))
                for name, car in entry.sidecars.items():
                    problems.extend(_sidecar_problems(f"{folder.name}/{car.name}", name, car, scan))
            problems.extend(_table_problems(shard, scan))
            if problems:
                result.damaged[shard] = problems
    result.missing = {str(m.path): m.why for m in missing}
    return result


def _sidecar_problems(path: str, name: str, expected: SidecarEntry, shard: ShardScan) -> list[str]:
    """How the sidecar of field set ``name`` differs from its index entry and its shard."""
    base = path.rsplit("/", 1)[-1]
    if not remote.is_remote(path) and not Path(path).is_file():
        return [f"field set {name!r}: {base} is missing"]
    scan = scan_shard(path)
    problems = [f"field set {name!r}: {problem}" for problem in scan.problems + _table_problems(path, scan)]
    if scan.entry.bytes != expected.bytes or (expected.checksum and scan.entry.checksum != expected.checksum):
        problems.append(f"field set {name!r}: {base} differs from its index entry (size or checksum)")
    problems.extend(_key_problems(f"field set {name!r}: {base} ", scan.entry, expected))
    if scan.keys != shard.keys:
        first = next(
            (i for i, (a, b) in enumerate(zip(scan.keys, shard.keys)) if a != b), min(len(scan.keys), len(shard.keys))
        )
        problems.append(
            f"field set {name!r}: {base} holds {len(scan.keys)} samples, the shard {len(shard.keys)}; "
            f"they first differ at sample {first}"
        )
    return problems


def _key_problems(label: str, found: ShardEntry, expected: ShardEntry | SidecarEntry) -> list[str]:
    """How the first and last keys of a file differ from those its index records (a loader
    refuses such a file)."""
    return [
        f"{label}{name} {getattr(found, name)!r}, index.json says {getattr(expected, name)!r}: {REPLACED}"
        for name in ("first_key", "last_key")
        if getattr(expected, name) is not None and getattr(found, name) != getattr(expected, name)
    ]


def _table_problems(path: str, scan: ShardScan) -> list[str]:
    """How the member table of ``path`` (if it has one) differs from its headers."""
    if scan.table is None:
        return []
    try:
        stored = load_table(path)
    except ShardError as error:
        return [error.problem]
    if stored is None or stored.same_as(scan.table):
        return []
    return [
        f"its member table {table_path(path)} differs from its headers: rebuild it with `seqshard index` on its folder"
    ]


def format_result(result: VerifyResult) -> str:
    """The report ``seqshard verify`` prints (URLs redacted)."""
    lines = [
        f"checked {counted(result.checked, 'shard')}: {len(result.damaged)} damaged, {len(result.missing)} missing"
    ]
    for shard, problems in result.damaged.items():
        lines.append(f"DAMAGED {shard}")
        lines.extend(f"    {problem}" for problem in problems)
    lines.extend(f"MISSING {shard}\n    {why}" for shard, why in result.missing.items())
    for shard in result.unindexed:
        lines.append(f"not in its folder's index.json (run `seqshard index`): {shard}")
    return redact("\n".join(lines))
