"""The fake backend's constructor options: each given as a keyword or as an environment variable
(``OFFLOAD_CORE_FAKE_*``, so that a whole test run or a spawned process gets it), both read by one
parser, so ``chaos="maybe"`` and ``OFFLOAD_CORE_FAKE_CHAOS=maybe`` are refused alike. Every error
is an :class:`~offload_core.OffloadConfigError` naming the keyword or the variable, as the
library's own options are."""

from __future__ import annotations

import math
import os
from typing import Any, Callable, TypeVar

from offload_core.common.config import check_value, count
from offload_core.base.errors import OffloadConfigError


T = TypeVar("T")

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def flag(value: Any) -> bool:
    """True or False, or their words as an environment variable spells them: 1/0, true/false,
    yes/no, on/off."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS + FALSE_WORDS:
        return value.strip().lower() in TRUE_WORDS
    raise ValueError(f"expected True or False (in text: {'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)})")


def nbytes(value: Any) -> int:
    """A byte count >= 0, also written out as text (``1e9`` is accepted when whole)."""
    if isinstance(value, str):
        number = float(value)  # ValueError for text that is no number
        if not (math.isfinite(number) and number.is_integer()):
            raise ValueError("expected a whole number")
        value = int(number)
    return count(0)(value)


def positive_number(value: Any) -> float:
    """A finite number > 0 (from text too)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"expected a number, got {type(value).__name__}")
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError("must be a finite number > 0")
    return number


def seconds(value: Any) -> float:
    """A delay: a finite number of seconds >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number of seconds, got {type(value).__name__}")
    if not (0 <= value < float("inf")):
        raise ValueError("must be a finite number of seconds >= 0")
    return float(value)


def from_env(var: str, parse: Callable[[Any], T]) -> T | None:
    """The environment variable ``var`` parsed, or None when it is unset or empty; a value that
    does not parse is an :class:`OffloadConfigError` naming the variable."""
    text = os.environ.get(var)
    if text is None or not text.strip():
        return None
    try:
        return parse(text)
    except (TypeError, ValueError) as exc:
        raise OffloadConfigError(f"invalid environment variable {var}={text!r}: {exc}") from None


def option(name: str, value: Any, parse: Callable[[Any], T]) -> T | None:
    """The option ``name``: the keyword ``value`` when given, else ``OFFLOAD_CORE_FAKE_<NAME>``;
    both through the same ``parse``, errors naming whichever was used."""
    if value is not None:
        return check_value(name, value, parse)
    return from_env(f"OFFLOAD_CORE_FAKE_{name.upper()}", parse)
