"""What ``hmem verify`` prints for an LMCache cache directory
(docs/lmcache.md): the findings of ``CacheDirectory.verify``
(hmem/lmcache/checks.py), errors first, and what they add up to, for
people, or the report's ``to_dict()`` for scripts (``--json``); exit code
4 when any finding is an error."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import typer

from hmem.cli.exit_codes import ExitCode
from hmem.cli.lmcache_tables import fitted
from hmem.cli.output import Output, human_bytes, literal, styled
from hmem.lmcache import CacheDirectory

STYLE = {"error": "red", "warning": "yellow"}  # of each severity


def _detail(name: str, detail: str) -> str:
    """A finding's detail without the file name the row already shows."""
    return detail[len(name) + 2 :] if name and detail.startswith(f"{name}: ") else detail


def verify(cache: CacheDirectory, *, deep: bool, max_findings: int, json_output: bool, quiet: bool) -> None:
    out = Output(json_mode=json_output, quiet=quiet)
    report = cache.verify(deep=deep)
    if json_output:
        document = report.to_dict()
        document["kv_shape_from"] = cache.kv_shape_origin
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
            out.print(fitted(table))
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
