"""The one place that checks caller-given integers, floats and choices.

Every public argument hmem checks goes through these helpers, so every
message has one wording:

    <name> must be an integer, got 'x'
    <name> must be between 1 and 4096, got 0
    <name> must be >= 1, got 0
    <name> must be a number, got 'x'
    <name> must be finite and >= 0, got nan
    <name> must be one of a, b, got 'c'

Booleans are refused where a number is asked for: ``True`` is an int to
Python, never a sensible count or size.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from typing import Any

from hmem.errors import InvalidArgumentError

U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1
F32_MAX = 3.4028234663852886e38


def integer(value: Any, name: str, *, low: int | None = None, high: int | None = None) -> int:
    """`value` as an int within [low, high] (either bound may be open)."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}") from None
    _check_range(number, name, low, high)
    return number


def _float(value: Any, name: str) -> float:
    """`value` as a float (NaN and infinities included), refusing bools and text."""
    if isinstance(value, bool) or isinstance(value, (str, bytes)):
        raise InvalidArgumentError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{name} must be a number, got {value!r}") from None


def number(value: Any, name: str, *, low: float | None = None, high: float | None = None) -> float:
    """`value` as a finite float within [low, high]."""
    result = _float(value, name)
    if not math.isfinite(result):
        raise InvalidArgumentError(f"{name} must be finite, got {value!r}")
    _check_range(result, name, low, high)
    return result


def wait_seconds(value: Any, name: str) -> float:
    """`value` as seconds to wait: >= 0, infinity meaning no limit."""
    result = _float(value, name)
    if not result >= 0.0:  # NaN too
        raise InvalidArgumentError(f"{name} must be >= 0 seconds, got {value!r}")
    return result


def choice(value: Any, name: str, choices: Iterable[str]) -> str:
    """`value`, which must be one of `choices`."""
    options = tuple(choices)
    if not isinstance(value, str) or value not in options:
        raise InvalidArgumentError(f"{name} must be one of {', '.join(options)}, got {value!r}")
    return value


def flag(value: Any, name: str) -> bool:
    """`value`, which must be True or False."""
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be true or false, got {value!r}")
    return value


def _check_range(value: float, name: str, low: float | None, high: float | None) -> None:
    if low is not None and high is not None:
        if not low <= value <= high:
            raise InvalidArgumentError(f"{name} must be between {low} and {high}, got {value}")
    elif low is not None and value < low:
        raise InvalidArgumentError(f"{name} must be >= {low}, got {value}")
    elif high is not None and value > high:
        raise InvalidArgumentError(f"{name} must be <= {high}, got {value}")


# The arguments many calls share, with their one definition.


def layer_index(value: Any, name: str = "layer_idx") -> int:
    return integer(value, name, low=0, high=U32_MAX)


def top_k(value: Any, name: str = "top_k") -> int:
    return integer(value, name, low=1)


def count(value: Any, name: str) -> int:
    return integer(value, name, low=0)


def importance(value: Any, name: str = "importance") -> float:
    return number(value, name, low=0.0, high=F32_MAX)


def share(value: Any, name: str) -> float:
    """A fraction between 0 and 1."""
    return number(value, name, low=0.0, high=1.0)
