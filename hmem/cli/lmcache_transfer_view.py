"""What ``hmem put`` and ``hmem export`` do and print for LMCache caches
(docs/lmcache.md, "Import and export"): a cache's chunks into a store, a
cache's chunks to a safetensors file or an fs connector cache, and a
store's chunks imported from LMCache back to an fs connector cache.  The
work is hmem/lmcache/importing.py's and exporting.py's; this formats it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from hmem import InvalidArgumentError, Store, is_store_url
from hmem.cli import signals
from hmem.cli.exit_codes import ExitCode, cli_hint
from hmem.cli.ids import id_ranges
from hmem.cli.lmcache_target import kv_shape
from hmem.cli.notes import problem
from hmem.cli.output import Output, human_bytes, literal
from hmem.lmcache import (
    SAFETENSORS_LAYOUTS,
    CacheDirectory,
    CacheImportReport,
    FsExportReport,
    export_fs_cache,
    export_safetensors,
    import_cache,
    is_cache,
    none_hash_of_seed,
    open_cache,
    read_requests,
)

SHOWN = 20  # chunk files listed in the human summary


def any_cache(inputs: list[str]) -> bool:
    """Whether one of `put`'s inputs is an LMCache cache directory."""
    return any("://" not in p and is_cache(p) for p in inputs)


def _code(problems: int, total: int) -> int:
    if not problems:
        return ExitCode.OK
    return ExitCode.FAILURE if problems >= total else ExitCode.PARTIAL


# ---- hmem put STORE CACHE... --------------------------------------------------------------


def put_caches(
    out: Output,
    store: str,
    inputs: list[str],
    *,
    kv_shape_text: str | None,
    model_config: str | None,
    chunk_size: int,
    tokens: str | None = None,
    hash_seed: str | None = None,
    none_hash: int | None = None,
    importance: float | None,
    again: bool,
    dry_run: bool,
    lock_wait: float,
) -> int:
    """Import each LMCache cache of `inputs` into `store`; the exit code."""
    shape = kv_shape(kv_shape_text, model_config)
    if tokens is None and (hash_seed is not None or none_hash is not None):
        raise InvalidArgumentError("--hash-seed and --none-hash apply with --tokens FILE")
    if hash_seed is not None and none_hash is not None:
        raise InvalidArgumentError("give --hash-seed or --none-hash, not both")
    requests = [r.tokens for r in read_requests(tokens)] if tokens is not None else None
    start_hash = none_hash_of_seed(hash_seed) if hash_seed is not None else (none_hash or 0)
    caches: list[CacheDirectory] = []
    root = None if is_store_url(store) else Path(store).resolve()
    for path in inputs:
        if "://" in path or not is_cache(path):
            raise InvalidArgumentError(
                f"{path} is not an LMCache cache directory",
                hint="import LMCache caches and safetensors files with separate 'hmem put' runs",
            )
        if root is not None and (root == Path(path).resolve() or root in Path(path).resolve().parents):
            raise InvalidArgumentError(f"{path} lies inside the store {store}: a store never imports its own files")
        caches.append(open_cache(path, kv_shape=shape, chunk_size=chunk_size))
    started = time.perf_counter()
    reports: list[CacheImportReport] = []
    total = sum(int(cache.listing.size[cache.select()].sum()) for cache in caches)
    with signals.stoppable():  # a signal stops between chunk files, every one before it whole
        with Store.open(store, read_only=dry_run, lock_wait=lock_wait) as s:
            with out.progress("importing", total, bytes_mode=True) as bar:
                for cache in caches:
                    if signals.requested():
                        break
                    reports.append(
                        import_cache(
                            s,
                            cache,
                            importance=1.0 if importance is None else importance,
                            requests=requests,
                            none_hash=start_hash,
                            again=again,
                            dry_run=dry_run,
                            progress=lambda result: bar.advance(result.bytes),
                            should_stop=signals.requested,
                        )
                    )
            if not dry_run:
                s.flush()
            entries_after = s.stats().entries
    code = _put_summary(out, store, dry_run, reports, entries_after, time.perf_counter() - started)
    found = [c for r in reports for c in r.chunks if c.skipped is None and c.imported_before is None]
    if requests is not None and found and not any(c.request_tokens for c in found):
        out.warn(
            "no chunk imported is one of the --tokens requests' chunks: their hashes differ "
            "(check --chunk-size, and --hash-seed or --none-hash for a vLLM deployment)"
        )
    return code


