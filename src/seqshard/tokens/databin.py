"""NLLB's ``data_bin``: fairseq's multilingual layout of language directions cut into shard
folders, found as fairseq's ``MultilingualDatasetManager`` (``translation_multi_simple_epoch``)
finds them.

``data_bin/shard000/train.eng_Latn-tur_Latn.eng_Latn.bin/.idx`` (+ the ``tur_Latn`` side, and
``dict.{lang}.txt``) is one direction's part in one shard folder. The rules, as fairseq's code
states them:

- A direction's shard count is the number of folders holding it; epoch ``k`` (fairseq counts
  from 1) reads folder ``(k - 1) mod count`` of those (``get_shard_id``). seqshard counts epochs
  from 0, so its epoch ``e`` reads folder ``e mod count``. A split other than ``train`` is read
  from the first folder only.
- A direction asked for as ``src-tgt`` but stored as ``tgt-src`` is read from those files
  (fairseq's reversed-direction rule); ``train1``, ``train2`` ... beside ``train`` in a folder
  are read with it (fairseq's ``combine``).
- Dictionaries are ``dict.{lang}.txt`` of the first folder; language tokens are
  ``__{lang}__`` (``lang_tok_style="multilingual"``; mBART's ``[{lang}]``), with the
  dictionary's id, or, for a token the dictionary lacks, the id fairseq's
  ``augment_dictionary`` gives it: appended after the dictionary, in the order of the language
  list (``langs``, else the sorted languages of the directions).
- ``encoder_langtok="src"`` prepends the source language's token to each source sentence
  (``"tgt"``: the target's; None: none); ``decoder_langtok=True`` the target language's to each
  target sentence. NLLB trains with both, the defaults here.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..formats.peers.mmidx import dtype_of, paths_of, read_layout
from ..text.fairseq_dict import FairseqDictionary
from .pairs import TokenPair

LANG_TOK_STYLES = {"multilingual": "__{}__", "mbart": "[{}]"}  # fairseq's get_lang_tok
SHARD_MODES = ("epoch", "all", "first")
_NUMBERS = re.compile(r"(\d+)")
SAMPLED_BYTES = 1 << 12  # of each .bin's head and tail whose ids are checked against its dictionary


@dataclass(frozen=True)
class Part:
    """One direction's files in one shard folder: a pair of datasets and its sentence count."""

    pair: TokenPair
    size: int


@dataclass(frozen=True)
class Direction:
    """A language direction of a data_bin: its parts in each shard folder that holds it (in
    folder order; a folder's parts are ``train``, ``train1``, ...), and which of them an epoch
    reads (``shards``: ``"epoch"`` one folder per epoch, ``"all"`` every folder, ``"first"``
    the first)."""

    src_lang: str
    tgt_lang: str
    folders: tuple[str, ...]
    shards: tuple[tuple[Part, ...], ...]
    mode: str = "epoch"

    @property
    def name(self) -> str:
        return f"{self.src_lang}-{self.tgt_lang}"

    def __str__(self) -> str:
        return self.name

    def __len__(self) -> int:
        """Sentences of the folders it is read from over the epochs: its size for temperature
        sampling (fairseq sums its shards' sizes)."""
        read = self.shards[:1] if self.mode == "first" else self.shards
        return sum(part.size for parts in read for part in parts)

    def parts(self, epoch: int) -> tuple[Part, ...]:
        """What epoch ``epoch`` (from 0) reads of it."""
        if self.mode == "all":
            return tuple(part for parts in self.shards for part in parts)
        if self.mode == "first":
            return self.shards[0]
        return self.shards[epoch % len(self.shards)]

    def folder(self, epoch: int) -> str | None:
        """The shard folder epoch ``epoch`` reads (None when it reads them all)."""
        if self.mode == "all":
            return None
        return self.folders[0 if self.mode == "first" else epoch % len(self.folders)]

    def fingerprint(self) -> str:
        """What a loader state must agree on: the folders, files, their sizes and the mode."""
        digest = hashlib.sha256(f"{self.name}\0{self.mode}\n".encode())
        for parts in self.shards:
            for part in parts:
                size = paths_of(part.pair.src)[0].stat().st_size
                digest.update(
                    f"{part.pair}\0{part.size}\0{size}\0{part.pair.src_lang_id}\0{part.pair.tgt_lang_id}\n".encode()
                )
        return digest.hexdigest()[:16]


