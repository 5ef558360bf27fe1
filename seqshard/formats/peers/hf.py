"""Hugging Face datasets as files, read with pyarrow (the ``[hf]`` extra), a batch of rows at a
time: the layouts ``datasets`` writes and the Hub serves.

- A ``save_to_disk`` folder: a ``DatasetDict`` (``dataset_dict.json`` naming its splits, one
  folder each) or one ``Dataset`` (``state.json`` naming its ``.arrow`` files, Arrow streams).
- Parquet: a file, a folder of them (searched below it: the Hub's ``data/train-00000-of-00004.parquet``
  and ``train/0000.parquet`` layouts), or a glob. A split is chosen among files named
  ``SPLIT-...``, ``SPLIT.parquet`` or under a folder ``SPLIT``, as ``datasets`` finds them.
- Arrow files (``.arrow``): streams as ``datasets`` writes them, or Arrow IPC files.

Memory follows one batch: a parquet row group, an Arrow record batch (``datasets`` writes
audio in batches of 100 rows, or fewer). Columns are chosen as a user of ``datasets`` would
expect: the first column whose feature is ``Audio`` (the ``huggingface`` schema metadata), else
the first with an audio cell's shape; text from ``text``, ``sentence``, ``transcript``,
``transcription``, ``normalized_text``; keys from ``id``. An audio cell is
``{"bytes", "path"}`` (the encoded file; a local file at ``path`` when the bytes were not
embedded) or, decoded, ``{"array", "sampling_rate"}``.
"""

from __future__ import annotations

import contextlib
import glob
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...checks import shown
from ...errors import ConfigError, InputError, Where, option
from ..audio import Audio, decode_audio, read_audio_file

if TYPE_CHECKING:
    import pyarrow as pa

TEXT_COLUMNS = ("text", "sentence", "transcript", "transcription", "normalized_text")
ID_COLUMN = "id"
ENCODED_CELL, DECODED_CELL = {"bytes", "path"}, {"array", "sampling_rate"}
MAX_SAMPLE_RATE = 655350  # FLAC's highest rate (libsndfile's); no recording is sampled faster
FILE_KINDS = {"parquet": "a parquet", "arrow": "an Arrow"}
SPLIT_NAME = re.compile(r"(?P<split>[A-Za-z0-9_.]+?)(?:[-_.].*)?")  # a split's files: SPLIT-00000-of-00004.parquet


def pyarrow() -> Any:
    try:
        import pyarrow as pa
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ConfigError("reading Hugging Face datasets needs pyarrow: pip install 'seqshard[hf]'") from None
    return pa


@dataclass(frozen=True)
class DatasetFiles:
    """The files of one split of a dataset, in order, and their kind (``parquet`` or ``arrow``)."""

    files: tuple[Path, ...]
    kind: str
    split: str | None


def dataset_files(path: str | Path, split: str | None = None) -> DatasetFiles:
    """The files of ``split`` of the dataset at ``path`` (see the module docstring): its only
    split, else ``train``, when none is given. ConfigError naming the splits found otherwise."""
    text = str(path)
    root = Path(text)
    if (root / "dataset_dict.json").is_file():
        splits = _names(root / "dataset_dict.json", "splits", lambda name: name)
        chosen = _choose(splits, split, root)
        return DatasetFiles(_saved_split(root / chosen), "arrow", chosen)
    if (root / "state.json").is_file():
        return DatasetFiles(_saved_split(root), "arrow", split)
    if glob.has_magic(text):
        found = [Path(p) for p in sorted(glob.glob(text, recursive=True)) if Path(p).is_file()]
    elif root.is_dir():
        found = sorted(p for p in root.rglob("*") if p.suffix in (".parquet", ".arrow") and p.is_file())
    else:
        found = [root] if root.is_file() else []
    files = [p for p in found if p.suffix in (".parquet", ".arrow")]
    if not files:
        raise ConfigError(
            f"{option('hf', text)}: no parquet or arrow file there. Fix: give a save_to_disk folder, a parquet or "
            "arrow file, a folder of them or a glob."
        )
    if len({p.suffix for p in files}) > 1:
        raise ConfigError(f"{option('hf', text)}: holds both parquet and arrow files; give one kind.")
    by_split: dict[str, list[Path]] = {}
    for file in files:
        by_split.setdefault(_split_of(file, root if root.is_dir() else None), []).append(file)
    if len(by_split) > 1 or split is not None:
        chosen = _choose(sorted(by_split), split, root)
        files = by_split[chosen]
        split = chosen
    return DatasetFiles(tuple(files), files[0].suffix[1:], split)


