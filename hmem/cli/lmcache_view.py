"""What ``hmem stats``, ``ls``, ``show`` and ``verify`` print for an LMCache
cache directory (docs/lmcache.md): the library (hmem/lmcache) reads the
files, this module words and lays out what it found, for people (Rich
tables) and for scripts (``--json``, the library's ``to_dict()``)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Iterable
from itertools import chain, repeat
from typing import Any

import numpy as np
import typer

from hmem import CorruptStoreError, EntryNotFoundError, InvalidArgumentError
from hmem.cli.entry_view import age, utc_time
from hmem.cli.exit_codes import ExitCode
from hmem.cli.output import Output, human_bytes, literal, styled
from hmem.lmcache import CacheDirectory, ChunkInfo, GroupStats

# ls: the orders a cache's chunks can be listed in ("id", the store's
# default, is the file name's order); each, what the summary line says
CACHE_SORTS = {
    "name": "by file name",
    "size": "largest first",
    "mtime": "least recently written first",
    "atime": "least recently read first",
}
SORT_ALIASES = {"id": "name", "age": "mtime"}
SHOWN = 100  # rows of the ls table without --limit
NAMES_WIDTH = 120  # ls: a terminal this wide shows each chunk's file name too
SAMPLE_VALUES = 4  # show: values of the first token per layer and plane
LISTED_NAMES = 10  # stats: foreign files and other entries named one by one
STYLE = {"error": "red", "warning": "yellow"}


# ---- the K/V shape -------------------------------------------------------------------------


def shape_origin(cache: CacheDirectory) -> str:
    """Where the shape of chunks whose files carry none comes from: given
    (--kv-shape), model config (--model-config), inferred (layerwise
    local_disk sizes), headers (an fs cache needs none), or unknown."""
    shape = cache.kv_shape
    if shape is None:
        needs = any(kind in ("local_disk", "mp") for kind in cache.kinds)
        return "unknown" if needs else "headers"
    source = shape.source
    if source.startswith("given"):
        return "given"
    if "model config" in source:
        return "model config"
    if source.startswith("inferred"):
        return "inferred"
    return source


def shape_text(cache: CacheDirectory) -> str:
    origin = shape_origin(cache)
    shape = cache.kv_shape
    if shape is None:
        if origin == "headers":
            return "from each fs file's header"
        return (
            "unknown: local_disk and multiprocess files hold bytes only; give --kv-shape LAYERS,HIDDEN "
            "or --model-config PATH (the model's config.json) for their shape and tokens"
            + (
                f" (a layerwise cache's is inferred from its files when --chunk-size, {cache.chunk_size} "
                "here, is the cache's)"
                if cache.layerwise
                else ""
            )
        )
    planes = "1 latent plane (MLA)" if shape.mla else "K and V"
    return f"{shape.layers} layers x {shape.hidden} hidden per rank, {planes}; {shape.source}"


WRAPPED = ("model", "tags", "file", "detail", "value")


def _fitted(table: Any) -> Any:
    """A filled table for a narrow terminal: names (model, tags, file)
    and details wrap, whole (no ellipsis: they are what a user copies);
    every other column keeps its width."""
    for column in table.columns:
        if column.header in WRAPPED:
            column.overflow = "fold"
        else:
            column.min_width = max([len(column.header), *(len(str(cell)) for cell in column.cells)])
    return table


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


# ---- stats ---------------------------------------------------------------------------------


def _ranges(values: Iterable[int]) -> str:
    """[0, 1, 2, 3, 7] -> '0-3, 7'."""
    out: list[str] = []
    run: list[int] = []
    for v in sorted(values):
        if run and v == run[-1] + 1:
            run.append(v)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [v]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


@dataclasses.dataclass
class _Row:
    """One line of the stats table: a group, or the layers of a layerwise group."""

    first: GroupStats
    layers: dict[int, int]  # layer -> chunks (layerwise groups only)
    chunks: int
    files: int
    bytes: int


def _rows(groups: Iterable[GroupStats]) -> list[_Row]:
    """The groups, the layers of a layerwise one collapsed into one row."""
    rows: dict[tuple, _Row] = {}
    for g in groups:
        label = (g.kind, g.model, g.world_size, g.rank, g.kv_dtype, g.tags, g.group, g.layer is None)
        row = rows.get(label)
        if row is None:
            row = rows[label] = _Row(g, {}, 0, 0, 0)
        if g.layer is not None:
            row.layers[g.layer] = g.chunks
            row.chunks = max(row.chunks, g.chunks)
        else:
            row.chunks += g.chunks
        row.files += g.chunks
        row.bytes += g.bytes
    return list(rows.values())


def _model_table(out: Output, model: str, rows: list[_Row], every: list[_Row]) -> tuple[Any, list[tuple[_Row, str]]]:
    """One model's chunks, a row per (kind, rank, dtype, tags, object
    group), a layerwise group's layers in one row; the columns are those
    some row of the whole cache needs (`every`), so the tables line up."""
    kinds = len({r.first.kind for r in every}) > 1
    tags = any(r.first.tags for r in every)
    groups = any(r.first.group is not None for r in every)
    layered = any(r.layers for r in every)
    columns = (
        (["kind"] if kinds else [])
        + [">rank/world", "dtype"]
        + (["tags"] if tags else [])
        + ([">group"] if groups else [])
        + (["layers"] if layered else [])
        + [">chunks"]
        + ([">files"] if layered else [])
        + [">bytes"]
    )
    table = out.table(*columns, title=model)
    uneven = []
    for r in rows:
        g = r.first
        cells: list[Any] = [g.kind] if kinds else []
        cells += [f"{g.rank}/{g.world_size}", g.kv_dtype or "-"]
        cells += [literal(g.tags or "-")] if tags else []
        cells += [str(g.group) if g.group is not None else "-"] if groups else []
        if layered:
            cells.append(_ranges(r.layers) if r.layers else "-")
        counts = set(r.layers.values())
        if len(counts) > 1:
            cells.append(f"{min(counts)}-{max(counts)}")
            uneven.append((r, " ".join(f"{layer}:{n}" for layer, n in sorted(r.layers.items()))))
        else:
            cells.append(str(r.chunks))
        cells += [str(r.files)] if layered else []
        cells.append(human_bytes(r.bytes))
        table.add_row(*cells, end_section=r is rows[-1] and len(rows) > 1)
    if len(rows) > 1:  # the model's totals
        total = dict.fromkeys(columns, "")
        total[columns[0]] = "total"
        total[">chunks"] = str(sum(r.chunks for r in rows))
        if layered:
            total[">files"] = str(sum(r.files for r in rows))
        total[">bytes"] = human_bytes(sum(r.bytes for r in rows))
        table.add_row(*total.values())
    return table, uneven


def stats(cache: CacheDirectory, *, json_output: bool, quiet: bool) -> None:
    out = Output(json_mode=json_output, quiet=quiet)
    st = cache.stats()
    if json_output:
        document = st.to_dict()
        document["kv_shape_from"] = shape_origin(cache)
        document["layerwise"] = cache.layerwise
        document["chunk_size"] = cache.chunk_size
        out.emit_json(document)
        return
    summary = out.table("", "value", show_header=False)
    summary.add_row("cache", literal(st.path))
    summary.add_row(
        "kinds",
        ", ".join(st.kinds) + (" (layerwise: one file per chunk and layer)" if cache.layerwise else "")
        or "none (no chunk file)",
    )
    summary.add_row("chunk files", f"{st.chunks}, {human_bytes(st.bytes)}")
    summary.add_row("K/V shape", literal(shape_text(cache)))
    summary.add_row("chunk size", f"{cache.chunk_size} tokens (--chunk-size)")
    if st.debris:
        summary.add_row(
            ".tmp debris",
            f"{_count(len(st.debris), 'file')}, {human_bytes(st.debris_bytes)} (fs writes never renamed; "
            "debris once no LMCache is writing)",
        )
    else:
        summary.add_row(".tmp debris", "none")
    summary.add_row("foreign files", str(len(st.foreign)) + (" (named below)" if st.foreign else ""))
    summary.add_row(
        "other entries", str(len(st.other)) + (" (directories, links, devices: never read)" if st.other else "")
    )
    out.print(summary)
    rows = _rows(st.groups)
    uneven: list[tuple[_Row, str]] = []
    models = sorted({r.first.model for r in rows})
    for model in models:  # a table per model: its name is the title, not a column
        of_model = [r for r in rows if r.first.model == model]
        table, more = _model_table(out, model, of_model, rows)
        out.print(_fitted(table))
        uneven += more
    for r, per_layer in uneven:
        g = r.first
        out.warn(
            f"{g.model} world {g.world_size} rank {g.rank} {g.kv_dtype}"
            + (f" {g.tags}" if g.tags else "")
            + f": layers hold different numbers of chunks (layer:chunks {per_layer}); "
            "a chunk missing a layer is a miss"
        )
    for what, names in (("foreign file", st.foreign), ("other entry", st.other)):
        for name in names[:LISTED_NAMES]:
            why = "its name is no LMCache chunk" if what == "foreign file" else "not a regular file"
            out.warn(f"{what} {name}: {why}; hmem leaves it alone")
        if len(names) > LISTED_NAMES:
            out.warn(f"... and {len(names) - LISTED_NAMES} more {what}s ('hmem verify' lists them)")


# ---- ls ------------------------------------------------------------------------------------


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


def _order(cache: CacheDirectory, rows: np.ndarray, sort: str) -> np.ndarray:
    ls = cache.listing
    if sort == "size":  # largest first, then by name (rows are in name order)
        return rows[np.argsort(-ls.size[rows], kind="stable")]
    if sort in ("mtime", "atime"):
        column = ls.mtime_ns if sort == "mtime" else ls.atime_ns
        return rows[np.argsort(column[rows], kind="stable")]
    return rows


# how a chunk's file name spells its key (ChunkInfo.key): the name less its
# suffix, and an fs file's model with each "/" as "-SEP-"
_SUFFIX = {"local_disk": ".pt", "fs": ".data", "mp": ".data"}
_SEPARATOR = "-SEP-"


def _shape_of(cache: CacheDirectory, row: int) -> ChunkInfo:
    """A chunk's ChunkInfo with its shape: an fs file's header read (when
    it can be: else its shape stays unknown, 'hmem verify' says why)."""
    try:
        return cache.chunk(row)
    except (CorruptStoreError, OSError):
        return next(cache.chunks(np.array([row])))


def _shape_groups(cache: CacheDirectory, rows: np.ndarray) -> tuple[list[int], np.ndarray]:
    """The rows' groups of one shape: same kind, size, dtype, layerwise-ness
    and world size.  (index in `rows` of each group's first, group of each row)"""
    ls = cache.listing
    _, dtype_code = np.unique(ls.kv_dtype[rows].astype(str), return_inverse=True)
    label = np.stack(
        [
            ls.kind[rows].astype(np.int64),
            ls.size[rows],
            dtype_code.reshape(-1).astype(np.int64),
            (ls.layer[rows] >= 0).astype(np.int64),
            ls.world_size[rows],
        ],
        axis=1,
    )
    _, first, inverse = np.unique(label, axis=0, return_index=True, return_inverse=True)
    return first.tolist(), inverse.reshape(-1)


def chunk_dicts(cache: CacheDirectory, rows: np.ndarray) -> list[dict[str, Any]]:
    """ChunkInfo.to_dict() of each chunk of `rows`, built from the listing's
    columns (100,000 chunks in a fraction of a second): the shape is that
    of one chunk of the same kind, size, dtype, layerwise-ness and world
    size; for fs files, the header of one file of that size is read (one
    read per distinct size, not per file: listing stays a listing; 'hmem
    show' and 'hmem verify' read each file's own)."""
    ls = cache.listing
    if not len(rows):
        return []
    first_of, inverse = _shape_groups(cache, rows)
    shaped = [_shape_of(cache, int(rows[f])) for f in first_of]
    out = []
    columns = zip(
        inverse.tolist(),
        rows.tolist(),
        ls.name[rows].tolist(),
        ls.model[rows].tolist(),
        ls.world_size[rows].tolist(),
        ls.rank[rows].tolist(),
        ls.chunk_hash[rows].tolist(),
        ls.kv_dtype[rows].tolist(),
        ls.layer[rows].tolist(),
        ls.tags[rows].tolist(),
        ls.group[rows].tolist(),
        ls.size[rows].tolist(),
        (ls.mtime_ns[rows] / 1e9).tolist(),
        (ls.atime_ns[rows] / 1e9).tolist(),
    )
    for group, row, name, model, world, rank, chunk_hash, dtype, layer, tags, obj_group, size, mtime, atime in columns:
        like = shaped[group]
        kind = like.kind
        if kind == "fs" and like.name != name:
            if like.shape is None:  # its header could not be read: this file's own is
                like = _shape_of(cache, row)
                source = like.shape_source
            else:
                source = f"the header of {like.name} (same size)"
        else:
            source = like.shape_source
        key = name[: -len(_SUFFIX[kind])]
        out.append(
            {
                "name": name,
                "kind": kind,
                "key": key.replace(_SEPARATOR, "/") if kind == "fs" else key,
                "model": model,
                "world_size": world,
                "rank": rank,
                "chunk_hash": chunk_hash,
                "kv_dtype": dtype or like.kv_dtype,
                "layer": layer if layer >= 0 else None,
                "tags": tags,
                "group": obj_group if obj_group >= 0 else None,
                "size": size,
                "mtime": mtime,
                "atime": atime,
                "shape": list(like.shape) if like.shape is not None else None,
                "memory_format": like.memory_format,
                "shape_source": source,
                "tokens": like.tokens,
            }
        )
    return out


def _json_strings(values: list[str]) -> list[str]:
    """Each string as a JSON string literal, all encoded by one call of
    json's C encoder.  Split at '", "', which no encoded string holds (a
    quote inside one is escaped)."""
    if not values:
        return []
    parts = json.dumps(values)[2:-2].split('", "')
    if len(parts) != len(values):  # cannot happen; never a wrong document if it does
        return [json.dumps(v) for v in values]
    return [f'"{p}"' for p in parts]


def chunk_json_lines(cache: CacheDirectory, rows: np.ndarray) -> list[str]:
    """chunk_dicts(cache, rows) as compact JSON objects, the same key
    order, built column by column (no Python step per chunk beyond the
    joins in C): a listing of 100,000 chunks is what 'hmem ls --json' of
    a large cache prints."""
    ls = cache.listing
    n = len(rows)
    if not n:
        return []
    first_of, inverse = _shape_groups(cache, rows)
    shaped = [_shape_of(cache, int(rows[f])) for f in first_of]
    tail_own = []  # per group: the text after "atime", for the file whose header was read ...
    tail_same = []  # ... and for other files of its size (their own header unread)
    for like in shaped:
        common = (
            f',"shape":{json.dumps(list(like.shape) if like.shape is not None else None)}'
            f',"memory_format":{json.dumps(like.memory_format)}'
        )
        tokens = f',"tokens":{json.dumps(like.tokens)}}}'
        tail_own.append(f'{common},"shape_source":{json.dumps(like.shape_source)}{tokens}')
        tail_same.append(f'{common},"shape_source":{json.dumps(f"the header of {like.name} (same size)")}{tokens}')
    group_kind = np.array([like.kind for like in shaped])[inverse]
    fs = group_kind == "fs"
    first = np.zeros(n, dtype=bool)
    first[first_of] = True
    tail_of = (inverse + len(shaped) * (fs & ~first)).tolist()
    tails = list(map((tail_own + tail_same).__getitem__, tail_of))
    names = ls.name[rows].tolist()
    keys = [
        name[: -len(_SUFFIX[kind])].replace(_SEPARATOR, "/") if kind == "fs" else name[: -len(_SUFFIX[kind])]
        for name, kind in zip(names, group_kind.tolist())
    ]
    dtypes = ls.kv_dtype[rows].astype(str)
    unnamed = dtypes == ""  # an mp object's name has no dtype: its header's, when it has one
    if unnamed.any():
        dtypes = np.where(unnamed, np.array([like.kv_dtype for like in shaped])[inverse], dtypes)

    def ints(column: np.ndarray) -> list[str]:  # -1 (none) as null
        return [str(v) if v >= 0 else "null" for v in column[rows].tolist()]

    pieces = (
        ('{"name":', _json_strings(names)),
        (',"kind":"', group_kind.tolist()),
        ('","key":', _json_strings(keys)),
        (',"model":', _json_strings(ls.model[rows].tolist())),
        (',"world_size":', list(map(str, ls.world_size[rows].tolist()))),
        (',"rank":', list(map(str, ls.rank[rows].tolist()))),
        (',"chunk_hash":', _json_strings(ls.chunk_hash[rows].tolist())),
        (',"kv_dtype":', _json_strings(dtypes.tolist())),
        (',"layer":', ints(ls.layer)),
        (',"tags":', _json_strings(ls.tags[rows].tolist())),
        (',"group":', ints(ls.group)),
        (',"size":', list(map(str, ls.size[rows].tolist()))),
        (',"mtime":', list(map(repr, (ls.mtime_ns[rows] / 1e9).tolist()))),
        (',"atime":', list(map(repr, (ls.atime_ns[rows] / 1e9).tolist()))),
        ("", tails),
    )
    columns: list[Iterable[str]] = []
    for label, values in pieces:
        if label:
            columns.append(repeat(label, n))
        columns.append(values)
    out = list(map("".join, zip(*columns)))
    # fs files of a size whose first file's header could not be read: each its own
    for index in np.flatnonzero(fs & ~first).tolist():
        if shaped[int(inverse[index])].shape is None:
            out[index] = json.dumps(chunk_dicts(cache, rows[index : index + 1])[0], separators=(",", ":"))
    return out


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
    ordered = _order(cache, matched, sort)
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
            "kv_shape_from": shape_origin(cache),
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
    out.print(_fitted(_ls_table(out, infos)))
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


# ---- show ----------------------------------------------------------------------------------


def _row_of(cache: CacheDirectory, name: str) -> int:
    """A chunk by file name, key, or chunk hash alone (when one file has it)."""
    try:
        return cache.row_of(name)
    except EntryNotFoundError:
        ls = cache.listing
        hits = np.flatnonzero((ls.chunk_hash == name) & ls.chunks)
        if len(hits) == 1:
            return int(hits[0])
        hint = f"'hmem ls {cache.path}' lists its chunks"
        if len(hits) > 1:
            names = ", ".join(str(n) for n in ls.name[hits[:3]])
            raise InvalidArgumentError(
                f"{len(hits)} chunk files have hash {name} ({names}{', ...' if len(hits) > 3 else ''}): "
                "give a file name or key",
                hint=hint,
            ) from None
        raise EntryNotFoundError(
            f"no chunk {name!r} in {cache.path} (give a file name, a key or a chunk hash)", hint=hint
        ) from None


def _fp8_table(exponent_bits: int, bias: int, *, fnuz: bool) -> np.ndarray:
    """The float32 value of each of the 256 codes of an fp8 format: e4m3fn
    (no inf; NaN at S.1111.111), e5m2 (IEEE-like inf and NaN), and the
    fnuz forms (their own bias, no inf, NaN only at 0x80, no -0)."""
    codes = np.arange(256)
    mantissa_bits = 7 - exponent_bits
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> mantissa_bits) & ((1 << exponent_bits) - 1)
    mantissa = (codes & ((1 << mantissa_bits) - 1)) / (1 << mantissa_bits)
    values = np.where(exponent == 0, mantissa * 2.0 ** (1 - bias), (1 + mantissa) * 2.0 ** (exponent - bias)) * sign
    top = (1 << exponent_bits) - 1
    if fnuz:
        values[0x80] = np.nan
    elif exponent_bits == 4:
        values[(exponent == top) & (mantissa * 8 == 7)] = np.nan
    else:
        values[(exponent == top) & (mantissa == 0)] = np.inf * sign[(exponent == top) & (mantissa == 0)]
        values[(exponent == top) & (mantissa != 0)] = np.nan
    return values.astype(np.float32)


