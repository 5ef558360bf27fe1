"""``seqshard binarize``: a text file (one sentence per line) -> ``PREFIX.bin`` + ``PREFIX.idx``
(Megatron's layout, or fairseq's) + ``PREFIX.json`` (the ids used: :class:`TokenMeta`).

Each line becomes one sequence of token ids followed by the end-of-sentence id, one document
per line (Megatron's document index; fairseq's layout has none). The ids are the tokenizer's
own, or with a fairseq ``dict.txt`` those of the dictionary (the line's SentencePiece pieces
looked up in it, unknown ones to ``<unk>``: what ``fairseq-preprocess`` writes for the
``spm_encode``'d text).
Lines are never dropped or merged, so the source and target sides of a parallel corpus
binarized separately stay aligned line for line; an empty line becomes ``[eos]`` and is
counted. With ``jobs`` > 1 the file is cut into byte ranges at line ends, each encoded in a
process of its own into a part file; the parts are joined in order, so the result does not
depend on ``jobs``.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import multiprocessing as mp
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, InputError, Where, counted, option
from ..formats.files import inside, open_output
from ..formats.lock import FolderLock
from ..formats.peers.mmidx import (
    TokenDataset,
    TokenDatasetWriter,
    TokenMeta,
    check_layout,
    data_fingerprint,
    meta_path_of,
    paths_of,
    token_dtype,
)
from ..progress import Progress
from ..text.fairseq_dict import DictionaryTokenizer
from ..text.tokenizers import SentencePieceTokenizer, Tokenizer, make_tokenizer, unknown_tokens_warning

_LOG = logging.getLogger("seqshard")
BLOCK_BYTES = 1 << 20  # text read, decoded and handed to the tokenizer at once
RANGES_PER_JOB = 4  # byte ranges per process, so that uneven lines still share the work
UNKNOWN_PIECES_WARN_SHARE = 0.01  # of the tokens, pieces missing from a --dict before a warning


@dataclass
class BinarizeReport:
    """What ``binarize`` wrote: ``lines`` in = ``sequences`` out, always."""

    output: str
    lines: int
    sequences: int
    tokens: int
    unknown_tokens: int
    empty_lines: int
    dtype: str
    eos_id: int | None
    bytes: int
    seconds: float
    layout: str = "megatron"
    vocab_size: int = 0
    pad_id: int | None = None
    dictionary: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def format_text(self) -> str:
        ids = f"vocabulary {self.vocab_size}" + (f" of {self.dictionary}" if self.dictionary else "")
        ids += f", pad {self.pad_id if self.pad_id is not None else 'none'}"
        return (
            f"seqshard binarize -> {self.output}.bin/.idx/.json ({self.layout} layout)\n"
            f"  lines -> sequences : {self.lines} -> {self.sequences} ({self.empty_lines} empty)\n"
            f"  tokens             : {self.tokens} ({self.unknown_tokens} unknown), {self.dtype}, "
            f"eos {self.eos_id if self.eos_id is not None else 'not appended'}\n"
            f"  ids                : {ids}\n"
            f"  written            : {self.bytes / 1e6:.1f} MB in {self.seconds:.1f} s"
        )


@dataclass(frozen=True)
class _Range:
    text: str
    start: int
    end: int
    part: str
    tokenizer: Tokenizer
    eos: int | None
    dtype: str


@dataclass
class _Part:
    sizes: np.ndarray
    unknown: int
    empty: int


def binarize(
    text: str | Path,
    out_prefix: str | Path,
    tokenizer: str | Path | Tokenizer | None,
    *,
    dictionary: str | Path | None = None,
    layout: str = "megatron",
    jobs: int = 1,
    append_eos: bool = True,
    eos_id: int | None = None,
    split: str | None = None,
    progress: bool = True,
) -> BinarizeReport:
    """Tokenize ``text`` line by line into ``out_prefix.bin``/``.idx`` in Megatron's ``layout``
    or fairseq's, and ``out_prefix.json`` (the ids used). With ``dictionary`` (a fairseq
    ``dict.txt``) the ids are the dictionary's, of the tokenizer's pieces (a SentencePiece
    model), or of the text's own whitespace-separated pieces when ``tokenizer`` is None.
    ``eos_id`` overrides the end-of-sentence id."""
    started = time.perf_counter()
    text = Path(text)
    if not text.is_file():
        raise ConfigError(f"{text} does not exist (binarize reads a text file, one sentence per line).")
    if jobs < 1:
        raise ConfigError(f"need {option('jobs', 1)} or more, got {jobs}.")
    check_layout(layout)
    encoder = _encoder(tokenizer, dictionary, split)
    eos = _appended_eos(encoder, append_eos, eos_id)
    dtype = token_dtype(encoder.vocab_size, layout)
    bin_path, _ = paths_of(out_prefix)
    ranges = [
        _Range(str(text), start, end, str(bin_path.with_name(f".{bin_path.name}.range{n}")), encoder, eos, dtype.str)
        for n, (start, end) in enumerate(_line_ranges(text, jobs * RANGES_PER_JOB if jobs > 1 else 1))
    ]
    with FolderLock(bin_path.parent, "seqshard binarize", name=f".{bin_path.stem}.lock"):  # one writer per prefix
        for piece in ranges:
            inside(bin_path.parent, Path(piece.part))
        writer = TokenDatasetWriter(out_prefix, dtype, layout)
        remove_parts(out_prefix)
        meta_path_of(out_prefix).unlink(missing_ok=True)  # an old PREFIX.json never describes the new files
        unknown, empty, lines = _write(writer, ranges, jobs, text, progress)
        written = TokenDataset(out_prefix)  # read back: the report counts what is on disk
        eos_recorded = eos_id if eos_id is not None else encoder.eos_id
        meta = TokenMeta(
            layout=layout,
            dtype=str(dtype),
            sequences=len(written),
            tokens=written.num_tokens,
            data=data_fingerprint(out_prefix),
            vocab_size=encoder.vocab_size,
            eos_id=eos_recorded,
            eos_appended=eos is not None,
            pad_id=padding_id(encoder, eos_recorded),
            bos_id=getattr(encoder, "bos_id", None),
            unk_id=encoder.unk_id,
            tokenizer=_identity(tokenizer, encoder if dictionary is None else getattr(encoder, "pieces", None)),
            dictionary=_identity(dictionary, None),
        )
        meta.write(out_prefix)
    report = BinarizeReport(
        output=str(out_prefix),
        lines=lines,
        sequences=len(written),
        tokens=written.num_tokens,
        unknown_tokens=unknown,
        empty_lines=empty,
        dtype=str(dtype),
        eos_id=eos,
        bytes=written.bin_path.stat().st_size,
        seconds=time.perf_counter() - started,
        layout=layout,
        vocab_size=encoder.vocab_size,
        pad_id=meta.pad_id,
        dictionary=str(dictionary) if dictionary is not None else None,
    )
    _say_unusual(text, encoder, dictionary is not None, report)
    return report


def _appended_eos(encoder: Tokenizer, append_eos: bool, eos_id: int | None) -> int | None:
    """The id appended to each sentence (None: none); ConfigError when one is asked for and the
    tokenizer has none."""
    eos = (eos_id if eos_id is not None else encoder.eos_id) if append_eos else None
    if append_eos and eos is None:
        raise ConfigError(
            f"the {encoder.describe()} has no end-of-sentence id: pass {option('eos_id', 'ID')}, or "
            f"{option('append_eos', False)} to store the tokens alone."
        )
    return eos


def _write(
    writer: TokenDatasetWriter, ranges: list[_Range], jobs: int, text: Path, progress: bool
) -> tuple[int, int, int]:
    """Encode ``ranges`` of ``text`` (in ``jobs`` processes) into ``writer``'s files, each
    range's part removed once added (all of them, and the files, on a failure); the unknown
    tokens, the empty lines and the lines."""
    unknown = empty = lines = 0
    try:
        with Progress(progress) as bars:
            advance = bars.bar(f"binarize {text.name}", text.stat().st_size, unit="B")
            for piece, part in zip(ranges, _encode_ranges(ranges, jobs)):
                writer.add_bin(Path(piece.part), part.sizes)
                Path(piece.part).unlink()
                unknown += part.unknown
                empty += part.empty
                lines += len(part.sizes)
                advance(piece.end - piece.start)
        writer.finish()
    except BaseException:
        writer.abort()
        for piece in ranges:
            Path(piece.part).unlink(missing_ok=True)
        raise
    return unknown, empty, lines


def _say_unusual(text: Path, encoder: Tokenizer, by_dictionary: bool, report: BinarizeReport) -> None:
    """Warn of the unknown tokens and the empty lines ``report`` counts."""
    if by_dictionary:
        warning = _unknown_pieces_warning(encoder, report.tokens, report.unknown_tokens)
    else:
        warning = unknown_tokens_warning(encoder, report.tokens, report.unknown_tokens)
    if warning:
        _LOG.warning("%s", warning)
    if report.empty_lines:
        _LOG.warning(
            "%s: %s, each stored as a sequence of its own (kept for alignment)",
            text,
            counted(report.empty_lines, "empty line"),
        )


def padding_id(encoder: Tokenizer, eos: int | None) -> int:
    """The pad ``PREFIX.json`` records: the vocabulary's own; else an id that encoded text
    never holds, so that a loader never mistakes a token for padding: a SentencePiece model's
    ``<s>`` (a control symbol, which encoding never gives and binarize never appends), else
    ``vocab_size`` (one past every id: an embedding looked up at padding needs one row more)."""
    pad = getattr(encoder, "pad_id", None)
    if pad is not None:
        return int(pad)
    if isinstance(encoder, SentencePieceTokenizer):
        bos = encoder.bos_id
        if bos is not None and bos != eos and encoder.is_control(bos):
            return bos
    return max(encoder.vocab_size, eos + 1 if eos is not None else 0)


def _encoder(tokenizer: str | Path | Tokenizer | None, dictionary: str | Path | None, split: str | None) -> Tokenizer:
    """The tokenizer, or with a dictionary the tokenizer's pieces mapped through it."""
    if dictionary is None:
        if tokenizer is None:
            raise ConfigError(
                f"give a tokenizer (a SentencePiece .model or a units file), or {option('dictionary', 'dict.txt')}."
            )
        encoder = make_tokenizer(tokenizer, split)
        assert encoder is not None
        return encoder
    pieces = make_tokenizer(tokenizer, split)
    if pieces is not None and not isinstance(pieces, SentencePieceTokenizer):
        raise ConfigError(
            f"{option('dictionary', 'dict.txt')} maps the pieces of a SentencePiece model, not the ids of a {pieces.describe()}; "
            "leave the tokenizer out if the text is already split into pieces."
        )
    return DictionaryTokenizer(dictionary, pieces)


