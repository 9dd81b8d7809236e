"""``hmem compact``: free the bytes of evicted entries, shard by shard, and report what was removed."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from hmem import MIN_DEAD_SHARE, InvalidArgumentError, Store
from hmem.cli import lmcache_clean_view, signals
from hmem.cli.compact_run import stoppable_compaction
from hmem.cli.lmcache_target import cache_at
from hmem.cli.options import DryRunOption, JsonOption, LockWaitOption, QuietOption, StoreArgument, YesOption
from hmem.cli.output import Output, human_bytes, human_duration


def compact(
    store: StoreArgument,
    threshold: Annotated[
        float,
        typer.Option(
            "--threshold",
            min=0.0,
            max=100.0,
            metavar="PCT",
            help="Do nothing unless at least PCT% of the bytes on disk would be freed (for cron jobs).",
        ),
    ] = 0.0,
    min_dead: Annotated[
        float,
        typer.Option(
            "--min-dead",
            min=0.0,
            max=100.0,
            metavar="PCT",
            help="Rewrite a shard only once PCT% of its bytes are evicted entries' (rewriting at most "
            "(100 - PCT) / PCT bytes per byte freed); evicted records go once they are PCT% of the records.",
        ),
    ] = MIN_DEAD_SHARE * 100,
    repack: Annotated[
        bool,
        typer.Option(
            "--repack",
            help="Rewrite every live entry into shards packed from 0 (merges small shards; needs free space "
            "for a copy of the live data).",
        ),
    ] = False,
    debris_older_than: Annotated[
        str | None,
        typer.Option(
            "--debris-older-than",
            metavar="AGE",
            help="An LMCache cache: delete the .tmp files of fs writes never finished once older than AGE "
            "(such as 30m, 2h, 1d; default 1h).",
            show_default=False,
        ),
    ] = None,
    restarted_at: Annotated[
        str | None,
        typer.Option(
            "--restarted-at",
            metavar="TIME",
            help="An LMCache cache: when LMCache last started (unix time or 2026-12-04T07:00:00Z): delete the "
            "local_disk files written before it, which it never reads.",
            show_default=False,
        ),
    ] = None,
    tokens: Annotated[
        str | None,
        typer.Option(
            "--tokens",
            metavar="FILE",
            help="An LMCache cache: requests' token ids (JSON, as for prefix-hit): delete the chunks stored after "
            "a hole in their prefixes, which no lookup reaches (with --model or --settings).",
            show_default=False,
        ),
    ] = None,
    settings: Annotated[
        str | None,
        typer.Option(
            "--settings",
            metavar="FILE",
            help="An LMCache cache: the deployment's settings for --tokens (JSON, as for prefix-hit).",
            show_default=False,
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model", help="An LMCache cache: the model name vLLM was given, for --tokens.", show_default=False
        ),
    ] = None,
    chunk_size: Annotated[
        int | None,
        typer.Option(
            "--chunk-size",
            min=1,
            help="An LMCache cache: the deployment's chunk size, for --tokens.",
            show_default=False,
        ),
    ] = None,
    yes: YesOption = False,
    dry_run: DryRunOption = False,
    lock_wait: LockWaitOption = 0.0,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Free the bytes of evicted entries, shard by shard, and remove orphan files.

    Only shards with at least --min-dead % evicted bytes are touched, one
    commit each: the extra disk needed is one shard. Entry ids and query
    results do not change; the store never grows.

    On an LMCache cache directory: deletes .tmp debris older than
    --debris-older-than, local_disk files written before --restarted-at,
    and with --tokens (and --model or --settings) the chunks stored after a hole. The
    plan is shown first; nothing is deleted unless confirmed (--yes, or a
    yes at the terminal).
    """
    cache = cache_at(store)
    if cache is not None:  # an LMCache cache directory: debris, stale and unreachable files
        lmcache_clean_view.refuse_for_cache("compact", **{"--repack": repack})
        lmcache_clean_view.compact(
            cache,
            debris_older_than=debris_older_than,
            restarted_at=restarted_at,
            tokens=tokens,
            settings=settings,
            model=model,
            chunk_size=chunk_size,
            dry_run=dry_run,
            yes=yes,
            json_output=json_output,
            quiet=quiet,
        )
        return
    lmcache_clean_view.refuse_for_store(
        "compact",
        **{
            "--debris-older-than": debris_older_than,
            "--restarted-at": restarted_at,
            "--tokens": tokens,
            "--settings": settings,
            "--model": model,
            "--chunk-size": chunk_size,
            "--yes": yes,
        },
    )
    out = Output(json_mode=json_output, quiet=quiet)
    for option, value in (("--threshold", threshold), ("--min-dead", min_dead)):
        if not 0.0 <= value <= 100.0:  # the option's range lets NaN through
            raise InvalidArgumentError(f"{option} must be a percentage between 0 and 100, got {value}")
    opened = Store.open(store, read_only=dry_run, lock_wait=lock_wait)  # a signal stops the lock wait at once
    with signals.stoppable():  # a signal stops the rewrite between shards, before the commit of the shard at hand
        with opened as s:
            plan = s.plan_compaction(min_dead_share=min_dead / 100, repack=repack)
            share = plan.reclaimable_share * 100
            document: dict[str, Any] = {
                "store": str(store),
                "dry_run": dry_run,
                "threshold_pct": threshold,
                "min_dead_pct": min_dead,
                "repack": repack,
                "removed_at_open": {"files": plan.removed_at_open_files, "bytes": plan.removed_at_open_bytes},
                "needed": plan.needed,
                "reclaimable_bytes": plan.reclaimable_bytes,
                "reclaimable_pct": share,
                "rewrite_bytes": plan.rewrite_bytes,
                "dead_bytes_left": plan.dead_bytes_left,
                "shards_before": plan.shards_before,
                "shards_after": plan.shards_after,
                "bytes_before": plan.bytes_before,
                "performed": False,
            }
            if plan.removed_at_open_files:
                # leftovers of an interrupted writer, removed by this command's open of the store
                out.print(
                    f"removed {plan.removed_at_open_files} leftover file(s) of an interrupted writer "
                    f"({human_bytes(plan.removed_at_open_bytes)}) on opening the store"
                )
            nothing = "nothing more to do" if plan.removed_at_open_files else "nothing to do"
            if not plan.needed:
                if plan.dead_bytes_left:
                    out.print(f"{nothing}: no shard has {min_dead:g}% of its bytes evicted")
                    out.print(
                        f"{human_bytes(plan.dead_bytes_left)} of evicted data stay until one has "
                        "(--min-dead 0 frees them now)"
                    )
                else:
                    out.print(f"{nothing}: the store is already compact")
            elif share < threshold:
                out.print(
                    f"{nothing}: compaction would free {human_bytes(plan.reclaimable_bytes)} "
                    f"({share:.1f}%), below the threshold of {threshold:g}%"
                )
            elif dry_run:
                out.print(
                    f"would free about {human_bytes(plan.reclaimable_bytes)} ({share:.1f}%) rewriting "
                    f"{human_bytes(plan.rewrite_bytes)}: {plan.shards_before} shards -> {plan.shards_after}, "
                    f"{plan.evicted_records} evicted records"
                    + (f", {len(plan.orphan_files)} orphan file(s)" if plan.orphan_files else "")
                )
            else:
                size_before = s.size()
                report = stoppable_compaction(s, threshold / 100, out, min_dead_share=min_dead / 100, repack=repack)
                if report is None:
                    # the shards committed before the stop stay compacted; the one at hand is as it was
                    freed = max(0, size_before - s.size())
                    document.update(bytes_freed=freed)
                    out.print(f"stopped before the commit of the shard at hand: freed {human_bytes(freed)} so far")
                else:
                    document.update(
                        performed=report.performed,
                        shards_after=report.shards_after,
                        bytes_after=report.bytes_after,
                        bytes_freed=report.bytes_freed,
                        bytes_rewritten=report.bytes_rewritten,
                        records_dropped=report.records_dropped,
                        orphans_removed=report.orphans_removed,
                        orphan_bytes_removed=report.orphan_bytes_removed,
                        seconds=report.seconds,
                    )
                    removed = human_bytes(report.orphan_bytes_removed)
                    orphans = (
                        f", {report.orphans_removed} orphan file(s) ({removed}) removed"
                        if report.orphans_removed
                        else ""
                    )
                    out.print(
                        f"freed {human_bytes(report.bytes_freed)} rewriting {human_bytes(report.bytes_rewritten)}: "
                        f"{human_bytes(report.bytes_before)} -> {human_bytes(report.bytes_after)}, "
                        f"{report.shards_before} shards -> {report.shards_after}"
                    )
                    took = human_duration(report.seconds)
                    out.print(f"{report.records_dropped} evicted records dropped{orphans}, in {took}")
        code = 0
        if signals.requested():
            done = (
                "compacted (committed)"
                if document["performed"]
                else "stopped before the commit of the shard at hand (shards committed before it stay compacted)"
            )
            code = signals.report_stop(document, done, performed=document["performed"])
        if json_output:
            out.emit_json(document)
    if code:
        raise typer.Exit(code)
