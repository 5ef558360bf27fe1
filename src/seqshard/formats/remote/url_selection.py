"""Which remote shards a set of patterns selects (the remote half of :mod:`.selection`).

A remote pattern is a URL with braces (always) and globs (where the store can list: s3, gs,
not plain http). An alternative that names a folder (no shard suffix) stands for the shards
of its ``index.json``. Every alternative must select at least one shard. List files
(``.list``, one shard per line, as WeNet's ``data.list``) may mix URLs and local paths.

A selected URL that its folder's index does not list has its size asked of the store now (the
plan needs it); one the store says does not exist is a :class:`~.selection.MissingShard`, as a
named local file that does not exist is. A URL with a query (a signed URL) is a shard without
an index: no ``index.json`` is looked up beside it.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path

from ...checks import parse_json
from ...errors import ConfigError
from ..index import ShardIndex
from ..index_entries import ShardEntry
from ..patterns import expand_braces, is_list_name, is_shard_name, pattern_list
from ..peers.lists import shard_list
from ..selection import MissingShard
from .access import (
    NotOnServer,
    RemoteAccess,
    check_pipes_allowed,
    has_query,
    is_pipe,
    is_remote,
    load_remote_index,
    url_name,
)


@dataclass(frozen=True)
class RemoteShard:
    """A selected remote shard: its URL, its folder's URL and its index entry (if indexed)."""

    url: str
    folder: str
    entry: ShardEntry | None


def split_patterns(patterns) -> tuple[list[str], list[str]]:
    """(local patterns, remote patterns) in their order; a local list file naming URLs gives
    each of its lines as a pattern of its own (local lines resolved against the list's folder)."""
    local: list[str] = []
    remote: list[str] = []
    for pattern in pattern_list(patterns):
        if is_remote(pattern):
            remote.append(pattern)
            continue
        path = Path(pattern)
        listed = (
            shard_list(path) if is_list_name(path.name) and not glob.has_magic(pattern) and path.is_file() else None
        )
        if listed is None or not any(is_remote(entry) for entry in listed):
            local.append(pattern)  # the local selection reads the list (and reports on it)
            continue
        for entry in listed:
            (remote if is_remote(entry) else local).append(entry)
    return local, remote


class RemoteSelection:
    """The remote shards of some patterns, in order, each once; the folders' indexes; the
    selected shards that the store does not have."""

    def __init__(self, patterns: list[str], access: RemoteAccess):
        self.access = access
        self.indexes: dict[str, ShardIndex | None] = {}
        self.shards: list[RemoteShard] = []
        self.missing: list[MissingShard] = []
        seen: set[str] = set()
        for pattern in patterns:
            for text in dict.fromkeys(expand_braces(pattern)):  # counted before they are made
                urls = self._alternative(text)
                if not urls:
                    raise ConfigError(
                        f"{text!r} (from the pattern {pattern!r}) selects no shard. Check the URL, the braces and "
                        "the wildcard; a folder URL needs an index.json listing its shards."
                    )
                for url in urls:
                    if url in seen:
                        continue
                    seen.add(url)
                    if is_pipe(url):  # a command's output: no folder, no index
                        self.shards.append(RemoteShard(url, "pipe:", None))
                        continue
                    folder = url.split("?", 1)[0].rsplit("/", 1)[0]
                    index = None if has_query(url) else self.index_of(folder)
                    entry = index.entry(url_name(url)) if index else None
                    if entry is None:
                        try:
                            access.size(url)
                        except NotOnServer:
                            self.missing.append(MissingShard(url, "named, but the server does not have it"))
                            continue
                    self.shards.append(RemoteShard(url, folder, entry))

    def index_of(self, folder: str) -> ShardIndex | None:
        if folder not in self.indexes:
            self.indexes[folder] = load_remote_index(folder, self.access)
        return self.indexes[folder]

    def _alternative(self, text: str) -> list[str]:
        if is_pipe(text):
            check_pipes_allowed(text, self.access.allow_pipes)
            return [text]
        name = url_name(text)
        if glob.has_magic(text.split("?", 1)[0].split("://", 1)[1]):
            if text.startswith(("http://", "https://")):
                raise ConfigError(
                    f"{text}: an http server cannot be listed, so wildcards do not work there; use braces "
                    "({00000..00099}), the folder's URL (its index.json lists the shards) or a .list file."
                )
            return [url for url in self.access.glob(text) if is_shard_name(url.rsplit("/", 1)[-1])]
        if is_shard_name(name) or has_query(text):
            return [text]
        folder = text.rstrip("/")
        index = self.index_of(folder)
        if index is None:  # the top folder of a pack with length groups: its groups' folders
            groups = self._pack_groups(folder)
            return [url for group in groups for url in self._alternative(f"{folder}/{group}/")]
        sidecars = index.sidecar_names()
        return [f"{folder}/{name}" for name in index.columns.names if name not in sidecars]

    def _pack_groups(self, folder: str) -> list[str]:
        """The length groups' folders that ``folder``'s pack_report.json names (none without one)."""
        url = f"{folder}/pack_report.json"
        text = self.access.read_text(url)
        fix = "upload the pack's pack_report.json again (or name the groups' folders)."
        groups = parse_json(text, url, fix, kind=dict).get("groups", {}) if text else {}
        return [name for name in groups if isinstance(name, str) and name and "/" not in name and name != ".."]
