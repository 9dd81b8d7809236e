"""Store: the persistent tier-3 K/V memory, hmem's main object.

A facade: it checks arguments, takes the store's lock (shared to read;
intent to put or flush beside reads, and for stats and the plans, which
no write may change under them; exclusive for evict, delete, compact,
record_source, close and a put that must evict: hmem/store/rwlock.py)
and hands the work to the components that share one StoreState
(docs/architecture.md):

- Writer (hmem/store/writer.py): put, flush and the commit protocol;
- Queries (hmem/store/queries.py): similarity search and re-rank;
- EntryReader (hmem/store/reading.py): an entry's tensors, checksums checked;
- Eviction (hmem/store/eviction.py): evict and the store's limits;
- Compaction (hmem/store/compaction.py): rewrite into fresh shards.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from hmem import _io, kernels, validation
from hmem.config import MAX_OPEN_SHARDS, StoreConfig
from hmem.errors import (
    CorruptStoreError,
    EntryNotFoundError,
    Hint,
    InvalidArgumentError,
    StoreExistsError,
)
from hmem.formats import layout, manifest, records, shard_file, stamp
from hmem.formats.layout import is_store
from hmem.formats.manifest import Manifest
from hmem.formats.records import EVICTED
from hmem.formats.sources import ImportedSource
from hmem.object_store import is_url
from hmem.store import caches, listing, lock, prepare, rewrite
from hmem.store.bridge import AugmentedKV, augmented_kv
from hmem.store.compaction import MIN_DEAD_SHARE, Compaction
from hmem.store.eviction import Eviction
from hmem.store.listing import ENTRY_SORTS, EntryListing
from hmem.store.placement import DirectoryPlacement, Placement
from hmem.store.prepare import Entry
from hmem.store.projection import Projector
from hmem.store.queries import Queries
from hmem.store.reading import EntryReader
from hmem.store.results import (
    CompactionPlan,
    CompactionReport,
    DeletePlan,
    EntryInfo,
    EvictionPlan,
    QueryResults,
    ShardStats,
    StoredEntry,
    StoredKV,
    StoreStats,
)
from hmem.store.state import StoreState, load_records, open_reader
from hmem.store.writer import Writer

__all__ = ["Entry", "Store", "is_store"]


class Store:
    """A store directory opened for writing (one process at a time) or reading.

    Use ``Store.create`` or ``Store.open``; close it (or use ``with``) so that
    everything put is flushed and the write lock is released.

    A Store object may be shared between threads (docs/architecture.md,
    "Threads"): reads (query, query_many, get, stored_kv, entries,
    entry_ids, size, check_entries, imported_sources, find_source) run at
    the same time, and beside put, put_many and flush.  stats and the
    plans (plan_eviction, plan_delete, plan_compaction) run beside reads
    but not beside any write: they read many parts of the state, which
    must not change between them.  Writes run one at a time: put,
    put_many and flush beside reads; evict, delete, compact,
    record_source, close and a put that the limits make evict while no
    read runs.  So every read sees the state after some whole number of
    writes.  A waiting exclusive write goes before the reads that come
    after it.
    """

    def __init__(self, state: StoreState) -> None:
        # the state and its components, swapped as one by a refresh
        self._open = _OpenState(state)
        # where the store's bytes live (hmem/store/placement.py): here, the
        # directory; a store on object storage is placed by _place
        self._placement: Placement = (placement := DirectoryPlacement(str(state.path)))
        self.location: str = self._placement.location  # what the store was opened as: a directory or a URL
        # A store dropped unclosed lets its lock and its storage go when
        # collected.  A finalizer (not __del__) so that a closed store runs
        # no Python code when collected: a signal arriving then would be
        # lost in a destructor.
        self._release_unclosed: weakref.finalize[[], Store] | None = (
            weakref.finalize(self, lambda: _release(state, placement)) if state.writer is not None else None
        )
        self._refresh_seconds: float | None = None
        self._refreshed = time.monotonic()
        self._refresh_lock = threading.Lock()  # one refresh at a time
        # (position, entry id or None when unknown) of each damaged record of
        # entries.bin a reader opened with on_damage="skip" reads past
        self.damaged_records: tuple[tuple[int, int | None], ...] = ()

    # the state and its components, as the last refresh left them
    _state = property(lambda self: self._open.state)
    _reader = property(lambda self: self._open.reader)
    _writer = property(lambda self: self._open.writer)
    _queries = property(lambda self: self._open.queries)
    _compaction = property(lambda self: self._open.compaction)
    _eviction = property(lambda self: self._open.eviction)

    @property
    def path(self) -> Path:
        """The store's directory (for a store on object storage, its working copy)."""
        return self._open.state.path

    @property
    def config(self) -> StoreConfig:
        return self._open.state.config

    def _place(self, placement: Placement) -> None:
        """Tie this store (a working copy) to where it lives."""
        self._placement = placement
        placement.attach(self._state)
        self.location = placement.location
        if self._release_unclosed is not None:
            self._release_unclosed.detach()
        state = self._state
        self._release_unclosed = weakref.finalize(self, lambda: _release(state, placement))

    def _publish(self, *, snapshot: bool = False, data_only: bool = False) -> None:
        """After a write: make its commit the store's own where it lives."""
        self._placement.after_write(self._state, snapshot=snapshot, data_only=data_only)

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
        """Create a new store at `path` (a missing or empty directory, or a
        URL s3://bucket/prefix holding no store) and open it for writing.
        `storage_options` (object storage only): endpoint, credentials,
        timeouts and the local cache (docs/cli.md, "Stores on object storage")."""
        if config is None:
            known = {f.name for f in dataclasses.fields(StoreConfig)}
            unknown = sorted(set(settings) - known)
            if unknown:
                raise InvalidArgumentError(
                    f"unknown store setting(s): {', '.join(unknown)}", hint="settings are " + ", ".join(sorted(known))
                )
            config = StoreConfig(**settings)
        elif settings:
            raise InvalidArgumentError("give either a StoreConfig or settings, not both")
        elif not isinstance(config, StoreConfig):
            raise InvalidArgumentError(f"config must be a StoreConfig, got {type(config).__name__}")
        if is_url(path):
            return cls._create_remote(str(path), config, storage_options)
        _local_only(storage_options)
        root = Path(validation.store_directory(path))  # "" and a file refused, as for every command
        if (root / layout.INDEX_FILE).exists():
            raise StoreExistsError(f"{root} already holds an hmem store", hint="open it instead")
        if root.exists() and (not root.is_dir() or any(root.iterdir())):
            raise StoreExistsError(
                f"{root} exists and is not an empty directory", hint="choose a new path for the store"
            )
        _io.make_dir(root)
        writer = lock.WriterLock(root)
        try:
            projection = Projector(config.embed_dim, config.hdc_dim, config.seed).describe()
            mf = Manifest(config=config, projection=projection)
            _io.write_file(root / layout.ENTRIES_FILE, [])
            data = manifest.write(root, mf)
        except BaseException:
            writer.release()
            raise
        return cls(
            StoreState(root, mf, writer=writer, verify_reads=True, manifest_bytes=data, loaded=records.empty(0, config))
        )

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

        On object storage the lock is a lease (docs/format.md, "Stores on
        object storage"); `storage_options` give the endpoint, credentials,
        timeouts and the local cache; a reader sees new commits after
        ``refresh()``, or by itself when a read comes `refresh_seconds`
        after its last look.  `lock_wait` may be infinite (wait as long as
        it takes), never negative or NaN.

        `max_open_shards` bounds the shard files this Store keeps
        memory-mapped, in place of the store's setting (which stays as it
        is): a store made when the default was 4 reads faster with more.

        `on_damage`: "raise" (a damaged record of entries.bin fails the
        open, CorruptStoreError) or "skip", for a reader (`read_only`) of a
        local store: each damaged record reads as an evicted entry, listed
        in ``damaged_records``, and every sound entry stays readable
        (docs/reliability.md, "Degraded reads").
        """
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
            store = cls.open(
                path,
                read_only=read_only,
                verify_reads=verify_reads,
                lock_wait=lock_wait,
                storage_options=storage_options,
                refresh_seconds=refresh_seconds,
                on_damage=on_damage,
            )
            store._state.cache.capacity = max_open_shards
            return store
        if is_url(path):
            return cls._open_remote(
                str(path),
                read_only=read_only,
                verify_reads=verify_reads,
                lock_wait=lock_wait,
                storage_options=storage_options,
                refresh_seconds=refresh_seconds,
            )
        _local_only(storage_options)
        if refresh_seconds is not None:
            raise InvalidArgumentError("refresh_seconds applies to stores on object storage only")
        root = Path(validation.store_directory(path))  # "" and a file refused, as for every command
        if read_only:
            return cls._open_reader(root, verify_reads, skip_damaged=on_damage == "skip")
        manifest.read_bytes(root)  # "not a store" before any lock file is made
        writer = lock.WriterLock(root, wait_seconds=lock_wait)
        try:
            data = manifest.read_bytes(root)
            mf = manifest.parse(root, data)
            evidence = stamp.stale_evidence(root, mf)
            if evidence is not None:  # leftovers are newer data here: never remove them
                raise CorruptStoreError(f"{root}: {evidence}", hint=Hint.ROLL_FORWARD)
            before = _directory_files(root)
            rewrite.finish_pending(root, mf)
            rewrite.remove_leftovers(root, mf)
            after = _directory_files(root)
            loaded = load_records(root, mf, follow_renames=False)
            state = StoreState(root, mf, writer=writer, verify_reads=verify_reads, manifest_bytes=data, loaded=loaded)
            # what an interrupted writer left and this open removed: `hmem compact` reports it
            state.removed_at_open = (max(0, before[0] - after[0]), max(0, before[1] - after[1]))
            return cls(state)
        except BaseException:
            writer.release()
            raise

    @classmethod
    def _open_reader(cls, root: Path, verify_reads: bool, *, skip_damaged: bool = False) -> Store:
        damaged: list[tuple[int, int | None]] | None = [] if skip_damaged else None
        store = cls(open_reader(root, verify_reads, skipped=damaged))
        store.damaged_records = tuple(damaged or ())
        return store

    @classmethod
    def _create_remote(cls, url: str, config: StoreConfig, storage_options: dict[str, Any] | None) -> Store:
        # imported here, where a store on object storage is opened: a local store's commands
        # start without the object-store code (docs/benchmarks.md, "Command start-up")
        from hmem.store.object_link import ObjectLink

        link = ObjectLink(url, storage_options)
        link.use_state_cache()
        store: Store | None = None
        try:
            link.claim_new()
            store = cls.create(link.workdir / "store-0", config)
            store._place(link)
            state = store._state
            link.create(state.path, state.committed)
            return store
        except BaseException:
            if store is not None:
                store._state.shut()
            link.close()
            raise

    @classmethod
    def _open_remote(
        cls,
        url: str,
        *,
        read_only: bool,
        verify_reads: bool,
        lock_wait: float,
        storage_options: dict[str, Any] | None,
        refresh_seconds: float | None,
    ) -> Store:
        if refresh_seconds is not None:
            refresh_seconds = validation.number(refresh_seconds, "refresh_seconds", low=0.0)
        # imported here, where a store on object storage is opened: a local store's commands
        # start without the object-store code (docs/benchmarks.md, "Command start-up")
        from hmem.store.object_link import ObjectLink

        link = ObjectLink(url, storage_options)
        link.use_state_cache()
        try:
            link.read_manifest()  # "not a store" before any lease is taken
            if read_only:
                store = cls._open_reader(link.materialize(), verify_reads)
            else:
                link.take_lease(lock_wait)  # checked by open: >= 0, infinity waiting as long as it takes
                link.fence()
                store = cls.open(link.materialize(), verify_reads=verify_reads)
                link.published_generation = store._state.committed.generation
                link.published_local = store._state.committed
        except BaseException:
            link.close()
            raise
        store._place(link)
        store._refresh_seconds = refresh_seconds
        return store

    def refresh(self) -> bool:
        """A reader of a store on object storage: take the newest commit if
        there is one (one request when there is none); returns whether the
        store changed.  Queries of other threads go on while the new commit
        is fetched, and pause only while it is swapped in.  Entries read
        before stay valid; ids a new commit removed are gone.  Nothing for a
        writer or a local store."""
        return self._refresh(wait=True)

    def _refresh(self, *, wait: bool) -> bool:
        self._refreshed = time.monotonic()
        if not self._state.read_only:
            return False
        if not self._refresh_lock.acquire(blocking=wait):
            return False  # another thread is refreshing: this read goes on with the commit it has
        try:
            self._state.check_open()
            # loaded without the store's lock: queries go on meanwhile, on the commit they have
            fresh = self._placement.newer_state(self._state)
            if fresh is None:
                return False
            old = self._state
            with old.lock.exclusive():
                self._placement.swap_in(old, fresh)
                self._open = _OpenState(fresh)  # one object: every component with its state
                old.shut()
            self._placement.forget(old)
            return True
        finally:
            self._refresh_lock.release()

    def _maybe_refresh(self) -> None:
        if self._refresh_seconds is not None and time.monotonic() - self._refreshed >= self._refresh_seconds:
            self._refresh(wait=False)

    @property
    def read_only(self) -> bool:
        return self._state.read_only

    def flush(self) -> None:
        """Make every put and access count so far durable (hmem/store/writer.py).
        Queries of other threads go on while the files are written."""
        with self._state.lock.intent():
            self._state.check_writable()
            self._writer.flush(exact_ids=False)
            self._publish()

    def close(self) -> None:
        """Flush (a writer), release the lock and drop the memory maps.  Idempotent."""
        state = self._state
        with state.lock.exclusive():
            if state.closed:
                return
            try:
                if not state.read_only:
                    self._writer.close()
                    self._publish()
                    self._placement.before_close(state)
            finally:
                state.shut()
                if self._release_unclosed is not None:
                    self._release_unclosed.detach()
                self._placement.close()

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
        self._state.check_writable()
        # checked and projected before the lock: queries go on meanwhile
        batch = prepare.prepare(self._state, keys, values, layer_idx, importance)
        try:
            return self._insert(batch)[0]
        finally:
            batch.release()  # copied into the open shard, or not stored

    def put_many(self, entries: Iterable[Entry | tuple]) -> list[int]:
        """Store many entries; returns their ids in order.  Every entry is
        checked before any is stored, so one bad entry stores nothing.  A
        batch whose entries are all plain (keys, values, layer_idx,
        importance) tuples or Entry without meta, of C-contiguous float32
        [n, embed_dim] arrays, is checked in one native pass
        (hmem/store/prepare.py); others are unpacked entry by entry."""
        self._state.check_writable()
        batch = prepare.prepare_all(self._state, entries)  # before the lock, as in put
        try:
            return self._insert(batch)
        finally:
            batch.release()

    def _insert(self, batch: prepare.PreparedBatch) -> list[int]:
        """Store a checked batch.  Queries of other threads go on meanwhile
        (the store's lock in intent mode): each change insert makes is one
        a query may meet at any point, and the batch becomes visible to
        them at its end (hmem/store/writer.py, hmem/store/search.py).  Only
        a put that the limits make evict holds the lock exclusively."""
        state = self._state
        with state.lock.intent():
            state.check_writable()
            if not self._eviction.needs_room(batch):
                ids = self._writer.insert(batch)
                self._publish(data_only=True)
                return ids
            with state.lock.exclusive():
                self._eviction.make_room(batch)
                ids = self._writer.insert(batch)
                self._publish(data_only=True)  # the limits may have evicted and committed
                return ids

    def check_entries(self, entries: Iterable[Entry | tuple]) -> int:
        """Check entries as put_many would, storing nothing (also on a
        read-only store); returns how many there are."""
        with self._state.lock.shared():
            self._state.check_open()
            batch = prepare.prepare_all(self._state, entries)
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
    ) -> QueryResults:
        """The `top_k` entries of layer `layer_idx` most similar to `query`
        ([n_tokens, embed_dim] or [embed_dim]), best first.

        Entries are ranked by signature similarity; with `rerank`, a
        shortlist of shortlist_factor * top_k is re-ranked by the exact
        cosine of pooled keys.  Ties go to the lower entry id.  Each result
        counts as an access of its entry (persisted by the next flush; a
        read-only store does not count).  A damaged entry raises
        CorruptStoreError; with on_damage="skip" it is left out, the next
        best takes its place and ``results.skipped`` names it (every tensor
        returned then passed its CRC, verify_reads or not).

        `search` says how the layer's signatures are ranked: "full" compares
        every signature whole; "two-stage" scans the first 1024 bits of each
        for 50 x the shortlist, then ranks those on the whole signature
        (reads a quarter of a 4096-bit signature; the shortlist may differ
        a little from the full scan's); "auto" (the default) takes two
        stages on layers of 100,000 entries and more when signatures have
        4096 bits or more, where recall after re-rank stays within 0.01 of
        the full scan's (docs/benchmarks.md, "Two-stage search").  On a
        store with span signatures (signatures_per_entry > 1), "spans" (the
        default there) ranks each entry by the nearest of its mean and span
        signatures and re-ranks 10 x the shortlist, joined by the usual
        shortlist of whole signatures, by the best cosine of its mean key
        and of the keys of spans at least half the query's length: a query
        of a few tokens finds the entry that holds them, a query as long as
        an entry what mean pooling finds (docs/format.md, "Span signatures").
        """
        self._maybe_refresh()
        with self._state.lock.shared():
            self._state.check_open()
            return self._queries.query(
                query,
                layer_idx,
                top_k,
                rerank=rerank,
                shortlist_factor=shortlist_factor,
                framework=framework,
                count_access=count_access,
                on_damage=on_damage,
                search=search,
            )

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
    ) -> list[QueryResults]:
        """query() of each item of `queries` (a list of [n_tokens, embed_dim]
        or [embed_dim] arrays, or one [n_queries, n_tokens, embed_dim]
        array), as a serving engine batches requests: the same results, in
        the same order, as one query per item made one after another.

        The layer's signatures are scanned once for the whole batch, by one
        thread per core, and the tensors the batch needs are read shard by
        shard.  Every query is checked before any is answered, and accesses
        are counted only once all are answered: a bad query, or a damaged
        entry met without on_damage="skip", raises and counts nothing.
        """
        self._maybe_refresh()
        with self._state.lock.shared():
            self._state.check_open()
            return self._queries.query_many(
                queries,
                layer_idx,
                top_k,
                rerank=rerank,
                shortlist_factor=shortlist_factor,
                framework=framework,
                count_access=count_access,
                on_damage=on_damage,
                search=search,
            )

    def entry_ids(self, layer_idx: int | None = None) -> list[int]:
        """Ids of the live entries (of one layer, if given), ascending."""
        with self._state.lock.shared():
            self._state.check_open()
            return [int(i) for i in self._state.records["entry_id"][self._live_in(layer_idx)]]

    def entries(self, layer_idx: int | None = None, *, sort: str = "id", limit: int | None = None) -> EntryListing:
        """The metadata of the live entries (of one layer, if given): a
        snapshot taken now, iterated as EntryInfo made a batch at a time.

        `sort` (ENTRY_SORTS): "id" ascending; "score" in eviction order,
        next to be evicted first (lowest score, then older, then lower id);
        "accesses" most accessed first; "age" oldest first; "size" largest
        first; ties in the last three go to the lower id.  `limit` keeps the
        first `limit` entries of that order (None: all); the listing's
        ``total`` counts the live entries before it."""
        sort = validation.choice(sort, "sort", ENTRY_SORTS)
        keep = None if limit is None else validation.count(limit, "limit")
        self._maybe_refresh()
        state = self._state
        with state.lock.shared():
            state.check_open()
            live = self._live_in(layer_idx)
            columns = {name: state.records[name][live] for name in listing.FIELDS}  # copies: a snapshot
        chosen = listing.order(columns, sort)[:keep]
        columns = {name: column[chosen] for name, column in columns.items()}
        sizes = np.asarray(state.entry_file_bytes(columns["n_tokens"].astype(np.int64)), dtype=np.int64)
        return EntryListing(columns, sizes, len(live), sort)

    def stored_kv(self, entry_id: int) -> StoredKV:
        """One live entry's keys and values exactly as its shard holds them,
        not decoded (bit-exact; BF16 as its uint16 words, INT8 with its row
        scales), each tensor's checksum checked as by get().  Raises
        EntryNotFoundError for an id that is not live."""
        state = self._state
        with state.lock.shared():
            state.check_open()
            pos = self._position(validation.integer(entry_id, "entry_id", low=0))
            tensors = {kind: _read_only(array) for kind, array in self._reader.stored(pos).items()}
            row = state.records[pos]
            info = EntryInfo.from_record(row, int(state.entry_file_bytes(int(row["n_tokens"]))))
            storage = self.config.storage_dtype
            return StoredKV(
                info,
                storage,
                shard_file.KV_DTYPES[storage],
                tensors["k"],
                tensors["v"],
                tensors.get("ks"),
                tensors.get("vs"),
                self._reader.meta(pos),
            )

    def get(self, entry_id: int) -> StoredEntry:
        """One live entry's metadata and K/V (read-only arrays, bit-exact as
        put).  Raises EntryNotFoundError for an id that is not live."""
        self._maybe_refresh()
        state = self._state
        with state.lock.shared():
            state.check_open()
            pos = self._position(validation.integer(entry_id, "entry_id", low=0))
            keys, values = self._reader.kv(pos)
            row = state.records[pos]
            info = EntryInfo.from_record(row, int(state.entry_file_bytes(int(row["n_tokens"]))))
            return StoredEntry(info, _read_only(keys), _read_only(values), self._reader.meta(pos))

    def _live_in(self, layer_idx: int | None) -> np.ndarray:
        live = self._state.live_positions()
        if layer_idx is not None:
            layer = validation.layer_index(layer_idx)
            live = live[self._state.records["layer_idx"][live] == layer]
        return live

    def _position(self, entry_id: int) -> int:
        """Where the live entry `entry_id` is in the records (ids ascend)."""
        state = self._state
        ids = state.records["entry_id"][: state.n]
        pos = int(np.searchsorted(ids, entry_id))
        if pos >= state.n or int(ids[pos]) != entry_id or state.records["shard_idx"][pos] == EVICTED:
            raise EntryNotFoundError(
                f"the store at {self.path} holds no entry {entry_id}", hint="list the live ids with Store.entry_ids()"
            )
        return pos

    # ---- the import registry (hmem/formats/sources.py) --------------------------------

    def imported_sources(self) -> list[ImportedSource]:
        """Every source file recorded as imported, oldest first (those
        recorded since the last flush included)."""
        with self._state.lock.shared():
            self._state.check_open()
            return self._state.imports.all(self._state.committed.sources)

    def find_source(self, sha256: str, size: int) -> ImportedSource | None:
        """The latest import of a file with this content (SHA-256 in hex and
        size), if the store recorded one."""
        with self._state.lock.shared():
            self._state.check_open()
            return self._state.imports.find(self._state.committed.sources, sha256, size)

    def record_source(self, name: str, sha256: str, size: int, entry_ids: Iterable[int]) -> ImportedSource:
        """Record that a file (its name, SHA-256 in hex and size) was imported
        as the entries `entry_ids` (consecutive, as one put_many hands them
        out); committed by the next flush, together with those entries."""
        with self._state.lock.exclusive():
            self._state.check_writable()
            return self._state.imports.add(name, sha256, size, entry_ids, next_id=self._state.next_id)

    # ---- eviction and compaction -----------------------------------------------------

    def plan_eviction(self, target_entries: int) -> EvictionPlan:
        """What evict(target_entries) would remove, without changing anything."""
        with self._state.lock.intent():  # many parts of the state, read with no write under way
            self._state.check_open()
            return self._eviction.plan(validation.count(target_entries, "target_entries"))

    def evict(self, target_entries: int) -> int:
        """Evict the lowest-scored live entries until at most `target_entries`
        remain (see hmem/store/policy.py); durable when it returns.  Their
        bytes are freed by the next compaction.  Returns how many were evicted."""
        with self._state.lock.exclusive():
            self._state.check_writable()
            evicted = self._eviction.evict(validation.count(target_entries, "target_entries"))
            self._publish()
            return evicted

    def plan_delete(self, entry_ids: Iterable[int]) -> DeletePlan:
        """Which of `entry_ids` delete() would remove and which name no live
        entry, without changing anything."""
        ids = _entry_id_array(entry_ids)
        with self._state.lock.intent():  # many parts of the state, read with no write under way
            self._state.check_open()
            return self._eviction.plan_delete(ids)[0]

    def delete(self, entry_ids: Iterable[int], *, missing_ok: bool = False) -> DeletePlan:
        """Delete entries by id, durably when it returns (crash-safe as
        evict: the old or the new state).  Their bytes are freed by the
        next compaction.  An id naming no live entry raises
        EntryNotFoundError and deletes nothing, unless `missing_ok`, which
        deletes the others and reports it in ``missing``."""
        ids = _entry_id_array(entry_ids)
        with self._state.lock.exclusive():
            self._state.check_writable()
            plan = self._eviction.delete(ids, missing_ok=validation.flag(missing_ok, "missing_ok"))
            self._publish()
            return plan

    def plan_compaction(self, *, min_dead_share: float = MIN_DEAD_SHARE, repack: bool = False) -> CompactionPlan:
        """What compact() (with the same options) would do and gain, without changing anything."""
        with self._state.lock.intent():  # many parts of the state, read with no write under way
            self._state.check_open()
            plan = self._compaction.plan(
                validation.share(min_dead_share, "min_dead_share"), repack=validation.flag(repack, "repack")
            )
        # on object storage, also the objects no commit names (a writer that stopped before its commit)
        orphans = self._placement.orphan_sizes()
        if not orphans:
            return plan
        reclaimable = plan.reclaimable_bytes + sum(orphans.values())
        before = plan.bytes_before + sum(orphans.values())
        return dataclasses.replace(
            plan,
            orphan_files=plan.orphan_files + tuple(orphans),
            needed=True,
            bytes_before=before,
            bytes_after_estimate=before - reclaimable,
            reclaimable_bytes=reclaimable,
            reclaimable_share=reclaimable / before,
        )

    def compact(
        self,
        min_reclaim_share: float = 0.0,
        *,
        progress: Callable[[int, int], None] | None = None,
        min_dead_share: float = MIN_DEAD_SHARE,
        repack: bool = False,
    ) -> CompactionReport:
        """Free the bytes of evicted entries, shard by shard: a shard whose
        evicted bytes are at least `min_dead_share` of its file is dropped
        (no live entry left) or rewritten with its live entries only, each
        shard one commit, so the extra disk needed is one shard's live
        bytes; the records of evicted entries go once they are that share
        of the records; orphan files go.  Ids, scores and query results do
        not change (docs/format.md, "Compaction").

        `repack` rewrites every live entry into shards packed up to
        shard_max_bytes, numbered from 0 (merging small shards; it needs
        room for a copy of the live data).  Does nothing when there is
        nothing to free, or when the share of bytes it would free is below
        `min_reclaim_share` (for cron jobs).  `progress(done_bytes,
        total_bytes)` is called as live data is copied; an exception it
        raises stops the compaction before the commit of the shard at hand."""
        with self._state.lock.exclusive():
            self._state.check_writable()
            share = validation.share(min_reclaim_share, "min_reclaim_share")
            report = self._compaction.run(
                share,
                progress,
                min_dead_share=validation.share(min_dead_share, "min_dead_share"),
                repack=validation.flag(repack, "repack"),
            )
            self._publish(snapshot=report.performed)  # the small files whole: the state list starts again
            removed = self._placement.remove_orphans()
            if not removed:
                return report
            freed = sum(removed.values())
            return dataclasses.replace(
                report,
                performed=True,
                orphans_removed=report.orphans_removed + len(removed),
                bytes_before=report.bytes_before + freed,
                bytes_freed=report.bytes_freed + freed,
                reason=report.reason if report.performed else "removed orphan objects",
            )

    def put_cache(
        self,
        cache: Any,
        *,
        chunk_tokens: int | None = None,
        importance: float = 1.0,
        layers: Iterable[int] | None = None,
    ) -> dict[int, list[int]]:
        """Store a transformers cache (DynamicCache, or the legacy tuple of
        per-layer (key, value) [batch, kv_heads, tokens, head_dim]): each
        layer's batch rows, cut into chunks of `chunk_tokens` if given, heads
        flattened into the row (embed_dim = kv_heads x head_dim); layers
        without K/V (mamba) are left out, a sliding-window layer stores the
        tokens it holds.  All or nothing; returns the new ids per layer, in
        order (hmem/store/caches.py; `hmem.cache_tensors` turns entries back)."""
        return caches.put_cache(self, cache, chunk_tokens=chunk_tokens, importance=importance, layers=layers)

    def augmented_kv(
        self, query: Any, cache_k: Any, cache_v: Any, layer_idx: int, top_k: int = 5, **query_options: Any
    ) -> AugmentedKV:
        """Keys and values of the `top_k` retrieved entries (rank order)
        followed by the cache rows, and which rows came from which entry.
        numpy in, numpy out; torch in, torch out (the cache's dtype and
        device).  Nothing retrieved gives the cache back unchanged."""
        return augmented_kv(self, query, cache_k, cache_v, layer_idx, top_k, **query_options)

    # ---- what the store holds --------------------------------------------------------

    def stats(self) -> StoreStats:
        state = self._state
        # intent, not shared: stats reads many parts of the state, which a
        # put or flush beside it would change between them (hmem/store/rwlock.py)
        with state.lock.intent():
            state.check_open()
            live = state.live_positions()
            rows = state.records[: state.n]
            shard_rows = [
                ShardStats(i, s.file, s.bytes, s.entries, s.dead_entries, s.dead_bytes, i < state.shards_committed)
                for i, s in enumerate(state.shards)
            ]
            files = layout.classify(state.path, state.shards, state.committed.pending)
            n_tokens = rows["n_tokens"][live].astype(np.int64)
            return StoreStats(
                path=self.location,
                format_version=manifest.FORMAT_VERSION,
                generation=state.committed.generation,
                config=self.config,
                entries=len(live),
                evicted=state.n - len(live),
                unflushed=state.n - state.committed_n,
                layers=state.index.layer_counts(),
                shards=shard_rows,
                bytes_on_disk=state.stored_bytes(),
                live_bytes=int(
                    np.sum(
                        shard_file.entry_bytes(
                            n_tokens, self.config.embed_dim, self.config.storage_dtype, self.config.signatures_per_entry
                        )
                    )
                ),
                # every evicted byte, as `compact(min_dead_share=0)` frees it (a shard left
                # without live entries frees its whole file, header too)
                reclaimable_bytes=self._compaction.plan(0.0).reclaimable_bytes,
                orphan_files=files.orphans,
                foreign_files=files.foreign,
                total_accesses=int(rows["access_count"].astype(np.int64).sum()),
                next_entry_id=state.next_id,
                kernels=kernels.describe(),
                # on object storage, also whether the objects are there (a listing; verify's remote errors)
                health=self._placement.checked_health(self._reader.health(), state.shards, rows["shard_idx"]),
                limits=state.limits,
                remote=self._placement.report(),
            )

    def size(self) -> int:
        """Bytes on disk: the files of the store directory (the lock file's
        transient owner record aside); on object storage, the same files
        (shards and small files) as they lie there (StoreStats.remote has
        the bytes of the objects themselves)."""
        with self._state.lock.shared():
            return self._state.stored_bytes()


def _directory_files(root: Path) -> tuple[int, int]:
    """How many files a store directory holds and their bytes (the lock aside)."""
    files = sum(
        1 for entry in os.scandir(root) if entry.name != layout.LOCK_FILE and entry.is_file(follow_symlinks=False)
    )
    return files, layout.directory_bytes(root)


def _local_only(storage_options: Any) -> None:
    if storage_options is not None:
        raise InvalidArgumentError("storage_options apply to stores on object storage (s3://...) only")


def _release(state: StoreState, placement: Placement) -> None:
    """An unclosed store's lock and storage go back.  A shard a put was
    still making durable is waited for first: no file is renamed into the
    store once another writer may have it (the shard itself is not committed)."""
    if state.writer is not None:
        sealing = state.sealing
        if sealing is not None:
            sealing.wait()
        state.writer.release()
    placement.close()


@dataclasses.dataclass(frozen=True)
class _OpenState:
    """A state and the components that work on it, made together and
    replaced together (Store.refresh)."""

    state: StoreState
    reader: EntryReader
    writer: Writer
    queries: Queries
    compaction: Compaction
    eviction: Eviction

    def __init__(self, state: StoreState) -> None:
        reader, writer = EntryReader(state), Writer(state)
        compaction = Compaction(state, writer, reader)
        for name, value in (
            ("state", state),
            ("reader", reader),
            ("writer", writer),
            ("queries", Queries(state, reader)),
            ("compaction", compaction),
            ("eviction", Eviction(state, writer, compaction)),
        ):
            object.__setattr__(self, name, value)


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


def _entry_id_array(entry_ids: Iterable[int]) -> np.ndarray:
    """Entry ids as a unique ascending uint64 array; anything else than
    non-negative integers is refused."""
    if isinstance(entry_ids, np.ndarray) and entry_ids.dtype.kind in "iu" and entry_ids.ndim == 1:
        if entry_ids.size and entry_ids.min() < 0:
            raise InvalidArgumentError(f"entry ids must be >= 0, got {entry_ids.min()}")
        return np.unique(entry_ids.astype(np.uint64))
    if isinstance(entry_ids, (str, bytes)) or not isinstance(entry_ids, Iterable):
        raise InvalidArgumentError(f"entry_ids must be an iterable of integers, got {type(entry_ids).__name__}")
    ids = [validation.integer(i, "entry id", low=0, high=2**64 - 1) for i in entry_ids]
    return np.unique(np.array(ids, dtype=np.uint64))
