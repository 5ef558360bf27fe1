"""Lists the loader reads directly: WeNet's ``.list`` files and Kaldi's ``wav.scp``.

A shard list names one tar shard per line (WeNet's ``data.shards.list``). A raw list holds one
JSON object per line, ``{"key": ..., "wav": PATH, "txt": ..., "start": s, "end": s}``
(``start``/``end`` in seconds, optional). A ``wav.scp`` (any ``.scp``) holds ``KEY PATH`` lines
(a file, or ``ARK:OFFSET`` of wav-in-ark; labels come from the loader's ``labels=``). A raw list
or scp is read like a shard whose samples are its lines: :class:`ListSampleStream` yields them
in order from a byte offset, so the loader plans, splits, resumes and skips it exactly as a
shard. Relative paths are taken from the current folder (as WeNet and Kaldi do), else from the
list's folder. Audio that cannot be read is reported by the audio stage, per sample, so that
``skip_bad`` skips that sample, not the rest of the list.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from ...errors import ConfigError, InputError, Where, listed
from ...protocol import Closing
from ..audio import WavLocation, parse_wav_location, read_location
from ..files import NotAFileError
from ..inflation import BoundedLines, LineTooLong, numbered_lines
from ..keys import key_hash
from ..patterns import SHARD_SUFFIXES, is_shard_name
from ..remote.access import has_query, is_remote, url_name
from ..tar import TarRecord
from .kaldi import BOM, long_line, parse_line

_LOG = logging.getLogger("seqshard")
SEGMENT_FIELD = "segment.json"  # start and end of a sample cut from its audio file
READ_ERROR_FIELD = "read_error.txt"  # why a sample's audio could not be read
RELATIVE_PATHS = "check the path (a relative path is taken from the current folder, else from the list's folder)."


def resolve(path: str, listed_in: Path, root: str | Path | None = None) -> Path:
    """A path written in a list: from ``root`` when given, else from the current folder, else
    from the list's folder."""
    candidate = Path(path)
    if root is not None and not candidate.is_absolute():
        return Path(root) / candidate
    if candidate.is_absolute() or candidate.exists():
        return candidate
    beside = listed_in.parent / candidate
    return beside if beside.exists() else candidate


def shard_list(path: Path) -> list[str] | None:
    """The shards a shard list names (local paths resolved, URLs as written), or None when the
    file is a list of samples (a raw list, whose first line is a JSON object, or a wav.scp).
    The one reader of shard lists, for local and remote selections alike."""
    if path.name.endswith(".scp"):
        return None
    first = first_line(path)
    if first is None or first.lstrip().startswith(b"{"):
        return None  # a raw list (an empty one is reported as such)
    lines = []
    for number, _, raw in list_lines(path):
        if not isinstance(raw, bytes):
            raise ConfigError(f"{path} line {number}: {raw}; a list names one shard a line.")
        try:
            if raw.strip():
                lines.append((number, raw.decode("utf-8").strip()))
        except UnicodeDecodeError as error:
            raise ConfigError(f"{path}: not UTF-8 text ({error.reason}): not a list of shards or samples.") from None
    for number, line in lines:
        if not (is_shard_name(url_name(line)) or (is_remote(line) and has_query(line))):
            raise ConfigError(
                f"{path} line {number}: {line[:80]!r} is not a shard path (a list holds shard paths ending in "
                f'{", ".join(SHARD_SUFFIXES)}, or JSON samples with "key" and "wav").'
            )
    return [line if is_remote(line) else str(resolve(line, path)) for _, line in lines]


def list_lines(path: str | Path) -> Iterator[tuple[int, int, bytes | LineTooLong]]:
    """The lines of a list (or manifest) file (``inflation.numbered_lines``): a regular file
    (ConfigError for a FIFO, a device or a folder: it is read more than once, and a device
    never ends)."""
    try:
        yield from numbered_lines(path)
    except NotAFileError as error:
        raise ConfigError(f"{path}: {error.strerror}: a list is read more than once; write it to a file.") from None


def carried_problem(error: InputError) -> bytes:
    """An error carried as a field (:data:`READ_ERROR_FIELD`) to the stage that reports it per
    sample (counted under ``skip_bad``)."""
    return "\t".join((error.reason, error.problem, error.fix or "")).encode()


