"""Questions the command line asks the person at the terminal."""

from __future__ import annotations

import sys

import typer

from hmem import InvalidArgumentError


def confirm(question: str, yes: bool) -> bool:
    """True when --yes was given or the person at the terminal agrees."""
    if yes:
        return True
    if not sys.stdin.isatty():
        raise InvalidArgumentError("not a terminal, so nobody can confirm", hint="pass --yes to go ahead")
    return typer.confirm(question, default=False, err=True)  # stdout stays for results
