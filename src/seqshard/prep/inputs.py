"""What ``pack`` reads: one row per utterance, its length, and the members it becomes.

- :class:`FeatureSource`: Kaldi matrices named by ``feats.scp``; lengths in frames (from
  ``utt2num_frames`` or matrix headers); each value's start and end checked against its ark.
- :class:`AudioSource`: audio named by ``wav.scp``, cut by ``segments`` when given; lengths in
  10 ms frames (from ``segments``, ``utt2dur`` or the audio); stored as FLAC (integer PCM,
  lossless), as the original bytes (lossy and float audio, or ``--audio-format keep``), or as
  Kaldi-compatible fbank computed at pack time (see ``formats.audio.store``).

The plan (``plan.py``) and the writer (``write.py``) work through this interface only, so
audio and features share the global shuffle, length groups, crash safety, jobs, parts, report
and bad-input rules.
"""

from __future__ import annotations

import json
import logging
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..checks import NumberError, read_number, shown
from ..errors import ConfigError, InputError, SkipCounter, Where, option
from ..formats.audio import (
    SEGMENTS_FIX,
    DecodedAudio,
    cut,
    decode_audio,
    header_seconds,
    parse_wav_location,
    read_location,
    resample,
    store,
)
from ..formats.fields import NODATA
from ..formats.files import NotAFileError, read_input
from ..formats.index_entries import MAX_DIM, MAX_SECONDS
from ..formats.keys import key_problem
from ..formats.npy import npy_parts
from ..formats.peers.kaldi import MatrixReader, parse_line
from ..formats.peers.keytable import KeyTable
from ..protocol import Closing

if TYPE_CHECKING:
    from .job import PackOptions

_LOG = logging.getLogger("seqshard")

FEATURE_MEMBER, LABEL_MEMBER = "feats.npy", "txt"  # what a packed feature sample holds
NUM_FRAMES_FILE = "utt2num_frames"
DURATIONS_FILE = "utt2dur"
FRAME_SHIFT_FILE = "frame_shift"
FRAME_SHIFT_BYTES = 4096  # what is read of it (a number)
AUDIO_SHIFT_MS = 10.0  # audio lengths are counted in 10 ms frames (those fbank makes)
Members = list[tuple[str, list[Any]]]
Progress = Callable[[str, int], Callable[[int], None]] | None


def check_key(key: str, where: Where, options: PackOptions) -> None:
    """InputError ``bad_key`` for a key no shard can hold as it is (or, with ``escape_keys``,
    escaped): every route of keys into a pack (feats.scp, wav.scp, segments) comes here."""
    problem = key_problem(key, escaped=options.escape_keys)
    if problem:
        escaping = not options.escape_keys and key_problem(key, escaped=True) is None
        raise InputError(
            where,
            "bad_key",
            f"{problem}.",
            "rename the utterance"
            + (f", or pass {option('escape_keys')} to store it percent-encoded." if escaping else "."),
        )


# ---------------------------------------------------------------------------------------
# Kaldi features


@dataclass(frozen=True)
class Utterance:
    """A planned utterance as a write task reads it: its table line's key and value, where
    that line is, its length as planned (-1: not known) and, for a feature matrix, ``(value
    offset, key)`` of the next value its scp lists in the same ark (see ``MatrixReader.read``)."""

    key: str
    value: str
    where: Where
    length: int = -1
    successor: tuple[int, str] | None = None


