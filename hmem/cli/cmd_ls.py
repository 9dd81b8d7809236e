"""``hmem ls``: list a store's entries."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Annotated

import typer

from hmem import ENTRY_SORTS, EntryListing, InvalidArgumentError, Store
from hmem.cli.entry_view import JSON_FIELDS, SORT_WORDS, entry_cells, json_template
from hmem.cli.health_view import SkipDamagedRecordsOption, report_damaged_records
from hmem.cli.options import ChunkSizeOption, JsonOption, KVShapeOption, ModelConfigOption, QuietOption, StoreArgument
from hmem.cli.output import Output, literal

# Rows of the human table when --limit is not given: a table is for reading,
# --json and --jsonl list every entry.
SHOWN = 100


def ls(
    store: StoreArgument,
    layer: Annotated[
        int | None,
        typer.Option("--layer", "-l", min=0, help="List only this layer's entries (or chunks).", show_default=False),
    ] = None,
    sort: Annotated[
        str,
        typer.Option(
            "--sort",
            "-s",
            metavar="ORDER",
            help="id (ascending), score (eviction order: next to be evicted first), "
            "accesses (most accessed first), age (oldest first) or size (largest first); other ties go to the lower "
            "id. An LMCache cache's chunks: name (the default), size (largest first), mtime (least recently "
            "written first) or atime (least recently read first).",
        ),
    ] = "id",
    limit: Annotated[
        int | None,
        typer.Option(
            "--limit",
            "-n",
            min=1,
            metavar="N",
            help=f"List the first N entries of that order (the table shows "
            f"the first {SHOWN} without it; --json and --jsonl list all).",
            show_default=False,
        ),
    ] = None,
    json_output: JsonOption = False,
    jsonl: Annotated[
        bool,
        typer.Option("--jsonl", help="Print one JSON object per entry and line, streamed (for millions of entries)."),
    ] = False,
    quiet: QuietOption = False,
    skip_damaged: SkipDamagedRecordsOption = False,
    model: Annotated[
        str | None,
        typer.Option(
            "--model", metavar="NAME", help="An LMCache cache: list only this model's chunks.", show_default=False
        ),
    ] = None,
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size", min=1, help="An LMCache cache: only chunks of this world size.", show_default=False
        ),
    ] = None,
    rank: Annotated[
        int | None,
        typer.Option(
            "--rank", min=0, help="An LMCache cache: only chunks of this rank (worker id).", show_default=False
        ),
    ] = None,
    tag: Annotated[
        str | None,
        typer.Option(
            "--tag",
            metavar="NAME%VALUE",
            help="An LMCache cache: only chunks with this tag (none: untagged ones).",
            show_default=False,
        ),
    ] = None,
    kv_dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            metavar="DTYPE",
            help="An LMCache cache: only chunks of this KV dtype (bfloat16...).",
            show_default=False,
        ),
    ] = None,
    kv_shape: KVShapeOption = None,
    model_config: ModelConfigOption = None,
    chunk_size: ChunkSizeOption = 256,
    chunks: Annotated[
        bool,
        typer.Option("--chunks", help="A store of chunks: list its chunks by key, not its entries."),
    ] = False,
) -> None:
    """List the entries of a store, one row each.

    Each row: id, layer, tokens, importance, accesses, eviction score, age,
    shard and bytes in the shard. With --chunks, a store of chunks (an hmem
    tier of LMCache) lists its chunks instead: key, parts (entries, one per
    layer), their ids, tokens, bytes, accesses and age, sorted by key.

    Of an LMCache cache directory: one row per chunk file, its key's
    fields, tokens, size and age; --model, --world-size, --rank, --tag,
    --layer and --dtype select chunks.

    Only reads: takes no lock and counts no access.
    """
    from hmem.cli.lmcache_target import cache_at

    if json_output and jsonl:
        raise InvalidArgumentError("give --json or --jsonl, not both")
    cache = cache_at(store, kv_shape_text=kv_shape, model_config=model_config, chunk_size=chunk_size)
    if cache is not None:
        from hmem.cli import lmcache_ls_view

        lmcache_ls_view.ls(
            cache,
            model=model,
            world_size=world_size,
            rank=rank,
            tag=tag,
            layer=layer,
            kv_dtype=kv_dtype,
            sort=sort,
            limit=limit,
            json_output=json_output,
            jsonl=jsonl,
            quiet=quiet,
        )
        return
    if any(x is not None for x in (model, world_size, rank, tag, kv_dtype)):
        raise InvalidArgumentError("--model, --world-size, --rank, --tag and --dtype select an LMCache cache's chunks")
    if sort not in ENTRY_SORTS:
        raise InvalidArgumentError(f"--sort must be one of {', '.join(ENTRY_SORTS)}, got {sort!r}")
    if json_output and jsonl:
        raise InvalidArgumentError("give --json or --jsonl, not both")
    out = Output(json_mode=json_output or jsonl, quiet=quiet)
    human = not (json_output or jsonl)
    if chunks:
        if jsonl or layer is not None or sort != "id":
            raise InvalidArgumentError("--chunks lists chunks by key: give it without --jsonl, --layer or --sort")
        with Store.open(store, read_only=True) as s:
            from hmem.cli import chunk_view

            chunk_view.ls(out, s, store, limit=limit, json_output=json_output)
        return
    with Store.open(store, read_only=True, on_damage="skip" if skip_damaged else "raise") as s:
        report_damaged_records(out, s)
        listing = s.entries(layer, sort=sort, limit=limit if limit is not None or not human else SHOWN)
    if jsonl:
        _write_stdout(_rows(listing, json_template(None), "", "\n"))
        return
    if json_output:
        head = {
            "store": str(store),
            "layer": layer,
            "sort": sort,
            "limit": limit,
            "total": listing.total,
            "count": len(listing),
        }
        opening = json.dumps(head, indent=2)[:-2] + ',\n  "entries": ['  # the document up to its entries
        if not len(listing):
            _write_stdout([opening + "]\n}\n"])
        else:
            _write_stdout(chain([opening + "\n    "], _rows(listing, json_template(4), ",\n    ", ""), ["\n  ]\n}\n"]))
        return
    where = "" if layer is None else f" in layer {layer}"
    if not listing.total:
        out.print(literal(f"no entries{where} in {store}"))
        return
    if quiet:
        return
    now = time.time_ns()
    table = out.table(">id", ">layer", ">tokens", ">importance", ">accesses", ">score", ">age", ">shard", ">bytes")
    for info in listing:
        table.add_row(*entry_cells(info, now))
    out.print(table)
    more = " (--limit N shows more)" if limit is None and len(listing) < listing.total else ""
    counted = f"{listing.total}" if len(listing) == listing.total else f"{len(listing)} of {listing.total}"
    out.print(f"{counted} entries{where}, {SORT_WORDS[sort]}{more}", soft_wrap=True)


def _rows(listing: EntryListing, template: str, between: str, after: str) -> Iterator[str]:
    """The entries' JSON objects, `between` them and `after` each, a batch
    per string; no Python object is kept per entry."""
    first = True
    for columns in listing.column_batches():
        rows = zip(*(columns[field] for _, field in JSON_FIELDS))
        text = between.join(template % row + after for row in rows)
        yield text if first else between + text
        first = False


def _write_stdout(parts: Iterable[str]) -> None:
    """Write the parts (a batch of entries each) to stdout as they come, as
    the JSON output of every command is written (Output.emit_json)."""
    for part in parts:
        sys.stdout.write(part)
    sys.stdout.flush()
