"""The ``hmem`` Typer application: global options, error handling, and the
registration of one module per command."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

import hmem
from hmem import FORMAT_VERSION, HmemError, __version__, kernel_info
from hmem.cli import signals
from hmem.cli.exit_codes import (
    ABORTED,
    INTERNAL_ERROR,
    STOPPED,
    USAGE_ERROR,
    ExitCode,
    cli_hint,
    error_name,
    exit_code_for,
)
from hmem.cli.options import plain_flags
from hmem.cli.output import (
    StdoutClosed,
    closed_stdout_guard,
    error_document,
    error_line,
    flush_stdout,
    json_emitted,
    reset_emitted,
    silence_stdout,
    whole_writes_to_stdout,
)

DEBUG_ENV = "HMEM_DEBUG"
JSON_FLAGS = ("--jsonl", "--json")


class _Session:
    """Per-invocation settings the error handler needs after parsing ends."""

    debug = False
    json_flag: str | None = None  # "--json" or "--jsonl" when the command line asks for JSON


def _print_error(message: str, hint: str | None = None, *, name: str = "failure", code: int = ExitCode.FAILURE) -> None:
    """The error line on stderr and, when the command line asked for JSON,
    the error document on stdout: alone under --json (unless the command
    already printed its document), as the last line of a --jsonl stream."""
    sys.stderr.write(error_line(message, hint) + "\n")
    sys.stderr.flush()
    if _Session.json_flag == "--jsonl":
        sys.stdout.write(json.dumps(error_document(name, code, message, hint), separators=(",", ":")) + "\n")
    elif _Session.json_flag == "--json" and not json_emitted():
        sys.stdout.write(json.dumps(error_document(name, code, message, hint), indent=2) + "\n")


def _json_flag(group: TyperGroup, args: Sequence[str]) -> str | None:
    """--json or --jsonl when the command line holds it for a command that
    has it (or for an unknown command); read before parsing, so that a
    usage error is reported as JSON too."""
    tokens = list(args)
    if "--" in tokens:
        tokens = tokens[: tokens.index("--")]
    name = next((t for t in tokens if not t.startswith("-")), None)
    command = group.commands.get(name) if name is not None else None
    known = {opt for param in command.params for opt in param.opts} if command is not None else set(JSON_FLAGS)
    return next((flag for flag in JSON_FLAGS if flag in tokens and flag in known), None)


class HmemGroup(TyperGroup):
    """Runs a command and turns every outcome into one exit code.

    Library errors print one line (what happened, what to do) and exit with
    the code of docs/cli.md; a traceback only with --debug or HMEM_DEBUG=1.
    With --json (or --jsonl) an error is also one JSON document on stdout.
    This lives in ``main`` so that the console script, ``python -m hmem`` and
    the test runner all take the same path.
    """

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        _Session.debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
        _Session.json_flag = _json_flag(self, sys.argv[1:] if args is None else args)
        reset_emitted()
        whole_writes_to_stdout()  # so that a closed stdout is always noticed (exit code 141)
        handlers = signals.install()  # SIGINT and SIGTERM stop at a consistent point (hmem/cli/signals.py)
        try:
            try:
                rv = super().main(
                    args=args, prog_name=prog_name or "hmem", complete_var=complete_var, standalone_mode=False, **extra
                )
            finally:
                signals.settle()
            code = rv if isinstance(rv, int) else ExitCode.OK
            code, stop_line = signals.final(code)  # Typer turns Ctrl-C into Exit(130)
            if stop_line:
                _print_error(stop_line, name=STOPPED[ExitCode(code)], code=code)
        except HmemError as exc:
            code = self._report(exc, exc.message, exc.hint)
        except (StdoutClosed, BrokenPipeError):  # the reader of stdout is gone: end quietly, as `cat` would
            silence_stdout()
            code = ExitCode.BROKEN_PIPE
        except typer.Abort:
            _print_error("aborted", name=ABORTED, code=ExitCode.FAILURE)
            code = ExitCode.FAILURE
        except KeyboardInterrupt:
            code, stop_line = signals.final(ExitCode.INTERRUPTED)
            if stop_line:
                _print_error(stop_line, name=STOPPED[ExitCode(code)], code=code)
        except OSError as exc:  # the file system refused something hmem's errors do not cover
            where = f"{exc.filename}: " if exc.filename is not None else ""
            code = self._report(exc, f"storage error: {where}{exc.strerror or exc}", None)
        except Exception as exc:
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

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            plain_flags(command, ctx)  # every command's --help, including commands added later
        return command

    def format_help(self, ctx: Any, formatter: Any) -> None:
        plain_flags(self, ctx)
        super().format_help(ctx, formatter)

    @staticmethod
    def _report(exc: BaseException, message: str, hint: str | None) -> ExitCode:
        if _Session.debug:
            traceback.print_exception(exc)
        code = exit_code_for(exc)
        _print_error(message, cli_hint(hint), name=error_name(exc), code=code)
        return code

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
            _print_error(exc.format_message(), hint, name=USAGE_ERROR, code=int(exc.exit_code))
            return int(exc.exit_code)
        traceback_hint = "run with --debug for the traceback and report it"
        if _Session.debug:
            traceback.print_exception(exc)
        _print_error(f"internal error: {type(exc).__name__}: {exc}", traceback_hint, name=INTERNAL_ERROR)
        return ExitCode.FAILURE


# The commands in the order `hmem --help` lists them: name, module of
# hmem/cli, function.  A module is imported only when its command is built
# (`_app_for`).
COMMANDS = (
    ("init", "cmd_init", "init"),
    ("put", "cmd_put", "put"),
    ("query", "cmd_query", "query"),
    ("stats", "cmd_stats", "stats"),
    ("ls", "cmd_ls", "ls"),
    ("show", "cmd_show", "show"),
    ("export", "cmd_export", "export"),
    ("evict", "cmd_evict", "evict"),
    ("rm", "cmd_rm", "rm"),
    ("compact", "cmd_compact", "compact"),
    ("verify", "cmd_verify", "verify_command"),
    ("copy", "cmd_copy", "copy"),
    ("prefix-hit", "cmd_prefix_hit", "prefix_hit"),
    ("demo", "cmd_demo", "demo"),
)


def _new_app(names: Sequence[str]) -> typer.Typer:
    """The application with the commands `names` (in COMMANDS order)."""
    built = typer.Typer(
        cls=HmemGroup,
        name="hmem",
        help="hmem: persistent, exact K/V memory on disk for LLM inference.",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=True,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    built.callback()(_global_options)
    for name, module, function in COMMANDS:
        if name in names:
            command = getattr(importlib.import_module(f"hmem.cli.{module}"), function)
            built.command(name, help=help_text(command.__doc__ or ""))(command)
    return built


def help_text(docstring: str) -> str:
    """A command's docstring as its help: each paragraph on one line, for
    Rich to wrap at the terminal's width.  Rich help keeps every line break
    it is given, so the source's wrapping would cut lines short (and the
    command list, which shows the first paragraph, mid-sentence)."""
    paragraphs = inspect.cleandoc(docstring).split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines() if line.strip()) for p in paragraphs)


def version_text() -> str:
    from hmem.lmcache import LMCACHE_VERSION

    remote = hmem.OBJECT_FORMAT_VERSION  # the object-store format's module is imported here only
    return (
        f"hmem {__version__} (store format {FORMAT_VERSION}: reads {FORMAT_VERSION}, writes {FORMAT_VERSION}; "
        f"object-store format {remote}: reads {remote}, writes {remote}; "
        f"LMCache {LMCACHE_VERSION} caches: reads local_disk, fs and multiprocess, writes fs, and is its remote tier; "
        f"{kernel_info()})"
    )


def _version(value: bool) -> None:
    if value:
        typer.echo(version_text())
        raise typer.Exit()


def _global_options(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            "-V",
            callback=_version,
            is_eager=True,
            help="Print the version, the store format it reads and writes, and the kernel path, then exit.",
        ),
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks of errors (or set HMEM_DEBUG=1).")] = False,
) -> None:
    if debug:
        _Session.debug = True


def main() -> None:
    signals.own_process()  # a late signal must not change the exit code decided
    try:
        _app_for(sys.argv[1:])()
    except SystemExit as stop:  # how every command ends (HmemGroup.main)
        code = stop.code
    else:
        code = ExitCode.OK
    if code is None:  # what sys.exit() means, as the interpreter reads it
        code = ExitCode.OK
    elif not isinstance(code, int):
        sys.stderr.write(f"{code}\n")
        code = ExitCode.FAILURE
    _end_process(int(code))


def _end_process(code: int) -> None:
    """End the process without the interpreter's teardown, which frees every
    object and module one by one: 40-50 ms after an import of 512 MiB
    (docs/benchmarks.md, "A Hugging Face cache dump through hmem put"), and
    nothing is left for it to do.  By now the command has closed its store
    (everything hmem writes goes through hmem/_io.py, fsynced before the
    command returns); only stdout and stderr may hold buffered text."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader gone: nothing more can reach it
            pass
    os._exit(code)


def _app_for(args: Sequence[str]) -> typer.Typer:
    """The application holding only the command that the command line names
    first, or every command.  Typer builds the options of every command it
    holds before running one (20-35 ms of every hmem command's start-up for
    all fourteen), and each command's module imports what it needs; a
    command line such as `hmem put ...` needs only its own.  Anything else
    (`hmem`, `hmem --help`, `hmem --debug put`, a misspelt command) gets the
    whole application; `hmem --version` alone gets none."""
    if args and any(args[0] == name for name, _, _ in COMMANDS):
        return _new_app([args[0]])
    if list(args) in (["--version"], ["-V"]):
        return _new_app([])
    return _whole_app()


def _whole_app() -> typer.Typer:
    built = globals().get("app")
    if built is None:
        built = globals()["app"] = _new_app([command for command, _, _ in COMMANDS])
    return built


def __getattr__(name: str) -> typer.Typer:
    """`app`, the whole application (built at its first use: the console
    script builds only the command it runs)."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _whole_app()
