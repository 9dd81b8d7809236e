"""What ``hmem stats`` prints for an LMCache cache directory
(docs/lmcache.md): the library's CacheStats (hmem/lmcache/cache.py),
worded and laid out for people (a summary, then a table per model) and for
scripts (``--json``, its ``to_dict()``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from hmem.cli.lmcache_tables import fitted
from hmem.cli.output import Output, human_bytes, literal
from hmem.lmcache import CacheDirectory, GroupStats

LISTED_NAMES = 10  # foreign files and other entries named one by one


def shape_text(cache: CacheDirectory) -> str:
    """The summary's K/V shape line: the shape and where it comes from,
    or why it is unknown and how to give it."""
    origin = cache.kv_shape_origin
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


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


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
        document["kv_shape_from"] = cache.kv_shape_origin
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
        out.print(fitted(table))
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