def _put_summary(
    out: Output, store: str, dry_run: bool, reports: list[CacheImportReport], entries: int, seconds: float
) -> int:
    files = [c for r in reports for c in r.chunks]
    imported = [c for r in reports for c in r.imported]
    skipped = [c for r in reports for c in r.skipped]
    already = [c for r in reports for c in r.already_imported]
    not_started = [n for r in reports for n in r.not_started]
    summary: dict[str, Any] = {
        "store": str(store),
        "dry_run": dry_run,
        "caches": [r.cache for r in reports],
        "chunks": len(files) + len(not_started),
        "chunks_imported": len(imported),
        "chunks_skipped": len(skipped),
        "chunks_already_imported": len(already),
        "entries_added": sum(r.entries_added for r in reports),
        "entries_found": sum(r.entries_found for r in reports),
        "bytes_read": sum(r.bytes_read for r in reports),
        "seconds": seconds,
        "entries": entries,
        "chunks_located": sum(r.located for r in reports),
        "imported": [
            {
                "file": c.name,
                "key": c.key,
                "entries": c.planned,
                "entry_ids": list(c.entries),
                "request_tokens": list(c.request_tokens) if c.request_tokens else None,
            }
            for c in imported
        ],
        "skipped": [{"file": c.name, "key": c.key, "reason": _reason(c.skipped, c.hint)} for c in skipped],
        "already_imported": [
            {"file": c.name, "key": c.key, "sha256": c.sha256, "entry_ids": list(c.imported_before.entry_ids)}
            for c in already
            if c.imported_before is not None
        ],
        "not_started": not_started,
    }
    for c in skipped:  # on stderr, also under --json: a script must learn why
        problem(f"skipped {c.name}: {_reason(c.skipped, c.hint)}")
    code = _code(len(skipped), len(files))
    if signals.requested():
        committed = 0 if dry_run else summary["entries_added"]
        code = signals.report_stop(
            summary,
            f"committed {committed} entries from {len(files)} finished chunk file(s); "
            f"{len(not_started)} not imported; the store holds {entries} entries",
            entries_committed=committed,
            files_finished=len(files),
            files_not_started=len(not_started),
            store_entries=entries,
        )
    if out.json_mode:
        out.emit_json(summary)
        return code
    verb = "would add" if dry_run else "added"
    found = summary["entries_found"] if dry_run else summary["entries_added"]
    out.print(
        literal(
            f"{verb} {found} entries from {len(imported)} of {summary['chunks']} chunk files of "
            f"{', '.join(summary['caches'])} {'to' if dry_run else 'into'} {store} "
            f"({human_bytes(summary['bytes_read'])} read in {seconds:.1f} s)"
        ),
        soft_wrap=True,
    )
    for c in imported[:SHOWN]:
        ids = f"ids {id_ranges(c.entries)}" if not dry_run else f"{c.planned} entries"
        out.print(literal(f"  {c.key}: {ids}"), soft_wrap=True)
    if len(imported) > SHOWN:
        out.print(literal(f"  and {len(imported) - SHOWN} more chunk files (--json lists every id)"))
    if already:
        names = ", ".join(c.name for c in already[:3]) + (f" and {len(already) - 3} more" if len(already) > 3 else "")
        out.print(literal(f"already imported, not imported again: {names} (--again imports them anyway)"))
    if not_started:
        out.warn(f"stopped: {len(not_started)} chunk files not imported (run the same command again)")
    if not dry_run:
        out.print(literal(f"the store holds {entries} entries"))
    return code


def _reason(message: str | None, hint: str | None) -> str:
    wording = cli_hint(hint)
    return (message or "") + (f" ({wording})" if wording else "")


# ---- hmem export CACHE [CHUNK...] (-o FILE | --to-fs DIR) ---------------------------------


