"""``hmem evict``, ``hmem compact`` and ``hmem rm`` on an LMCache cache
directory (docs/lmcache.md): the plan first (hmem/lmcache/cleaning.py),
shown as a table with its totals, then, once confirmed (--yes, or a yes
at the terminal), its execution.  Without a confirmation it is a dry run:
the plan is shown and nothing is deleted."""

from __future__ import annotations

import re
import sys
from typing import Any

import typer

from hmem import InvalidArgumentError
from hmem.cli import signals
from hmem.cli.exit_codes import ExitCode
from hmem.cli.lmcache_prefix_hit_view import parse_time
from hmem.cli.notes import problem
from hmem.cli.output import Output, human_bytes, human_duration
from hmem.cli.prompts import confirm_change
from hmem.cli.units import parse_size
from hmem.lmcache import CacheDirectory, CleanPlan, CleanReport, clean, plan_clean, unreachable_files

DEFAULT_DEBRIS_AGE = 3600.0  # a .tmp younger than an hour may be a write in flight
SHOWN = 50  # plan rows a terminal shows (--json lists them all)

_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")
_AGE_UNITS = {
    "": 1,
    "s": 1,
    "sec": 1,
    "m": 60,
    "min": 60,
    "h": 3600,
    "d": 86400,
    "w": 604800,
}


def parse_age(text: str, option: str) -> float:
    """'90' or '90s', '10m', '2h', '1d', '1w' -> seconds."""
    match = _AGE.match(text.lower())
    if match is None or match.group(2) not in _AGE_UNITS:
        raise InvalidArgumentError(f"{option} {text!r}: expected an age such as 3600, 30s, 10m, 2h or 1d")
    return float(match.group(1)) * _AGE_UNITS[match.group(2)]


def refuse_for_store(command: str, **given: Any) -> None:
    """A store was given with options only an LMCache cache takes."""
    named = [option for option, value in given.items() if value is not None and value is not False]
    if named:
        raise InvalidArgumentError(
            f"{', '.join(named)}: 'hmem {command}' takes {'them' if len(named) > 1 else 'it'} for an LMCache "
            "cache directory, not for an hmem store"
        )


def refuse_for_cache(command: str, **given: Any) -> None:
    """An LMCache cache was given with options only a store takes."""
    named = [option for option, value in given.items() if value is not None and value is not False]
    if named:
        raise InvalidArgumentError(
            f"{', '.join(named)}: 'hmem {command}' takes {'them' if len(named) > 1 else 'it'} for an hmem store, "
            "not for an LMCache cache directory"
        )


# ---- the three commands -----------------------------------------------------------------


def evict(
    cache: CacheDirectory,
    *,
    max_bytes: str | None,
    by: str | None,
    dry_run: bool,
    yes: bool,
    json_output: bool,
    quiet: bool,
) -> None:
    if max_bytes is None:
        raise InvalidArgumentError("give --max-bytes SIZE: evict deletes the least recently used chunks down to it")
    cap = parse_size(max_bytes, "--max-bytes")
    plan = plan_clean(cache, max_bytes=cap, by=by or "atime")
    _run("evict", cache, plan, dry_run=dry_run, yes=yes, json_output=json_output, quiet=quiet)


def compact(
    cache: CacheDirectory,
    *,
    debris_older_than: str | None,
    restarted_at: str | None,
    tokens: str | None,
    settings: str | None,
    model: str | None,
    chunk_size: int | None,
    dry_run: bool,
    yes: bool,
    json_output: bool,
    quiet: bool,
) -> None:
    age = DEFAULT_DEBRIS_AGE if debris_older_than is None else parse_age(debris_older_than, "--debris-older-than")
    restarted = None if restarted_at is None else parse_time(restarted_at)
    unreachable: tuple[str, ...] = ()
    if tokens is None and (settings is not None or model is not None or chunk_size is not None):
        raise InvalidArgumentError(
            "--settings, --model and --chunk-size describe the deployment of --tokens: give --tokens FILE too"
        )
    if tokens is not None:
        from hmem.lmcache import Deployment, read_requests

        given: dict[str, Any] = {"model": model, "chunk_size": chunk_size, "restarted_at": restarted}
        given = {k: v for k, v in given.items() if v is not None}
        if settings is not None:
            deployment = Deployment.from_file(settings, **given)
        elif "model" in given:
            deployment = Deployment.from_dict(given)
        else:
            raise InvalidArgumentError("give the deployment's model name (--model, or model in --settings)")
        unreachable = unreachable_files(cache, read_requests(tokens), deployment)
    plan = plan_clean(cache, debris_older_than=age, restarted_at=restarted, unreachable=unreachable)
    _run("compact", cache, plan, dry_run=dry_run, yes=yes, json_output=json_output, quiet=quiet)


