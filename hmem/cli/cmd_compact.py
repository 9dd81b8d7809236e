"""``hmem compact``: reclaim the space of evicted entries."""

from __future__ import annotations

from typing import Annotated

import typer

from hmem import InvalidArgumentError, Store
from hmem.cli import signals
from hmem.cli.compact_run import stoppable_compaction
from hmem.cli.options import DryRunOption, JsonOption, LockWaitOption, QuietOption, StoreArgument
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
    dry_run: DryRunOption = False,
    lock_wait: LockWaitOption = 0.0,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Rewrite live entries into packed shards and drop evicted data and orphan files.

    Entry ids and query results do not change; the store never grows.
    """
    out = Output(json_mode=json_output, quiet=quiet)
    if not 0.0 <= threshold <= 100.0:  # the option's range lets NaN through
        raise InvalidArgumentError(f"--threshold must be a percentage between 0 and 100, got {threshold}")
    opened = Store.open(store, read_only=dry_run, lock_wait=lock_wait)  # a signal stops the lock wait at once
    with signals.stoppable():  # a signal stops the rewrite between shards, before its commit
        with opened as s:
            plan = s.plan_compaction()
            share = plan.reclaimable_share * 100
            document = {
                "store": str(store),
                "dry_run": dry_run,
                "threshold_pct": threshold,
                "needed": plan.needed,
                "reclaimable_bytes": plan.reclaimable_bytes,
                "reclaimable_pct": share,
                "shards_before": plan.shards_before,
                "shards_after": plan.shards_after,
                "bytes_before": plan.bytes_before,
                "performed": False,
            }
            if not plan.needed:
                out.print("nothing to do: the store is already compact")
            elif share < threshold:
                out.print(
                    f"nothing to do: compaction would free {human_bytes(plan.reclaimable_bytes)} "
                    f"({share:.1f}%), below the threshold of {threshold:g}%"
                )
            elif dry_run:
                out.print(
                    f"would free about {human_bytes(plan.reclaimable_bytes)} ({share:.1f}%): "
                    f"{plan.shards_before} shards -> {plan.shards_after}, {plan.evicted_records} evicted "
                    f"records and {len(plan.orphan_files)} orphan file(s) dropped"
                )
            else:
                report = stoppable_compaction(s, threshold / 100, out)
                if report is None:
                    out.print("stopped before the commit: the store is as it was")
                else:
                    document.update(
                        performed=report.performed,
                        shards_after=report.shards_after,
                        bytes_after=report.bytes_after,
                        bytes_freed=report.bytes_freed,
                        records_dropped=report.records_dropped,
                        orphans_removed=report.orphans_removed,
                        seconds=report.seconds,
                    )
                    out.print(
                        f"freed {human_bytes(report.bytes_freed)}: {human_bytes(report.bytes_before)} -> "
                        f"{human_bytes(report.bytes_after)}, {report.shards_before} shards -> "
                        f"{report.shards_after}, {report.records_dropped} evicted records dropped, "
                        f"in {human_duration(report.seconds)}"
                    )
        code = 0
        if signals.requested():
            done = "compacted (committed)" if document["performed"] else "stopped before the commit: nothing changed"
            code = signals.report_stop(document, done, performed=document["performed"])
        if json_output:
            out.emit_json(document)
    if code:
        raise typer.Exit(code)
