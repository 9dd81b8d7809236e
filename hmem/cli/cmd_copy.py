"""``hmem copy``: a store's last commit copied whole to a new place."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from hmem import copy_store
from hmem.cli.options import JsonOption, LockWaitOption, QuietOption
from hmem.cli.output import Output, human_bytes


def copy(
    source: Annotated[
        str, typer.Argument(help="The store to copy: a directory or s3://bucket/prefix.", show_default=False)
    ],
    destination: Annotated[
        str,
        typer.Argument(
            help="Where the copy goes: a missing or empty directory, or an empty s3://bucket/prefix outside any store.",
            show_default=False,
        ),
    ],
    lock_wait: LockWaitOption = 0.0,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Copy a store, byte for byte, between a directory and object storage.

    Either way, or between two of either: ids, access counts and the
    import registry come along.  The source's writer lock (or lease) is held
    while it is read; the copy becomes a store only at its last step."""
    out = Output(json_mode=json_output, quiet=quiet)
    started = time.perf_counter()
    report = copy_store(source, destination, lock_wait=lock_wait)
    seconds = time.perf_counter() - started
    if json_output:
        out.emit_json(
            {
                "source": source,
                "destination": destination,
                "entries": report.entries,
                "records": report.records,
                "shards": report.shards,
                "bytes": report.bytes,
                "seconds": round(seconds, 3),
            }
        )
        return
    out.print(
        f"copied {source} to {destination}: {report.entries} entries in {report.shards} shard(s), "
        f"{human_bytes(report.bytes)} in {seconds:.1f} s"
    )
