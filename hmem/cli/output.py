"""Everything the command line prints goes through here.

- Results go to stdout: Rich tables and text for people, or exactly one JSON
  document with ``--json`` (raw numbers, no colour, nothing else on stdout).
- Errors and progress go to stderr.  Progress bars appear only when stderr
  is a terminal and neither ``--json`` nor ``--quiet`` is set.
- Colour follows Rich's detection: none when the stream is not a terminal,
  none when NO_COLOR is set.
- Text is printed as it is: a ``str`` given to ``Output.print``, ``warn``,
  a table cell or a title is never read as Rich markup or an emoji code, so
  user text (a file ``run[bold]1.safetensors``, a message quoting
  ``[n_tokens, embed_dim]``) shows literally.  Style is asked for
  explicitly, with ``styled()`` or a ``rich.text.Text``.
- Control characters are shown, never sent: text that came from a store
  (entry metadata, a lock's owner, a source name, an error quoting them)
  could carry terminal escape sequences, so every str the consoles print,
  every styled() text and every error line has its C0 and C1 control
  characters (ESC, CR, BEL, DEL...; newline and tab aside) replaced by
  visible ``\\x1b`` forms (``visible()``, docs/security.md).  JSON output
  is escaped by ``json.dumps`` already.
- Sizes and rates are binary (KiB, MiB, GiB; MiB/s), in summaries and in
  progress bars alike (docs/cli.md, "Conventions").
- An error under ``--json`` (or ``--jsonl``) is also one JSON document on
  stdout, ``error_document()`` (hmem/cli/app.py prints it).
- A closed stdout (``hmem stats S | head -1``) ends the command quietly
  with exit code 141 (docs/cli.md, "Exit codes").
- Rich is imported when something is first printed through it, so a
  command under ``--json`` (what scripts and cron jobs run) does not pay
  for importing it (about 40 ms of every start-up).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table
    from rich.text import Text

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
    from rich.console import Console

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
        sys.stdout = io.TextIOWrapper(
            io.BufferedWriter(raw), encoding=sys.stdout.encoding, errors=sys.stdout.errors, write_through=True
        )


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


# C0 controls but newline and tab, DEL and C1 controls: what a terminal may
# act on (ESC starts a sequence; C1 CSI 0x9b is one on its own)
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible(text: str) -> str:
    """`text` with its control characters replaced by ``\\xNN`` (ESC shows as
    ``\\x1b``): store text (docs/security.md) never drives the terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def styled(text: str, style: str) -> Text:
    """`text` shown literally in `style` ("bold", "yellow"): the way to
    colour a line or a table cell (a plain ``str`` is never markup, and
    its control characters are shown: visible())."""
    from rich.text import Text

    return Text(visible(text), style=style)


def literal(text: str) -> Text:
    """`text` as a Rich Text, unstyled: a table cell or line that must never
    be read as markup, whatever the console's settings."""
    return styled(text, "")


def _console(**kwargs: Any) -> Console:
    """A Rich console that prints every str as it is: markup and emoji
    codes off; style comes only from Text objects (styled())."""
    from rich.console import Console

    class _Console(Console):
        def render_str(self, text: str, **kwargs: Any) -> Text:
            # every str printed or put in a table passes here (Text: styled())
            return super().render_str(visible(text), **kwargs)

        def on_broken_pipe(self) -> None:
            # Rich would exit with code 1; hmem ends with 141 (hmem/cli/app.py)
            self.quiet = True
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    return _Console(markup=False, emoji=False, highlight=False, **kwargs)


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
        self._out: Console | None = None
        self._err: Console | None = None

    @staticmethod
    def _plain() -> dict[str, Any]:
        # NO_COLOR: no escape codes at all (Rich alone would still embolden).
        return {"color_system": None} if os.environ.get("NO_COLOR") else {}

    @property
    def out(self) -> Console:
        """stdout's Rich console, made at first use."""
        if self._out is None:
            self._out = _console(**self._plain())
        return self._out

    @property
    def err(self) -> Console:
        """stderr's Rich console, made at first use."""
        if self._err is None:
            self._err = _console(stderr=True, **self._plain())
        return self._err

    # ---- results ---------------------------------------------------------

    def emit_json(self, document: Any) -> None:
        """The command's one JSON document on stdout."""
        sys.stdout.write(json.dumps(document, indent=2, sort_keys=False) + "\n")
        sys.stdout.flush()
        _Emitted.document = True

    def emit_jsonl(self, record: Any) -> None:
        """One line of a --jsonl stream on stdout (compact JSON)."""
        sys.stdout.write(json.dumps(record, separators=(",", ":")) + "\n")
        _Emitted.document = True

    def print(self, *objects: Any, **kwargs: Any) -> None:
        """Human output; silent under --json and --quiet.  A str is printed
        literally (never markup); style with styled() or a Text."""
        if not (self.json_mode or self.quiet):
            self.out.print(*objects, **kwargs)

    def table(self, *columns: str, title: str | None = None, **kwargs: Any) -> Table:
        from rich.table import Table

        table = Table(title=title, title_justify="left", header_style="bold", **kwargs)
        for column in columns:
            table.add_column(column.lstrip(">"), justify="right" if column.startswith(">") else "left")
        return table

    # ---- stderr --------------------------------------------------------------

    def warn(self, message: str) -> None:
        """'warning: message' on stderr; the message is shown literally."""
        if not self.quiet:
            from rich.text import Text

            self.err.print(Text.assemble(("warning:", "yellow"), " ", visible(message)), soft_wrap=True)

    @contextlib.contextmanager
    def progress(self, description: str, total: float | None, *, bytes_mode: bool = False) -> Iterator[Any]:
        """A progress bar on stderr, or a do-nothing stand-in when none should show.

        Yields an object with ``advance(amount)``.
        """
        if self.json_mode or self.quiet or not self.err.is_terminal:
            yield _NoProgress()
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        columns: list[Any] = [TextColumn("{task.description}", markup=False), BarColumn()]
        columns.append(binary_speed_column() if bytes_mode else MofNCompleteColumn())
        columns.append(TimeRemainingColumn())
        with Progress(*columns, console=self.err, transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield _Progress(bar, task)


def binary_speed_column() -> Any:
    """A progress column of the transfer speed in the units of every other
    size hmem prints (MiB/s; Rich's own column says MB/s)."""
    from rich.progress import ProgressColumn, Task
    from rich.text import Text

    class BinaryTransferSpeedColumn(ProgressColumn):
        def render(self, task: Task) -> Text:
            speed = task.finished_speed or task.speed
            return Text("?" if speed is None else f"{human_bytes(speed)}/s", style="progress.data.speed")

    return BinaryTransferSpeedColumn()


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


class _Emitted:
    """Whether this run already printed its JSON document (or a --jsonl
    line): an error then adds no second document (hmem/cli/app.py)."""

    document = False


def reset_emitted() -> None:
    _Emitted.document = False


def json_emitted() -> bool:
    return _Emitted.document


def error_line(message: str, hint: str | None) -> str:
    """The one line an error prints: what happened, then what to do.  Plain
    text, written to stderr as it is (no Rich), so user text stays literal;
    its control characters shown (visible())."""
    return visible(f"error: {message}" + (f" ({hint})" if hint else ""))


def error_document(code: str, exit_code: int, message: str, hint: str | None) -> dict[str, Any]:
    """The JSON document of an error under --json (docs/cli.md, "Errors as JSON")."""
    return {"error": {"code": code, "exit": int(exit_code), "message": message, "hint": hint}}