def _choose(splits: Sequence[str], split: str | None, root: Path) -> str:
    if split is None and len(splits) == 1:
        return splits[0]
    if split is None and "train" in splits:
        return "train"
    if split not in splits:
        raise ConfigError(
            f"{root}: {'no split ' + repr(split) if split else 'several splits'} (it has: {', '.join(splits)}). "
            f"Fix: choose one with {option('split', splits[0])}."
        )
    return split


def _saved_split(folder: Path) -> tuple[Path, ...]:
    files = _names(
        folder / "state.json", "_data_files", lambda item: item.get("filename") if isinstance(item, dict) else None
    )
    return tuple(folder / name for name in files)


def _names(path: Path, field: str, name_of: Callable[[Any], Any]) -> list[str]:
    """The names ``field`` of a ``save_to_disk`` JSON file lists (``name_of`` each item's),
    each a file or folder beside it: ConfigError naming the file when it is not JSON, lacks
    the list, or names something elsewhere (``..``, a path)."""
    fix = "Fix: save the dataset again with datasets' save_to_disk."
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ConfigError(f"{path} cannot be read as JSON ({str(error)[:200]}). {fix}") from None
    items = document.get(field) if isinstance(document, dict) else None
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{path} has no list {field!r} (found {shown(items)}). {fix}")
    names = [name_of(item) for item in items]
    for name in names:
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
            raise ConfigError(f"{path}: {field} names {shown(name)}, not a file or folder beside it. {fix}")
    return names


def _split_of(file: Path, root: Path | None) -> str:
    """The split a file belongs to: a folder named like a split, else its name's first part."""
    parts = file.relative_to(root).parts[:-1] if root is not None else ()
    for part in reversed(parts):
        if part in ("train", "validation", "valid", "dev", "test") or part.startswith(("train", "test")):
            return part
    match = SPLIT_NAME.fullmatch(file.stem)
    return match["split"] if match else file.stem


