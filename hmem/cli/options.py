"""Option declarations shared by every command, so each is spelled once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

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

StoreArgument = Annotated[
    Path,
    typer.Argument(envvar=STORE_ENV, show_envvar=True, help="The store directory (or set HMEM_STORE).",
                   show_default=False),
]
LockWaitOption = Annotated[
    float,
    typer.Option("--lock-wait", min=0, metavar="SECONDS",
                 help="Wait up to this long for another writer to release the store."),
]
YesOption = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]
DryRunOption = Annotated[bool, typer.Option("--dry-run", help="Show what would be done; change nothing.")]
