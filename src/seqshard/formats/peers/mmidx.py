"""fairseq's and Megatron's memory-mapped token datasets: ``PREFIX.bin`` + ``PREFIX.idx``.

``.bin`` is every sequence's tokens back to back, of one integer dtype. ``.idx`` starts, all
little-endian, with the magic ``MMIDIDX\\0\\0``, the version (u64 = 1), a dtype code (u8) and
the sequence count (u64); then the two projects differ:

- **Megatron** (``megatron/core/datasets/indexed_dataset.py``, ``preprocess_data.py``): the
  document count (u64), the sizes (int32, tokens per sequence), the pointers (int64, byte
  offset of each sequence in ``.bin``) and the document index (int64, the first sequence of
  each document, plus the sequence count at the end).
- **fairseq** (``MMapIndexedDataset`` of fairseq 0.12.x, ``fairseq-preprocess --dataset-impl
  mmap``): the sizes and the pointers, no document count and no document index.

Both sizes follow from the header, and never agree (Megatron's is 8 bytes longer than
fairseq's with no document at all), so :class:`TokenDataset` tells the layouts apart by the
file size and reads both; :class:`TokenDatasetWriter` writes either, crash-safe (the final
names appear complete or not at all). dtype codes 1-5 and 8 mean the same to both; 9 and 10
(uint32, uint64) are fairseq's; 6 and 7 are floats (7 is float64 to fairseq but float32 to
Megatron), refused because token ids are integers.

``PREFIX.json`` (:class:`TokenMeta`, written by ``seqshard binarize``) records the ids the
tokens were made with: vocabulary size, pad/eos/bos/unk, the tokenizer or dictionary.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...checks import read_number, shown
from ...errors import ConfigError, ShardError
from ..files import fsync_directory, inside, open_output, read_json, write_json_atomic, writing

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
LAYOUTS = ("megatron", "fairseq")
HEADER = struct.Struct("<9sQBQQ")  # Megatron: magic, version, dtype code, sequences, documents
FAIRSEQ_HEADER = struct.Struct("<9sQBQ")  # fairseq: magic, version, dtype code, sequences
_INTEGERS = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
DTYPE_OF_CODE = {"megatron": _INTEGERS, "fairseq": {**_INTEGERS, 9: np.uint32, 10: np.uint64}}
CODE_OF_DTYPE = {layout: {np.dtype(t): code for code, t in codes.items()} for layout, codes in DTYPE_OF_CODE.items()}
FLOAT_CODES = {"megatron": {6: "float64", 7: "float32"}, "fairseq": {6: "float64", 7: "float64"}}
META_VERSION = 1
FINGERPRINT_BYTES = 1 << 20  # of the .bin's head and tail in data_fingerprint


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ConfigError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}.")
    return layout


def token_dtype(vocab_size: int, layout: str = "megatron") -> np.dtype:
    """The dtype each project chooses for a vocabulary: uint16 below 65,500 ids, else int32
    (Megatron) or uint32 (fairseq 0.12's ``best_fitting_int_dtype``)."""
    if vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32 if check_layout(layout) == "fairseq" else np.int32)


def paths_of(prefix: str | Path) -> tuple[Path, Path]:
    """``PREFIX.bin`` and ``PREFIX.idx`` (``prefix`` may end in either suffix)."""
    prefix = str(prefix)
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            prefix = prefix[: -len(suffix)]
    return Path(prefix + ".bin"), Path(prefix + ".idx")


def meta_path_of(prefix: str | Path) -> Path:
    """``PREFIX.json``, the ids the tokens were made with (:class:`TokenMeta`)."""
    return paths_of(prefix)[0].with_suffix(".json")


CHECK_BLOCK = 1 << 20  # sequences checked at once: the check's arrays stay a few MB for any index


