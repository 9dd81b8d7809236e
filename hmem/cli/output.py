"""Everything the command line prints goes through here.

- Results go to stdout: Rich tables and text for people, or exactly one JSON
  document with ``--json`` (raw numbers, no colour, nothing else on stdout).
- Errors and progress go to stderr.  Progress bars appear only when stderr
  is a terminal and neither ``--json`` nor ``--quiet`` is set.
- Colour follows Rich's detection: none when the stream is not a terminal,
  none when NO_COLOR is set.
- A closed stdout (``hmem stats S | head -1``) ends the command quietly
  with exit code 141 (docs/cli.md, "Exit codes").
"""

from __future__ import annotations

import contextlib
import errno
import io
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


class StdoutClosed(Exception):
    """stdout's reader went away.  Not an OSError, so that Typer, which
    would end the command with exit code 1 on a BrokenPipeError, lets it
    through to hmem's own handler (hmem/cli/app.py)."""


@contextlib.contextmanager
def closed_stdout_guard() -> Iterator[None]:
    """Turn a BrokenPipeError into StdoutClosed."""
    try:
        yield
    except BrokenPipeError as exc:
        raise StdoutClosed() from exc


def silence_stdout() -> None:
    """Python's recipe for a closed stdout (the signal module's "Note on
    SIGPIPE"): point stdout at os.devnull, so that the interpreter's last
    flush at exit does not fail again.  Rich's Console.on_broken_pipe is
    that recipe; it opens os.devnull, which hmem's own code leaves to
    hmem/_io.py (docs/architecture.md, rule 6)."""
    try:
        sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test runner's buffer): nothing to flush at exit
        return
    with contextlib.suppress(SystemExit):  # Rich ends the process with exit code 1 after it
        Console().on_broken_pipe()


def whole_writes_to_stdout() -> None:
    """Under PYTHONUNBUFFERED (or ``python -u``) stdout's text layer writes
    to the file itself and drops what a partial write leaves over (a pipe
    closed mid-write): the rest of the output is lost without an error.  A
    buffered layer in between writes everything or raises; hmem flushes
    after each result it prints."""
    raw = getattr(sys.stdout, "buffer", None)
    if isinstance(raw, io.FileIO):
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(raw), encoding=sys.stdout.encoding,
                                      errors=sys.stdout.errors, write_through=True)


def flush_stdout() -> bool:
    """Flush stdout; False when its reader has gone (stdout is then silenced)."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        silence_stdout()
        return False
    except (OSError, ValueError):  # closed or not flushable: nothing more to do
        pass
    return True


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # Rich would exit with code 1; hmem ends with 141 (hmem/cli/app.py)
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


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
        self.out = _Console(highlight=False, **plain)
        self.err = _Console(stderr=True, highlight=False, **plain)

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
