"""Checks of option values, one rule for every loader, the config and the trainer.

A numeric option is a real number (a whole one where it counts something), never a bool or a
string, finite (NaN passes every ``<=`` check and infinity never ends a loop) and within its
bounds; otherwise :class:`~seqshard.errors.ConfigError` names the option and what it must be,
before Python or torch fail further on with an error that names neither.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from .errors import ConfigError

MAX_WORKERS = 1024  # worker processes per rank: more is a mistake, not a machine


def check_number(
    name: str,
    value: Any,
    *,
    whole: bool = False,
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
    optional: bool = False,
    what: str | None = None,
) -> int | float | None:
    """``value`` as a Python int or float (numpy's numbers too, so a state stays JSON-safe),
    checked: a number (``whole``: a whole number), finite, ``>= at_least``, ``> above`` and
    ``<= at_most`` (each bound when given); ``None`` too when ``optional``. Else ConfigError
    ``"NAME must be WHAT, got VALUE."``, WHAT saying what failed unless ``what`` says what the
    option is (e.g. "a number of seconds > 0")."""
    if value is None and optional:
        return value
    bounds = [f">= {at_least}"] if at_least is not None else []
    bounds += [f"> {above}"] if above is not None else []
    bounds += [f"<= {at_most}"] if at_most is not None else []
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if whole else numbers.Real):
        problem = ("a whole number" if whole else "a number") + (" or None" if optional else "")
    elif not isinstance(value, numbers.Integral) and not math.isfinite(value):
        problem = "a finite number"
    elif (
        (at_least is not None and value < at_least)
        or (above is not None and value <= above)
        or (at_most is not None and value > at_most)
    ):
        problem = " and ".join(bounds)
    else:
        return int(value) if isinstance(value, numbers.Integral) else float(value)
    raise ConfigError(f"{name} must be {what or problem}, got {value!r}.")


def check_flag(name: str, value: Any) -> bool:
    """``value`` if it is True or False (not 0, 1 or "false"), else ConfigError naming ``name``."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}.")
    return value
