"""Where an open store's bytes live: the one seam between the store engine
and its storage (docs/architecture.md, "Where bytes live").

The engine always works on a local directory: the store itself, or, for a
store on object storage, a working copy of it.  What differs by where the
store lives is said here, by a Placement the `Store` facade holds and calls
at fixed points, never by a branch on the kind of store:

- `DirectoryPlacement`: the directory is the store.  Its shard files are
  mapped in place, its commits are durable where they are made, and there
  is nothing to publish, refresh or list besides it.
- `hmem.store.object_link.ObjectLink`: a store on object storage (S3, or
  memory:// in the process), imported only when one is opened.  Commits
  are published by conditional writes, shard bytes are fetched by range as
  reads need them, and a reader takes newer commits on refresh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from hmem.formats.manifest import ShardInfo
    from hmem.store.results import RemoteStats, StoreHealth
    from hmem.store.state import StoreState


class Placement(Protocol):
    """What the facade asks of where a store lives."""

    @property
    def location(self) -> str:
        """What the store was opened as: a directory or a URL."""

    # shard files are mapped where they are (a directory), rather than
    # fetched by range into a sparse local copy first (object storage)
    maps_in_place: bool

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

    maps_in_place = True

    def __init__(self, location: str) -> None:
        self.location = location

    def attach(self, state: StoreState) -> None:
        pass

    def after_write(self, state: StoreState, *, snapshot: bool = False, data_only: bool = False) -> None:
        pass  # a local commit is durable where it was made

    def before_close(self, state: StoreState) -> None:
        pass

    def newer_state(self, state: StoreState) -> StoreState | None:
        return None  # a local reader sees commits when it opens again

    def swap_in(self, old: StoreState, fresh: StoreState) -> None:
        raise AssertionError("a store in a directory is never refreshed")

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
