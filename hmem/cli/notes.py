"""Lines about single inputs on stderr (a file skipped, an id not found):
printed under --quiet and --json too, since a script must learn why, and
as plain text, never read as Rich markup."""

from __future__ import annotations

import sys


def problem(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