def _identity(path: str | Path | Tokenizer | None, encoder: Tokenizer | None) -> dict[str, str] | None:
    """``{"path", "sha256"}`` of a tokenizer or dictionary file, what a tokenizer object says
    of itself, or None."""
    if isinstance(path, (str, Path)):
        digest = hashlib.sha256()
        with open(path, "rb") as stream:
            while chunk := stream.read(1 << 20):
                digest.update(chunk)
        return {"path": str(path), "sha256": digest.hexdigest()}
    return {"describe": encoder.describe()} if encoder is not None else None


def _unknown_pieces_warning(encoder: Tokenizer, tokens: int, unknown: int) -> str | None:
    if not tokens or unknown / tokens <= UNKNOWN_PIECES_WARN_SHARE:
        return None
    return (
        f"{unknown} of {tokens} tokens ({unknown / tokens:.1%}) are pieces the {encoder.describe()} does not hold, "
        f"stored as <unk> ({encoder.unk_id}): was the dictionary made from this tokenizer's pieces "
        "(fairseq-preprocess of the spm_encode'd training text)?"
    )


def _line_ranges(path: Path, pieces: int) -> list[tuple[int, int]]:
    """About ``pieces`` byte ranges of ``path`` that start and end at line ends."""
    size = path.stat().st_size
    bounds = [0]
    with open(path, "rb") as stream:
        for k in range(1, pieces):
            stream.seek(max(size * k // pieces, bounds[-1]))
            stream.readline()  # to the end of the line the cut fell in
            position = stream.tell()
            if position < size and position > bounds[-1]:
                bounds.append(position)
    bounds.append(size)
    return [(start, end) for start, end in itertools.pairwise(bounds) if end > start] or [(0, 0)]


def _encode_ranges(ranges: list[_Range], jobs: int):
    if jobs <= 1 or len(ranges) == 1:
        yield from map(_encode_range, ranges)
        return
    with mp.get_context("spawn").Pool(min(jobs, len(ranges))) as pool:
        yield from pool.imap(_encode_range, ranges)


def _encode_range(piece: _Range) -> _Part:
    """Encode the lines of one byte range into its part file; returns their sizes."""
    dtype = np.dtype(piece.dtype)
    unk = piece.tokenizer.unk_id
    sizes: list[np.ndarray] = []
    unknown = empty = 0
    with open(piece.text, "rb") as stream, os.fdopen(open_output(Path(piece.part)), "wb") as part:
        for offset, lines in _blocks_of_lines(stream, piece):
            empty += sum(1 for line in lines if not line.strip())
            encoded = piece.tokenizer.encode_many(lines)
            if piece.eos is not None:
                for ids in encoded:
                    ids.append(piece.eos)
            lengths = np.fromiter(map(len, encoded), dtype=np.int32, count=len(encoded))
            flat = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int64, count=int(lengths.sum()))
            if flat.size and (flat.min() < 0 or flat.max() > np.iinfo(dtype).max):
                raise ConfigError(f"token ids {flat.min()}..{flat.max()} do not fit {dtype} (block at byte {offset}).")
            unknown += int(np.count_nonzero(flat == unk))
            part.write(flat.astype(dtype).tobytes())
            sizes.append(lengths)
    return _Part(np.concatenate(sizes) if sizes else np.zeros(0, np.int32), unknown, empty)


def _blocks_of_lines(stream, piece: _Range):
    """``(byte offset, lines)`` of the range in blocks of whole lines, decoded as UTF-8."""
    stream.seek(piece.start)
    position = piece.start
    carry = b""
    while position < piece.end or carry:
        chunk = stream.read(min(BLOCK_BYTES, piece.end - position)) if position < piece.end else b""
        position += len(chunk)
        data = carry + chunk
        cut = data.rfind(b"\n") + 1 if position < piece.end else len(data)
        block, carry = data[:cut], data[cut:]
        if not block:
            continue
        offset = position - len(carry) - len(block)
        try:
            text = block.decode("utf-8")
        except UnicodeDecodeError as error:
            _raise_not_utf8(piece.text, offset, block, error)
        lines = text.split("\n")
        if lines[-1] == "":
            lines.pop()
        yield offset, [line[:-1] if line.endswith("\r") else line for line in lines]


def _raise_not_utf8(path: str, offset: int, block: bytes, error: UnicodeDecodeError) -> None:
    with open(path, "rb") as stream:
        number = stream.read(offset).count(b"\n") + block[: error.start].count(b"\n") + 1
    column = error.start - block.rfind(b"\n", 0, error.start) - 1
    raise InputError(
        Where(path, number, None),
        "non_utf8",
        f"the line is not UTF-8 (byte {column} of the line).",
        "convert the file to UTF-8 (iconv); lines are never skipped, to keep parallel files aligned.",
        skippable=False,
    )


def remove_parts(out_prefix: str | Path) -> None:
    """Remove the part files a killed run left behind."""
    bin_path, _ = paths_of(out_prefix)
    for path in bin_path.parent.glob(f".{bin_path.name}.range*"):
        os.unlink(path)
