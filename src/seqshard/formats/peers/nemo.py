"""NVIDIA NeMo's manifests: one JSON object a line, ``{"audio_filepath", "duration", "text",
"offset"?, ...}``, read as NeMo reads them.

- Audio: ``audio_filepath`` (or ``audio_filename``); a relative path is taken from the
  manifest's folder when the file is there, else as written (NeMo's ``get_full_path``).
- Text: ``text``, else ``normalized_text``, else empty (NeMo's ``__parse_item``).
- A cut: ``offset`` seconds into the file, ``duration`` seconds long. Without ``offset`` the
  whole file is the utterance and ``duration`` its length.
- Key: the entry's ``id`` when it has one; else the file's stem, and for a cut
  ``STEM-OFFSET-DURATION`` in hundredths of a second, six digits each (the cut ids NeMo's
  Lhotse adapter gives: ``ES2011a-000146-000136``).
- Other keys (``speaker``, ``lang``, ...) are the entry's extra fields.
- Sharded manifests: NeMo writes braces as ``_OP_`` and ``_CL_`` (``manifest__OP_0..127_CL_.json``),
  and its ``expand_sharded_filepaths`` reads ``(…)``, ``[…]`` and ``<…>`` as braces too:
  :func:`manifest_files` expands the manifests of ``pack --manifest`` by that rule
  (:func:`~..patterns.nemo_braces`).

A manifest given to the loader is read like a WeNet raw list (:class:`ManifestSampleStream`);
``seqshard pack --manifest`` packs one (``prep/nemo_source.py``). The tarred sets NeMo makes
from manifests are read by ``formats/peers/nemo_tarred.py``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ConfigError, InputError, Where, option
from ..index_entries import MAX_SECONDS
from ..patterns import FIELD_SET_NAME, expand_braces, kinds_in_folder, nemo_braces
from .lists import ListSampleStream, first_line, scan_list

AUDIO_KEYS = ("audio_filepath", "audio_filename")
TEXT_KEYS = ("text", "normalized_text")
ID_KEY = "id"
SHARD_KEY = "shard_id"  # the tar of a tarred set's entry (nemo_tarred.py)
READ_KEYS = frozenset({*AUDIO_KEYS, *TEXT_KEYS, ID_KEY, SHARD_KEY, "duration", "offset"})  # not extra fields
MANIFEST_FIX = 'each line is a JSON object with "audio_filepath" and "duration" (NeMo\'s manifest format).'


def manifest_files(patterns: str | Path | Sequence[str | Path], name: str = "manifest") -> list[Path]:
    """The manifest files ``patterns`` name, expanded as NeMo expands a manifest path
    (:func:`~..patterns.nemo_braces`: ``{…}``, ``_OP_…_CL_``, ``(…)``, ``[…]``, ``<…>``), each
    once, in order; ConfigError for a pattern that names no file or too many."""
    items = [patterns] if isinstance(patterns, (str, Path)) else list(patterns)
    if not items:
        raise ConfigError(f"{option(name, '...')}: give at least one manifest.")
    files: dict[Path, None] = {}
    for item in items:
        try:
            texts = expand_braces(nemo_braces(str(item)), escape=False)
        except ConfigError as error:
            raise ConfigError(f"{option(name, item)}: {error}") from None
        for folder, in_folder in itertools.groupby(texts, os.path.dirname):
            names = [os.path.basename(text) for text in in_folder]
            for file, kind in zip(names, kinds_in_folder(Path(folder or "."), names)):
                path = Path(folder, file)
                if kind != "file":
                    raise ConfigError(
                        f"{option(name, item)}: {path} {'is a folder' if kind else 'does not exist'}; give NeMo "
                        "manifest files (braces, NeMo's _OP_…_CL_, (…), […] and <…> expand to several; wildcards "
                        "are not expanded, as in NeMo)."
                    )
                files[path] = None
    return list(files)


@dataclass(frozen=True)
class Entry:
    """One manifest line: ``record`` is its object, ``audio`` its path as written."""

    record: dict[str, Any]
    audio: str
    duration: float
    offset: float | None
    text: str

    @property
    def segment(self) -> tuple[float, float] | None:
        """``(start, end)`` seconds of a cut entry, None for a whole file."""
        return None if self.offset is None else (self.offset, self.offset + self.duration)

    def stable_key(self) -> str:
        """The entry's ``id``, else its file's stem (with ``-OFFSET-DURATION`` for a cut)."""
        if ID_KEY in self.record and isinstance(self.record[ID_KEY], (str, int)) and str(self.record[ID_KEY]):
            return str(self.record[ID_KEY])
        stem = Path(self.audio).stem
        if self.offset is None:
            return stem
        return f"{stem}-{round(self.offset * 100):06d}-{round(self.duration * 100):06d}"

    def extra(self, names: Sequence[str] | None = None) -> dict[str, Any]:
        """The entry's other keys (those of ``names``, or all that can name a field)."""
        if names is not None:
            return {name: self.record[name] for name in names if name in self.record}
        return {k: v for k, v in self.record.items() if k not in READ_KEYS and FIELD_SET_NAME.fullmatch(k)}


