"""``hmem rm``: delete entries by id."""

from __future__ import annotations

from typing import Any

import typer

from hmem import Store
from hmem.cli import signals
from hmem.cli.compact_run import compact_advice
from hmem.cli.entry_args import EntryIdsArgument, store_and_ids
from hmem.cli.exit_codes import ExitCode
from hmem.cli.ids import id_ranges
from hmem.cli.notes import problem
from hmem.cli.options import DryRunOption, JsonOption, LockWaitOption, QuietOption, YesOption
from hmem.cli.output import Output, human_bytes
from hmem.cli.prompts import confirm_change


def rm(
    args: EntryIdsArgument,
    dry_run: DryRunOption = False,
    yes: YesOption = False,
    lock_wait: LockWaitOption = 0.0,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Delete entries by id; their bytes are freed by the next 'hmem compact'.

    The deletion is committed whole (a crash leaves the store as before or
    with every one deleted). Ids that name no entry are reported on stderr
    and the others are deleted; the exit code is then 3 (partial), or 1
    when none of the ids names an entry.
    """
    out = Output(json_mode=json_output, quiet=quiet)
    store, entry_ids = store_and_ids(args, one=False)
    opened = Store.open(store, read_only=dry_run, lock_wait=lock_wait)  # a signal stops the lock wait at once
    with signals.stoppable():  # a deletion is short: a signal lets it finish, or stops before it
        with opened as s:
            plan = s.plan_delete(entry_ids)
            document: dict[str, Any] = {
                "store": str(store),
                "dry_run": dry_run,
                "entry_ids": list(plan.entry_ids),
                "missing": list(plan.missing),
                "bytes_reclaimable": plan.bytes_reclaimable,
                "deleted": 0,
            }
            if plan.missing:
                problem(f"no entry {id_ranges(plan.missing)} in {store}")
            if not plan.count:
                out.print("nothing to delete")
            elif dry_run:
                out.print(
                    f"would delete {plan.count} entries ({id_ranges(plan.entry_ids)}) from {store}; "
                    f"compaction would then free about {human_bytes(plan.bytes_reclaimable)}"
                )
            elif confirm_change(f"delete {plan.count} entries ({id_ranges(plan.entry_ids)}) from {store}?", yes):
                document["deleted"] = s.delete(plan.entry_ids).count
                out.print(
                    f"deleted {document['deleted']} entries ({id_ranges(plan.entry_ids)}) from {store}; "
                    + compact_advice(s, plan.bytes_reclaimable)
                )
            else:
                out.print("nothing deleted")
            entries_after = s.stats().entries
        document["store_entries"] = entries_after
        code: int = ExitCode.OK
        if plan.missing:
            code = ExitCode.PARTIAL if plan.count else ExitCode.FAILURE
        if signals.requested():
            code = signals.report_removed(document, "deleted", document["deleted"], entries_after)
        if json_output:
            out.emit_json(document)
    if code:
        raise typer.Exit(code)
