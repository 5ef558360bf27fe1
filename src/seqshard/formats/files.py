"""Writing output files safely: complete or absent under their final name, with the mode the
user's umask gives, errors that name the file (disk full, read-only, no permission), and only
inside the folder being written: :func:`inside` refuses a path that a symbolic link leads out
of it, and files are opened without following a link at their own name and only when they are
regular files with no other name (:func:`open_own`): nothing is written into a user's file that
a hard link brought into the folder. Inputs read by path are opened by :func:`open_input`:
regular files only (a FIFO where pipes are allowed), checked on the opened descriptor, so that
a device such as ``/dev/zero`` or a FIFO never fills memory or hangs a reader.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import stat
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO

from ..checks import parse_json
from ..errors import InputError, OutputError, Where

TEMPORARY_SUFFIX = ".partial"
STALE_SECONDS = 600.0  # a JSON temporary this old belongs to a killed run (writes take milliseconds)
MAX_JSON_BYTES = 1 << 30  # a JSON file seqshard reads (the index.json of 500,000 shards: 170 MB)


@lru_cache(maxsize=1)
def default_file_mode() -> int:
    """``0o666`` less the process's umask: the mode ``open()`` gives a new file."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # no /proc: read the umask by setting it, then put it back
    os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Turn an OSError raised inside the block into an OutputError naming ``path``."""
    try:
        yield
    except OSError as error:
        raise OutputError.from_os_error(error.filename or path, error) from None


def leads_out(folder: str | Path, path: str | Path) -> bool:
    """Whether ``path``, with every symbolic link resolved, lies outside ``folder``."""
    root, real = os.path.realpath(folder), os.path.realpath(path)
    return real != root and os.path.commonpath([real, root]) != root


def inside(folder: str | Path, path: str | Path) -> Path:
    """``path`` when, with every symbolic link resolved, it lies in ``folder`` (checked before
    anything is written or removed there); else OutputError naming the link that leads out and
    the fix. ``folder`` itself may be a link: where it points is the user's choice."""
    if not leads_out(folder, path):
        return Path(path)
    real = os.path.realpath(path)
    link = _first_link(Path(folder), Path(path))
    if link is None:
        raise OutputError(path, f"lies outside {folder}: refusing to write there.", "name a file inside the folder.")
    raise OutputError(
        link,
        f"is a symbolic link to {os.readlink(link)}, outside {folder}: seqshard writes only inside the folder "
        f"it writes (here {real} would be written).",
        f"replace the link with a real {'folder' if os.path.isdir(link) else 'file'} (a copy of what it points to), "
        "or remove it; to write where it points, give that folder itself as the output.",
    )


def _first_link(folder: Path, path: Path) -> Path | None:
    """The first symbolic link on the way from ``folder`` down to ``path``."""
    try:
        parts = path.relative_to(folder).parts
    except ValueError:
        return None
    at = folder
    for part in parts:
        at = at / part
        if at.is_symlink():
            return at
    return None


def open_output(path: Path, append: bool = False) -> int:
    """A descriptor of ``path`` opened for writing (created, emptied unless ``append``): see
    :func:`open_own`."""
    return open_own(path, os.O_WRONLY | (os.O_APPEND if append else os.O_TRUNC))


def open_own(path: Path, flags: int) -> int:
    """``path`` opened with ``flags`` (and created when absent) as a file seqshard may write in
    place: a regular file with no other name. Never through a symbolic link at ``path`` itself;
    a hard link to another file, a FIFO or a device there is refused (OutputError naming it)
    before a byte is written or cut (``O_TRUNC`` is applied after the check; the open does not
    wait for a FIFO's reader)."""
    opened = (flags & ~os.O_TRUNC) | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        descriptor = os.open(path, opened, 0o666)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise OutputError(
                path, f"is a symbolic link (to {os.readlink(path)}): refusing to write through it.", "remove the link."
            ) from None
        if error.errno == errno.ENXIO:  # a FIFO that no one reads, opened for writing only
            raise _not_own(path, "a FIFO (named pipe)") from None
        raise OutputError.from_os_error(path, error) from None
    try:
        found = os.fstat(descriptor)
        if not stat.S_ISREG(found.st_mode):
            raise _not_own(path, file_kind(found.st_mode))
        if found.st_nlink > 1:
            raise _not_own(
                path,
                f"a file with {found.st_nlink} names (hard links)",
                "writing it would change that file under its other names too",
                "remove this name (the file's other names keep their content)",
            )
        os.set_blocking(descriptor, True)
        if flags & os.O_TRUNC:
            os.ftruncate(descriptor, 0)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def _not_own(path: Path, what: str, why: str = "it is not a file to write", remove: str = "remove it") -> OutputError:
    return OutputError(
        path,
        f"is {what}: seqshard writes only regular files of its own here ({why}).",
        f"{remove}; seqshard then makes a file of its own.",
    )


def file_kind(mode: int) -> str:
    """What a file of ``mode`` (``st_mode``) is, as messages name it."""
    for test, kind in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


class NotAFileError(OSError):
    """An input that is not a regular file: a device (``/dev/zero``), a FIFO where none is
    allowed, a folder, a socket; or a file beyond what may be read whole. An OSError, so that
    every reader reports it as a file it cannot open (``strerror`` says what it is)."""


