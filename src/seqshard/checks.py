"""Checks of numbers, one rule for options (every loader, the config, the trainer) and for
numbers read from files (indexes, manifests, metadata).

A number is a real number (a whole one where it counts something), never a bool or a string,
finite (NaN passes every ``<=`` check and infinity never ends a loop) and within its bounds;
otherwise :class:`~seqshard.errors.ConfigError` names the option and what it must be
(:func:`check_number`), or :class:`NumberError` names the field read from a file
(:func:`read_number`, for its reader to name the file and the fix), before Python, numpy or
torch fail further on with an error that names neither.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Collection
from dataclasses import fields
from pathlib import Path
from typing import Any

from .errors import ConfigError, InputError, Where

MAX_WORKERS = 1024  # worker processes per rank: more is a mistake, not a machine
MAX_PREFETCH = 256  # batches each worker prepares ahead (each takes a slot of shared memory)
MAX_BUCKETS = 1024  # length buckets (of calibrate, of bucket_sync): more is a mistake, and each costs a search
COUNT, INDEX, POSITIVE = dict(whole=True, at_least=1), dict(whole=True, at_least=0), dict(above=0)
# The rule (check_number's arguments) of every numeric option of pack, the loaders and the token
# loader, by its name: said once, so a name means one thing with one message everywhere. Whether
# None is allowed is the caller's (an option whose default is None).
RULES: dict[str, dict[str, Any]] = {
    **dict.fromkeys(("batch_size", "batch_frames", "shuffle_window", "sort_window", "interleave"), COUNT),
    **dict.fromkeys(("max_frames", "max_tokens", "epoch_steps", "world_size", "utts_per_file"), COUNT),
    **dict.fromkeys(("max_sentences", "max_positions", "virtual_size", "block_size"), COUNT),  # token loader's
    **dict.fromkeys(("seed", "min_frames", "channel", "rank", "pad_id", "eos_id", "src_lang_id", "tgt_lang_id"), INDEX),
    **dict.fromkeys(("quadratic_frames", "min_frames_per_token", "max_frames_per_token", "epoch_hours"), POSITIVE),
    **{name: {} for name in ("frame_length_ms", "frame_shift_ms", "dither")},  # bounded by FbankOptions
    "pad_label": dict(whole=True),
    "noise_prob": dict(at_least=0, at_most=1),
    "max_bad_shards": dict(at_least=0, what="a fraction of the shards (< 1) or a count (>= 1)"),
    "remote_retries": dict(INDEX, what="a whole number >= 0"),
    "remote_timeout": dict(POSITIVE, what="a number of seconds > 0"),
    "remote_min_rate": dict(POSITIVE, what="a number of bytes per second > 0"),
    "prefetch_factor": dict(COUNT, at_most=MAX_PREFETCH),
    "timeout": dict(at_least=0, what="a number of seconds >= 0 (0: no limit)"),
    "num_buckets": dict(COUNT, at_most=MAX_BUCKETS),
    "resample_to": dict(whole=True, at_least=1000, what="a sample rate in Hz (a whole number >= 1000)"),
    "num_mel_bins": dict(whole=True, at_least=3),  # as Kaldi (upper bound: FbankOptions)
    "num_workers": dict(INDEX, at_most=MAX_WORKERS),
    "jobs": dict(COUNT, at_most=MAX_WORKERS),  # pack's processes (and an executor's local workers)
}


def number_problem(
    value: Any,
    *,
    whole: bool = False,
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
    optional: bool = False,
) -> str | None:
    """What ``value`` must be and is not (``"a whole number"``, ``"a finite number"``,
    ``">= 0 and <= 10"``), or None when it is a number (``whole``: a whole number; never a
    bool or a string), finite, ``>= at_least``, ``> above`` and ``<= at_most``; None is fine
    when ``optional``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if whole else numbers.Real):
        return ("a whole number" if whole else "a number") + (" or None" if optional else "")
    if not isinstance(value, numbers.Integral) and not math.isfinite(value):
        return "a finite number"
    if (
        (at_least is not None and value < at_least)
        or (above is not None and value <= above)
        or (at_most is not None and value > at_most)
    ):
        bounds = [f">= {at_least}"] if at_least is not None else []
        bounds += [f"> {above}"] if above is not None else []
        bounds += [f"<= {at_most}"] if at_most is not None else []
        return " and ".join(bounds)
    return None


