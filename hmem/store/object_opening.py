"""Making and opening a store on object storage (s3://, memory://): the
object-storage backend's side of hmem/store/opening.py.

The engine works on a local working copy of the store (a directory of the
link's cache), made and opened as any store directory is; the ObjectLink
(hmem/store/object_link.py) ties it to the objects: a lease in place of
the lock, the first commit create-only, the manifest fenced under the
lease before a writer writes (docs/format.md, "Stores on object storage").
"""

from __future__ import annotations

from typing import Any

from hmem.config import StoreConfig
from hmem.store.directory import create_directory, open_writer
from hmem.store.object_link import ObjectLink
from hmem.store.placement import Opened
from hmem.store.state import StoreState, open_reader


def create_store(url: str, config: StoreConfig, storage_options: dict[str, Any] | None) -> Opened:
    """A new store at `url` (refused if it holds one or anything else),
    opened for writing under this process's lease."""
    link = ObjectLink(url, storage_options)
    link.use_state_cache()
    state: StoreState | None = None
    try:
        link.claim_new()
        state = create_directory(link.workdir / "store-0", config)
        link.create(state.path, state.committed)
        return Opened(state, link)
    except BaseException:
        if state is not None:
            state.shut()
        link.close()
        raise


def open_store(
    url: str,
    *,
    read_only: bool,
    verify_reads: bool,
    lock_wait: float,
    storage_options: dict[str, Any] | None,
    refresh_seconds: float | None,
) -> Opened:
    """The store at `url`: a reader's view of its last commit, or a
    writer's, once the lease is taken (waiting up to `lock_wait` seconds,
    infinity as long as it takes) and the manifest fenced."""
    link = ObjectLink(url, storage_options)
    link.use_state_cache()
    try:
        link.read_manifest()  # "not a store" before any lease is taken
        if read_only:
            state = open_reader(link.materialize(), verify_reads)
        else:
            link.take_lease(lock_wait)
            link.fence()
            state = open_writer(link.materialize(), verify_reads, 0.0)
            link.published_generation = state.committed.generation
            link.published_local = state.committed
    except BaseException:
        link.close()
        raise
    return Opened(state, link, refresh_seconds=refresh_seconds)
