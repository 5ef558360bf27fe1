"""What a pack owns in its output folder, and what else the folder holds.

A pack records every shard it plans (``.seqshard-pack/planned.json``, before it writes any)
and every shard it finishes (the journals). Its own files are those shards with what belongs
to each (the hidden partial file, the member table, the sidecars ``add-field`` wrote for it),
each group folder's ``index.json`` (and ``index.npz``), the report and the state folder. ``pack --overwrite``
removes exactly those (:func:`remove_previous_pack`); anything else in the folder (another
corpus copied there, a link to one, a user's notes) is left alone and never written over or
mixed with: a file named like the pack's shards, or an index, that the previous pack did not
write is refused (:func:`in_the_way`), and a refusal names what else the folder holds
(:func:`foreign_entries`).
Nothing is removed through a symbolic link.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SeqshardError, counted, listed
from ..formats.files import TEMPORARY_SUFFIX, leads_out
from ..formats.index import INDEX_NAME, ShardIndex
from ..formats.index_entries import check_name, old_sidecar_name
from ..formats.lock import LOCK_NAME
from ..formats.members import TABLE_DIR, table_path
from ..formats.pack_state import REPORT_NAME, STATE_DIR, planned_shards
from ..formats.patterns import FIELD_SET_NAME, FIELDS_DIR, INDEX_TABLE_NAME, is_shard_name, shard_stem
from ..formats.tar import temporary_path
from .journal import journal_records

_LOG = logging.getLogger("seqshard")


@dataclass
class Owned:
    """The files a pack in ``root`` recorded as its own: shard names per group folder (``""``:
    the root itself) and the field sets added to them."""

    root: Path
    shards: dict[str, set[str]] = field(default_factory=dict)
    field_sets: set[str] = field(default_factory=set)

    def folder(self, group: str) -> Path:
        return self.root / group if group else self.root

    def paths(self) -> set[Path]:
        """The recorded shard files."""
        return {self.folder(group) / name for group, names in self.shards.items() for name in names}


def recorded(root: Path) -> Owned:
    """What the pack in ``root`` recorded: its planned shards and the shards its journals name
    (a name that is not a plain file name is refused: it could lead out of the folder)."""
    owned = Owned(root)
    state = root / STATE_DIR
    if state.is_symlink() or not state.is_dir():
        return owned
    for group, names in (planned_shards(root) or {}).items():
        owned.shards.setdefault(group, set()).update(names)
    fix = "It was not written by seqshard, or was altered: move the folder's data elsewhere by hand."
    for journal, record in journal_records(root):
        group = record.get("group") or ""
        if group:
            check_name(group, journal, "a length group", fix)
        owned.shards.setdefault(group, set()).add(check_name(record.get("name"), journal, "a shard", fix))
    for path in state.glob("field-*-*.jsonl"):
        name = path.name[len("field-") :].rsplit("-", 1)[0]
        if FIELD_SET_NAME.fullmatch(name):
            owned.field_sets.add(name)
    for group in owned.shards:
        with contextlib.suppress(SeqshardError):
            index = ShardIndex.load(owned.folder(group))
            owned.field_sets.update(index.field_sets if index else ())
    return owned


def remove_previous_pack(root: Path) -> int:
    """Remove what the previous pack in ``root`` recorded as its own (module docstring);
    returns how many files. Folders reached through a symbolic link are left alone."""
    owned = recorded(root)
    removed = 0
    for group, names in owned.shards.items():
        folder = owned.folder(group)
        if _leads_elsewhere(root, folder):
            _LOG.warning("%s is a symbolic link: the previous pack's files through it are left alone", folder)
            continue
        removed += _remove_shards(folder, names, owned.field_sets)
        removed += _unlink(folder / INDEX_NAME) + _unlink(folder / INDEX_TABLE_NAME)
        if group:
            _remove_if_empty(folder, root)
    removed += _unlink(root / REPORT_NAME)
    return removed + remove_tree(root / STATE_DIR)


def remove_tree(folder: Path) -> int:
    """Remove seqshard's own ``folder`` (the pack's state: its files, its waves' folders),
    never following a link (a link in it is removed, not what it points at); returns how many files."""
    if not folder.is_dir() or folder.is_symlink():
        return 0
    removed = 0
    for path in folder.iterdir():
        if path.is_dir() and not path.is_symlink():
            removed += remove_tree(path)
        else:
            removed += _unlink(path)
    _remove_if_empty(folder)
    return removed


def _remove_shards(folder: Path, names: set[str], field_sets: set[str]) -> int:
    """Recorded shards of ``folder``, with their partial files, member tables and sidecars
    (both layouts); then the seqshard folders this leaves empty."""
    fields = folder / FIELDS_DIR
    field_folders = (
        [f for f in fields.iterdir() if FIELD_SET_NAME.fullmatch(f.name) and not _leads_elsewhere(folder, f)]
        if fields.is_dir() and not _leads_elsewhere(folder, fields)
        else []
    )
    removed = 0
    for name in names:
        paths = [folder / name, *(f / f"{shard_stem(name)}.tar" for f in field_folders)]
        paths += [folder / old_sidecar_name(name, field_set) for field_set in field_sets]
        for path in paths:
            removed += _unlink(path) + _unlink(temporary_path(path))
            if not _leads_elsewhere(folder, path.parent / TABLE_DIR):
                removed += _unlink(table_path(path))
    for field_folder in field_folders:
        _remove_if_empty(field_folder / TABLE_DIR, folder)
        _remove_if_empty(field_folder, folder)
    _remove_if_empty(fields, folder)
    _remove_if_empty(folder / TABLE_DIR, folder)
    return removed


def in_the_way(owned: Owned, folders: list[Path], fmt: str) -> list[Path]:
    """Files in the folders a pack writes (``folders``, its shards named by ``fmt``) that
    are not the previous pack's: an index, or files named like its shards. A pack writing
    there would write over another corpus's files, or mix its shards with them."""
    pattern = re.sub(r"%[-+ 0#]*\d*d", "*", fmt)
    ours = owned.paths()
    found = []
    for folder in folders:
        group = "" if folder == owned.root else folder.name
        for index in (folder / INDEX_NAME, folder / INDEX_TABLE_NAME):
            if group not in owned.shards and (index.exists() or index.is_symlink()):
                found.append(index)
        found += [path for path in sorted(folder.glob(pattern)) if path not in ours]
    return found