FP8 = {  # exponent bits, bias, fnuz
    "fp8_e4m3fn": (4, 7, False),
    "fp8_e5m2": (5, 15, False),
    "fp8_e4m3fnuz": (4, 8, True),
    "fp8_e5m2fnuz": (5, 16, True),
}


def _floats(info: ChunkInfo, values: np.ndarray) -> np.ndarray | None:
    """K/V values as float32: bfloat16 words shifted into a float32's high
    half, fp8 bytes through their format's table; None for integers."""
    if info.kv_dtype == "bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    if info.kv_dtype in FP8:
        bits, bias, fnuz = FP8[info.kv_dtype]
        return _fp8_table(bits, bias, fnuz=fnuz)[values]
    if values.dtype.kind == "f":
        return values.astype(np.float32)
    return None


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def _sample(info: ChunkInfo, data: np.ndarray) -> dict[str, Any] | None:
    """Per layer and plane (K and V, or the MLA latent): the first token's
    first values and the largest magnitude (None for a layout not known)."""
    if info.memory_format == "KV_T2D":  # one layer: [tokens, 2, hidden]
        planes = {"k": data[:, 0, :], "v": data[:, 1, :]}
        per_layer = [(info.layer, planes)]
    elif info.memory_format == "KV_MLA_FMT" and data.ndim == 2:  # one layer, latent: [tokens, hidden]
        per_layer = [(info.layer, {"latent": data})]
    elif data.ndim == 4 and data.shape[0] == 1:  # [1, layers, tokens, hidden]
        per_layer = [(layer, {"latent": data[0, layer]}) for layer in range(data.shape[1])]
    elif info.memory_format == "KV_2TD" and data.ndim == 3:  # one layer: [2, tokens, hidden]
        per_layer = [(info.layer, {"k": data[0], "v": data[1]})]
    elif data.ndim == 4:  # [2, layers, tokens, hidden]
        per_layer = [(layer, {"k": data[0, layer], "v": data[1, layer]}) for layer in range(data.shape[1])]
    else:
        return None
    layers = []
    decoded = True
    for layer, planes_of in per_layer:
        entry: dict[str, Any] = {"layer": layer}
        for plane, values in planes_of.items():
            floats = _floats(info, values)
            if floats is None:
                decoded = False
                entry[plane] = [int(x) for x in values[0, :SAMPLE_VALUES]]
                continue
            entry[plane] = [_json_float(float(x)) for x in floats[0, :SAMPLE_VALUES]]
            finite = floats[np.isfinite(floats)]
            entry[f"max_abs_{plane}"] = float(np.abs(finite).max()) if finite.size else None
            entry[f"non_finite_{plane}"] = int(floats.size - finite.size)
        layers.append(entry)
    return {"token": 0, "values": SAMPLE_VALUES, "decoded": decoded, "layers": layers}