def check_sequences(
    sizes: np.ndarray, pointers: np.ndarray, itemsize: int, bin_bytes: int, idx_path: Path, bin_path: Path
) -> None:
    """Check an index as a whole (ShardError naming the file and the first bad sequence):
    sizes >= 0, the first pointer at 0, each pointer + size x itemsize equal to the next
    pointer, and the last sequence ending where ``.bin`` ends. Vectorised, ``CHECK_BLOCK``
    sequences at a time: a million sequences take milliseconds, a billion need no more memory."""
    if not len(sizes):
        if bin_bytes:
            raise ShardError(bin_path, None, f"holds {bin_bytes} bytes where its index lists no sequence.")
        return
    end = 0  # where the sequences checked so far end, in bytes
    for block in range(0, len(sizes), CHECK_BLOCK):
        block_sizes, block_pointers = sizes[block : block + CHECK_BLOCK], pointers[block : block + CHECK_BLOCK]
        negative = np.flatnonzero(block_sizes < 0)
        if len(negative):
            first = block + int(negative[0])
            raise ShardError(
                idx_path, None, f"sequence {first} has a negative size ({int(sizes[first])}): a damaged index."
            )
        ends = block_pointers + block_sizes.astype(np.int64) * itemsize
        starts = np.concatenate(([end], ends[:-1]))
        wrong = np.flatnonzero(block_pointers != starts)
        if len(wrong):
            first = block + int(wrong[0])
            raise ShardError(
                idx_path,
                None,
                f"sequence {first} starts at byte {int(pointers[first])} of {bin_path.name} where the sequences before "
                f"it end at byte {int(starts[wrong[0]])}: a damaged index (or another file's).",
            )
        end = int(ends[-1])
    if end != bin_bytes:
        raise ShardError(
            bin_path,
            None,
            f"holds {bin_bytes} bytes where its index says {end} (cut short, or another index?).",
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


@dataclass(frozen=True)
class TokenMeta:
    """``PREFIX.json``: what ``seqshard binarize`` made the tokens with. ``eos_id`` is the
    tokenizer's or dictionary's end-of-sentence id and ``eos_appended`` whether each line ends
    with it; ``pad_id``/``bos_id``/``unk_id`` are None where the vocabulary has none;
    ``tokenizer``/``dictionary`` are ``{"path", "sha256"}`` of the files used. ``sequences``,
    ``tokens`` and ``data`` (:func:`data_fingerprint`) tie it to its ``.bin``/``.idx``."""

    layout: str
    dtype: str
    sequences: int
    tokens: int
    data: str
    vocab_size: int
    eos_id: int | None
    eos_appended: bool
    pad_id: int | None = None
    bos_id: int | None = None
    unk_id: int | None = None
    tokenizer: dict[str, str] | None = None
    dictionary: dict[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"seqshard_token_meta": META_VERSION, **asdict(self)}

    def write(self, prefix: str | Path) -> None:
        """Write ``PREFIX.json`` atomically."""
        write_json_atomic(meta_path_of(prefix), self.to_json())

    @classmethod
    def read(cls, path: Path) -> TokenMeta:
        """``PREFIX.json`` with every value checked (:meth:`check`); InputError (not JSON) or
        ShardError naming the file, the field and the fix."""
        data = read_json(path, "binarize again (it was altered).")
        if not isinstance(data, dict) or data.pop("seqshard_token_meta", None) != META_VERSION:
            raise ShardError(
                path, None, f"not a seqshard token metadata file of version {META_VERSION} (seqshard_token_meta)."
            )
        try:
            meta = cls(**data)
        except TypeError as error:
            raise ShardError(path, None, f"unexpected fields ({error}).") from None
        try:
            meta.check()
        except ValueError as error:
            raise ShardError(path, None, f"{error}. Fix: binarize again (or correct the field).") from None
        return meta

    def check(self) -> None:
        """ValueError naming the field unless every value is of its kind and in range: a known
        layout and integer dtype; counts >= 0; ``vocab_size`` >= 1 and within the dtype's ids;
        ``eos_id``, ``bos_id`` and ``unk_id`` (tokens) below ``vocab_size``; ``pad_id`` a
        whole number >= 0 (it may lie outside the vocabulary); a flag for ``eos_appended``."""
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout is {shown(self.layout)}, not one of {', '.join(LAYOUTS)}")
        dtypes = {str(np.dtype(t)) for t in DTYPE_OF_CODE[self.layout].values()}
        if self.dtype not in dtypes:
            raise ValueError(f"dtype is {shown(self.dtype)}, not one of {', '.join(sorted(dtypes))}")
        for name in ("sequences", "tokens"):
            read_number(name, getattr(self, name), whole=True, at_least=0)
        if not isinstance(self.data, str):
            raise ValueError(f"data is {shown(self.data)}, not the fingerprint string binarize writes")
        ids = int(np.iinfo(np.dtype(self.dtype)).max) + 1
        read_number("vocab_size", self.vocab_size, whole=True, at_least=1, at_most=ids)
        for name in ("eos_id", "bos_id", "unk_id"):
            read_number(name, getattr(self, name), whole=True, at_least=0, at_most=self.vocab_size - 1, optional=True)
        read_number("pad_id", self.pad_id, whole=True, at_least=0, at_most=2**63 - 1, optional=True)
        if not isinstance(self.eos_appended, bool):
            raise ValueError(f"eos_appended is {shown(self.eos_appended)}, not true or false")
        for name in ("tokenizer", "dictionary"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, dict) and all(isinstance(v, str) for v in value.values())):
                raise ValueError(f"{name} is {shown(value)}, not null or the path and sha256 binarize writes")


