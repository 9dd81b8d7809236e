"""``hmem evict``: remove the lowest-scored entries."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from hmem import InvalidArgumentError, Store
from hmem.cli import lmcache_clean_view, signals
from hmem.cli.compact_run import compact_advice
from hmem.cli.lmcache_target import cache_at
from hmem.cli.options import DryRunOption, JsonOption, LockWaitOption, QuietOption, StoreArgument, YesOption
from hmem.cli.output import Output, human_bytes
from hmem.cli.prompts import confirm_change


def evict(
    store: StoreArgument,
    target: Annotated[
        int | None, typer.Option("--target", "-n", min=0, help="Keep at most this many live entries.")
    ] = None,
    keep: Annotated[
        float | None, typer.Option("--keep", min=0.0, max=1.0, help="Keep this share of the live entries (0-1).")
    ] = None,
    max_bytes: Annotated[
        str | None,
        typer.Option(
            "--max-bytes",
            metavar="SIZE",
            help="An LMCache cache: delete the least recently used chunks until the chunks take at most SIZE "
            "(such as 10GiB).",
            show_default=False,
        ),
    ] = None,
    by: Annotated[
        str | None,
        typer.Option(
            "--by",
            metavar="atime|mtime",
            help="An LMCache cache: read least recent use from the files' atime (default; see docs/lmcache.md "
            "on noatime mounts) or mtime (when LMCache wrote them).",
            show_default=False,
        ),
    ] = None,
    dry_run: DryRunOption = False,
    yes: YesOption = False,
    lock_wait: LockWaitOption = 0.0,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Evict the lowest-scored entries: score = importance x (1 + ln(1 + accesses)).

    Ties go to the older entry, then the lower id. Their bytes are freed by
    the next 'hmem compact'.

    On an LMCache cache directory: --max-bytes SIZE deletes its least
    recently used chunk files (--by atime or mtime) until the chunks take at
    most SIZE. The plan is shown first; nothing is deleted unless confirmed
    (--yes, or a yes at the terminal).
    """
    cache = cache_at(store)
    if cache is not None:  # an LMCache cache directory: a byte cap by least recent use
        lmcache_clean_view.refuse_for_cache("evict", **{"--target": target, "--keep": keep})
        lmcache_clean_view.evict(
            cache, max_bytes=max_bytes, by=by, dry_run=dry_run, yes=yes, json_output=json_output, quiet=quiet
        )
        return
    lmcache_clean_view.refuse_for_store("evict", **{"--max-bytes": max_bytes, "--by": by})
    out = Output(json_mode=json_output, quiet=quiet)
    if (target is None) == (keep is None):
        raise InvalidArgumentError("give exactly one of --target N or --keep SHARE")
    if keep is not None and not 0.0 <= keep <= 1.0:  # the option's range lets NaN through
        raise InvalidArgumentError(f"--keep must be a share between 0 and 1, got {keep}")
    opened = Store.open(store, read_only=dry_run, lock_wait=lock_wait)  # a signal stops the lock wait at once
    with signals.stoppable():  # a signal lets the eviction finish, or stops before it (hmem/cli/signals.py)
        with opened as s:
            live = s.stats().entries
            goal = target if target is not None else int(live * (keep or 0.0))
            plan = s.plan_eviction(goal)
            document: dict[str, Any] = {
                "store": str(store),
                "target_entries": goal,
                "entries_before": plan.entries_before,
                "evict": plan.count,
                "entry_ids": list(plan.entry_ids),
                "bytes_reclaimable": plan.bytes_reclaimable,
                "lowest_score": plan.lowest_score,
                "dry_run": dry_run,
                "evicted": 0,
            }
            if not plan.count:
                out.print(f"nothing to evict: {live} entries, target {goal}")
            elif dry_run:
                out.print(
                    f"would evict {plan.count} of {live} entries (scores from {plan.lowest_score:.4g}); "
                    f"compaction would then free about {human_bytes(plan.bytes_reclaimable)}"
                )
                shown = ", ".join(map(str, plan.entry_ids[:20])) + (" ..." if plan.count > 20 else "")
                out.print(f"entry ids, first to go first: {shown}")
            elif confirm_change(f"evict {plan.count} of {live} entries from {store}?", yes):
                document["evicted"] = s.evict(goal)
                out.print(
                    f"evicted {document['evicted']} entries; {live - document['evicted']} remain; "
                    + compact_advice(s, plan.bytes_reclaimable)
                )
            else:
                out.print("nothing evicted")
            entries_after = s.stats().entries
        code = 0
        if signals.requested():
            code = signals.report_removed(document, "evicted", document["evicted"], entries_after)
        if json_output:
            out.emit_json(document)
    if code:
        raise typer.Exit(code)
