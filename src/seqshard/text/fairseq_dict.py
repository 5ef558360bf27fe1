"""A fairseq ``dict.txt`` as a tokenizer: text -> SentencePiece pieces -> the dictionary's ids.

The ids are those of fairseq's ``Dictionary.load`` (fairseq 0.12): ``<s>`` 0, ``<pad>`` 1,
``</s>`` 2, ``<unk>`` 3, then one id per line of the file, in order. A line is ``PIECE COUNT``
(split at its last space, after trailing whitespace is stripped), optionally followed by
``#fairseq:overwrite``, which lets a piece appear again (the new line gets a new id and the
piece maps to it; the old id stays taken). A piece twice without the flag, or a line without a
count, is an error naming the line.

Like ``fairseq-preprocess`` on text made with ``spm_encode --output_format=piece``, a line's
pieces are split on whitespace, each mapped through the dictionary (unknown pieces to
``<unk>``), and ``</s>`` is appended by the caller. Without a SentencePiece model the text is
taken as already split (whitespace-separated pieces).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from ..formats.files import MAX_JSON_BYTES, read_input
from .tokenizers import SentencePieceTokenizer

SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # ids 0-3, before the file's lines
OVERWRITE = "#fairseq:overwrite"


class FairseqDictionary:
    """The ids of a ``dict.txt``: ``index(piece)``, ``len()``; ``bos_id``, ``pad_id``,
    ``eos_id``, ``unk_id`` are 0-3."""

    bos_id, pad_id, eos_id, unk_id = range(4)

    def __init__(self, path: str | Path):
        self.path = str(path)
        self.ids: dict[str, int] = {piece: number for number, piece in enumerate(SPECIALS)}
        self.size = len(SPECIALS)
        try:
            text = read_input(path, MAX_JSON_BYTES, what="a dictionary").decode("utf-8")
            lines = text.split("\n")  # \r\n and \r read as \n, as fairseq reads
        except FileNotFoundError:
            raise ConfigError(
                f"dictionary {self.path} does not exist (a fairseq dict.txt: 'PIECE COUNT' per line)."
            ) from None
        except OSError as error:  # a FIFO, a device, a folder, a file beyond any dictionary
            raise ConfigError(f"dictionary {self.path}: {error.strerror}; give a fairseq dict.txt.") from None
        except UnicodeDecodeError as error:
            raise ConfigError(f"{self.path}: not UTF-8 text (byte {error.start}); is it a fairseq dict.txt?") from None
        if lines[-1] == "":
            lines.pop()
        for number, line in enumerate(lines, start=1):
            self._add(line, number)

    def _add(self, line: str, number: int) -> None:
        piece, space, field = line.rstrip().rpartition(" ")
        overwrite = bool(space) and field == OVERWRITE
        if overwrite:
            piece, space, field = piece.rpartition(" ")
        if not space or not _is_count(field):
            raise ConfigError(
                f"{self.path}:{number}: expected 'PIECE COUNT' (optionally '{OVERWRITE}'), found {line!r}."
            )
        if piece in self.ids and not overwrite:
            raise ConfigError(
                f"{self.path}:{number}: {piece!r} again; fairseq refuses a piece twice unless its line ends "
                f"with {OVERWRITE}."
            )
        self.ids[piece] = self.size
        self.size += 1

    def __len__(self) -> int:
        return self.size

    def index(self, piece: str) -> int:
        return self.ids.get(piece, self.unk_id)


def _is_count(field: str) -> bool:
    try:
        int(field)
    except ValueError:
        return False
    return True


class DictionaryTokenizer:
    """The :class:`~seqshard.text.tokenizers.Tokenizer` of a fairseq dictionary: pieces from
    ``pieces`` (a SentencePiece model), or the text's own whitespace-separated words when None,
    mapped to the dictionary's ids."""

    def __init__(self, dictionary: str | Path | FairseqDictionary, pieces: SentencePieceTokenizer | None = None):
        self.dictionary = dictionary if isinstance(dictionary, FairseqDictionary) else FairseqDictionary(dictionary)
        self.pieces = pieces

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        if self.pieces is not None:  # the line spm_encode --output_format=piece writes
            texts = [" ".join(pieces) for pieces in self.pieces.encode_pieces_many(texts)]
        ids, unk = self.dictionary.ids, self.dictionary.unk_id
        # fairseq's tokenize_line splits on runs of whitespace (re's \s), as str.split() does
        return [[ids.get(word, unk) for word in text.split()] for text in texts]

    def encode(self, text: str) -> list[int]:
        return self.encode_many([text])[0]

    @property
    def vocab_size(self) -> int:
        return len(self.dictionary)

    @property
    def unk_id(self) -> int:
        return self.dictionary.unk_id

    @property
    def eos_id(self) -> int:
        return self.dictionary.eos_id

    @property
    def pad_id(self) -> int:
        return self.dictionary.pad_id

    @property
    def bos_id(self) -> int:
        return self.dictionary.bos_id

    def describe(self) -> str:
        source = f"pieces of {self.pieces.describe()}" if self.pieces is not None else "whitespace-separated pieces"
        return f"fairseq dictionary {self.dictionary.path} ({source})"