def data_fingerprint(prefix: str | Path, part: int = FINGERPRINT_BYTES) -> str:
    """sha256 of the first and last ``part`` bytes of the ``.idx`` and of the ``.bin``, with
    their sizes: cheap for any size, and different for other tokens of the same lengths."""
    digest = hashlib.sha256()
    for path in paths_of(prefix)[::-1]:
        size = path.stat().st_size
        digest.update(f"{size}\n".encode())
        with open(path, "rb") as stream:
            digest.update(stream.read(part))
            stream.seek(max(size - part, part))
            digest.update(stream.read(part))
    return digest.hexdigest()


def _bad_magic(head: bytes) -> str:
    if head.startswith(b"TNTIDX\x00\x00"):
        return (
            "fairseq's older IndexedDataset (magic TNTIDX, --dataset-impl lazy or cached), not the mmap layout: "
            "binarize again with fairseq-preprocess --dataset-impl mmap, or with seqshard binarize."
        )
    return "not an MMIDIDX index (fairseq's or Megatron's mmap format): bad magic."


def read_layout(index: np.ndarray, idx_path: Path) -> tuple[str, int, int, int]:
    """``(layout, dtype code, sequences, documents)`` of a mapped ``.idx``: the layout is the
    one whose size, computed from the header, is the file's (they never agree: see the module
    docstring). ShardError naming both layouts when neither fits."""
    size = len(index)
    if size < FAIRSEQ_HEADER.size or bytes(index[:9]) != MAGIC:
        raise ShardError(idx_path, 0, _bad_magic(bytes(index[:9])))
    _, version, code, count = FAIRSEQ_HEADER.unpack(bytes(index[: FAIRSEQ_HEADER.size]))
    if version != VERSION:
        raise ShardError(idx_path, 9, f"index version {version}; only version {VERSION} is known.")
    fairseq = FAIRSEQ_HEADER.size + 12 * count  # Python ints: a damaged count cannot overflow
    if size == fairseq:
        return "fairseq", code, count, 0
    megatron = documents = None
    if size >= HEADER.size:
        documents = HEADER.unpack(bytes(index[: HEADER.size]))[4]
        megatron = HEADER.size + 12 * count + 8 * documents
        if size == megatron:
            return "megatron", code, count, documents
        if size == megatron + count:
            raise ShardError(
                idx_path,
                None,
                "Megatron's multimodal index (a mode byte per sequence after the document index): "
                "seqshard reads token indexes only.",
            )
    megatron_size = f"{megatron} with its {documents} document entries" if megatron is not None else "at least 34"
    raise ShardError(
        idx_path,
        None,
        f"the index holds {size} bytes, which fits neither layout of its header ({count} sequences): fairseq's "
        f"(sizes and pointers, no document index) takes {fairseq} bytes, Megatron's (with a document index) "
        f"{megatron_size}: damaged or cut short?",
    )


