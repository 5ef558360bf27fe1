"""Audio in and out: Kaldi ``wav.scp`` entries, decoding (soundfile), cutting segments, and
storing for shards (FLAC, lossless for integer PCM; lossy and float audio as it came).

Samples are float32 in [-1, 1] (soundfile's scale); Kaldi's feature code works on the int16
scale, which the fbank stage applies itself. Multi-channel audio is mixed down (the mean of the
channels) unless a channel is chosen. A ``wav.scp`` value is a file path, a Kaldi pipe
(``sox a.flac -t wav - |``, run only when the user allows pipes), or ``ark:offset`` of a RIFF
blob stored in an ark (ESPnet's and k2's wav-in-ark).
"""

from __future__ import annotations

import errno
import io
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..checks import NumberError, read_digits
from ..errors import InputError, Where, counted, option
from .fields import AUDIO_EXTENSIONS
from .files import NotAFileError, open_input, read_bounded, read_input
from .index_entries import MAX_BYTES

if TYPE_CHECKING:
    from soundfile import SoundFile

CONTAINERS = {
    "WAV": "wav",
    "WAVEX": "wav",
    "FLAC": "flac",
    "OGG": "ogg",
    "MPEG": "mp3",
    "MP3": "mp3",
    "RF64": "wav",
    "NIST": "sph",
}
PCM_BITS = {"PCM_S8": 8, "PCM_U8": 8, "PCM_16": 16, "PCM_24": 24}  # what FLAC holds exactly
LOSSY_SUBTYPES = (  # codecs that decode to approximations of 16-bit (or fewer) PCM
    *("MPEG_LAYER_I", "MPEG_LAYER_II", "MPEG_LAYER_III", "VORBIS", "OPUS"),
    *("ULAW", "ALAW", "IMA_ADPCM", "MS_ADPCM", "GSM610", "G721_32", "G723_24", "G723_40", "VOX_ADPCM"),
)
ESTIMATED_LENGTH_FORMATS = ("MP3", "OGG")  # their headers give an estimated frame count, not an exact one
DECODE_BLOCK_SAMPLES = 1 << 20  # samples decoded at a time (4 MB of float32)
MAX_AUDIO_FILE_BYTES = 1 << 32  # an audio file is read whole: 4 GiB is 18 h of 16 kHz 16-bit stereo
MAX_FRAMES_PER_BYTE = 8192  # beyond any codec's reach (a FLAC frame holds <= 65535 frames in >= 10 bytes)
MAX_SAMPLE_RATE = 655_350  # FLAC's highest rate; a header declaring more (or 0) is damaged


@dataclass(frozen=True)
class DecodedAudio:
    """Decoded audio: ``samples`` (float32, one channel) at ``sample_rate``; ``subtype`` is
    the stored sample format (``PCM_16``, ``PCM_24``, ``FLOAT``, ...)."""

    samples: np.ndarray
    sample_rate: int
    subtype: str = "PCM_16"
    format: str = "wav"  # the container it was read from (wav, flac, mp3, ...)
    channels: int = 1  # of the input (``samples`` holds its mixdown or one of them)

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate


@dataclass(frozen=True)
class WavLocation:
    """Where a ``wav.scp`` entry's audio is: a file, a RIFF blob at ``offset`` in an ark, or
    a shell command whose standard output is the audio."""

    path: str
    offset: int | None = None
    is_pipe: bool = False

    @property
    def format(self) -> str:
        """The file's own extension (``wav`` for pipes and ark blobs)."""
        if self.is_pipe or self.offset is not None:
            return "wav"
        return Path(self.path).suffix.lstrip(".").lower() or "wav"


