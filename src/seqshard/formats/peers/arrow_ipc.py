"""What the messages of an Arrow IPC stream declare, read from their flatbuffer headers before
pyarrow reads a batch: its rows, and the bytes its buffers take once decompressed (a stream
written with IPC body compression, LZ4 or ZSTD, inflates when a batch is read: a few kB may
declare a GB). Only the fields needed are read (``Message.header``, ``RecordBatch.length``,
``.buffers``, ``.compression``; ``DictionaryBatch.data``), each bounds-checked.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

DICTIONARY_BATCH, RECORD_BATCH = 2, 3  # Message.header_type (the MessageHeader union)
NOT_COMPRESSED = -1  # a compressed body's buffer stored as it is: its length prefix says so


class DamagedMessage(ValueError):
    """A message header that points outside itself or lacks what its type needs."""


class _Table:
    """A flatbuffer table of ``data`` at ``position``; every read is bounds-checked."""

    def __init__(self, data: memoryview, position: int):
        self.data, self.position = data, position
        self.vtable = position - _read(data, "<i", position)
        self.vtable_size = _read(data, "<H", self.vtable)

    def _field(self, number: int) -> int:
        at = 4 + 2 * number
        return _read(self.data, "<H", self.vtable + at) if at < self.vtable_size else 0

    def scalar(self, number: int, kind: str) -> int:
        offset = self._field(number)
        return _read(self.data, kind, self.position + offset) if offset else 0

    def _target(self, number: int) -> int | None:
        offset = self._field(number)
        return None if not offset else self.position + offset + _read(self.data, "<I", self.position + offset)

    def table(self, number: int) -> _Table | None:
        at = self._target(number)
        return None if at is None else _Table(self.data, at)

    def structs(self, number: int, kind: str) -> Iterator[tuple[int, ...]]:
        at = self._target(number)
        count = 0 if at is None else _read(self.data, "<I", at)
        size = struct.calcsize(kind)
        if at is not None and at + 4 + count * size > len(self.data):
            raise DamagedMessage(f"a vector of {count} items runs past the header")
        for item in range(count):
            yield struct.unpack_from(kind, self.data, at + 4 + item * size)  # type: ignore[operator]


def _read(data: Any, kind: str, at: int) -> int:
    if not 0 <= at <= len(data) - struct.calcsize(kind):
        raise DamagedMessage(f"byte {at} is outside the header")
    return struct.unpack_from(kind, data, at)[0]


@dataclass(frozen=True)
class BatchSize:
    """A record batch as its header declares it: rows, body bytes, bytes once decompressed
    (the dictionary batches before it included)."""

    rows: int
    body: int
    inflated: int


def batch_sizes(messages: Any) -> Iterator[BatchSize]:
    """Each record batch of a ``pyarrow.ipc.MessageReader`` as declared; DamagedMessage for
    a header that lies about itself."""
    body = inflated = 0
    while True:
        try:
            message = messages.read_next_message()
        except StopIteration:
            return
        header_type, header = _header(memoryview(message.metadata))
        if header_type not in (DICTIONARY_BATCH, RECORD_BATCH):
            continue
        data = memoryview(message.body) if message.body is not None else memoryview(b"")
        body += len(data)
        inflated += _inflated(header, data)
        if header_type == RECORD_BATCH:
            yield BatchSize(header.scalar(0, "<q"), body, inflated)
            body = inflated = 0


def _header(metadata: memoryview) -> tuple[int, _Table]:
    message = _Table(metadata, _read(metadata, "<I", 0))
    header_type, header = message.scalar(1, "<B"), message.table(2)
    if header_type == DICTIONARY_BATCH and header is not None:
        header = header.table(1)  # DictionaryBatch.data, a RecordBatch
    if header_type in (DICTIONARY_BATCH, RECORD_BATCH) and header is None:
        raise DamagedMessage("a batch message without its header")
    return header_type, header  # type: ignore[return-value]


def _inflated(header: _Table, body: memoryview) -> int:
    """The bytes a batch's buffers take once read: their lengths, or for a compressed body
    the length each buffer's 8-byte prefix declares."""
    compressed = header.table(3) is not None  # RecordBatch.compression
    total = 0
    for offset, length in header.structs(2, "<qq"):  # RecordBatch.buffers: (offset, length)
        if not compressed or length <= 0:
            total += max(0, length)
            continue
        declared = _read(body, "<q", offset)
        total += length - 8 if declared == NOT_COMPRESSED else max(0, declared)
    return total
