"""Shard patterns as users write them: brace and glob, several at once.

``data/{10_1000,1000_2000}/data-*.tar`` and ``data/10_1000/data-0000{0..9}.tar`` behave as in
seed 01's ``trset``: braces expand first (bash-style, with ``{a..b}`` ranges), then each
result is globbed if it holds a wildcard, else taken as a file that must exist.
"""

from __future__ import annotations

import glob
from collections.abc import Sequence
from pathlib import Path

from ..errors import ConfigError

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def expand_patterns(patterns: str | Path | Sequence[str | Path]) -> list[Path]:
    """Shard files named by ``patterns``, in pattern order, each once.

    A pattern that matches nothing is an error that names it. A directory stands for the
    shards in it (``DIR/*.tar``).
    """
    from braceexpand import braceexpand

    if isinstance(patterns, (str, Path)):
        patterns = [patterns]
    if not patterns:
        raise ConfigError("no shard pattern given.")
    found: dict[Path, None] = {}
    for pattern in patterns:
        matched: list[Path] = []
        missing: list[str] = []
        for expanded in braceexpand(str(pattern)):
            path = Path(expanded)
            if path.is_dir():
                matched.extend(shards_in_folder(path))
                for sub in sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")):
                    matched.extend(shards_in_folder(sub))
            elif glob.has_magic(expanded):
                matched.extend(Path(p) for p in sorted(glob.glob(expanded)) if Path(p).is_file())
            elif path.is_file():
                matched.append(path)
            else:
                missing.append(expanded)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ConfigError(f"shard pattern {str(pattern)!r} names files that do not exist: {shown}.")
        if not matched:
            raise ConfigError(
                f"shard pattern {str(pattern)!r} matches no file (from {Path.cwd()}). Check the path, the braces and the wildcard."
            )
        for path in matched:
            found.setdefault(path, None)
    return list(found)


def shards_in_folder(folder: Path) -> list[Path]:
    """Shard files directly inside ``folder`` (hidden partial files excluded), sorted."""
    return sorted(
        p for p in folder.iterdir() if p.is_file() and p.name.endswith(SHARD_SUFFIXES) and not p.name.startswith(".")
    )


def group_by_folder(paths: Sequence[Path]) -> dict[Path, list[Path]]:
    """Shards grouped by the folder (and so the index) they belong to, in first-seen order."""
    folders: dict[Path, list[Path]] = {}
    for path in paths:
        folders.setdefault(path.parent, []).append(path)
    return folders
