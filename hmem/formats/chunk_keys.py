"""Chunks: entries stored together under an external key (docs/format.md,
"Chunks").

A store made with ``chunks: true`` may hold chunks: the entries one
``Store.put_chunks`` stored under one key (an LMCache chunk key, say), one
entry per part (a layer of the chunk), with consecutive ids in part order.
Each part's metadata, in its shard's header like any entry's, says which
chunk it belongs to:

    "chunk_key": the key, 1 to 1024 printable characters
    "part":      its index in the chunk, 0 .. parts - 1
    "parts":     how many entries the chunk has

The metadata is committed with the entry, carried by compaction and kept by
repair, so the key index a store builds from it when opened
(hmem/store/chunks.py) is as durable as the entries themselves: no file of
its own to keep in step.
"""

from __future__ import annotations

import json
from typing import Any

from hmem.errors import InvalidArgumentError

KEY_FIELD = "chunk_key"
PART_FIELD = "part"
PARTS_FIELD = "parts"
MAX_KEY_CHARS = 1024
MAX_PARTS = 1 << 16
RESERVED_FIELDS = (KEY_FIELD, PART_FIELD, PARTS_FIELD)
# A first part's metadata as compact JSON with sorted keys (how hmem writes
# every entry's) holds this text: a cheap test before any parse.
_FIRST_PART_TEXT = f'"{PART_FIELD}":0,'


def check_key(key: Any, what: str = "chunk key") -> str:
    """A chunk key as given by a caller: a non-empty string of printable
    characters, at most MAX_KEY_CHARS."""
    if not isinstance(key, str):
        raise InvalidArgumentError(f"a {what} must be a string, got {type(key).__name__}")
    if not key or len(key) > MAX_KEY_CHARS:
        raise InvalidArgumentError(f"a {what} must have 1 to {MAX_KEY_CHARS} characters, got {len(key)}")
    if not key.isprintable():
        raise InvalidArgumentError(f"a {what} must be printable characters: {key!r}")
    return key


def part_meta(key: str, part: int, parts: int) -> dict[str, Any]:
    """The chunk fields of one part's metadata."""
    return {KEY_FIELD: key, PART_FIELD: part, PARTS_FIELD: parts}


def first_part(text: str) -> tuple[str, int] | None:
    """(key, parts) when the metadata text `text` is that of a chunk's
    first part, else None (another part, an entry of no chunk, or
    metadata that is not what hmem writes: never trusted)."""
    if _FIRST_PART_TEXT not in text:
        return None
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(meta, dict):
        return None
    key, part, parts = meta.get(KEY_FIELD), meta.get(PART_FIELD), meta.get(PARTS_FIELD)
    if (
        not isinstance(key, str)
        or not key
        or len(key) > MAX_KEY_CHARS
        or part != 0
        or type(parts) is not int
        or not 1 <= parts <= MAX_PARTS
    ):
        return None
    return key, parts


def part_of(meta: dict[str, Any] | None) -> tuple[str, int, int] | None:
    """(key, part, parts) of an entry's parsed metadata, or None."""
    if not meta:
        return None
    key, part, parts = meta.get(KEY_FIELD), meta.get(PART_FIELD), meta.get(PARTS_FIELD)
    if isinstance(key, str) and type(part) is int and type(parts) is int and 0 <= part < parts:
        return key, part, parts
    return None
