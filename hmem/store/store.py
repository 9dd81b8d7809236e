"""Store: the persistent tier-3 K/V memory, hmem's main object.

A facade: it checks arguments, takes the store's lock (hmem/store/rwlock.py)
and delegates (docs/architecture.md): opening to hmem/store/opening.py, the
open store's life (refresh, publishing where it lives, close) to its Session,
the work to the components of one StoreState (writer, queries, reader,
eviction, compaction).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from hmem import validation
from hmem.config import StoreConfig
from hmem.formats.sources import ImportedSource
from hmem.formats.store_files import is_store
from hmem.store import bridge, caches, listing, opening, prepare
from hmem.store.chunk_api import StoreChunks
from hmem.store.compaction import MIN_DEAD_SHARE
from hmem.store.listing import ENTRY_SORTS, EntryListing
from hmem.store.placement import Opened
from hmem.store.prepare import Entry
from hmem.store.queries import QueryOptions
from hmem.store.results import (
    CompactionPlan,
    CompactionReport,
    DeletePlan,
    EvictionPlan,
    QueryResults,
    StoredEntry,
    StoredKV,
    StoreStats,
)
from hmem.store.session import Session
from hmem.store.store_stats import store_stats

__all__ = ["Entry", "Store", "is_store"]


class Store:
    """A store directory opened for writing (one process at a time) or reading.

    Use ``Store.create`` or ``Store.open``; close it (or use ``with``) so that
    everything put is flushed and the write lock is released.

    A Store object may be shared between threads: reads run at the same
    time and beside put, put_many and flush; stats and the plans beside
    reads only; evict, delete, compact, record_source, close and a put the
    limits make evict alone.  Every read sees the state after some whole
    number of writes (docs/architecture.md, "Threads", has the lock table).
    """

    def __init__(self, opened: Opened) -> None:
        # the state, its components and where its bytes live, for as long as it is open
        self._session = Session(opened.state, opened.placement, refresh_seconds=opened.refresh_seconds)
        self.location: str = opened.placement.location  # what the store was opened as: a directory or a URL
        # (position, entry id or None) of each damaged record an on_damage="skip" reader reads past
        self.damaged_records = opened.damaged_records

    # the state as the last refresh left it, and where the store lives
    _state = property(lambda self: self._session.components.state)
    _placement = property(lambda self: self._session.placement)

    @property
    def path(self) -> Path:
        """The store's directory (for a store on object storage, its working copy)."""
        return self._state.path

    @property
    def config(self) -> StoreConfig:
        return self._state.config

    @property
    def read_only(self) -> bool:
        return self._state.read_only

    # ---- lifecycle -------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        path: str | os.PathLike,
        config: StoreConfig | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        **settings: Any,
    ) -> Store:
        """Create a new store at `path` (a missing or empty directory, or a URL
        s3://bucket/prefix holding no store) and open it for writing; give a
        StoreConfig or its settings.  `storage_options`: docs/cli.md, "Stores
        on object storage"."""
        return cls(opening.create_store(path, opening.config_of(config, settings), storage_options))

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        *,
        read_only: bool = False,
        verify_reads: bool = True,
        lock_wait: float = 0.0,
        storage_options: dict[str, Any] | None = None,
        refresh_seconds: float | None = None,
        max_open_shards: int | None = None,
        on_damage: str = "raise",
    ) -> Store:
        """Open an existing store: a directory, or a URL s3://bucket/prefix.

        A writer takes the store's lock (waiting up to `lock_wait` seconds),
        finishes what an interrupted writer left and removes its leftovers.
        A reader (`read_only`) takes no lock and sees the last commit.
        With `verify_reads`, every tensor's checksum is checked the first
        time it is read.

        On object storage the lock is a lease, `storage_options` give the
        endpoint, credentials, timeouts and the local cache, and a reader
        sees new commits after ``refresh()``, or by itself when a read comes
        `refresh_seconds` after its last look (docs/format.md, "Stores on
        object storage").  `lock_wait` may be infinite, never negative.

        `max_open_shards` bounds the shard files this Store keeps mapped, in
        place of the store's setting (which stays as it is).  `on_damage`:
        "raise" (a damaged record of entries.bin fails the open) or "skip",
        for a reader of a local store: each damaged record reads as an
        evicted entry, listed in ``damaged_records`` (docs/reliability.md,
        "Degraded reads").
        """
        options = (read_only, verify_reads, lock_wait, storage_options, refresh_seconds, max_open_shards, on_damage)
        return cls(opening.open_store(path, *options))

    def refresh(self) -> bool:
        """A reader: take the newest commit, if any (one read of index.json,
        or one request on object storage, when none); returns whether the
        store changed.  Queries go on while it is loaded and pause only while
        it is swapped in.  Nothing for a writer."""
        return self._session.refresh(wait=True)

    def flush(self) -> None:
        """Make every put and access count so far durable (hmem/store/writer.py).
        Queries of other threads go on while the files are written."""
        with self._session.writing(exclusive=False) as parts:
            parts.writer.flush(exact_ids=False)
            self._session.publish()

    def close(self) -> None:
        """Flush (a writer), release the lock and drop the memory maps.  Idempotent."""
        self._session.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = self._state
        mode = "closed" if state.closed else ("read-only" if state.read_only else "writer")
        return f"Store({str(self.path)!r}, {mode}, entries={state.live_count()})"

    # ---- writing ---------------------------------------------------------------------

    def put(self, keys: Any, values: Any, layer_idx: int = 0, importance: float = 1.0) -> int:
        """Store one entry; returns its id.  Bad input raises and stores nothing."""
        self._state.check_writable()  # checked and projected before the lock: queries go on meanwhile
        return self._session.insert(prepare.prepare(self._state, keys, values, layer_idx, importance))[0]

    def put_many(self, entries: Iterable[Entry | tuple]) -> list[int]:
        """Store many entries (Entry or (keys, values, layer_idx, importance)
        tuples); returns their ids in order.  Every entry is checked before
        any is stored, so one bad entry stores nothing (hmem/store/prepare.py)."""
        self._state.check_writable()
        return self._session.insert(prepare.prepare_all(self._state, entries))  # prepared before the lock, as in put

    def check_entries(self, entries: Iterable[Entry | tuple]) -> int:
        """Check entries as put_many would, storing nothing (also on a
        read-only store); returns how many there are."""
        with self._session.reading() as parts:
            batch = prepare.prepare_all(parts.state, entries)
            batch.release()
            return len(batch)

    # ---- reading ---------------------------------------------------------------------

    def query(
        self,
        query: Any,
        layer_idx: int,
        top_k: int = 5,
        *,
        rerank: bool = True,
        shortlist_factor: int = 4,
        framework: str = "numpy",
        count_access: bool = True,
        on_damage: str = "raise",
        search: str = "auto",
        token_rerank: int | None = None,
    ) -> QueryResults:
        """The `top_k` entries of layer `layer_idx` most similar to `query`
        ([n_tokens, embed_dim] or [embed_dim]), best first, ties to the
        lower id: ranked by signature, then with `rerank` a shortlist of
        shortlist_factor * top_k by the exact cosine of pooled keys.  Each
        result counts as an access (persisted by the next flush; not on a
        read-only store).  A damaged entry raises CorruptStoreError; with
        on_damage="skip" the next best takes its place and
        ``results.skipped`` names it.

        `search`: "full" compares every signature whole; "two-stage" scans
        their first 1024 bits for 50 x the shortlist first; "auto" (the
        default) takes two stages on layers of 100,000 entries and more
        with signatures of 4096 bits or more (docs/benchmarks.md, "Two-stage
        search"); "spans", the default on a store with span signatures,
        ranks each entry by the nearest of its mean and span signatures,
        so that a query of a few tokens finds the entry that holds them
        (docs/format.md, "Span signatures").

        `token_rerank`: re-rank the best `token_rerank` candidates (by pooled
        keys) by token-level max-sim, each query row's best cosine over the
        candidate's stored keys, averaged (``QueryResult.token_score``): a
        query as long as an entry finds the document it continues more
        often than by its mean (docs/benchmarks.md, "Token re-rank").  None
        (the default) takes the store's setting (StoreConfig.token_rerank),
        0 re-ranks by pooled keys alone.
        """
        options = QueryOptions(rerank, shortlist_factor, framework, count_access, on_damage, search, token_rerank)
        self._session.maybe_refresh()
        with self._session.reading() as parts:
            return parts.queries.query(query, layer_idx, top_k, options)

    def query_many(
        self,
        queries: Any,
        layer_idx: int,
        top_k: int = 5,
        *,
        rerank: bool = True,
        shortlist_factor: int = 4,
        framework: str = "numpy",
        count_access: bool = True,
        on_damage: str = "raise",
        search: str = "auto",
        token_rerank: int | None = None,
    ) -> list[QueryResults]:
        """query() of each item of `queries` (a list of [n_tokens, embed_dim]
        or [embed_dim] arrays, or one [n_queries, n_tokens, embed_dim]
        array): the same results as one query per item in turn, from one
        scan of the layer by one thread per core.  Every query is checked
        before any is answered and accesses are counted once all are: a bad
        query, or a damaged entry without on_damage="skip", counts nothing."""
        options = QueryOptions(rerank, shortlist_factor, framework, count_access, on_damage, search, token_rerank)
        self._session.maybe_refresh()
        with self._session.reading() as parts:
            return parts.queries.query_many(queries, layer_idx, top_k, options)

    def entry_ids(self, layer_idx: int | None = None) -> list[int]:
        """Ids of the live entries (of one layer, if given), ascending."""
        with self._session.reading() as parts:
            return parts.state.records["entry_id"][parts.reader.live_in(layer_idx)].tolist()

    def entries(self, layer_idx: int | None = None, *, sort: str = "id", limit: int | None = None) -> EntryListing:
        """The metadata of the live entries (of one layer, if given): a
        snapshot, iterated as EntryInfo.  `sort`: "id" ascending, "score"
        next to be evicted first, "accesses" most first, "age" oldest first,
        "size" largest first (ties to the lower id).  `limit` keeps the first
        `limit` of them; the listing's ``total`` counts all."""
        sort = validation.choice(sort, "sort", ENTRY_SORTS)
        keep = None if limit is None else validation.count(limit, "limit")
        self._session.maybe_refresh()
        with self._session.reading() as parts:
            live = parts.reader.live_in(layer_idx)
            columns = {name: parts.state.records[name][live] for name in listing.FIELDS}  # copies: a snapshot
        return listing.listing(columns, sort, keep, parts.state.entry_file_bytes)

    def stored_kv(self, entry_id: int) -> StoredKV:
        """One live entry's K/V exactly as its shard holds them (BF16 as its
        uint16 words, INT8 with its row scales), checksums checked as by get()."""
        with self._session.reading() as parts:
            return parts.reader.stored_kv(parts.reader.position(validation.integer(entry_id, "entry_id", low=0)))

    def get(self, entry_id: int) -> StoredEntry:
        """One live entry's metadata and K/V (read-only arrays, bit-exact as
        put).  Raises EntryNotFoundError for an id that is not live."""
        self._session.maybe_refresh()
        with self._session.reading() as parts:
            return parts.reader.entry(parts.reader.position(validation.integer(entry_id, "entry_id", low=0)))

    # ---- the import registry (hmem/formats/sources.py) --------------------------------

    def imported_sources(self) -> list[ImportedSource]:
        """Every source file recorded as imported, oldest first (unflushed included)."""
        with self._session.reading() as parts:
            return parts.state.imports.all(parts.state.committed.sources)

    def find_source(self, sha256: str, size: int) -> ImportedSource | None:
        """The latest import of a file with this content (SHA-256 in hex and
        size), if the store recorded one."""
        with self._session.reading() as parts:
            return parts.state.imports.find(parts.state.committed.sources, sha256, size)

    def record_source(self, name: str, sha256: str, size: int, entry_ids: Iterable[int]) -> ImportedSource:
        """Record that a file (its name, SHA-256 in hex and size) was imported
        as the entries `entry_ids` (consecutive, as one put_many hands them
        out); committed by the next flush, together with those entries."""
        with self._session.writing() as parts:
            return parts.state.imports.add(name, sha256, size, entry_ids, next_id=parts.state.next_id)

    # ---- eviction and compaction -----------------------------------------------------

    def plan_eviction(self, target_entries: int) -> EvictionPlan:
        """What evict(target_entries) would remove, without changing anything."""
        with self._session.planning() as parts:
            return parts.eviction.plan(validation.count(target_entries, "target_entries"))

    def evict(self, target_entries: int) -> int:
        """Evict the lowest-scored live entries (hmem/store/policy.py) until at
        most `target_entries` remain, durably; returns how many were evicted."""
        with self._session.writing() as parts:
            evicted = parts.eviction.evict(validation.count(target_entries, "target_entries"))
            self._session.publish()
            return evicted

    def plan_delete(self, entry_ids: Iterable[int]) -> DeletePlan:
        """Which of `entry_ids` delete() would remove, and which are not live."""
        ids = validation.entry_ids(entry_ids)
        with self._session.planning() as parts:
            return parts.eviction.plan_delete(ids)[0]

    def delete(self, entry_ids: Iterable[int], *, missing_ok: bool = False) -> DeletePlan:
        """Delete entries by id, durably when it returns; compaction frees
        their bytes.  An id naming no live entry raises EntryNotFoundError
        and deletes nothing, unless `missing_ok` (reported in ``missing``)."""
        ids = validation.entry_ids(entry_ids)
        with self._session.writing() as parts:
            plan = parts.eviction.delete(ids, missing_ok=validation.flag(missing_ok, "missing_ok"))
            self._session.publish()
            return plan

    def plan_compaction(self, *, min_dead_share: float = MIN_DEAD_SHARE, repack: bool = False) -> CompactionPlan:
        """What compact() (same options) would do and free at least (index.json shrinks too); changes nothing."""
        with self._session.planning() as parts:
            plan = parts.compaction.plan(
                validation.share(min_dead_share, "min_dead_share"), repack=validation.flag(repack, "repack")
            )
        # on object storage, also the objects no commit names (a writer that stopped before its commit)
        return plan.with_orphan_objects(self._placement.orphan_sizes())

    def compact(
        self,
        min_reclaim_share: float = 0.0,
        *,
        progress: Callable[[int, int], None] | None = None,
        min_dead_share: float = MIN_DEAD_SHARE,
        repack: bool = False,
    ) -> CompactionReport:
        """Free the bytes of evicted entries: each shard whose evicted bytes
        are at least `min_dead_share` of it is dropped or rewritten with its
        live entries, one commit each; orphan files go.  Ids, scores and
        query results do not change (docs/format.md, "Compaction").

        `repack` rewrites every live entry into shards packed up to
        shard_max_bytes (it needs room for a copy of the live data).  Does
        nothing when the share of bytes it would free is below
        `min_reclaim_share` (for cron jobs).  `progress(done_bytes,
        total_bytes)` is called as data is copied; an exception it raises
        stops the compaction before the commit of the shard at hand."""
        with self._session.writing() as parts:
            report = parts.compaction.run(
                validation.share(min_reclaim_share, "min_reclaim_share"),
                progress,
                min_dead_share=validation.share(min_dead_share, "min_dead_share"),
                repack=validation.flag(repack, "repack"),
            )
            self._session.publish(snapshot=report.performed)  # the small files whole: the state list starts again
            return report.with_orphan_objects(self._placement.remove_orphans())

    # a transformers cache in (hmem/store/caches.py), retrieved K/V beside a cache out (hmem/store/bridge.py)
    put_cache = caches.put_cache
    augmented_kv = bridge.augmented_kv

    @property
    def chunks(self) -> StoreChunks:
        """The store's chunks: entries put together under a key, found by
        key without a scan (hmem/store/chunk_api.py; a store made with chunks=True)."""
        return StoreChunks(self._session)

    # ---- what the store holds --------------------------------------------------------

    def stats(self) -> StoreStats:
        with self._session.planning():  # many parts of the state, which no write may change between them
            return store_stats(self._session)

    def size(self) -> int:
        """Bytes of the store's files (the lock file's owner record aside), on
        object storage as they lie there (StoreStats.remote: the objects')."""
        with self._state.lock.shared():
            return self._state.stored_bytes()