def show(cache: CacheDirectory, name: str, *, json_output: bool, quiet: bool) -> None:
    out = Output(json_mode=json_output, quiet=quiet)
    row = _row_of(cache, name)
    info = cache.chunk(row)
    sample = None
    problem = None
    header_bytes = None
    if info.shape is not None:
        try:
            info, data = cache.read(row)
        except (CorruptStoreError, OSError) as exc:
            problem = exc
        else:
            sample = _sample(info, data)
            header_bytes = info.size - data.nbytes
    if json_output:
        out.emit_json(
            {
                "cache": str(cache.path),
                "chunk": info.to_dict(),
                "header_bytes": header_bytes if info.kind == "fs" else None,
                "kv_shape_from": shape_origin(cache),
                "sample": sample,
            }
        )
    elif not quiet:
        _show_human(out, cache, info, sample, header_bytes, problem is not None)
    if problem is not None:
        raise problem


def _show_human(
    out: Output,
    cache: CacheDirectory,
    info: ChunkInfo,
    sample: dict[str, Any] | None,
    header_bytes: int | None,
    problem: bool,
) -> None:
    now = time.time_ns()
    facts = out.table("", "value", show_header=False, title="chunk")
    facts.add_row("file", literal(info.name))
    facts.add_row("key", literal(info.key))
    facts.add_row("kind", info.kind)
    facts.add_row("model", literal(info.model))
    facts.add_row("world size", str(info.world_size))
    facts.add_row("rank", str(info.rank))
    facts.add_row("chunk hash", info.chunk_hash)
    facts.add_row("dtype", info.kv_dtype or "?")
    if info.layer is not None:
        facts.add_row("layer", str(info.layer))
    if info.tags:
        facts.add_row("tags", literal(info.tags))
    if info.group is not None:
        facts.add_row("object group", str(info.group))
    facts.add_row("size", f"{human_bytes(info.size)} ({info.size} bytes)")
    if info.kind == "fs" and info.memory_format is not None:
        shape = list(info.shape) if info.shape is not None else info.shape_source
        size = f"{header_bytes} bytes: " if header_bytes is not None else ""
        facts.add_row("header", literal(f"{size}memory format {info.memory_format}, {info.kv_dtype}, {shape}"))
    facts.add_row(
        "shape",
        literal(
            f"{' x '.join(map(str, info.shape))} {info.memory_format}; {info.shape_source}"
            if info.shape is not None
            else info.shape_source
        ),
    )
    facts.add_row("tokens", "?" if info.tokens is None else f"{info.tokens} (chunk size {cache.chunk_size})")
    facts.add_row("modified", f"{utc_time(int(info.mtime * 1e9))} ({age(int(info.mtime * 1e9), now)} ago)")
    facts.add_row("accessed", f"{utc_time(int(info.atime * 1e9))} (atime; not updated on noatime mounts)")
    out.print(_fitted(facts))
    if sample is None:
        if info.shape is None:
            out.print("no values shown: the shape is unknown (--kv-shape LAYERS,HIDDEN or --model-config PATH)")
        elif not problem:
            out.print(f"no values shown: memory format {info.memory_format} is not one hmem lays out")
        return
    planes = [p for p in ("k", "v", "latent") if sample["layers"] and p in sample["layers"][0]]
    table = out.table(">layer", "", f"token 0, first {SAMPLE_VALUES} values", ">max |x|", title="values (as float32)")
    for entry in sample["layers"]:
        for plane in planes:
            top = entry.get(f"max_abs_{plane}")
            bad = entry.get(f"non_finite_{plane}", 0)
            table.add_row(
                "-" if entry["layer"] is None else str(entry["layer"]),
                plane.upper() if plane != "latent" else "latent",
                " ".join(_number(x) for x in entry[plane]),
                ("?" if top is None else f"{top:.4g}") + (f" ({bad} inf/NaN)" if bad else ""),
            )
    out.print(_fitted(table))
    if not sample["decoded"]:
        out.print(f"{info.kv_dtype} values are shown as they are stored (integers)")