def parse_entry(line: bytes | str, where: Where) -> Entry:
    """A manifest line as an :class:`Entry`; InputError (``malformed_line``) when it is not one."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as error:
        raise InputError(where, "malformed_line", f"the line is not JSON ({str(error)[:200]}).", MANIFEST_FIX) from None
    if not isinstance(record, dict):
        raise InputError(where, "malformed_line", "the line is not a JSON object.", MANIFEST_FIX)
    audio = next((record[k] for k in AUDIO_KEYS if k in record), None)
    if not isinstance(audio, str) or not audio:
        raise InputError(where, "malformed_line", 'the line has no "audio_filepath" string.', MANIFEST_FIX)
    duration, offset = _seconds(record.get("duration")), record.get("offset")
    if duration is None or not 0 < duration <= MAX_SECONDS:
        raise InputError(
            where,
            "malformed_line",
            f'"duration" must be a positive number of seconds up to {MAX_SECONDS} (found {record.get("duration")!r:.40}).',
            MANIFEST_FIX,
        )
    if offset is not None and (_seconds(offset) is None or not 0 <= offset <= MAX_SECONDS):
        raise InputError(
            where,
            "malformed_line",
            f'"offset" must be a number of seconds from 0 to {MAX_SECONDS} (found {offset!r:.40}).',
            MANIFEST_FIX,
        )
    text = next((record[k] for k in TEXT_KEYS if k in record), "")
    if not isinstance(text, str):
        raise InputError(where, "malformed_line", f'"text" must be a string (found {text!r:.40}).', MANIFEST_FIX)
    return Entry(record, audio, duration, None if offset is None else float(offset), text)


def _seconds(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        seconds = float(value)
    except OverflowError:
        return None
    return seconds if math.isfinite(seconds) else None


def audio_path(audio: str, manifest: str | Path) -> str:
    """Where an entry's audio is: a relative path from the manifest's folder when the file is
    there, else as written (NeMo's rule)."""
    path = Path(audio)
    if path.is_absolute():
        return audio
    beside = Path(manifest).parent / path
    return str(beside) if beside.exists() else audio


def parse_keyed(line: bytes, where: Where, needs_value: bool) -> tuple[str, str]:
    """``(key, the line)`` of a manifest line: a key table's parser (``formats/peers/keytable.py``)."""
    entry = parse_entry(line, where)
    return entry.stable_key(), line.decode("utf-8")


def parse_text(line: bytes, where: Where, needs_value: bool) -> tuple[str, str]:
    """``(key, text)`` of a manifest line: the parser of a pack's labels."""
    entry = parse_entry(line, where)
    return entry.stable_key(), entry.text


def _manifest_key(line: bytes) -> str:
    """The key of a line, as far as it can be told (a bad line gets its own text)."""
    try:
        return parse_entry(line, Where("")).stable_key()
    except InputError:
        return line.decode("utf-8", "replace")


def scan_manifest(path: Path) -> int:
    """How many entries a manifest given to the loader holds (ConfigError for repeated keys,
    an empty file, a file that is not a NeMo manifest, or the manifest of a tarred set)."""
    try:
        entry = parse_entry(first_line(path) or b"", Where(path, 1))
    except InputError as error:
        raise ConfigError(f"{path} is not a NeMo manifest: {error.problem} Fix: {MANIFEST_FIX}") from None
    if SHARD_KEY in entry.record:
        raise ConfigError(
            f"{path} is the manifest of a NeMo tarred set (its entries name members of audio_N.tar by shard_id). "
            f"Fix: give the folder that holds it and the tars ({path.parent}), or the tars."
        )
    return scan_list(path, _manifest_key)


class ManifestSampleStream(ListSampleStream):
    """A NeMo manifest's entries as samples (the interface of :class:`~.tar.SampleStream`):
    its audio file's bytes under the file's extension, ``txt``, ``segment.json`` for a cut,
    and each extra key ``NAME`` as ``NAME.json``."""

    def _parse(self, line: bytes, where: Where) -> dict:
        entry = parse_entry(line, where)
        record: dict[str, Any] = {
            "key": entry.stable_key(),
            "wav": audio_path(entry.audio, self.path),
            "txt": entry.text,
            "fields": entry.extra(),
        }
        if entry.segment is not None:
            record["start"], record["end"] = entry.segment
        return record

    def _more_fields(self, record: dict) -> dict[str, bytes]:
        return {f"{name}.json": json.dumps(value).encode("utf-8") for name, value in record["fields"].items()}
