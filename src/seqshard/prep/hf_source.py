"""``pack --hf``: the rows of a Hugging Face dataset (``formats/peers/hf.py``) as utterances.

The scan reads only the key and text columns, a batch at a time, and writes them with each
row's place (file, batch, row) to ``rows.jsonl`` in the pack's state folder: the source's
table and its labels, re-read by line as a ``text`` file is, so a corpus of millions of rows
is never held in memory. Writing reads the audio column a batch at a time, in row order.
Audio is stored by the rules of a ``wav.scp``: cells of encoded bytes are decoded and kept
(integer PCM as FLAC, lossy audio as its original bytes; all as they are with
``audio_format="keep"``), decoded cells (``{"array", "sampling_rate"}``) are encoded as FLAC
when their samples are 16- or 24-bit PCM values (audio decoded from such files), else as
float WAV, so that nothing is lost. Keys come from the id column, else ``row-000000042`` by
row number (from 0, across the split's files).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import replace
from pathlib import Path

from ..checks import shown
from ..errors import ConfigError, InputError, Where, option
from ..formats.audio import DecodedAudio
from ..formats.files import open_output
from ..formats.pack_state import STATE_DIR
from ..formats.peers.hf import (
    Batches,
    Damaged,
    audio_column,
    cell_audio,
    dataset_features,
    dataset_files,
    declared_rate,
    id_column,
    text_column,
)
from .inputs import AudioSource, Members, Utterance, _AudioReader, check_key, field_members
from .job import PackOptions

_LOG = logging.getLogger("seqshard")

ROWS_FILE = "rows.jsonl"
SAMPLED_BYTES = 1 << 20  # the head and tail hashed for a file's identity


def row_key(number: int) -> str:
    """The key of row ``number`` (from 0, across the split's files) without an id column:
    always valid, the same whichever way the split was chosen."""
    return f"row-{number:09d}"


def _parse_row(line: bytes, where: Where, needs_value: bool) -> tuple[str, str]:
    return json.loads(line)["key"], line.decode("utf-8")


def _check_row(value: str, where: Where) -> None:
    """InputError for a row that cannot be packed: a batch that failed its checks (one line,
    counted once), an id that is not one. Raised by the scan's check, so the table knows the
    key and does not count the row's label again as a label without audio."""
    if '"damaged": ' not in value and '"bad_key": ' not in value:  # nearly every row: no second parse
        return
    row = json.loads(value)
    if "damaged" in row:
        raise InputError(Where(row["damaged"]["at"]), *row["damaged"]["why"])
    if "bad_key" in row:
        raise InputError(where, "bad_key", f"{row['bad_key']}.", "give ids as strings or whole numbers (--id-column).")


def _parse_text(line: bytes, where: Where, needs_value: bool) -> tuple[str, str]:
    row = json.loads(line)
    if "damaged" in row:  # counted by the scan of rows
        return row["key"], "-"
    if "bad_text" in row:
        raise InputError(where, "bad_label", f"{row['bad_text']}.", "choose a column of strings with --text-column.")
    return row["key"], row["text"]


def _row(key: object, text: object, columns: tuple[str | None, str], at: list[int], file: Path) -> dict:
    """A row of ``rows.jsonl``: its key and text as strings, or why its cells cannot be one
    (a null id, a list or bytes: never their ``str()``); ``columns``: the id and text columns."""
    row: dict = {"key": str(key), "text": "" if text is None else str(text), "at": at}
    where = f"{file}, batch {at[1]}, row {at[2]}"
    if not isinstance(key, (str, int)) or isinstance(key, bool):
        row["bad_key"] = f"{where}: its id (column {columns[0]}) is {shown(key)}, not a string or a whole number"
    if text is not None and (not isinstance(text, (str, int, float)) or isinstance(text, bool)):
        row["bad_text"] = f"{where}: its text (column {columns[1]}) is {shown(text)}, not a string"
    return row


class DatasetSource(AudioSource):
    """Audio and texts of one split of a Hugging Face dataset."""

    texts_inside = True
    parse = staticmethod(_parse_row)
    parse_label = staticmethod(_parse_text)

    durations = "the audio header", "check the audio cell."

    def __init__(
        self,
        path: str | Path,
        split: str | None,
        audio: str | None,
        text: str | None,
        key: str | None,
        options: PackOptions,
        d_out: Path,
    ):
        self.dataset = dataset_files(path, split)
        schema = Batches(self.dataset).schema()
        names = list(schema.names)
        features = dataset_features(schema, self.dataset.files[0])
        self.audio_column = audio_column(schema, features, audio)
        self.declared_rate = declared_rate(features, self.audio_column, self.dataset.files[0])
        if self.declared_rate and options.resample_to is None and (options.audio_format != "keep" or options.features):
            _LOG.info("column %s is Audio(sampling_rate=%d): resampled to it", self.audio_column, self.declared_rate)
            options = replace(options, resample_to=self.declared_rate)  # as datasets decodes it
        super().__init__(list(self.dataset.files), [], options)
        self.text_column = text_column(names, text)
        self.id_column = id_column(names, key)
        missing = [name for name in options.fields if name not in names]
        if missing:
            raise ConfigError(
                f"{option('fields', ','.join(missing))}: no such column (its columns: {', '.join(names)})."
            )
        self.rows_file = d_out / STATE_DIR / ROWS_FILE

    def content_hash(self, path: Path) -> str:
        """A file's identity for the pack's fingerprint: its size and the digest of its first
        and last MiB (a parquet footer describes every row group), not a read of all of it."""
        digest = hashlib.blake2b(str(path.stat().st_size).encode(), digest_size=16)
        with open(path, "rb") as stream:
            digest.update(stream.read(SAMPLED_BYTES))
            stream.seek(max(0, path.stat().st_size - SAMPLED_BYTES))
            digest.update(stream.read())
        return digest.hexdigest()

    @property
    def tables(self) -> list[Path]:
        return [self.rows_file]

    def prepare(self) -> None:
        """Write ``rows.jsonl``: each row's key, text and place, the source's table (read by
        line as a text file is)."""
        columns = [c for c in (self.id_column, self.text_column) if c is not None]
        temporary = self.rows_file.with_name(f".{ROWS_FILE}.{os.getpid()}")
        number = 0
        with os.fdopen(open_output(temporary), "w", encoding="utf-8") as rows:
            for file, batch_number, batch in Batches(self.dataset).all(columns):
                if isinstance(batch, Damaged):  # one line, counted once: its rows cannot be listed
                    error = batch.error
                    why = [error.reason, f"{error.problem} Its {batch.rows} rows are not read.", error.fix]
                    damaged = {"at": str(error.where), "why": why}
                    rows.write(json.dumps({"key": f"#damaged {error.where}", "damaged": damaged}) + "\n")
                    number += max(0, batch.rows)
                    continue
                texts = batch.column(self.text_column).to_pylist()
                keys = batch.column(self.id_column).to_pylist() if self.id_column else None
                for row, text in enumerate(texts):
                    key = keys[row] if keys is not None else row_key(number)
                    at = [file, batch_number, row]
                    columns = (self.id_column, self.text_column)
                    rows.write(json.dumps(_row(key, text, columns, at, self.dataset.files[file])) + "\n")
                    number += 1
        os.replace(temporary, self.rows_file)

    def check(self, key: str, value: str, where: Where) -> None:
        _check_row(value, where)
        check_key(key, where, self.options)

    def length_files(self) -> tuple[list[Path], bool]:
        return [], True  # lengths come from the audio cells

    def length(self, measurer: _DatasetReader, key: str, value: str, where: Where) -> int:
        """Length in 10 ms frames, from the row's audio cell."""
        return round(measurer.audio(key, value, where).seconds * 100)

    def measurer(self) -> _DatasetReader:
        return _DatasetReader(self, 0)

    def reader(self, dim: int) -> _DatasetReader:
        return _DatasetReader(self, dim)


class _DatasetReader(_AudioReader):
    """Reads planned rows' audio cells, a batch of the audio column at a time."""

    source: DatasetSource

    def __init__(self, source: DatasetSource, dim: int):
        super().__init__(source, dim)
        self.batches = Batches(source.dataset)
        self.columns = [source.audio_column, *(f for f in self.options.fields if f != source.audio_column)]
        self._batch: tuple[tuple[int, int], object] | None = None

    def _place(self, value: str, key: str | None) -> tuple[list[int], Where]:
        """A row's (file, batch, row) and its place as messages name it: the dataset's file,
        batch and row, not the line of rows.jsonl (which the user never wrote)."""
        file, batch, row = at = json.loads(value)["at"]
        return at, Where(f"{self.source.dataset.files[file]}, batch {batch}, row {row}", key=key)

    def _cell(self, value: str, where: Where) -> tuple[dict, Path, Where]:
        """The row's cells (the audio column's and the asked fields'), its file's folder and place."""
        (file, batch, row), place = self._place(value, where.key)
        if self._batch is None or self._batch[0] != (file, batch):
            try:
                self._batch = (file, batch), self.batches.batch(file, batch, self.columns)
            except InputError as error:  # each of its rows is counted, the batch read once
                self._batch = (file, batch), error
        table = self._batch[1]
        if isinstance(table, InputError):
            raise InputError(Where(f"{table.where}, row {row}", key=where.key), table.reason, table.problem, table.fix)
        cells = {name: table.column(name)[row].as_py() for name in self.columns}
        return cells, self.source.dataset.files[file].parent, place

    def _utterance(self, key: str, value: str, where: Where) -> tuple[bytes | None, DecodedAudio]:
        cells, folder, where = self._cell(value, where)
        original, audio = cell_audio(cells[self.source.audio_column], where, folder, self.options.channel)
        rate = self.source.declared_rate
        if rate and audio.sample_rate != rate and self.options.resample_to is None:  # --audio-format keep
            raise InputError(
                where,
                "sample_rate_mismatch",
                f"the audio is at {audio.sample_rate} Hz, but column {self.source.audio_column!r} is "
                f"Audio(sampling_rate={rate}): datasets decodes it at {rate} Hz, and {option('audio_format', 'keep')} "
                "stores the file as it is.",
                f"pack with {option('audio_format', 'flac')}, which resamples it to {rate} Hz.",
            )
        return original, audio

    def read(self, utterance: Utterance) -> tuple[Members, int, str | None]:
        at_row = replace(utterance, where=self._place(utterance.value, utterance.key)[1])
        members, frames, how = super().read(at_row)
        if self.options.fields:
            members += field_members(self._cell(utterance.value, at_row.where)[0], self.options.fields, at_row.where)
        return members, frames, how