class FeatureSource:
    """Kaldi feature matrices named by ``feats.scp`` file(s)."""

    kind = "features"
    unit = "frames"
    texts_inside = False
    parse = staticmethod(parse_line)

    def __init__(self, scp_files: Sequence[Path], options: PackOptions):
        self.files = self.tables = [Path(f) for f in scp_files]
        self.options = options

    def check(self, key: str, value: str, where: Where) -> tuple[str, int] | None:
        """Refuse a line the pack cannot take; returns the value's ``(ark, offset)`` (None for a
        command or a file of one object), by which a scan finds each value's successor."""
        check_key(key, where, self.options)
        location = self.options.location(value, where)
        return None if location.is_pipe or location.offset is None else (location.path, location.offset)

    def length_files(self) -> tuple[list[Path], bool]:
        """The files that give lengths (``utt2num_frames``, next to each scp or given), and
        whether they count seconds."""
        return [Path(f) for f in self.options.num_frames_files] or _beside(self.files, NUM_FRAMES_FILE), False

    def measurer(self) -> MatrixReader:
        return MatrixReader(allow_pipes=self.options.allow_pipes)

    def length(self, measurer: MatrixReader, key: str, value: str, where: Where) -> int:
        """Frames of the matrix, from its header when binary."""
        return int(measurer.shape(self.options.location(value, where), where)[0])

    def dim(self, utterances: Iterable[Utterance]) -> int:
        """The dataset's feature dimension: that of the first of ``utterances`` that reads (an
        unreadable one stops here unless skipping; 0 when none reads)."""
        with self.measurer() as reader:
            for utterance in utterances:
                try:
                    dim = int(reader.shape(self.options.location(utterance.value, utterance.where), utterance.where)[1])
                except InputError:
                    if not self.options.skip_bad:
                        raise
                    continue
                if dim > MAX_DIM:
                    raise InputError(
                        utterance.where,
                        "bad_dim",
                        f"its matrix has {dim} columns, more than the {MAX_DIM} a feature vector may have.",
                        "check that feats.scp points at feature matrices (one row a frame).",
                        skippable=False,
                    )
                return dim
        return 0

    def reader(self, dim: int) -> _FeatureReader:
        return _FeatureReader(self, dim)

    def facts(self, dim: int) -> tuple[dict[str, Any], list[str]]:
        """The index's dataset facts and member fields."""
        return pack_facts(dim, asdict(self.options), _frame_shift_ms(self.files))


class _FeatureReader(Closing):
    """Reads planned matrices and checks them (a context manager: arks stay open)."""

    def __init__(self, source: FeatureSource, dim: int):
        self.source, self.dim = source, dim
        self.options = source.options
        self.matrices = MatrixReader(allow_pipes=self.options.allow_pipes)

    def close(self) -> None:
        self.matrices.close()

    def read(self, utterance: Utterance) -> tuple[Members, int, None]:
        """The utterance's members and length (frames); None: no audio was stored."""
        options, where = self.options, utterance.where
        array = self.matrices.read(options.location(utterance.value, where), where, utterance.successor)
        frames = array.shape[0]
        if frames == 0:
            raise InputError(where, "zero_length", "the matrix has no frames.", "remove it.")
        if utterance.length >= 0 and utterance.length != frames:
            raise InputError(
                where,
                "frames_mismatch",
                f"utt2num_frames says {utterance.length} frames but the ark holds {frames}.",
                "regenerate utt2num_frames (or delete it to read lengths from the arks).",
            )
        if array.shape[1] != self.dim:
            raise InputError(
                where,
                "dim_mismatch",
                f"the matrix has {array.shape[1]} columns where the dataset has {self.dim}.",
                "pack features of one kind together.",
            )
        return [(FEATURE_MEMBER, list(npy_parts(checked_features(array, options.dtype, where))))], frames, None


def checked_features(array: np.ndarray, dtype: str, where: Where) -> np.ndarray:
    """``array`` in the stored ``dtype``, refusing NaN/Inf and float16 overflow."""
    # A float64 sum is one pass without a temporary; NaN/Inf propagate and cannot overflow.
    if not np.isfinite(array.sum(dtype=np.float64)):
        bad_frame = int(np.flatnonzero(~np.isfinite(array).all(axis=1))[0])
        raise InputError(
            where,
            "non_finite",
            f"the matrix holds NaN or Inf (first at frame {bad_frame}).",
            "recompute the features.",
        )
    array = array.astype(dtype, copy=False)
    if dtype == "float16" and not np.isfinite(array.sum(dtype=np.float64)):
        raise InputError(
            where,
            "float16_overflow",
            "a value is beyond float16's range (65504).",
            f"pack with {option('dtype', 'float32')}.",
        )
    return array


