"""Lines about single inputs on stderr (a file skipped, an id not found):
printed under --quiet and --json too, since a script must learn why, and
as plain text, never read as Rich markup."""

from __future__ import annotations

import sys

from hmem.cli.output import visible


def problem(message: str) -> None:
    sys.stderr.write(visible(f"error: {message}") + "\n")  # a file name's control characters shown
    sys.stderr.flush()