def open_input(path: str | Path, pipes: bool = False) -> int:
    """A descriptor of the input ``path``, opened for reading when it is a regular file, or with
    ``pipes`` (``allow_pipes``) a FIFO, once its writer has come (as Kaldi waits for it).
    Anything else is :class:`NotAFileError`, found before it is opened (opening a FIFO lets its
    writer in, opening a device may act) and again on the opened descriptor, before a byte is
    read; the open itself never waits."""
    _input_kind(os.stat(path).st_mode, path, pipes)
    descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        if _input_kind(os.fstat(descriptor).st_mode, path, pipes) == "fifo":
            waiting = select.poll()  # data, or an end, once a writer came (none is said before)
            waiting.register(descriptor, select.POLLIN)
            waiting.poll()
        os.set_blocking(descriptor, True)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def _input_kind(mode: int, path: str | Path, pipes: bool) -> str:
    """``file`` or (with ``pipes``) ``fifo``; else NotAFileError saying what ``path`` is."""
    if stat.S_ISREG(mode):
        return "file"
    if pipes and stat.S_ISFIFO(mode):
        return "fifo"
    raise NotAFileError(errno.EINVAL, f"it is {file_kind(mode)}, not a regular file", str(path))


def read_input(path: str | Path, limit: int, pipes: bool = False, what: str = "a file") -> bytes:
    """The whole of the input ``path`` (:func:`open_input`), at most ``limit`` bytes: a larger
    file (its size checked before it is read) or FIFO is :class:`NotAFileError`."""
    with os.fdopen(open_input(path, pipes), "rb") as stream:
        found = os.fstat(stream.fileno())
        piped = stat.S_ISFIFO(found.st_mode)
        data = read_bounded(stream, limit) if piped else b"" if found.st_size > limit else stream.read(found.st_size)
    if len(data) > limit or found.st_size > limit:
        raise NotAFileError(errno.EFBIG, f"it holds more than the {limit} bytes seqshard reads as {what}", str(path))
    return data


_REQUIRED: Any = object()


def read_json(
    path: str | Path, fix: str, missing: Any = _REQUIRED, limit: int | None = None, kind: type = object
) -> Any:
    """The JSON file ``path`` (a regular file of at most ``limit`` bytes, by default
    ``MAX_JSON_BYTES``): InputError naming it, the line and ``fix`` when it is
    damaged, unreadable or not of ``kind`` (:func:`~seqshard.checks.parse_json`), or missing
    unless ``missing`` is given (then returned instead)."""
    try:
        return parse_json(read_input(path, limit or MAX_JSON_BYTES, what="JSON"), path, fix, kind)
    except FileNotFoundError:
        if missing is not _REQUIRED:
            return missing
        problem = "no such file."
    except OSError as error:
        problem = f"cannot be read ({error.strerror or error})."
    raise InputError(Where(path), "bad_json", problem, fix, skippable=False)


def read_bounded(stream: BinaryIO, limit: int) -> bytes:
    """What ``stream`` (a pipe) gives until its end, or its first ``limit + 1`` bytes: read a
    MiB at a time (``read(limit + 1)`` would allocate all of it at once)."""
    chunks, size = [], 0
    while size <= limit and (chunk := stream.read(min(1 << 20, limit + 1 - size))):
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def write_json_atomic(path: Path, data: Any, root: str | Path | None = None, sync: bool = True) -> None:
    """Write JSON to ``path`` as :func:`write_atomic` does."""

    text = json_bytes(data)
    write_atomic(path, lambda stream: stream.write(text), root, sync)


def json_bytes(data: Any) -> bytes:
    """``data`` as seqshard writes its JSON files."""
    return json.dumps(data, indent=1, ensure_ascii=False).encode("utf-8") + b"\n"


def write_atomic(
    path: Path, fill: Callable[[BinaryIO], None], root: str | Path | None = None, sync: bool = True
) -> None:
    """Write ``path`` (``fill`` writes its bytes to a stream) so that a reader sees the old file
    or the new one, never half, and only inside ``root`` (default: ``path``'s own folder; see
    :func:`inside`). ``sync``: on disk before the rename (without it a lost machine may leave
    the file empty).

    The temporary file has a unique name: parts of a pack running at once may write the same
    file (they write the same content). The file gets the mode of any new file (umask).
    """
    inside(path.parent if root is None else root, path)
    with writing(path):
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMPORARY_SUFFIX)
        try:
            with os.fdopen(descriptor, "wb") as stream:
                fill(stream)
                stream.flush()
                os.fchmod(stream.fileno(), default_file_mode())
                if sync:
                    os.fsync(stream.fileno())
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise


def remove_stale_temporaries(folder: Path, older_than: float = STALE_SECONDS) -> int:
    """Delete ``.NAME.*.partial`` temporaries of JSON files and member tables in ``folder``
    (and its ``.members``) left by killed runs; returns how many. Recent ones are kept:
    another process may be about to rename its own (a writer holding the folder's lock alone
    passes ``older_than=0``)."""
    removed = 0
    now = time.time()
    for pattern in (f".*.json.*{TEMPORARY_SUFFIX}", f".members/.*.npz.*{TEMPORARY_SUFFIX}"):
        for path in folder.glob(pattern):
            with contextlib.suppress(OSError):
                if now - path.stat().st_mtime >= older_than:
                    path.unlink()
                    removed += 1
    return removed


def fsync_directory(directory: Path) -> None:
    """Make a rename inside ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def crc32_of(read: Callable[[int], bytes | memoryview], block: int = 8 << 20) -> tuple[int, int]:
    """``(crc32, size)`` of what ``read(n)`` gives until it gives nothing (a file's ``read``,
    a remote byte source's)."""
    crc = size = 0
    while chunk := read(block):
        crc = zlib.crc32(chunk, crc)
        size += len(chunk)
    return crc, size
