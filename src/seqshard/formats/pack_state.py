"""What a pack folder says about its own completeness (``OUT/.seqshard-pack/``).

``pack`` records every shard it plans (``planned.json``) before writing any, and each
folder's ``index.json`` once all of that folder's shards are written. So a folder with a
pack state and no index is a pack still being written (or one whose run died), and the
planned shards missing from it are known by name.
"""

from __future__ import annotations

from pathlib import Path

from ..checks import NumberError, read_number, shown
from ..errors import SeqshardError
from .files import read_json
from .index_entries import MAX_COUNT, check_name

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
    (group ``""`` without length groups), or None when the pack recorded no plan. A plan that
    cannot be read, names that could point outside the folder and counts that are not whole
    numbers from 0 are refused (SeqshardError naming the file)."""
    path = root / STATE_DIR / PLANNED_NAME
    fix = "It was not written by seqshard, or was altered: pack again into a new folder."
    if (data := read_json(path, "pack again into a new folder (it was altered).", None, kind=dict)) is None:
        return None
    groups = data.get("groups")
    if not isinstance(groups, dict) or not all(isinstance(shards, list) for shards in groups.values()):
        raise SeqshardError(f'{path}: not a pack\'s plan ({{"groups": {{GROUP: [[SHARD, UTTERANCES], ...]}}}}). {fix}')
    planned: dict[str, dict[str, int]] = {}
    for group, shards in groups.items():
        if group:
            check_name(group, path, "a length group", fix)
        planned[group] = {}
        for shard in shards:
            if not isinstance(shard, list) or len(shard) != 2:
                raise SeqshardError(f"{path}: a planned shard is {shown(shard)}, not [NAME, UTTERANCES]. {fix}")
            name = check_name(shard[0], path, "a planned shard", fix)
            try:
                planned[group][name] = int(
                    read_number(f"the utterances of {name}", shard[1], whole=True, at_least=0, at_most=MAX_COUNT)
                )  # type: ignore[arg-type]
            except NumberError as error:
                raise SeqshardError(f"{path}: {error}. {fix}") from None
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
