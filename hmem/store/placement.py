"""Where an open store's bytes live: the one seam between the store engine
and its storage (docs/architecture.md, "Where bytes live").

The engine always works on a local directory: the store itself, or, for a
store on object storage, a working copy of it.  What differs by where the
store lives is said here, by a Placement the `Store` facade holds and calls
at fixed points, never by a branch on the kind of store:

- `DirectoryPlacement`: the directory is the store.  Its shard files are
  mapped in place, its commits are durable where they are made, and there
  is nothing to publish or list besides it; a reader's refresh opens the
  newest commit again when index.json changed.
- `hmem.store.object_link.ObjectLink`: a store on object storage (S3, or
  memory:// in the process), imported only when one is opened.  Commits
  are published by conditional writes, shard bytes are fetched by range as
  reads need them, and a reader takes newer commits on refresh.

A shard cache reads the shards that are not files of the directory
through a `ShardSource` (object storage's is hmem/store/object_fetch.py),
each one a `FetchedFile`.  `Opened` is what making or opening a store
gives the facade: the state and its placement (hmem/store/opening.py).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import numpy as np

from hmem.store.state import open_reader

if TYPE_CHECKING:
    from pathlib import Path

    from hmem.formats.manifest import ShardInfo
    from hmem.store.results import RemoteStats, StoreHealth
    from hmem.store.state import StoreState


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What differs between the places a store can live."""

    # shard files are mapped where they lie, rather than fetched by range
    # into a sparse local copy first
    maps_in_place: bool
    # a commit is published by a write conditional on the one it replaces
    # (which also fences out a writer whose lease lapsed), rather than by
    # renames under a lock file
    conditional_writes: bool
    # a reader takes newer commits without opening again (Store.refresh)
    refreshes: bool
    # orphans (what a writer that stopped before its commit left) are found
    # by listing the place, beside the compaction plan's own orphan files
    lists_orphans: bool


class FetchedFile(Protocol):
    """A shard kept elsewhere, mirrored into a local sparse file whose
    bytes are fetched by range as reads need them."""

    @property
    def path(self) -> Path:
        """The local file."""

    @property
    def fd(self) -> int:
        """Its open descriptor (the reader maps a duplicate of it)."""

    @property
    def head(self) -> tuple[int, bytes | memoryview] | None:
        """(data start, index bytes) given with the store's state, when they
        were: the file's first block need not be fetched to read its index."""

    def ensure(self, start: int, end: int) -> None:
        """Make bytes [start, end) of the file present."""


class ShardSource(Protocol):
    """Where the shards of a store that are not files of its directory come
    from (a shard cache's source; None for a store in a directory)."""

    def remote_bytes(self, uid: str) -> int | None:
        """The size of shard `uid` where it is kept, or None when its file is
        local (a shard this writer made)."""

    def source(self, uid: str) -> FetchedFile | None:
        """The local mirror of shard `uid`, or None when its file is local."""

    def fetch_heads(self, uids: list[str]) -> None:
        """The header and index of each of these shards whose head the
        state did not give, fetched together."""

    def fetch_ranges(self, spans: list[tuple[str, int, int]]) -> None:
        """Make each (shard uid, start, end) present, fetched together."""


class Placement(Protocol):
    """What the facade asks of where a store lives."""

    @property
    def location(self) -> str:
        """What the store was opened as: a directory or a URL."""

    capabilities: Capabilities

    def attach(self, state: StoreState) -> None:
        """Let `state` read through this placement (its shard cache's source)."""

    def after_write(self, state: StoreState, *, snapshot: bool = False, data_only: bool = False) -> None:
        """After a write of `state` committed: make that commit the store's
        own where it lives (nothing when it is there already)."""

    def before_close(self, state: StoreState) -> None:
        """A writer closing, everything committed and published: leave the
        store quickest to open next."""

    def newer_state(self, state: StoreState) -> StoreState | None:
        """A reader's refresh: the store's newest commit, loaded beside
        `state` without its lock, or None when `state` is the newest."""

    def swap_in(self, old: StoreState, fresh: StoreState) -> None:
        """`fresh` replaces `old` (the facade holds old's lock exclusively)."""

    def forget(self, old: StoreState) -> None:
        """`old` was replaced and shut: free what it held."""

    def orphan_sizes(self) -> dict[str, int]:
        """Objects beside the store that no commit names, with their sizes
        (a directory's own orphan files are the compaction plan's)."""

    def remove_orphans(self) -> dict[str, int]:
        """Delete those (a writer's job); returns what was deleted."""

    def checked_health(self, health: StoreHealth, shards: list[ShardInfo], shard_of: np.ndarray) -> StoreHealth:
        """`health` (the local files' check) with what the storage itself says."""

    def report(self) -> RemoteStats | None:
        """The storage's own figures for StoreStats.remote (None: a directory)."""

    def close(self) -> None:
        """The store closed: let the storage go."""


class DirectoryPlacement:
    """A store in a local directory: the engine's files are the store."""

    capabilities = Capabilities(maps_in_place=True, conditional_writes=False, refreshes=True, lists_orphans=False)

    def __init__(self, location: str) -> None:
        self.location = location

    def attach(self, state: StoreState) -> None:
        pass

    def after_write(self, state: StoreState, *, snapshot: bool = False, data_only: bool = False) -> None:
        pass  # a local commit is durable where it was made

    def before_close(self, state: StoreState) -> None:
        pass

    def newer_state(self, state: StoreState) -> StoreState | None:
        if not state.store_changed():  # one read of index.json
            return None
        return open_reader(state.path, state.verify_reads)

    def swap_in(self, old: StoreState, fresh: StoreState) -> None:
        fresh.cache.capacity = old.cache.capacity  # the bound open() was given, if any

    def forget(self, old: StoreState) -> None:
        pass

    def orphan_sizes(self) -> dict[str, int]:
        return {}

    def remove_orphans(self) -> dict[str, int]:
        return {}

    def checked_health(self, health: StoreHealth, shards: list[ShardInfo], shard_of: np.ndarray) -> StoreHealth:
        return health

    def report(self) -> RemoteStats | None:
        return None

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class Opened:
    """A store just made or opened: its state, where it lives, and what the
    open found."""

    state: StoreState
    placement: Placement
    # (position, entry id or None) of each damaged record a reader opened with on_damage="skip" reads past
    damaged_records: tuple[tuple[int, int | None], ...] = ()
    refresh_seconds: float | None = None  # a reader of a store on object storage: its refresh interval
