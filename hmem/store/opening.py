"""Making and opening stores: the arguments of Store.create and Store.open
checked and the place chosen from the location.

This is the one module of the engine that chooses where a store's bytes
live: a directory is opened here, and a URL is handed to the object-storage
backend (hmem/store/object_opening.py), imported only when one is opened
so that a local store's commands start without the object-store code
(docs/benchmarks.md, "Command start-up").  Both give an `Opened`
(hmem/store/placement.py): a state and its Placement, which the facade
wraps in a Session.  A directory's own making and opening, which the
object-storage backend does on its working copy too, are in
hmem/store/directory.py.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from hmem import validation
from hmem.config import MAX_OPEN_SHARDS, StoreConfig
from hmem.errors import InvalidArgumentError
from hmem.object_store import is_url
from hmem.store.directory import create_directory, open_writer
from hmem.store.placement import DirectoryPlacement, Opened
from hmem.store.state import open_reader


def config_of(config: StoreConfig | None, settings: dict[str, Any]) -> StoreConfig:
    """The StoreConfig Store.create is given: one, or its settings by name."""
    if config is None:
        known = {f.name for f in dataclasses.fields(StoreConfig)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise InvalidArgumentError(
                f"unknown store setting(s): {', '.join(unknown)}", hint="settings are " + ", ".join(sorted(known))
            )
        return StoreConfig(**settings)
    if settings:
        raise InvalidArgumentError("give either a StoreConfig or settings, not both")
    if not isinstance(config, StoreConfig):
        raise InvalidArgumentError(f"config must be a StoreConfig, got {type(config).__name__}")
    return config


def create_store(path: str | os.PathLike, config: StoreConfig, storage_options: dict[str, Any] | None) -> Opened:
    """A new store at `path` (a missing or empty directory, or a URL holding
    no store), opened for writing."""
    if is_url(path):
        from hmem.store import object_opening  # the object-storage backend, where one is made

        return object_opening.create_store(str(path), config, storage_options)
    _local_only(storage_options)
    root = Path(validation.store_directory(path))  # "" and a file refused, as for every command
    return Opened(create_directory(root, config), DirectoryPlacement(str(root)))


def open_store(
    path: str | os.PathLike,
    read_only: bool,
    verify_reads: bool,
    lock_wait: float,
    storage_options: dict[str, Any] | None,
    refresh_seconds: float | None,
    max_open_shards: int | None,
    on_damage: str,
) -> Opened:
    """An existing store at `path`, for reading or writing (Store.open)."""
    lock_wait = validation.wait_seconds(lock_wait, "lock_wait")
    read_only = validation.flag(read_only, "read_only")
    verify_reads = validation.flag(verify_reads, "verify_reads")
    validation.choice(on_damage, "on_damage", ("raise", "skip"))
    if on_damage == "skip" and not read_only:
        raise InvalidArgumentError(
            "on_damage='skip' opens a store for reading only: give read_only=True",
            hint="a writer never works past damage; salvage it with hmem.repair(path)",
        )
    if max_open_shards is not None:
        max_open_shards = validation.integer(max_open_shards, "max_open_shards", low=1, high=MAX_OPEN_SHARDS)
    if is_url(path):
        from hmem.store import object_opening  # the object-storage backend, where one is opened

        if refresh_seconds is not None:
            refresh_seconds = validation.number(refresh_seconds, "refresh_seconds", low=0.0)
        opened = object_opening.open_store(
            str(path),
            read_only=read_only,
            verify_reads=verify_reads,
            lock_wait=lock_wait,
            storage_options=storage_options,
            refresh_seconds=refresh_seconds,
        )
    else:
        _local_only(storage_options)
        if refresh_seconds is not None:
            raise InvalidArgumentError("refresh_seconds applies to stores on object storage only")
        root = Path(validation.store_directory(path))  # "" and a file refused, as for every command
        damaged: list[tuple[int, int | None]] = []
        if read_only:
            state = open_reader(root, verify_reads, skipped=damaged if on_damage == "skip" else None)
        else:
            state = open_writer(root, verify_reads, lock_wait)
        opened = Opened(state, DirectoryPlacement(str(root)), tuple(damaged))
    if max_open_shards is not None:  # in place of the store's setting, which stays as it is
        opened.state.cache.capacity = max_open_shards
    return opened


def _local_only(storage_options: Any) -> None:
    if storage_options is not None:
        raise InvalidArgumentError("storage_options apply to stores on object storage (s3://...) only")
