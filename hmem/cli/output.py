"""Everything the command line prints goes through here.

- Results go to stdout: Rich tables and text for people, or exactly one JSON
  document with ``--json`` (raw numbers, no colour, nothing else on stdout).
- Errors and progress go to stderr.  Progress bars appear only when stderr
  is a terminal and neither ``--json`` nor ``--quiet`` is set.
- Colour follows Rich's detection: none when the stream is not a terminal,
  none when NO_COLOR is set.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: int | float) -> str:
    """1536 -> '1.5 KiB'; exact below 1 KiB."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_duration(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} d"


class Output:
    """The printing side of one command invocation."""

    def __init__(self, *, json_mode: bool = False, quiet: bool = False) -> None:
        self.json_mode = json_mode
        self.quiet = quiet
        # NO_COLOR: no escape codes at all (Rich alone would still embolden).
        plain: Any = {"color_system": None} if os.environ.get("NO_COLOR") else {}
        self.out = Console(highlight=False, **plain)
        self.err = Console(stderr=True, highlight=False, **plain)

    # ---- results ---------------------------------------------------------

    def emit_json(self, document: Any) -> None:
        sys.stdout.write(json.dumps(document, indent=2, sort_keys=False) + "\n")
        sys.stdout.flush()

    def print(self, *objects: Any, **kwargs: Any) -> None:
        """Human output; silent under --json and --quiet."""
        if not (self.json_mode or self.quiet):
            self.out.print(*objects, **kwargs)

    def table(self, *columns: str, title: str | None = None, **kwargs: Any) -> Table:
        table = Table(title=title, title_justify="left", header_style="bold", **kwargs)
        for column in columns:
            table.add_column(column.lstrip(">"), justify="right" if column.startswith(">") else "left")
        return table

    # ---- stderr --------------------------------------------------------------

    def warn(self, message: str) -> None:
        if not self.quiet:
            self.err.print(f"[yellow]warning:[/] {message}", markup=True, highlight=False)

    @contextlib.contextmanager
    def progress(self, description: str, total: float | None, *, bytes_mode: bool = False) -> Iterator[Any]:
        """A progress bar on stderr, or a do-nothing stand-in when none should show.

        Yields an object with ``advance(amount)``.
        """
        if self.json_mode or self.quiet or not self.err.is_terminal:
            yield _NoProgress()
            return
        columns: list[Any] = [TextColumn("{task.description}"), BarColumn()]
        columns.append(TransferSpeedColumn() if bytes_mode else MofNCompleteColumn())
        columns.append(TimeRemainingColumn())
        with Progress(*columns, console=self.err, transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield _Progress(bar, task)


class _NoProgress:
    def advance(self, amount: float = 1, *, total: float | None = None) -> None:
        pass


class _Progress:
    def __init__(self, bar: Progress, task: Any) -> None:
        self._bar = bar
        self._task = task

    def advance(self, amount: float = 1, *, total: float | None = None) -> None:
        if total is not None:
            self._bar.update(self._task, total=total)
        self._bar.advance(self._task, amount)


def error_line(message: str, hint: str | None) -> str:
    """The one line an error prints: what happened, then what to do."""
    return f"error: {message}" + (f" ({hint})" if hint else "")
