"""The application shell: version, entry points, error handling, colour."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

import hmem
from hmem import kernels
from hmem.cli import app as app_module
from hmem.cli.app import app
from hmem.cli.exit_codes import ERROR_EXIT_CODES, ExitCode, exit_code_for
from hmem.errors import HmemError, InvalidArgumentError, KernelUnavailableError

# Subprocesses start outside the checkout so that they import the installed
# hmem (with its compiled kernels), not the source tree on sys.path[0].
OUTSIDE_CHECKOUT = tempfile.gettempdir()


def run_python(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=OUTSIDE_CHECKOUT, capture_output=True, text=True, timeout=60, env=env
    )


def test_version_names_format_versions_and_kernel_path():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    formats = f"store format {hmem.FORMAT_VERSION}: reads {hmem.FORMAT_VERSION}, writes {hmem.FORMAT_VERSION}"
    obj = hmem.OBJECT_FORMAT_VERSION
    formats += f"; object-store format {obj}: reads {obj}, writes {obj}"
    formats += "; LMCache 0.5.6 caches: reads local_disk, fs and multiprocess, writes fs, and is its remote tier"
    assert result.stdout.strip() == (
        f"hmem {hmem.__version__} ({formats}; kernels: {kernels.KERNEL_SET}, cpu path: {kernels.cpu_path()})"
    )


@pytest.mark.stress
def test_python_dash_m_and_exit_code_pass_through():
    proc = run_python("-m", "hmem", "prefix-hit", "-c", "2", "-w", "x")
    assert proc.returncode == ExitCode.USAGE
    assert proc.stderr.startswith("error: --windows")
    proc = run_python("-m", "hmem", "--version")
    assert proc.returncode == 0 and proc.stdout.startswith("hmem ")


def test_no_arguments_prints_help_with_usage_code():
    result = CliRunner().invoke(app, [])
    assert result.exit_code == ExitCode.USAGE
    assert "prefix-hit" in result.output


def test_help_lists_each_command_in_one_sentence_and_wraps_at_the_terminal_width():
    # Rich help keeps the line breaks it is given: each command's summary (the
    # first paragraph of its help) is one line, and its paragraphs are one
    # line each, for the terminal to wrap, not the source's hard wrapping.
    for info in app.registered_commands:
        summary, *rest = app_module.help_text(info.callback.__doc__).split("\n\n")
        assert "\n" not in summary and len(summary) <= 100, (info.name, summary)
        assert all("\n" not in p for p in rest), info.name
    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0
    listed = [line for line in result.output.splitlines() if line.startswith("│ stats ")]
    assert len(listed) == 1 and "Show what a store holds: entries, layers, shards, bytes, health." in listed[0]
    result = CliRunner().invoke(app, ["show", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    # the second paragraph, four lines in the source, runs on past the source's first break
    assert any(
        line.strip().startswith("The metadata: layer,") and "source file and token range." in line
        for line in result.output.splitlines()
    ), result.output


def test_exit_codes_are_stable():
    # Scripts depend on these numbers: changing one is a breaking change.
    assert {c.name: c.value for c in ExitCode} == {
        "OK": 0,
        "FAILURE": 1,
        "USAGE": 2,
        "PARTIAL": 3,
        "PROBLEMS_FOUND": 4,
        "NOT_A_STORE": 5,
        "LOCKED": 6,
        "UNSUPPORTED_FORMAT": 7,
        "INTERRUPTED": 130,
        "NO_PERMISSION": 8,
        "NO_SPACE": 9,
        "BAD_PATH": 10,
        "UNAVAILABLE": 11,
        "BROKEN_PIPE": 141,
        "TERMINATED": 143,
    }
    assert exit_code_for(InvalidArgumentError("x")) == ExitCode.USAGE
    assert exit_code_for(KernelUnavailableError("x")) == ExitCode.FAILURE
    assert exit_code_for(hmem.ObjectStoreError("x")) == ExitCode.UNAVAILABLE
    assert exit_code_for(RuntimeError("x")) == ExitCode.FAILURE
    assert all(issubclass(cls, BaseException) for cls, _ in ERROR_EXIT_CODES)


def _app_raising(exc: BaseException) -> typer.Typer:
    probe = typer.Typer(cls=app_module.HmemGroup)

    @probe.command()
    def boom() -> None:
        raise exc

    @probe.command()
    def other() -> None:
        pass

    return probe


@pytest.mark.parametrize(
    "exc, code, line",
    [
        (HmemError("it broke", hint="do this"), ExitCode.FAILURE, "error: it broke (do this)"),
        (KeyboardInterrupt(), ExitCode.INTERRUPTED, "error: interrupted"),
        (ZeroDivisionError("bad"), ExitCode.FAILURE, "error: internal error: ZeroDivisionError: bad"),
    ],
)
def test_errors_become_one_line_and_exit_code(exc, code, line):
    result = CliRunner().invoke(_app_raising(exc), ["boom"])
    assert result.exit_code == code
    assert result.stderr.startswith(line)
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_debug_shows_traceback(monkeypatch):
    monkeypatch.setenv("HMEM_DEBUG", "1")
    result = CliRunner().invoke(_app_raising(HmemError("it broke")), ["boom"])
    assert result.exit_code == ExitCode.FAILURE
    assert "Traceback" in result.stderr
    assert result.stderr.strip().endswith("error: it broke")


def test_no_ansi_when_not_a_terminal_or_no_color(monkeypatch):
    args = ["prefix-hit", "-c", "4", "-w", "-1", "-g", "0-2"]
    plain = CliRunner().invoke(app, args)
    assert "\x1b[" not in plain.stdout
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("FORCE_COLOR", "")
    env = {**os.environ, "NO_COLOR": "1", "TERM": "xterm-256color"}
    proc = run_python("-m", "hmem", *args, env=env)
    assert proc.returncode == 0
    assert "\x1b[" not in proc.stdout


def test_missing_kernels_is_a_clear_error():
    # A checkout without the compiled extension: importing hmem from the
    # source tree with the native kernels asked for must fail loudly.
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'hmem.kernels._native._bitops': raise ImportError('no compiled module')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from hmem.cli import main\n"
        "sys.argv = ['hmem', '--version']\n"
        "main()\n"
    )
    proc = run_python("-c", code, env={**os.environ, "HMEM_KERNELS": "native"})
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: hmem's compiled kernels cannot be loaded")
    assert "HMEM_KERNELS=reference" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.stress
def test_a_command_line_naming_a_command_runs_it_alone_and_others_see_every_command(tmp_path):
    # The console script builds only the command that the command line names
    # first (start-up: hmem/cli/app.py, _app_for); everything else goes
    # through the whole application, unchanged.
    only = app_module._app_for(["stats", "somewhere"])
    assert [info.name for info in only.registered_commands] == ["stats"]
    assert len(app.registered_commands) == 14  # the application itself keeps them all
    for args in ([], ["--help"], ["--debug", "stats"], ["stat"], ["--version", "stats"]):
        assert app_module._app_for(args) is app
    assert app_module._app_for(["--version"]).registered_commands == []  # it runs no command
    version = run_python("-m", "hmem", "--version")
    assert version.returncode == 0 and version.stdout.strip() == app_module.version_text()
    store = tmp_path / "s"
    assert run_python("-m", "hmem", "init", str(store), "-d", "8").returncode == 0
    stats = run_python("-m", "hmem", "stats", str(store), "--json")
    assert stats.returncode == 0 and json.loads(stats.stdout)["entries"] == 0
    helped = run_python("-m", "hmem", "put", "--help")
    assert helped.returncode == 0 and "Usage: hmem put [OPTIONS]" in helped.stdout
    wrong = run_python("-m", "hmem", "stats", str(store), "--bogus", "--json")
    assert wrong.returncode == 2 and "No such option: --bogus" in wrong.stderr
    assert json.loads(wrong.stdout)["error"]["code"] == "usage"  # --json read before parsing, as before
    misspelt = run_python("-m", "hmem", "stat", str(store))
    assert misspelt.returncode == 2 and "No such command 'stat'" in misspelt.stderr
    # ... and imports only that command's module; `import hmem` leaves the
    # prefix-hit operators, verify/repair and export until they are used
    probe = run_python(
        "-c",
        "import sys; from hmem.cli.app import _app_for; _app_for(['stats']); "
        "print(sorted(m for m in sys.modules if m.startswith(('hmem.cli.cmd_', "
        "'hmem.recovery', 'hmem.prefix_hit.explain', 'hmem.transfer.kv_export'))))",
    )
    assert probe.stdout.split() == ["['hmem.cli.cmd_stats']"]


@pytest.mark.stress
def test_a_command_under_json_does_not_import_rich(tmp_path):
    # Rich is imported at the first thing printed through it (start-up:
    # hmem/cli/output.py); scripts and cron jobs run commands under --json.
    # The object-store code is imported where such a store is opened.
    from safetensors.numpy import save_file

    store, files, empty = tmp_path / "s", tmp_path / "files", tmp_path / "empty"
    files.mkdir()
    empty.mkdir()
    rows = np.arange(32, dtype=np.float32).reshape(4, 8)
    save_file({"keys": rows, "values": rows}, str(files / "one.safetensors"))
    assert run_python("-m", "hmem", "init", str(store), "-d", "8").returncode == 0
    for args, code in (
        (["put", str(store), str(files)], 0),
        (["stats", str(store)], 0),
        (["ls", str(store)], 0),
        (["verify", str(store)], 0),
        (["put", str(store), str(empty)], 2),
    ):
        proc = run_python("-X", "importtime", "-m", "hmem", *args, "--json")
        assert proc.returncode == code, proc.stderr[-500:]
        json.loads(proc.stdout)  # a result, or an error as one JSON document
        imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line]
        assert "typer" in imported  # the probe sees the imports
        assert not [m for m in imported if m.split(".")[0] == "rich"], args
        # a local store's command imports no object-store code either
        assert not [
            m
            for m in imported
            if m in ("hmem.store.object_link", "hmem.formats.objects", "hmem.store.object_fetch", "hmem.store.lease")
        ], args
    human = run_python("-m", "hmem", "ls", str(store))  # ... and human output still has it
    assert human.returncode == 0 and "┃ id ┃" in human.stdout and "1 entries, by id" in human.stdout


@pytest.mark.stress
def test_reference_kernels_are_explicit():
    proc = run_python("-m", "hmem", "--version", env={**os.environ, "HMEM_KERNELS": "reference"})
    assert proc.returncode == 0
    assert "kernels: reference" in proc.stdout
    proc = run_python("-m", "hmem", "--version", env={**os.environ, "HMEM_KERNELS": "bogus"})
    assert proc.returncode == 1
    assert "unknown HMEM_KERNELS" in proc.stderr


def test_every_public_name_of_hmem_resolves_also_those_imported_at_first_use():
    # hmem/__init__.py imports some names only when first asked for (start-up);
    # each must still be what its module defines, and dir() must list it.
    import importlib

    for name in hmem.__all__:
        assert getattr(hmem, name) is not None
        assert name in dir(hmem)
    for name, (module, attribute) in hmem._LAZY.items():
        assert name in hmem.__all__
        assert getattr(hmem, name) is getattr(importlib.import_module(module), attribute)
    try:
        hmem.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("an unknown name must raise AttributeError")


@pytest.mark.stress
def test_a_command_ends_without_teardown_but_with_all_its_output(tmp_path):
    # The console script ends with os._exit once the command returns
    # (hmem/cli/app.py, _end_process): every buffered line must still reach
    # stdout and stderr, and the exit code must be the command's.
    import numpy as np

    store = tmp_path / "s"
    with hmem.Store.create(store, embed_dim=8) as s:
        s.put_many((np.full((2, 8), i, np.float32), np.ones((2, 8), np.float32)) for i in range(3000))
    listed = run_python("-m", "hmem", "ls", str(store), "--jsonl")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert len(lines) == 3000 and json.loads(lines[-1])["entry_id"] == 3000
    missing = run_python("-m", "hmem", "stats", str(tmp_path / "nowhere"), "--json")
    assert missing.returncode == ExitCode.NOT_A_STORE
    assert missing.stderr.startswith("error: ") and json.loads(missing.stdout)["error"]["code"]
