"""Tokenizers behind one protocol: a SentencePiece ``.model``, or a units file (``token id``
per line, as WeNet and Kaldi write; or ESPnet's ``token_list``, one token per line whose id is
its line number from 0) splitting into characters or words, unknowns to ``<unk>``.

Anything with the :class:`Tokenizer` protocol's methods may be given instead (``make_loader(...,
tokenizer=my_tokenizer)``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol, runtime_checkable

from ..errors import ConfigError, option
from ..formats.files import MAX_JSON_BYTES, read_input

EOS_UNITS = ("</s>", "<eos>", "<sos/eos>")
SPACE_UNITS = ("▁", "<space>")
_UNIT_ID = re.compile(r"[0-9]{1,10}")  # ASCII digits ("²" is a digit to str.isdigit, not to int)
MAX_UNIT_ID = 2**31 - 1  # labels are batched as int32-sized ids
UNKNOWN_WARN_AFTER = 2000  # tokens seen before the share of unknown tokens is judged
UNKNOWN_WARN_SHARE = 0.05


class SentencePieceTokenizer:
    """A SentencePiece model, loaded lazily (in each DataLoader worker, not pickled)."""

    def __init__(self, model: str | Path):
        self.model = str(model)
        if not Path(self.model).is_file():
            raise ConfigError(f"tokenizer model {self.model!r} does not exist.")
        self._processor = None
        try:
            self._load()  # here, once: a file that is no model fails now, not in a worker
        except (RuntimeError, OSError) as error:
            raise ConfigError(f"tokenizer {self.model!r} is not a SentencePiece model ({error}).") from None

    def __getstate__(self) -> dict:
        return {"model": self.model, "_processor": None}

    def _load(self):
        if self._processor is None:
            import sentencepiece

            self._processor = sentencepiece.SentencePieceProcessor(model_file=self.model)
        return self._processor

    def encode(self, text: str) -> list[int]:
        return self._load().encode(text, out_type=int)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """``encode`` of each text, in one call into SentencePiece (one thread)."""
        return self._load().encode(texts, out_type=int, num_threads=1)

    def encode_pieces_many(self, texts: list[str]) -> list[list[str]]:
        """The pieces (strings) of each text, as ``spm_encode --output_format=piece`` gives them."""
        return self._load().encode(texts, out_type=str, num_threads=1)

    @property
    def eos_id(self) -> int | None:
        """The model's end-of-sentence id (None when it has none)."""
        eos = int(self._load().eos_id())
        return eos if eos >= 0 else None

    @property
    def pad_id(self) -> int | None:
        """The model's padding id (None when it has none, SentencePiece's default)."""
        pad = int(self._load().pad_id())
        return pad if pad >= 0 else None

    @property
    def bos_id(self) -> int | None:
        bos = int(self._load().bos_id())
        return bos if bos >= 0 else None

    @property
    def vocab_size(self) -> int:
        return int(self._load().get_piece_size())

    def is_control(self, piece_id: int) -> bool:
        """Whether ``piece_id`` is a control symbol (``<s>``, ``</s>``): never a piece of encoded text."""
        return bool(self._load().is_control(piece_id))

    @property
    def unk_id(self) -> int:
        return int(self._load().unk_id())

    def describe(self) -> str:
        return f"SentencePiece model {self.model}"


