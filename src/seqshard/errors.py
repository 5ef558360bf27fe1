"""Exceptions that name the file, line, key or shard at fault and say what to do."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

_LOG = logging.getLogger("seqshard")

# What redact() hides: the user info of a URL (``user:password@``), the values of query
# parameters whose names say they carry a secret (``sig``, ``X-Amz-Signature``, ``token``,
# ``api_key``, ``password``, ``X-Amz-Credential``, ...: any name containing sig, token, key,
# secret, pass, credential or auth), ``Authorization:`` header values and ``AWS_SECRET_ACCESS_KEY=...``
# style assignments (in pipe commands). Names are kept, so a message still says what was there.
_SECRETS = (
    (re.compile(r"(?<=://)[^/?#\s@'\"<>]+@"), "***@"),
    (  # a value ends before &, #, a quote or a space, and before punctuation that ends a sentence
        re.compile(
            r"([?&;][\w.\-]*(?:sig|token|key|secret|pass|credential|auth)[\w.\-]*=)"
            r"[^&#\s'\"<>]*?(?=[:.,;)\]]*(?:[&#\s'\"<>]|$))",
            re.I,
        ),
        r"\1***",
    ),
    (re.compile(r"(authorization:\s*(?:bearer\s+|basic\s+|token\s+)?)[^\s'\"]+", re.I), r"\1***"),
    (
        re.compile(r"\b((?=\w*(?:SECRET|TOKEN|PASSWORD|PASSWD|KEY|CREDENTIAL))[A-Z][A-Z0-9]*_[A-Z0-9_]*=)[^\s'\"]+"),
        r"\1***",
    ),
)


def redact(text: str) -> str:
    """``text`` with the secrets of any URL or command in it replaced by ``***``:
    ``http://alice:pw@host/a.tar?sig=XY&n=1`` -> ``http://***@host/a.tar?sig=***&n=1``."""
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


class _Redacting(logging.Filter):
    """Redacts every record of seqshard's logger (its URLs may carry credentials)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: the handler reports it
            return True
        shown = redact(message)
        if shown != message:
            record.msg, record.args = shown, None
        return True


_REDACTING = _Redacting()
_LOG.addFilter(_REDACTING)
# Libraries that log the URLs seqshard hands them (fsspec's http logs each one at DEBUG): a
# filter acts only on its own logger's records, so each of theirs gets one, those made later
# (a module's logger, on import) when a remote file system is made (:func:`redact_libraries`).
REDACTED_LIBRARIES = ("fsspec", "s3fs", "gcsfs", "adlfs", "aiohttp", "aiobotocore", "botocore", "urllib3")


def redact_libraries() -> None:
    """Redact the records of every logger of :data:`REDACTED_LIBRARIES` that exists now."""
    names = set(logging.root.manager.loggerDict) | set(REDACTED_LIBRARIES)
    for name in names:
        if name.split(".")[0] in REDACTED_LIBRARIES:
            logger = logging.getLogger(name)
            if _REDACTING not in logger.filters:
                logger.addFilter(_REDACTING)


redact_libraries()

_VERBS = {"is": "are", "was": "were", "has": "have"}


def counted(count: int, noun: str, verb: str = "") -> str:
    """``count`` with ``noun`` (and ``verb``) agreeing: ``counted(1, "shard")`` -> "1 shard",
    ``counted(2, "shard", "is")`` -> "2 shards are"."""
    if count == 1:
        return f"{count} {noun}" + (f" {verb}" if verb else "")
    plural = noun[:-1] + "ies" if noun.endswith("y") and noun[-2:-1] not in "aeiou" else noun + "s"
    return f"{count} {plural}" + (f" {_VERBS.get(verb, verb)}" if verb else "")


def listed(items: Sequence[object], sep: str = ", ", shown: int = 5) -> str:
    """The first ``shown`` of ``items`` joined by ``sep``, and how many more: "a, b and 3 more"."""
    return sep.join(map(str, items[:shown])) + (f" and {len(items) - shown} more" if len(items) > shown else "")


# How options are spelled in messages: ``None`` from Python (``skip_bad=True``), else the
# command line's flags by Python name (``--skip-bad``), set by ``seqshard.cli`` for one command.
_FLAGS: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar("seqshard_flags", default=None)


def option(name: str, value: object = True) -> str:
    """Option ``name`` set to ``value`` as the user writes it: ``skip_bad=True`` in Python,
    ``--skip-bad`` on the command line (``--utts-per-file 10`` for other values)."""
    flags = _FLAGS.get()
    if flags is None:
        return f"{name}={value!r}"
    flag = flags.get(name, "--" + name.replace("_", "-"))
    if value is True or (value is False and flag.startswith("--no-")):  # --no-eos stands for append_eos=False
        return flag
    return f"{flag} {value}"


@contextlib.contextmanager
def command_line_flags(flags: Mapping[str, str]) -> Iterator[None]:
    """Within this block messages name options by their command-line ``flags`` (Python name ->
    flag; names not listed become ``--name-with-dashes``)."""
    token = _FLAGS.set(dict(flags))
    try:
        yield
    finally:
        _FLAGS.reset(token)


class SeqshardError(Exception):
    """Base class of every error seqshard raises on purpose. Its text is redacted (see
    :func:`redact`): a URL's credentials never reach a message, a log or a traceback."""

    def __init__(self, *args: object):
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))

    def __str__(self) -> str:
        return redact(super().__str__())