def foreign_entries(owned: Owned) -> list[str]:
    """What ``root`` holds besides the recorded pack, each named (a folder with what it
    holds, a link with its target), for messages."""
    root = owned.root
    ours = {STATE_DIR, LOCK_NAME, REPORT_NAME, *(group for group in owned.shards if group)}
    if "" in owned.shards:
        ours |= {INDEX_NAME, INDEX_TABLE_NAME, TABLE_DIR, FIELDS_DIR, *owned.shards[""]}
    found = []
    for entry in sorted(root.iterdir()):
        name = entry.name
        if name in ours or (name.startswith(".") and name.endswith(TEMPORARY_SUFFIX)):
            continue
        if entry.is_symlink():
            found.append(f"{entry} -> {os.readlink(entry)}")
        elif entry.is_dir():
            found.append(f"{entry}/ ({_describe_folder(entry)})")
        else:
            found.append(str(entry))
    return found


def describe_foreign(entries: list[str]) -> str:
    """A sentence naming what is not the pack's, for the end of a message ('' for nothing)."""
    if not entries:
        return ""
    return f" The folder also holds what no pack here wrote, which seqshard leaves alone: {listed(entries, '; ')}."


def _describe_folder(folder: Path) -> str:
    try:
        names = [p.name for p in folder.iterdir()]
    except OSError:
        return "unreadable"
    shards = sum(is_shard_name(n) for n in names)
    parts = [counted(shards, "shard file")] if shards else []
    if INDEX_NAME in names:
        parts.append(INDEX_NAME)
    return ", ".join(parts) or counted(len(names), "file")


def _leads_elsewhere(root: Path, path: Path) -> bool:
    """Whether a symbolic link on the way from ``root`` to ``path`` leads out of ``root``."""
    return path.is_symlink() or leads_out(root, path)


def _unlink(path: Path) -> int:
    try:
        path.unlink()
    except FileNotFoundError:
        return 0
    return 1


def _remove_if_empty(folder: Path, root: Path | None = None) -> None:
    if folder.is_symlink() or (root is not None and _leads_elsewhere(root, folder)):
        return
    with contextlib.suppress(OSError):
        folder.rmdir()
