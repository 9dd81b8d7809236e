"""What ``hmem show`` prints for one chunk of an LMCache cache directory
(docs/lmcache.md): its facts (ChunkInfo) and a sample of its values
(``hmem.lmcache.value_sample``), as tables for people and as one JSON
document for scripts (``--json``)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from hmem import CorruptStoreError, EntryNotFoundError, InvalidArgumentError
from hmem.cli.entry_view import age, utc_time
from hmem.cli.lmcache_tables import fitted
from hmem.cli.output import Output, human_bytes, literal
from hmem.lmcache import CacheDirectory, ChunkInfo, value_sample

SAMPLE_VALUES = 4  # values of the first token per layer and plane


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
            sample = value_sample(info, data, SAMPLE_VALUES)
            header_bytes = info.size - data.nbytes
    if json_output:
        out.emit_json(
            {
                "cache": str(cache.path),
                "chunk": info.to_dict(),
                "header_bytes": header_bytes if info.kind == "fs" else None,
                "kv_shape_from": cache.kv_shape_origin,
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
    out.print(fitted(facts))
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
    out.print(fitted(table))
    if not sample["decoded"]:
        out.print(f"{info.kv_dtype} values are shown as they are stored (integers)")


def _number(x: float | int | str) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)
