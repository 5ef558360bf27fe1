"""A token index (``.idx``) is checked as a whole when it is opened, not only at its last entry."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from seqshard import TokenDataset
from seqshard.errors import ShardError
from seqshard.formats.peers.mmidx import HEADER, TokenDatasetWriter


@pytest.fixture
def dataset(tmp_path):
    writer = TokenDatasetWriter(tmp_path / "d", np.uint16)
    for length in (3, 5, 2, 4):
        writer.add(np.arange(length) + 10)
    writer.finish()
    return tmp_path / "d"


def _patch(prefix, field: str, sequence: int, value: int) -> None:
    """Overwrite one size (int32) or pointer (int64) of a 4-sequence index."""
    path = prefix.with_suffix(".idx")
    data = bytearray(path.read_bytes())
    if field == "size":
        data[HEADER.size + 4 * sequence : HEADER.size + 4 * sequence + 4] = struct.pack("<i", value)
    else:
        at = HEADER.size + 4 * 4 + 8 * sequence
        data[at : at + 8] = struct.pack("<q", value)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "field, sequence, value, message",
    [
        ("pointer", 2, 8 * 2 + 4, r"sequence 2 starts at byte 20 .* end at byte 16"),  # moved into its neighbour
        ("size", 1, -1, r"sequence 1 has a negative size"),
        ("size", 1, 2**31 - 1, r"sequence 2 starts at byte 16 .* end at byte"),  # a huge size
        ("pointer", 3, 10**6, r"sequence 3 starts at byte 1000000"),  # past the end of .bin
    ],
)
def test_a_damaged_entry_anywhere_is_named(dataset, field, sequence, value, message):
    assert [len(s) for s in TokenDataset(dataset)] == [3, 5, 2, 4]
    _patch(dataset, field, sequence, value)
    with pytest.raises(ShardError, match=message) as caught:
        TokenDataset(dataset)
    assert "d.idx" in str(caught.value) or "d.bin" in str(caught.value)


def test_counts_in_the_header_are_checked_before_anything_is_mapped(dataset):
    path = dataset.with_suffix(".idx")
    data = bytearray(path.read_bytes())
    magic, version, code, _, documents = HEADER.unpack(bytes(data[: HEADER.size]))
    data[: HEADER.size] = HEADER.pack(magic, version, code, 2**60, documents)
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"header \(1152921504606846976 sequences"):
        TokenDataset(dataset)


def test_a_document_index_out_of_order_is_named(tmp_path):
    writer = TokenDatasetWriter(tmp_path / "d", np.uint16)
    writer.add_many([[1, 2], [3], [4, 5, 6]])
    writer.end_document()
    writer.add(np.array([7]))
    writer.end_document()
    writer.finish()
    path = tmp_path / "d.idx"
    data = bytearray(path.read_bytes())
    last = len(data) - 8  # the document index ends with the sequence count
    data[last:] = struct.pack("<q", 2)
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="document index"):
        TokenDataset(tmp_path / "d")
