"""What ``hmem put`` prints: the summary (text or the JSON document), and
what a run that a signal stopped committed (docs/cli.md, "Interrupts")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.text import Text

from hmem import FileResult, ImportReport, StoreStats
from hmem.cli import signals
from hmem.cli.exit_codes import ExitCode, cli_hint
from hmem.cli.output import Output, human_bytes


def report(out: Output, store: Path, dry_run: bool, result: ImportReport, before: StoreStats, after: StoreStats,
           seconds: float) -> int:
    """Print the summary of an import; returns the exit code (0 when all went in)."""
    summary: dict[str, Any] = {
        "store": str(store),
        "dry_run": dry_run,
        "files": len(result.files) + len(result.not_started),
        "files_imported": len(result.files) - len(result.skipped),
        "files_skipped": len(result.skipped),
        "entries_added": result.entries_added,
        "entries_found": result.entries_found,
        "bytes_read": result.bytes_read,
        "bytes_written": after.bytes_on_disk - before.bytes_on_disk,
        "shards_created": len(after.shards) - len(before.shards),
        "seconds": seconds,
        "skipped": [{"file": f.path, "reason": skip_reason(f)} for f in result.skipped],
    }
    code: int = ExitCode.PARTIAL if result.skipped else ExitCode.OK
    if signals.requested():
        code = _stopped(summary, result, after)
    if out.json_mode:
        out.emit_json(summary)
        return code
    verb = "would add" if dry_run else "added"
    found = result.entries_found if dry_run else result.entries_added
    out.print(f"{verb} {found} entries from {summary['files_imported']} of {summary['files']} files "
              f"({human_bytes(result.bytes_read)} read in {seconds:.1f} s"
              + (f", {human_bytes(result.bytes_read / seconds)}/s)" if seconds > 0 else ")"))
    if not dry_run:
        out.print(f"wrote {human_bytes(max(0, summary['bytes_written']))}, "
                  f"{summary['shards_created']} new shard(s); the store holds {after.entries} entries")
    if result.skipped:
        table = out.table("skipped file", "reason")
        for f in result.skipped:
            table.add_row(Text(f.path), Text(skip_reason(f)))  # as text: a reason's [shape] is no markup
        out.print(table)
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
    what = (f"committed {committed} entries from {len(result.files)} finished file(s)"
            + (f"; not imported: {first} and {len(result.not_started) - 1} file(s) after it" if first else
               "; every file was finished")
            + f"; the store holds {after.entries} entries")
    return signals.report_stop(summary, what, entries_committed=committed, files_finished=len(result.files),
                               files_not_started=len(result.not_started), first_file_not_finished=first,
                               store_entries=after.entries)
