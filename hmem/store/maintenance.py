"""Store maintenance: eviction, the entry and disk limits, compaction, and
the K/V bridge (SPEC §2.6-2.8).

StoreMaintenance is a part of Store kept in its own module: its methods
work on the same state as the engine in hmem/store.py (records, shards,
the open shard, the search index) and are called through Store.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hmem import _io

from hmem.store import lock

from hmem.formats import manifest

from hmem.store import rewrite

from hmem.formats import shard_file
from hmem.store.bridge import AugmentedKV, augmented_kv
from hmem import validation
from hmem.errors import CorruptStoreError, EntryTooLargeError, HmemError, InvalidArgumentError
from hmem.kernels import checksum as checksum_kernels
from hmem.formats.manifest import Pending, ShardInfo
from hmem.store.policy import eviction_order, scores
from hmem.formats.records import ENTRIES_FILE, EVICTED
from hmem.store.results import CompactionPlan, CompactionReport, EvictionPlan
from hmem.store.search import SearchIndex

if TYPE_CHECKING:
    from hmem.store.store import _Prepared

DISK_LOW_WATER = 0.9  # a put past max_disk_bytes makes room down to this share, then compacts
FIXED_OVERHEAD_BYTES = 16 * 1024  # index.json, the lock and a shard's fixed header, at most
INDEX_BYTES_PER_SHARD = 320  # a shard's object in index.json, at most
INDEX_BYTES_PER_UPDATE = 32  # a pending record update in index.json (base64), at most


class StoreMaintenance:
    """Eviction, limits, compaction and the bridge, as methods of Store."""

    # eviction

    def plan_eviction(self, target_entries: int) -> EvictionPlan:
        """What evict(target_entries) would remove, without changing anything."""
        with self._mutex:
            self._check_open()
            target = validation.count(target_entries, "target_entries")
            live = self._live_positions()
            victims = eviction_order(self._records, live)[: max(0, len(live) - target)]
            return self._eviction_plan(target, len(live), victims)

    def _eviction_plan(self, target: int, live: int, victims: np.ndarray) -> EvictionPlan:
        rows = self._records[victims]
        return EvictionPlan(
            target_entries=target,
            entries_before=live,
            entry_ids=tuple(int(i) for i in rows["entry_id"]),
            bytes_reclaimable=int(np.sum(self._entry_file_bytes(rows["n_tokens"].astype(np.int64)))),
            lowest_score=float(scores(rows["importance"], rows["access_count"]).min()) if len(rows) else None,
        )

    def evict(self, target_entries: int) -> int:
        """Evict the lowest-scored live entries until at most `target_entries`
        remain (see hmem.policy); durable when it returns.  Their bytes are
        freed by the next compaction.  Returns how many were evicted."""
        with self._mutex:
            self._check_writable()
            target = validation.count(target_entries, "target_entries")
            live = self._live_positions()
            victims = eviction_order(self._records, live)[: max(0, len(live) - target)]
            self._evict_positions(victims)
            _io.crash_point("evict.marked")
            self._flush(exact_ids=False)
            return len(victims)

    def _evict_positions(self, victims: np.ndarray) -> None:
        """Mark records evicted (in memory) and account their bytes as dead."""
        if not len(victims):
            return
        self._index.remove(self._records, victims)
        rows = self._records[victims]
        sizes = self._entry_file_bytes(rows["n_tokens"].astype(np.int64))
        builder_index = self._builder.index if self._builder is not None else -1
        for shard_idx, nbytes in zip(rows["shard_idx"].tolist(), np.asarray(sizes).tolist()):
            if shard_idx == builder_index:
                self._builder_dead[0] += 1
                self._builder_dead[1] += nbytes
            else:
                info = self._shards[shard_idx]
                info.dead_entries += 1
                info.dead_bytes += nbytes
        self._records["shard_idx"][victims] = EVICTED
        self._dirty.update(int(p) for p in victims if p < self._committed_n)

    # limits

    def _make_room(self, batch: list[_Prepared]) -> None:
        """Evict (and compact, for the disk limit) so that `batch` fits the
        limits; refuse a batch that can never fit.  Nothing is changed when
        it is refused."""
        cfg = self.config
        if not (cfg.max_entries or cfg.max_disk_bytes):
            return
        sizes = [int(self._entry_file_bytes(p.n_tokens)) + self._record_size for p in batch]
        sizes[0] += INDEX_BYTES_PER_SHARD  # the shard the batch may open, in index.json
        if cfg.max_entries and len(batch) > cfg.max_entries:
            raise EntryTooLargeError(f"{len(batch)} entries can never fit max_entries={cfg.max_entries}")
        if cfg.max_disk_bytes:
            floor = self._fixed_overhead()
            if floor + sum(sizes) > cfg.max_disk_bytes:
                raise EntryTooLargeError(
                    f"{'this entry' if len(batch) == 1 else 'this batch'} needs {floor + sum(sizes)} bytes on disk "
                    f"with the store's fixed files; max_disk_bytes is {cfg.max_disk_bytes}",
                    hint="raise max_disk_bytes or store smaller entries")
        live = self._live_positions()
        if cfg.max_entries and len(live) + len(batch) > cfg.max_entries:
            over = len(live) + len(batch) - cfg.max_entries
            self._evict_positions(eviction_order(self._records, live)[:over])
        if cfg.max_disk_bytes and self._usage_bytes() + sum(sizes) > cfg.max_disk_bytes:
            # Evicted bytes stay on disk until compaction, so make room down
            # to 90% of the limit and compact once, not at every put.
            budget = max(int(cfg.max_disk_bytes * DISK_LOW_WATER), self._fixed_overhead() + sum(sizes))
            budget = min(budget, cfg.max_disk_bytes) - self._fixed_overhead() - sum(sizes)
            live = self._live_positions()
            order = eviction_order(self._records, live)
            kept_bytes = np.asarray(self._entry_file_bytes(self._records["n_tokens"][order].astype(np.int64)),
                                    dtype=np.int64) + self._record_size
            # evict the shortest prefix of `order` whose removal leaves at most `budget`
            remaining = kept_bytes.sum() - np.concatenate([[0], np.cumsum(kept_bytes)])
            count = int(np.argmax(remaining <= budget))
            self._evict_positions(order[:count])
            self._compact(min_reclaim_share=0.0)

    def _fixed_overhead(self) -> int:
        """Bytes of the store's files that do not grow with entries."""
        return FIXED_OVERHEAD_BYTES

    def _usage_bytes(self) -> int:
        """Bytes on disk now plus what the next flush will add: shards,
        records, and index.json's growth (evicted entries count until
        compaction)."""
        pending = (self._n - self._committed_n) * self._record_size
        new_shards = len(self._shards) - self._shards_committed
        if self._builder is not None:
            pending += self._builder.file_bytes_bound()
            new_shards += 1
        pending += new_shards * INDEX_BYTES_PER_SHARD + len(self._dirty) * INDEX_BYTES_PER_UPDATE
        return directory_bytes(self.path) + pending

    # compaction

    def plan_compaction(self) -> CompactionPlan:
        """What compact() would do and gain, without changing anything."""
        with self._mutex:
            self._check_open()
            return self._plan_compaction()

    def _plan_compaction(self) -> CompactionPlan:
        live = self._live_positions()
        sizes = np.asarray(self._entry_file_bytes(self._records["n_tokens"][live].astype(np.int64)), dtype=np.int64)
        groups = rewrite.pack(sizes, self.config.shard_max_bytes)
        orphans, _ = orphan_files(self.path, self._shards, self._committed.pending)
        before = directory_bytes(self.path)
        dead = self._n - len(live)
        shard_count = len(self._shards) + (1 if self._builder is not None else 0)
        needed = bool(dead or orphans or len(groups) < shard_count or self._n > self._committed_n)
        # What compaction frees for sure: evicted tensors and records, and
        # orphan files (merging shards saves a little more, not counted).
        reclaimable = (sum(info.dead_bytes for info in self._shards) + self._builder_dead[1]
                       + dead * self._record_size
                       + sum((self.path / name).stat().st_size for name in orphans if (self.path / name).exists()))
        reclaimable = min(reclaimable, before)
        return CompactionPlan(
            shards_before=shard_count,
            shards_after=len(groups),
            bytes_before=before,
            bytes_after_estimate=before - reclaimable,
            reclaimable_bytes=reclaimable,
            reclaimable_share=reclaimable / before if before else 0.0,
            evicted_records=dead,
            orphan_files=tuple(orphans),
            needed=needed,
        )

    def compact(self, min_reclaim_share: float = 0.0, *,
                progress: Callable[[int, int], None] | None = None) -> CompactionReport:
        """Rewrite the live entries into fresh shards packed up to
        shard_max_bytes, numbered from 0; drop evicted records and orphan
        files.  Ids, scores and query results do not change.

        Does nothing when the store is already compact, or when the share of
        bytes it would free is below `min_reclaim_share` (for cron jobs).
        `progress(done_bytes, total_bytes)` is called as live data is copied."""
        with self._mutex:
            self._check_writable()
            if not 0.0 <= float(min_reclaim_share) <= 1.0:
                raise InvalidArgumentError(f"min_reclaim_share must be between 0 and 1, got {min_reclaim_share}")
            return self._compact(float(min_reclaim_share), progress)

    def _compact(self, min_reclaim_share: float,
                 progress: Callable[[int, int], None] | None = None) -> CompactionReport:
        started = time.perf_counter()
        plan = self._plan_compaction()
        if not plan.needed or plan.reclaimable_share < min_reclaim_share:
            reason = "already compact" if not plan.needed else (
                f"would free {plan.reclaimable_share:.1%}, below the threshold of {min_reclaim_share:.1%}")
            return CompactionReport(False, reason, plan.shards_before, plan.shards_before, plan.bytes_before,
                                    plan.bytes_before, 0, self._live_count(), 0, 0, time.perf_counter() - started)
        self._flush(exact_ids=False)
        before = directory_bytes(self.path)
        shards_before = len(self._shards)
        orphans, _ = orphan_files(self.path, self._shards, self._committed.pending)
        if not plan.evicted_records and plan.shards_after >= len(self._shards):
            # Nothing to rewrite (no evicted data, no shards to merge): only
            # leftovers to delete.
            _io.unlink_many([self.path / name for name in orphans])
            after = directory_bytes(self.path)
            return CompactionReport(True, "removed orphan files", shards_before, shards_before, before, after,
                                    max(0, before - after), self._live_count(), 0, len(orphans),
                                    time.perf_counter() - started)
        live = self._live_positions()
        sizes = np.asarray(self._entry_file_bytes(self._records["n_tokens"][live].astype(np.int64)), dtype=np.int64)
        deletes = [info.file for info in self._shards] + orphans
        try:
            mf, new_records = rewrite.rewrite(
                self.path, self._committed, self._records[live], [self._sources(int(p)) for p in live], sizes,
                deletes, arenas=self._arenas, config_json=self._config_json, crash_prefix="compact",
                progress=progress)
        except BaseException:
            try:
                committed = manifest.load(self.path).generation != self._committed.generation
            except HmemError:
                committed = True
            if committed:
                # Committed, but this object's memory still holds the old
                # layout: close it; opening the store again finishes the job.
                self._closed = True
                if self._lock is not None:
                    self._lock.release()
            raise
        self._committed = mf
        self._listed_pending = False  # rewrite's last commit lists no steps
        self._cache.drop()
        # the new state in memory
        self._records = new_records
        self._n = self._committed_n = len(new_records)
        self._shards = [dataclasses.replace(info) for info in mf.shards]
        self._shards_committed = len(mf.shards)
        self._dirty.clear()
        self._index = SearchIndex(self.config.signature_bytes)
        self._index.add_records(self._records, np.arange(self._n, dtype=np.int64))
        after = directory_bytes(self.path)
        return CompactionReport(True, "compacted", shards_before, len(mf.shards), before, after,
                                max(0, before - after), self._n, plan.evicted_records, len(orphans),
                                time.perf_counter() - started)

    def _kinds(self) -> tuple[str, ...]:
        return shard_file.KINDS if self.config.quantize_stored else shard_file.KINDS[:3]

    def _sources(self, pos: int) -> Callable[[], rewrite.TensorSources]:
        """Where the tensors of record `pos` lie; each is checked against its
        CRC as it is copied (compaction must never carry damage over)."""
        def locate() -> rewrite.TensorSources:
            row = self._records[pos]
            entry_id = int(row["entry_id"])
            reader = self._reader(int(row["shard_idx"]))
            found = {}
            for kind in self._kinds():
                dtype, shape = shard_file.tensor_layout(kind, int(row["n_tokens"]), self.config.embed_dim,
                                                    self.config.quantize_stored)
                nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                crc = reader.crc(entry_id, kind)
                where = reader.file_range(entry_id, kind, nbytes)
                found[kind] = (dtype, shape, where._replace(check=_crc_check(crc, f"{kind}_{entry_id}", where)), crc)
            return found
        return locate

    # the bridge

    def augmented_kv(self, query: Any, cache_k: Any, cache_v: Any, layer_idx: int, top_k: int = 5,
                     **query_options: Any) -> AugmentedKV:
        """Keys and values of the `top_k` retrieved entries (rank order)
        followed by the cache rows, and which rows came from which entry.
        numpy in, numpy out; torch in, torch out (the cache's dtype and
        device).  Nothing retrieved gives the cache back unchanged."""
        return augmented_kv(self, query, cache_k, cache_v, layer_idx, top_k, **query_options)

