"""Shard patterns as users write them: brace and glob, several at once.

``data/{10_1000,1000_2000}/data-*.tar`` and ``data/10_1000/data-0000{0..9}.tar`` behave as in
seed 01's ``trset``: braces expand first (bash-style, with ``{a..b}`` ranges), then each
alternative is a folder (its shards and its sub-folders' shards), a glob, or a file. A
folder's ``fields/`` sub-folder is not one of its sub-folders of shards: it holds the sidecar
field files of ``add-field`` (``fields/NAME/data-00042.tar``), read with their shards only.
This module only looks at the file system; :mod:`seqshard.formats.selection` checks the
result against the folders' indexes and refuses an alternative that selects nothing.
"""

from __future__ import annotations

import glob
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
MANIFEST_SUFFIXES = (".json", ".jsonl")  # NeMo manifests, read directly (see formats/peers/nemo.py)
LIST_SUFFIXES = (".list", ".scp", *MANIFEST_SUFFIXES)  # and WeNet lists and Kaldi wav.scp (formats/peers/lists.py)
FIELD_SET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_]*")  # names of sidecar field sets
INDEX_NAME = "index.json"  # a folder's index (formats/index.py)
FIELDS_DIR = "fields"  # FOLDER/fields/NAME/data-00042.tar: field set NAME of FOLDER/data-00042.tar
SHAR_CUTS = re.compile(r"cuts(?P<id>(?:\.[^.]+)*?)\.jsonl(?:\.gz)?")  # a Lhotse Shar shard (formats/peers/shar.py)

Patterns = str | Path | Sequence[str | Path]


def is_list_name(name: str) -> bool:
    return name.endswith(LIST_SUFFIXES) and not _is_index(name)


def is_manifest_name(name: str) -> bool:
    return name.endswith(MANIFEST_SUFFIXES) and not _is_index(name)


def _is_index(name: str) -> bool:
    return name.rsplit("/", 1)[-1] == INDEX_NAME


def is_shard_name(name: str) -> bool:
    """Whether a file name is that of a shard: a tar suffix (or a Lhotse Shar folder's
    ``cuts.000000.jsonl.gz``) and not hidden (partial files are)."""
    return (name.endswith(SHARD_SUFFIXES) or SHAR_CUTS.fullmatch(name) is not None) and not name.startswith(".")


@dataclass
class Alternative:
    """One brace alternative of a pattern and what it names on disk.

    ``kind`` is ``"folder"``, ``"glob"``, ``"file"`` or ``"list"`` (a WeNet list file, which
    :mod:`~.selection` reads). ``files`` are the shard files found (a
    glob's other matches, such as ``index.json``, are not shards); ``folders`` are the folders
    it covers, whose indexes may list shards that should be there.
    """

    text: str
    kind: str
    files: list[Path] = field(default_factory=list)
    folders: list[Path] = field(default_factory=list)

    def covers(self, path: Path) -> bool:
        """Whether a shard at ``path`` would be named by this alternative if it existed."""
        if self.kind == "folder":
            return path.parent in self.folders
        if self.kind == "file":
            return path == Path(self.text)
        return path.parent in self.folders and Path(path).match(Path(self.text).name)


def pattern_list(patterns: Patterns) -> list[str]:
    """The patterns as a list of strings (one pattern may be given alone)."""
    items = [patterns] if isinstance(patterns, (str, Path)) else list(patterns)
    if not items or any(not str(item).strip() for item in items):
        raise ConfigError(f"no shard pattern given (got {patterns!r}).")
    return [str(item) for item in items]


def expand_pattern(pattern: str) -> list[Alternative]:
    """Every brace alternative of ``pattern`` (NeMo's ``_OP_``/``_CL_`` are braces too), each
    with the shard files it names."""
    from braceexpand import braceexpand

    return [_alternative(text) for text in dict.fromkeys(braceexpand(nemo_braces(pattern)))]


