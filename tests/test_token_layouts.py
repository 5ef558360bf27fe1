"""fairseq's and Megatron's ``.idx`` layouts, each checked both ways against readers and writers
written here from the peers' own code (fairseq 0.12.2 ``fairseq/data/indexed_dataset.py``:
``MMapIndexedDataset.Index`` and its ``writer``; Megatron-LM ``megatron/core/datasets/
indexed_dataset.py``: ``_IndexWriter``/``_IndexReader``), never through seqshard's own code."""

import struct
from pathlib import Path

import numpy as np
import pytest
import sentencepiece

from conftest import REALDATA
from seqshard import TokenDataset
from seqshard.cli import main
from seqshard.errors import ConfigError, ShardError
from seqshard.formats.peers.mmidx import TokenDatasetWriter

BPE = REALDATA / "tokenizers/librispeech.train_960_unigram5000.bpemodel"
MEGATRON = REALDATA / "megatron"
# the peers' dtype codes, as their files list them
FAIRSEQ_CODES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f8", 8: "<u2", 9: "<u4", 10: "<u8"}
MEGATRON_CODES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}
SEQUENCES = [[5, 6, 7], [], [65000, 1], [9], [4, 4, 4, 4]]


def _header(stream, codes):
    assert stream.read(9) == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", stream.read(8)) == (1,)
    (code,) = struct.unpack("<B", stream.read(1))
    (count,) = struct.unpack("<Q", stream.read(8))
    return np.dtype(codes[code]), count


def fairseq_read(prefix):
    """fairseq's MMapIndexedDataset: header, sizes, pointers; items read at their pointers."""
    with open(f"{prefix}.idx", "rb") as stream:
        dtype, count = _header(stream, FAIRSEQ_CODES)
        sizes = np.frombuffer(stream.read(4 * count), dtype="<i4")
        pointers = np.frombuffer(stream.read(8 * count), dtype="<i8")
    data = Path(f"{prefix}.bin").read_bytes()
    return [np.frombuffer(data, dtype, int(n), int(p)).tolist() for n, p in zip(sizes, pointers)]


def megatron_read(prefix):
    """Megatron's _IndexReader: the document count after the sequence count, the document index last."""
    with open(f"{prefix}.idx", "rb") as stream:
        dtype, count = _header(stream, MEGATRON_CODES)
        (documents,) = struct.unpack("<Q", stream.read(8))
        sizes = np.frombuffer(stream.read(4 * count), dtype="<i4")
        pointers = np.frombuffer(stream.read(8 * count), dtype="<i8")
        doc_index = np.frombuffer(stream.read(8 * documents), dtype="<i8").tolist()
        assert stream.read() == b""
    data = Path(f"{prefix}.bin").read_bytes()
    return [np.frombuffer(data, dtype, int(n), int(p)).tolist() for n, p in zip(sizes, pointers)], doc_index


