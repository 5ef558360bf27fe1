"""``pack --hf``: the rows of a Hugging Face dataset (``formats/peers/hf.py``) as utterances.

The scan reads only the key and text columns, a batch at a time, and writes them with each
row's place (file, batch, row) to ``rows.jsonl`` in the pack's state folder: the source's
table and its labels, re-read by line as a ``text`` file is, so a corpus of millions of rows
is never held in memory. Writing reads the audio column a batch at a time, in row order.
Audio is stored by the rules of a ``wav.scp``: cells of encoded bytes are decoded and kept
(integer PCM as FLAC, lossy audio as its original bytes; all as they are with
``audio_format="keep"``), decoded cells (``{"array", "sampling_rate"}``) are encoded as FLAC
when their samples are 16- or 24-bit PCM values (audio decoded from such files), else as
float WAV, so that nothing is lost. Keys come from the id column, else ``SPLIT-000000042``
(``row-...`` without a split) by row number.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..checks import shown
from ..errors import ConfigError, InputError, Where, option
from ..formats.audio import Audio
from ..formats.files import open_output
from ..formats.pack_state import STATE_DIR
from ..formats.peers.hf import Batches, audio_column, cell_audio, dataset_files, id_column, text_column
from .plan import PackOptions
from .sources import AudioSource, Members, Utterance, _AudioReader, check_key, field_members

ROWS_FILE = "rows.jsonl"
SAMPLED_BYTES = 1 << 20  # the head and tail hashed for a file's identity


def _parse_row(line: bytes, where: Where, needs_value: bool) -> tuple[str, str]:
    row = json.loads(line)
    if "bad_key" in row:
        raise InputError(where, "bad_key", f"{row['bad_key']}.", "give ids as strings or whole numbers (--id-column).")
    return row["key"], line.decode("utf-8")


def _parse_text(line: bytes, where: Where, needs_value: bool) -> tuple[str, str]:
    row = json.loads(line)
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
        super().__init__(list(self.dataset.files), [], options)
        schema = Batches(self.dataset).schema()
        names = list(schema.names)
        self.audio_column = audio_column(schema, audio)
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
        prefix = self.dataset.split or "row"
        number = 0
        with os.fdopen(open_output(temporary), "w", encoding="utf-8") as rows:
            for file, batch_number, batch in Batches(self.dataset).all(columns):
                texts = batch.column(self.text_column).to_pylist()
                keys = batch.column(self.id_column).to_pylist() if self.id_column else None
                for row, text in enumerate(texts):
                    key = keys[row] if keys is not None else f"{prefix}-{number:09d}"
                    at = [file, batch_number, row]
                    columns = (self.id_column, self.text_column)
                    rows.write(json.dumps(_row(key, text, columns, at, self.dataset.files[file])) + "\n")
                    number += 1
        os.replace(temporary, self.rows_file)

    def check(self, key: str, value: str, where: Where) -> None:
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

    def _cell(self, value: str) -> tuple[dict, Path]:
        """The row's cells (the audio column's and the asked fields') and its file's folder."""
        file, batch, row = json.loads(value)["at"]
        if self._batch is None or self._batch[0] != (file, batch):
            self._batch = (file, batch), self.batches.batch(file, batch, self.columns)
        table = self._batch[1]
        return {name: table.column(name)[row].as_py() for name in self.columns}, self.source.dataset.files[file].parent

    def _utterance(self, key: str, value: str, where: Where) -> tuple[bytes | None, Audio]:
        cells, folder = self._cell(value)
        return cell_audio(cells[self.source.audio_column], where, folder, self.options.channel)

    def read(self, utterance: Utterance) -> tuple[Members, int, str | None]:
        members, frames, how = super().read(utterance)
        if self.options.fields:
            members += field_members(self._cell(utterance.value)[0], self.options.fields, utterance.where)
        return members, frames, how