class Where(NamedTuple):
    """A place in an input: a file, optionally a 1-based line and a key (a tuple: made for
    every line a pack scans, it costs a tenth of a frozen dataclass)."""

    path: str | Path
    line: int | None = None
    key: str | None = None

    def __str__(self) -> str:
        text = str(self.path)
        if self.line is not None:
            text += f":{self.line}"
        if self.key is not None:
            text += f" (key {self.key!r})"
        return text


class InputError(SeqshardError):
    """Bad input data. ``reason`` is a short machine-readable tag used to count skips.

    ``skippable`` errors end their message with how to skip such cases instead (``--skip-bad``
    or ``skip_bad=True``, spelled when the message is shown); a logged skip leaves it out.
    """

    def __init__(self, where: Where, reason: str, problem: str, fix: str | None = None, skippable: bool = True):
        super().__init__(where, reason, problem, fix, skippable)
        self.where = where
        self.reason = reason
        self.problem = problem
        self.fix = fix
        self.skippable = skippable

    def describe(self, skip_hint: bool = True) -> str:
        message = f"{self.where}: {self.problem}"
        if self.fix:
            message += f" Fix: {self.fix}"
        if skip_hint and self.skippable:
            message += f" Or pass {option('skip_bad')} to count and skip such cases."
        return redact(message)

    def __str__(self) -> str:
        return self.describe()


class ShardError(SeqshardError):
    """A shard file that cannot be read as a tar of samples."""

    def __init__(self, path: str | Path, offset: int | None, problem: str):
        self.path = str(path)
        self.offset = offset
        self.problem = problem
        where = f"{path}" if offset is None else f"{path} at byte {offset}"
        super().__init__(f"{where}: {problem}")

    def __reduce__(self) -> tuple:
        return (type(self), (self.path, self.offset, self.problem))


class OutputError(SeqshardError):
    """An output file that cannot be written (disk full, read-only folder, no permission)."""

    def __init__(self, path: str | Path, problem: str, fix: str | None = None):
        super().__init__(path, problem, fix)
        self.path = str(path)
        self.problem = problem
        self.fix = fix

    @classmethod
    def from_os_error(cls, path: str | Path, error: OSError) -> OutputError:
        import errno

        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = "free space on that disk (or write elsewhere); running the same command again continues where it stopped."
        elif error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            fix = "choose an output folder you can write to."
        else:
            fix = None
        return cls(path, f"cannot write: {error.strerror or error}.", fix)

    def __str__(self) -> str:
        return redact(f"{self.path}: {self.problem}" + (f" Fix: {self.fix}" if self.fix else ""))


class ConfigError(SeqshardError, ValueError):
    """An impossible or inconsistent option; the message names the option."""


class StateMismatchError(SeqshardError):
    """A saved loader state does not fit the loader it is being loaded into."""


class SkipCounter:
    """Raises each bad-input error, or, when the user asked to skip, counts it by reason
    (errors that are not ``skippable``, such as a refused pipe, are always raised).

    The first few skips of each reason are logged with their file, line and key, so that a
    skip is never silent.
    """

    def __init__(self, skip: bool, log_limit: int = 5, done: str = "skipped"):
        self.skip = skip
        self.counts: dict[str, int] = {}
        self._log_limit = log_limit
        self._done = done  # what happens to a counted case, as the log says it

    def __call__(self, error: InputError) -> None:
        if not self.skip or not error.skippable:
            raise error
        seen = self.counts.get(error.reason, 0)
        self.counts[error.reason] = seen + 1
        if seen < self._log_limit:
            _LOG.warning("%s (%s): %s", self._done, error.reason, error.describe(skip_hint=False))
        elif seen == self._log_limit:
            _LOG.warning("further '%s' cases are counted but not logged", error.reason)
