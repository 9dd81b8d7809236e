"""Sizes and durations as people type and read them."""

from __future__ import annotations

import re

from hmem import InvalidArgumentError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, option: str) -> int:
    """'256MiB' -> 268435456; plain numbers are bytes; k/M/G/T are powers of
    ten, KiB/MiB/GiB/TiB powers of two."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise InvalidArgumentError(f"{option} {text!r}: expected a size such as 1048576, 512MiB or 10G")
    value = float(match.group(1)) * _UNITS[unit]
    if not value < 2**64:
        raise InvalidArgumentError(f"{option} {text!r} is larger than 2^64 bytes")
    return int(value)
