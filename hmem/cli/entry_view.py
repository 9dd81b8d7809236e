"""How `hmem ls` and `hmem show` word one entry's metadata: the JSON
fields (named as in `hmem query --json`) and the human cells."""

from __future__ import annotations

import datetime
from typing import Any

from hmem import EntryInfo, EntryNotFoundError
from hmem.cli.output import human_bytes, human_duration

# --sort NAME -> how the listing is ordered, as the footer of `hmem ls` says it
SORT_WORDS = {
    "id": "by id",
    "score": "by eviction score, next to be evicted first",
    "accesses": "most accessed first",
    "age": "oldest first",
    "size": "largest first",
}


# An entry's JSON object: (JSON name, EntryInfo field), in order
JSON_FIELDS = (
    ("entry_id", "entry_id"),
    ("layer", "layer_idx"),
    ("n_tokens", "n_tokens"),
    ("importance", "importance"),
    ("access_count", "access_count"),
    ("score", "score"),
    ("timestamp_ns", "created"),
    ("shard", "shard_idx"),
    ("bytes", "bytes"),
)
_FLOATS = {"importance", "score"}


def entry_json(info: EntryInfo) -> dict[str, Any]:
    return {name: getattr(info, field) for name, field in JSON_FIELDS}


def json_template(indent: int | None) -> str:
    """A %-format of one entry's JSON object (its values in JSON_FIELDS
    order) that prints what json.dumps(entry_json(info)) would: on one line,
    or as an element of a list in a document printed with indent=2 (`indent`
    spaces before its braces).  repr of a finite float is JSON's."""
    items = [f'"{name}": ' + ("%r" if field in _FLOATS else "%d") for name, field in JSON_FIELDS]
    if indent is None:
        return "{" + ", ".join(items) + "}"
    pad = " " * indent
    return "{\n" + ",\n".join(pad + "  " + item for item in items) + "\n" + pad + "}"


def entry_cells(info: EntryInfo, now_ns: int) -> tuple[str, ...]:
    """id, layer, tokens, importance, accesses, score, age, shard, bytes."""
    return (
        str(info.entry_id),
        str(info.layer_idx),
        str(info.n_tokens),
        f"{info.importance:g}",
        str(info.access_count),
        f"{info.score:.4g}",
        age(info.created, now_ns),
        str(info.shard_idx),
        human_bytes(info.bytes),
    )


def age(created_ns: int, now_ns: int) -> str:
    return human_duration(max(0, now_ns - created_ns) / 1e9)


def utc_time(ns: int) -> str:
    moment = datetime.datetime.fromtimestamp(ns / 1e9, datetime.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def not_found(exc: EntryNotFoundError, store: str) -> EntryNotFoundError:
    """The library's error with the hint worded for the command line."""
    return EntryNotFoundError(exc.message, hint=f"'hmem ls {store}' lists the live entries")