def parse_wav_location(value: str, where: Where, root: Path | None = None) -> WavLocation:
    """A ``wav.scp`` value: ``path``, ``command |`` or ``ark_path:offset`` (an offset no ark
    can reach: InputError ``bad_offset`` naming ``where``)."""
    value = value.strip(" \t\r\n")
    if value.endswith("|"):
        return WavLocation(value[:-1].strip(), is_pipe=True)
    head, sep, tail = value.rpartition(":")
    if sep and tail.isascii() and tail.isdigit() and head.endswith(".ark"):
        try:
            path, offset = head, read_digits("its byte offset", tail, MAX_BYTES)
        except NumberError as error:
            raise InputError(
                where,
                "bad_offset",
                f"{error}: no ark is that large.",
                "regenerate the wav.scp with the ark (wav-copy).",
            ) from None
    else:
        path, offset = value, None
    if root is not None and not Path(path).is_absolute():
        path = str(root / path)
    return WavLocation(path, offset)


def read_location(location: WavLocation, where: Where, allow_pipes: bool = False) -> bytes:
    """The encoded audio of an entry (the file's bytes, the ark's blob or the command's output),
    the one way every route reads audio by path: only a regular file (a FIFO with
    ``allow_pipes``), of at most :data:`MAX_AUDIO_FILE_BYTES` (InputError ``not_a_file``)."""
    if location.is_pipe:
        return _run_pipe(location, where, allow_pipes)
    try:
        if location.offset is None:
            return read_audio_file(location.path, allow_pipes)
        with os.fdopen(open_input(location.path), "rb") as stream:
            stream.seek(location.offset)
            return _riff_blob(stream, location, where)
    except NotAFileError as error:
        raise not_audio(location.path, error, where) from None
    except OSError as error:
        raise InputError(
            where,
            "missing_audio",
            f"cannot open {location.path!r}: {error.strerror}.",
            f"check the path (relative paths are taken from the current folder, as Kaldi does, or from {option('path_root', 'DIR')}).",
        ) from None


def read_audio_file(path: str | Path, allow_pipes: bool = False) -> bytes:
    """The bytes of the audio file ``path``: a regular file (a FIFO with ``allow_pipes``) of at
    most :data:`MAX_AUDIO_FILE_BYTES`, else NotAFileError (an OSError) saying what it is."""
    return read_input(path, MAX_AUDIO_FILE_BYTES, allow_pipes, "one audio file")


def not_audio(path: str | Path, error: NotAFileError, where: Where) -> InputError:
    """The error for an audio path that is no audio file (a device, a FIFO, too large)."""
    if error.errno == errno.EFBIG:
        fix = "cut the recording into shorter files (or give their segments of it in shorter files)."
    else:
        fix = f"name the audio file itself (to read a FIFO, pass {option('allow_pipes')})."
    return InputError(where, "not_a_file", f"{str(path)!r} cannot be read as audio: {error.strerror}.", fix)


def header_seconds(location: WavLocation, where: Where) -> float | None:
    """The duration a file's header gives, read without decoding the audio; None for pipes
    (and FIFOs), for formats whose headers only estimate it (MP3, OGG), for a header that
    declares more frames than its bytes can hold, and for anything unreadable (the full read
    reports those)."""
    import soundfile

    if location.is_pipe:
        return None
    try:
        with os.fdopen(open_input(location.path), "rb") as stream:
            if location.offset is None:
                info, size = soundfile.info(stream), os.fstat(stream.fileno()).st_size
            else:
                stream.seek(location.offset)
                blob = _riff_blob(stream, location, where)
                info, size = soundfile.info(io.BytesIO(blob)), len(blob)
    except (OSError, RuntimeError, InputError):
        return None
    if info.format in ESTIMATED_LENGTH_FORMATS or info.samplerate <= 0 or info.frames > MAX_FRAMES_PER_BYTE * size:
        return None
    return info.frames / info.samplerate