def _plain(value: Any) -> int | float | None:
    """A checked number as a Python int or float (numpy's too, so that a state stays JSON-safe)."""
    if value is None:
        return None
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def check_number(name: str, value: Any, *, what: str | None = None, **rule: Any) -> int | float | None:
    """``value`` as a Python int or float (numpy's numbers too, so a state stays JSON-safe),
    checked by :func:`number_problem` with ``rule`` (``whole``, ``at_least``, ``above``,
    ``at_most``, ``optional``). Else ConfigError ``"NAME must be WHAT, got VALUE."``, WHAT
    saying what failed unless ``what`` says what the option is (e.g. "a number of seconds > 0")."""
    problem = number_problem(value, **rule)
    if problem is not None:
        raise ConfigError(f"{name} must be {what or problem}, got {value!r}.")
    return _plain(value)


def check_rule(name: str, value: Any, optional: bool = False) -> int | float | None:
    """``value`` of the numeric option ``name`` checked by its rule in :data:`RULES` (None
    allowed when ``optional``), as :func:`check_number` returns it."""
    return check_number(name, value, optional=optional, **RULES[name])


def check_fields(options: Any, skip: Collection[str] = ()) -> None:
    """Each field of the frozen dataclass ``options`` (but ``skip``) that is a numeric option
    checked by its rule (None allowed where the default is None) and kept as a Python number
    (numpy's too, so states stay JSON); each bool field checked as a flag."""
    for entry in fields(options):
        value = getattr(options, entry.name)
        if entry.name in skip:
            continue
        if entry.name in RULES:
            object.__setattr__(options, entry.name, check_rule(entry.name, value, entry.default is None))
        elif entry.type in ("bool", bool):
            check_flag(entry.name, value)


class NumberError(ValueError):
    """A number read from a file that breaks its rule; the message names the field, the value
    and what it must be, for the reader to add the file and the fix."""


def read_number(field: str, value: Any, **rule: Any) -> int | float | None:
    """A number read from a file (an index, a manifest, metadata), checked as options are
    (:func:`number_problem` with ``rule``): a string, a list, NaN, infinity or a value out of
    range raises NumberError ``"FIELD is VALUE, not WHAT"`` (the value cut short), never a numpy
    or Python error further on."""
    problem = number_problem(value, **rule)
    if problem is not None:
        raise NumberError(f"{field} is {shown(value)}, not {problem}")
    return _plain(value)


def read_digits(field: str, text: str, at_most: int) -> int:
    """``text`` (ASCII digits, as Kaldi writes a count or a byte offset) as a whole number from
    0 to ``at_most``, else NumberError ``"FIELD is 'TEXT', not ..."``: never ``int``'s
    ValueError past 4300 digits, its ``1_000`` or Unicode digits, nor a number too large to
    seek to or count further on."""
    if not (text.isascii() and text.isdigit() and len(text) <= len(str(at_most)) and int(text) <= at_most):
        raise NumberError(f"{field} is {shown(text)}, not a whole number from 0 to {at_most}")
    return int(text)


def shown(value: Any) -> str:
    """``repr(value)``, cut short past 40 characters (for messages about values read from files)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_flag(name: str, value: Any) -> bool:
    """``value`` if it is True or False (not 0, 1 or "false"), else ConfigError naming ``name``."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}.")
    return value


def parse_json(data: bytes | str, where: str | Path, fix: str, kind: type = object) -> Any:
    """``data`` (a file's bytes or text) as JSON of ``kind`` (``dict``: an object); InputError
    naming ``where``, the line where it breaks and ``fix`` when it is not UTF-8, not JSON,
    nested too deeply or not of ``kind``."""
    line = None
    try:
        document = json.loads(data)
        if isinstance(document, kind):
            return document
        problem = f"holds {shown(document)}, not a JSON {'object' if kind is dict else kind.__name__}."
    except json.JSONDecodeError as error:
        line, problem = error.lineno, f"not JSON ({error.msg}, column {error.colno})."
    except UnicodeDecodeError as error:
        problem = f"not UTF-8 text (byte {error.start})."
    except RecursionError:
        problem = "its lists or objects nest deeper than Python reads."
    except ValueError as error:  # a number of more digits than Python reads
        problem = f"cannot be read as JSON ({str(error)[:200]})."
    raise InputError(Where(where, line), "bad_json", problem, fix, skippable=False)
