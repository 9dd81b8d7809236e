"""Library hints say what to do in library terms; the command line words each
as the hmem command or flag that does it (hmem/cli/exit_codes.py)."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

import hmem
from hmem import Hint, HmemError, StoreLockedError
from hmem.cli.app import HmemGroup, app
from hmem.cli.exit_codes import HINT_WORDING, ExitCode, cli_hint

HINTS = {name: value for name, value in vars(Hint).items() if name.isupper() and isinstance(value, str)}

EXPECTED = {
    "VERIFY": "run 'hmem verify'",
    "VERIFY_FULL": "run 'hmem verify --full'",
    "REPAIR": "run 'hmem verify --repair'",
    "VERIFY_THEN_REPAIR": "run 'hmem verify --full', then 'hmem verify --repair'",
    "LOCK_WAIT": "wait for it to finish, or retry with a lock wait such as --lock-wait 30",
    "CREATE": "create one with 'hmem init'",
    "OPEN_AGAIN": "try the command again",
    "REFRESH": "try the command again",
    "ROLL_FORWARD": "run 'hmem verify --repair': it rolls the store forward and keeps every intact entry",
}

LIBRARY_TERMS = ("hmem.", "(path", "lock_wait=", "Store.", "full=True")


def test_every_hint_has_a_cli_wording():
    assert set(HINTS) == set(EXPECTED)
    assert set(HINT_WORDING) == set(HINTS.values())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hint_wording(name):
    wording = cli_hint(HINTS[name])
    assert wording == EXPECTED[name]
    assert wording != HINTS[name]
    assert not any(term in wording for term in LIBRARY_TERMS), wording
    # each names what to run: an hmem command, a flag, or the command itself
    assert "'hmem " in wording or "--" in wording or "the command" in wording


def test_other_hints_pass_through():
    assert cli_hint("pass --yes to go ahead") == "pass --yes to go ahead"
    assert cli_hint(None) is None


def _app_raising(exc: BaseException) -> typer.Typer:
    probe = typer.Typer(cls=HmemGroup)

    @probe.command()
    def boom() -> None:
        raise exc

    @probe.command()
    def other() -> None:
        pass

    return probe


def test_a_lock_wait_hint_is_printed_with_the_flag():
    exc = StoreLockedError("store is locked by another process", hint=Hint.LOCK_WAIT)
    result = CliRunner().invoke(_app_raising(exc), ["boom"])
    assert result.exit_code == ExitCode.LOCKED
    lines = result.stderr.strip().splitlines()
    assert lines == [
        "error: store is locked by another process "
        "(wait for it to finish, or retry with a lock wait such as --lock-wait 30)"
    ]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_hint_is_printed_in_cli_terms(name):
    result = CliRunner().invoke(_app_raising(HmemError("it broke", hint=HINTS[name])), ["boom"])
    assert result.exit_code == ExitCode.FAILURE
    assert result.stderr.strip() == f"error: it broke ({EXPECTED[name]})"


def test_a_locked_store_tells_the_shell_user_about_lock_wait(tmp_path):
    store = tmp_path / "store"
    hmem.Store.create(store, hmem.StoreConfig(embed_dim=32, hdc_dim=256)).close()
    writer = hmem.Store.open(store)
    try:
        result = CliRunner().invoke(app, ["compact", str(store)], env={"HMEM_DEBUG": None})
    finally:
        writer.close()
    assert result.exit_code == ExitCode.LOCKED
    line = result.stderr.strip()
    assert line.startswith("error: ") and "--lock-wait" in line
    assert not any(term in line for term in LIBRARY_TERMS), line
