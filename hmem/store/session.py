"""An open store's session: its state and the components working on it,
where its bytes live, and the life of the three together.

The `Store` facade holds one Session.  The session owns what outlives a
single call: the state and its components (swapped as one object by a
refresh, so none keeps a closed state), the Placement (hmem/store/placement.py)
told after every write and at close, the refresh policy of a reader of a
store on object storage, and the finalizer that lets the lock and the
storage go when a store is dropped unclosed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import weakref
from collections.abc import Iterator

from hmem.store.chunks import Chunks
from hmem.store.compaction import Compaction
from hmem.store.eviction import Eviction
from hmem.store.placement import Placement
from hmem.store.prepare import PreparedBatch
from hmem.store.queries import Queries
from hmem.store.reading import EntryReader
from hmem.store.state import StoreState
from hmem.store.writer import Writer


@dataclasses.dataclass(frozen=True)
class Components:
    """A state and the components that work on it, made together and
    replaced together."""

    state: StoreState
    reader: EntryReader
    writer: Writer
    queries: Queries
    compaction: Compaction
    eviction: Eviction
    chunks: Chunks

    @classmethod
    def of(cls, state: StoreState) -> Components:
        reader, writer = EntryReader(state), Writer(state)
        compaction, chunks = Compaction(state, writer, reader), Chunks(state, reader)
        eviction = Eviction(state, writer, compaction, chunks)
        return cls(state, reader, writer, Queries(state, reader), compaction, eviction, chunks)


class Session:
    """One open store: its components, its placement and their lifetime."""

    def __init__(self, state: StoreState, placement: Placement, *, refresh_seconds: float | None = None) -> None:
        placement.attach(state)
        self.components = Components.of(state)
        self.placement = placement
        # A store dropped unclosed lets its lock and its storage go when
        # collected.  A finalizer (not __del__) so that a closed store runs
        # no Python code when collected: a signal arriving then would be
        # lost in a destructor.
        self._release_unclosed = weakref.finalize(self, _release, state, placement)
        self._refresh_seconds = refresh_seconds
        self._refreshed = time.monotonic()
        self._refresh_lock = threading.Lock()  # one refresh at a time

    @property
    def state(self) -> StoreState:
        return self.components.state

    # ---- the store's lock, held over the components of one state -------------------

    def reading(self) -> contextlib.AbstractContextManager[Components]:
        """A read: the lock shared, the store checked open."""
        return self._held("shared", writable=False)

    def planning(self) -> contextlib.AbstractContextManager[Components]:
        """A read of many parts of the state (stats, the plans) or a put or
        flush: the lock in intent mode, so no other write runs meanwhile."""
        return self._held("intent", writable=False)

    def writing(self, *, exclusive: bool = True) -> contextlib.AbstractContextManager[Components]:
        """A write: the lock exclusive (or in intent mode for a flush, which
        reads go on beside), the store checked writable."""
        return self._held("exclusive" if exclusive else "intent", writable=True)

    @contextlib.contextmanager
    def _held(self, mode: str, *, writable: bool) -> Iterator[Components]:
        while True:
            parts = self.components
            with getattr(parts.state.lock, mode)():
                if parts is not self.components:
                    continue  # a refresh swapped the state before the lock was had: take the new one's
                if writable:
                    parts.state.check_writable()
                else:
                    parts.state.check_open()
                yield parts
                return

    def insert(self, batch: PreparedBatch) -> list[int]:
        """Store a checked batch, beside queries (they see it whole at its
        end: hmem/store/writer.py); only a put that must evict goes alone.
        The batch's memory goes back to the pool: copied into the shard, or not stored."""
        try:
            with self.writing(exclusive=False) as parts:
                if not parts.eviction.needs_room(batch):
                    ids = parts.writer.insert(batch)
                    self.publish(data_only=True)
                    return ids
                with parts.state.lock.exclusive():
                    parts.eviction.make_room(batch)
                    ids = parts.writer.insert(batch)
                    self.publish(data_only=True)  # the limits may have evicted and committed
                    return ids
        finally:
            batch.release()

    def publish(self, *, snapshot: bool = False, data_only: bool = False) -> None:
        """After a write: make its commit the store's own where it lives."""
        self.placement.after_write(self.state, snapshot=snapshot, data_only=data_only)

    # ---- a reader of a store on object storage ---------------------------------------

    def refresh(self, *, wait: bool) -> bool:
        """Take the newest commit, if there is one (Store.refresh); without
        `wait`, nothing when another thread is refreshing already."""
        self._refreshed = time.monotonic()
        if not self.placement.capabilities.refreshes or not self.state.read_only:
            return False  # a local store is seen anew when opened again; a writer holds the newest
        if not self._refresh_lock.acquire(blocking=wait):
            return False  # another thread is refreshing: this read goes on with the commit it has
        try:
            old = self.state
            old.check_open()
            # loaded without the store's lock: queries go on meanwhile, on the commit they have
            fresh = self.placement.newer_state(old)
            if fresh is None:
                return False
            fresh.chunk_index.carry(old.chunk_index)  # the shards both have are not read again
            with old.lock.exclusive():
                self.placement.swap_in(old, fresh)
                self.components = Components.of(fresh)  # one object: every component with its state
                old.shut()
            self.placement.forget(old)
            return True
        finally:
            self._refresh_lock.release()

    def maybe_refresh(self) -> None:
        """Before a read: refresh when the store's refresh interval has passed."""
        if self._refresh_seconds is not None and time.monotonic() - self._refreshed >= self._refresh_seconds:
            self.refresh(wait=False)

    # ---- end -------------------------------------------------------------------------

    def close(self) -> None:
        """Flush (a writer), publish, release the lock and drop the memory maps.  Idempotent."""
        state = self.state
        with state.lock.exclusive():
            if state.closed:
                return
            try:
                if not state.read_only:
                    self.components.writer.close()
                    self.publish()
                    self.placement.before_close(state)
            finally:
                state.shut()
                self._release_unclosed.detach()
                self.placement.close()


def _release(state: StoreState, placement: Placement) -> None:
    """An unclosed store's lock and storage go back.  A shard a put was
    still making durable is waited for first: no file is renamed into the
    store once another writer may have it (the shard itself is not committed)."""
    if state.writer is not None:
        for sealing in state.sealing:
            sealing.wait()
        state.writer.release()
    placement.close()
