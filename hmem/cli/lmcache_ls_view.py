"""What ``hmem ls`` prints for an LMCache cache directory (docs/lmcache.md):
the chunks ``CacheDirectory.select`` matches, in the order asked, as a
table for people (columns the same on every row go to the title) or as
the library's JSON objects of them (hmem/lmcache/chunk_table.py) for
scripts (``--json``, ``--jsonl``)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

from hmem import InvalidArgumentError
from hmem.cli.entry_view import age
from hmem.cli.lmcache_tables import fitted
from hmem.cli.output import Output, human_bytes, literal
from hmem.lmcache import CacheDirectory, chunk_dicts, chunk_json_lines, sort_rows

# the orders a cache's chunks can be listed in (the library's CHUNK_SORTS;
# "id", the store's default, is the file name's order); each, what the
# summary line says
CACHE_SORTS = {
    "name": "by file name",
    "size": "largest first",
    "mtime": "least recently written first",
    "atime": "least recently read first",
}
SORT_ALIASES = {"id": "name", "age": "mtime"}
SHOWN = 100  # rows of the table without --limit
NAMES_WIDTH = 120  # a terminal this wide shows each chunk's file name too


def _tag_filter(tag: str | None) -> str | None:
    if tag is None or tag == "none":
        return tag
    name, sep, _ = tag.partition("%")
    if not sep or not name or "@" in tag:
        raise InvalidArgumentError(f"--tag {tag!r}: give NAME%VALUE (as LMCache's keys spell a tag) or none")
    return tag


def sort_word(sort: str) -> str:
    word = SORT_ALIASES.get(sort, sort)
    if word not in CACHE_SORTS:
        raise InvalidArgumentError(
            f"--sort {sort!r}: an LMCache cache's chunks sort by {', '.join(CACHE_SORTS)}",
        )
    return word


def _write_lines(lines: Iterable[str]) -> None:
    """Text to stdout in batches, as the store's ls writes (each line whole)."""
    batch: list[str] = []
    for line in lines:
        batch.append(line)
        if len(batch) >= 4096:
            sys.stdout.write("".join(batch))
            batch.clear()
    sys.stdout.write("".join(batch))
    sys.stdout.flush()


def ls(
    cache: CacheDirectory,
    *,
    model: str | None,
    world_size: int | None,
    rank: int | None,
    tag: str | None,
    layer: int | None,
    kv_dtype: str | None,
    sort: str,
    limit: int | None,
    json_output: bool,
    jsonl: bool,
    quiet: bool,
) -> None:
    sort = sort_word(sort)
    tag = _tag_filter(tag)
    filters = {"model": model, "world_size": world_size, "rank": rank, "tag": tag, "layer": layer, "dtype": kv_dtype}
    out = Output(json_mode=json_output or jsonl, quiet=quiet)
    human = not (json_output or jsonl)
    matched = cache.select(model=model, world_size=world_size, rank=rank, kv_dtype=kv_dtype, tag=tag, layer=layer)
    ordered = sort_rows(cache, matched, sort)
    shown = limit if limit is not None else (SHOWN if human else None)
    rows = ordered[:shown] if shown is not None else ordered
    if jsonl:
        _write_lines(line + "\n" for line in chunk_json_lines(cache, rows))
        return
    if json_output:
        lines = chunk_json_lines(cache, rows)
        head = {
            "cache": str(cache.path),
            "kinds": list(cache.kinds),
            "kv_shape": cache.kv_shape.to_dict() if cache.kv_shape else None,
            "kv_shape_from": cache.kv_shape_origin,
            "filters": filters,
            "sort": sort,
            "limit": limit,
            "total": len(matched),
            "count": len(lines),
        }
        # one document, each chunk's object on a line of its own (json's C encoder: no indent)
        opening = json.dumps(head, indent=2)[:-2] + ',\n  "chunks": ['
        if not lines:
            _write_lines([opening + "]\n}\n"])
        else:
            body = (("\n    " if i == 0 else ",\n    ") + line for i, line in enumerate(lines))
            _write_lines(chain([opening], body, ["\n  ]\n}\n"]))
        return
    infos = chunk_dicts(cache, rows)
    given = {k: v for k, v in filters.items() if v is not None}
    where = (" matching " + ", ".join(f"{k} {v}" for k, v in given.items())) if given else ""
    if not len(matched):
        out.print(literal(f"no chunks{where} in {cache.path}"))
        return
    if quiet:
        return
    out.print(fitted(_ls_table(out, infos)))
    more = " (--limit N shows more)" if limit is None and len(infos) < len(matched) else ""
    counted = str(len(matched)) if len(infos) == len(matched) else f"{len(infos)} of {len(matched)}"
    out.print(literal(f"{counted} chunk files{where}, {CACHE_SORTS[sort]}{more}"), soft_wrap=True)
    if cache.kv_shape is None and any(info["shape"] is None and info["kind"] != "fs" for info in infos):
        out.print("tokens unknown: local_disk and multiprocess files carry no shape (--kv-shape or --model-config)")


def _ls_table(out: Output, infos: list[dict[str, Any]]) -> Any:
    """Columns whose value is the same on every row go to the title."""

    def dash(value: Any) -> str:
        return "-" if value is None or value == "" else str(value)

    fields: tuple[tuple[str, str, Callable[[dict[str, Any]], str]], ...] = (
        ("kind", "kind", lambda i: i["kind"]),
        ("model", "model", lambda i: i["model"]),
        (">rank", "rank/world size", lambda i: f"{i['rank']}/{i['world_size']}"),
        ("dtype", "dtype", lambda i: dash(i["kv_dtype"])),
        ("tags", "tags", lambda i: dash(i["tags"])),
        (">layer", "layer", lambda i: dash(i["layer"])),
        (">group", "group", lambda i: dash(i["group"])),
    )
    varying = []
    same = []
    for column, word, cell in fields:
        values = {cell(i) for i in infos}
        if len(values) > 1:
            varying.append((column, cell))
        elif values != {"-"}:
            same.append(f"{word} {values.pop()}")
    now = time.time_ns()
    title = ", ".join(same) or None
    # a file name is some 60 characters: on a narrow terminal the key's fields are shown without it
    names = out.out.width >= NAMES_WIDTH
    table = out.table(
        *(c for c, _ in varying), "hash", ">tokens", ">size", ">modified", *(["file"] if names else []), title=title
    )
    for info in infos:
        table.add_row(
            *(literal(cell(info)) for _, cell in varying),
            info["chunk_hash"],
            dash(info["tokens"]).replace("-", "?"),
            human_bytes(info["size"]),
            f"{age(int(info['mtime'] * 1e9), now)} ago",
            *([literal(info["name"])] if names else []),
        )
    return table
