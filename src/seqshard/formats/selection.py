"""Which shards a set of patterns selects, checked against what should be there.

Every brace alternative must select at least one shard: a typo in one alternative of
``{10_500,500_200}`` is an error, not half the data. Shards that should be there but are not
are returned as :class:`MissingShard`, never dropped from the list unannounced: those listed
in a folder's ``index.json`` whose file is gone, those a pack planned for a folder it has not
finished writing, and explicitly named files that do not exist. The caller decides: an error
naming them, or (when the user asked to skip bad data) a counted, logged skip.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, ShardError, counted, listed, option
from .files import file_kind
from .index import ShardIndex
from .pack_state import REPORT_NAME, pack_root, planned_in_folder
from .patterns import (
    FIELD_SET_NAME,
    FIELDS_DIR,
    Alternative,
    Listing,
    Patterns,
    expand_pattern,
    grouped,
    in_fields_folder,
    is_shard_name,
    old_layout_sidecar,
    pattern_list,
)
from .peers.lists import shard_list
from .peers.nemo_tarred import NEMO_FORMAT, nemo_index
from .peers.shar import shar_index
from .streams import same_keys

_LOG = logging.getLogger("seqshard")


@dataclass(frozen=True)
class MissingShard:
    """A shard that the patterns select but that is not on disk (or on its server: ``path``
    is then its URL), and why it should be."""

    path: Path | str
    why: str
    num_utts: int | None = None

    @property
    def place(self) -> tuple[str, str]:
        """(folder, file name) of the path or URL."""
        if isinstance(self.path, Path):
            return str(self.path.parent), self.path.name
        folder, _, name = self.path.split("?", 1)[0].rpartition("/")
        return folder, name


@dataclass
class ShardSelection:
    """The names of the shard files selected, by folder (in pattern order, each file once),
    each folder's index, and the shards that are missing."""

    folders: dict[Path, list[str]] = field(default_factory=dict)
    indexes: dict[Path, ShardIndex | None] = field(default_factory=dict)
    missing: list[MissingShard] = field(default_factory=list)
    skip_bad: bool = False  # a Lhotse Shar cut with a bad duration is counted when read, not refused here
    listed_sidecars: dict[Path, frozenset[str]] = field(default_factory=dict)  # per folder, from its index
    listings: dict[Path, Listing] = field(default_factory=dict)  # of folders listed whole
    real_folders: dict[Path, str] = field(default_factory=dict)  # each folder's real path, looked up once

    @property
    def paths(self) -> list[Path]:
        return [folder / name for folder, names in self.folders.items() for name in names]


def missing_error(missing: Sequence[MissingShard]) -> ShardError:
    """The error that names missing shards (the first few) and what to do."""
    folders = {m.place[0] for m in missing}
    shown = listed([f"{m.place[1] if len(folders) == 1 else m.path} ({m.why})" for m in missing], "; ")
    return ShardError(
        missing[0].place[0] if len(folders) == 1 else "the selected shards",
        None,
        f"{counted(len(missing), 'selected shard', 'is')} missing: {shown}. Fix: restore them or finish the pack that "
        f"writes them; or pass {option('skip_bad')} to read the others (the missing ones are counted).",
    )


def select_shards(patterns: Patterns, skip_bad: bool = False) -> ShardSelection:
    """The shards named by ``patterns`` (see the module docstring), each file once however
    it is spelled (``a/../b``, a link); raises ConfigError for an alternative that selects
    nothing at all. ``skip_bad``: see :func:`~.peers.shar.shar_index`."""
    selection = ShardSelection(skip_bad=skip_bad)
    missing: dict[Path, MissingShard] = {}
    selected: dict[str, dict[str, Any]] = {}  # real folder -> real name -> the spelling selected (or its folder)
    for pattern in pattern_list(patterns):
        for alternative in expand_pattern(pattern):
            selection.listings.update(alternative.listings)
            if alternative.kind == "list":
                absent = _read_list(alternative)
            else:
                sidecars = {
                    folder: _sidecars_among(folder, names, selection) for folder, names in alternative.files.items()
                }
                if alternative.kind == "file" and any(sidecars.values()):
                    folder, names = next((f, n) for f, n in sidecars.items() if n)
                    raise ConfigError(
                        f"{folder / next(n for n in alternative.files[folder] if n in names)} is a field file of "
                        "add-field, read with its shard beside it (or in the folder above fields/): select that "
                        "shard, and the field with fields=[...]."
                    )
                alternative.files = {
                    folder: [n for n in names if n not in sidecars[folder]] if sidecars[folder] else names
                    for folder, names in alternative.files.items()
                }
                absent = _absent(alternative, selection)
            if not any(alternative.files.values()) and not absent:
                raise ConfigError(
                    f"{alternative.text!r} (from the pattern {pattern!r}) selects no shard (from {Path.cwd()}). "
                    "Check the path, the braces and the wildcard; shards end in .tar, .tar.gz or .tgz (lists in .list; "
                    "a Lhotse Shar folder's shards are its cuts.*.jsonl.gz)."
                )
            for shard in absent:
                missing.setdefault(shard.path, shard)
            for folder, names in alternative.files.items():
                _select(folder, names, alternative.links.get(folder), selected, selection)
    for folder in selection.folders:
        _index_of(folder, selection)
    selection.missing = list(missing.values())
    return selection