def dtype_of(layout: str, code: int, idx_path: Path) -> np.dtype:
    if code in DTYPE_OF_CODE[layout]:
        return np.dtype(DTYPE_OF_CODE[layout][code])
    known = sorted(DTYPE_OF_CODE[layout])
    if code in FLOAT_CODES[layout]:
        problem = (
            f"dtype code {code} means {FLOAT_CODES[layout][code]} in {layout}'s layout, but token ids are integers"
            + (" (7 means float64 to fairseq but float32 to Megatron)" if code == 7 else "")
        )
    elif layout == "megatron" and code in DTYPE_OF_CODE["fairseq"]:
        problem = (
            f"dtype code {code} ({np.dtype(DTYPE_OF_CODE['fairseq'][code])}) is fairseq's, "
            "but the index has Megatron's layout (with a document index)"
        )
    else:
        problem = f"dtype code {code} is unknown to {layout}'s layout"
    raise ShardError(idx_path, 17, f"{problem}; integer codes are {known}.")


class TokenDataset:
    """The sequences of ``PREFIX.bin``/``PREFIX.idx`` in either layout: ``len(ds)``, ``ds[i]``
    (a read-only numpy view of the memory-mapped tokens), ``ds.sizes`` (tokens per sequence,
    int32), ``ds.doc_index`` (fairseq's layout has none: each sequence is a document),
    ``ds.dtype``, ``ds.layout`` (``"megatron"`` or ``"fairseq"``) and ``ds.meta`` (the
    ``PREFIX.json`` of ``seqshard binarize``, or None)."""

    def __init__(self, prefix: str | Path):
        self.bin_path, self.idx_path = paths_of(prefix)
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise ConfigError(f"{path} does not exist (a token dataset is PREFIX.bin + PREFIX.idx).")
        index = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        self.layout, code, count, documents = read_layout(index, self.idx_path)
        self.dtype = dtype_of(self.layout, code, self.idx_path)
        offset = HEADER.size if self.layout == "megatron" else FAIRSEQ_HEADER.size
        self.sizes = np.frombuffer(index, dtype="<i4", count=count, offset=offset)
        self.pointers = np.frombuffer(index, dtype="<i8", count=count, offset=offset + count * 4)
        if self.layout == "megatron":
            self.doc_index = np.frombuffer(index, dtype="<i8", count=documents, offset=offset + count * 12)
        else:
            self.doc_index = np.arange(count + 1, dtype=np.int64)
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

    @functools.cached_property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    @functools.cached_property
    def meta(self) -> TokenMeta | None:
        """``PREFIX.json`` when there is one; ShardError when it describes other files."""
        path = meta_path_of(self.bin_path)
        if not path.is_file():
            return None
        meta = TokenMeta.read(path)
        mine = (self.layout, str(self.dtype), len(self), self.num_tokens, data_fingerprint(self.bin_path))
        if (meta.layout, meta.dtype, meta.sequences, meta.tokens, meta.data) != mine:
            raise ShardError(
                path,
                None,
                f"describes {meta.sequences} sequences, {meta.tokens} tokens of {meta.dtype} in {meta.layout}'s "
                f"layout (sha256 {meta.data[:12]}...), but {self.bin_path.name}/.idx hold {mine[2]} sequences, "
                f"{mine[3]} tokens of {mine[1]} in {mine[0]}'s (sha256 {mine[4][:12]}...): it belongs to other "
                "files; delete it, or binarize again.",
            )
        problem = self._disagreement(meta)
        if problem is not None:
            raise ShardError(path, None, f"{problem}: it does not describe these tokens. Fix: binarize again.")
        return meta

    def _disagreement(self, meta: TokenMeta) -> str | None:
        """What the tokens say against ``meta``, looking where its fingerprint looks (the first
        and last MiB of the tokens: all of a small dataset): an id at or above ``vocab_size``,
        or a first or last sequence not ending with ``eos_id`` where ``eos_appended`` says
        every one does."""
        part = FINGERPRINT_BYTES // self.dtype.itemsize
        for tokens in (self._data[:part], self._data[-part:]):
            if len(tokens) and int(tokens.max()) >= meta.vocab_size:
                return f"vocab_size is {meta.vocab_size}, but the tokens hold id {int(tokens.max())}"
        if meta.eos_appended and meta.eos_id is not None:
            for number in {0, len(self) - 1} if len(self) else ():
                sequence = self[number]
                if not len(sequence) or int(sequence[-1]) != meta.eos_id:
                    return f"eos_appended is true, but sequence {number} does not end with eos_id {meta.eos_id}"
        return None

    def __repr__(self) -> str:
        return (
            f"TokenDataset({str(self.bin_path)[:-4]!r}: {len(self)} sequences, {self.num_tokens} tokens, {self.dtype}, "
            f"{self.layout} layout)"
        )


