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
import itertools
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...checks import NumberError, read_number, shown
from ...errors import ConfigError, InputError, Where, option
from ..audio import MAX_SAMPLE_RATE, DecodedAudio, decode_audio, read_audio_file
from ..files import read_json
from ..inflation import MAX_INFLATION, MIN_INFLATION_LIMIT, inflation_limit
from .arrow_ipc import DamagedMessage, batch_sizes

if TYPE_CHECKING:
    import pyarrow as pa

TEXT_COLUMNS = ("text", "sentence", "transcript", "transcription", "normalized_text")
ID_COLUMN = "id"
ENCODED_CELL, DECODED_CELL = {"bytes", "path"}, {"array", "sampling_rate"}
FILE_KINDS = {"parquet": "a parquet", "arrow": "an Arrow"}
SUFFIXES = (".parquet", ".arrow")
REFETCH = "download or save the file again."
ARROW_MAGIC, ARROW_FILE_START = b"ARROW1", 8  # an Arrow IPC file: magic, padding, then its stream
MAX_FILES = 100_000  # the files of one --hf (the Hub's largest datasets have a few thousand)
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
        files = sorted(_expand(text), key=str)
    elif root.is_dir():
        files = sorted(_expand(str(root / "**" / "*")))
    else:
        files = [root] if root.is_file() and root.suffix in SUFFIXES else []
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


def _expand(pattern: str) -> list[Path]:
    """The parquet and arrow files a glob names, unsorted: ``**`` is folders at any depth but
    never a symbolic link to a folder (``glob.glob`` follows those, so a link to a folder above
    never ends); ConfigError past :data:`MAX_FILES`."""
    parts = Path(pattern).parts
    fixed = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    base = Path(*parts[:fixed]) if fixed else Path()
    files = []
    for path in base.glob(str(Path(*parts[fixed:]))):
        if path.suffix in SUFFIXES and path.is_file():
            files.append(path)
            if len(files) > MAX_FILES:
                raise ConfigError(
                    f"{option('hf', pattern)}: names more than {MAX_FILES} parquet or arrow files. Fix: give the "
                    "folder or the files of one split."
                )
    return files


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
    each a file or folder beside it: InputError naming the file when it is not JSON, ConfigError
    when it lacks the list or names something elsewhere (``..``, a path)."""
    fix = "save the dataset again with datasets' save_to_disk."
    items = read_json(path, fix, kind=dict).get(field)
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{path} has no list {field!r} (found {shown(items)}). Fix: {fix}")
    names = [name_of(item) for item in items]
    for name in names:
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
            raise ConfigError(f"{path}: {field} names {shown(name)}, not a file or folder beside it. Fix: {fix}")
    return names


def _split_of(file: Path, root: Path | None) -> str:
    """The split a file belongs to: a folder named like a split, else its name's first part."""
    parts = file.relative_to(root).parts[:-1] if root is not None else ()
    for part in reversed(parts):
        if part in ("train", "validation", "valid", "dev", "test") or part.startswith(("train", "test")):
            return part
    match = SPLIT_NAME.fullmatch(file.stem)
    return match["split"] if match else file.stem


@dataclass(frozen=True)
class Damaged:
    """A batch that failed its checks: why, and how many rows it declares."""

    error: InputError
    rows: int