def _select(
    folder: Path,
    names: list[str],
    links: frozenset[str] | None,
    selected: dict[str, dict[str, Any]],
    selection: ShardSelection,
) -> None:
    """Add the files ``names`` of ``folder`` to ``selection`` unless a file is selected already
    (under another spelling: logged). A file is known by its real path: the folder's (looked
    up once) and its name, unless it is a symbolic link (``links``: of a listing, whose names
    are each once; None: not known, each file's is looked up)."""
    if not names:
        return
    if folder not in selection.real_folders:
        selection.real_folders[folder] = os.path.realpath(folder)
    real = selection.real_folders[folder]
    if links is not None and not links and real not in selected:  # a listing's names, none a link, none seen
        selected[real] = (folder, names)  # made a dict only if another spelling comes to this folder
        selection.folders.setdefault(folder, []).extend(names)
        return
    for name in names:
        place, real_name = (real, name) if links is not None and name not in links else _real(folder, name)
        known = selected.setdefault(place, {})
        if isinstance(known, tuple):  # the names of one listing: spelled folder/name
            known = selected[place] = dict.fromkeys(known[1], known[0])
        first = known.get(real_name)
        if first is None:
            known[real_name] = (folder, name)
            selection.folders.setdefault(folder, []).append(name)
        elif (first := first if isinstance(first, tuple) else (first, real_name)) != (folder, name):
            _LOG.info("%s is %s (selected already): read once", folder / name, first[0] / first[1])


def _real(folder: Path, name: str) -> tuple[str, str]:
    """The real folder and name of the file ``name`` in ``folder`` (links followed)."""
    real = os.path.realpath(folder / name)
    return os.path.dirname(real), os.path.basename(real)


def _index_of(folder: Path, selection: ShardSelection) -> ShardIndex | None:
    """The folder's index.json, or the facts of a Lhotse Shar folder (its field files are
    then sidecars, never shards) or of a NeMo tarred set (from its manifest)."""
    if folder not in selection.indexes:
        listing = selection.listings.get(folder)
        shar = shar_index(folder, selection.skip_bad) if listing is None or listing.cuts else None  # a listing said
        selection.indexes[folder] = shar or ShardIndex.load(folder) or nemo_index(folder)
    return selection.indexes[folder]


def _sidecars_among(folder: Path, names: list[str], selection: ShardSelection) -> set[str]:
    """Those of the files ``names`` of ``folder`` that are field files beside a shard (read
    with their shard, never alone: :func:`is_sidecar`), judged on the folder's index at once
    (the files it lists as shards are not field files), the others one by one."""
    index = _index_of(folder, selection)
    if index is None:
        listed = None
        unknown = names
    else:
        listed = selection.listed_sidecars.get(folder)
        if listed is None:
            listed = selection.listed_sidecars[folder] = index.sidecar_names()  # once a folder
        unlisted = set() if names == index.columns.names else set(names).difference(index.columns.rows())
        unknown = unlisted | (listed.intersection(names) if listed else set())  # the index's names in its order: none
    if not unknown:
        return set()
    fields_folder = folder.parent.name == FIELDS_DIR and FIELD_SET_NAME.fullmatch(folder.name) is not None
    return {
        name
        for name in (names if unknown is names else [name for name in names if name in unknown])  # in order
        if (listed is not None and name in listed)
        or ((fields_folder or _dotted(name)) and is_sidecar(folder / name, index, listed))
    }


def _dotted(name: str) -> bool:
    """Whether ``name`` may be add-field's old ``STEM.NAME.tar`` (``old_layout_sidecar`` decides)."""
    return name.endswith(".tar") and "." in name[: -len(".tar")]