class TokenDatasetWriter:
    """Appends sequences to ``PREFIX.bin`` and writes ``PREFIX.idx`` on :meth:`finish`, in
    Megatron's ``layout`` (the default) or fairseq's.

    Both are written under temporary names and renamed when complete, index last, so a
    reader never sees half a dataset under the final names. ``end_document()`` closes a
    document (Megatron's document index); without it every sequence is one document.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype | type, layout: str = "megatron"):
        self.bin_path, self.idx_path = paths_of(prefix)
        self.dtype = np.dtype(dtype)
        self.layout = check_layout(layout)
        if self.dtype not in CODE_OF_DTYPE[layout]:
            raise ConfigError(
                f"dtype {self.dtype} cannot be stored in {layout}'s layout "
                f"(codes exist for {sorted(map(str, CODE_OF_DTYPE[layout]))})."
            )
        self._temporary = self.bin_path.with_name(f".{self.bin_path.name}.partial")
        self._index_temporary = self.idx_path.with_name(f".{self.idx_path.name}.partial")
        folder = self.bin_path.parent
        for path in (self.bin_path, self.idx_path, self._temporary, self._index_temporary):
            inside(folder, path)  # a link at one of these names does not lead the writing elsewhere
        with writing(self._temporary):
            folder.mkdir(parents=True, exist_ok=True)
        self._stream = os.fdopen(open_output(self._temporary), "wb")  # closed by finish/abort
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
        if self.layout == "fairseq":
            raise ConfigError("fairseq's layout has no document index: write layout='megatron' to keep documents.")
        self._explicit_documents = True
        self._doc_index.append(self._count)

    def finish(self) -> None:
        """Write the index and move both files to their final names."""
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        code = CODE_OF_DTYPE[self.layout][self.dtype]
        if self.layout == "megatron":
            documents = (
                np.asarray(self._doc_index, dtype=np.int64) if self._explicit_documents else np.arange(len(sizes) + 1)
            )
            parts = [HEADER.pack(MAGIC, VERSION, code, len(sizes), len(documents))]
            tail = [documents.astype("<i8").tobytes()]
        else:
            parts, tail = [FAIRSEQ_HEADER.pack(MAGIC, VERSION, code, len(sizes))], []
        parts += [sizes.astype("<i4").tobytes(), pointers.astype("<i8").tobytes(), *tail]
        with writing(self._temporary):
            self._stream.flush()
            os.fsync(self._stream.fileno())
            self._stream.close()
        with writing(self._index_temporary), os.fdopen(open_output(self._index_temporary), "wb") as stream:
            for part in parts:
                stream.write(part)
            stream.flush()
            os.fsync(stream.fileno())
        self.idx_path.unlink(missing_ok=True)  # an old index never describes the new .bin
        os.replace(self._temporary, self.bin_path)
        os.replace(self._index_temporary, self.idx_path)
        fsync_directory(self.bin_path.parent)

    def abort(self) -> None:
        self._stream.close()
        self._temporary.unlink(missing_ok=True)