@dataclass(frozen=True)
class DataBin:
    """The directions :func:`token_pairs` found (iterate it, or ``seqshard.mux`` it), with the
    dictionaries and language-token ids they use. Given to ``make_token_loader`` as it is,
    every sentence of what an epoch reads is read once (fairseq's ``--sampling-method concat``);
    ``seqshard.mux(data_bin, temperature=T)`` samples the directions by size at a temperature."""

    root: str
    split: str
    folders: tuple[str, ...]
    directions: tuple[Direction, ...]
    dictionaries: dict[str, str]
    lang_tokens: dict[str, int]  # "__eng_Latn__" -> its id (in the first dictionary asked for it)

    def __iter__(self) -> Iterator[Direction]:
        return iter(self.directions)

    def __len__(self) -> int:
        return len(self.directions)

    def __getitem__(self, name: str) -> Direction:
        for direction in self.directions:
            if direction.name == name:
                return direction
        raise KeyError(f"{name!r} is not a direction of {self.root} (it has {', '.join(map(str, self))})")


def token_pairs(
    data_bin: str | Path | Sequence[str | Path],
    lang_pairs: Sequence[str] | str | None = None,
    split: str = "train",
    *,
    shards: str | None = None,
    langs: Sequence[str] | None = None,
    encoder_langtok: str | None = "src",
    decoder_langtok: bool = True,
    lang_tok_style: str = "multilingual",
) -> DataBin:
    """The language directions of a ``data_bin`` (a folder of shard folders, one folder, or a
    list of folders in order, fairseq's ``data`` path list), as fairseq's multilingual task reads
    them (see the module docstring). ``lang_pairs``: ``["eng_Latn-tur_Latn", ...]`` or a comma
    list (fairseq's ``--lang-pairs``); None takes every direction found. ``shards``: ``"epoch"``
    (one shard folder per epoch, the default for ``split="train"``), ``"all"`` (every folder
    every epoch) or ``"first"`` (the first folder, the default for other splits)."""
    mode = shards or ("epoch" if split == "train" else "first")
    if mode not in SHARD_MODES:
        raise ConfigError(f"shards must be one of {', '.join(map(repr, SHARD_MODES))}, got {shards!r}.")
    if lang_tok_style not in LANG_TOK_STYLES:
        raise ConfigError(
            f"lang_tok_style must be one of {', '.join(map(repr, LANG_TOK_STYLES))}, got {lang_tok_style!r}."
        )
    if encoder_langtok not in ("src", "tgt", None):
        raise ConfigError(f"encoder_langtok must be 'src', 'tgt' or None, got {encoder_langtok!r}.")
    folders = _shard_folders(data_bin, split)
    searched = folders if mode != "first" else folders[:1]
    found = [_directions_in(folder, split) for folder in searched]
    wanted = _wanted(lang_pairs, found, searched, split)
    languages = list(langs) if langs is not None else sorted({lang for pair in wanted for lang in pair})
    missing = sorted({lang for pair in wanted for lang in pair} - set(languages))
    if missing:
        raise ConfigError(
            f"langs lacks {', '.join(missing)}, a language of the directions (fairseq refuses a pair whose languages "
            "are not in --langs): add them to langs."
        )
    style = LANG_TOK_STYLES[lang_tok_style]
    dictionaries = {lang: folders[0] / f"dict.{lang}.txt" for lang in sorted({x for pair in wanted for x in pair})}
    token_ids = _LangTokens(dictionaries, languages, style)
    directions = []
    for src, tgt in wanted:
        src_id = token_ids.id(src, src if encoder_langtok == "src" else tgt) if encoder_langtok else None
        tgt_id = token_ids.id(tgt, tgt) if decoder_langtok else None
        holding = [(folder, parts.get((src, tgt)) or parts.get((tgt, src))) for folder, parts in zip(searched, found)]
        holding = [(folder, prefixes) for folder, prefixes in holding if prefixes]
        sizes = {src: token_ids.size(src), tgt: token_ids.size(tgt)}
        shards_of = tuple(_parts(prefixes, src, tgt, src_id, tgt_id, sizes) for _, prefixes in holding)
        directions.append(Direction(src, tgt, tuple(str(folder) for folder, _ in holding), shards_of, mode))
    return DataBin(
        str(data_bin) if isinstance(data_bin, (str, Path)) else str(folders[0].parent),
        split,
        tuple(str(folder) for folder in folders),
        tuple(directions),
        {lang: str(path) for lang, path in dictionaries.items()},
        dict(sorted(token_ids.found.items())),
    )


