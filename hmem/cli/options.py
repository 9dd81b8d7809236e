"""Option declarations shared by every command, so each is spelled once."""

from __future__ import annotations

from typing import Annotated, Any

import typer

JsonOption = Annotated[
    bool,
    typer.Option("--json", help="Print one JSON document on stdout (raw numbers, no colour)."),
]
QuietOption = Annotated[
    bool,
    typer.Option("--quiet", "-q", help="Print nothing but errors (and the JSON document with --json)."),
]

STORE_ENV = "HMEM_STORE"

# a str, not a Path: a store may be a URL (s3://bucket/prefix), which a Path would mangle
StoreArgument = Annotated[
    str,
    typer.Argument(
        envvar=STORE_ENV,
        show_envvar=True,
        help="The store: a directory or s3://bucket/prefix (or set HMEM_STORE).",
        show_default=False,
    ),
]
LockWaitOption = Annotated[
    float,
    typer.Option(
        "--lock-wait", min=0, metavar="SECONDS", help="Wait up to this long for another writer to release the store."
    ),
]
YesOption = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]
DryRunOption = Annotated[bool, typer.Option("--dry-run", help="Show what would be done; change nothing.")]


def plain_flags(command: Any, ctx: Any) -> None:
    """Show flags in --help without a value type: Typer (its own copy of
    click, hence the duck typing) labels every flag
    (--json, --dry-run, --help itself) '<bool>', as if it took a value.  An
    empty metavar is what Typer then shows; applied to each command as it is
    looked up (hmem/cli/app.py), so commands added later are covered too."""
    params = list(command.params)
    help_option = command.get_help_option(ctx)
    if help_option is not None:
        params.append(help_option)
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""


# LMCache caches (docs/lmcache.md): what a read of one needs beyond its files
KVShapeOption = Annotated[
    str | None,
    typer.Option(
        "--kv-shape",
        metavar="LAYERS,HIDDEN",
        help="An LMCache cache's K/V per chunk and rank (hidden = kv heads x head dim), for local_disk and "
        "multiprocess files, which carry no shape. Add ',mla' for MLA models.",
        show_default=False,
    ),
]
ModelConfigOption = Annotated[
    str | None,
    typer.Option(
        "--model-config",
        metavar="PATH",
        help="An LMCache cache's model: its config.json (or the directory holding it), for the K/V shape.",
        show_default=False,
    ),
]
ChunkSizeOption = Annotated[
    int,
    typer.Option("--chunk-size", min=1, help="An LMCache cache's chunk size in tokens (its chunk_size setting)."),
]
