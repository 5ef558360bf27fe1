"""fairseq's and Megatron's memory-mapped token datasets: ``PREFIX.bin`` + ``PREFIX.idx``.

``.bin`` is every sequence's tokens back to back, of one integer dtype. ``.idx`` is, all
little-endian: the magic ``MMIDIDX\\0\\0``, version (u64 = 1), a dtype code (u8), the
sequence count (u64), the document count (u64), then the sizes (int32, tokens per sequence),
the pointers (int64, byte offset of each sequence in ``.bin``) and the document index
(int64, the first sequence of each document, plus the count at the end). Both projects write
and read exactly this (fairseq ``MMapIndexedDataset``, Megatron ``preprocess_data.py``).
:class:`TokenDataset` maps both files and hands out views (no copy);
:class:`TokenDatasetWriter` writes them, crash-safe (the final names appear complete or not at all).
"""

from __future__ import annotations

import functools
import os
import struct
from pathlib import Path

import numpy as np

from ..errors import ConfigError, ShardError
from .files import fsync_directory, writing

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Codes both projects agree on. 6 is float64 in both; 7 is float64 in fairseq but float32 in
# Megatron, so it is refused rather than guessed.
DTYPE_OF_CODE = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 8: np.uint16}
CODE_OF_DTYPE = {np.dtype(dtype): code for code, dtype in DTYPE_OF_CODE.items()}
HEADER = struct.Struct("<9sQBQQ")


