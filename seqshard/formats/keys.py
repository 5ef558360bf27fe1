"""Utterance keys inside tar shards.

A shard member is named ``KEY.FIELD`` and readers (WebDataset among them) split the name at
the first ``.`` after the last ``/``. A key holding ``.`` or ``/`` would therefore be read back
as a different key, so such keys are refused, or escaped reversibly when the user asks.
"""

from __future__ import annotations

import hashlib

_ESCAPES = {"%": "%25", ".": "%2E", "/": "%2F"}
_UNESCAPES = {code: ch for ch, code in _ESCAPES.items()}
_ASCII_WHITESPACE = frozenset(" \t\n\r\v\f")  # what Kaldi splits table lines on


def key_problem(key: str) -> str | None:
    """Say why ``key`` cannot be a shard key, or return None when it can.

    Only ASCII whitespace is refused, as in Kaldi: a key may hold a no-break space or any
    other non-ASCII character."""
    if not key:
        return "the key is empty"
    if not _ASCII_WHITESPACE.isdisjoint(key):
        return "the key contains whitespace"
    if "." in key:
        return "the key contains '.', which tar-shard readers take as the start of the field name"
    if "/" in key:
        return "the key contains '/', which tar-shard readers take as a directory"
    return None


def escape_key(key: str) -> str:
    """Percent-encode ``%``, ``.`` and ``/`` so that any non-empty key fits ``KEY.FIELD``."""
    return "".join(_ESCAPES.get(ch, ch) for ch in key)


def unescape_key(key: str) -> str:
    """Invert :func:`escape_key`."""
    out = []
    i = 0
    while i < len(key):
        code = key[i : i + 3]
        if code in _UNESCAPES:
            out.append(_UNESCAPES[code])
            i += 3
        else:
            out.append(key[i])
            i += 1
    return "".join(out)


def split_member_name(name: str) -> tuple[str, str] | None:
    """Split ``dir/key.field.ext`` into (``dir/key``, ``field.ext``) as WebDataset does."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot <= slash + 1:
        return None
    return name[:dot], name[dot + 1 :]


def key_hash(key: str) -> int:
    """A stable 64-bit hash of a key (the same in every process and run)."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "little")
