"""Shard patterns as users write them: brace and glob, several at once.

``data/{10_1000,1000_2000}/data-*.tar`` and ``data/10_1000/data-0000{0..9}.tar`` behave as in
seed 01's ``trset``: braces expand first (bash-style, with ``{a..b}`` ranges), then each
alternative is a folder (its shards and its sub-folders' shards), a glob, or a file. A
folder's ``fields/`` sub-folder is not one of its sub-folders of shards: it holds the sidecar
field files of ``add-field`` (``fields/NAME/data-00042.tar``), read with their shards only.
This module only looks at the file system; :mod:`seqshard.formats.selection` checks the
result against the folders' indexes and refuses an alternative that selects nothing.

Braces are expanded as bash and ``braceexpand`` expand them, one alternative at a time, after
counting them: a pattern of more than :data:`MAX_ALTERNATIVES` is refused by name before any is
made, and names of files in one folder are looked up with one listing of it when they are
many. NeMo's ``_OP_``/``_CL_`` are braces; NeMo's other spellings (``(…)``, ``[…]``, ``<…>``,
see :func:`nemo_braces`) are refused by name where NeMo would expand them and seqshard's
reading names nothing, or a ``[…]`` (a wildcard here) holds ``..`` or ``,``.
"""

from __future__ import annotations

import functools
import glob
import itertools
import math
import os
import re
import string
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
MANIFEST_SUFFIXES = (".json", ".jsonl")  # NeMo manifests, read directly (see formats/peers/nemo.py)
LIST_SUFFIXES = (".list", ".scp", *MANIFEST_SUFFIXES)  # and WeNet lists and Kaldi wav.scp (formats/peers/lists.py)
FIELD_SET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_]*")  # names of sidecar field sets
INDEX_NAME = "index.json"  # a folder's index (formats/index.py)
INDEX_TABLE_NAME = "index.npz"  # its shards as arrays, beside it (formats/index_table.py)
FIELDS_DIR = "fields"  # FOLDER/fields/NAME/data-00042.tar: field set NAME of FOLDER/data-00042.tar
SHAR_CUTS = re.compile(r"cuts(?P<id>(?:\.[^.]+)*?)\.jsonl(?:\.gz)?")  # a Lhotse Shar shard (formats/peers/shar.py)

