"""The one place that checks caller-given integers, floats, choices and
paths (an empty path, a file where a store directory goes).

Every public argument hmem checks goes through these helpers, so every
message has one wording:

    <name> must be an integer, got 'x'
    <name> must be between 1 and 4096, got 0
    <name> must be >= 1, got 0
    <name> must be > 0, got 0
    <name> must be a number, got 'x'
    <name> must be finite and >= 0, got nan
    <name> must be one of a, b, got 'c'

Booleans are refused where a number is asked for: ``True`` is an int to
Python, never a sensible count or size.
"""

from __future__ import annotations

import errno
import math
import operator
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from hmem.errors import InvalidArgumentError, PathError, storage_error

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


def positive(value: Any, name: str, *, high: float | None = None) -> float:
    """`value` as a finite float > 0 (and <= high): a size or a duration
    that zero would make meaningless."""
    result = number(value, name, high=high)
    if not result > 0.0:
        raise InvalidArgumentError(f"{name} must be > 0, got {value!r}")
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


def entry_ids(value: Any) -> np.ndarray:
    """Entry ids as a unique ascending uint64 array; anything else than an
    iterable of non-negative integers is refused."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "iu" and value.ndim == 1:
        if value.size and value.min() < 0:
            raise InvalidArgumentError(f"entry ids must be >= 0, got {value.min()}")
        return np.unique(value.astype(np.uint64))
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidArgumentError(f"entry_ids must be an iterable of integers, got {type(value).__name__}")
    ids = [integer(i, "entry id", low=0, high=2**64 - 1) for i in value]
    return np.unique(np.array(ids, dtype=np.uint64))


def count(value: Any, name: str) -> int:
    return integer(value, name, low=0)


def importance(value: Any, name: str = "importance") -> float:
    return number(value, name, low=0.0, high=F32_MAX)


def share(value: Any, name: str) -> float:
    """A fraction between 0 and 1."""
    return number(value, name, low=0.0, high=1.0)


def path_text(value: Any, name: str) -> str:
    """A path given as text (or os.PathLike) that names something: ``""``
    is refused, not taken for the current directory, as ``Path("")`` and
    the file system calls would take it (a store or a file "" is a slip of
    the shell, such as an unset variable, never the directory meant)."""
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else value
    if not isinstance(text, str):
        raise InvalidArgumentError(f"{name} must be a path, got {value!r}")
    if not text:
        raise InvalidArgumentError(
            f"{name} is empty ({text!r}): an empty path names no directory or file",
            hint="give the path explicitly, '.' for the current directory",
        )
    return text


def file_to_write(value: Any, name: str) -> str:
    """A path a file can be written to (``path_text``): not a directory,
    and in a directory that exists; else the PathError of what is wrong
    (EISDIR, ENOENT, ENOTDIR: exit code 10), before anything is read or
    written."""
    text = path_text(value, name)
    if os.path.isdir(text):
        code = errno.EISDIR
    else:
        parent = os.path.dirname(text) or "."
        if os.path.isdir(parent):
            return text
        code = errno.ENOENT if not os.path.exists(parent) else errno.ENOTDIR
    raise storage_error(OSError(code, os.strerror(code)), "write", text)


def store_directory(value: Any, name: str = "the store path") -> str:
    """A local store's path: not empty (path_text), and not an existing
    file or other non-directory, which is a PathError (ENOTDIR: exit code
    10, "a file for a directory", docs/cli.md) for every command alike,
    not "no store here" (NotAStoreError) nor "exists" (StoreExistsError)."""
    text = path_text(value, name)
    if os.path.exists(text) and not os.path.isdir(text):
        strerror = os.strerror(errno.ENOTDIR)
        raise PathError(
            f"{text} is a file, not a store directory",
            path=text,
            errno=errno.ENOTDIR,
            strerror=strerror,
            hint="give the directory of a store, or a new or empty one to create a store in",
        )
    return text