class Batches:
    """The record batches of a dataset's files, read one at a time (a batch is a parquet row
    group or an Arrow record batch), each checked before a value of it is read: the inflation
    a parquet row group's metadata or an Arrow batch's message header declares, before it is
    decompressed, and what its dictionaries expand to (:func:`inflation_limit`); every batch's
    offsets and UTF-8 (pyarrow's full validation: offsets that lie would read past the buffer,
    crash or serve stray bytes). A batch that fails is an InputError (``damaged_batch``,
    ``decompression_limit``) naming the file, batch and column; a file pyarrow cannot read at
    all is a ConfigError."""

    def __init__(self, dataset: DatasetFiles):
        self.dataset = dataset
        self._open: tuple[int, Any] | None = None  # (file number, its ParquetFile)
        self._stream: tuple[int, int, Iterator[Any]] | None = None  # an Arrow stream being read: (file, next batch, it)

    def schema(self) -> pa.Schema:
        """The first file's schema, every field name (nested ones too) read as UTF-8 here."""
        pa = pyarrow()
        first = self.dataset.files[0]
        with self._reading(first):
            if self.dataset.kind == "parquet":
                schema = pa.parquet.read_schema(first)
            else:
                schema = pa.ipc.open_stream(_arrow_source(first)).schema
            fields = list(schema)
            while fields:  # every name read now: one that is not UTF-8 raises here, not where it is used
                field = fields.pop()
                field.name.encode()
                fields += [field.type.field(i) for i in range(field.type.num_fields)]
            return schema

    def _reading(self, path: Path, number: int | None = None) -> contextlib.AbstractContextManager[None]:
        """Turns pyarrow's errors about ``path`` (batch ``number``) into a ConfigError naming it."""
        return _reading(path, self.dataset.kind, number)

    def _parquet(self, file: int) -> Any:
        """File ``file`` open, its text and binary columns read as dictionaries where they are
        dictionary-encoded (so that a value repeated by a million indices is held once, and
        what it expands to is checked before it is: :func:`_check_expansion`)."""
        if self._open is None or self._open[0] != file:
            pq, path = pyarrow().parquet, self.dataset.files[file]
            with self._reading(path):
                metadata = pq.read_metadata(path)
                columns = [metadata.schema.column(i) for i in range(metadata.num_columns)]
                binary = [column.path for column in columns if column.physical_type == "BYTE_ARRAY"]
                self._open = file, pq.ParquetFile(path, metadata=metadata, read_dictionary=binary)
        return self._open[1]

    def _row_group(self, file: int, number: int, columns: Sequence[str]) -> Any:
        pa, parquet = pyarrow(), self._parquet(file)
        where = place(self.dataset.files[file], "parquet", number)
        compressed = self.dataset.files[file].stat().st_size  # its row groups' own are not read: _check_inflation
        _check_inflation(parquet.metadata.row_group(number), compressed, where)
        try:
            table = parquet.read_row_group(number, columns=list(columns))
        except (pa.ArrowException, OSError, UnicodeDecodeError) as error:
            raise InputError(
                Where(where), "damaged_batch", f"it cannot be read ({str(error)[:200]}): a damaged file.", REFETCH
            ) from None
        return _check_expansion(_checked(table, where), compressed, where)

    def _batches(self, file: int, columns: Sequence[str]) -> Iterator[Any]:
        """File ``file``'s batches in order, each a checked batch or :class:`Damaged`."""
        if self.dataset.kind == "arrow":
            yield from self._arrow_batches(self.dataset.files[file], columns)
            return
        for number in range(self._parquet(file).num_row_groups):
            try:
                yield self._row_group(file, number, columns)
            except InputError as error:
                yield Damaged(error, self._parquet(file).metadata.row_group(number).num_rows)

    def _arrow_batches(self, path: Path, columns: Sequence[str]) -> Iterator[Any]:
        """An Arrow file's batches, each declared size checked (its message header, read first)
        before pyarrow reads and decompresses it; a stream is not read past a batch refused."""
        with self._reading(path):
            batches = iter(pyarrow().ipc.open_stream(_arrow_source(path)))
            sizes = batch_sizes(pyarrow().ipc.MessageReader.open_stream(_arrow_source(path)))
        refused: InputError | None = None
        for number in itertools.count():
            where = Where(place(path, "arrow", number))
            with self._reading(path, number):
                size = next(sizes, None)
            if size is None:
                return
            if refused is None:
                refused = _inflation_error(
                    size.inflated, size.body, "its buffers declare", where, "write it again without IPC compression"
                )
            if refused is not None:
                problem = refused.problem if refused.where == where else f"it follows {refused.where}, not read."
                yield Damaged(InputError(where, refused.reason, problem, refused.fix), size.rows)
                continue
            with self._reading(path, number):
                batch = next(batches, None)
            if batch is None:
                return
            try:
                yield _check_expansion(_checked(batch.select(list(columns)), str(where)), size.body, str(where))
            except InputError as error:
                yield Damaged(error, batch.num_rows)

    def all(self, columns: Sequence[str]) -> Iterator[tuple[int, int, Any]]:
        """``(file number, batch number, batch)`` of every batch, in order; a batch that fails
        its checks comes as :class:`Damaged`."""
        for file in range(len(self.dataset.files)):
            for number, batch in enumerate(self._batches(file, columns)):
                yield file, number, batch

    def batch(self, file: int, number: int, columns: Sequence[str]) -> Any:
        """Batch ``number`` of file ``file`` (read forward: batches asked for in order are read
        once); InputError when it fails its checks."""
        path = self.dataset.files[file]
        if self.dataset.kind == "parquet":
            if not 0 <= number < self._parquet(file).num_row_groups:
                raise InputError(
                    Where(path), "unreadable_audio", f"the file has no row group {number} (changed since the scan?)."
                )
            return self._row_group(file, number, columns)
        if self._stream is None or self._stream[0] != file or self._stream[1] > number:
            self._stream = file, 0, self._batches(file, columns)
        file_, at, batches = self._stream
        for batch in batches:
            self._stream = file_, at + 1, batches
            if at == number:
                if isinstance(batch, Damaged):
                    raise batch.error
                return batch
            at += 1
        raise InputError(Where(path), "unreadable_audio", f"the file has no batch {number} (changed since the scan?).")


