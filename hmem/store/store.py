"""Store: the persistent tier-3 K/V memory (SPEC §2): creation, opening,
put, flush, query and stats.  Eviction, limits, compaction and the bridge
are in hmem/maintenance.py.

Write path.  ``put`` validates and converts its input, computes the
signature and pooled key, and keeps the entry's tensors in the open shard
(in memory) and its record in memory.  When the open shard would pass
shard_max_bytes it is sealed into its file.  ``flush`` makes everything
durable in this order, each step fsynced before the next:

  1. seal the open shard into shard_NNNN.safetensors;
  2. append the new records to entries.bin;
  3. commit index.json (record count, shards, next id, and the new mutable
     fields of older records as pending updates);
  4. write those mutable fields in place in entries.bin.

A crash before 3 leaves the previous state (leftover shards and records
past the commit are ignored, then removed by the next writer); a crash after
3 leaves the new state, and the next writer finishes step 4 from index.json.

Entry ids are handed out from a range reserved in index.json before use, so
an id given to a put that a crash then loses is never given again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from hmem import _io, kernels

from hmem.store import lock

from hmem.formats import manifest

from hmem.formats import records

from hmem.store import rewrite

from hmem.store import quantize

from hmem.store import shard_builder

from hmem.formats import shard_file

from hmem.store import shard_reader
from hmem.config import StoreConfig
from hmem.errors import (
    CorruptStoreError,
    EntryNotFoundError,
    HmemError,
    InvalidArgumentError,
    InvalidTensorError,
    ReadOnlyStoreError,
    StoreChangedError,
    StoreClosedError,
    StoreExistsError,
    UnsupportedFormatError,
)
from hmem.store.maintenance import StoreMaintenance, directory_bytes, orphan_files
from hmem.formats.manifest import Manifest, Pending, ShardInfo
from hmem.store.projection import Projector, similarity
from hmem.formats.records import ENTRIES_FILE, EVICTED
from hmem.store.results import EntryInfo, QueryResult, ShardStats, StoredEntry, StoreStats, as_framework
from hmem.store.search import SearchIndex
from hmem import validation
from hmem.store.tensors import as_rows

ID_LEASE = 4096  # ids reserved per index.json write
_READ_RETRIES = 5
_U32_MAX = 0xFFFFFFFF
FRAMEWORKS = ("numpy", "torch")


class Entry(NamedTuple):
    """One put of a batch (``Store.put_many``)."""

    keys: Any
    values: Any
    layer_idx: int = 0
    importance: float = 1.0


@dataclasses.dataclass
class _Prepared:
    """A validated put, ready to be stored."""

    keys: np.ndarray
    values: np.ndarray
    layer_idx: int
    importance: float
    signature: np.ndarray
    pooled: np.ndarray

    @property
    def n_tokens(self) -> int:
        return self.keys.shape[0]


class Store(StoreMaintenance):
    """A store directory opened for writing (one process at a time) or reading.

    Use ``Store.create`` or ``Store.open``; close it (or use ``with``) so that
    everything put is flushed and the write lock is released.  A Store object
    may be shared between threads: calls are serialised.
    """

    # ---- lifecycle -----------------------------------------------------------

    def __init__(self, path: Path, mf: Manifest, *, writer: lock.WriterLock | None,
                 verify_reads: bool, index_bytes: bytes, loaded: np.ndarray) -> None:
        self.path = path
        self._lock = writer
        self._mutex = threading.RLock()
        self._verify_reads = verify_reads
        self._closed = False
        self._committed = mf  # what index.json says now
        self._listed_pending = bool(mf.pending)
        self._index_bytes = index_bytes
        cfg = mf.config
        self.config = cfg
        self._projector = Projector(cfg.embed_dim, cfg.hdc_dim, cfg.seed)
        if mf.projection != self._projector.describe():
            raise UnsupportedFormatError(
                f"{path} was written with projection {mf.projection}, which this hmem cannot reproduce",
                hint="use the hmem release that wrote it",
            )
        self._record_size = 40 + cfg.signature_bytes
        self._config_json = json.dumps(cfg.to_dict(), sort_keys=True)
        self._records = loaded
        self._n = len(loaded)
        self._committed_n = self._n
        self._dirty: set[int] = set()
        self._next_id = mf.next_entry_id
        self._id_limit = mf.next_entry_id  # ids below this are reserved in index.json
        self._shards = [dataclasses.replace(info) for info in mf.shards]  # committed, then sealed since
        self._shards_committed = len(self._shards)
        self._builder_dead = [0, 0]  # evicted entries (count, bytes) of the open shard
        self._builder: shard_builder.ShardBuilder | None = None
        self._arenas = (shard_builder.Arena(), shard_builder.Arena())  # reused by every open shard
        self._cache = shard_reader.ShardCache(cfg.max_open_shards)
        self._index = SearchIndex(cfg.signature_bytes)
        self._index.add_records(self._records, np.arange(self._n, dtype=np.int64))

    @classmethod
    def create(cls, path: str | os.PathLike, config: StoreConfig | None = None, **settings: Any) -> Store:
        """Create a new store at `path` (a missing or empty directory) and open it for writing."""
        if config is None:
            known = {f.name for f in dataclasses.fields(StoreConfig)}
            unknown = sorted(set(settings) - known)
            if unknown:
                raise InvalidArgumentError(f"unknown store setting(s): {', '.join(unknown)}",
                                           hint="settings are " + ", ".join(sorted(known)))
            config = StoreConfig(**settings)
        elif settings:
            raise InvalidArgumentError("give either a StoreConfig or settings, not both")
        elif not isinstance(config, StoreConfig):
            raise InvalidArgumentError(f"config must be a StoreConfig, got {type(config).__name__}")
        root = Path(path)
        if (root / manifest.INDEX_FILE).exists():
            raise StoreExistsError(f"{root} already holds an hmem store", hint="open it instead")
        if root.exists() and (not root.is_dir() or any(root.iterdir())):
            raise StoreExistsError(f"{root} exists and is not an empty directory",
                                   hint="choose a new path for the store")
        _io.make_dir(root)
        writer = lock.WriterLock(root)
        try:
            mf = Manifest(config=config, projection=Projector(config.embed_dim, config.hdc_dim, config.seed).describe())
            _io.write_file(root / ENTRIES_FILE, [])
            data = manifest.write(root, mf)
        except BaseException:
            writer.release()
            raise
        return cls(root, mf, writer=writer, verify_reads=True, index_bytes=data,
                   loaded=records.empty(0, config.signature_bytes))

    @classmethod
    def open(cls, path: str | os.PathLike, *, read_only: bool = False, verify_reads: bool = True,
             lock_wait: float = 0.0) -> Store:
        """Open an existing store.

        A writer takes the store's lock (waiting up to `lock_wait` seconds),
        finishes what an interrupted writer left and removes its leftovers.
        A reader (`read_only`) takes no lock and sees the last commit.
        With `verify_reads`, every tensor's checksum is checked the first
        time it is read.
        """
        root = Path(path)
        if read_only:
            return cls._open_reader(root, verify_reads)
        manifest.read_bytes(root)  # "not a store" before any lock file is made
        writer = lock.WriterLock(root, wait_seconds=lock_wait)
        try:
            data = manifest.read_bytes(root)
            mf = manifest.parse(root, data)
            rewrite.finish_pending(root, mf)
            rewrite.remove_leftovers(root, mf)
            loaded = _load_records(root, mf, resolve=False)
            return cls(root, mf, writer=writer, verify_reads=verify_reads, index_bytes=data, loaded=loaded)
        except BaseException:
            writer.release()
            raise

    @classmethod
    def _open_reader(cls, root: Path, verify_reads: bool) -> Store:
        # Load, then check index.json did not change meanwhile; a writer that
        # committed in between may have rewritten what was read.
        for _ in range(_READ_RETRIES):
            data = manifest.read_bytes(root)
            mf = manifest.parse(root, data)
            loaded = _load_records(root, mf, resolve=True)
            if manifest.read_bytes(root) == data:
                return cls(root, mf, writer=None, verify_reads=verify_reads, index_bytes=data, loaded=loaded)
            time.sleep(0.01)
        raise StoreChangedError(f"{root} kept changing while it was being opened", hint="try again")

    @property
    def read_only(self) -> bool:
        return self._lock is None

    def flush(self) -> None:
        """Make every put and access count so far durable (see the module docstring)."""
        with self._mutex:
            self._check_writable()
            self._flush(exact_ids=False)

    def close(self) -> None:
        """Flush (a writer), release the lock and drop the memory maps.  Idempotent."""
        with self._mutex:
            if self._closed:
                return
            try:
                if not self.read_only:
                    self._flush(exact_ids=True)
                    if self._listed_pending and not self._committed.pending:
                        # every listed step is done: leave index.json saying so
                        self._commit(dataclasses.replace(self._committed, generation=self._committed.generation + 1))
            finally:
                self._closed = True
                self._cache.drop()
                if self._lock is not None:
                    self._lock.release()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Never flush from the garbage collector; just let the lock go.
        writer = getattr(self, "_lock", None)
        if writer is not None:
            writer.release()

    def __repr__(self) -> str:
        mode = "closed" if self._closed else ("read-only" if self.read_only else "writer")
        return f"Store({str(self.path)!r}, {mode}, entries={self._live_count()})"

    # ---- put ------------------------------------------------------------------

    def put(self, keys: Any, values: Any, layer_idx: int = 0, importance: float = 1.0) -> int:
        """Store one entry; returns its id.  Bad input raises and stores nothing."""
        with self._mutex:
            self._check_writable()
            return self._insert([self._prepare(keys, values, layer_idx, importance)])[0]

    def put_many(self, entries: Iterable[Entry | tuple]) -> list[int]:
        """Store many entries; returns their ids in order.  Every entry is
        checked before any is stored, so one bad entry stores nothing."""
        with self._mutex:
            self._check_writable()
            prepared = self._prepare_all(entries)
            return self._insert(prepared)

    def check_entries(self, entries: Iterable[Entry | tuple]) -> int:
        """Check entries as put_many would, storing nothing (also on a
        read-only store); returns how many there are."""
        with self._mutex:
            self._check_open()
            return len(self._prepare_all(entries))

    def _prepare_all(self, entries: Iterable[Entry | tuple]) -> list[_Prepared]:
        prepared = []
        for i, item in enumerate(entries):
            try:
                entry = Entry(*item)
            except TypeError:
                raise InvalidArgumentError(
                    f"entry {i}: expected (keys, values[, layer_idx[, importance]]), got {type(item).__name__}"
                ) from None
            try:
                prepared.append(self._prepare(*entry))
            except InvalidArgumentError as exc:
                raise type(exc)(f"entry {i}: {exc.message}", hint=exc.hint) from None
        return prepared

    def _prepare(self, keys: Any, values: Any, layer_idx: Any, importance: Any) -> _Prepared:
        dim = self.config.embed_dim
        k = as_rows(keys, "keys", dim)  # the open shard copies them
        v = as_rows(values, "values", dim)
        if k.shape != v.shape:
            raise InvalidTensorError(f"keys {list(k.shape)} and values {list(v.shape)} differ in shape")
        if k.shape[0] > _U32_MAX:
            raise InvalidTensorError(f"an entry holds at most {_U32_MAX} tokens")
        layer = validation.layer_index(layer_idx)
        imp = validation.importance(importance)
        signature, mean = self._projector.signature_and_mean(k)
        return _Prepared(k, v, layer, imp, signature, mean.astype(np.float32))

    def _insert(self, batch: list[_Prepared]) -> list[int]:
        if not batch:
            return []
        self._make_room(batch)
        self._reserve_ids(len(batch))
        quantized = self.config.quantize_stored
        first_id, start = self._next_id, self._n
        ids = np.arange(first_id, first_id + len(batch), dtype=np.uint64)
        shard_of = np.zeros(len(batch), dtype=np.uint32)
        sizes = [int(self._entry_file_bytes(p.n_tokens)) for p in batch]
        if self._batch_rolls_over(sizes):
            # Seal what came before, so every shard sealed below holds
            # entries of this batch only and a failure can take them back.
            self._seal_builder()
        shards_mark = len(self._shards)
        builder_mark = (self._builder, self._builder.mark()) if self._builder is not None else None
        try:
            for i, p in enumerate(batch):  # each entry's own tensors go to the open shard
                builder = self._builder_for(sizes[i])
                builder.add_entry(first_id + i, p.n_tokens, _entry_tensors(p, quantized))
                shard_of[i] = builder.index
        except BaseException:
            self._undo_insert(shards_mark, builder_mark)
            raise
        self._grow(len(batch))
        rows = self._records[start : start + len(batch)]
        rows["entry_id"] = ids
        rows["layer_idx"] = [p.layer_idx for p in batch]
        rows["n_tokens"] = [p.n_tokens for p in batch]
        rows["importance"] = [p.importance for p in batch]
        rows["timestamp"] = time.time_ns()
        rows["access_count"] = 0
        rows["shard_idx"] = shard_of
        rows["signature"] = np.stack([p.signature for p in batch])
        self._next_id += len(batch)
        self._n += len(batch)
        self._index.add_records(self._records, np.arange(start, self._n, dtype=np.int64))
        return [int(i) for i in ids]

    def _batch_rolls_over(self, sizes: list[int]) -> bool:
        """Whether adding entries of these file sizes will seal the open shard."""
        b = self._builder
        entries = b.entries if b is not None else 0
        bound = b.file_bytes_bound() if b is not None else shard_file.HEADER_FIXED_BYTES
        for size in sizes:
            if entries and bound + size > self.config.shard_max_bytes:
                return True
            bound += size
            entries += 1
        return False

    def _undo_insert(self, shards_mark: int, builder_mark: tuple | None) -> None:
        """Take back a failed batch: the shards sealed for it (not yet
        committed) and its entries in the open shard."""
        for info in self._shards[shards_mark:]:
            try:
                _io.unlink(self.path / info.file)
            except OSError:
                pass  # past the commit: the next writer removes it
        del self._shards[shards_mark:]
        if builder_mark is not None and self._builder is builder_mark[0]:
            self._builder.rollback(builder_mark[1])
        else:
            self._builder = None

    def _reserve_ids(self, count: int) -> None:
        if self._next_id + count <= self._id_limit:
            return
        # Commit a new reservation (state otherwise unchanged) before use.
        mf = dataclasses.replace(self._committed, generation=self._committed.generation + 1,
                                 next_entry_id=self._next_id + count + ID_LEASE)
        self._commit(mf)
        self._id_limit = mf.next_entry_id

    def _grow(self, extra: int) -> None:
        need = self._n + extra
        if need <= len(self._records):
            return
        grown = records.empty(max(need, 2 * len(self._records), 64), self.config.signature_bytes)
        grown[: self._n] = self._records[: self._n]
        self._records = grown

    def _next_shard_index(self) -> int:
        return len(self._shards)

    def _builder_for(self, entry_bytes: int) -> shard_builder.ShardBuilder:
        """The open shard, sealed first and replaced when this entry would
        push it past shard_max_bytes (an entry larger than the limit gets a
        shard of its own)."""
        b = self._builder
        if b is not None and b.entries and b.file_bytes_bound() + entry_bytes > self.config.shard_max_bytes:
            self._seal_builder()
            b = None
        if b is None:
            b = self._builder = shard_builder.ShardBuilder(self._next_shard_index(), uuid.uuid4().hex, self._arenas,
                                                    self._config_json)
        return b

    def _seal_builder(self) -> None:
        b = self._builder
        if b is None or not b.entries:
            return
        name = shard_file.shard_file(b.index)
        size, index_crc = b.seal(self.path / name)
        dead_entries, dead_bytes = self._builder_dead
        self._shards.append(ShardInfo(file=name, bytes=size, uid=b.uid, entries=b.entries, index_crc=index_crc,
                                      dead_entries=dead_entries, dead_bytes=dead_bytes))
        self._builder = None
        self._builder_dead = [0, 0]

    # ---- flush ----------------------------------------------------------------

    def _flush(self, *, exact_ids: bool) -> None:
        new = self._n - self._committed_n
        next_id = self._next_id if exact_ids else self._id_limit
        if not new and not self._dirty and self._builder is None and self._shards == self._committed.shards \
                and next_id == self._committed.next_entry_id:
            return
        self._seal_builder()
        _io.crash_point("flush.shards_written")
        entries_path = self.path / ENTRIES_FILE
        if new:
            fresh = self._records[self._committed_n : self._n]
            records.seal(fresh)
            _io.write_at(entries_path, self._committed_n * self._record_size, [fresh.tobytes()], create=True)
        _io.crash_point("flush.records_written")
        dirty = np.array(sorted(self._dirty), dtype=np.int64)
        if len(dirty):
            touched = self._records[dirty]
            records.seal(touched)
            self._records["checksum"][dirty] = touched["checksum"]
        # Updates a failed earlier flush could not write in place go again.
        updates = records.merge_updates(self._committed.pending.record_updates,
                                        records.updates_for(self._records, dirty))
        mf = dataclasses.replace(
            self._committed,
            generation=self._committed.generation + 1,
            record_count=self._n,
            shards=[dataclasses.replace(info) for info in self._shards],
            next_entry_id=next_id,
            pending=Pending(record_updates=updates),
        )
        self._commit(mf)
        self._committed_n = self._n
        self._shards_committed = len(self._shards)
        self._dirty.clear()
        self._id_limit = max(self._id_limit, next_id)
        _io.crash_point("flush.committed")
        _io.write_pieces(entries_path, records.update_pieces(updates, self._record_size))
        _io.crash_point("flush.updates_written")
        self._committed.pending = Pending()  # applied; the next commit need not repeat them

    def _commit(self, mf: Manifest) -> None:
        self._index_bytes = manifest.write(self.path, mf)
        self._committed = mf
        self._listed_pending = bool(mf.pending)  # index.json lists steps (done or not)

    # ---- query ----------------------------------------------------------------

    def query(self, query: Any, layer_idx: int, top_k: int = 5, *, rerank: bool = True,
              shortlist_factor: int = 4, framework: str = "numpy",
              count_access: bool = True) -> list[QueryResult]:
        """The `top_k` entries of layer `layer_idx` most similar to `query`
        ([n_tokens, embed_dim] or [embed_dim]), best first.

        Entries are ranked by signature similarity; with `rerank`, a
        shortlist of shortlist_factor * top_k is re-ranked by the exact
        cosine of pooled keys.  Ties go to the lower entry id.  Each result
        counts as an access of its entry (persisted by the next flush; a
        read-only store does not count).
        """
        with self._mutex:
            self._check_open()
            q = as_rows(query, "query", self.config.embed_dim, allow_vector=True)
            layer = validation.layer_index(layer_idx)
            k = validation.top_k(top_k)
            if framework not in FRAMEWORKS:
                raise InvalidArgumentError(f"framework must be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
            factor = validation.integer(shortlist_factor, "shortlist_factor", low=1) if rerank else 1
            signature, q_mean = self._projector.signature_and_mean(q)
            positions, dists = self._index.search(layer, signature, k * factor)
            sims = similarity(dists, self.config.hdc_dim)
            cosines = None
            if rerank and len(positions):
                cosines = self._cosines(positions, q_mean)
                order = np.lexsort((self._records["entry_id"][positions], -cosines))[:k]
                positions, sims, cosines = positions[order], sims[order], cosines[order]
            results = [self._result(int(pos), float(sims[i]), None if cosines is None else float(cosines[i]),
                                    framework) for i, pos in enumerate(positions)]
            if count_access and not self.read_only and len(positions):
                self._count_access(positions)
                results = [dataclasses.replace(r, access_count=int(self._records["access_count"][pos]))
                           for r, pos in zip(results, positions)]
            return results

    def _cosines(self, positions: np.ndarray, target: np.ndarray) -> np.ndarray:
        # Row by row with numpy's own reduction (not a BLAS product, whose
        # rounding depends on a row's place in the block): an entry's cosine
        # is the same whatever the other candidates, and equal keys tie.
        pooled = np.stack([self._tensor(int(pos), "p") for pos in positions]).astype(np.float64)
        norms = np.sqrt((pooled * pooled).sum(axis=1)) * np.sqrt((target * target).sum())
        dots = (pooled * target).sum(axis=1)
        return np.divide(dots, norms, out=np.zeros_like(dots), where=norms > 0)

    def _count_access(self, positions: np.ndarray) -> None:
        counts = self._records["access_count"]
        counts[positions] = np.minimum(counts[positions].astype(np.int64) + 1, _U32_MAX)
        self._dirty.update(int(p) for p in positions if p < self._committed_n)

    def _result(self, pos: int, sim: float, cosine: float | None, framework: str) -> QueryResult:
        row = self._records[pos]
        keys, values = self._kv(pos)
        return QueryResult(
            entry_id=int(row["entry_id"]),
            layer_idx=int(row["layer_idx"]),
            score=sim if cosine is None else cosine,
            similarity=sim,
            cosine=cosine,
            keys=as_framework(keys, framework),
            values=as_framework(values, framework),
            n_tokens=int(row["n_tokens"]),
            importance=float(row["importance"]),
            timestamp=int(row["timestamp"]),
            access_count=int(row["access_count"]),
            shard_idx=int(row["shard_idx"]),
        )

    def _kv(self, pos: int) -> tuple[np.ndarray, np.ndarray]:
        keys, values = self._tensor(pos, "k"), self._tensor(pos, "v")
        if self.config.quantize_stored:
            keys = quantize.dequantize_rows(keys, self._tensor(pos, "ks"))
            values = quantize.dequantize_rows(values, self._tensor(pos, "vs"))
        return keys, values

    def _tensor(self, pos: int, kind: str, *, check: bool | None = None) -> np.ndarray:
        """Tensor `kind` (k, v, p, ks, vs) of the record at `pos`, its CRC
        checked on first read (with verify_reads, or when `check`)."""
        row = self._records[pos]
        entry_id, shard_idx = int(row["entry_id"]), int(row["shard_idx"])
        if self._builder is not None and shard_idx == self._builder.index:
            # The open shard's memory is reused after it is sealed: copy.
            return self._builder.get(entry_id, kind).copy()
        reader = self._reader(shard_idx)
        dtype, shape = shard_file.tensor_layout(kind, int(row["n_tokens"]), self.config.embed_dim,
                                            self.config.quantize_stored)
        array = reader.tensor(entry_id, kind, dtype, shape)
        wanted = self._verify_reads if check is None else check
        if wanted and (entry_id, kind) not in reader.verified and not reader.check(entry_id, kind, array):
            raise CorruptStoreError(f"entry {entry_id}: tensor {kind}_{entry_id} in {reader.path.name} "
                                    "fails its checksum", hint="run 'hmem verify --full'")
        return array

    def _reader(self, shard_idx: int) -> shard_reader.ShardReader:
        if shard_idx < len(self._shards):
            info = self._shards[shard_idx]
        else:
            raise CorruptStoreError(f"a record names shard {shard_idx}, which the store does not have",
                                    hint="run 'hmem verify'")
        path = _resolve(self.path, info.file, self._committed.pending)
        try:
            try:
                return self._cache.get(shard_idx, path, info)
            except CorruptStoreError:
                if path == self.path / info.file:
                    raise
                # the pending rename happened in between: the file has its final name now
                return self._cache.get(shard_idx, self.path / info.file, info)
        except (CorruptStoreError, StoreChangedError) as exc:
            # Say what really happened: a reader whose files a writer has
            # since replaced (compaction) sees them as missing or foreign;
            # when nothing was committed since, the file itself is damaged.
            changed = self._store_changed()
            if changed and self.read_only:
                raise StoreChangedError(f"{self.path} was changed by a writer since it was opened",
                                        hint="open it again") from None
            if isinstance(exc, StoreChangedError) and not changed:
                raise CorruptStoreError(f"shard {info.file} is not the file the store names (its uid differs)",
                                        hint="run 'hmem verify'") from None
            raise

    def _store_changed(self) -> bool:
        try:
            return manifest.read_bytes(self.path) != self._index_bytes
        except HmemError:
            return True

    # ---- management -------------------------------------------------------------

    def _live_count(self) -> int:
        return sum(self._index.layer_counts().values())

    def _live_positions(self) -> np.ndarray:
        return np.flatnonzero(self._records["shard_idx"][: self._n] != EVICTED)

    def _entry_file_bytes(self, n_tokens: np.ndarray | int) -> np.ndarray | int:
        """Bytes an entry of n_tokens takes in a shard, header entries and index row included."""
        quantized = self.config.quantize_stored
        tensors = 5 if quantized else 3
        return (shard_file.entry_bytes(n_tokens, self.config.embed_dim, quantized)
                + tensors * shard_file.HEADER_BYTES_PER_TENSOR + shard_file.INDEX_ROW_BYTES)

    # ---- reading entries by id -----------------------------------------------------

    def entry_ids(self, layer_idx: int | None = None) -> list[int]:
        """Ids of the live entries (of one layer, if given), ascending."""
        with self._mutex:
            self._check_open()
            return [int(i) for i in self._records["entry_id"][self._live_in(layer_idx)]]

    def entries(self, layer_idx: int | None = None) -> Iterator[EntryInfo]:
        """The metadata of the live entries (of one layer, if given), by
        ascending id: a snapshot taken when iteration starts."""
        with self._mutex:
            self._check_open()
            positions = self._live_in(layer_idx)
            rows = self._records[positions].copy()
            sizes = np.asarray(self._entry_file_bytes(rows["n_tokens"].astype(np.int64)), dtype=np.int64)
        for row, size in zip(rows, sizes.tolist()):
            yield _entry_info(row, size)

    def get(self, entry_id: int) -> StoredEntry:
        """One live entry's metadata and K/V (read-only arrays, bit-exact as
        put).  Raises EntryNotFoundError for an id that is not live."""
        with self._mutex:
            self._check_open()
            pos = self._position(validation.integer(entry_id, "entry_id", low=0))
            keys, values = self._kv(pos)
            keys, values = _read_only(keys), _read_only(values)
            row = self._records[pos]
            size = int(self._entry_file_bytes(int(row["n_tokens"])))
            return StoredEntry(_entry_info(row, size), keys, values)

    def _live_in(self, layer_idx: int | None) -> np.ndarray:
        live = self._live_positions()
        if layer_idx is not None:
            layer = validation.layer_index(layer_idx)
            live = live[self._records["layer_idx"][live] == layer]
        return live

    def _position(self, entry_id: int) -> int:
        """Where the live entry `entry_id` is in the records (ids ascend)."""
        ids = self._records["entry_id"][: self._n]
        pos = int(np.searchsorted(ids, entry_id))
        if pos >= self._n or int(ids[pos]) != entry_id or self._records["shard_idx"][pos] == EVICTED:
            raise EntryNotFoundError(f"the store at {self.path} holds no entry {entry_id}",
                                     hint="list the live ids with Store.entry_ids()")
        return pos

    def stats(self) -> StoreStats:
        with self._mutex:
            self._check_open()
            live = self._live_positions()
            rows = self._records[: self._n]
            shard_rows = [ShardStats(i, s.file, s.bytes, s.entries, s.dead_entries, s.dead_bytes,
                                     i < self._shards_committed) for i, s in enumerate(self._shards)]
            orphans, foreign = orphan_files(self.path, self._shards, self._committed.pending)
            n_tokens = rows["n_tokens"][live].astype(np.int64)
            return StoreStats(
                path=str(self.path),
                format_version=manifest.FORMAT_VERSION,
                generation=self._committed.generation,
                config=self.config,
                entries=len(live),
                evicted=self._n - len(live),
                unflushed=self._n - self._committed_n,
                layers=self._index.layer_counts(),
                shards=shard_rows,
                bytes_on_disk=self.size(),
                live_bytes=int(shard_file.entry_bytes(n_tokens, self.config.embed_dim, self.config.quantize_stored).sum()),
                reclaimable_bytes=self._plan_compaction().reclaimable_bytes,
                orphan_files=orphans,
                foreign_files=foreign,
                total_accesses=int(rows["access_count"].astype(np.int64).sum()),
                next_entry_id=self._next_id,
                kernels=kernels.describe(),
            )

    def size(self) -> int:
        """Bytes on disk: the files of the store directory (the lock file's
        transient owner record aside)."""
        with self._mutex:
            return directory_bytes(self.path)

    # ---- checks -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"the store at {self.path} is closed", hint="open it again")

    def _check_writable(self) -> None:
        self._check_open()
        if self.read_only:
            raise ReadOnlyStoreError(f"the store at {self.path} is open read-only",
                                     hint="open it without read_only to write")


# ---- helpers ---------------------------------------------------------------


def _entry_tensors(p: _Prepared, quantized: bool) -> dict[str, np.ndarray]:
    if not quantized:
        return {"k": p.keys, "v": p.values, "p": p.pooled}
    kq, ks = quantize.quantize_rows(p.keys)
    vq, vs = quantize.quantize_rows(p.values)
    return {"k": kq, "v": vq, "p": p.pooled, "ks": ks, "vs": vs}










def _entry_info(row: np.void, size: int) -> EntryInfo:
    return EntryInfo(entry_id=int(row["entry_id"]), layer_idx=int(row["layer_idx"]), n_tokens=int(row["n_tokens"]),
                     importance=float(row["importance"]), access_count=int(row["access_count"]),
                     created=int(row["timestamp"]), shard_idx=int(row["shard_idx"]), bytes=size)


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


def is_store(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory holding an hmem store (it has an
    index.json; whether that is sound is verify's question)."""
    root = Path(path)
    return root.is_dir() and (root / manifest.INDEX_FILE).is_file()


def _resolve(root: Path, name: str, pending: Pending) -> Path:
    """Where a file named by the commit is now: the source of a pending
    rename to it while that rename has not happened yet."""
    for src, dst in pending.renames:
        if dst == name and (root / src).exists():
            return root / src
    return root / name


def _load_records(root: Path, mf: Manifest, *, resolve: bool) -> np.ndarray:
    path = _resolve(root, ENTRIES_FILE, mf.pending) if resolve else root / ENTRIES_FILE
    try:
        loaded = records.read(path, mf.record_count, mf.config.signature_bytes)
    except (CorruptStoreError, FileNotFoundError):
        if path == root / ENTRIES_FILE:
            raise
        loaded = records.read(root / ENTRIES_FILE, mf.record_count, mf.config.signature_bytes)  # renamed meanwhile
    records.apply_updates(loaded, mf.pending.record_updates)
    bad = records.damaged(loaded)
    if len(bad):
        first = int(bad[0])
        raise CorruptStoreError(
            f"{len(bad)} record(s) of {ENTRIES_FILE} fail their checksum (first: record {first}, "
            f"entry {int(loaded['entry_id'][first])})",
            hint="run 'hmem verify' for the list, 'hmem verify --repair' to drop them",
        )
    return loaded