def rm(
    cache: CacheDirectory,
    names: list[str],
    *,
    model: str | None,
    world_size: int | None,
    rank: int | None,
    tag: str | None,
    kv_dtype: str | None,
    layer: int | None,
    dry_run: bool,
    yes: bool,
    json_output: bool,
    quiet: bool,
) -> None:
    selection = (model, world_size, rank, tag, kv_dtype, layer)
    if not names and all(v is None for v in selection):
        raise InvalidArgumentError(
            "give the files (names or keys) to delete, or select chunks with --model, --world-size, --rank, "
            "--tag, --dtype or --layer"
        )
    plan = plan_clean(
        cache, names=names, model=model, world_size=world_size, rank=rank, tag=tag, kv_dtype=kv_dtype, layer=layer
    )
    _run("rm", cache, plan, dry_run=dry_run, yes=yes, json_output=json_output, quiet=quiet)


# ---- shared -----------------------------------------------------------------------------


def _run(
    command: str, cache: CacheDirectory, plan: CleanPlan, *, dry_run: bool, yes: bool, json_output: bool, quiet: bool
) -> None:
    out = Output(json_mode=json_output, quiet=quiet)
    for name in plan.missing:
        problem(f"no chunk or .tmp file {name!r} in {cache.path}")
    for warning in plan.warnings:
        out.warn(warning)
    _show_plan(out, plan)
    # without --yes, only a person at a terminal can confirm: anyone else gets the dry run
    asking = not dry_run and (yes or sys.stdin.isatty())
    document: dict[str, Any] = {
        "cache": str(cache.path),
        "command": command,
        "dry_run": not asking,
        "plan": plan.to_dict(),
    }
    report: CleanReport | None = None
    with signals.stoppable():  # a signal stops the deletion between batches of files
        if not plan.count:
            out.print("nothing to delete")
        elif not asking:
            hint = "" if dry_run else " (pass --yes to delete)"
            out.print(f"a dry run: nothing deleted{hint}")
        elif confirm_change(f"delete {plan.count} file(s), {human_bytes(plan.bytes)}, from {cache.path}?", yes):
            report = clean(cache, plan, should_stop=signals.requested)
            _show_report(out, report)
        else:
            out.print("nothing deleted")
        document["report"] = report.to_dict() if report is not None else None
        code: int = ExitCode.OK
        if plan.missing:
            code = ExitCode.PARTIAL if plan.count else ExitCode.FAILURE
        if report is not None and report.problems:
            code = ExitCode.PARTIAL
        if signals.requested():
            deleted = len(report.deleted) if report is not None else 0
            code = signals.report_stop(
                document,
                f"deleted {deleted} of the plan's {plan.count} files; the others are as they were",
                deleted=deleted,
            )
        if json_output:
            out.emit_json(document)
    if code:
        raise typer.Exit(code)


def _show_plan(out: Output, plan: CleanPlan) -> None:
    if plan.count:
        table = out.table("name", "reason", ">size")
        for planned in plan.files[:SHOWN]:
            table.add_row(planned.name, planned.reason, human_bytes(planned.size))
        out.print(table)
        if plan.count > SHOWN:
            out.print(f"... and {plan.count - SHOWN} more (--json lists every file)")
        parts = [f"{v['files']} {reason} ({human_bytes(v['bytes'])})" for reason, v in plan.by_reason().items()]
        out.print(f"to delete: {plan.count} file(s), {human_bytes(plan.bytes)}: " + ", ".join(parts))
    out.print(
        f"chunks: {plan.chunks_before} ({human_bytes(plan.chunk_bytes_before)}) -> "
        f"{plan.chunks_after} ({human_bytes(plan.chunk_bytes_after)})"
        + (
            f"; byte cap {human_bytes(plan.max_bytes)}, least recently used by {plan.clock}"
            if plan.max_bytes is not None
            else ""
        )
    )
    if plan.asked.get("debris_older_than") is not None:
        age = human_duration(plan.asked["debris_older_than"])
        out.print(f".tmp files of unfinished writes count as debris once {age} old")


def _show_report(out: Output, report: CleanReport) -> None:
    line = f"deleted {len(report.deleted)} file(s), {human_bytes(report.deleted_bytes)}"
    if report.already_gone:
        line += f"; {len(report.already_gone)} already gone"
    if report.skipped:
        line += f"; {len(report.skipped)} skipped"
    out.print(line)
    for skipped in report.problems[:SHOWN]:
        problem(f"{skipped.name}: {skipped.reason}" + (f" ({skipped.detail})" if skipped.detail else ""))