def _write(prefix, sequences, dtype, code, header_tail, index_tail=b""):
    sizes = [len(s) for s in sequences]
    pointers, address = [], 0
    for size in sizes:
        pointers.append(address)
        address += size * np.dtype(dtype).itemsize
    with open(f"{prefix}.bin", "wb") as stream:
        for sequence in sequences:
            stream.write(np.array(sequence, dtype=dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as stream:
        stream.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        stream.write(struct.pack("<Q", len(sizes)) + header_tail)
        stream.write(np.array(sizes, dtype=np.int32).tobytes() + np.array(pointers, dtype=np.int64).tobytes())
        stream.write(index_tail)


def fairseq_write(prefix, sequences, dtype=np.uint16, code=8):
    """fairseq's MMapIndexedDatasetBuilder + Index.writer."""
    _write(prefix, sequences, dtype, code, b"")


def megatron_write(prefix, sequences, doc_index, dtype=np.uint16, code=8):
    """Megatron's IndexedDatasetBuilder + _IndexWriter."""
    _write(prefix, sequences, dtype, code, struct.pack("<Q", len(doc_index)), np.array(doc_index, np.int64).tobytes())


@pytest.mark.parametrize("layout", ["fairseq", "megatron"])
def test_each_layout_written_by_seqshard_is_read_by_the_peers_reader(tmp_path, layout):
    writer = TokenDatasetWriter(tmp_path / "d", np.uint16, layout=layout)
    writer.add_many([np.array(s) for s in SEQUENCES])
    writer.finish()
    size = (tmp_path / "d.idx").stat().st_size
    if layout == "fairseq":
        assert size == 26 + 12 * len(SEQUENCES)  # no document count, no document index
        assert fairseq_read(tmp_path / "d") == SEQUENCES
    else:
        assert size == 34 + 12 * len(SEQUENCES) + 8 * (len(SEQUENCES) + 1)
        assert megatron_read(tmp_path / "d") == (SEQUENCES, list(range(len(SEQUENCES) + 1)))
    dataset = TokenDataset(tmp_path / "d")
    assert dataset.layout == layout and [d.tolist() for d in dataset] == SEQUENCES


def test_files_of_the_peers_writers_are_read_in_either_layout(tmp_path):
    fairseq_write(tmp_path / "f", SEQUENCES)
    dataset = TokenDataset(tmp_path / "f")
    assert dataset.layout == "fairseq" and [d.tolist() for d in dataset] == SEQUENCES
    assert dataset.doc_index.tolist() == list(range(len(SEQUENCES) + 1))  # each sequence a document
    megatron_write(tmp_path / "m", SEQUENCES, [0, 2, 5])
    dataset = TokenDataset(tmp_path / "m")
    assert dataset.layout == "megatron" and [d.tolist() for d in dataset] == SEQUENCES
    assert dataset.doc_index.tolist() == [0, 2, 5]
    big = [[70000, 3], [4_000_000_000]]  # fairseq 0.12 stores a vocabulary above 65,500 as uint32 (code 9)
    fairseq_write(tmp_path / "big", big, np.uint32, 9)
    assert [d.tolist() for d in TokenDataset(tmp_path / "big")] == big
    for name in ("e", "e2"):  # no sequence at all: 26 bytes for fairseq, 42 for Megatron; never both
        (fairseq_write if name == "e" else lambda p, s: megatron_write(p, s, [0]))(tmp_path / name, [])
        assert len(TokenDataset(tmp_path / name)) == 0
    assert TokenDataset(tmp_path / "e").layout == "fairseq" and TokenDataset(tmp_path / "e2").layout == "megatron"


def test_the_realdata_megatron_files_are_megatron_layout():
    for name in ("ag_news_prompt_targets_document", "meg-gpt2-openwebtext_text_document"):
        dataset = TokenDataset(MEGATRON / name)
        sequences, doc_index = megatron_read(MEGATRON / name)
        assert dataset.layout == "megatron" and dataset.doc_index.tolist() == doc_index
        assert [dataset[i].tolist() for i in (0, len(dataset) - 1)] == [sequences[0], sequences[-1]]


def test_an_index_of_neither_layout_names_both(tmp_path):
    fairseq_write(tmp_path / "d", SEQUENCES)
    idx = (tmp_path / "d.idx").read_bytes()
    (tmp_path / "d.idx").write_bytes(idx[:-1])
    with pytest.raises(ShardError, match=r"d.idx: the index holds 85 bytes, which fits neither layout .*fairseq's "
                       r"\(sizes and pointers, no document index\) takes 86 bytes, Megatron's"):  # fmt: skip
        TokenDataset(tmp_path / "d")
    (tmp_path / "d.idx").write_bytes(b"TNTIDX\x00\x00" + idx[8:])
    with pytest.raises(ShardError, match=r"fairseq's older IndexedDataset .* --dataset-impl mmap"):
        TokenDataset(tmp_path / "d")
    megatron_write(tmp_path / "m", SEQUENCES, [0, 5], np.uint32, 9)
    with pytest.raises(ShardError, match=r"dtype code 9 \(uint32\) is fairseq's, but the index has Megatron's layout"):
        TokenDataset(tmp_path / "m")
    megatron_write(tmp_path / "mm", SEQUENCES, [0, 5])
    with open(tmp_path / "mm.idx", "ab") as stream:
        stream.write(bytes(len(SEQUENCES)))  # a mode per sequence
    with pytest.raises(ShardError, match="Megatron's multimodal index"):
        TokenDataset(tmp_path / "mm")
    with pytest.raises(ConfigError, match="fairseq's layout has no document index"):
        TokenDatasetWriter(tmp_path / "w", np.uint16, layout="fairseq").end_document()
    with pytest.raises(ConfigError, match="cannot be stored in megatron's layout"):
        TokenDatasetWriter(tmp_path / "w", np.uint32, layout="megatron")


@pytest.mark.parametrize("layout", ["fairseq", "megatron"])
def test_binarize_writes_the_layout_asked_for(tmp_path, layout):
    text = tmp_path / "train.txt"
    lines = ["THE FIRST GREAT SORROW OF HIS LIFE", "", "IT WAS"]
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["binarize", "--in", str(text), "--out", str(tmp_path / "t"), "--tokenizer", str(BPE),
                 "--layout", layout, "--quiet"]) == 0  # fmt: skip
    processor = sentencepiece.SentencePieceProcessor(model_file=str(BPE))
    expected = [processor.encode(line) + [processor.eos_id()] for line in lines]
    assert (fairseq_read if layout == "fairseq" else lambda p: megatron_read(p)[0])(tmp_path / "t") == expected
    assert TokenDataset(tmp_path / "t").layout == layout