def export_cache(
    out: Output,
    cache: CacheDirectory,
    chunks: list[str],
    *,
    output: str | None,
    to_fs: str | None,
    layout: str | None,
    model_name: str | None,
    force: bool,
    dry_run: bool,
) -> int:
    """Export chunks of a cache (given by file name or key; all by
    default) to a safetensors file or an fs connector cache."""
    if (output is None) == (to_fs is None):
        raise InvalidArgumentError(
            "give --output FILE (a safetensors file) or --to-fs DIR (an LMCache fs connector cache)"
        )
    rows = np.array([cache.row_of(c) for c in chunks], dtype=np.int64) if chunks else None
    if output is not None:
        if force or dry_run:
            raise InvalidArgumentError("--force and --dry-run apply to --to-fs")
        layout = layout or "split"
        if layout not in SAFETENSORS_LAYOUTS:
            raise InvalidArgumentError(f"--layout must be one of {', '.join(SAFETENSORS_LAYOUTS)}, got {layout!r}")
        result = export_safetensors(cache, output, rows, layout=layout, model=model_name)
        for name, why in result.skipped:
            problem(f"skipped {name}: {why}")
        code = _code(len(result.skipped), len(result.skipped) + len(result.chunks))
        if out.json_mode:
            out.emit_json({"cache": str(cache.path), **result.to_dict()})
            return code
        what = (
            f"{result.entries} entries (one per layer per chunk; 'hmem put' imports them)"
            if layout == "split"
            else "each chunk in its own layout"
        )
        out.print(
            literal(
                f"exported {len(result.chunks)} chunks of {cache.path} to {output} "
                f"({human_bytes(result.bytes)}): {what}"
            ),
            soft_wrap=True,
        )
        return code
    if layout is not None:
        raise InvalidArgumentError("--layout applies to a safetensors --output file")
    assert to_fs is not None
    report = export_fs_cache(cache, to_fs, rows=rows, model=model_name, force=force, dry_run=dry_run)
    return _fs_summary(out, report)


# ---- hmem export STORE [ID...] --to-fs DIR ------------------------------------------------


def export_store_to_fs(
    out: Output, store: str, ids: list[int], *, to_fs: str, model_name: str | None, force: bool, dry_run: bool
) -> int:
    """Write the chunks the store's entries were imported from (those of
    `ids`, or all) as an fs connector cache."""
    with Store.open(store, read_only=True) as s:
        report = export_fs_cache(s, to_fs, entry_ids=ids or None, model=model_name, force=force, dry_run=dry_run)
    if not report.files:
        raise InvalidArgumentError(
            f"the store at {store} holds no entries imported from an LMCache cache",
            hint="import a cache first: hmem put STORE CACHE_DIR",
        )
    return _fs_summary(out, report)


def _fs_summary(out: Output, report: FsExportReport) -> int:
    for f in report.problems:
        problem(f"{f.status} {f.name or f.source}: {f.reason}")
    for note in report.notes:
        out.warn(note + (": give --model-name NAME, the name it serves" if note.startswith("local_disk") else ""))
    inexact = [f for f in report.files if f.status in ("written", "replaced", "unchanged") and not f.exact]
    if inexact:
        out.warn(
            f"{len(inexact)} chunks were held by the store with loss (its storage dtype is not the chunk's): "
            "LMCache reads them, not bit-exact"
        )
    code = _code(len(report.problems), len(report.files))
    if out.json_mode:
        out.emit_json(report.to_dict())
        return code
    verb = "would write" if report.dry_run else "wrote"
    done = report.count("written") + report.count("replaced")
    parts = [f"{verb} {done} chunk files to {report.destination} ({human_bytes(report.bytes_written)})"]
    for status, words in (("replaced", "replaced"), ("unchanged", "already there"), ("refused", "refused")):
        if report.count(status):
            parts.append(f"{report.count(status)} {words}")
    if report.count("skipped"):
        parts.append(f"{report.count('skipped')} skipped")
    out.print(literal(", ".join(parts) + f"; from {report.source}"), soft_wrap=True)
    if report.count("refused"):
        out.print(literal("a refused file differs from the chunk of that name: --force replaces it"))
    return code
