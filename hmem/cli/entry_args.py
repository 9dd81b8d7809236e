"""``[STORE] ID...``: the positional arguments of the commands that name
entries (`hmem show`, `hmem export`, `hmem rm`).  The store may be left out when
HMEM_STORE names it, as for every store command (docs/cli.md,
"Conventions"): the first argument is the store unless HMEM_STORE is set
and it is an entry id that names no store directory."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from hmem import InvalidArgumentError, is_store
from hmem.cli.options import STORE_ENV


def _argument(what: str, whose: str) -> typer.models.ArgumentInfo:
    return typer.Argument(
        metavar=f"[STORE] {what}",
        show_default=False,
        help=f"The store (may be left out when {STORE_ENV} is set), then {whose} ('hmem ls' lists them).",
    )


EntryIdArgument = Annotated[list[str], _argument("ID", "the entry's id")]
EntryIdsArgument = Annotated[list[str], _argument("ID...", "the entries' ids")]


def store_and_ids(args: list[str], *, one: bool) -> tuple[str, list[int]]:
    env = os.environ.get(STORE_ENV)
    if env and args and _is_id(args[0]) and not is_store(args[0]) and (not one or len(args) == 1):
        store, rest = env, args
    elif len(args) >= 2:
        store, rest = args[0], args[1:]
    else:
        what = "the entry id" if one else "at least one entry id"
        raise InvalidArgumentError(
            f"give the store and {what}", hint=f"or set {STORE_ENV} and give only the " + ("id" if one else "ids")
        )
    if one and len(rest) > 1:
        raise InvalidArgumentError(f"give one entry id, got {len(rest)}: {' '.join(rest)}")
    bad = [a for a in rest if not _is_id(a)]
    if bad:
        raise InvalidArgumentError(f"{bad[0]!r} is not an entry id (ids are whole numbers >= 0)")
    return store, [int(a) for a in rest]


def _is_id(text: str) -> bool:
    return text.isascii() and text.isdigit()
