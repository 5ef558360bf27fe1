"""Utterance keys inside tar shards.

A shard member is named ``KEY.FIELD`` and readers (WebDataset among them) split the name at
the first ``.`` after the last ``/``. A key holding ``.`` or ``/`` would therefore be read back
as a different key, and one holding NUL would end its name in a tar header (and the member
table's list of keys), so such keys are refused, or escaped reversibly when the user asks. A
key longer than :data:`MAX_KEY_BYTES` is refused either way: its member names would need tar
extension headers beyond what readers accept.
"""

from __future__ import annotations

import hashlib

MAX_KEY_BYTES = 1 << 16  # UTF-8 bytes of a key as stored (readers refuse extension headers beyond 1 MiB)
_ESCAPES = {"%": "%25", ".": "%2E", "/": "%2F", "\0": "%00"}
_UNESCAPES = {code: ch for ch, code in _ESCAPES.items()}
_ASCII_WHITESPACE = frozenset(" \t\n\r\v\f")  # what Kaldi splits table lines on


def key_problem(key: str, escaped: bool = False) -> str | None:
    """Say why ``key`` cannot be a shard key, or return None when it can; ``escaped``: it will
    be stored percent-encoded (:func:`escape_key`), so only an empty or too long key is one.

    Only ASCII whitespace is refused, as in Kaldi: a key may hold a no-break space or any
    other non-ASCII character."""
    if not key:
        return "the key is empty"
    if (12 if escaped else 4) * len(key) > MAX_KEY_BYTES:  # a character takes at most 4 bytes, 12 escaped
        stored = len((escape_key(key) if escaped else key).encode("utf-8", "surrogateescape"))
        if stored > MAX_KEY_BYTES:
            return f"the key is {stored} bytes long{' escaped' if escaped else ''}, beyond the {MAX_KEY_BYTES} a shard key may have"
    if escaped:
        return None
    if not _ASCII_WHITESPACE.isdisjoint(key):
        return "the key contains whitespace"
    if "\0" in key:
        return "the key contains a NUL character, which ends a member name in a tar header"
    if "." in key:
        return "the key contains '.', which tar-shard readers take as the start of the field name"
    if "/" in key:
        return "the key contains '/', which tar-shard readers take as a directory"
    return None


def escape_key(key: str) -> str:
    """Percent-encode ``%``, ``.``, ``/`` and NUL so that any non-empty key fits ``KEY.FIELD``."""
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
