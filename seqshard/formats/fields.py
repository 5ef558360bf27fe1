"""Sample fields: a member ``KEY.NAME.EXT`` (or ``KEY.EXT``) is field ``NAME`` decoded by ``EXT``.

Decoding is explicit and safe: ``.npy`` arrays without pickle (a view of the bytes read, no
copy), ``.txt`` UTF-8 text, ``.json`` JSON, audio (``.wav``, ``.flac``, ...) kept as its encoded
bytes until an audio stage decodes it, ``.gz`` decompressed first, and any other extension
passed through as bytes (never unpickled: a ``.pth`` or ``.pickle`` member stays bytes).
A ``.nodata`` member marks a field that a sample does not have (``add-field --allow-missing``).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .npy import decode_npy

AUDIO_EXTENSIONS = ("wav", "flac", "mp3", "ogg", "opus", "sph", "m4a")
NODATA = "nodata"


@dataclass(frozen=True)
class AudioBytes:
    """Encoded audio as stored (a view of the shard's bytes); an audio stage decodes it."""

    data: bytes | memoryview
    format: str

    def __len__(self) -> int:
        return len(self.data)


class _Absent:
    """The value of a ``.nodata`` member: the sample has no such field."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()


def decode_text(data: bytes | memoryview) -> str:
    return str(data, "utf-8")


def decode_json(data: bytes | memoryview) -> Any:
    return json.loads(str(data, "utf-8"))


DECODERS: dict[str, Callable[[bytes | memoryview], Any]] = {
    "npy": decode_npy,
    "txt": decode_text,
    "text": decode_text,
    "json": decode_json,
    NODATA: lambda data: ABSENT,
    **{ext: (lambda data, ext=ext: AudioBytes(data, ext)) for ext in AUDIO_EXTENSIONS},
}


@lru_cache(maxsize=1024)
def split_suffix(suffix: str) -> tuple[str, str, bool]:
    """``(name, extension, gzipped)`` of a member suffix: ``feats.npy`` -> ``("feats", "npy",
    False)``, ``txt`` -> ``("txt", "txt", False)``, ``txt.gz`` -> ``("txt", "txt", True)``."""
    gzipped = suffix.endswith(".gz")
    if gzipped:
        suffix = suffix[:-3]
    name, dot, extension = suffix.rpartition(".")
    return (name, extension, gzipped) if dot else (suffix, suffix, gzipped)


def field_name(suffix: str) -> str:
    """The field a member suffix holds (``feats.npy`` -> ``feats``)."""
    return split_suffix(suffix)[0]


def decode_field(suffix: str, data: bytes | memoryview) -> Any:
    """The value of a member with this suffix (see the module docstring); ValueError when the
    bytes do not decode as their extension says."""
    _, extension, gzipped = split_suffix(suffix)
    try:
        if gzipped:
            data = gzip.decompress(data)
        return DECODERS.get(extension, bytes)(data)
    except (UnicodeDecodeError, json.JSONDecodeError, OSError, EOFError) as error:
        raise ValueError(f"not valid .{extension}{'.gz' if gzipped else ''} ({error})") from None
