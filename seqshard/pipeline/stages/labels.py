"""Labels at load time: an optional override file, and tokenization on the fly.

Shards store labels as text, so changing the tokenizer never needs a repack; a Kaldi
``text`` file given at load time replaces the shards' labels by key (relabel without
repacking). Tokenizers: a SentencePiece ``.model``, or a units file (``token id`` per line,
as WeNet and ESPnet write) splitting into characters or words, unknowns to ``<unk>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ...errors import ConfigError, InputError, SkipCounter, Where, option
from ...formats.keytable import KeyTable
from .base import Map, Stage
from .decode import LABEL_FIELD
from .filters import TOKENS_FIELD
from .sample import Sample

EOS_UNITS = ("</s>", "<eos>", "<sos/eos>")
SPACE_UNITS = ("▁", "<space>")
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

    @property
    def eos_id(self) -> int | None:
        """The model's end-of-sentence id (None when it has none)."""
        eos = int(self._load().eos_id())
        return eos if eos >= 0 else None

    @property
    def vocab_size(self) -> int:
        return int(self._load().get_piece_size())

    @property
    def unk_id(self) -> int:
        return int(self._load().unk_id())

    def describe(self) -> str:
        return f"SentencePiece model {self.model}"


class UnitsTokenizer:
    """A units file (``token id`` per line). ``split="char"`` maps each character (spaces to
    ``▁`` or ``<space>`` when the units have one, else to ``<unk>``); ``"word"`` maps each
    whitespace-separated word. ``split=None`` chooses from the units: ``"char"`` when every
    unit other than ``<...>`` symbols is one character, else ``"word"``."""

    def __init__(self, units: str | Path, split: str | None = None, unk: str = "<unk>"):
        if split not in (None, "char", "word"):
            raise ConfigError(f"split must be 'char', 'word' or None (chosen from the units), got {split!r}.")
        self.units = str(units)
        self.ids: dict[str, int] = {}
        try:
            lines = Path(units).read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as error:
            raise ConfigError(f"{units}: not UTF-8 text (byte {error.start}); is it a units file?") from None
        owners: dict[int, str] = {}
        for number, line in enumerate(lines, start=1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
                raise ConfigError(f"{units}:{number}: expected 'TOKEN ID', found {line!r}.")
            token, unit_id = parts[0], int(parts[1])
            if token in self.ids or unit_id in owners:
                clash = (
                    f"unit {token!r} again" if token in self.ids else f"id {unit_id} already for {owners[unit_id]!r}"
                )
                raise ConfigError(f"{units}:{number}: {clash}; each unit needs one id of its own.")
            self.ids[token] = unit_id
            owners[unit_id] = token
        if unk not in self.ids:
            raise ConfigError(f"{units} has no {unk!r} unit for unknown tokens.")
        self.unk = self.ids[unk]
        self.space = next((self.ids[u] for u in SPACE_UNITS if u in self.ids), self.unk)
        self.split = split or self._split_of_units()

    def _split_of_units(self) -> str:
        plain = [u for u in self.ids if not (u.startswith("<") and u.endswith(">")) and u not in SPACE_UNITS]
        return "char" if all(len(u) == 1 for u in plain) else "word"

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    @property
    def eos_id(self) -> int | None:
        """The id of ``</s>``, ``<eos>`` or ``<sos/eos>`` (None when the units have none)."""
        return next((self.ids[u] for u in EOS_UNITS if u in self.ids), None)

    def encode(self, text: str) -> list[int]:
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
        return f"units file {self.units} split into {self.split}s"


Tokenizer = SentencePieceTokenizer | UnitsTokenizer


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
    """A tokenizer from a SentencePiece ``.model`` path, a units file path, or as given."""
    if spec is None or not isinstance(spec, (str, Path)):
        return spec  # a tokenizer object (anything with encode(text) -> list[int])
    path = Path(spec)
    if path.is_dir():
        raise ConfigError(f"tokenizer {str(spec)!r} is a folder; give a SentencePiece .model or a units file.")
    if not path.is_file():
        raise ConfigError(f"tokenizer {str(spec)!r}: no such file (give a SentencePiece .model or a units file).")
    with open(path, "rb") as stream:
        head = stream.read(64)
    if path.suffix in (".model", ".bpemodel") or b"\0" in head:
        return SentencePieceTokenizer(path)
    return UnitsTokenizer(path, split=split)


class LabelOverride:
    """Labels from Kaldi ``text`` files, looked up by key (compact: no per-key Python objects)."""

    def __init__(self, files: str | Path | Sequence[str | Path]):
        paths = [Path(files)] if isinstance(files, (str, Path)) else [Path(f) for f in files]
        for path in paths:
            if path.is_dir():
                raise ConfigError(f"label file {str(path)!r} is a folder; give Kaldi text file(s).")
            if not path.is_file():
                raise ConfigError(f"label file {str(path)!r} does not exist.")
        try:
            self.table = KeyTable.scan(paths, SkipCounter(False), needs_value=False)
            self.table.report_repeats(
                SkipCounter(False),
                "duplicate_label",
                "the key already has a label at {first}.",
                "remove duplicate lines.",
            )
        except InputError as error:
            error.skippable = False  # the label files are settings: fix them, nothing is skipped
            raise

    def get(self, key: str) -> str | None:
        found = self.table.find(key)
        return None if found is None else found[1]


class Labeler:
    """Sample -> Sample with its label (field ``txt``) from the override file (if any) and its
    tokens (field ``tokens``, an int64 array; if a tokenizer); a key missing from the override
    raises InputError (reason ``no_label``)."""

    def __init__(self, tokenizer: Tokenizer | None, override: LabelOverride | None = None, strip_spaces: bool = False):
        self.tokenizer = tokenizer
        self.override = override
        self.strip_spaces = strip_spaces

    def __call__(self, sample: Sample) -> Sample:
        text = sample.fields.get(LABEL_FIELD, "")
        if self.override is not None:
            label = self.override.get(sample.key)
            if label is None:
                raise InputError(
                    Where(", ".join(map(str, self.override.table.files)), None, sample.key),
                    "no_label",
                    "the label file given at load time has no line for this key.",
                    "add it.",
                )
            text = label
        if self.strip_spaces:
            text = "".join(text.split())
        sample.fields[LABEL_FIELD] = text
        if self.tokenizer is not None:
            sample.fields[TOKENS_FIELD] = np.asarray(self.tokenizer.encode(text), dtype=np.int64)
        return sample


class Labels(Map[Sample]):
    """Applies a :class:`Labeler`, counting label tokens and unknown tokens (``tokens``,
    ``unknown_tokens`` in stats); with ``skip`` a sample whose label is missing is counted
    under ``dropped.no_label`` instead of raising."""

    def __init__(self, source: Stage[Sample], labeler: Labeler, skip: SkipCounter | None = None):
        super().__init__(source, labeler, skip)
        self.unk_id = labeler.tokenizer.unk_id if labeler.tokenizer is not None else None

    def next(self) -> Sample:
        sample = super().next()
        tokens = sample.fields.get(TOKENS_FIELD)
        if tokens is not None:
            self.count("tokens", len(tokens))
            self.count("unknown_tokens", int(np.count_nonzero(tokens == self.unk_id)))
        return sample