Patterns = str | Path | Sequence[str | Path]
MAX_ALTERNATIVES = 2_000_000  # brace alternatives of one pattern (corpora of 5e5 shards are named by one)
LISTED = 256  # more names than this in one folder: the folder is listed once, not each name looked up
NEMO_BRACES = (("(", "[", "<", "_OP_"), (")", "]", ">", "_CL_"))  # NeMo's spellings of { and }
_INT_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?$")  # bash's (and braceexpand's) ranges
_CHAR_RANGE = re.compile(r"^([A-Za-z])\.\.([A-Za-z])(?:\.\.-?(\d+))?$")
_LETTERS = string.ascii_uppercase + string.ascii_lowercase
_ESCAPED = re.compile(r"\\(.)")
_NEMO_RANGE_IN_BRACKETS = re.compile(r"\[[^\]]*(?:,|\.\.)[^\]]*\]")  # [0..9], [a,b]: NeMo's braces, not a wildcard


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
    :mod:`~.selection` reads). ``files`` are the shard files found, by folder: their names, in
    order (a glob's other matches, such as ``index.json``, are not shards; names, not a path
    object a shard: a folder may hold 500,000); ``links``, for a folder whose listing said which
    of them are symbolic links, those names (a folder not there: not known). ``folders`` are
    the folders it covers, whose indexes may list shards that should be there. A ``"file"``
    alternative stands for the files ``names`` of its one folder (alternatives named one after
    another), whether they exist or not.
    """

    text: str
    kind: str
    files: dict[Path, list[str]] = field(default_factory=dict)
    folders: list[Path] = field(default_factory=list)
    names: dict[str, None] = field(default_factory=dict)  # in order
    links: dict[Path, frozenset[str]] = field(default_factory=dict)
    listings: dict[Path, Listing] = field(default_factory=dict)  # of the folders it listed whole

    @property
    def paths(self) -> list[Path]:
        """The shard files found, as paths."""
        return [folder / name for folder, names in self.files.items() for name in names]

    def covers(self, path: Path) -> bool:
        """Whether a shard at ``path`` would be named by this alternative if it existed."""
        if self.kind == "folder":
            return path.parent in self.folders
        if self.kind == "file":
            return path.parent in self.folders and path.name in self.names
        return path.parent in self.folders and Path(path).match(Path(self.text).name)


def pattern_list(patterns: Patterns) -> list[str]:
    """The patterns as a list of strings (one pattern may be given alone)."""
    items = [patterns] if isinstance(patterns, (str, Path)) else list(patterns)
    if not items or any(not str(item).strip() for item in items):
        raise ConfigError(f"no shard pattern given (got {patterns!r}).")
    return [str(item) for item in items]


def expand_pattern(pattern: str) -> list[Alternative]:
    """Every brace alternative of ``pattern`` (NeMo's ``_OP_``/``_CL_`` are braces too), each
    with the shard files it names; files named one after another in one folder are one
    ``"file"`` alternative."""
    text = pattern.replace("_OP_", "{").replace("_CL_", "}")
    alternatives: list[Alternative] = []
    for magic, run in itertools.groupby(expand_braces(text), glob.has_magic):
        if magic:
            alternatives.extend(_alternative(alternative) for alternative in run)
            continue
        for folder, in_folder in itertools.groupby(run, os.path.dirname):
            alternatives.extend(_named_in(folder, [os.path.basename(t) for t in in_folder]))
    _refuse_nemo_brackets(pattern, text, alternatives)
    return alternatives


def _named_in(folder: str, names: list[str]) -> Iterator[Alternative]:
    """The alternatives of paths without wildcards in one folder: each folder and list its
    own, shard files and names of nothing together (in order)."""
    base = Path(folder or ".")
    files: list[str] = []
    named: dict[str, None] = {}
    listed = _listed_kinds(base, names) if len(names) > LISTED else None
    known = {base: listed[1]} if listed is not None else {}  # the listing said which are links
    for name, kind in zip(names, listed[0] if listed is not None else [_kind(base / n) for n in names]):
        text = os.path.join(folder, name)
        if kind == "folder" or (kind == "file" and is_list_name(name)):
            if named:
                yield Alternative(
                    os.path.join(folder, next(iter(named))), "file", _of(base, files), [base], named, known
                )
                files, named = [], {}
            yield _alternative(text)
        elif kind == "file" and not is_shard_name(name):
            raise ConfigError(
                f"{text} is not a shard (shards end in {', '.join(SHARD_SUFFIXES)}; lists of shards or samples in .list)."
            )
        elif name not in named:
            named[name] = None
            files += [name] if kind == "file" else []
    if named:
        yield Alternative(os.path.join(folder, next(iter(named))), "file", _of(base, files), [base], named, known)


def kinds_in_folder(folder: Path, names: Sequence[str]) -> list[str | None]:
    """For each of ``names`` in ``folder``: ``"folder"``, ``"file"`` or None (nothing, or
    neither), links followed; more than :data:`LISTED` names are answered by one listing."""
    listed = _listed_kinds(folder, names) if len(names) > LISTED else None
    return listed[0] if listed is not None else [_kind(folder / name) for name in names]


def _listed_kinds(folder: Path, names: Sequence[str]) -> tuple[list[str | None], frozenset[str]] | None:
    """What :func:`kinds_in_folder` says of ``names``, from one listing of ``folder``, and
    which of them are symbolic links; None when the folder cannot be listed."""
    wanted, found, links = set(names), {}, set()
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name in wanted:
                    found[entry.name] = _kind(entry)
                    if entry.is_symlink():
                        links.add(entry.name)
    except OSError:  # not a folder, or not listable: each name is looked up
        return None
    return [found.get(name) if name not in ("", ".", "..") else _kind(folder / name) for name in names], frozenset(
        links
    )


def _kind(path: os.DirEntry | Path) -> str | None:
    return "folder" if path.is_dir() else "file" if path.is_file() else None


def expand_braces(pattern: str, escape: bool = True) -> Iterator[str]:
    """The brace alternatives of ``pattern`` as bash (and ``braceexpand``) makes them: ranges
    ``{1..10}``, ``{01..10}``, ``{a..e..2}``, lists ``{a,b}``, nested; with ``escape``, ``\\{``
    is a brace itself. Made one at a time, after counting them: ConfigError for unbalanced
    braces or more than :data:`MAX_ALTERNATIVES`, before any is made."""
    try:
        parts = _parse(pattern, escape)
    except _Unbalanced:
        raise ConfigError(f"the pattern {pattern[:200]!r} has unbalanced braces: close each {{ with }}.") from None
    except RecursionError:
        raise ConfigError(f"the pattern {pattern[:200]!r} nests braces too deeply.") from None
    except ValueError:  # a range's end of thousands of digits
        raise ConfigError(f"the pattern {pattern[:200]!r} has a range with an end too long to be a number.") from None
    count = _count(parts)
    if count > MAX_ALTERNATIVES:
        many = f"{count:,}" if count < 10**15 else "more than 10^15"
        raise ConfigError(
            f"the pattern {pattern[:200]!r} expands to {many} alternatives, more than the {MAX_ALTERNATIVES:,} seqshard "
            "expands. Fix: name the folder that holds the files (all its shards are read), a wildcard "
            "(data-*.tar), or a list file of them."
        )
    if not (escape and "\\" in pattern):
        return _strings(parts)
    unescape = functools.partial(_ESCAPED.sub, r"\1")
    return map(unescape, _strings(parts, 0, unescape))


def nemo_braces(pattern: str) -> str:
    """``pattern`` as NeMo's ``expand_sharded_filepaths`` reads it before expanding its braces
    (with ``escape=False``): ``(``, ``[``, ``<`` and ``_OP_`` are ``{``; ``)``, ``]``, ``>``
    and ``_CL_`` are ``}`` (``audio__OP_0..127_CL_.tar``, ``manifest_(0..127).json``)."""
    for brace, spellings in zip("{}", NEMO_BRACES):
        for spelling in spellings:
            pattern = pattern.replace(spelling, brace)
    return pattern


def _refuse_nemo_brackets(pattern: str, text: str, alternatives: list[Alternative]) -> None:
    """ConfigError for a pattern that NeMo would expand into more alternatives than seqshard
    (NeMo's ``(…)``, ``[…]`` or ``<…>`` braces), when its ``[…]`` hold ``..`` or ``,`` (a
    wildcard would pick some of NeMo's files) or its ``alternatives`` name nothing that
    exists (a name may hold brackets)."""
    if not any(bracket in pattern for bracket in "([<"):
        return
    nemo = nemo_braces(pattern)
    try:
        more = _count(_parse(nemo, escape=False)) > _count(_parse(text, escape=True))
    except (ValueError, RecursionError):  # not NeMo's braces either (_Unbalanced is a ValueError)
        return
    named = any(a.files or a.kind in ("folder", "list") for a in alternatives)  # files: only folders with some
    if more and (_NEMO_RANGE_IN_BRACKETS.search(pattern) or not named):
        raise ConfigError(
            f"the pattern {pattern!r} holds NeMo's spelling of braces: NeMo reads (…), […] and <…> as {{…}} "
            f"({nemo!r}), seqshard reads […] as a wildcard and (…) and <…> as part of a name. Fix: write braces "
            f"({nemo!r}; _OP_ and _CL_ are braces too)."
        )


class _Unbalanced(ValueError):
    """Braces that do not close."""


class _Choice(list):
    """A brace list: its alternatives, each a parsed pattern (a list of parts)."""


class _IntRange:
    """A range ``{first..last..step}`` as braceexpand makes it (zero-padded when an end is)."""

    def __init__(self, first: str, last: str, step: str | None):
        padded = any(n.startswith(("0", "-0")) for n in (first, last) if n not in ("0", "-0"))
        self.format = f"%0{max(len(first), len(last)) if padded else 0}d"
        by = (int(step) or 1) if step else 1
        start, end = int(first), int(last)
        self.numbers = range(start, end + 1, by) if start < end else range(start, end - 1, -by)

    def __len__(self) -> int:
        return len(self.numbers)

    def __iter__(self) -> Iterator[str]:
        return map(self.format.__mod__, self.numbers)


def _parse(pattern: str, escape: bool) -> list:
    """``pattern`` as parts whose values are concatenated: a list of literal text, a range
    (``_IntRange``, or a string of letters) or a :class:`_Choice` (braceexpand's grammar)."""
    parts: list = []
    start = depth = position = 0
    while position < len(pattern):
        if escape and pattern[position] == "\\":
            position += 2
            continue
        if pattern[position] == "{":
            if depth == 0 and position > start:
                parts.append([pattern[start:position]])
                start = position
            depth += 1
        elif pattern[position] == "}":
            depth -= 1
            if depth == 0:
                inner = pattern[start + 1 : position]
                expression = _expression(inner, escape)
                parts += [["{"], _Choice([_parse(inner, escape)]), ["}"]] if expression is None else [expression]
                start = position + 1
        position += 1
    if depth != 0:
        raise _Unbalanced(pattern)
    if start < position:
        parts.append([pattern[start:]])
    return parts


def _expression(text: str, escape: bool) -> _IntRange | str | _Choice | None:
    """What ``{text}`` stands for: a range, a list, or None (the braces are text)."""
    if match := _INT_RANGE.match(text):
        return _IntRange(*match.groups())
    if match := _CHAR_RANGE.match(text):
        first, last = _LETTERS.index(match[1]), _LETTERS.index(match[2])
        by = (int(match[3]) or 1) if match[3] else 1
        return _LETTERS[first : last + 1 : by] if first < last else _LETTERS[first : (last or -len(_LETTERS)) - 1 : -by]
    items, start, depth, position = [], 0, 0, 0
    while position < len(text):
        char = text[position]
        if escape and char == "\\":
            position += 2
            continue
        depth += (char == "{") - (char == "}")
        if char == "," and depth == 0:
            items.append(_parse(text[start:position], escape))
            start = position + 1
        position += 1
    if depth != 0 or not items:
        return None
    return _Choice([*items, _parse(text[start:], escape)])


def _count(parts: list) -> int:
    return math.prod(sum(map(_count, part)) if isinstance(part, _Choice) else len(part) for part in parts)


def _strings(parts: list, at: int = 0, unescape: Callable[[str], str] | None = None) -> Iterator[str]:
    """The alternatives of ``parts[at:]``, in bash's order; ``unescape`` is applied to each
    value of a brace list, as braceexpand does (at each level it is nested in)."""
    if at == len(parts):
        yield ""
        return
    values: Iterable[str] = parts[at]
    if isinstance(values, _Choice):
        values = itertools.chain.from_iterable(_strings(choice, 0, unescape) for choice in values)
        values = values if unescape is None else map(unescape, values)
    if _count(parts[at + 1 :]) == 1:  # the rest is one text: no generator for each value
        rest = next(_strings(parts, at + 1, unescape))
        yield from (value + rest for value in values)
        return
    for value in values:
        yield from (value + rest for rest in _strings(parts, at + 1, unescape))


def _alternative(text: str) -> Alternative:
    path = Path(text)
    if glob.has_magic(text):
        parent = str(path.parent)
        folders = [Path(p) for p in sorted(glob.glob(parent))] if glob.has_magic(parent) else [path.parent]
        matches = [Path(p) for p in sorted(glob.glob(text))]
        files = grouped(p for p in matches if is_shard_name(p.name) and p.is_file())
        links: dict[Path, frozenset[str]] = {}  # of the folders listed whole (those of files matched: not known)
        listings: dict[Path, Listing] = {}
        for folder in (p for p in matches if p.is_dir() and p.name != FIELDS_DIR):  # a folder stands for its shards
            inner = _alternative(str(folder))
            for place, names in inner.files.items():
                links.update({place: inner.links[place]} if place not in files else {})
                files.setdefault(place, []).extend(names)
            folders.extend(inner.folders)
            listings.update(inner.listings)
        found = [f for f in dict.fromkeys(folders) if f.is_dir()]
        return Alternative(text, "glob", files, found, links=links, listings=listings)
    if path.is_dir():
        top = list_folder(path)
        listings = [(path, top), *((sub, list_folder(sub)) for sub in (path / name for name in top.folders))]
        files = {folder: listing.shards for folder, listing in listings if listing.shards}
        links = {folder: listing.links for folder, listing in listings}
        return Alternative(
            text, "folder", files, [folder for folder, _ in listings], links=links, listings=dict(listings)
        )
    files = {path.parent: [path.name]} if path.is_file() else {}
    if files and is_list_name(path.name):
        return Alternative(text, "list", files, [path.parent])
    if files and not is_shard_name(path.name):
        raise ConfigError(
            f"{text} is not a shard (shards end in {', '.join(SHARD_SUFFIXES)}; lists of shards or samples in .list)."
        )
    return Alternative(text, "file", files, [path.parent])


def _of(folder: Path, names: list[str]) -> dict[Path, list[str]]:
    return {folder: names} if names else {}


def grouped(paths: Iterable[Path]) -> dict[Path, list[str]]:
    """The names of ``paths`` by folder, in order."""
    found: dict[Path, list[str]] = {}
    for path in paths:
        found.setdefault(path.parent, []).append(path.name)
    return found


def shard_subfolders(folder: Path) -> list[Path]:
    """The sub-folders of ``folder`` that may hold shards (length groups), sorted: not hidden
    ones, and not its ``fields/`` folder of sidecars."""
    return [folder / name for name in list_folder(folder).folders]


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
    return [folder / name for name in list_folder(folder).shards]


@dataclass(frozen=True)
class Listing:
    """What one listing of a folder says: its shard files (``links``: those of them that are
    symbolic links), the sub-folders that may hold shards (:func:`shard_subfolders`), each
    sorted by name, and whether any name is a Lhotse Shar cuts file's (``cuts``)."""

    shards: list[str]
    links: frozenset[str]
    folders: list[str]
    cuts: bool = False


def list_folder(folder: Path) -> Listing:
    """``folder`` listed once: a folder of 500,000 shards costs a listing, not a system call a
    shard (an entry's kind comes with the listing; names sort as strings)."""
    shards: list[str] = []
    links: list[str] = []
    folders: list[str] = []
    cuts = False
    append = shards.append
    with os.scandir(folder) as listing:
        for entry in listing:
            name = entry.name
            if name.endswith(SHARD_SUFFIXES) and entry.is_file(follow_symlinks=False) and name[0] != ".":
                append(name)  # a shard file, not a link: nearly every one
                continue
            cuts = cuts or _is_cuts(name)
            if is_shard_name(name) and entry.is_file():
                append(name)
                if entry.is_symlink():
                    links.append(name)
            elif entry.is_dir() and not name.startswith(".") and name != FIELDS_DIR:
                folders.append(name)
    shards.sort()
    return Listing(shards, frozenset(links), sorted(folders), cuts)


def _is_cuts(name: str) -> bool:
    """Whether ``name`` is a Lhotse Shar cuts file's (not hidden)."""
    return SHAR_CUTS.fullmatch(name) is not None and not name.startswith(".")
