"""``hmem verify``: check a store, and salvage it with --repair."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from hmem import InvalidArgumentError, is_store_url, repair, verify
from hmem.cli.exit_codes import ExitCode
from hmem.cli.options import (
    ChunkSizeOption,
    JsonOption,
    KVShapeOption,
    LockWaitOption,
    ModelConfigOption,
    QuietOption,
    StoreArgument,
    YesOption,
)
from hmem.cli.output import Output, human_bytes, human_duration, styled
from hmem.cli.prompts import confirm

if TYPE_CHECKING:
    from hmem import RepairReport

STYLE = {"error": "red", "warning": "yellow", "info": "dim"}


def _subset(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise InvalidArgumentError(f"--subset {text!r}: expected k/n such as 1/7") from None
    if not 1 <= k <= n:
        raise InvalidArgumentError(f"--subset {text!r}: k must be between 1 and n")
    return k, n


def _next_step(codes: set[str], full: bool) -> str:
    if "index.stale" in codes:
        return (
            "index.json is older than the store's files: run 'hmem verify --repair' to roll forward "
            "(every intact entry is kept)"
        )
    if codes & {"index.pending", "entries.tail", "file.temp"} and len(codes) == 1:
        return "open the store for writing (any writing command) to finish what was interrupted"
    if codes <= {"file.orphan", "file.temp", "entries.tail", "index.pending", "file.foreign"}:
        return "run 'hmem compact' to remove the leftovers"
    return "run 'hmem verify --repair' to salvage what can be saved" + (
        "" if full else " (and 'hmem verify --full' to check every tensor)"
    )


def verify_command(
    store: StoreArgument,
    full: Annotated[bool, typer.Option("--full", help="Also read every tensor and check its checksum.")] = False,
    subset: Annotated[
        str | None,
        typer.Option(
            "--subset",
            metavar="K/N",
            help="With --full (required), check only shards whose index is K-1 "
            "modulo N (e.g. a nightly cron job with 1/7 .. 7/7).",
        ),
    ] = None,
    max_seconds: Annotated[
        float | None,
        typer.Option(
            "--max-seconds",
            min=0.0,
            help="With --full (required), stop checking tensors after this long; exit 3 if stopped.",
        ),
    ] = None,
    max_findings: Annotated[int, typer.Option("--max-findings", min=1, help="List at most this many findings.")] = 50,
    do_repair: Annotated[
        bool,
        typer.Option(
            "--repair",
            help="Salvage what can be saved: drop records whose data is lost, rebuild index.json and shards.",
        ),
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="With --repair: list what repair would keep, rebuild, drop and move to lost+found/; change nothing.",
        ),
    ] = False,
    rebuild_layer: Annotated[
        int,
        typer.Option(
            "--rebuild-layer",
            min=0,
            max=2**32 - 1,
            help="With --repair: the layer of entries whose records are lost, rebuilt from their shards.",
        ),
    ] = 0,
    rebuild_importance: Annotated[
        float,
        typer.Option(
            "--rebuild-importance",
            min=0.0,
            help="With --repair: the importance of entries rebuilt from their shards.",
        ),
    ] = 1.0,
    yes: YesOption = False,
    lock_wait: LockWaitOption = 0.0,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
    deep: Annotated[
        bool, typer.Option("--deep", help="An LMCache cache: also read every chunk's K/V (as --full does).")
    ] = False,
    kv_shape: KVShapeOption = None,
    model_config: ModelConfigOption = None,
    chunk_size: ChunkSizeOption = 256,
) -> None:
    """Check a store's files and checksums; exit 4 when problems are found.

    The quick check reads index.json, every record and every shard's header
    and index; --full also reads every tensor. Nothing is written unless
    --repair is given (which shows its plan and asks first, or --yes).

    Of an LMCache cache directory: each fs header against its file's size
    and key, each file's size against the K/V shape, names that are no
    chunk, .tmp debris, links and unreadable files; --deep (or --full) also
    reads every chunk for all-zero or non-finite K/V. Exit 4 when a finding
    is an error; nothing is ever written.
    """
    from hmem.cli.lmcache_target import cache_at

    cache = cache_at(store, kv_shape_text=kv_shape, model_config=model_config, chunk_size=chunk_size)
    if cache is not None:
        from hmem.cli import lmcache_verify_view

        if do_repair or dry_run or subset is not None or max_seconds is not None:
            raise InvalidArgumentError(
                "--repair, --dry-run, --subset and --max-seconds are for an hmem store; an LMCache cache is "
                "only checked (its files are LMCache's: nothing is rewritten)"
            )
        lmcache_verify_view.verify(
            cache, deep=deep or full, max_findings=max_findings, json_output=json_output, quiet=quiet
        )
        return
    if deep:
        raise InvalidArgumentError("--deep checks an LMCache cache; a store's full check is --full")
    out = Output(json_mode=json_output, quiet=quiet)
    if not full and (subset is not None or max_seconds is not None):
        raise InvalidArgumentError("--subset and --max-seconds bound the full check: give them with --full")
    rebuild = {"rebuild_layer": rebuild_layer, "rebuild_importance": rebuild_importance}
    if not do_repair and (dry_run or rebuild_layer != 0 or rebuild_importance != 1.0):
        raise InvalidArgumentError("--dry-run, --rebuild-layer and --rebuild-importance go with --repair")
    report = verify(store, full=full or do_repair, subset=_subset(subset), max_seconds=max_seconds)
    document: dict = {"verify": report.to_dict(), "repair": None}
    problems = report.problems
    shown = report.findings[:max_findings]
    if shown and not json_output:
        table = out.table("severity", "code", "file", "problem", "expected")
        for f in shown:
            table.add_row(styled(f.severity, STYLE[f.severity]), f.code, f.file, f.message, f.expected or "")
        out.print(table)
        if len(report.findings) > len(shown):
            out.print(f"... and {len(report.findings) - len(shown)} more findings (--max-findings, --json)")
    depth = "full" if report.full else "quick"
    checked = f"{report.records} records, {report.shards} shards" + (
        f", {report.tensors_checked} tensors ({human_bytes(report.bytes_checked)})" if report.full else ""
    )
    if report.subset is not None:  # the tensors of the other shards were not checked: say so
        k, n = report.subset
        checked += f" in subset {k}/{n} (the shards numbered {k - 1} mod {n})"
    if not problems and not report.complete:
        out.print(
            f"incomplete: the {depth} check stopped after {human_duration(report.seconds)} (--max-seconds) "
            f"having checked {checked}; no problem found so far"
        )
    elif not problems:
        out.print(f"ok: {depth} check of {checked} found no problem in {human_duration(report.seconds)}")
    else:
        errors = sum(f.severity == "error" for f in problems)
        out.print(
            f"{depth} check of {checked}: {errors} error(s), {len(problems) - errors} warning(s); "
            + (
                ("planning the repair" if dry_run else "repairing")
                if do_repair
                else _next_step({f.code for f in problems}, report.full)
            )
        )
    plan = None
    if do_repair and problems and not is_store_url(store):
        plan = repair(store, dry_run=True, **rebuild)  # type: ignore[arg-type]
        _print_plan(out, plan)
        if dry_run:
            document["repair"] = plan.to_dict()
            out.print("nothing written (--dry-run)")
    elif do_repair and dry_run:
        raise InvalidArgumentError(
            "--dry-run plans the repair of a store directory",
            hint="copy the store to a directory with 'hmem copy' to plan its repair",
        )
    if do_repair and problems and not dry_run:
        question = f"rewrite {store} as planned above?" if plan is not None else f"rewrite {store}?"
        if not confirm(question, yes):
            out.print("nothing repaired")
        else:
            fixed = repair(store, lock_wait=lock_wait, **rebuild)  # type: ignore[arg-type]
            document["repair"] = fixed.to_dict()
            lost = len([d for d in fixed.dropped if d[0] is not None])
            if fixed.rolled_forward:
                out.print("index.json was older than the store's files: rolled forward to what they hold")
            if fixed.action == "tidied":
                out.print("repaired: finished what an interrupted writer left and removed its leftovers")
            else:
                out.print(
                    f"repaired: kept {fixed.entries_kept} entries in {fixed.shards_after} shards"
                    + (", rebuilt index.json" if fixed.rebuilt_index else "")
                    + f"; {human_bytes(fixed.bytes_before)} -> {human_bytes(fixed.bytes_after)}"
                )
            for entry_id, why in fixed.dropped:
                out.warn((f"lost entry {entry_id}: " if entry_id is not None else "dropped: ") + why)
            for name, why, count, size in fixed.quarantined:
                out.warn(f"moved to {name}: {why} ({count} entries, {human_bytes(size)}; not served)")
            if fixed.rebuilt_entries:
                out.print(
                    f"{len(fixed.rebuilt_entries)} entries rebuilt from their shards (their records were lost): "
                    + _rebuilt_fields(fixed)
                )
            for note in fixed.notes if plan is None else ():  # else printed with the plan
                out.warn(note)
            after = verify(store, full=True)
            document["after"] = after.to_dict()
            problems = after.problems
            if lost:
                out.print(f"{lost} entries could not be saved (listed above)")
    if json_output:
        out.emit_json(document)
    if problems:
        raise typer.Exit(ExitCode.PROBLEMS_FOUND)
    if not report.complete and document["repair"] is None:
        raise typer.Exit(ExitCode.PARTIAL)


def _print_plan(out: Output, plan: RepairReport) -> None:
    """What a repair would do, before it is asked for (and for --dry-run)."""
    if plan.action == "tidied":
        out.print("repair would finish what an interrupted writer left and remove its leftovers; nothing is dropped")
        return
    lost = [(entry_id, why) for entry_id, why in plan.dropped if entry_id is not None]
    out.print(
        f"repair would keep {plan.entries_kept} entries in {plan.shards_after} shards"
        + (
            f" ({len(plan.rebuilt_entries)} of them rebuilt from their shards, their records being lost: "
            + _rebuilt_fields(plan)
            + "; --rebuild-layer, --rebuild-importance)"
            if plan.rebuilt_entries
            else ""
        )
        + (", rebuild index.json" if plan.rebuilt_index else "")
    )
    if lost or plan.dropped:
        out.print(
            f"repair would drop {len(lost)} entries ({human_bytes(plan.dropped_bytes)} of K/V)"
            + (f" and {len(plan.dropped) - len(lost)} records it cannot name" if len(plan.dropped) > len(lost) else "")
            + ":"
        )
        for entry_id, why in plan.dropped:
            out.print(f"  {'entry ' + str(entry_id) if entry_id is not None else 'record'}: {why}")
    else:
        out.print("repair would drop nothing")
    for name, why, count, size in plan.quarantined:
        out.print(f"repair would move to {name}: {why} ({count} entries, {human_bytes(size)}; not served, not deleted)")
    if plan.sources_dropped:
        out.print(
            f"repair would drop {plan.sources_dropped} lines of the import registry, whose files' entries are lost "
            "(the next 'hmem put' of those files stores them again)"
        )
    for note in plan.notes:
        out.print(f"note: {note}")


def _rebuilt_fields(report: RepairReport) -> str:
    """The layer and importance rebuilt records get."""
    text = f"layer {report.rebuilt_layer}, importance {report.rebuilt_importance:g}"
    kept = len(report.salvaged_fields)
    if kept:
        text += f", but {kept} keep those of their damaged record"
    return text
