"""What ``hmem put`` prints: the summary (text or the JSON document), and
what a run that a signal stopped committed (docs/cli.md, "Interrupts")."""

from __future__ import annotations

from typing import Any

from hmem import FileResult, ImportReport, StoreStats
from hmem.cli import signals
from hmem.cli.exit_codes import ExitCode, cli_hint
from hmem.cli.ids import id_ranges
from hmem.cli.notes import problem
from hmem.cli.output import Output, human_bytes, literal

FILES_SHOWN = 20  # files listed with their ids in the human summary


def report(
    out: Output, store: str, dry_run: bool, result: ImportReport, before: StoreStats, after: StoreStats, seconds: float
) -> int:
    """Print the summary of an import; returns the exit code: 0 when every
    file went in (or was in already), 3 (partial) when some were skipped,
    1 when all were."""
    evicted = after.limits.evicted - before.limits.evicted
    rewritten = after.limits.bytes_rewritten - before.limits.bytes_rewritten
    imported = [f for f in result.files if f.skipped is None and f.imported_before is None]
    already = result.already_imported
    summary: dict[str, Any] = {
        "store": str(store),
        "dry_run": dry_run,
        "files": len(result.files) + len(result.not_started),
        "files_imported": len(imported),
        "files_skipped": len(result.skipped),
        "files_already_imported": len(already),
        "entries_added": result.entries_added,
        "entries_found": result.entries_found,
        "entries_evicted": evicted,
        "compactions": after.limits.compactions - before.limits.compactions,
        "bytes_rewritten": rewritten,
        "bytes_freed_by_compaction": after.limits.bytes_freed - before.limits.bytes_freed,
        "bytes_read": result.bytes_read,
        "bytes_written": after.bytes_on_disk - before.bytes_on_disk,
        "shards_created": len(after.shards) - len(before.shards),
        "seconds": seconds,
        "imported": [{"file": f.path, "entries": f.planned, "entry_ids": list(f.entries)} for f in imported],
        "skipped": [{"file": f.path, "reason": skip_reason(f)} for f in result.skipped],
        "already_imported": [
            {
                "file": f.path,
                "sha256": f.sha256,
                "imported_as": f.imported_before.name,
                "imported": f.imported_before.imported,
                "entry_ids": list(f.imported_before.entry_ids),
            }
            for f in already
            if f.imported_before is not None
        ],
    }
    for f in result.skipped:  # on stderr, also under --quiet and --json: a script must learn why
        problem(f"skipped {f.path}: {skip_reason(f)}")
    code: int = ExitCode.OK
    if result.skipped:
        code = ExitCode.FAILURE if len(result.skipped) == len(result.files) else ExitCode.PARTIAL
    if signals.requested():
        code = _stopped(summary, result, after)
    if out.json_mode:
        out.emit_json(summary)
        return code
    verb = "would add" if dry_run else "added"
    found = result.entries_found if dry_run else result.entries_added
    rate = f", {human_bytes(result.bytes_read / seconds)}/s" if seconds > 0 else ""
    out.print(
        literal(
            f"{verb} {found} entries from {len(imported)} of {summary['files']} files "
            f"{'to' if dry_run else 'into'} {store} ({human_bytes(result.bytes_read)} read in {seconds:.1f} s"
            f"{rate})"
        )
    )
    for f in imported[:FILES_SHOWN]:
        ids = id_ranges(f.entries) if not dry_run else f"{f.planned} entries"
        out.print(literal(f"  {f.path}: {'ids ' if not dry_run else ''}{ids}"))
    if len(imported) > FILES_SHOWN:
        out.print(literal(f"  and {len(imported) - FILES_SHOWN} more files (--json lists every id)"))
    if already:
        names = ", ".join(f.path for f in already[:3]) + (f" and {len(already) - 3} more" if len(already) > 3 else "")
        out.print(literal(f"already imported, not imported again: {names} (--again imports them anyway)"))
    if evicted:
        limit = ", ".join(
            name
            for name, value in (
                ("max_entries", after.config.max_entries),
                ("max_disk_bytes", after.config.max_disk_bytes),
            )
            if value
        )
        freed = after.limits.bytes_freed - before.limits.bytes_freed
        compacted = (
            f"; compacted, rewriting {human_bytes(rewritten)} to free {human_bytes(freed)}"
            if summary["compactions"]
            else "; run 'hmem compact' to free their bytes"
        )
        # The new entries always stay (docs/format.md, "Disk usage and limits"): the
        # evicted ones are the lowest-scored of those stored before, whatever the
        # new entries' scores, so the line says that and not "lower-scored".
        out.print(
            literal(
                f"evicted {evicted} stored entries (lowest score first) to make room for the new "
                f"entries under {limit}{compacted}"
            )
        )
    if not dry_run:
        change = summary["bytes_written"]
        out.print(
            literal(
                f"{'grew' if change >= 0 else 'shrank'} by {human_bytes(abs(change))} on disk "
                f"({summary['shards_created']} new shard(s)); the store holds {after.entries} entries"
            )
        )
    return code


def skip_reason(f: FileResult) -> str:
    """Why a file was skipped and, when there is one, what to do, as the
    command line words it (an ambiguous layout: the --layout to give)."""
    if f.layouts:
        hint: str | None = "give " + " or ".join(f"--layout {x}" for x in f.layouts)
    else:
        hint = cli_hint(f.hint)
    return (f.skipped or "") + (f" ({hint})" if hint else "")


def _stopped(summary: dict[str, Any], result: ImportReport, after: StoreStats) -> int:
    """A signal stopped the import between files: every file before the
    first one not started went in whole (or was skipped) and is committed."""
    committed = 0 if summary["dry_run"] else result.entries_added
    first = result.not_started[0] if result.not_started else None
    what = (
        f"committed {committed} entries from {len(result.files)} finished file(s)"
        + (
            f"; not imported: {first} and {len(result.not_started) - 1} file(s) after it"
            if first
            else "; every file was finished"
        )
        + f"; the store holds {after.entries} entries"
    )
    return signals.report_stop(
        summary,
        what,
        entries_committed=committed,
        files_finished=len(result.files),
        files_not_started=len(result.not_started),
        first_file_not_finished=first,
        store_entries=after.entries,
    )


def report_not_started(out: Output, store: str, dry_run: bool, files: list[Any]) -> int:
    """A signal stopped ``hmem put`` before it imported anything (while it
    opened the store or waited for its lock): nothing was committed, which
    the line on stderr and the JSON document (``entries_committed`` 0) say."""
    summary: dict[str, Any] = {
        "store": str(store),
        "dry_run": dry_run,
        "files": len(files),
        "files_imported": 0,
        "files_skipped": 0,
        "files_already_imported": 0,
        "entries_added": 0,
        "entries_found": 0,
    }
    code = signals.report_stop(
        summary,
        f"nothing was committed: stopped before the import began ({len(files)} file(s) not imported)",
        entries_committed=0,
        files_finished=0,
        files_not_started=len(files),
        first_file_not_finished=str(files[0]) if files else None,
    )
    if out.json_mode:
        out.emit_json(summary)
    return code