def place(path: Path, kind: str, batch: int) -> str:
    """Where a batch is, as messages say it: ``FILE, row group 3`` or ``FILE, batch 3``."""
    return f"{path}, {'row group' if kind == 'parquet' else 'batch'} {batch}"


def _arrow_source(path: Path) -> Any:
    """An Arrow file memory-mapped, at the start of its stream: an Arrow IPC file is read as
    the stream it holds after its magic, never through its footer's offsets."""
    source = pyarrow().memory_map(str(path))
    source.seek(ARROW_FILE_START if source.read(len(ARROW_MAGIC)) == ARROW_MAGIC else 0)
    return source


def _checked(batch: Any, where: str) -> Any:
    """``batch``, once every column's offsets, lengths and UTF-8 hold (pyarrow's full
    validation); InputError ``damaged_batch`` naming the column (and row) otherwise."""
    pa = pyarrow()
    for name, column in zip(batch.schema.names, batch.columns):
        try:
            column.validate(full=True)
        except pa.ArrowException as error:
            said = str(error)
            utf8 = re.search(r"Invalid UTF8 sequence at string index (\d+)", said)
            row = _text_row(column, int(utf8[1])) if utf8 else None
            if row is not None:
                raise InputError(
                    Where(where),
                    "damaged_batch",
                    f"column {name!r}, row {row}: its text is not UTF-8.",
                    "write the text as UTF-8 (or leave the column out).",
                ) from None
            raise InputError(
                Where(where),
                "damaged_batch",
                f"column {name!r} does not hold what it declares ({said[:200]}): a damaged or hostile file (its "
                "offsets or lengths point outside its data, or its text is not UTF-8).",
                REFETCH,
            ) from None
    return batch


def _text_row(column: Any, index: int) -> int | None:
    """The row of a text column (plain or dictionary-encoded: ``index`` is then its
    dictionary's) whose text is entry ``index``; None for another kind of column."""
    pa = pyarrow()
    import pyarrow.compute as pc

    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    kind = chunks[0].type if len(chunks) == 1 else None
    if kind is not None and pa.types.is_dictionary(kind) and pa.types.is_string(kind.value_type):
        row = pc.index(chunks[0].indices, index).as_py()
        return row if row >= 0 else None
    return index if kind is not None and (pa.types.is_string(kind) or pa.types.is_large_string(kind)) else None


def _check_expansion(batch: Any, compressed: int, where: str) -> Any:
    """``batch``, unless its dictionary-encoded values expand (each index a copy of its value)
    beyond :func:`inflation_limit` of the ``compressed`` bytes it was read from: InputError
    ``decompression_limit`` (a bomb of one large value and a million indices)."""
    expanded = sum(_expanded(column) for column in batch.columns)
    fix = "write it again without dictionary encoding (pyarrow's write_table(..., use_dictionary=False))"
    error = _inflation_error(expanded, compressed, "its dictionary-encoded values expand to", Where(where), fix)
    if error is not None:
        raise error
    return batch


