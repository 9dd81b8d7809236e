"""``[STORE] ID...``: the positional arguments of the commands that name
entries (`hmem show`, `hmem export`, `hmem rm`).  The store may be left out when
HMEM_STORE names it, as for every store command (docs/cli.md,
"Conventions"): the first argument is the store unless HMEM_STORE is set
and it is an entry id that names no store directory.  `hmem show` and
`hmem rm` also take chunk keys (a store of chunks): any argument after the
store that is not a whole number."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from hmem import InvalidArgumentError, Store, is_store
from hmem.cli.options import STORE_ENV


def _argument(what: str, whose: str) -> typer.models.ArgumentInfo:
    return typer.Argument(
        metavar=f"[STORE] {what}",
        show_default=False,
        help=f"The store (may be left out when {STORE_ENV} is set), then {whose} ('hmem ls' lists them).",
    )


EntryIdArgument = Annotated[list[str], _argument("ID", "the entry's id")]
EntryIdsArgument = Annotated[list[str], _argument("ID...", "the entries' ids")]
EntryOrChunkArgument = Annotated[list[str], _argument("ID|KEY", "the entry's id or a chunk's key")]
EntriesOrChunksArgument = Annotated[list[str], _argument("ID|KEY...", "the entries' ids or chunks' keys")]


def store_and_ids(args: list[str], *, one: bool) -> tuple[str, list[int]]:
    store, ids, keys = store_and_targets(args, one=one)
    if keys:
        raise InvalidArgumentError(f"{keys[0]!r} is not an entry id (ids are whole numbers >= 0)")
    return store, ids


def store_and_targets(args: list[str], *, one: bool) -> tuple[str, list[int], list[str]]:
    """The store, the entry ids and the chunk keys the arguments name."""
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
    return store, [int(a) for a in rest if _is_id(a)], [a for a in rest if not _is_id(a)]


def refuse_keys(keys: list[str], store: Store) -> None:
    """Chunk keys are names in a store of chunks only."""
    if keys and not store.config.chunks:
        raise InvalidArgumentError(
            f"{keys[0]!r} is not an entry id (ids are whole numbers >= 0), and {store.location} keeps no chunks"
        )


def _is_id(text: str) -> bool:
    return text.isascii() and text.isdigit()