def _shard_folders(data_bin: str | Path | Sequence[str | Path], split: str) -> list[Path]:
    """The shard folders in order: those given, or the folder itself when it holds the split's
    files, else its sub-folders that do, in natural order (``shard2`` before ``shard10``)."""
    if not isinstance(data_bin, (str, Path)):
        folders = [Path(folder) for folder in data_bin]
        for folder in folders:
            if not folder.is_dir():
                raise ConfigError(f"{folder} is not a folder (token_pairs takes shard folders of a data_bin).")
        if not folders:
            raise ConfigError("token_pairs: give a data_bin folder or a list of its shard folders.")
        return folders
    root = Path(data_bin)
    if not root.is_dir():
        raise ConfigError(f"{root} is not a folder (a data_bin holds shard folders of .bin/.idx files).")
    if _holds_split(root, split):
        return [root]
    folders = sorted((p for p in root.iterdir() if p.is_dir() and _holds_split(p, split)), key=_natural)
    if not folders:
        raise ConfigError(
            f"{root} holds no {split}.SRC-TGT.LANG.idx files, nor folders that do (a data_bin's shard folders hold "
            f"files such as {split}.eng_Latn-tur_Latn.eng_Latn.idx): check the folder and the split."
        )
    return folders


def _natural(path: Path) -> list:
    return [int(piece) if piece.isdigit() else piece for piece in _NUMBERS.split(path.name)]


def _file_pattern(split: str) -> re.Pattern:
    """``{split}{k}.{src}-{tgt}.{lang}.idx``: the file names fairseq's multilingual task reads."""
    return re.compile(rf"^{re.escape(split)}(\d*)\.([^.\-]+)-([^.\-]+)\.([^.]+)\.idx$")


def _holds_split(folder: Path, split: str) -> bool:
    pattern = _file_pattern(split)
    return any(pattern.match(path.name) for path in folder.iterdir() if path.is_file())


def _directions_in(folder: Path, split: str) -> dict[tuple[str, str], list[str]]:
    """The directions stored in ``folder`` (as the files name them), each with the prefixes of
    its parts (``train.SRC-TGT``, then ``train1.SRC-TGT``, ...), checked to have both sides."""
    pattern = _file_pattern(split)
    sides: dict[tuple[str, str, int], set[str]] = {}
    for path in folder.iterdir():
        match = pattern.match(path.name)
        if match:
            k, src, tgt, lang = match.groups()
            sides.setdefault((src, tgt, int(k) if k else 0), set()).add(lang)
    found: dict[tuple[str, str], list[str]] = {}
    for (src, tgt, k), langs in sorted(sides.items()):
        prefix = f"{folder / split}{k or ''}.{src}-{tgt}"
        lacking = [lang for lang in (src, tgt) if lang not in langs]
        if lacking:
            raise ConfigError(
                f"{prefix}.{lacking[0]}.idx is missing: a direction needs both sides ({prefix}.{src} and .{tgt}); "
                "binarize the other side, or remove the direction's files."
            )
        parts = found.setdefault((src, tgt), [])
        if k != len(parts):  # fairseq reads train, train1, ... and stops at the first one missing
            raise ConfigError(
                f"{prefix}.*: {split}{k} comes after a gap ({split}{len(parts) or ''}.{src}-{tgt}.* is missing); fairseq "
                f"reads {split}, {split}1, {split}2, ... up to the first one missing: rename the parts."
            )
        parts.append(prefix)
    return found


def _wanted(
    lang_pairs: Sequence[str] | str | None,
    found: list[dict[tuple[str, str], list[str]]],
    folders: list[Path],
    split: str,
) -> list[tuple[str, str]]:
    """The directions to read: ``lang_pairs`` (each found as itself or reversed), or every
    direction found, in sorted order."""
    stored = {direction for parts in found for direction in parts}
    if lang_pairs is None:
        return sorted(stored)
    if isinstance(lang_pairs, str):
        lang_pairs = lang_pairs.split(",")
    wanted = []
    for name in lang_pairs:
        langs = name.strip().split("-")
        if len(langs) != 2 or not all(langs):
            raise ConfigError(f"lang_pairs: {name!r} is not SRC-TGT (e.g. 'eng_Latn-tur_Latn').")
        src, tgt = langs
        if (src, tgt) not in stored and (tgt, src) not in stored:
            listed = ", ".join(f"{a}-{b}" for a, b in sorted(stored)) or "none"
            where = f"{folders[0]}" if len(folders) == 1 else f"{len(folders)} shard folders ({folders[0]} ...)"
            raise ConfigError(f"lang_pairs: {name} is not in {where} (its {split} directions: {listed}).")
        wanted.append((src, tgt))
    if len(set(wanted)) != len(wanted):
        raise ConfigError(f"lang_pairs names a direction twice: {', '.join(lang_pairs)}.")
    return wanted


