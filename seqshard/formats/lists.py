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
from pathlib import Path

from ..errors import ConfigError, InputError, ShardError, Where
from .audio import WavLocation, parse_wav_location, read_location
from .patterns import SHARD_SUFFIXES
from .tar import Sample

SEGMENT_FIELD = "segment.json"  # start and end of a sample cut from its audio file
READ_ERROR_FIELD = "read_error.txt"  # why a sample's audio could not be read
RELATIVE_PATHS = "check the path (a relative path is taken from the current folder, else from the list's folder)."


def resolve(path: str, listed_in: Path) -> Path:
    """A path written in a list: from the current folder, else from the list's folder."""
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists():
        return candidate
    beside = listed_in.parent / candidate
    return beside if beside.exists() else candidate


def shard_list(path: Path) -> list[Path] | None:
    """The shards a shard list names, or None when the file is a list of samples (a raw list,
    whose first line is a JSON object, or a wav.scp)."""
    if path.name.endswith(".scp"):
        return None
    with open(path, encoding="utf-8") as stream:
        if next((line for line in stream if line.strip()), "").lstrip().startswith("{"):
            return None
        stream.seek(0)
        lines = [(number, line.strip()) for number, line in enumerate(stream, 1) if line.strip()]
    for number, line in lines:
        if not line.endswith(SHARD_SUFFIXES):
            raise ConfigError(
                f"{path} line {number}: {line[:80]!r} is not a shard path (a list holds shard paths ending in "
                f'{", ".join(SHARD_SUFFIXES)}, or JSON samples with "key" and "wav").'
            )
    return [resolve(line, path) for _, line in lines]


def count_lines(path: Path) -> int:
    with open(path, "rb") as stream:
        return sum(1 for line in stream if line.strip())


class ListSampleStream:
    """The samples of a raw list, from byte ``start`` (sample ``ordinal``): the interface of
    :class:`~.tar.SampleStream`. A sample's fields are its audio file's bytes under the
    file's extension, its ``txt`` and, when cut, ``segment.json``."""

    def __init__(self, path: str | Path, start: int = 0, ordinal: int = 0, read_data: bool = True, **_: object):
        self.path = str(path)
        self._stream = open(path, "rb")  # noqa: SIM115 (closed by close())
        self._stream.seek(start)
        self._read_data = read_data
        self._offset = start
        self.ordinal = ordinal
        self.ended_cleanly = False

    @property
    def resume_offset(self) -> int:
        return self._offset

    def close(self) -> None:
        self._stream.close()

    def __enter__(self) -> ListSampleStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def next_sample(self) -> Sample | None:
        while True:
            offset = self._offset
            line = self._stream.readline()
            if not line:
                self.ended_cleanly = True
                return None
            self._offset += len(line)
            if line.strip():
                break
        record = self._parse(line, offset)
        fields: dict[str, bytes | memoryview] = {}
        if self._read_data:
            fields.update(self._audio(record))
            if "txt" in record:
                fields["txt"] = str(record["txt"]).encode("utf-8")
            if "start" in record or "end" in record:
                segment = {"start": float(record.get("start", 0)), "end": float(record.get("end", -1))}
                fields[SEGMENT_FIELD] = json.dumps(segment).encode()
        sample = Sample(str(record["key"]), fields, offset, self.ordinal)
        self.ordinal += 1
        return sample

    def _audio(self, record: dict) -> dict[str, bytes]:
        """The audio's bytes under its extension, or why they cannot be read."""
        location = parse_wav_location(str(record["wav"]))
        if not location.is_pipe and location.offset is None:
            location = WavLocation(str(resolve(location.path, Path(self.path))))
        elif location.offset is not None:
            location = WavLocation(str(resolve(location.path, Path(self.path))), location.offset)
        where = Where(self.path, self.ordinal + 1, str(record["key"]))
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
            fix = RELATIVE_PATHS if error.reason == "missing_audio" else error.fix or ""
            return {READ_ERROR_FIELD: "\t".join((error.reason, error.problem, fix)).encode()}

    def _parse(self, line: bytes, offset: int) -> dict:
        if not line.lstrip().startswith(b"{"):  # a wav.scp line: KEY LOCATION
            key, _, value = line.decode("utf-8", "replace").strip().partition(" ")
            if not value.strip():
                raise ShardError(self.path, offset, f"line {self.ordinal + 1} needs 'KEY PATH' (found {line[:80]!r})")
            return {"key": key, "wav": value.strip()}
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ShardError(self.path, offset, f"line {self.ordinal + 1} is not JSON ({error})") from None
        if not isinstance(record, dict) or "key" not in record or "wav" not in record:
            raise ShardError(self.path, offset, f'line {self.ordinal + 1} needs "key" and "wav" (found {line[:80]!r})')
        return record