def scan_list(path: Path, key_of: Callable[[bytes], str] | None = None) -> int:
    """How many samples a raw list (or wav.scp; or with ``key_of``, the key of a line, another
    list of JSON lines) holds, checking that no key repeats and that there is at least one
    (ConfigError naming the lines otherwise). Lines that cannot be read are counted here and
    reported when the loader reaches them."""
    key_of = key_of or _key_of
    keys = []
    for number, _, line in list_lines(path):
        if not isinstance(line, bytes):
            keys.append(key_hash(f"{line} (line {number})"))  # read as a bad sample, told then
        elif line.strip():
            keys.append(key_hash(key_of(line)))
    if not keys:
        raise ConfigError(f"{path} holds no samples (an empty list).")
    hashes = np.asarray(keys, dtype=np.uint64)
    unique, counts = np.unique(hashes, return_counts=True)
    if (counts > 1).any():
        repeated = int(unique[np.argmax(counts > 1)])
        lines = [number for number, h in enumerate(keys, 1) if h == repeated]
        raise ConfigError(
            f"{path}: samples {', '.join(map(str, lines))} have the same key; each sample needs a key of its own "
            "(remove the repeats)."
        )
    return len(keys)


def first_line(path: Path) -> bytes | None:
    """The first line of a file that is not blank (None when there is none); ConfigError
    when it is beyond the line bound (``inflation.MAX_LINE_BYTES``)."""
    for number, _, line in list_lines(path):
        if not isinstance(line, bytes):
            raise ConfigError(f"{path} line {number}: {line}. Fix: remove the line, or split it (one entry a line).")
        if line.strip():
            return line
    return None


def _key_of(line: bytes) -> str:
    """The key of a list line, as far as it can be told (a bad line gets its own text)."""
    if line.lstrip().startswith(b"{"):
        try:
            record = json.loads(line)
            return (
                str(record["key"]) if isinstance(record, dict) and "key" in record else line.decode("utf-8", "replace")
            )
        except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deeply, a number too long
            return line.decode("utf-8", "replace")
    return line.removeprefix(BOM).split(None, 1)[0].decode("utf-8", "replace")


