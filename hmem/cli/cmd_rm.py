"""``hmem rm``: delete entries by id."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from hmem import Store
from hmem.cli import lmcache_clean_view, signals
from hmem.cli.compact_run import compact_advice
from hmem.cli.entry_args import EntriesOrChunksArgument, refuse_keys, store_and_targets
from hmem.cli.exit_codes import ExitCode
from hmem.cli.ids import id_ranges
from hmem.cli.lmcache_target import cache_at
from hmem.cli.notes import problem
from hmem.cli.options import DryRunOption, JsonOption, LockWaitOption, QuietOption, YesOption
from hmem.cli.output import Output, human_bytes
from hmem.cli.prompts import confirm_change


def rm(
    args: EntriesOrChunksArgument,
    model: Annotated[
        str | None,
        typer.Option("--model", help="An LMCache cache: delete the chunks of this model.", show_default=False),
    ] = None,
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size", min=1, help="An LMCache cache: delete the chunks of this world size.", show_default=False
        ),
    ] = None,
    rank: Annotated[
        int | None,
        typer.Option(
            "--rank", min=0, help="An LMCache cache: delete the chunks of this rank (worker id).", show_default=False
        ),
    ] = None,
    tag: Annotated[
        str | None,
        typer.Option(
            "--tag",
            metavar="NAME%VALUE",
            help="An LMCache cache: delete the chunks with this tag (as in the file names), or 'none': untagged ones.",
            show_default=False,
        ),
    ] = None,
    kv_dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            help="An LMCache cache: delete the chunks of this KV dtype (bfloat16, half...).",
            show_default=False,
        ),
    ] = None,
    layer: Annotated[
        int | None,
        typer.Option(
            "--layer",
            min=0,
            help="An LMCache cache: delete this layer's files of a layerwise cache.",
            show_default=False,
        ),
    ] = None,
    dry_run: DryRunOption = False,
    yes: YesOption = False,
    lock_wait: LockWaitOption = 0.0,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Delete entries by id (or chunks by key); their bytes are freed by the next 'hmem compact'.

    The deletion is committed whole (a crash leaves the store as before or
    with every one deleted). Ids that name no entry are reported on stderr
    and the others are deleted; the exit code is then 3 (partial), or 1
    when none of the ids names an entry.

    In a store of chunks (an hmem tier of LMCache), keys name chunks, and a
    chunk goes whole: deleting one of its entries deletes them all.

    On an LMCache cache directory: deletes the files named (file names or
    keys) and the chunks that --model, --world-size, --rank, --tag, --dtype
    and --layer select (all given must match). The plan is shown first;
    nothing is deleted unless confirmed (--yes, or a yes at the terminal).
    """
    cache = cache_at(args[0]) if args else None
    if cache is not None:  # an LMCache cache directory: the files named, or the chunks selected
        lmcache_clean_view.rm(
            cache,
            args[1:],
            model=model,
            world_size=world_size,
            rank=rank,
            tag=tag,
            kv_dtype=kv_dtype,
            layer=layer,
            dry_run=dry_run,
            yes=yes,
            json_output=json_output,
            quiet=quiet,
        )
        return
    lmcache_clean_view.refuse_for_store(
        "rm",
        **{
            "--model": model,
            "--world-size": world_size,
            "--rank": rank,
            "--tag": tag,
            "--dtype": kv_dtype,
            "--layer": layer,
        },
    )
    out = Output(json_mode=json_output, quiet=quiet)
    store, entry_ids, keys = store_and_targets(args, one=False)
    opened = Store.open(store, read_only=dry_run, lock_wait=lock_wait)  # a signal stops the lock wait at once
    with signals.stoppable():  # a deletion is short: a signal lets it finish, or stops before it
        with opened as s:
            refuse_keys(keys, s)
            absent = []
            for key in keys:  # a chunk's key stands for its entries
                found = s.chunks.ids(key)
                if found is None:
                    absent.append(key)
                else:
                    entry_ids.extend(found)
            if absent:
                problem(f"no chunk {', '.join(absent[:5])}{', ...' if len(absent) > 5 else ''} in {store}")
            plan = s.plan_delete(entry_ids)
            document: dict[str, Any] = {
                "store": str(store),
                "dry_run": dry_run,
                "entry_ids": list(plan.entry_ids),
                "missing": list(plan.missing),
                "missing_keys": absent,
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
        if plan.missing or absent:
            code = ExitCode.PARTIAL if plan.count else ExitCode.FAILURE
        if signals.requested():
            code = signals.report_removed(document, "deleted", document["deleted"], entries_after)
        if json_output:
            out.emit_json(document)
    if code:
        raise typer.Exit(code)
