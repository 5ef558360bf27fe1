"""Sample fields: a member ``KEY.NAME.EXT`` (or ``KEY.EXT``) is field ``NAME`` decoded by ``EXT``.

Decoding is explicit and safe: ``.npy`` arrays without pickle (a view of the bytes read, no
copy), ``.llc`` arrays (lilcom-compressed, as lhotse stores features; needs ``lilcom``),
``.txt`` UTF-8 text, ``.json`` JSON, audio (``.wav``, ``.flac``, ...) kept as its encoded bytes
until an audio stage decodes it, ``.gz`` decompressed first (within the limits of ``inflation.py``: at most
:data:`MAX_INFLATION` times the member's size, or 1 MiB, and :data:`MAX_INFLATED_BYTES`, so a
small member cannot fill memory). A member whose extension has no decoder is passed through as its bytes,
still compressed if it is, under its whole suffix as its name (``KEY.audio.pth`` is field
``audio.pth``, never ``audio``, the name of decoded waveforms; nothing is ever unpickled).
A ``.nodata`` member marks a field that a sample does not have (``add-field --allow-missing``).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .inflation import MAX_INFLATED_BYTES, MAX_INFLATION, MIN_INFLATION_LIMIT, InflationError, inflation_limit
from .npy import decode_npy

AUDIO_EXTENSIONS = ("wav", "flac", "mp3", "ogg", "opus", "sph", "m4a")
NODATA = "nodata"
_FEED = 16 << 10  # compressed bytes inflated at a time


@dataclass(frozen=True)
class AudioBytes:
    """Encoded audio as stored (a view of the shard's bytes); an audio stage decodes it."""

    data: bytes | memoryview
    format: str

    def __len__(self) -> int:
        return len(self.data)

    def __reduce__(self) -> tuple:
        """Pickled as bytes (a view cannot be): batches holding encoded audio cross to the
        training process."""
        return (AudioBytes, (bytes(self.data), self.format))


class _Absent:
    """The value of a ``.nodata`` member: the sample has no such field."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()


def decode_text(data: bytes | memoryview) -> str:
    return str(data, "utf-8")


def decode_json(data: bytes | memoryview) -> Any:
    return json.loads(str(data, "utf-8"))


def decode_lilcom(data: bytes | memoryview) -> Any:
    """A lilcom-compressed float array (lhotse's ``.llc`` features)."""
    try:
        import lilcom
    except ImportError:
        raise ImportError(
            "the shards hold lilcom-compressed arrays (.llc, as lhotse writes features): pip install lilcom"
        ) from None
    return lilcom.decompress(bytes(data))


DECODERS: dict[str, Callable[[bytes | memoryview], Any]] = {
    "npy": decode_npy,
    "llc": decode_lilcom,
    "txt": decode_text,
    "text": decode_text,
    "json": decode_json,
    NODATA: lambda data: ABSENT,
    **{ext: (lambda data, ext=ext: AudioBytes(data, ext)) for ext in AUDIO_EXTENSIONS},
}


@lru_cache(maxsize=1024)
def split_suffix(suffix: str) -> tuple[str, str, bool]:
    """``(name, extension, gzipped)`` of a member suffix: ``feats.npy`` -> ``("feats", "npy",
    False)``, ``txt`` -> ``("txt", "txt", False)``, ``txt.gz`` -> ``("txt", "txt", True)``.
    A suffix whose extension has no decoder is its own name: ``audio.pth`` -> ``("audio.pth",
    "pth", False)``, ``blob.gz`` -> ``("blob.gz", "blob", True)``."""
    gzipped = suffix.endswith(".gz")
    inner = suffix[:-3] if gzipped else suffix
    name, dot, extension = inner.rpartition(".")
    if not dot:
        name = extension = inner
    if extension not in DECODERS:
        return suffix, extension, gzipped
    return name, extension, gzipped


def field_name(suffix: str) -> str:
    """The field a member suffix holds (``feats.npy`` -> ``feats``; see :func:`split_suffix`)."""
    return split_suffix(suffix)[0]


def inflate(data: bytes | memoryview, limit: int | None = None) -> bytes:
    """A gzip member's content, refusing (InflationError) output beyond ``limit`` bytes
    (default: :data:`MAX_INFLATION` x its size, at least :data:`MIN_INFLATION_LIMIT`, at most
    :data:`MAX_INFLATED_BYTES`) before
    more than that is held. The input is fed ``_FEED`` bytes at a time: zlib copies the input
    left after each gzip member, so feeding it whole takes time quadratic in their number."""
    if limit is None:
        limit = inflation_limit(len(data))
    view = memoryview(data)
    parts: list[bytes] = []
    size = position = 0
    inflater = None
    while position < len(view):  # a gzip file may hold several members back to back
        inflater = inflater or zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip framing
        fed = view[position : position + _FEED]
        try:
            part = inflater.decompress(fed, limit + 1 - size)
        except zlib.error as error:
            raise ValueError(f"not valid gzip ({error})") from None
        size += len(part)
        if size > limit:
            raise InflationError(
                f"the gzip'd member of {len(data)} bytes inflates beyond {limit} bytes (limits: {MAX_INFLATION}x its "
                f"size or {MIN_INFLATION_LIMIT} bytes, at most {MAX_INFLATED_BYTES} bytes)"
            )
        parts.append(part)
        position += len(fed) - len(inflater.unused_data)  # all it was fed, but the next member's start
        if inflater.eof:
            inflater = None
    if inflater is not None:
        raise ValueError("not valid gzip (it ends early)")
    return parts[0] if len(parts) == 1 else b"".join(parts)


def decode_field(suffix: str, data: bytes | memoryview) -> Any:
    """The value of a member with this suffix (see the module docstring); ValueError when the
    bytes do not decode as their extension says (InflationError when a compressed member would
    inflate beyond the limits)."""
    _, extension, gzipped = split_suffix(suffix)
    decoder = DECODERS.get(extension)
    if decoder is None:
        return bytes(data)  # passed through as it is, compressed or not
    try:
        return decoder(inflate(data) if gzipped else data)
    except (UnicodeDecodeError, json.JSONDecodeError, EOFError) as error:
        raise ValueError(f"not valid .{extension}{'.gz' if gzipped else ''} ({error})") from None
    except RecursionError:
        raise ValueError(f"not valid .{extension}: nested too deeply to decode") from None