def _crc_check(expected: int, name: str, where: _io.FileRange) -> Callable[[memoryview], None]:
    """A check for _io's copy: the bytes must match their recorded CRC-32C."""
    def check(data: memoryview) -> None:
        if checksum_kernels.crc32c(data) != expected:
            raise CorruptStoreError(f"tensor {name} in {where.path.name} fails its checksum",
                                    hint="run 'hmem verify --full', then 'hmem verify --repair'")
    return check

def directory_bytes(root: Path) -> int:
    """Bytes of the files of a store directory; the lock file's owner record
    (present only while a writer holds it) does not count."""
    return sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(root)
               if e.is_file(follow_symlinks=False) and e.name != lock.LOCK_FILE)

def orphan_files(root: Path, known_shards: list[ShardInfo], pending: Pending) -> tuple[list[str], list[str]]:
    """Files of the store directory no commit names: those hmem made
    (temporary files, shard files) and foreign ones, sorted."""
    known = {manifest.INDEX_FILE, ENTRIES_FILE, lock.LOCK_FILE}
    known.update(info.file for info in known_shards)
    known.update(src for src, _ in pending.renames)
    orphans, foreign = [], []
    for entry in os.scandir(root):
        if entry.name in known:
            continue
        if entry.is_file(follow_symlinks=False) and (
                entry.name.startswith(_io.TEMP_PREFIX) or shard_file.SHARD_NAME.match(entry.name)):
            orphans.append(entry.name)
        else:
            foreign.append(entry.name)
    return sorted(orphans), sorted(foreign)
