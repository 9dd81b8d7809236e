"""Option declarations shared by every command, so each is spelled once."""

from __future__ import annotations

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
