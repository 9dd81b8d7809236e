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

docs/architecture.md describes how the components share it.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
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
from hmem.formats import layout, manifest, pooled, records, shard_file
from hmem.formats.manifest import Manifest, ShardInfo
from hmem.formats.records import EVICTED
from hmem.store import lock
from hmem.store.imported import ImportRegistry
from hmem.store.pooled_keys import PooledKeys
from hmem.store.projection import Projector, SpanProjector
from hmem.store.results import LimitActivity
from hmem.store.rwlock import ReadWriteLock
from hmem.store.search import SearchIndex
from hmem.store.shard_builder import SealInFlight, ShardBuilder, SpareSegments
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
    ) -> None:
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
        self.record_size = layout.record_bytes(cfg)
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
        self.sealing: SealInFlight | None = None
        self.builder_dead = DeadBytes()
        self.limits = LimitActivity()  # what the limits made puts do (StoreStats.limits)
        # (files, bytes) of leftovers the writer's open removed: compaction reports them (Store.open)
        self.removed_at_open = (0, 0)
        self.imports = ImportRegistry(path)  # sources.jsonl (hmem/store/imported.py)
        self.adopt(committed, manifest_bytes, loaded)

    def adopt(self, committed: Manifest, manifest_bytes: bytes | None, loaded: np.ndarray) -> None:
        """Take `committed` and its records as the whole state (at open, and
        after compaction rewrote the store)."""
        self.committed = committed  # what index.json says now
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
        self.index = SearchIndex(self.config.signature_bytes, self.config.spans, self.config.span_signature_bytes)
        # each layer's signatures are copied into its matrix at its first query (LayerIndex.defer)
        self.index.load(self.records[: self.n])

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
        total = layout.directory_bytes(self.path)
        fetcher = self.cache.fetcher
        if fetcher is not None:
            total += sum(info.bytes for info in self.shards if info.uid in fetcher.remote)
        return total

    def live_count(self) -> int:
        return sum(self.index.layer_counts().values())

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
        sealing, self.sealing = self.sealing, None
        if sealing is not None:
            sealing.wait()  # no file is renamed into the store once its lock is let go
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
    name = layout.ENTRIES_FILE
    path = layout.resolve(root, name, committed.pending) if follow_renames else root / name
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