def _number(x: float | int | str) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _detail(name: str, detail: str) -> str:
    """A finding's detail without the file name the row already shows."""
    return detail[len(name) + 2 :] if name and detail.startswith(f"{name}: ") else detail


# ---- verify --------------------------------------------------------------------------------


def verify(cache: CacheDirectory, *, deep: bool, max_findings: int, json_output: bool, quiet: bool) -> None:
    out = Output(json_mode=json_output, quiet=quiet)
    report = cache.verify(deep=deep)
    if json_output:
        document = report.to_dict()
        document["kv_shape_from"] = shape_origin(cache)
        out.emit_json(document)
    else:
        findings = sorted(report.findings, key=lambda f: f.severity != "error")  # errors first
        shown = findings[:max_findings]
        if shown:
            table = out.table("severity", "problem", "file", "detail")
            for f in shown:
                table.add_row(
                    styled(f.severity, STYLE.get(f.severity, "")),
                    f.problem,
                    literal(f.name or "-"),
                    literal(_detail(f.name, f.detail)),
                )
            out.print(_fitted(table))
            if len(report.findings) > len(shown):
                out.print(f"... and {len(report.findings) - len(shown)} more findings (--max-findings, --json)")
        depth = "deep" if deep else "quick"
        checked = f"{report.chunks_checked} chunk files of {report.files} entries" + (
            f", {human_bytes(report.bytes_read)} of K/V read" if deep else ""
        )
        errors = sum(f.severity == "error" for f in report.findings)
        warnings = len(report.findings) - errors
        if not report.findings:
            more = "" if deep else " (--deep also reads every chunk's K/V)"
            out.print(literal(f"ok: {depth} check of {checked} found no problem{more}"))
        elif not errors:
            out.print(literal(f"ok: {depth} check of {checked}: {warnings} warning(s), no error; nothing changed"))
        else:
            out.print(
                literal(
                    f"{depth} check of {checked}: {errors} error(s), {warnings} warning(s); nothing changed "
                    "(a chunk with an error is one LMCache would serve wrong or fail to read)"
                )
            )
        hint = _chunk_size_hint(report.findings, report.chunks_checked)
        if hint:
            out.print(literal(hint))
    if not report.ok:
        raise typer.Exit(ExitCode.PROBLEMS_FOUND)


def _chunk_size_hint(findings: Iterable[Any], chunks: int) -> str | None:
    """When every chunk is 'partial' by the same count of tokens, the
    chunk size given is likely not the cache's."""
    partial = [f for f in findings if f.problem == "partial chunk"]
    sizes = {f.detail.split(" of ", 1)[0] for f in partial}
    if not chunks or len(partial) != chunks or len(sizes) != 1:
        return None
    size = sizes.pop()
    if not size.isdigit():
        return None
    return (
        f"every chunk holds {size} tokens: is the cache's chunk size {size}? "
        f"(LMCache's chunk_size setting: give --chunk-size {size})"
    )