def _expanded(array: Any) -> int:
    """The bytes ``array``'s dictionary-encoded values (nested ones too) take once expanded."""
    pa = pyarrow()
    import pyarrow.compute as pc

    total = 0
    for chunk in array.chunks if isinstance(array, pa.ChunkedArray) else [array]:
        kind = chunk.type
        if pa.types.is_dictionary(kind):
            values = chunk.dictionary
            if pa.types.is_binary(values.type) or pa.types.is_string(values.type):
                sizes = pc.binary_length(values)
            else:
                sizes = pa.array([values.nbytes // max(1, len(values))] * len(values), pa.int64())
            total += int(pc.sum(pc.take(sizes.cast(pa.int64()), chunk.indices)).as_py() or 0)
        elif pa.types.is_struct(kind):
            total += sum(_expanded(chunk.field(i)) for i in range(kind.num_fields))
        elif pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
            total += _expanded(chunk.flatten())
    return total


def _check_inflation(row_group: Any, compressed: int, where: str) -> None:
    """InputError ``decompression_limit`` when the row group declares more bytes decompressed
    than :func:`inflation_limit` allows the ``compressed`` bytes of its file (checked before
    anything is decompressed: a parquet bomb, a few kB holding a GB). The row group's own
    total is read, never its column chunks' metadata: pyarrow aborts the process on a chunk
    whose statistics do not fit its column's type."""
    fix = "write it again uncompressed (pyarrow's write_table(..., compression='none'))"
    error = _inflation_error(max(0, row_group.total_byte_size), compressed, "it declares", Where(where), fix)
    if error is not None:
        raise error


def _inflation_error(inflated: int, compressed: int, what: str, where: Where, fix: str) -> InputError | None:
    """InputError ``decompression_limit`` when ``inflated`` bytes from ``compressed`` break the
    rule for compressed data (:func:`inflation_limit`, uncapped: a batch of many cells)."""
    limit = inflation_limit(compressed, capped=False)
    if inflated <= limit:
        return None
    return InputError(
        where,
        "decompression_limit",
        f"{what} {inflated} bytes once read, from {compressed}: beyond the {limit} allowed ({MAX_INFLATION} times as "
        f"many, at least {MIN_INFLATION_LIMIT}): a damaged or hostile file.",
        f"if the file is real, {fix}.",
    )


@contextlib.contextmanager
def _reading(path: Path, kind: str, number: int | None = None) -> Iterator[None]:
    pa = pyarrow()
    try:
        yield
    except (pa.ArrowException, OSError, KeyError, UnicodeDecodeError, DamagedMessage) as error:
        said = str(error)[:200] or type(error).__name__
        at = str(path) if number is None else place(path, kind, number)
        raise ConfigError(
            f"{at} cannot be read as {kind} ({said}): damaged, cut short, or not {FILE_KINDS[kind]} file with the "
            "dataset's columns. Fix: download or save it again."
        ) from None


def dataset_features(schema: pa.Schema, path: Path) -> dict[str, dict]:
    """Column -> its ``datasets`` feature (``{"_type": "Audio", "sampling_rate": 16000}``),
    from the schema's ``huggingface`` metadata (empty when there is none); ConfigError naming
    ``path`` when that metadata is not JSON (or nested too deep to read)."""
    metadata = (schema.metadata or {}).get(b"huggingface")
    if not metadata:
        return {}
    try:
        document = json.loads(metadata)
    except (ValueError, RecursionError) as error:
        raise ConfigError(
            f"{path}: its huggingface schema metadata (the dataset's features) is not JSON ({str(error)[:100]}). "
            "Fix: write the file again with datasets."
        ) from None
    info = document.get("info") if isinstance(document, dict) else None
    features = info.get("features") if isinstance(info, dict) else None
    return {name: f for name, f in features.items() if isinstance(f, dict)} if isinstance(features, dict) else {}


def declared_rate(features: dict[str, dict], column: str, path: Path) -> int | None:
    """The sampling rate ``column``'s ``Audio`` feature declares (``datasets`` decodes the
    column at it), None when it declares none; ConfigError naming ``path`` for one that is not
    a rate."""
    feature = features.get(column, {})
    if feature.get("_type") != "Audio" or feature.get("sampling_rate") is None:
        return None
    try:
        rate = read_number("its sampling_rate", feature["sampling_rate"], whole=True, above=0, at_most=MAX_SAMPLE_RATE)
    except NumberError as error:
        raise ConfigError(
            f"{path}: the huggingface schema metadata of column {column!r}: {error}. Fix: write the file again "
            "with datasets."
        ) from None
    return int(rate)  # type: ignore[arg-type]


def audio_column(schema: pa.Schema, features: dict[str, dict], given: str | None) -> str:
    """The audio column: ``given``, else the first ``Audio`` feature, else the first column
    of ``{"bytes", "path"}`` or ``{"array", "sampling_rate"}`` cells."""
    pa = pyarrow()
    names = list(schema.names)
    if given is not None:
        return _given(given, names, "audio_column")
    found = next((n for n in names if features.get(n, {}).get("_type") == "Audio"), None)
    for field in schema:
        if found is None and pa.types.is_struct(field.type):
            children = {field.type.field(i).name for i in range(field.type.num_fields)}
            if children >= ENCODED_CELL or children >= DECODED_CELL:
                found = field.name
    if found is None:
        raise ConfigError(
            f"the dataset has no audio column (its columns: {', '.join(names)}): {option('hf', '...')} packs speech, "
            'a column of Audio cells ({"bytes", "path"} or {"array", "sampling_rate"}). Fix: for text alone, write '
            "its text column to a file, one sentence a line, and tokenize it with `seqshard binarize --in FILE --out "
            "PREFIX --tokenizer MODEL` (read by make_token_loader); if a column does hold audio, name it with "
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


def cell_audio(cell: Any, where: Where, folder: Path, channel: int | None) -> tuple[bytes | None, DecodedAudio]:
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
        try:  # a path too long or holding NUL is an OSError or ValueError of its own
            path = Path(cell["path"])
            path = path if path.is_absolute() or path.is_file() else folder / path
            data = read_audio_file(path)  # a regular file of bounded size, not a device or a FIFO
        except (OSError, ValueError) as error:
            said = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            raise InputError(
                where,
                "missing_audio",
                f"the audio cell holds no bytes, and its path {shown(cell['path'])} cannot be read ({said}).",
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


def decoded_audio(array: np.ndarray, rate: int, where: Where, channel: int | None) -> DecodedAudio:
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
    return DecodedAudio(array.astype(np.float32), rate, subtype, "array")
