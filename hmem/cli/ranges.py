"""The readable chunk-set syntax of the command line: ``0-11,14``.

Items are separated by commas: ``a`` is one chunk, ``a-b`` the chunks a to b
inclusive, ``a-`` chunk a to the last.  ``all`` and ``none`` (or an empty
string) stand for every chunk and no chunk.
"""

from __future__ import annotations

from hmem import Bitmap, InvalidArgumentError


def _chunk(text: str, spec: str, count: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise InvalidArgumentError(f"{spec!r}: {text!r} is not a chunk number") from None
    if not 0 <= value < count:
        raise InvalidArgumentError(f"{spec!r}: chunk {value} is outside 0-{count - 1}")
    return value


def parse_chunks(spec: str, count: int) -> Bitmap:
    """The chunks `spec` names, as a Bitmap of `count` bits."""
    bm = Bitmap(count)
    text = spec.strip().lower()
    if text in ("", "none"):
        return bm
    if text == "all":
        return Bitmap.ones(count)
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise InvalidArgumentError(f"{spec!r}: empty item between commas")
        first, sep, last = item.partition("-")
        lo = _chunk(first.strip(), spec, count)
        hi = lo if not sep else (count - 1 if not last.strip() else _chunk(last.strip(), spec, count))
        if hi < lo:
            raise InvalidArgumentError(f"{spec!r}: range {item!r} runs backwards")
        bm.set_range(lo, hi + 1)
    return bm


def format_chunks(bm: Bitmap) -> str:
    """The shortest spec of the set bits: ``0-11,14``; ``none`` when empty."""
    runs = bm.runs()
    if not runs:
        return "none"
    return ",".join(str(a) if b == a + 1 else f"{a}-{b - 1}" for a, b in runs)
