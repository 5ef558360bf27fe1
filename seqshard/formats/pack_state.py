"""What a pack folder says about its own completeness (``OUT/.seqshard-pack/``).

``pack`` records every shard it plans (``planned.json``) before writing any, and each
folder's ``index.json`` once all of that folder's shards are written. So a folder with a
pack state and no index is a pack still being written (or one whose run died), and the
planned shards missing from it are known by name.
"""

from __future__ import annotations

import json
from pathlib import Path

from .index import check_name

STATE_DIR = ".seqshard-pack"
PLANNED_NAME = "planned.json"
REPORT_NAME = "pack_report.json"


def pack_root(folder: Path) -> Path | None:
    """The output folder of the pack that wrote ``folder`` (itself or, for a length group,
    its parent), or None for a folder that no pack wrote."""
    for candidate in (folder, folder.parent):
        if (candidate / STATE_DIR).is_dir():
            return candidate
    return None


def planned_shards(root: Path) -> dict[str, dict[str, int]] | None:
    """``{group: {shard name: planned utterances}}`` recorded by the pack in ``root``
    (group ``""`` without length groups), or None when the pack recorded no plan. Names that
    could point outside the folder are refused."""
    path = root / STATE_DIR / PLANNED_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    fix = "It was not written by seqshard, or was altered: pack again into a new folder."
    planned: dict[str, dict[str, int]] = {}
    for group, shards in data["groups"].items():
        if group:
            check_name(group, path, "a length group", fix)
        planned[group] = {check_name(name, path, "a planned shard", fix): int(count) for name, count in shards}
    return planned


def planned_record(groups: dict[str, list[tuple[str, int]]]) -> dict:
    """The content of ``planned.json`` for ``{group: [(shard name, planned utterances), ...]}``."""
    return {"groups": {group: [[name, count] for name, count in shards] for group, shards in groups.items()}}


def planned_in_folder(folder: Path) -> dict[str, int] | None:
    """Shards the pack planned for ``folder`` (name -> planned utterances), if a pack wrote it."""
    root = pack_root(folder)
    if root is None:
        return None
    planned = planned_shards(root)
    if planned is None:
        return None
    return planned.get("" if root == folder else folder.name)
