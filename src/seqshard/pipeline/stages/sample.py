"""The one sample model every stage works on: a key and named fields, and where it was read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...errors import Where


@dataclass
class Sample:
    """One example on its way to a batch.

    ``fields`` maps a field name to its value: as read, a member suffix (``feats.npy``) to its
    bytes; after decoding, a field name (``feats``) to its value (an array, a text, ...).
    ``shard``, ``ordinal`` (position in the shard) and ``offsets`` (byte offset of its first
    member in each field file read, by field set) say where it came from: an elastic resume
    re-reads a sample from there. Stages may change ``fields``; they keep the origin.
    """

    key: str
    fields: dict[str, Any] = field(default_factory=dict)
    shard: int = -1
    ordinal: int = -1
    offsets: tuple[tuple[str, int], ...] = ()
    file: str = ""  # the shard file it was read from, for messages
    stream: int = 0  # which source of a mix (seqshard.mux) it came from
    pass_number: int = -1  # which pass of an endless stream read it (-1: an epoch that ends)

    def where(self) -> Where:
        """Where the sample came from, for an error about it: shard file, position and key."""
        shard = self.file or f"shard {self.shard}"
        return Where(f"{shard} sample {self.ordinal + 1}", None, self.key)  # counted from 1, as lines

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    def __contains__(self, name: str) -> bool:
        return name in self.fields