class ListSampleStream(Closing):
    """The samples of a raw list, from byte ``start`` (sample ``ordinal``): the interface of
    :class:`~.tar.SampleStream`. A sample's fields are its audio file's bytes under the
    file's extension, its ``txt`` and, when cut, ``segment.json``."""

    def __init__(
        self,
        path: str | Path,
        start: int = 0,
        ordinal: int = 0,
        read_data: bool = True,
        path_root: str | Path | None = None,
        **_: object,
    ):
        self.path = str(path)
        self.path_root = path_root
        self._lines = BoundedLines(path, start, compressed=False)
        self._read_data = read_data
        self.ordinal = ordinal
        self.ended_cleanly = False

    @property
    def resume_offset(self) -> int:
        return self._lines.position

    def close(self) -> None:
        self._lines.close()

    def next_sample(self) -> TarRecord | None:
        while True:
            offset = self._lines.position
            line: bytes | LineTooLong
            try:
                line = self._lines.readline()
            except LineTooLong as error:
                line = error  # a bad sample, reported as such
                break
            if not line:
                self.ended_cleanly = True
                return None
            if offset == 0 and line.startswith(BOM):
                _LOG.warning(
                    "%s starts with a UTF-8 byte order mark (an editor's); it is not part of the first key", self.path
                )
                line = line[len(BOM) :]
            if line.strip():
                break
        where = Where(self.path, self.ordinal + 1, None)
        fields: dict[str, bytes | memoryview] = {}
        try:
            if not isinstance(line, bytes):
                raise long_line(where, line)
            record = self._parse(line, where)
        except InputError as error:  # one bad line is one bad sample, not the end of the list
            record = {"key": f"line-{self.ordinal + 1}"}
            fields[READ_ERROR_FIELD] = carried_problem(error)
        else:
            if self._read_data:
                fields.update(self._audio(record))
                if "txt" in record:
                    fields["txt"] = record["txt"].encode("utf-8")
                if "start" in record or "end" in record:
                    fields[SEGMENT_FIELD] = json.dumps({"start": record["start"], "end": record["end"]}).encode()
                fields.update(self._more_fields(record))
        sample = TarRecord(str(record["key"]), fields, offset, self.ordinal)
        self.ordinal += 1
        return sample

    def _more_fields(self, record: dict) -> dict[str, bytes]:
        """Fields beyond audio, text and segment (none in a raw list)."""
        return {}

    def _audio(self, record: dict) -> dict[str, bytes]:
        """The audio's bytes under its extension, or why they cannot be read."""
        where = Where(self.path, self.ordinal + 1, str(record["key"]))
        try:
            location = parse_wav_location(str(record["wav"]), where)
        except InputError as error:  # an offset no ark reaches
            return {READ_ERROR_FIELD: carried_problem(error)}
        if not location.is_pipe:
            location = WavLocation(str(resolve(location.path, Path(self.path), self.path_root)), location.offset)
        if location.is_pipe:
            raise InputError(
                where,
                "pipe_refused",
                f"the entry is a shell command ({location.path!r}); the loader does not run commands found in data.",
                "pack it with `seqshard pack --wav-scp ... --allow-pipes`, or write the audio to files.",
                skippable=False,
            )
        try:
            return {location.format: read_location(location, where)}
        except InputError as error:
            if error.reason == "missing_audio":
                fix = f"check the path (relative paths are taken from path_root={self.path_root!s})."
                error = InputError(error.where, error.reason, error.problem, fix if self.path_root else RELATIVE_PATHS)
            return {READ_ERROR_FIELD: carried_problem(error)}

    def _parse(self, line: bytes, where: Where) -> dict:
        """A line as a record with ``key``, ``wav`` and optional ``txt``, ``start``, ``end``
        (numbers, seconds); InputError (``malformed_line``) when it is not one."""
        if not line.lstrip().startswith(b"{"):  # a wav.scp line: KEY LOCATION
            key, value = parse_line(line, where, needs_value=True)
            return {"key": key, "wav": value}
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as error:  # not JSON, not UTF-8, nested too deeply, a number too long
            raise InputError(where, "malformed_line", f"the line is not JSON ({str(error)[:200]}).") from None
        if (
            not isinstance(record, dict)
            or not isinstance(record.get("key"), str)
            or not isinstance(record.get("wav"), str)
        ):
            if isinstance(record, dict):
                held = f"keys {listed([json.dumps(k) for k in record], shown=8)}" if record else "no keys"
            else:
                held = f"a JSON {type(record).__name__}, not an object"
            raise InputError(
                where,
                "malformed_line",
                f"this line holds {held}; a line of a sample list (WeNet's raw list) is a JSON object with "
                '"key" and "wav" strings ("txt", "start", "end" optional), and a shard list names one shard a line.',
                "a NeMo manifest line (audio_filepath): give the file a .json or .jsonl name, read as NeMo's"
                if isinstance(record, dict) and "audio_filepath" in record
                else 'write the list in that form (e.g. {"key": "utt1", "wav": "a.wav", "txt": "hello"}).',
            )
        if "txt" in record and not isinstance(record["txt"], str):
            raise InputError(
                Where(where.path, where.line, record["key"]),
                "malformed_line",
                f'"txt" must be a string (found {record["txt"]!r:.40}).',
            )
        if "start" in record or "end" in record:
            start, end = record.get("start", 0), record.get("end", -1)
            seconds = (_seconds(start), _seconds(end))
            if None in seconds:
                raise InputError(
                    Where(where.path, where.line, record["key"]),
                    "malformed_line",
                    f'"start" and "end" must be finite numbers of seconds (found {start!r:.40}, {end!r:.40}).',
                )
            record["start"], record["end"] = seconds
        return record


def _seconds(value: object) -> float | None:
    """A JSON number as seconds, or None when it is not a finite number (text, true, NaN, 1e999)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        seconds = float(value)
    except OverflowError:  # an integer of hundreds of digits
        return None
    return seconds if math.isfinite(seconds) else None