def _riff_blob(stream: io.BufferedReader, location: WavLocation, where: Where) -> bytes:
    header = stream.read(8)
    if header[:4] != b"RIFF" or len(header) < 8:
        matrix = header[:2] == b"\0B" and header[2:4] in (b"FM", b"CM", b"DM", b"FV")
        raise InputError(
            where,
            "bad_offset",
            f"byte offset {location.offset} in {location.path!r} does not start a RIFF (wav) blob"
            + (": it starts a Kaldi matrix (is this a feats.scp?)." if matrix else "."),
            f"pack features with {option('f_scps', '...')}."
            if matrix
            else "regenerate the wav.scp with the ark (wav-copy).",
        )
    size = int.from_bytes(header[4:8], "little")
    left = os.fstat(stream.fileno()).st_size - stream.tell()
    if size > left:  # checked before reading: a read allocates the size it is asked for
        raise InputError(
            where,
            "unreadable_audio",
            f"the wav blob at {location.path}:{location.offset} declares {size} bytes after its RIFF header, but the "
            f"ark holds {left} more bytes (cut short, or the header is damaged).",
            "regenerate the ark and its wav.scp (wav-copy).",
        )
    return header + stream.read(size)


def _run_pipe(location: WavLocation, where: Where, allow_pipes: bool) -> bytes:
    if not allow_pipes:
        raise InputError(
            where,
            "pipe_refused",
            f"the entry is a shell command ({location.path!r}); seqshard does not run commands found in data.",
            f"run the command yourself, or pass {option('allow_pipes')} to run it.",
            skippable=False,
        )
    # a shell, as Kaldi runs its pipes: the user allowed commands from this data
    with (
        tempfile.TemporaryFile() as errors,
        subprocess.Popen(location.path, shell=True, stdout=subprocess.PIPE, stderr=errors) as process,
    ):
        assert process.stdout is not None
        data = read_bounded(process.stdout, MAX_AUDIO_FILE_BYTES)
        if len(data) > MAX_AUDIO_FILE_BYTES:
            process.kill()
            raise not_audio(
                location.path, NotAFileError(errno.EFBIG, f"its output is over {MAX_AUDIO_FILE_BYTES} bytes"), where
            )
        code = process.wait()
        errors.seek(max(0, os.fstat(errors.fileno()).st_size - 4096))
        message = errors.read().decode("utf-8", "replace").strip()[-300:].rstrip(".")
    if code != 0:
        raise InputError(
            where,
            "unreadable_audio",
            f"the command {location.path!r} failed (exit code {code}): {message}.",
            "run the command in a shell to see why (a program missing from PATH, such as flac or sox, exits 127).",
        )
    return data


def decode_audio(data: bytes | memoryview, where: Where, channel: int | None = None) -> DecodedAudio:
    """Encoded audio -> :class:`DecodedAudio` (mixed down, or ``channel``)."""
    import soundfile

    header = ""  # what the header declares, once it was read: the context of a failure to decode
    try:
        with soundfile.SoundFile(io.BytesIO(bytes(data))) as sound:
            header = f" (its {sound.format} header declares {sound.frames} frames at {sound.samplerate} Hz)"
            if sound.frames > MAX_FRAMES_PER_BYTE * len(data):
                raise InputError(
                    where,
                    "unreadable_audio",
                    f"the {sound.format} header declares {sound.frames} frames, more than {len(data)} bytes of audio "
                    "can hold (a damaged header).",
                    "check the file, or remove its entry.",
                )
            if not 0 < sound.samplerate <= MAX_SAMPLE_RATE:
                raise InputError(
                    where,
                    "unreadable_audio",
                    f"the {sound.format} header declares {sound.samplerate} Hz, no rate audio is recorded at (FLAC "
                    f"holds at most {MAX_SAMPLE_RATE} Hz): a damaged header.",
                    "check the file, or remove its entry.",
                )
            samples = _read_samples(sound)
            rate, subtype, declared, container = sound.samplerate, sound.subtype, sound.frames, sound.format
            if sound.format in ESTIMATED_LENGTH_FORMATS:
                declared = 0
    except (RuntimeError, soundfile.LibsndfileError, ValueError) as error:
        why = "the file is empty (0 bytes)" if len(data) == 0 else _without_repr(str(error)) + header
        raise InputError(
            where, "unreadable_audio", f"the audio cannot be decoded: {why}.", "check the file, or remove its entry."
        ) from None
    missing = _missing_wav_bytes(data)
    if missing:
        raise InputError(
            where,
            "unreadable_audio",
            f"the WAV header says its data is {counted(missing, 'byte')} longer than the file holds (cut short, or bytes "
            "removed, e.g. by git's line-ending conversion).",
            "restore the original file.",
        )
    if len(samples) < declared:
        raise InputError(
            where,
            "unreadable_audio",
            f"the audio holds {len(samples)} samples where its header says {declared} (cut short or damaged).",
        )
    if channel is None:
        mono = samples.mean(axis=1, dtype=np.float32) if samples.shape[1] > 1 else samples[:, 0]
    elif 0 <= channel < samples.shape[1]:
        mono = samples[:, channel]
    else:
        raise InputError(
            where,
            "bad_channel",
            f"channel {channel} does not exist: the audio has {counted(samples.shape[1], 'channel')}.",
            f"choose {option('channel', 0)} .. {samples.shape[1] - 1}, or leave it out to mix down.",
        )
    if len(mono) == 0:
        raise InputError(where, "zero_length", "the audio has no samples.")
    container = CONTAINERS.get(container, container.lower())
    return DecodedAudio(np.ascontiguousarray(mono), rate, subtype, container, samples.shape[1])


