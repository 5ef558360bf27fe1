"""Reading a tar shard by its member table (``members.py``): each sample's members are slices
of the memory map, found without parsing a header.

The stream checks the table against the file as it goes: its size at opening; before a
block's first sample, the block's header bytes (the table's CRC-32 of them) and what they say
(each member's name and size, one member after the other, read from the headers in numpy;
headers this quick check does not read, such as pax or long names, by a walk over the block's
headers); the end-of-archive block at the end. So a table whose keys or sizes were changed
never serves one utterance's bytes under another key. Where table and file disagree the
stream goes on by parsing the headers from the sample it stands at, as a shard without a
table is read, so that damage is reported where and as the headers show it (a truncated
member, a bad header checksum, another first key than the index records); a shard whose
headers read cleanly is read whole, and its table counted as damaged (``mismatch``).
"""

from __future__ import annotations

import logging

import numpy as np

from ..errors import ShardError
from ..protocol import Closing
from . import tar
from .members import CHECK_EVERY, REBUILD, MemberTable, table_path
from .remote.access import RemoteAccess
from .tar import BLOCK, MappedBytes, SampleStream, TarRecord

_LOG = logging.getLogger("seqshard")
_ZERO_BLOCK = bytes(BLOCK)
_WARNED: set[str] = set()  # shards whose damaged table this process has warned about


class SlicedSampleStream(Closing):
    """The samples of a local tar ``path`` from byte ``start`` (sample ``ordinal``), sliced by
    ``table``; the interface of :class:`seqshard.formats.tar.SampleStream` (``access`` reads
    the file ahead, with ``read_ahead`` and ``read_data``)."""

    def __init__(
        self,
        path: str,
        table: MemberTable,
        start: int = 0,
        ordinal: int = 0,
        read_data: bool = True,
        read_ahead: bool = True,
        access: RemoteAccess | None = None,
    ):
        self.path = path
        self.ordinal = ordinal
        self.ended_cleanly = False
        self.mismatch: str | None = None  # why the file and its table disagree, once found
        self._table = table
        self._read_data = read_data
        self._headers: SampleStream | None = None  # reading by headers, after a disagreement
        self._opening = (read_ahead, access)  # for reading by headers
        self._file: MappedBytes = tar._open_for_reading(path, read_ahead and read_data, access)
        self._offsets: list[int] = table.sample_offsets.tolist()
        self._next = 0
        if self._file.size != table.file_size:
            self._disagree(f"it has {self._file.size} bytes where its member table says {table.file_size}", start)
            return
        located = self._locate(start)
        if located is None:
            self._disagree(f"its member table has no sample starting at byte {start}", start)
            return
        self._next = located
        self._checked_until = located - located % CHECK_EVERY
        self._keys = table.keys
        self._first: list[int] = table.first_member.tolist()
        self._data: list[int] = table.data_offsets.tolist()
        self._ends: list[int] = (table.data_offsets + table.sizes).tolist()
        self._names = [table.suffixes[i] for i in table.suffix_ids.tolist()]

    def _locate(self, start: int) -> int | None:
        """The number of the sample whose first header is at ``start`` (0 for 0), or None."""
        if start == 0:
            return 0
        found = int(np.searchsorted(self._table.sample_offsets, start))
        return found if found < len(self._offsets) and self._offsets[found] == start else None

    @property
    def resume_offset(self) -> int:
        if self._headers is not None:
            return self._headers.resume_offset
        return self._offsets[self._next]

    def close(self) -> None:
        if self._headers is not None:
            self._headers.close()
        self._file.close()

    def next_sample(self) -> TarRecord | None:
        """The next sample, or None at the end of the shard."""
        if self._headers is not None:
            return self._next_by_headers()
        number = self._next
        if number >= self._checked_until:
            if number >= self._table.num_samples:
                return self._end()
            if not self._check_block(number // CHECK_EVERY):
                return self._next_by_headers()
        first, stop = self._first[number], self._first[number + 1]
        if self._read_data:
            low = self._data[first]
            view = self._file.view(low, self._ends[stop - 1])
            fields = {self._names[m]: view[self._data[m] - low : self._ends[m] - low] for m in range(first, stop)}
        else:
            fields = dict.fromkeys(self._names[first:stop], b"")
        record = TarRecord(self._keys[number], fields, self._offsets[number], self.ordinal)
        self._next = number + 1
        self.ordinal += 1
        return record

    def _check_block(self, block: int) -> bool:
        """Whether block ``block``'s header bytes are those its table describes and name and
        size its members as the table does (else the stream turns to its headers)."""
        table = self._table
        low, high = table.block_span(block)
        view = self._file.view(low, high)
        if table.block_crc(block, view, low) != int(table.header_crcs[block]):
            self._disagree(
                f"the headers of its samples from number {block * CHECK_EVERY + 1} differ from its member table"
            )
            return False
        if not table.headers_agree(block, view, low) and not self._walk_agrees(block):
            self._disagree(
                f"its member table names or sizes its samples from number {block * CHECK_EVERY + 1} otherwise than "
                "their tar headers do"
            )
            return False
        self._checked_until = min((block + 1) * CHECK_EVERY, table.num_samples)
        return True

    def _walk_agrees(self, block: int) -> bool:
        """Whether a walk over block ``block``'s headers finds the samples and members its table
        lists (for headers the table's quick check does not read: pax, long names, ...)."""
        low, high, _, _ = self._table.block_members(block)
        headers = self._table.header_offsets
        try:
            start = (
                self._offsets[low] if low else 0
            )  # from the file's start: nothing before the first sample is skipped
            with SampleStream(self.path, start, read_data=False, read_ahead=False, where=True) as walk:
                for number in range(low, high):
                    record = walk.next_sample()
                    members = range(self._first[number], self._first[number + 1])
                    expected = [
                        (self._names[m], int(headers[m]), self._data[m], self._ends[m] - self._data[m]) for m in members
                    ]
                    if record is None or (record.key, record.offset, record.members) != (
                        self._keys[number],
                        self._offsets[number],
                        expected,
                    ):
                        return False
                return walk.resume_offset == self._offsets[high]
        except ShardError:
            return False

    def _end(self) -> None:
        end = self._table.end
        if bytes(self._file.view(end, end + BLOCK)) == _ZERO_BLOCK:
            self.ended_cleanly = True
            return None
        self._disagree(f"its member table says its samples end at byte {end}, where it has no end-of-archive block")
        return self._next_by_headers()

    def _disagree(self, problem: str, start: int | None = None) -> None:
        """Read on by parsing headers from ``start`` (the current sample's offset): the table
        is damaged (``mismatch`` says how; warned about once per table and process)."""
        self.mismatch = (
            f"{problem} ({table_path(self.path)}): the table is damaged, or the shard was changed after it was made; "
            f"the shard is read by its tar headers instead. {REBUILD}"
        )
        if self.path not in _WARNED:
            _WARNED.add(self.path)
            _LOG.warning("%s: %s", self.path, self.mismatch)
        if start is None:  # where the samples read so far end (verified), or the file's start
            start = self._offsets[self._next] if self._next else 0
        self._headers = SampleStream(self.path, start, self.ordinal, self._read_data, *self._opening)

    def _next_by_headers(self) -> TarRecord | None:
        assert self._headers is not None
        record = self._headers.next_sample()
        self.ordinal = self._headers.ordinal
        self.ended_cleanly = self._headers.ended_cleanly
        return record
