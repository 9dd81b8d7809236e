"""``hmem prefix-hit``: compute and explain a prefix-cache hit of a hybrid model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hmem import InvalidArgumentError, Layout, explain_prefix_hit
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
    chunks: Annotated[int, typer.Option("--chunks", "-c", min=0, help="Number of chunks C of the request.")],
    windows: Annotated[
        str,
        typer.Option(
            "--windows",
            "-w",
            help="One window per object group, comma-separated: -1 (any value <= 0) is full "
            "attention, w >= 1 a sliding window of w chunks (1 for mamba). Example: -1,-1,4,1",
        ),
    ],
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
    json_output: JsonOption = False,
) -> None:
    """Compute the prefix-cache hit of a hybrid model and show which group limits it.

    Give the presence as a flat map, per group (--group, once per window) or
    as raw bitmap bytes (--hex or --bitmap-file) in either --layout, or as
    rows, one per (group, rank) (--row or --rows-file).
    """
    out = Output(json_mode=json_output)
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
