"""Questions the command line asks the person at the terminal."""

from __future__ import annotations

import sys

import typer

from hmem import InvalidArgumentError
from hmem.cli import signals


def confirm(question: str, yes: bool) -> bool:
    """True when --yes was given or the person at the terminal agrees."""
    if yes:
        return True
    if not sys.stdin.isatty():
        raise InvalidArgumentError("not a terminal, so nobody can confirm", hint="pass --yes to go ahead")
    return typer.confirm(question, default=False, err=True)  # stdout stays for results


def confirm_change(question: str, yes: bool) -> bool:
    """``confirm`` for a command about to change a store: asked at once (a
    signal while the question waits stops at once), and a signal that came
    before it stops the command before anything changes."""
    with signals.at_once():
        agreed = confirm(question, yes)
    return agreed and not signals.requested()