class UnitsTokenizer:
    """A units file: ``token id`` per line (WeNet's ``units.txt``), or ESPnet's ``token_list``
    (``tokens.txt``): one token per line, its id the line's number from 0, as ESPnet's
    ``TokenIDConverter`` numbers them. The first line tells the two apart.
    ``split="char"`` maps each character (spaces to ``▁`` or ``<space>`` when the units have
    one, else to ``<unk>``); ``"word"`` maps each whitespace-separated word. ``split=None``
    chooses from the units: ``"char"`` when every unit other than ``<...>`` symbols is one
    character, else ``"word"``. With ``pieces`` (a SentencePiece model: ESPnet's ``bpemodel``,
    WeNet's ``bpe_model``) the text is split into the model's pieces, each mapped through the
    units (``split="piece"``), as ESPnet and WeNet give BPE ids."""

    def __init__(
        self, units: str | Path, split: str | None = None, unk: str = "<unk>", pieces: str | Path | None = None
    ):
        if split not in ((None, "piece") if pieces is not None else (None, "char", "word")):
            raise ConfigError(
                f"split must be 'char', 'word' or None (chosen from the units), or 'piece' with pieces=MODEL; got "
                f"{split!r}{' with pieces' if pieces is not None else ''}."
            )
        self.pieces = SentencePieceTokenizer(pieces) if pieces is not None else None
        self.units = str(units)
        try:
            lines = read_input(units, MAX_JSON_BYTES, what="a units file").decode("utf-8").splitlines()
        except OSError as error:  # missing, a FIFO, a device, a folder, too large
            raise ConfigError(f"units file {units}: {error.strerror}.") from None
        except UnicodeDecodeError as error:
            raise ConfigError(f"{units}: not UTF-8 text (byte {error.start}); is it a units file?") from None
        first = next((line.split() for line in lines if line.split()), [])
        self.token_list = len(first) == 1
        self.ids: dict[str, int] = self._token_list(lines) if self.token_list else self._units(lines)
        if unk not in self.ids:
            raise ConfigError(f"{units} has no {unk!r} unit for unknown tokens.")
        self.unk = self.ids[unk]
        self.space = next((self.ids[u] for u in SPACE_UNITS if u in self.ids), self.unk)
        self.split = "piece" if self.pieces is not None else split or self._split_of_units()

    def _units(self, lines: list[str]) -> dict[str, int]:
        """``TOKEN ID`` lines (blank lines ignored)."""
        ids: dict[str, int] = {}
        owners: dict[int, str] = {}
        for number, line in enumerate(lines, start=1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 2 or not _UNIT_ID.fullmatch(parts[1]) or int(parts[1]) > MAX_UNIT_ID:
                raise ConfigError(
                    f"{self.units}:{number}: expected 'TOKEN ID' with an ID from 0 to {MAX_UNIT_ID}, found {line[:80]!r}."
                )
            token, unit_id = parts[0], int(parts[1])
            if token in ids or unit_id in owners:
                clash = f"unit {token!r} again" if token in ids else f"id {unit_id} already for {owners[unit_id]!r}"
                raise ConfigError(f"{self.units}:{number}: {clash}; each unit needs one id of its own.")
            ids[token] = unit_id
            owners[unit_id] = token
        return ids

    def _token_list(self, lines: list[str]) -> dict[str, int]:
        """ESPnet's token list: line N (from 0) is the token of id N, so every line counts (blank
        lines at the end number no token and are left out)."""
        while lines and not lines[-1].strip():
            lines = lines[:-1]
        ids: dict[str, int] = {}
        for number, line in enumerate(lines):
            parts = line.split()
            where = f"{self.units}:{number + 1}"
            if len(parts) != 1:
                found = "an empty line" if not parts else repr(line)
                raise ConfigError(
                    f"{where}: found {found} in a token list (one token a line, its id the line's number from 0, as "
                    "its first line says): each line must hold one token; a units file has 'TOKEN ID' on every line."
                )
            if parts[0] in ids:
                raise ConfigError(
                    f"{where}: token {parts[0]!r} again (first on line {ids[parts[0]] + 1}); ESPnet refuses a "
                    "token twice."
                )
            ids[parts[0]] = number
        return ids

    def _split_of_units(self) -> str:
        plain = [u for u in self.ids if not (u.startswith("<") and u.endswith(">")) and u not in SPACE_UNITS]
        return "char" if all(len(u) == 1 for u in plain) else "word"

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        if self.pieces is not None:
            ids, unk = self.ids, self.unk
            return [[ids.get(piece, unk) for piece in pieces] for pieces in self.pieces.encode_pieces_many(texts)]
        return [self.encode(text) for text in texts]

    @property
    def eos_id(self) -> int | None:
        """The id of ``</s>``, ``<eos>`` or ``<sos/eos>`` (None when the units have none)."""
        return next((self.ids[u] for u in EOS_UNITS if u in self.ids), None)

    def encode(self, text: str) -> list[int]:
        if self.pieces is not None:
            return self.encode_many([text])[0]
        if self.split == "word":
            return [self.ids.get(word, self.unk) for word in text.split()]
        return [self.space if ch.isspace() else self.ids.get(ch, self.unk) for ch in text]

    @property
    def vocab_size(self) -> int:
        return max(self.ids.values()) + 1

    @property
    def unk_id(self) -> int:
        return self.unk

    def describe(self) -> str:
        kind = "token list" if self.token_list else "units file"
        split = f"pieces of {self.pieces.describe()}" if self.pieces is not None else f"{self.split}s"
        return f"{kind} {self.units} split into {split}"


@runtime_checkable
class Tokenizer(Protocol):
    """What a loader asks of a tokenizer: ids of a text (one or many), the vocabulary size, the
    unknown and end-of-sentence ids, and a line saying what it is (for messages)."""

    def encode(self, text: str) -> list[int]: ...

    def encode_many(self, texts: list[str]) -> list[list[int]]: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def unk_id(self) -> int: ...

    @property
    def eos_id(self) -> int | None: ...

    def describe(self) -> str: ...


def unknown_tokens_warning(tokenizer: Tokenizer, tokens: int, unknown: int) -> str | None:
    """A warning when too many label tokens are unknown to the tokenizer, else None."""
    if tokens == 0 or unknown / tokens <= UNKNOWN_WARN_SHARE:
        return None
    hint = "check that the labels are in the language and case the tokenizer was trained on"
    if isinstance(tokenizer, UnitsTokenizer):
        other = "word" if tokenizer.split == "char" else "char"
        hint = f"a units file of {other}s needs {option('split', other)}; or " + hint
    return (
        f"{unknown / tokens:.0%} of the first {tokens} label tokens map to the unknown token of the "
        f"{tokenizer.describe()}: {hint}."
    )


def make_tokenizer(spec: str | Path | Tokenizer | None, split: str | None = None) -> Tokenizer | None:
    """A tokenizer from a SentencePiece ``.model`` path, a units file or token list path, or as
    given."""
    if spec is None or not isinstance(spec, (str, Path)):
        return spec  # a tokenizer object (anything with encode(text) -> list[int])
    path = Path(spec)
    if path.is_dir():
        raise ConfigError(
            f"tokenizer {str(spec)!r} is a folder; give a SentencePiece .model, a units file or a token list."
        )
    if not path.is_file():
        raise ConfigError(
            f"tokenizer {str(spec)!r}: no such file (give a SentencePiece .model, a units file or a token list)."
        )
    with open(path, "rb") as stream:
        head = stream.read(64)
    if path.suffix in (".model", ".bpemodel") or b"\0" in head:
        return SentencePieceTokenizer(path)
    return UnitsTokenizer(path, split=split)