class Batches:
    """The record batches of a dataset's files, read one at a time (a batch is a parquet row
    group or an Arrow record batch); ``columns`` limits what is read from parquet."""

    def __init__(self, dataset: DatasetFiles):
        self.dataset = dataset
        self._open: tuple[int, Any] | None = None  # (file number, its reader)
        self._stream: tuple[int, int, Iterator[Any]] | None = None  # an Arrow stream being read: (file, next batch, it)

    def schema(self) -> pa.Schema:
        pa = pyarrow()
        first = self.dataset.files[0]
        with self._reading(first):
            if self.dataset.kind == "parquet":
                return pa.parquet.read_schema(first)
            return self._arrow(first).schema

    def _reading(self, path: Path) -> contextlib.AbstractContextManager[None]:
        """Turns pyarrow's errors about ``path`` into a ConfigError naming it."""
        return _reading(path, self.dataset.kind)

    def _arrow(self, path: Path) -> Any:
        pa = pyarrow()
        source = pa.memory_map(str(path))
        try:
            return pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            return pa.ipc.open_file(source)

    def _arrow_batches(self, path: Path) -> Iterator[Any]:
        reader = self._arrow(path)
        if hasattr(reader, "num_record_batches"):  # an Arrow IPC file
            return (reader.get_batch(i) for i in range(reader.num_record_batches))
        return iter(reader)

    def _batches_of(self, path: Path, columns: Sequence[str]) -> Iterator[Any]:
        if self.dataset.kind == "parquet":
            file = pyarrow().parquet.ParquetFile(path)
            return (file.read_row_group(group, columns=list(columns)) for group in range(file.num_row_groups))
        return (batch.select(list(columns)) for batch in self._arrow_batches(path))

    def all(self, columns: Sequence[str]) -> Iterator[tuple[int, int, Any]]:
        """``(file number, batch number, batch)`` of every batch, in order."""
        for number, path in enumerate(self.dataset.files):
            with self._reading(path):
                batches = enumerate(self._batches_of(path, columns))
            while True:
                with self._reading(path):
                    found = next(batches, None)
                if found is None:
                    break
                yield number, *found

    def batch(self, file: int, number: int, columns: Sequence[str]) -> Any:
        """Batch ``number`` of file ``file`` (read forward: batches asked for in order are read once)."""
        path = self.dataset.files[file]
        with self._reading(path):
            if self.dataset.kind == "parquet":
                if self._open is None or self._open[0] != file:
                    self._open = file, pyarrow().parquet.ParquetFile(path)
                return self._open[1].read_row_group(number, columns=list(columns))
            if self._stream is None or self._stream[0] != file or self._stream[1] > number:
                self._stream = file, 0, self._arrow_batches(path)
            file_, at, batches = self._stream
            for batch in batches:
                self._stream = file_, at + 1, batches
                if at == number:
                    return batch.select(list(columns))
                at += 1
        raise InputError(Where(path), "unreadable_audio", f"the file has no batch {number} (changed since the scan?).")


@contextlib.contextmanager
def _reading(path: Path, kind: str) -> Iterator[None]:
    pa = pyarrow()
    try:
        yield
    except (pa.ArrowException, OSError, KeyError) as error:
        said = str(error)[:200] or type(error).__name__
        raise ConfigError(
            f"{path} cannot be read as {kind} ({said}): damaged, cut short, or not {FILE_KINDS[kind]} file with the "
            "dataset's columns. Fix: download or save it again."
        ) from None


def _feature_types(schema: pa.Schema) -> dict[str, str]:
    """Column -> its ``datasets`` feature type (``Audio``, ``Value``, ...), from the schema's
    ``huggingface`` metadata (empty when there is none)."""
    metadata = (schema.metadata or {}).get(b"huggingface")
    try:
        features = json.loads(metadata)["info"]["features"] if metadata else {}
    except (ValueError, KeyError, TypeError):
        return {}
    return {name: str(f.get("_type", "")) for name, f in features.items() if isinstance(f, dict)}


def audio_column(schema: pa.Schema, given: str | None) -> str:
    """The audio column: ``given``, else the first ``Audio`` feature, else the first column
    of ``{"bytes", "path"}`` or ``{"array", "sampling_rate"}`` cells."""
    pa = pyarrow()
    names = list(schema.names)
    if given is not None:
        return _given(given, names, "audio_column")
    types = _feature_types(schema)
    found = next((n for n in names if types.get(n) == "Audio"), None)
    for field in schema:
        if found is None and pa.types.is_struct(field.type):
            children = {field.type.field(i).name for i in range(field.type.num_fields)}
            if children >= ENCODED_CELL or children >= DECODED_CELL:
                found = field.name
    if found is None:
        raise ConfigError(
            f"the dataset has no audio column (its columns: {', '.join(names)}). Fix: name it with "
            f"{option('audio_column', 'NAME')}."
        )
    return found


def text_column(names: Sequence[str], given: str | None) -> str:
    if given is not None:
        return _given(given, names, "text_column")
    found = next((n for n in TEXT_COLUMNS if n in names), None)
    if found is None:
        raise ConfigError(
            f"the dataset has none of the text columns {', '.join(TEXT_COLUMNS)} (its columns: {', '.join(names)}). "
            f"Fix: name it with {option('text_column', 'NAME')}."
        )
    return found