def _parts(
    prefixes: list[str], src: str, tgt: str, src_id: int | None, tgt_id: int | None, sizes: dict[str, tuple[int, Path]]
) -> tuple[Part, ...]:
    """Direction ``src-tgt``'s parts in one folder, from their stored prefixes (either name);
    ``sizes``: each language's dictionary size and file, which the ids must stay below."""
    parts = []
    for prefix in prefixes:
        pair = TokenPair(f"{prefix}.{src}", f"{prefix}.{tgt}", src_id, tgt_id)
        count, other = _sequences(pair.src, *sizes[src]), _sequences(pair.tgt, *sizes[tgt])
        if other != count:
            raise ConfigError(
                f"{pair.src} holds {count} sentences but {pair.tgt} {other}: the two sides of a direction need one "
                "target per source (binarize both sides of the same parallel files)."
            )
        parts.append(Part(pair, count))
    return tuple(parts)


def _sequences(prefix: str, vocab: int, dictionary: Path) -> int:
    """The sentence count in a ``.idx`` header (the file's pages are not read), once its
    ``.bin`` is known to exist; the whole index is checked when an epoch opens it. The ids at
    the ``.bin``'s head and tail must be below ``vocab``, the size of its ``dictionary``: a
    ``.bin`` binarized with another dictionary would give other words' ids, and ids past the
    dictionary would be taken for language tokens."""
    bin_path, idx_path = paths_of(prefix)
    if not bin_path.is_file():
        raise ConfigError(f"{bin_path} does not exist (a token dataset is PREFIX.bin + PREFIX.idx).")
    index = np.memmap(idx_path, dtype=np.uint8, mode="r")
    try:
        layout, code, count, _ = read_layout(index, idx_path)
    finally:
        del index
    dtype = dtype_of(layout, code, idx_path)
    with open(bin_path, "rb") as stream:
        head = stream.read(SAMPLED_BYTES)
        stream.seek(max(0, bin_path.stat().st_size - SAMPLED_BYTES))
        tail = stream.read()
    for part in (head, tail):
        ids = np.frombuffer(part[: len(part) - len(part) % dtype.itemsize], dtype=dtype)
        if len(ids) and int(ids.max()) >= vocab:
            raise ConfigError(
                f"{bin_path} holds token id {int(ids.max())}, but {dictionary} has {vocab} ids (0 to {vocab - 1}, "
                "fairseq's four specials first): it was binarized with another dictionary. Fix: binarize it again "
                "with this dictionary, or put the dictionary it was made with in the first shard folder."
            )
    return int(count)


class _LangTokens:
    """Language-token ids as fairseq's multilingual task gives them: each ``dict.{lang}.txt``
    loaded once per distinct content, a token it lacks appended after it in ``languages``
    order (``augment_dictionary``)."""

    def __init__(self, dictionaries: dict[str, Path], languages: list[str], style: str):
        self.dictionaries = dictionaries
        self.languages = languages
        self.style = style
        self._loaded: dict[str, dict[str, int]] = {}  # content digest -> token ids after augmenting
        self._sizes: dict[str, int] = {}  # content digest -> the dictionary's ids
        self._size_of: dict[Path, int] = {}
        self._digest_of: dict[Path, str] = {}  # each file read and hashed once
        self.found: dict[str, int] = {}

    def id(self, dictionary_lang: str, lang: str) -> int:
        """The id of ``lang``'s token in the dictionary of ``dictionary_lang``."""
        token = self.style.format(lang)
        ids = self._augmented(dictionary_lang)
        self.found.setdefault(token, ids[token])
        return ids[token]

    def size(self, lang: str) -> tuple[int, Path]:
        """The size of ``lang``'s dictionary (its ids, language tokens not added) and its file."""
        self._augmented(lang)
        return self._size_of[self.dictionaries[lang]], self.dictionaries[lang]

    def _augmented(self, dictionary_lang: str) -> dict[str, int]:
        path = self.dictionaries[dictionary_lang]
        if path in self._digest_of:
            return self._loaded[self._digest_of[path]]
        if not path.is_file():
            raise ConfigError(
                f"{path} does not exist: fairseq's multilingual task reads dict.{{lang}}.txt for every language "
                "from the first shard folder (copy the dictionary there under that name)."
            )
        digest = self._digest_of[path] = hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()
        if digest not in self._loaded:
            dictionary = FairseqDictionary(path)
            tokens = {}
            size = self._sizes[digest] = len(dictionary)
            for lang in self.languages:
                token = self.style.format(lang)
                if token in dictionary.ids:
                    tokens[token] = dictionary.ids[token]
                else:
                    tokens[token] = size
                    size += 1
            self._loaded[digest] = tokens
        self._size_of[path] = self._sizes[digest]
        return self._loaded[digest]
