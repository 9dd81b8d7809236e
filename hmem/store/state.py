"""StoreState: everything an open store holds in memory, owned in one place.

The Store facade (hmem/store/store.py) and its components (the write path,
eviction, compaction, queries) all work on one StoreState that they are
given explicitly.  It holds:

- the records: every record of entries.bin that the commit names (up to
  ``committed_n``) followed by the records of entries put since, in
  ascending id order, with mutable fields newer than the file's
  (``dirty`` lists the committed ones changed since the last flush);
- the shards: the committed ones, then those sealed since, and the open
  shard (``builder``) whose tensors are still in memory; a full shard a
  put sealed is also read from memory (``sealing``) until its file is
  durable under its name;
- the search index over the live records' signatures, the bounded cache of
  memory-mapped shard files, the map of pooled.bin, and the write lock
  (None for a reader).

Its invariants are held by its own methods: each change the writer,
eviction and compaction make (a put batch admitted, a shard sealed or taken
back, a commit taken, victims marked, a compaction step applied, ...) is
one method whose docstring states what it keeps, and no other module
assigns its attributes (tests/test_layering.py checks it).  ``committed``,
the last commit, is an immutable snapshot (a frozen Manifest,
hmem/formats/manifest.py), replaced whole by each commit and never changed
in place.

docs/architecture.md describes how the components share it.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hmem import memory
from hmem.config import StoreConfig
from hmem.errors import (
    CorruptStoreError,
    Hint,
    HmemError,
    ReadOnlyStoreError,
    StoreChangedError,
    StoreClosedError,
    UnsupportedFormatError,
)
from hmem.formats import manifest, pooled, records, shard_file, store_files
from hmem.formats.manifest import MAX_FILE_BYTES, Manifest, Pending, ShardInfo
from hmem.formats.records import EVICTED
from hmem.store import lock
from hmem.store.chunk_index import ChunkIndex
from hmem.store.imported import ImportRegistry
from hmem.store.pooled_keys import PooledKeys
from hmem.store.projection import Projector, SpanProjector
from hmem.store.results import LimitActivity
from hmem.store.rwlock import ReadWriteLock
from hmem.store.search import SearchIndex
from hmem.store.shard_builder import Arena, SealInFlight, ShardBuilder, SpareSegments
from hmem.store.shard_reader import ShardCache


@dataclasses.dataclass
class DeadBytes:
    """Evicted entries of the open shard, and the bytes they take there."""

    entries: int = 0
    bytes: int = 0


class StoreState:
    """The live state of one open store (see the module docstring)."""

    def __init__(
        self,
        path: Path,
        committed: Manifest,
        *,
        writer: lock.WriterLock | None,
        verify_reads: bool,
        manifest_bytes: bytes,
        loaded: np.ndarray,
        removed_at_open: tuple[int, int] = (0, 0),
    ) -> None:
        """`removed_at_open`: (files, bytes) of leftovers the writer's open
        removed (an interrupted writer's files); compaction reports them."""
        cfg = committed.config
        self.path = path
        self.config: StoreConfig = cfg
        self.writer = writer
        self.lock = ReadWriteLock()  # shared to read, exclusive to write (hmem/store/rwlock.py)
        # Reads that change memory take these short locks of their own:
        self.counts_lock = threading.RLock()  # access counts and the dirty set (queries)
        self.verify_reads = verify_reads
        self.closed = False
        self.projector = Projector(cfg.embed_dim, cfg.hdc_dim, cfg.seed)
        self.span_projector = (
            SpanProjector(cfg.embed_dim, cfg.span_signature_bytes * 8, cfg.seed, cfg.spans, cfg.span_layout)
            if cfg.spans
            else None
        )
        if committed.projection != self.projector.describe():
            raise UnsupportedFormatError(
                f"{path} was written with projection {committed.projection}, which this hmem cannot reproduce",
                hint="use the hmem release that wrote it",
            )
        self.record_size = store_files.record_bytes(cfg)
        # what an entry takes on disk outside its shard: its record and its row of pooled.bin
        self.entry_overhead = self.record_size + pooled.row_bytes(cfg.pooled_width)
        self.config_json = json.dumps(cfg.to_dict(), sort_keys=True)
        self.spares = SpareSegments()  # the open shard's memory, reused shard after shard
        self.cache = ShardCache(cfg.max_open_shards)
        self.pooled = PooledKeys(path, cfg.pooled_width)  # pooled.bin, for re-rank
        self.next_id = committed.next_entry_id
        self.id_limit = committed.next_entry_id  # ids below this are reserved in index.json
        self.builder: ShardBuilder | None = None
        # a full shard a put sealed, its file still being made durable (writer.py, settle)
        self.sealing: tuple[SealInFlight, ...] = ()  # oldest first
        self.builder_dead = DeadBytes()
        self.limits = LimitActivity()  # what the limits made puts do (StoreStats.limits)
        self.removed_at_open = removed_at_open
        self.imports = ImportRegistry(path)  # sources.jsonl (hmem/store/imported.py)
        self.chunk_index = ChunkIndex()  # a store of chunks: key -> chunk (hmem/store/chunk_index.py)
        self.adopt(committed, manifest_bytes, loaded)

    def adopt(self, committed: Manifest, manifest_bytes: bytes | None, loaded: np.ndarray) -> None:
        """Take `committed` and its records as the whole state (at open, and
        after compaction rewrote the store).  Keeps: everything in memory is
        what the commit names, nothing past it (no record, shard or change
        awaits a flush)."""
        # the last commit: an immutable snapshot, replaced whole (committed_as, pending_done)
        self.committed = committed
        if manifest_bytes is not None:
            self.manifest_bytes = manifest_bytes
        self.listed_pending = bool(committed.pending)  # index.json lists steps (done or not)
        self.records = loaded
        self.n = self.committed_n = len(loaded)
        self.dirty: set[int] = set()
        # the pooled keys of the records past committed_n, in order, in the
        # batches they were put: the next flush writes them to pooled.bin
        self.fresh_pooled: list[np.ndarray] = []
        self.pooled.drop()
        # committed, then sealed since; never changed in place (eviction replaces one), so shared with commits
        self.shards = list(committed.shards)
        self.shards_committed = len(self.shards)
        cfg = self.config
        self.search_index = SearchIndex(cfg.signature_bytes, cfg.spans, cfg.span_signature_bytes)
        # each layer's signatures are copied into its matrix at its first query (LayerIndex.defer)
        self.search_index.load(self.records[: self.n])

    # ---- transitions: each keeps its part of the state consistent, here only --------
    # (no other module assigns a StoreState's attributes: tests/test_layering.py)

    def admit_batch(self, count: int, pooled_keys: np.ndarray) -> None:
        """A put's `count` records, written past n (their entries in shards,
        their rows in the search index), join the state.  Keeps: the records
        between committed_n and n are the new ones, fresh_pooled holds their
        pooled keys in order, and next_id is past every id handed out.  The
        keys are queued first, then n and next_id move in one assignment:
        an interrupt leaves the batch in, or out with at most its keys
        queued (withdraw_pooled takes them back)."""
        self.fresh_pooled.append(pooled_keys)
        self.n, self.next_id = self.n + count, self.next_id + count

    def withdraw_pooled(self, pooled_keys: np.ndarray) -> None:
        """Take back the keys a batch that did not go in queued (admit_batch)."""
        if self.fresh_pooled and self.fresh_pooled[-1] is pooled_keys:
            self.fresh_pooled.pop()

    def reserve_ids(self, limit: int) -> None:
        """index.json now reserves the ids below `limit` (a commit just
        said so).  Keeps: id_limit never goes down, and puts hand out ids
        below it only (hmem/store/writer.py commits a reservation first)."""
        self.id_limit = max(self.id_limit, limit)

    def open_shard(self) -> ShardBuilder:
        """The open shard, begun when there is none.  Keeps: the open
        shard's index is len(shards), the next one to be listed."""
        if self.builder is None:
            self.builder = ShardBuilder(len(self.shards), uuid.uuid4().hex, self.config_json, Arena(self.spares))
        return self.builder

    def seal(self, info: ShardInfo, sealing: SealInFlight | None) -> None:
        """The open shard, its file written (or being written by `sealing`),
        is listed as `info`.  Keeps: a shard is open (builder, its evicted
        entries counted in builder_dead) or listed, never both nor neither:
        shards, builder, builder_dead and sealing change in one assignment,
        so an interrupt leaves it listed and closed, or open and unlisted."""
        self.shards, self.builder, self.builder_dead, self.sealing = (
            [*self.shards, info],  # a new list: the one a commit took is never changed
            None,
            DeadBytes(),
            self.sealing if sealing is None else (*self.sealing, sealing),
        )

    def seal_settled(self, done: SealInFlight) -> None:
        """The shard `done` wrote in the background is durable under its
        name.  Keeps: while a seal is in `sealing`, readers read its shard
        from memory (hmem/store/reading.py); from now on, from its file."""
        self.sealing = tuple(s for s in self.sealing if s is not done)

    def unseal(self, shards_mark: int, builder: ShardBuilder | None) -> None:
        """Take back the shards listed since `shards_mark` (a failed put's)
        and make `builder` the open shard again.  Keeps: no committed shard
        is ever taken back (shards_mark is at least shards_committed)."""
        if shards_mark < self.shards_committed:
            raise AssertionError("a committed shard cannot be taken back")
        self.shards, self.builder = self.shards[:shards_mark], builder

    def take_dirty(self) -> set[int]:
        """Take the positions of the committed records changed since the
        last flush (the flush writes them).  Queries add to the set under
        counts_lock, so it is swapped for an empty one under it."""
        with self.counts_lock:
            taken, self.dirty = self.dirty, set()
        return taken

    def return_dirty(self, taken: set[int]) -> None:
        """Give back what take_dirty took and a failed flush did not write:
        the next flush writes it."""
        with self.counts_lock:
            self.dirty |= taken

    def committed_as(self, committed: Manifest, manifest_bytes: bytes) -> None:
        """index.json now holds `committed` (as manifest.write committed it),
        written as `manifest_bytes`.  Keeps: `committed` is the last commit,
        an immutable snapshot replaced whole by each commit and never changed;
        manifest_bytes are the bytes it was written as (store_changed
        compares them); listed_pending says whether index.json lists
        pending steps."""
        self.manifest_bytes = manifest_bytes
        self.committed = committed
        self.listed_pending = bool(committed.pending)

    def flushed(self, end: int, next_id: int) -> None:
        """The commit just made names every record below `end` (n) and
        every shard listed, and reserves the ids below `next_id`.  Keeps:
        committed_n and shards_committed count what index.json names, and
        fresh_pooled holds the keys of the records past committed_n (none
        now: the flush wrote them)."""
        self.committed_n = end
        self.fresh_pooled = []
        self.shards_committed = len(self.shards)
        self.reserve_ids(next_id)

    def pending_done(self) -> None:
        """The pending steps of the last commit are done: `committed` is
        replaced by a snapshot without them, which the next commit starts
        from (it need not repeat them).  index.json lists them until that
        commit (listed_pending)."""
        self.committed = dataclasses.replace(self.committed, pending=Pending())

    def mark_evicted(self, victims: np.ndarray) -> None:
        """Mark the records at `victims` (live positions) evicted, in
        memory, and count their bytes as dead in their shards.  Keeps: the
        search index holds live records only; each shard's dead counts stay
        within the bounds index.json is held to (a crafted index.json may
        set them at the bound with live entries left: docs/security.md);
        a listed ShardInfo is replaced, never changed (commits share them);
        a committed record changed is in `dirty` for the next flush."""
        if not len(victims):
            return
        self.search_index.remove(self.records, victims)
        rows = self.records[victims]
        sizes = self.entry_file_bytes(rows["n_tokens"].astype(np.int64))
        open_index = self.builder.index if self.builder is not None else -1
        shard_of = rows["shard_idx"].astype(np.int64)
        touched, first = np.unique(shard_of, return_inverse=True)
        dead_entries = np.bincount(first, minlength=len(touched)).tolist()
        dead_bytes = np.bincount(first, weights=np.asarray(sizes, dtype=np.float64), minlength=len(touched))
        shards = list(self.shards)
        for shard_idx, entries, nbytes in zip(touched.tolist(), dead_entries, dead_bytes.astype(np.int64).tolist()):
            if shard_idx == open_index:
                self.builder_dead.entries += entries
                self.builder_dead.bytes += nbytes
            else:
                info = shards[shard_idx]
                shards[shard_idx] = dataclasses.replace(
                    info,
                    dead_entries=min(info.dead_entries + entries, info.entries),
                    dead_bytes=min(info.dead_bytes + nbytes, MAX_FILE_BYTES),
                )
        self.shards = shards
        self.records["shard_idx"][victims] = EVICTED
        self.dirty.update(int(p) for p in victims if p < self.committed_n)

    def count_limit_activity(
        self, *, evicted: int = 0, compactions: int = 0, bytes_rewritten: int = 0, bytes_freed: int = 0
    ) -> None:
        """Add to what the limits made puts do.  Keeps: `limits` only grows,
        and is replaced whole (a StoreStats holds the one it was given)."""
        self.limits = dataclasses.replace(
            self.limits,
            evicted=self.limits.evicted + evicted,
            compactions=self.limits.compactions + compactions,
            bytes_rewritten=self.limits.bytes_rewritten + bytes_rewritten,
            bytes_freed=self.limits.bytes_freed + bytes_freed,
        )

    def apply_step(self, positions: np.ndarray, rows: np.ndarray, shards: Sequence[ShardInfo]) -> None:
        """A committed compaction step into memory: the records at
        `positions` become `rows` (moved to another shard) and the shard
        list becomes `shards`, the list the step committed.  Keeps:
        shards_committed counts them all (a compaction flushes first, so
        no shard is sealed past its commits)."""
        self.records[positions] = rows
        self.shards = list(shards)
        self.shards_committed = len(shards)

    # ---- facts derived from the state ---------------------------------------------

    @property
    def read_only(self) -> bool:
        return self.writer is None

    def live_positions(self) -> np.ndarray:
        return np.flatnonzero(self.records["shard_idx"][: self.n] != EVICTED)

    def stored_bytes(self) -> int:
        """Bytes the store takes: the files of its directory; on object
        storage, whose working copy holds no shard it did not make, also
        the committed shards that live only there (hmem/store/object_link.py)."""
        total = store_files.directory_bytes(self.path)
        fetcher = self.cache.fetcher
        if fetcher is not None:
            total += sum(info.bytes for info in self.shards if fetcher.remote_bytes(info.uid) is not None)
        return total

    def live_count(self) -> int:
        return sum(self.search_index.layer_counts().values())

    def entry_file_bytes(self, n_tokens: Any) -> Any:
        """Bytes an entry of n_tokens takes in a shard, header entries and
        index row included (an int, or an array for an array)."""
        cfg = self.config
        return shard_file.entry_file_bytes(n_tokens, cfg.embed_dim, cfg.storage_dtype, cfg.signatures_per_entry)

    def grow(self, extra: int) -> None:
        """Room for `extra` more records.  A put grows the records while
        queries run (hmem/store/rwlock.py): a query that took the old array
        reads the same rows there, and access counts, which queries change
        in place under counts_lock, are copied and swapped under it, so none
        lands in the old array."""
        need = self.n + extra
        if need <= len(self.records):
            return
        grown = memory.zeros((max(need, 2 * len(self.records), 64),), records.record_dtype(self.config))
        with self.counts_lock:
            grown[: self.n] = self.records[: self.n]
            self.records = grown

    def shard_info(self, shard_idx: int) -> ShardInfo:
        if shard_idx < len(self.shards):
            return self.shards[shard_idx]
        raise CorruptStoreError(f"a record names shard {shard_idx}, which the store does not have", hint=Hint.VERIFY)

    def store_changed(self) -> bool:
        """Whether index.json is no longer what this state was loaded from."""
        try:
            return manifest.read_bytes(self.path) != self.manifest_bytes
        except HmemError:  # unreadable counts as changed: the caller reports what it found
            return True

    # ---- lifecycle ----------------------------------------------------------------

    def check_open(self) -> None:
        if self.closed:
            raise StoreClosedError(f"the store at {self.path} is closed", hint=Hint.OPEN_AGAIN)

    def check_writable(self) -> None:
        self.check_open()
        if self.read_only:
            raise ReadOnlyStoreError(
                f"the store at {self.path} is open read-only", hint="open it without read_only to write"
            )

    def shut(self) -> None:
        """Mark the state closed, drop the memory maps and let the lock go."""
        self.closed = True
        sealing, self.sealing = self.sealing, ()
        for seal in sealing:
            seal.wait()  # no file is renamed into the store once its lock is let go
        self.cache.drop()
        self.pooled.drop()
        self.builder = None  # its arena's segments go to the spares when it is freed (now, as nothing reads)
        self.spares.release()
        if self.writer is not None:
            self.writer.release()


_READ_RETRIES = 5


def open_reader(root: Path, verify_reads: bool, *, skipped: list[tuple[int, int | None]] | None = None) -> StoreState:
    """The state of a reader of the store directory `root`: its last commit,
    loaded and then checked not to have changed meanwhile (a writer that
    committed in between may have rewritten what was read).  `skipped`:
    as load_records'."""
    for _ in range(_READ_RETRIES):
        data = manifest.read_bytes(root)
        mf = manifest.parse(root, data)
        damaged: list[tuple[int, int | None]] | None = [] if skipped is not None else None
        loaded = load_records(root, mf, follow_renames=True, skipped=damaged)
        if manifest.read_bytes(root) == data:
            if skipped is not None and damaged:
                skipped.extend(damaged)
            return StoreState(root, mf, writer=None, verify_reads=verify_reads, manifest_bytes=data, loaded=loaded)
        time.sleep(0.01)
    raise StoreChangedError(f"{root} kept changing while it was being opened", hint="try again")


def load_records(
    root: Path, committed: Manifest, *, follow_renames: bool, skipped: list[tuple[int, int | None]] | None = None
) -> np.ndarray:
    """The committed records, pending updates applied; refuses damaged ones,
    unless `skipped` (a reader's list) is given: then each damaged record
    reads as an evicted one (records.set_aside) and (position, entry id or
    None) goes into `skipped`.  A reader follows a pending rename of
    entries.bin (`follow_renames`)."""
    name = store_files.ENTRIES_FILE
    path = store_files.resolve(root, name, committed.pending) if follow_renames else root / name
    try:
        loaded, bad = records.read_checked(path, committed.record_count, committed.config)
    except (CorruptStoreError, FileNotFoundError):
        if path == root / name:
            raise
        loaded, bad = records.read_checked(root / name, committed.record_count, committed.config)  # renamed meanwhile
    updates = committed.pending.record_updates
    if len(updates):
        # checked as read; the records the pending updates change are checked again once changed
        records.apply_updates(loaded, updates)
        updated = np.unique(updates["position"].astype(np.int64))
        updated = updated[updated < len(loaded)]
        again = updated[records.damaged(loaded[updated])]
        bad = np.union1d(np.setdiff1d(bad, updated), again)
    if len(bad) and skipped is not None:
        skipped.extend(records.set_aside(loaded, bad, committed.next_entry_id))
    elif len(bad):
        first = int(bad[0])
        raise CorruptStoreError(
            f"{len(bad)} record(s) of {name} fail their checksum (first: record {first}, "
            f"entry {int(loaded['entry_id'][first])})",
            hint=Hint.VERIFY_THEN_REPAIR,
        )
    why = records.problem(loaded, len(committed.shards), committed.next_entry_id)
    if why is not None:  # sound records of a crafted store: docs/security.md
        raise CorruptStoreError(f"{name} of {root}: {why}", hint=Hint.VERIFY_THEN_REPAIR)
    return loaded
