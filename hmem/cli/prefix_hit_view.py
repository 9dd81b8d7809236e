"""How ``hmem prefix-hit`` shows a prefix-hit report: the JSON document,
the summary and table, and the picture of present and kept chunks, for a
flat presence map (a line per group) or for rows (a line per row)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hmem import Bitmap, GroupHit, PrefixHitReport, group_rows
from hmem.cli.output import Output, styled
from hmem.cli.ranges import format_chunks

if TYPE_CHECKING:
    from rich.text import Text

PICTURE_MAX_CHUNKS = 64


def _lengths(servable: Bitmap) -> str:
    """Servable prefix lengths (bit j = length j + 1) in the chunk-set syntax."""
    runs = servable.runs()
    if not runs:
        return "none"
    return ",".join(str(a + 1) if b == a + 1 else f"{a + 1}-{b}" for a, b in runs)


def _tokens(chunks: int, chunk_size: int | None) -> int | None:
    return None if chunk_size is None else chunks * chunk_size


def _facts(g: GroupHit) -> dict:
    return {
        "window": g.window,
        "kind": g.kind,
        "present_chunks": [list(run) for run in g.present.runs()],
        "first_missing": g.first_missing,
        "own_hit": g.own_hit,
        "needed": list(g.needed),
        "limits_hit": g.blocks_longer,
    }


def json_document(report: PrefixHitReport, chunk_size: int | None, ranks: int) -> dict:
    """`ranks`: the --ranks given; rows come `ranks` per group."""
    doc: dict[str, Any] = {
        "hit": report.hit,
        "hit_tokens": _tokens(report.hit, chunk_size),
        "num_chunks": report.num_chunks,
        "num_ranks": ranks,
        "windows": list(report.windows[::ranks] if report.from_rows else report.windows),
        "form": "rows" if report.from_rows else "flat",
    }
    if report.from_rows:
        doc.update(
            {
                "chunk_size": chunk_size,
                "servable_lengths": [[a + 1, b + 1] for a, b in report.servable.runs()],
                "limiting_rows": list(report.limiting_groups),
                "rows": [
                    {"row": g.index, "group": g.index // ranks, "rank": g.index % ranks, **_facts(g)}
                    for g in report.groups
                ],
                "retained": report.retain.popcount(),
                "retain_rows_hex": [row.to_bytes().hex() for row in report.retain_rows],
            }
        )
        return doc
    doc.update(
        {
            "layout": report.layout.value,
            "chunk_size": chunk_size,
            "servable_lengths": [[a + 1, b + 1] for a, b in report.servable.runs()],
            "limiting_groups": list(report.limiting_groups),
            "groups": [{"group": g.index, **_facts(g)} for g in report.groups],
            "retain_bits": len(report.retain),
            "retained": report.retain.popcount(),
            "retain_mask_hex": report.retain.to_bytes().hex(),
        }
    )
    return doc


def _label(report: PrefixHitReport, g: GroupHit, ranks: int) -> str:
    return f"g{g.index // ranks}r{g.index % ranks}" if report.from_rows else f"g{g.index}"


def _picture(report: PrefixHitReport, found: Bitmap | None, ranks: int) -> Text:
    """One line per group (per row for rows); `found` is the flat map, None for rows."""
    C = report.num_chunks
    label_width = max(len(_label(report, g, ranks)) for g in report.groups) + 2
    from rich.text import Text  # human output only (hmem/cli/output.py)

    text = Text()
    if C >= 10:
        text.append(" " * label_width + "".join(str(j // 10 % 10) if j % 10 == 0 else " " for j in range(C)) + "\n")
    text.append(" " * label_width + "".join(str(j % 10) for j in range(C)) + "\n")
    if found is None:
        rows = [[g.present] for g in report.groups]
    else:
        rows = group_rows(found, C, report.num_ranks, report.windows, report.layout)
    for g in report.groups:
        ranks_present = [sum(row.test(j) for row in rows[g.index]) for j in range(C)]
        text.append(_label(report, g, ranks).ljust(label_width))
        lo, hi = g.needed
        for j in range(C):
            if lo <= j < hi:
                text.append("#", style="green")
            elif ranks_present[j] == len(rows[g.index]):
                text.append("+", style="cyan")
            elif ranks_present[j]:
                text.append("~", style="yellow")
            else:
                text.append(".", style="red")
        text.append("\n")
    legend = "# kept   + present, not needed   " + ("" if found is None else "~ some ranks missing   ")
    text.append(legend + ". absent", style="dim")
    return text


def _name(report: PrefixHitReport, g: GroupHit, ranks: int) -> str:
    if report.from_rows:
        return f"row {g.index} (group {g.index // ranks} rank {g.index % ranks}, {g.kind})"
    return f"group {g.index} ({g.kind})"


def show(
    out: Output, report: PrefixHitReport, found: Bitmap | None, chunk_size: int | None, picture: bool | None, ranks: int
) -> None:
    """`found`: the flat map, None when the presence came as rows, `ranks` per group."""
    from rich.text import Text  # human output only (hmem/cli/output.py)

    C = report.num_chunks
    tokens = _tokens(report.hit, chunk_size)
    headline = Text.assemble(styled(f"hit: {report.hit}", "bold"), f" of {C} chunks")
    if tokens is not None:
        headline.append(f" ({tokens} of {_tokens(C, chunk_size)} tokens)")
    out.print(headline)
    out.print(f"servable prefix lengths: {_lengths(report.servable)}")
    if report.from_rows:
        n = len(report.groups)
        out.print(
            f"rows: {n // ranks} groups x {ranks} ranks = {n} rows of {C} chunks, {report.retain.popcount()} retained"
        )
    else:
        out.print(
            f"layout {report.layout.value}: {len(report.windows)} groups x {C} chunks x {report.num_ranks} "
            f"ranks = {len(report.retain)} bits, {report.retain.popcount()} retained"
        )
    limiting = [report.groups[i] for i in report.limiting_groups]
    if limiting:
        names = ", ".join(_name(report, g, ranks) for g in limiting)
        plural = "s" if report.hit + 1 > 1 else ""
        out.print(f"limited by: {names}: cannot serve a prefix of {report.hit + 1} chunk{plural}")
    elif C:
        out.print("limited by: nothing, the whole request is servable")
    heads = ("row", ">group", ">rank") if report.from_rows else ("group",)
    table = out.table(*heads, "kind", "present", ">first missing", ">alone", "keeps")
    for g in report.groups:
        lo, hi = g.needed
        keeps = "none" if lo == hi else (str(lo) if hi == lo + 1 else f"{lo}-{hi - 1}")
        place = (str(g.index), str(g.index // ranks), str(g.index % ranks)) if report.from_rows else (str(g.index),)
        table.add_row(
            *place,
            g.kind,
            format_chunks(g.present),
            "-" if g.first_missing is None else str(g.first_missing),
            str(g.own_hit),
            keeps,
        )
    out.print(table)
    if picture if picture is not None else 0 < C <= PICTURE_MAX_CHUNKS:
        out.print(_picture(report, found, ranks))
