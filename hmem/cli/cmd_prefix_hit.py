"""``hmem prefix-hit``: compute and explain a prefix-cache hit of a hybrid model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hmem import InvalidArgumentError, Layout, explain_prefix_hit
from hmem.cli.lmcache_prefix_hit_view import explain_cache, parse_tags, parse_time
from hmem.cli.options import JsonOption
from hmem.cli.output import Output
from hmem.cli.prefix_hit_input import (
    check_size,
    parse_windows,
    presence_from_groups,
    raw_presence,
    row_windows,
    rows_from_file,
    rows_from_specs,
)
from hmem.cli.prefix_hit_view import PICTURE_MAX_CHUNKS, json_document, show


def prefix_hit(
    cache: Annotated[
        str | None,
        typer.Argument(
            help="An LMCache cache directory: explain the hit of the requests of --tokens against its files "
            "(docs/lmcache.md). Without it, the presence is given by hand.",
            show_default=False,
        ),
    ] = None,
    tokens: Annotated[
        Path | None,
        typer.Option(
            "--tokens",
            "-t",
            help="With CACHE: JSON token ids of one or more requests (a list of ids, a list of lists, or "
            'objects {"name", "tokens", "tags"}).',
            show_default=False,
        ),
    ] = None,
    chunks: Annotated[
        int | None, typer.Option("--chunks", "-c", min=0, help="Number of chunks C of the request.", show_default=False)
    ] = None,
    windows: Annotated[
        str | None,
        typer.Option(
            "--windows",
            "-w",
            help="One window per object group, comma-separated: -1 (any value <= 0) is full "
            "attention, w >= 1 a sliding window of w chunks (1 for mamba). Example: -1,-1,4,1. "
            "With CACHE: a multiprocess-mode cache's object groups (default -1).",
            show_default=False,
        ),
    ] = None,
    ranks: Annotated[int, typer.Option("--ranks", "-r", min=1, help="kv-rank shards per chunk (R).")] = 1,
    group: Annotated[
        list[str] | None,
        typer.Option(
            "--group",
            "-g",
            help="Chunks one group holds, once per window in order: '0-11,14' on every rank, "
            "or one set per rank separated by ';' such as '0-11;0-9'. 'all' and 'none' work too.",
        ),
    ] = None,
    hex_bitmap: Annotated[
        str | None,
        typer.Option(
            "--hex", help="The whole presence map as raw bitmap bytes in hex (bit i in byte i//8, mask 1<<(i%8))."
        ),
    ] = None,
    bitmap_file: Annotated[
        Path | None,
        typer.Option("--bitmap-file", help="The whole presence map as a file of raw bitmap bytes ('-' reads stdin)."),
    ] = None,
    row: Annotated[
        list[str] | None,
        typer.Option(
            "--row",
            help="Chunks one (group, rank) row holds, such as '0-11,14'; one --row per row, group by "
            "group: R rows for each window with --ranks R.",
        ),
    ] = None,
    rows_file: Annotated[
        Path | None,
        typer.Option(
            "--rows-file",
            help="The rows as raw bitmap bytes, ceil(C/8) bytes per row, back to back in --row's order "
            "('-' reads stdin).",
        ),
    ] = None,
    layout: Annotated[
        Layout | None,
        typer.Option(
            "--layout",
            help="Bit order of --hex / --bitmap-file and of the retain mask in --json "
            "(default: group-major). Rows have none.",
        ),
    ] = None,
    chunk_size: Annotated[
        int | None, typer.Option("--chunk-size", min=1, help="Tokens per chunk, to show the hit in tokens.")
    ] = None,
    picture: Annotated[
        bool | None,
        typer.Option(
            "--picture/--no-picture", help=f"Draw present and kept chunks (default: when C <= {PICTURE_MAX_CHUNKS})."
        ),
    ] = None,
    settings: Annotated[
        Path | None,
        typer.Option(
            "--settings",
            help="With CACHE: a JSON file of the deployment's settings (model, world_size, chunk_size, "
            "kv_dtype, hash_algorithm, none_hash or hash_seed, tags, layers, windows, salt, "
            "save_unfull_chunk, restarted_at); the options below override it.",
            show_default=False,
        ),
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="With CACHE: the model name vLLM was given.", show_default=False)
    ] = None,
    world_size: Annotated[
        int | None, typer.Option("--world-size", min=1, help="With CACHE: tensor-parallel ranks.", show_default=False)
    ] = None,
    hash_seed: Annotated[
        str | None,
        typer.Option(
            "--hash-seed",
            help="With CACHE: the PYTHONHASHSEED the deployment ran with (vLLM derives NONE_HASH from it).",
            show_default=False,
        ),
    ] = None,
    none_hash: Annotated[
        int | None,
        typer.Option("--none-hash", help="With CACHE: NONE_HASH itself (0 outside vLLM).", show_default=False),
    ] = None,
    hash_algorithm: Annotated[
        str | None,
        typer.Option(
            "--hash",
            help="With CACHE: builtin (the in-process engine) or blake3 (multiprocess mode); "
            "default: blake3 for a multiprocess-mode cache, else builtin.",
            show_default=False,
        ),
    ] = None,
    tag: Annotated[
        list[str] | None,
        typer.Option("--tag", help="With CACHE: a request tag NAME=VALUE (lmcache.tag.NAME), once per tag."),
    ] = None,
    restarted_at: Annotated[
        str | None,
        typer.Option(
            "--restarted-at",
            help="With CACHE: when the running LMCache started (unix seconds or ISO 8601): local_disk files "
            "written before it are never read by it.",
            show_default=False,
        ),
    ] = None,
    json_output: JsonOption = False,
) -> None:
    """Compute the prefix-cache hit of a hybrid model and show which group limits it.

    With an LMCache cache directory and --tokens, explain each request's hit
    from the cache's files: chunk by chunk and rank by rank, where the hit
    stops and why, what is unreachable after the hole, and near misses.

    Otherwise give the presence as a flat map, per group (--group, once per
    window) or as raw bitmap bytes (--hex or --bitmap-file) in either
    --layout, or as rows, one per (group, rank) (--row or --rows-file).
    """
    out = Output(json_mode=json_output)
    if cache is not None or tokens is not None:
        if cache is None or tokens is None:
            raise InvalidArgumentError("explaining requests against a cache needs both CACHE and --tokens FILE")
        overrides = {
            "model": model,
            "world_size": world_size,
            "chunk_size": chunk_size,
            "hash_seed": hash_seed,
            "none_hash": none_hash,
            "hash_algorithm": hash_algorithm,
            "tags": dict(parse_tags(tag)) if tag else None,
            "windows": parse_windows(windows) if windows is not None else None,
            "restarted_at": parse_time(restarted_at) if restarted_at is not None else None,
        }
        explain_cache(out, cache, tokens, settings, overrides, json_output)
        return
    if chunks is None or windows is None:
        raise InvalidArgumentError("give --chunks and --windows (or an LMCache cache directory and --tokens)")
    window_list = parse_windows(windows)
    sources = sum(x is not None and x != [] for x in (group, hex_bitmap, bitmap_file, row, rows_file))
    if sources != 1:
        raise InvalidArgumentError(
            "give the presence exactly one way: --group per window, --hex, --bitmap-file, "
            "--row per (group, rank), or --rows-file"
        )
    nbits = check_size(chunks, ranks, window_list)  # before anything of that size is allocated
    if row or rows_file is not None:
        if layout is not None:
            raise InvalidArgumentError(
                "--layout orders the bits of a flat map (--hex, --bitmap-file, --group); "
                "rows (--row, --rows-file) have no layout: leave it out"
            )
        per_row = row_windows(window_list, ranks)
        rows = (
            rows_from_specs(row, chunks, ranks, window_list)
            if row
            else rows_from_file(rows_file, chunks, ranks, window_list)  # type: ignore[arg-type]
        )
        report = explain_prefix_hit(rows, windows=per_row)
        found = None
    else:
        layout = layout or Layout.GROUP_MAJOR
        if group:
            found = presence_from_groups(group, chunks, ranks, window_list, layout)
        else:
            what = f"{len(window_list)} groups x {chunks} chunks x {ranks} ranks = {nbits} bits"
            found = raw_presence(hex_bitmap, bitmap_file, nbits, what)
        report = explain_prefix_hit(found, chunks, ranks, window_list, layout)
    if json_output:
        out.emit_json(json_document(report, chunk_size, ranks))
    else:
        show(out, report, found, chunk_size, picture, ranks)