def is_sidecar(path: Path, index: ShardIndex | None, listed: frozenset[str] | None = None) -> bool:
    """Whether ``path`` is a field file of a shard beside it (read with that shard, never as a
    shard), on evidence: its folder's ``index`` lists it as one (not as a shard), it lies in
    add-field's ``fields/NAME/`` beside its shard, or it is named ``STEM.NAME.tar`` beside a
    shard ``STEM.tar`` (add-field's old layout) and holds the same keys in the same order. A
    dotted name alone is no evidence: WebDataset shards ``part.tar`` and ``part.1.tar`` are
    two shards. One taken for a field file that no index lists is named in a warning.
    ``listed``: ``index.sidecar_names()``, when the caller asks about many files of one folder."""
    if index is not None and path.name in (index.sidecar_names() if listed is None else listed):
        return True
    if index is not None and index.entry(path.name) is not None:
        return False
    if in_fields_folder(path):
        return True
    old = old_layout_sidecar(path)
    if old is None or not same_keys(path.parent / old[0], path):
        return False
    _LOG.warning(
        "%s holds the keys of %s in the same order, as add-field's field files did (field set %r), and is read with "
        "it, not as a shard; no index.json lists it (an add-field run that did not finish? run it again, or "
        "`seqshard index --move-sidecars` on the folder)",
        path,
        old[0],
        old[1],
    )
    return True


def _read_list(alternative: Alternative) -> list[MissingShard]:
    """A WeNet shard list stands for the shards it names (those not on disk are returned); a
    raw list of samples is read as one shard."""
    entries = shard_list(alternative.paths[0])
    if entries is None:
        return []
    listed = [Path(entry) for entry in entries]
    alternative.files = grouped(path for path in listed if path.is_file())
    return [
        MissingShard(path, f"named in {alternative.text}, but it does not exist")
        for path in listed
        if not path.is_file()
    ]


def _absent(alternative: Alternative, selection: ShardSelection) -> list[MissingShard]:
    """Shards this alternative names that should exist and do not (those of a folder's index
    or plan that the alternative did not find, each then looked for)."""
    absent = []
    for folder in alternative.folders:
        index = _index_of(folder, selection)
        if index is not None:
            columns = index.columns
            found = alternative.files.get(folder, [])
            unseen = set() if found == columns.names else columns.rows().keys() - set(found)  # not found: missing?
            counts = columns.numbers["num_utts"].tolist() if unseen else []
            expected = {n: c for n, c in zip(columns.names, counts) if n in unseen}
            why = "listed in its folder's index.json, but the file is missing"
            if index.source.get("format") == NEMO_FORMAT:
                why = "its shard id has entries in the folder's NeMo manifest, but the tar is missing"
        else:
            planned = planned_in_folder(folder)
            if planned is None:
                if _unfinished_without_record(folder):
                    absent.append(MissingShard(folder, "written by a pack that has not finished (no index.json)"))
                absent.extend(
                    MissingShard(link, f"a link to {os.readlink(link)}, which does not exist")
                    for link in dangling_shard_links(folder)
                    if alternative.covers(link)
                )
                continue
            expected = planned
            why = "planned by a pack that has not finished writing it (no index.json yet)"
        absent.extend(
            MissingShard(folder / name, why, count)
            for name, count in expected.items()
            if alternative.covers(folder / name) and not (folder / name).is_file()
        )
    if alternative.kind == "file":
        folder = alternative.folders[0]
        found = set(alternative.files.get(folder, ())) | {m.path.name for m in absent if isinstance(m.path, Path)}
        absent.extend(
            MissingShard(folder / name, _not_there(folder / name)) for name in alternative.names if name not in found
        )
    return absent


def _not_there(path: Path) -> str:
    """Why a file a pattern names is not a shard: it does not exist, or it is no regular file."""
    try:
        return f"named in the pattern, but it is {file_kind(os.stat(path).st_mode)}, not a shard file"
    except OSError:
        return "named in the pattern, but it does not exist"


def dangling_shard_links(folder: Path) -> list[Path]:
    """Links named like shards in ``folder`` whose target does not exist (a disk not mounted,
    a copy removed): shards that should be there."""
    if not folder.is_dir():
        return []
    with os.scandir(folder) as entries:  # whether each is a link comes with the listing
        links = [Path(entry.path) for entry in entries if is_shard_name(entry.name) and entry.is_symlink()]
    return sorted(link for link in links if not link.exists())


def _unfinished_without_record(folder: Path) -> bool:
    """A folder of shards without an index, written by a pack that recorded no plan (an older
    seqshard) and has no report: it cannot be told complete."""
    root = pack_root(folder)
    return root is not None and not (root / REPORT_NAME).is_file() and any(folder.glob("*.tar"))
