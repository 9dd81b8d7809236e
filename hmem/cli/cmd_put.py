"""``hmem put``: import K/V safetensors files."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from hmem import InvalidArgumentError, Store, find_kv_files, import_files, is_store
from hmem.cli.exit_codes import ExitCode
from hmem.cli.options import STORE_ENV, DryRunOption, JsonOption, LockWaitOption, QuietOption
from hmem.cli.output import Output, human_bytes


def _store_and_inputs(paths: list[Path]) -> tuple[Path, list[Path]]:
    """STORE FILES...: the store may be left out when HMEM_STORE names it."""
    env = os.environ.get(STORE_ENV)
    if env and (not paths or not is_store(paths[0])):
        return Path(env), paths
    if len(paths) < 2:
        raise InvalidArgumentError("give the store and at least one file or directory to import",
                                   hint=f"or set {STORE_ENV} and give only the files")
    return paths[0], paths[1:]


def put(
    paths: Annotated[list[Path], typer.Argument(
        metavar="[STORE] FILES...",
        help="The store (may be left out when HMEM_STORE is set), then safetensors files or directories "
        "searched for *.safetensors.", show_default=False)],
    layer: Annotated[int | None, typer.Option("--layer", "-l", min=0,
                                              help="Layer of entries whose tensor names carry none.")] = None,
    importance: Annotated[float | None, typer.Option("--importance", "-i", min=0.0,
                                                     help="Importance of every entry imported.")] = None,
    dry_run: DryRunOption = False,
    lock_wait: LockWaitOption = 0.0,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Import K/V safetensors files; bad files are reported and skipped.

    Each file holds one entry (tensors 'keys'/'values' or 'k'/'v'), one entry
    per layer ('layer.{i}.k'/'layer.{i}.v'), or several entries
    ('k_{n}'/'v_{n}'). The layer comes from such names, else --layer, else
    the file's __metadata__ 'layer', else 0; importance from --importance,
    else __metadata__ 'importance', else 1. F32, F16, BF16 and F64 are read.
    Exits with code 3 when any file was skipped.
    """
    out = Output(json_mode=json_output, quiet=quiet)
    store, inputs = _store_and_inputs(paths)
    files = find_kv_files(inputs)
    if not files:
        raise InvalidArgumentError("no .safetensors files found in " + ", ".join(map(str, inputs)))
    total = sum(p.stat().st_size for p in files if p.is_file())
    started = time.perf_counter()
    with Store.open(store, read_only=dry_run, lock_wait=lock_wait) as s:
        before = s.stats()
        with out.progress("importing", total, bytes_mode=True) as bar:
            report = import_files(s, files, layer=layer, importance=importance, dry_run=dry_run,
                                  progress=lambda result: bar.advance(result.bytes))
        if not dry_run:
            s.flush()
        after = s.stats()
    seconds = time.perf_counter() - started
    summary: dict[str, Any] = {
        "store": str(store),
        "dry_run": dry_run,
        "files": len(report.files),
        "files_imported": len(report.files) - len(report.skipped),
        "files_skipped": len(report.skipped),
        "entries_added": report.entries_added,
        "entries_found": report.entries_found,
        "bytes_read": report.bytes_read,
        "bytes_written": after.bytes_on_disk - before.bytes_on_disk,
        "shards_created": len(after.shards) - len(before.shards),
        "seconds": seconds,
        "skipped": [{"file": f.path, "reason": f.skipped} for f in report.skipped],
    }
    if json_output:
        out.emit_json(summary)
    else:
        verb = "would add" if dry_run else "added"
        found = report.entries_found if dry_run else report.entries_added
        out.print(f"{verb} {found} entries from {summary['files_imported']} of {len(report.files)} files "
                  f"({human_bytes(report.bytes_read)} read in {seconds:.1f} s"
                  + (f", {human_bytes(report.bytes_read / seconds)}/s)" if seconds > 0 else ")"))
        if not dry_run:
            out.print(f"wrote {human_bytes(max(0, summary['bytes_written']))}, "
                      f"{summary['shards_created']} new shard(s); the store holds {after.entries} entries")
        if report.skipped:
            table = out.table("skipped file", "reason")
            for f in report.skipped:
                table.add_row(f.path, f.skipped)
            out.print(table)
    if report.skipped:
        raise typer.Exit(ExitCode.PARTIAL)