def nemo_braces(pattern: str) -> str:
    """``pattern`` with NeMo's brace tags ``_OP_`` and ``_CL_`` (its sharded manifests and tars:
    ``audio__OP_0..127_CL_.tar``) as ``{`` and ``}``."""
    return pattern.replace("_OP_", "{").replace("_CL_", "}")


def _alternative(text: str) -> Alternative:
    path = Path(text)
    if glob.has_magic(text):
        parent = str(path.parent)
        folders = [Path(p) for p in sorted(glob.glob(parent))] if glob.has_magic(parent) else [path.parent]
        matches = [Path(p) for p in sorted(glob.glob(text))]
        files = [p for p in matches if is_shard_name(p.name) and p.is_file()]
        for folder in (p for p in matches if p.is_dir() and p.name != FIELDS_DIR):  # a folder stands for its shards
            inner = _alternative(str(folder))
            files.extend(inner.files)
            folders.extend(inner.folders)
        return Alternative(text, "glob", files, [f for f in dict.fromkeys(folders) if f.is_dir()])
    if path.is_dir():
        folders = [path, *shard_subfolders(path)]
        return Alternative(text, "folder", [f for folder in folders for f in shards_in_folder(folder)], folders)
    files = [path] if path.is_file() else []
    if files and is_list_name(path.name):
        return Alternative(text, "list", files, [path.parent])
    if files and not is_shard_name(path.name):
        raise ConfigError(
            f"{text} is not a shard (shards end in {', '.join(SHARD_SUFFIXES)}; lists of shards or samples in .list)."
        )
    return Alternative(text, "file", files, [path.parent])


def shard_subfolders(folder: Path) -> list[Path]:
    """The sub-folders of ``folder`` that may hold shards (length groups), sorted: not hidden
    ones, and not its ``fields/`` folder of sidecars."""
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != FIELDS_DIR)


def shard_stem(shard_name: str) -> str:
    """A shard's name without its tar suffix (``data-00042.tar.gz`` -> ``data-00042``)."""
    for suffix in SHARD_SUFFIXES:
        if shard_name.endswith(suffix):
            return shard_name[: -len(suffix)]
    return shard_name


def _shard_beside(folder: Path, stem: str) -> str | None:
    """The name of the shard ``STEM.tar`` (or ``.tar.gz``, ``.tgz``) in ``folder``, if any."""
    return next((f"{stem}{suffix}" for suffix in SHARD_SUFFIXES if (folder / f"{stem}{suffix}").is_file()), None)


def old_layout_sidecar(path: Path) -> tuple[str, str] | None:
    """``(shard name, field set)`` of ``STEM.NAME.tar`` beside a shard ``STEM.tar``, named as
    ``add-field`` named sidecars before ``fields/NAME/`` (``seqshard index --move-sidecars``
    moves them). A name is no evidence by itself: ``selection.is_sidecar`` decides."""
    if not path.name.endswith(".tar"):
        return None
    base, dot, name = path.name[: -len(".tar")].rpartition(".")
    if not dot or not FIELD_SET_NAME.fullmatch(name):
        return None
    shard = _shard_beside(path.parent, base)
    return None if shard is None else (shard, name)


def in_fields_folder(path: Path) -> bool:
    """Whether ``path`` is ``FOLDER/fields/NAME/STEM.tar`` beside a shard ``FOLDER/STEM.tar``:
    a field file of ``add-field`` (one written before its index entry, by a run that was
    killed, is still not a shard). Files named like the old layout, ``STEM.NAME.tar``, need
    more evidence (``selection.is_sidecar``): WebDataset shards are often named ``part.1.tar``."""
    fields = path.parent.parent
    in_fields = fields.name == FIELDS_DIR and bool(FIELD_SET_NAME.fullmatch(path.parent.name))
    return in_fields and path.name.endswith(".tar") and _shard_beside(fields.parent, shard_stem(path.name)) is not None


def shards_in_folder(folder: Path) -> list[Path]:
    """Shard files directly inside ``folder`` (hidden partial files excluded), sorted."""
    return sorted(p for p in folder.iterdir() if p.is_file() and is_shard_name(p.name))