class ArkPositions:
    """Per scp row, its ark (a small number per distinct path) and value offset, gathered
    while the scp is scanned, in compact arrays (no Python object per row)."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self.arks = array("i")
        self.offsets = array("q")

    def add(self, position: tuple[str, int] | None) -> None:
        """The next row's ``(ark, value offset)``; None: no ark position (a command, or a file
        holding one object)."""
        if position is None:
            self.arks.append(-1)
            self.offsets.append(0)
            return
        self.arks.append(self._ids.setdefault(position[0], len(self._ids)))
        self.offsets.append(position[1])

    def next_rows(self, num_rows: int) -> np.ndarray:
        """For each row, the first row (in scp order) of the next distinct value start after
        its own in the same ark, else -1. Rows sharing one offset (different Kaldi ranges of
        one matrix) share a value and so a successor. Empties the collector."""
        if len(self.arks) != num_rows:
            raise RuntimeError(f"{len(self.arks)} ark positions for {num_rows} scp rows; please report this.")
        dtype = np.int32 if num_rows < 2**31 else np.int64
        arks = np.frombuffer(self.arks, dtype=np.int32) if num_rows else np.empty(0, np.int32)
        offsets = np.frombuffer(self.offsets, dtype=np.int64) if num_rows else np.empty(0, np.int64)
        self.arks, self.offsets, self._ids = array("i"), array("q"), {}  # freed with the views below
        next_row = np.full(num_rows, -1, dtype=dtype)
        rows = np.flatnonzero(arks >= 0).astype(dtype)
        if not len(rows):
            return next_row
        order = rows[np.lexsort((offsets[rows], arks[rows]))]  # stable: scp order within one offset
        del rows
        sorted_arks, sorted_offsets = arks[order], offsets[order]
        starts_value = np.ones(len(order), dtype=bool)
        starts_value[1:] = (sorted_arks[1:] != sorted_arks[:-1]) | (sorted_offsets[1:] != sorted_offsets[:-1])
        del sorted_offsets
        firsts = np.flatnonzero(starts_value)  # the first sorted position of each distinct value
        successor = np.full(len(firsts), -1, dtype=dtype)  # per distinct value
        same_ark = sorted_arks[firsts[1:]] == sorted_arks[firsts[:-1]]
        successor[:-1] = np.where(same_ark, order[firsts[1:]], -1)
        value_of = np.cumsum(starts_value) - 1  # sorted position -> its distinct value
        next_row[order] = successor[value_of]
        return next_row


# ---------------------------------------------------------------------------------------
# audio


@dataclass(frozen=True)
class _Segment:
    recording: str
    start: float
    end: float


class AudioSource:
    """Audio named by ``wav.scp`` file(s), cut by ``segments`` file(s) when given."""

    kind = "audio"
    unit = "10 ms"
    texts_inside = False
    parse = staticmethod(parse_line)
    durations = "utt2dur", "regenerate utt2dur (or delete it to read durations from the audio)."  # name, fix

    def __init__(self, wav_scp: Sequence[Path], segments: Sequence[Path], options: PackOptions):
        self.wav_files = [Path(f) for f in wav_scp]
        self.segment_files = [Path(f) for f in segments]
        self.files = [*self.wav_files, *self.segment_files]
        self.options = options
        self._recordings: KeyTable | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_recordings": None}  # each process scans the wav.scp it needs

    @property
    def tables(self) -> list[Path]:
        """The files of one line per utterance: the segments, else the wav.scp."""
        return self.segment_files or self.wav_files

    def _root(self) -> Path | None:
        return Path(self.options.path_root) if self.options.path_root else None

    def check(self, key: str, value: str, where: Where) -> None:
        """Refuse a line the pack cannot take (a key no shard holds, a command unless allowed)."""
        check_key(key, where, self.options)
        if self.segment_files:
            _parse_segment(value, where)
        else:
            self._check_recording(value, where)

    def _check_recording(self, value: str, where: Where) -> None:
        location = parse_wav_location(value, where, self._root())
        if location.is_pipe and not self.options.allow_pipes:
            raise InputError(
                where,
                "pipe_refused",
                f"the entry is a shell command ({location.path!r}); seqshard does not run commands found in data.",
                f"run the command yourself, or pass {option('allow_pipes')} to run it.",
                skippable=False,  # running data as commands is the user's call, not a bad-data skip
            )

    def recordings(self) -> KeyTable:
        """The wav.scp of the segments, scanned once per process (a bad recording line is
        counted through its segments, dropped as ``no_recording``)."""
        if self._recordings is None:
            self._recordings = KeyTable.scan(
                self.wav_files,
                SkipCounter(self.options.skip_bad),
                needs_value=True,
                check=lambda key, value, where: self._check_recording(value, where),
            )
        return self._recordings

    def length_files(self) -> tuple[list[Path], bool]:
        """``utt2dur`` next to the wav.scp (not for segments, which say their own ends), in seconds."""
        return ([] if self.segment_files else _beside(self.wav_files, DURATIONS_FILE)), True

    def measurer(self) -> _AudioReader:
        return _AudioReader(self, 0)

    def length(self, reader: _AudioReader, key: str, value: str, where: Where) -> int:
        """One utterance's length in 10 ms frames, decoding its audio only when no header or
        segment end says it."""
        if self.segment_files:
            segment = _parse_segment(value, where)
            if segment.end >= 0:
                return round((segment.end - segment.start) * 100)
        else:
            seconds = header_seconds(parse_wav_location(value, where, self._root()), where)
            if seconds is not None:
                return round(seconds * 100)
        return round(reader.audio(key, value, where).seconds * 100)

    def dim(self, utterances: Iterable[Utterance]) -> int:
        return self.options.num_mel_bins if self.options.features == "fbank" else 0

    def reader(self, dim: int) -> _AudioReader:
        return _AudioReader(self, dim)

    def facts(self, dim: int) -> tuple[dict[str, Any], list[str]]:
        return pack_facts(dim, asdict(self.options))


def pack_facts(dim: int, options: Mapping[str, Any], frame_shift_ms: float = 10.0) -> tuple[dict[str, Any], list[str]]:
    """The index's dataset facts and member fields of a pack with ``options`` (its PackOptions
    as a dict, or their record in run.json, which ``seqshard index`` reads): features of ``dim``
    (read from arks, or fbank computed at pack time) or, when ``dim`` is 0, the audio stored."""
    if not dim:
        facts = {
            "field": "audio",
            "kind": "audio",
            "encoding": options["audio_format"],
            "label_field": LABEL_MEMBER,
            "frame_shift_ms": AUDIO_SHIFT_MS,
        }
        return facts, []  # the members' extensions are recorded per shard (they vary with "keep")
    facts = {
        "field": FEATURE_MEMBER,
        "label_field": LABEL_MEMBER,
        "dim": dim,
        "dtype": options["dtype"],
        "frame_shift_ms": frame_shift_ms,
    }
    if options.get("features") == "fbank":
        facts.update(made_from="audio (Kaldi-compatible fbank at pack time)", sample_rate=options.get("resample_to"))
    return facts, [FEATURE_MEMBER, LABEL_MEMBER]


def _parse_segment(value: str, where: Where) -> _Segment:
    """A segments line's value; its times finite seconds that an utterance's length can
    count (the end negative: to the end of the recording, as in Kaldi), else InputError."""
    parts = value.split()
    try:
        recording, start, end = parts[0], float(parts[1]), float(parts[2])
    except (IndexError, ValueError):
        parts = []
    if len(parts) != 3:
        raise InputError(where, "malformed_line", f"expected 'RECORDING START END' (seconds), found {value!r}.")
    try:
        read_number("its start", start, at_least=0, at_most=MAX_SECONDS)
        read_number("its end", end, at_most=MAX_SECONDS)
    except NumberError as error:
        raise InputError(where, "bad_segment", f"{error} (seconds).", SEGMENTS_FIX) from None
    if end >= 0 and end <= start:
        raise InputError(where, "bad_segment", f"the segment {start:g} .. {end:g} s is empty or negative.")
    return _Segment(recording, start, end)


class _AudioReader(Closing):
    """Reads planned utterances' audio: decodes (the last recording is kept for its next
    segments), cuts, and encodes or computes fbank."""

    def __init__(self, source: AudioSource, dim: int):
        self.source, self.dim = source, dim
        self.options = source.options
        self._last: tuple[str, DecodedAudio] | None = None

    def close(self) -> None:
        self._last = None

    def _recording(self, key: str, value: str, where: Where) -> tuple[bytes, DecodedAudio]:
        location = parse_wav_location(value, where, self.source._root())
        data = read_location(location, where, self.options.allow_pipes)
        return data, decode_audio(data, where, self.options.channel)

    def audio(self, key: str, value: str, where: Where) -> DecodedAudio:
        """The utterance's audio (a whole recording, or its segment)."""
        return self._utterance(key, value, where)[1]

    def _utterance(self, key: str, value: str, where: Where) -> tuple[bytes | None, DecodedAudio]:
        if not self.source.segment_files:
            return self._recording(key, value, where)
        segment = _parse_segment(value, where)
        if self._last is None or self._last[0] != segment.recording:
            found = self.source.recordings().find(segment.recording)
            if found is None:
                raise InputError(
                    where,
                    "no_recording",
                    f"recording {segment.recording!r} is not in {', '.join(map(str, self.source.wav_files))}.",
                    "add it to the wav.scp, or remove its segments.",
                )
            self._last = (segment.recording, self._recording(segment.recording, found[1], where)[1])
        return None, cut(self._last[1], segment.start, segment.end, where)

    def read(self, utterance: Utterance) -> tuple[Members, int, str | None]:
        """The utterance's members, its length and how its audio was stored (``kept mp3``,
        ``wav -> flac``; None for fbank features)."""
        where = utterance.where
        original, audio = self._utterance(utterance.key, utterance.value, where)
        samples = audio.samples  # float WAV, decoded arrays may hold NaN (integer PCM cannot): never stored
        if samples.dtype.kind == "f" and not np.isfinite(samples.sum(dtype=np.float64)):
            raise InputError(
                where,
                "non_finite",
                f"the audio holds NaN or infinity (first at sample {int(np.flatnonzero(~np.isfinite(samples))[0])}).",
                "check how the audio was made.",
            )
        frames = round(audio.seconds * 100)
        if utterance.length >= 0 and abs(utterance.length - frames) > 1:
            raise InputError(
                where,
                "duration_mismatch",
                f"{self.source.durations[0]} says {utterance.length / 100:g} s but the audio lasts {audio.seconds:g} s.",
                self.source.durations[1],
            )
        options = self.options
        if options.features == "fbank":
            return self._fbank(audio, where)
        if options.resample_to and audio.sample_rate != options.resample_to:
            samples = resample(audio.samples, audio.sample_rate, options.resample_to)
            audio, original = replace(audio, samples=samples, sample_rate=options.resample_to), None
        if options.channel is not None and audio.channels > 1:
            original = None  # one channel of several
        stored = store(audio, options.audio_format, original)  # named by what it is, not by its file name
        return [(stored.extension, [stored.data])], frames, stored.how

    def _fbank(self, audio: DecodedAudio, where: Where) -> tuple[Members, int, None]:
        from ..features.fbank import FbankOptions
        from ..features.frontend import audio_fbank

        options = self.options
        rate = options.resample_to or audio.sample_rate
        fbank_options = FbankOptions(
            sample_rate=float(options.resample_to or FbankOptions.sample_rate), num_mel_bins=options.num_mel_bins
        )
        features = audio_fbank(resample(audio.samples, audio.sample_rate, rate), rate, fbank_options, where)
        if len(features) == 0:
            raise InputError(where, "zero_length", "the audio is shorter than one 25 ms frame.", "remove it.")
        features = checked_features(features, options.dtype, where)
        return [(FEATURE_MEMBER, list(npy_parts(features)))], len(features), None