def _read_samples(sound: SoundFile) -> np.ndarray:
    """Every sample (frames x channels, float32), decoded a block at a time, so that memory
    follows the audio that is there and not the frame count its header declares (a FLAC
    header may declare 2^36 frames; ``read()`` allocates them at once)."""
    step = max(1, DECODE_BLOCK_SAMPLES // sound.channels)
    blocks = []
    while len(block := sound.read(step, dtype="float32", always_2d=True)):
        blocks.append(block if block.base is None else block.copy())  # a short read is a view of the whole block
        if len(block) < step:
            break
    if len(blocks) == 1:
        return blocks[0]
    return np.concatenate(blocks) if blocks else np.empty((0, sound.channels), dtype=np.float32)


def _without_repr(message: str) -> str:
    """libsndfile's message without the Python object it names (``Error opening <_io...>: ``)."""
    return re.sub(r"Error opening <[^>]*>: ", "", message).rstrip(".")


def _missing_wav_bytes(data: bytes | memoryview) -> int:
    """How many bytes of a WAV's ``data`` chunk its header declares but the file lacks.

    soundfile reads such a file without a word (one frame short, or the rest misaligned), so
    the chunk sizes are checked here. Streamed WAVs (size 0 or 0xFFFFFFFF) are not checked.
    """
    view = memoryview(data)
    if bytes(view[:4]) != b"RIFF" or bytes(view[8:12]) != b"WAVE":
        return 0
    position = 12
    while position + 8 <= len(view):
        chunk, size = bytes(view[position : position + 4]), int.from_bytes(view[position + 4 : position + 8], "little")
        if chunk == b"data":
            available = len(view) - position - 8
            return size - available if size not in (0, 0xFFFFFFFF) and size > available else 0
        position += 8 + size + (size & 1)  # chunks are padded to even sizes
    return 0


def audio_seconds(data: bytes | memoryview) -> float:
    """The duration of encoded audio, from its header (ValueError when it cannot be read)."""
    import soundfile

    try:
        info = soundfile.info(io.BytesIO(bytes(data)))
    except (RuntimeError, soundfile.LibsndfileError) as error:
        raise ValueError(f"the audio cannot be decoded ({error})") from None
    if info.frames > MAX_FRAMES_PER_BYTE * len(data):
        raise ValueError(f"its header declares {info.frames} frames, more than {len(data)} bytes of audio can hold")
    return info.frames / info.samplerate


def resample(samples: np.ndarray, rate: float, target: float) -> np.ndarray:
    """``samples`` at ``rate`` resampled to ``target`` (soxr, high quality): a tone keeps its
    frequency; the length becomes ``round(n * target / rate)``."""
    import soxr

    if rate == target:
        return samples
    return soxr.resample(samples, rate, target).astype(np.float32, copy=False)


SEGMENTS_FIX = "fix the segments file (its times are in seconds)."


def cut(audio: DecodedAudio, start: float, end: float, where: Where, fix: str = SEGMENTS_FIX) -> DecodedAudio:
    """The part ``[start, end)`` (seconds; ``end`` < 0: to the end, as Kaldi's segments); an
    InputError with ``fix`` (how to mend where the times came from) when it runs past the end."""
    total = len(audio.samples)
    first = round(start * audio.sample_rate)
    last = total if end < 0 else round(end * audio.sample_rate)
    if start < 0 or (end >= 0 and end <= start):
        raise InputError(where, "bad_segment", f"the segment {start:g} .. {end:g} s is empty or negative.")
    if last > total + round(0.01 * audio.sample_rate) or first >= total:
        raise InputError(
            where,
            "bad_segment",
            f"the segment {start:g} .. {end:g} s runs past the end of its recording ({audio.seconds:.3f} s).",
            fix,
        )
    return replace(audio, samples=audio.samples[first : min(last, total)])


@dataclass(frozen=True)
class Stored:
    """An utterance's audio as a shard member: its extension, its bytes, and how it was made
    from the input (``kept mp3``: the original bytes; ``wav -> flac``: decoded, encoded)."""

    extension: str
    data: bytes
    how: str


def store(audio: DecodedAudio, encoding: str, original: bytes | None) -> Stored:
    """``audio`` for a shard; ``original`` is the input's bytes when ``audio`` is all of it,
    unchanged (None when it was cut, resampled or a channel was picked).

    ``flac``: integer PCM up to 24 bits becomes FLAC of the same bits (lossless); anything FLAC
    cannot hold exactly (lossy codecs, float, 32-bit PCM) keeps its original bytes, since a
    re-encoding cannot make it better, in a container the loader decodes. Audio that changed
    is encoded: PCM at its own bits, a lossy codec's as 16-bit FLAC (its rounding, below
    -96 dBFS, is far under the codec's own noise), float and 32-bit PCM as float WAV; samples
    beyond full scale (after resampling, or a lossy decoder's overshoot) go to float WAV rather
    than be clipped. ``keep``: the original bytes, or for a cut a WAV made the same way.
    """
    import soundfile

    loadable = audio.format in AUDIO_EXTENSIONS  # a member the loader decodes
    if original is not None and (encoding == "keep" or (audio.subtype not in PCM_BITS and loadable)):
        return Stored(audio.format, bytes(original), f"kept {audio.format}")
    bits = _integer_bits(audio)
    container = "FLAC" if encoding == "flac" and bits else "WAV"
    subtype = {8: "PCM_S8" if container == "FLAC" else "PCM_U8", 16: "PCM_16", 24: "PCM_24"}.get(bits, "FLOAT")
    buffer = io.BytesIO()
    soundfile.write(buffer, audio.samples, audio.sample_rate, format=container, subtype=subtype)
    return Stored(container.lower(), buffer.getvalue(), f"{audio.format} -> {container.lower()}")


def _integer_bits(audio: DecodedAudio) -> int | None:
    """Bits of integer PCM that hold ``audio``'s samples: its own (PCM), 16 for a lossy codec;
    None for float, 32-bit or unknown sample formats, and for samples beyond full scale."""
    bits = PCM_BITS.get(audio.subtype) or (16 if audio.subtype in LOSSY_SUBTYPES else None)
    if bits is not None and len(audio.samples) and float(np.abs(audio.samples).max()) > 1.0:
        return None  # an integer format would clip them
    return bits