def id_column(names: Sequence[str], given: str | None) -> str | None:
    if given is not None:
        return _given(given, names, "id_column")
    return ID_COLUMN if ID_COLUMN in names else None


def _given(name: str, names: Sequence[str], flag: str) -> str:
    if name not in names:
        raise ConfigError(f"{option(flag, name)}: the dataset has no such column (its columns: {', '.join(names)}).")
    return name


def cell_audio(cell: Any, where: Where, folder: Path, channel: int | None) -> tuple[bytes | None, Audio]:
    """An audio cell's encoded bytes (None for a decoded cell) and its audio."""
    if isinstance(cell, dict) and cell.get("bytes") is not None:
        if not isinstance(cell["bytes"], (bytes, bytearray, memoryview)):
            raise InputError(
                where,
                "unreadable_audio",
                f'the audio cell\'s "bytes" are {shown(cell["bytes"])}, not the bytes of an audio file.',
                "check the audio column (a binary column of encoded audio).",
            )
        data = bytes(cell["bytes"])
        return data, decode_audio(data, where, channel)
    if isinstance(cell, dict) and isinstance(cell.get("path"), str) and "array" not in cell:
        path = Path(cell["path"])
        path = path if path.is_absolute() or path.is_file() else folder / path
        try:
            data = read_audio_file(path)  # a regular file of bounded size, not a device or a FIFO
        except OSError as error:
            raise InputError(
                where,
                "missing_audio",
                f"the audio cell holds no bytes, and its path {cell['path']!r} cannot be read ({error.strerror}).",
                "save the dataset with its audio embedded (datasets embeds it in save_to_disk and push_to_hub).",
            ) from None
        return data, decode_audio(data, where, channel)
    if isinstance(cell, dict) and cell.get("array") is not None and isinstance(cell.get("sampling_rate"), int):
        try:
            array = np.asarray(cell["array"], dtype=np.float64)
        except (TypeError, ValueError):
            raise InputError(
                where,
                "unreadable_audio",
                f"the decoded audio's array holds values that are not numbers ({shown(cell['array'])}).",
                "check the audio column.",
            ) from None
        return None, decoded_audio(array, cell["sampling_rate"], where, channel)
    raise InputError(
        where,
        "unreadable_audio",
        'the audio cell is neither {"bytes", "path"} nor {"array", "sampling_rate"} (or it is empty).',
        "check the audio column.",
    )


def decoded_audio(array: np.ndarray, rate: int, where: Where, channel: int | None) -> Audio:
    """A decoded cell as :class:`Audio` (one channel); its subtype says which PCM holds its
    samples exactly (``PCM_16`` for audio decoded from 16-bit files), else ``FLOAT``."""
    if array.ndim == 2:  # channels first, as datasets decodes them, when there are fewer channels than samples
        frames = array.T if array.shape[0] < array.shape[1] else array
        if channel is not None and not 0 <= channel < frames.shape[1]:
            raise InputError(
                where, "bad_channel", f"channel {channel} does not exist: the audio has {frames.shape[1]}."
            )
        array = frames[:, channel] if channel is not None else frames.mean(axis=1)
    if array.ndim != 1 or not 0 < rate <= MAX_SAMPLE_RATE or not len(array):
        raise InputError(
            where,
            "unreadable_audio",
            f"the decoded audio has shape {array.shape} at {rate} Hz (audio is 1 to {MAX_SAMPLE_RATE} Hz).",
        )
    subtype = "FLOAT"
    if np.abs(array).max() <= 1.0:
        for name, scale in (("PCM_16", 1 << 15), ("PCM_24", 1 << 23)):
            scaled = array * scale
            if np.array_equal(scaled, np.round(scaled)):
                subtype = name
                break
    return Audio(array.astype(np.float32), rate, subtype, "array")
