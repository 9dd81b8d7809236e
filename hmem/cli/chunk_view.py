"""Chunks on the command line: `hmem ls STORE --chunks` and `hmem show
STORE KEY` of a store of chunks (an hmem tier of LMCache, say), through
`Store.chunks` (docs/cli.md)."""

from __future__ import annotations

import time
from typing import Any

from hmem import EntryNotFoundError, InvalidArgumentError, Store, StoreChunkInfo
from hmem.cli.entry_view import age, utc_time
from hmem.cli.ids import id_ranges
from hmem.cli.output import Output, human_bytes, literal


def chunk_json(info: StoreChunkInfo) -> dict[str, Any]:
    return {
        "key": info.key,
        "entry_ids": list(info.entry_ids),
        "layers": list(info.layers),
        "parts": info.parts,
        "tokens": info.n_tokens,
        "bytes": info.bytes,
        "created_ns": info.created,
        "accesses": info.access_count,
    }


def ls(out: Output, store: Store, location: str, *, limit: int | None, json_output: bool) -> None:
    """One row per live chunk, sorted by key."""
    if not store.config.chunks:
        raise InvalidArgumentError(f"{location} keeps no chunks: 'hmem ls' without --chunks lists its entries")
    chunks = store.chunks.listing()
    shown = chunks if limit is None else chunks[:limit]
    if json_output:
        out.emit_json(
            {"store": location, "total": len(chunks), "count": len(shown), "chunks": [chunk_json(c) for c in shown]}
        )
        return
    if not chunks:
        out.print(literal(f"no chunks in {location}"))
        return
    now = time.time_ns()
    table = out.table("key", ">parts", ">ids", ">tokens", ">bytes", ">accesses", ">age")
    for info in shown:
        table.add_row(
            literal(info.key),
            str(info.parts),
            id_ranges(info.entry_ids),
            str(info.n_tokens),
            human_bytes(info.bytes),
            str(info.access_count),
            age(info.created, now),
        )
    out.print(table)
    counted = f"{len(chunks)}" if len(shown) == len(chunks) else f"{len(shown)} of {len(chunks)}"
    out.print(f"{counted} chunks, by key", soft_wrap=True)


def show(out: Output, store: Store, location: str, key: str) -> None:
    """A chunk: its facts, then each part (an entry: 'hmem show STORE ID' shows it whole)."""
    found = store.chunks.listing([key])
    if not found:
        raise EntryNotFoundError(
            f"the store at {location} holds no chunk {key!r}", hint=f"'hmem ls {location} --chunks' lists them"
        )
    info = found[0]
    first_meta = store.get(info.entry_ids[0]).meta or {}  # the chunk's fields and what came with its first part
    if out.json_mode:
        out.emit_json({"store": location, **chunk_json(info), "meta": first_meta})
        return
    facts = out.table("", "value", show_header=False, title=f"chunk {info.key}")
    facts.add_row("parts", f"{info.parts} entries ({id_ranges(info.entry_ids)}), layers {id_ranges(info.layers)}")
    facts.add_row("tokens", str(info.n_tokens))
    facts.add_row("bytes", f"{human_bytes(info.bytes)} in its shards")
    facts.add_row("accesses", str(info.access_count))
    facts.add_row("put", f"{utc_time(info.created)} ({age(info.created, time.time_ns())} ago)")
    for name, value in first_meta.items():
        facts.add_row(literal(f"meta {name}"), literal(str(value)))
    out.print(facts)
    out.print(f"each part is an entry: 'hmem show {location} ID' shows one", soft_wrap=True)
