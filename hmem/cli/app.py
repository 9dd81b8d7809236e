"""The ``hmem`` Typer application: global options, error handling, and the
registration of one module per command."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from hmem import FORMAT_VERSION, HmemError, __version__, kernel_info
from hmem.cli import (
    cmd_compact,
    cmd_demo,
    cmd_evict,
    cmd_init,
    cmd_prefix_hit,
    cmd_put,
    cmd_query,
    cmd_stats,
    cmd_verify,
    signals,
)
from hmem.cli.exit_codes import ExitCode, cli_hint, exit_code_for
from hmem.cli.output import (StdoutClosed, closed_stdout_guard, error_line, flush_stdout, silence_stdout,
                             whole_writes_to_stdout)

DEBUG_ENV = "HMEM_DEBUG"


class _Session:
    """Per-invocation settings the error handler needs after parsing ends."""

    debug = False


def _print_error(message: str, hint: str | None = None) -> None:
    sys.stderr.write(error_line(message, hint) + "\n")
    sys.stderr.flush()


class HmemGroup(TyperGroup):
    """Runs a command and turns every outcome into one exit code.

    Library errors print one line (what happened, what to do) and exit with
    the code of docs/cli.md; a traceback only with --debug or HMEM_DEBUG=1.
    This lives in ``main`` so that the console script, ``python -m hmem`` and
    the test runner all take the same path.
    """

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,  # type: ignore[override]
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        _Session.debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
        whole_writes_to_stdout()  # so that a closed stdout is always noticed (exit code 141)
        handlers = signals.install()  # SIGINT and SIGTERM stop at a consistent point (hmem/cli/signals.py)
        try:
            try:
                rv = super().main(args=args, prog_name=prog_name or "hmem", complete_var=complete_var,
                                  standalone_mode=False, **extra)
            finally:
                signals.settle()
            code = rv if isinstance(rv, int) else ExitCode.OK
            code, stop_line = signals.final(code)  # Typer turns Ctrl-C into Exit(130)
            if stop_line:
                _print_error(stop_line)
        except HmemError as exc:
            code = self._report(exc, exc.message, exc.hint)
        except (StdoutClosed, BrokenPipeError):  # the reader of stdout is gone: end quietly, as `cat` would
            silence_stdout()
            code = ExitCode.BROKEN_PIPE
        except typer.Abort:
            _print_error("aborted")
            code = ExitCode.FAILURE
        except KeyboardInterrupt:
            code, stop_line = signals.final(ExitCode.INTERRUPTED)
            if stop_line:
                _print_error(stop_line)
        except OSError as exc:  # the file system refused something hmem's errors do not cover
            where = f"{exc.filename}: " if exc.filename is not None else ""
            code = self._report(exc, f"storage error: {where}{exc.strerror or exc}", None)
        except Exception as exc:  # noqa: BLE001 - the last line of defence
            code = self._report_other(exc)
        if not flush_stdout():  # a closed stdout also when the output is flushed only now
            code = ExitCode.BROKEN_PIPE
        signals.restore(handlers)
        if standalone_mode:
            sys.exit(int(code))
        return int(code)

    def make_context(self, *args: Any, **kwargs: Any) -> Any:  # prints --help and --version
        with closed_stdout_guard():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        with closed_stdout_guard():
            return super().invoke(ctx)

    @staticmethod
    def _report(exc: BaseException, message: str, hint: str | None) -> ExitCode:
        if _Session.debug:
            traceback.print_exception(exc)
        _print_error(message, cli_hint(hint))
        return exit_code_for(exc)

    @staticmethod
    def _report_other(exc: Exception) -> int:
        # Typer's own usage errors (missing option, bad type) carry an exit
        # code and a message; anything else is a bug in hmem.
        if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):
            if type(exc).__name__ == "NoArgsIsHelpError":
                return ExitCode.USAGE  # the help text is already printed
            ctx = getattr(exc, "ctx", None)
            hint = f"see '{ctx.command_path} --help'" if ctx is not None else "see 'hmem --help'"
            if _Session.debug:
                traceback.print_exception(exc)
            _print_error(exc.format_message(), hint)
            return int(exc.exit_code)
        traceback_hint = "run with --debug for the traceback and report it"
        if _Session.debug:
            traceback.print_exception(exc)
        _print_error(f"internal error: {type(exc).__name__}: {exc}", traceback_hint)
        return ExitCode.FAILURE


app = typer.Typer(
    cls=HmemGroup,
    name="hmem",
    help="hmem: persistent, exact K/V memory on disk for LLM inference.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def version_text() -> str:
    return (f"hmem {__version__} (store format {FORMAT_VERSION}: reads {FORMAT_VERSION}, writes {FORMAT_VERSION}; "
            f"{kernel_info()})")


def _version(value: bool) -> None:
    if value:
        typer.echo(version_text())
        raise typer.Exit()


@app.callback()
def _global_options(
    version: Annotated[
        bool,
        typer.Option("--version", "-V", callback=_version, is_eager=True,
                     help="Print the version, the store format it reads and writes, and the kernel path, then exit."),
    ] = False,
    debug: Annotated[
        bool, typer.Option("--debug", help="Show tracebacks of errors (or set HMEM_DEBUG=1).")
    ] = False,
) -> None:
    if debug:
        _Session.debug = True


app.command("init")(cmd_init.init)
app.command("put")(cmd_put.put)
app.command("query")(cmd_query.query)
app.command("stats")(cmd_stats.stats)
app.command("evict")(cmd_evict.evict)
app.command("compact")(cmd_compact.compact)
app.command("verify")(cmd_verify.verify_command)
app.command("prefix-hit")(cmd_prefix_hit.prefix_hit)
app.command("demo")(cmd_demo.demo)


def main() -> None:
    signals.own_process()  # a late signal must not change the exit code decided
    app()
