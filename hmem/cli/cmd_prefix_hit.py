"""``hmem prefix-hit``: compute and explain a prefix-cache hit of a hybrid model."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from hmem import (
    Bitmap,
    Layout,
    PrefixHitReport,
    explain_prefix_hit,
    group_rows,
    presence_bits,
    presence_map,
)
from hmem.cli.options import JsonOption
from hmem.cli.output import Output
from hmem.cli.ranges import format_chunks, parse_chunks
from hmem.errors import InvalidArgumentError

PICTURE_MAX_CHUNKS = 64


def _parse_windows(text: str) -> list[int]:
    try:
        windows = [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        raise InvalidArgumentError(
            f"--windows {text!r}: expected comma-separated integers such as -1,-1,4,1"
        ) from None
    if not windows:
        raise InvalidArgumentError("--windows is empty: give one window per object group")
    return windows


def _presence_from_groups(specs: list[str], chunks: int, ranks: int, windows: list[int],
                          layout: Layout) -> Bitmap:
    if len(specs) != len(windows):
        raise InvalidArgumentError(
            f"{len(specs)} --group option(s) for {len(windows)} windows: give one --group per window, in order"
        )
    rows = []
    for g, spec in enumerate(specs):
        per_rank = spec.split(";")
        if len(per_rank) == 1:
            per_rank = per_rank * ranks
        if len(per_rank) != ranks:
            raise InvalidArgumentError(
                f"--group {spec!r} (group {g}) lists {len(per_rank)} ranks; give one chunk set "
                f"for all ranks or {ranks} separated by ';'"
            )
        rows.append([parse_chunks(part, chunks) for part in per_rank])
    return presence_map(rows, chunks, layout)


def _raw_presence(hex_text: str | None, path: Path | None, nbits: int, what: str) -> Bitmap:
    if hex_text is not None:
        cleaned = "".join(hex_text.split()).lower().removeprefix("0x")
        try:
            data = bytes.fromhex(cleaned)
        except ValueError:
            raise InvalidArgumentError(f"--hex: {hex_text!r} is not hexadecimal") from None
        source = "--hex"
    else:
        assert path is not None
        try:
            data = sys.stdin.buffer.read() if str(path) == "-" else path.read_bytes()
        except OSError as exc:
            raise InvalidArgumentError(f"--bitmap-file {path}: {exc.strerror}") from None
        source = f"--bitmap-file {path}"
    need = (nbits + 7) // 8
    if len(data) != need:
        raise InvalidArgumentError(
            f"{source} holds {len(data)} bytes but {what} = {nbits} bits need exactly {need}"
        )
    return Bitmap.from_bytes(data, nbits)


def _lengths(servable: Bitmap) -> str:
    """Servable prefix lengths (bit j = length j + 1) in the chunk-set syntax."""
    runs = servable.runs()
    if not runs:
        return "none"
    return ",".join(str(a + 1) if b == a + 1 else f"{a + 1}-{b}" for a, b in runs)


def _tokens(chunks: int, chunk_size: int | None) -> int | None:
    return None if chunk_size is None else chunks * chunk_size


def _json_document(report: PrefixHitReport, chunk_size: int | None) -> dict:
    return {
        "hit": report.hit,
        "hit_tokens": _tokens(report.hit, chunk_size),
        "num_chunks": report.num_chunks,
        "num_ranks": report.num_ranks,
        "windows": list(report.windows),
        "layout": report.layout.value,
        "chunk_size": chunk_size,
        "servable_lengths": [[a + 1, b + 1] for a, b in report.servable.runs()],
        "limiting_groups": list(report.limiting_groups),
        "groups": [
            {
                "group": g.index,
                "window": g.window,
                "kind": g.kind,
                "present_chunks": [list(run) for run in g.present.runs()],
                "first_missing": g.first_missing,
                "own_hit": g.own_hit,
                "needed": list(g.needed),
                "limits_hit": g.blocks_longer,
            }
            for g in report.groups
        ],
        "retain_bits": len(report.retain),
        "retained": report.retain.popcount(),
        "retain_mask_hex": report.retain.to_bytes().hex(),
    }


def _picture(report: PrefixHitReport, found: Bitmap) -> Text:
    C = report.num_chunks
    label_width = max(len(f"g{g.index}") for g in report.groups) + 2
    text = Text()
    if C >= 10:
        text.append(" " * label_width + "".join(str(j // 10 % 10) if j % 10 == 0 else " " for j in range(C)) + "\n")
    text.append(" " * label_width + "".join(str(j % 10) for j in range(C)) + "\n")
    rows = group_rows(found, C, report.num_ranks, report.windows, report.layout)
    for g in report.groups:
        ranks_present = [sum(row.test(j) for row in rows[g.index]) for j in range(C)]
        text.append(f"g{g.index}".ljust(label_width))
        lo, hi = g.needed
        for j in range(C):
            if lo <= j < hi:
                text.append("#", style="green")
            elif ranks_present[j] == report.num_ranks:
                text.append("+", style="cyan")
            elif ranks_present[j]:
                text.append("~", style="yellow")
            else:
                text.append(".", style="red")
        text.append("\n")
    text.append("# kept   + present, not needed   ~ some ranks missing   . absent", style="dim")
    return text


def _show(out: Output, report: PrefixHitReport, found: Bitmap, chunk_size: int | None,
          picture: bool | None) -> None:
    C = report.num_chunks
    tokens = _tokens(report.hit, chunk_size)
    headline = f"[bold]hit: {report.hit}[/] of {C} chunks"
    if tokens is not None:
        headline += f" ({tokens} of {_tokens(C, chunk_size)} tokens)"
    out.print(headline)
    out.print(f"servable prefix lengths: {_lengths(report.servable)}")
    G = len(report.windows)
    out.print(
        f"layout {report.layout.value}: {G} groups x {C} chunks x {report.num_ranks} ranks = "
        f"{len(report.retain)} bits, {report.retain.popcount()} retained"
    )
    limiting = [report.groups[i] for i in report.limiting_groups]
    if limiting:
        names = ", ".join(f"group {g.index} ({g.kind})" for g in limiting)
        plural = "s" if report.hit + 1 > 1 else ""
        out.print(f"limited by: {names}: cannot serve a prefix of {report.hit + 1} chunk{plural}")
    elif C:
        out.print("limited by: nothing, the whole request is servable")
    table = out.table("group", "kind", "present", ">first missing", ">alone", "keeps")
    for g in report.groups:
        lo, hi = g.needed
        keeps = "none" if lo == hi else (str(lo) if hi == lo + 1 else f"{lo}-{hi - 1}")
        table.add_row(
            str(g.index),
            g.kind,
            format_chunks(g.present),
            "-" if g.first_missing is None else str(g.first_missing),
            str(g.own_hit),
            keeps,
        )
    out.print(table)
    if picture if picture is not None else 0 < C <= PICTURE_MAX_CHUNKS:
        out.print(_picture(report, found))


def prefix_hit(
    chunks: Annotated[int, typer.Option("--chunks", "-c", min=0, help="Number of chunks C of the request.")],
    windows: Annotated[
        str,
        typer.Option(
            "--windows", "-w",
            help="One window per object group, comma-separated: -1 (any value <= 0) is full "
            "attention, w >= 1 a sliding window of w chunks (1 for mamba). Example: -1,-1,4,1",
        ),
    ],
    ranks: Annotated[int, typer.Option("--ranks", "-r", min=1, help="kv-rank shards per chunk (R).")] = 1,
    group: Annotated[
        list[str] | None,
        typer.Option(
            "--group", "-g",
            help="Chunks one group holds, once per window in order: '0-11,14' on every rank, "
            "or one set per rank separated by ';' such as '0-11;0-9'. 'all' and 'none' work too.",
        ),
    ] = None,
    hex_bitmap: Annotated[
        str | None,
        typer.Option("--hex", help="The whole presence map as raw bitmap bytes in hex (bit i in byte i//8, mask 1<<(i%8))."),
    ] = None,
    bitmap_file: Annotated[
        Path | None,
        typer.Option("--bitmap-file", help="The whole presence map as a file of raw bitmap bytes ('-' reads stdin)."),
    ] = None,
    layout: Annotated[
        Layout,
        typer.Option("--layout", help="Bit order of --hex / --bitmap-file and of the retain mask in --json."),
    ] = Layout.GROUP_MAJOR,
    chunk_size: Annotated[
        int | None, typer.Option("--chunk-size", min=1, help="Tokens per chunk, to show the hit in tokens.")
    ] = None,
    picture: Annotated[
        bool | None,
        typer.Option("--picture/--no-picture", help=f"Draw present and kept chunks (default: when C <= {PICTURE_MAX_CHUNKS})."),
    ] = None,
    json_output: JsonOption = False,
) -> None:
    """Compute the prefix-cache hit of a hybrid model and show which group limits it.

    Give the presence either per group (--group, once per window) or as raw
    bitmap bytes (--hex or --bitmap-file) in either --layout.
    """
    out = Output(json_mode=json_output)
    window_list = _parse_windows(windows)
    sources = sum(x is not None and x != [] for x in (group, hex_bitmap, bitmap_file))
    if sources != 1:
        raise InvalidArgumentError(
            "give the presence exactly one way: --group per window, --hex, or --bitmap-file"
        )
    nbits = presence_bits(chunks, ranks, window_list)
    if group:
        found = _presence_from_groups(group, chunks, ranks, window_list, layout)
    else:
        what = f"{len(window_list)} groups x {chunks} chunks x {ranks} ranks"
        found = _raw_presence(hex_bitmap, bitmap_file, nbits, what)
    report = explain_prefix_hit(found, chunks, ranks, window_list, layout)
    if json_output:
        out.emit_json(_json_document(report, chunk_size))
    else:
        _show(out, report, found, chunk_size, picture)