# ---------------------------------------------------------------------------------------
# shared helpers


def field_members(values: Mapping[str, Any], names: Sequence[str], where: Where) -> Members:
    """Extra fields kept on request (``fields``): each of ``names`` as ``NAME.json``, or
    ``NAME.nodata`` where ``values`` lacks it; InputError (``bad_field``) for a value JSON
    cannot hold (bytes, NaN, infinity)."""
    members: Members = []
    for name in names:
        if name not in values:
            members.append((f"{name}.{NODATA}", [b""]))
            continue
        try:
            members.append((f"{name}.json", [json.dumps(values[name], ensure_ascii=False, allow_nan=False).encode()]))
        except (TypeError, ValueError):
            raise InputError(
                where,
                "bad_field",
                f"field {name!r} is {shown(values[name])}, which JSON cannot hold (bytes, NaN or infinity).",
                f"leave {name} out of {option('fields', '...')}, or make its values numbers, strings or lists.",
            ) from None
    return members


def _beside(files: Sequence[Path], name: str) -> list[Path]:
    """``name`` in the folders of ``files``, where it exists (Kaldi's data dir layout)."""
    return list(dict.fromkeys(Path(f).parent / name for f in files if (Path(f).parent / name).is_file()))


def _frame_shift_ms(files: Sequence[Path]) -> float:
    """Kaldi's ``frame_shift`` file (seconds) next to the first scp, else 10 ms."""
    candidate = Path(files[0]).parent / FRAME_SHIFT_FILE
    try:
        text = read_input(candidate, FRAME_SHIFT_BYTES).decode("utf-8", errors="replace")
    except NotAFileError as error:
        raise ConfigError(
            f"{candidate}: {error.strerror}. Fix: make it a file holding the frame shift in seconds (such as 0.01), "
            "or remove it (10 ms is assumed)."
        ) from None
    except OSError:
        return 10.0
    try:
        return float(read_number("its frame shift", float(text.split()[0]), above=0, at_most=60)) * 1000  # type: ignore[arg-type]
    except (ValueError, IndexError):
        raise ConfigError(
            f"{candidate}: {text[:40]!r} is not a frame shift in seconds (a finite number > 0, such as 0.01): the "
            "index records it and loaders count hours by it. Fix: correct the file, or remove it (10 ms is assumed)."
        ) from None