def token_dtype(vocab_size: int) -> np.dtype:
    """The dtype fairseq and Megatron choose for a vocabulary: uint16 below 65,500, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def paths_of(prefix: str | Path) -> tuple[Path, Path]:
    prefix = str(prefix)
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            prefix = prefix[: -len(suffix)]
    return Path(prefix + ".bin"), Path(prefix + ".idx")


def check_sequences(
    sizes: np.ndarray, pointers: np.ndarray, itemsize: int, bin_bytes: int, idx_path: Path, bin_path: Path
) -> None:
    """Check an index as a whole (ShardError naming the file and the first bad sequence):
    sizes >= 0, the first pointer at 0, each pointer + size x itemsize equal to the next
    pointer, and the last sequence ending where ``.bin`` ends. Vectorised: a million
    sequences take milliseconds."""
    if not len(sizes):
        if bin_bytes:
            raise ShardError(bin_path, None, f"holds {bin_bytes} bytes where its index lists no sequence.")
        return
    negative = np.flatnonzero(sizes < 0)
    if len(negative):
        first = int(negative[0])
        raise ShardError(
            idx_path, None, f"sequence {first} has a negative size ({int(sizes[first])}): a damaged index."
        )
    ends = pointers + sizes.astype(np.int64) * itemsize
    starts = np.concatenate(([0], ends[:-1]))
    wrong = np.flatnonzero(pointers != starts)
    if len(wrong):
        first = int(wrong[0])
        raise ShardError(
            idx_path,
            None,
            f"sequence {first} starts at byte {int(pointers[first])} of {bin_path.name} where the sequences before it "
            f"end at byte {int(starts[first])}: a damaged index (or another file's).",
        )
    if int(ends[-1]) != bin_bytes:
        raise ShardError(
            bin_path,
            None,
            f"holds {bin_bytes} bytes where its index says {int(ends[-1])} (cut short, or another index?).",
        )


def check_documents(doc_index: np.ndarray, count: int, idx_path: Path) -> None:
    """Megatron's document index: the first sequence of each document, ascending from 0, and
    the sequence count at the end."""
    if not len(doc_index):
        return
    if int(doc_index[0]) != 0 or int(doc_index[-1]) != count or (np.diff(doc_index) < 0).any():
        raise ShardError(
            idx_path,
            None,
            f"its document index does not run from sequence 0 up to {count} (the sequence count): a damaged index.",
        )


class TokenDataset:
    """The sequences of ``PREFIX.bin``/``PREFIX.idx``: ``len(ds)``, ``ds[i]`` (a read-only
    numpy view of the memory-mapped tokens), ``ds.sizes`` (tokens per sequence, int32),
    ``ds.doc_index`` and ``ds.dtype``."""

    def __init__(self, prefix: str | Path):
        self.bin_path, self.idx_path = paths_of(prefix)
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise ConfigError(f"{path} does not exist (a token dataset is PREFIX.bin + PREFIX.idx).")
        index = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        if len(index) < HEADER.size or bytes(index[:9]) != MAGIC:
            raise ShardError(self.idx_path, 0, "not an MMIDIDX index (fairseq/Megatron mmap format): bad magic.")
        _, version, code, count, documents = HEADER.unpack(bytes(index[: HEADER.size]))
        if version != VERSION:
            raise ShardError(self.idx_path, 9, f"index version {version}; only version {VERSION} is known.")
        if code not in DTYPE_OF_CODE:
            raise ShardError(
                self.idx_path,
                17,
                f"dtype code {code} is not one of {sorted(DTYPE_OF_CODE)}"
                + (" (7 means float64 to fairseq but float32 to Megatron)" if code == 7 else "")
                + ".",
            )
        self.dtype = np.dtype(DTYPE_OF_CODE[code])
        expected = HEADER.size + count * 4 + count * 8 + documents * 8  # Python ints: no overflow
        if len(index) != expected:
            raise ShardError(
                self.idx_path,
                None,
                f"the index holds {len(index)} bytes where its header ({count} sequences, {documents} documents) "
                f"implies {expected} (damaged, or another layout?).",
            )
        offset = HEADER.size
        self.sizes = np.frombuffer(index, dtype="<i4", count=count, offset=offset)
        self.pointers = np.frombuffer(index, dtype="<i8", count=count, offset=offset + count * 4)
        self.doc_index = np.frombuffer(index, dtype="<i8", count=documents, offset=offset + count * 12)
        self._index = index
        actual = self.bin_path.stat().st_size
        check_sequences(self.sizes, self.pointers, self.dtype.itemsize, actual, self.idx_path, self.bin_path)
        check_documents(self.doc_index, count, self.idx_path)
        # a plain ndarray view of the mapping: np.memmap's own indexing costs more than the read
        mapped = np.memmap(self.bin_path, dtype=self.dtype, mode="r") if actual else np.zeros(0, self.dtype)
        self._data = mapped.view(np.ndarray)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, index: int) -> np.ndarray:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sequence {index} of {len(self)} in {self.bin_path}")
        index %= len(self)
        start = int(self.pointers[index]) // self.dtype.itemsize
        return self._data[start : start + int(self.sizes[index])]

    @functools.cached_property
    def starts(self) -> np.ndarray:
        """Where each sequence starts in :attr:`tokens` (the pointers in tokens, not bytes)."""
        return self.pointers // self.dtype.itemsize

    @property
    def tokens(self) -> np.ndarray:
        """All tokens back to back (the mapped ``.bin``)."""
        return self._data

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def __repr__(self) -> str:
        return (
            f"TokenDataset({str(self.bin_path)[:-4]!r}: {len(self)} sequences, {self.num_tokens} tokens, {self.dtype})"
        )


class TokenDatasetWriter:
    """Appends sequences to ``PREFIX.bin`` and writes ``PREFIX.idx`` on :meth:`finish`.

    Both are written under temporary names and renamed when complete, index last, so a
    reader never sees half a dataset under the final names. ``end_document()`` closes a
    document (Megatron's document index); without it every sequence is one document.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype | type):
        self.bin_path, self.idx_path = paths_of(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ConfigError(
                f"dtype {self.dtype} cannot be stored (codes exist for {sorted(map(str, CODE_OF_DTYPE))})."
            )
        self._temporary = self.bin_path.with_name(f".{self.bin_path.name}.partial")
        with writing(self._temporary):
            self.bin_path.parent.mkdir(parents=True, exist_ok=True)
            self._stream = open(self._temporary, "wb")  # noqa: SIM115 (closed by finish/abort)
        self._sizes: list[np.ndarray] = []
        self._doc_index = [0]
        self._explicit_documents = False
        self._count = 0

    def add(self, tokens: np.ndarray) -> None:
        """Append one sequence."""
        self.add_many([tokens])

    def add_many(self, sequences: list[np.ndarray] | list[list[int]]) -> None:
        """Append sequences (arrays or lists of ints)."""
        if not sequences:
            return
        arrays = [np.asarray(s) for s in sequences]
        joined = np.concatenate(arrays) if arrays else np.zeros(0)
        if joined.size and (joined.min() < np.iinfo(self.dtype).min or joined.max() > np.iinfo(self.dtype).max):
            raise ConfigError(f"token ids {joined.min()}..{joined.max()} do not fit {self.dtype}.")
        with writing(self._temporary):
            self._stream.write(joined.astype(self.dtype, copy=False).tobytes())
        self._sizes.append(np.fromiter((len(a) for a in arrays), dtype=np.int32, count=len(arrays)))
        self._count += len(arrays)

    def add_bin(self, bin_path: Path, sizes: np.ndarray) -> None:
        """Append a ``.bin`` written elsewhere with this dtype (a parallel worker's part)."""
        with writing(self._temporary), open(bin_path, "rb") as part:
            while chunk := part.read(8 << 20):
                self._stream.write(chunk)
        self._sizes.append(np.asarray(sizes, dtype=np.int32))
        self._count += len(sizes)

    def end_document(self) -> None:
        self._explicit_documents = True
        self._doc_index.append(self._count)

    def finish(self) -> None:
        """Write the index and move both files to their final names."""
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = (
            np.asarray(self._doc_index, dtype=np.int64) if self._explicit_documents else np.arange(len(sizes) + 1)
        )
        with writing(self._temporary):
            self._stream.flush()
            os.fsync(self._stream.fileno())
            self._stream.close()
        index_temporary = self.idx_path.with_name(f".{self.idx_path.name}.partial")
        with writing(index_temporary), open(index_temporary, "wb") as stream:
            stream.write(HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[self.dtype], len(sizes), len(documents)))
            stream.write(sizes.astype("<i4").tobytes())
            stream.write(pointers.astype("<i8").tobytes())
            stream.write(documents.astype("<i8").tobytes())
            stream.flush()
            os.fsync(stream.fileno())
        self.idx_path.unlink(missing_ok=True)  # an old index never describes the new .bin
        os.replace(self._temporary, self.bin_path)
        os.replace(index_temporary, self.idx_path)
        fsync_directory(self.bin_path.parent)

    def abort(self) -> None:
        self._stream.close()
        self._temporary.unlink(missing_ok=True)
