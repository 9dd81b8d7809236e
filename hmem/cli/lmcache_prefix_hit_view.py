"""How ``hmem prefix-hit CACHE --tokens FILE`` shows the explanation of
requests against an LMCache cache (hmem/lmcache/hit_explanation.py): per request
a grid, one row per rank (per object group and rank in multiprocess mode)
and one column per chunk, so the hole is seen before it is read about;
then the hit, why it stops, what lies after the hole, and near misses."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hmem import InvalidArgumentError
from hmem.cli.output import Output, styled
from hmem.lmcache import CELL_MEANINGS, Deployment, RequestHit, explain, open_cache, read_requests

# How each cell letter of RequestHit.grid (hmem.lmcache.CELL_MEANINGS) is drawn: a glyph and a style
_CELLS = {
    "H": ("█", "green"),  # held and hit
    "h": ("▒", "green"),  # held, inside the hit, outside the row's window
    ".": ("·", "dim"),  # missing
    "X": ("X", "bold red"),  # missing: stops the hit
    "u": ("▓", "yellow"),  # held after the hole: unreachable
    "s": ("s", "magenta"),  # held, written before the restart: never read
    "t": ("t", "red"),  # only a .tmp: a write that never finished
}
_GRID_WIDTH = 96  # chunks per line of the grid; longer requests wrap


def json_document(results: Sequence[RequestHit], deployment: Deployment, cache_path: str) -> dict:
    return {
        "cache": cache_path,
        "deployment": deployment.to_dict(),
        "cells": CELL_MEANINGS,
        "requests": [r.to_dict() for r in results],
        "hit_tokens": sum(r.hit_tokens for r in results),
        "tokens": sum(r.tokens for r in results),
    }


def show(out: Output, results: Sequence[RequestHit], deployment: Deployment) -> None:
    for result in results:
        _show_one(out, result)
    if len(results) > 1:
        hit = sum(r.hit_tokens for r in results)
        total = sum(r.tokens for r in results)
        out.print(f"{len(results)} requests: {hit} of {total} tokens hit ({100 * hit / max(1, total):.1f}%)")
    used = {cell for r in results for row in r.grid for cell in row}
    legend = "  ".join(f"{_CELLS[k][0]} {v}" for k, v in CELL_MEANINGS.items() if k in used)
    if legend:
        out.print(styled(legend, "dim"), soft_wrap=True)


def _show_one(out: Output, r: RequestHit) -> None:
    title = (
        f"request {r.name}: {r.hit_tokens} of {r.tokens} tokens hit "
        f"({r.hit_chunks} of {r.chunks} chunks of {r.chunk_size})"
    )
    out.print(styled(title, "bold"))
    if r.chunks:
        label_width = max(len(label) for label in r.rows)
        for start in range(0, r.chunks, _GRID_WIDTH):
            if r.chunks > _GRID_WIDTH:
                out.print(styled(f"{'':{label_width}}  chunks {start}-{min(r.chunks, start + _GRID_WIDTH) - 1}", "dim"))
            for label, window, cells in zip(r.rows, r.windows, r.grid):
                line = styled(f"{label:{label_width}}  ", "")
                for cell in cells[start : start + _GRID_WIDTH]:
                    glyph, style = _CELLS[cell]
                    line.append(glyph, style=style)
                if window > 0:
                    line.append(f"  window {window}", style="dim")
                out.print(line, soft_wrap=True)
    if r.reason:
        out.print(f"  stops at chunk {r.first_missing}: {r.reason}" if r.chunks else f"  {r.reason}", soft_wrap=True)
    if r.unreachable:
        out.print(
            f"  {len(r.unreachable_files)} file(s) of chunk(s) {', '.join(map(str, r.unreachable))} "
            "are held after the hole: every chunk's hash depends on all before it, so no lookup reaches them "
            "('hmem compact CACHE --tokens ...' can remove them)",
            soft_wrap=True,
        )
    for m in r.near_misses:
        out.print(
            f"  near miss: {m.chunks} chunk(s) of this request are stored with {m.setting} {m.stored} "
            f"(this lookup uses {m.wanted}), e.g. {m.example}",
            soft_wrap=True,
        )
    for note in r.notes:
        out.print(f"  note: {note}", soft_wrap=True)


def parse_tags(specs: Sequence[str]) -> list[tuple[str, str]]:
    out = []
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or not name:
            raise InvalidArgumentError(f"--tag {spec!r}: give NAME=VALUE, e.g. user=alice")
        out.append((name.removeprefix("lmcache.tag."), value))
    return out


def parse_time(text: str) -> float:
    """Unix seconds, or an ISO 8601 time (UTC unless it says otherwise)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise InvalidArgumentError(f"{text!r} is neither unix seconds nor an ISO 8601 time") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp()


def explain_cache(
    out: Output, path: str, tokens: Path, settings: Path | None, overrides: dict[str, Any], json_output: bool
) -> None:
    """`hmem prefix-hit CACHE --tokens FILE`: the library explains, this shows."""
    given = {k: v for k, v in overrides.items() if v is not None}
    deployment = Deployment.from_file(settings, **given) if settings is not None else _deployment(given)
    cache = open_cache(path, chunk_size=deployment.chunk_size)
    results = explain(cache, read_requests(tokens), deployment)
    if json_output:
        out.emit_json(json_document(results, deployment, str(cache.path)))
    else:
        show(out, results, deployment)


def _deployment(given: dict[str, Any]) -> Deployment:
    if "model" not in given:
        raise InvalidArgumentError("give the deployment's model name (--model, or model in --settings)")
    return Deployment.from_dict(given)
