"""SIGINT (Ctrl-C) and SIGTERM during a command (docs/cli.md, "Interrupts").

The command line handles both signals for the whole run:

- outside a stoppable section, a signal stops the command at once (as a
  KeyboardInterrupt: open stores are closed on the way out);
- inside one (``stoppable()``: the mutating work of put, evict, compact and
  init), the first signal is only recorded.  The command checks
  ``requested()`` at its safe points (put between files, compact between
  the shards it writes), stops there, says what it committed and exits
  with ``stop_code()``: 130 for SIGINT, 143 for SIGTERM.  Work without a
  safe point (evict, init) is short and is finished first;
- a second signal stops at once, as outside a section;
- once the command has returned (``settle()``), a signal changes nothing:
  the exit code is being decided and the output flushed.

The library never sees a signal: its write path leaves each step done or
undone when a KeyboardInterrupt cuts it short (docs/reliability.md,
"Interrupts").
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from hmem.cli.exit_codes import ExitCode
from hmem.cli.output import error_line

HANDLED = (signal.SIGINT, signal.SIGTERM)
_CODES: dict[int, ExitCode] = {signal.SIGINT: ExitCode.INTERRUPTED, signal.SIGTERM: ExitCode.TERMINATED}


class _Run:
    """What the signals of one command run did."""

    first: int | None = None  # the first signal received
    sections = 0  # stoppable sections entered and not left
    reported = False  # the command said what it committed before exiting
    owns_process = False  # the process exits when the run ends
    settled = False  # the command has returned: its exit code is being decided


def _handle(signum: int, frame: FrameType | None) -> None:
    if _Run.first is None:
        _Run.first = signum
        if _Run.sections:
            return  # the command stops at its next safe point
    if _Run.settled:
        return  # too late to stop anything: an exception now would only be a traceback
    raise KeyboardInterrupt


def install() -> dict[int, Any] | None:
    """Handle SIGINT and SIGTERM for one run; returns the handlers to put
    back (None off the main thread, where Python allows no handler)."""
    _Run.first, _Run.sections, _Run.reported, _Run.settled = None, 0, False, False
    if threading.current_thread() is not threading.main_thread():
        return None
    previous: dict[int, Any] = {int(sig): signal.getsignal(sig) for sig in HANDLED}
    for sig in HANDLED:
        signal.signal(sig, _handle)
    return previous


def settle() -> None:
    """The command has returned or failed: a signal from here on is only
    recorded, while the exit code is decided and the output flushed."""
    _Run.settled = True


def own_process() -> None:
    """The process ends with the run (the ``hmem`` program itself)."""
    _Run.owns_process = True


def restore(previous: dict[int, Any] | None) -> None:
    """The run is over: put the handlers back or, when the process exits
    next with its code decided, ignore a late signal (it would only turn
    that code into a traceback)."""
    for sig, handler in (previous or {}).items():
        signal.signal(sig, signal.SIG_IGN if _Run.owns_process else handler)


@contextlib.contextmanager
def stoppable() -> Iterator[None]:
    """A section in which the first signal waits for the command's next safe point."""
    _Run.sections += 1
    try:
        yield
    finally:
        _Run.sections -= 1


def requested() -> bool:
    """Whether a signal asked the command to stop."""
    return _Run.first is not None


def name() -> str:
    return signal.Signals(_Run.first).name if _Run.first is not None else "SIGINT"


def stop_code() -> ExitCode:
    """The exit code of a command a signal stopped: 130 (SIGINT) or 143 (SIGTERM)."""
    return _CODES.get(_Run.first or signal.SIGINT, ExitCode.INTERRUPTED)


def stopped_and_reported() -> ExitCode:
    """The command reported what it committed: its exit code, and no
    further 'interrupted' line."""
    _Run.reported = True
    return stop_code()


def final(code: int) -> tuple[int, str | None]:
    """The exit code of a run that ended with `code`, and the error line
    to print (None when the command already reported its stop)."""
    if code not in (ExitCode.INTERRUPTED, ExitCode.TERMINATED):
        return code, None
    if _Run.reported:  # a second signal may have cut the report short: the first one decides the code
        return stop_code(), None
    return stop_code(), "terminated" if _Run.first == signal.SIGTERM else "interrupted"


def report_stop(document: dict[str, Any], summary: str, **committed: Any) -> ExitCode:
    """Say what a command a signal stopped committed: one line on stderr
    (also under --quiet) and ``"interrupted": {...}`` in its JSON document.
    Returns the exit code to leave with."""
    document["interrupted"] = {"signal": name(), "exit_code": int(stop_code()), **committed}
    verb = "terminated" if _Run.first == signal.SIGTERM else "interrupted"
    sys.stderr.write(error_line(f"{verb} ({name()}): {summary}", None) + "\n")
    sys.stderr.flush()
    return stopped_and_reported()


def report_removed(document: dict[str, Any], verb: str, removed: int, store_entries: int) -> ExitCode:
    """``report_stop`` for a removal a signal let finish (evict, rm): `verb`
    ("evicted", "deleted") is also the document's key of the count."""
    return report_stop(
        document,
        f"{verb} {removed} entries (committed); the store holds {store_entries} entries",
        **{verb: removed, "store_entries": store_entries},
    )


@contextlib.contextmanager
def at_once() -> Iterator[None]:
    """A part of a stoppable section where a signal stops at once: a
    prompt waiting for the user."""
    saved, _Run.sections = _Run.sections, 0
    try:
        yield
    finally:
        _Run.sections = saved
