"""Eviction and the store's limits (docs/format.md, "Eviction"): which
entries go (hmem/store/policy.py), marking them, making room for a put
under max_entries and max_disk_bytes, and deleting entries by id (the
same mark, chosen by the user rather than by score)."""

from __future__ import annotations

import numpy as np

from hmem import _io
from hmem.errors import EntryNotFoundError, EntryTooLargeError
from hmem.formats.records import EVICTED
from hmem.store.chunks import Chunks
from hmem.store.compaction import Compaction
from hmem.store.policy import eviction_order, scores
from hmem.store.prepare import PreparedBatch
from hmem.store.results import DeletePlan, EvictionPlan
from hmem.store.state import StoreState
from hmem.store.writer import Writer

DISK_LOW_WATER = 0.9  # a put past max_disk_bytes makes room down to this share, then compacts
FIXED_OVERHEAD_BYTES = 16 * 1024  # index.json, the lock and a shard's fixed header, at most
INDEX_BYTES_PER_SHARD = 320  # a shard's object in index.json, at most
INDEX_BYTES_PER_UPDATE = 32  # a pending record update in index.json (base64), at most


class Eviction:
    """Evicting entries of one StoreState, by request or to keep its limits."""

    def __init__(self, state: StoreState, writer: Writer, compaction: Compaction, chunks: Chunks) -> None:
        self.state = state
        self.writer = writer
        self.compaction = compaction
        self.chunks = chunks  # a store of chunks evicts and deletes a chunk whole

    def victims(self, target: int) -> np.ndarray:
        """Positions of the live records to evict to keep at most `target`."""
        live = self.state.live_positions()
        return self.chunks.whole(eviction_order(self.state.records, live)[: max(0, len(live) - target)])

    def plan(self, target: int) -> EvictionPlan:
        state = self.state
        victims = self.victims(target)
        rows = state.records[victims]
        return EvictionPlan(
            target_entries=target,
            entries_before=len(state.live_positions()),
            entry_ids=tuple(int(i) for i in rows["entry_id"]),
            bytes_reclaimable=int(np.sum(state.entry_file_bytes(rows["n_tokens"].astype(np.int64)))),
            lowest_score=float(scores(rows["importance"], rows["access_count"]).min()) if len(rows) else None,
        )

    def evict(self, target: int) -> int:
        """Evict down to `target` live entries, durably; returns how many went."""
        victims = self.victims(target)
        self.mark(victims)
        _io.crash_point("evict.marked")
        self.writer.flush(exact_ids=False)
        return len(victims)

    def plan_delete(self, entry_ids: np.ndarray) -> tuple[DeletePlan, np.ndarray]:
        """The live entries among `entry_ids` (unique, ascending) and their
        record positions; the others are missing."""
        state = self.state
        ids = state.records["entry_id"][: state.n]  # ascending: ids are handed out in order
        at = np.minimum(np.searchsorted(ids, entry_ids), max(state.n - 1, 0))
        found = np.zeros(len(entry_ids), dtype=bool)
        if state.n:
            found = (ids[at] == entry_ids) & (state.records["shard_idx"][at] != EVICTED)
        positions = self.chunks.whole(at[found])
        nbytes = state.entry_file_bytes(state.records["n_tokens"][positions].astype(np.int64))
        plan = DeletePlan(
            entry_ids=tuple(state.records["entry_id"][positions].tolist()),
            missing=tuple(entry_ids[~found].tolist()),
            bytes_reclaimable=int(np.sum(nbytes)),
        )
        return plan, positions

    def delete(self, entry_ids: np.ndarray, *, missing_ok: bool) -> DeletePlan:
        """Delete the live entries of `entry_ids`, durably.  Unless
        `missing_ok`, an id naming no live entry deletes nothing and raises."""
        plan, positions = self.plan_delete(entry_ids)
        if plan.missing and not missing_ok:
            shown = ", ".join(map(str, plan.missing[:10])) + (", ..." if len(plan.missing) > 10 else "")
            raise EntryNotFoundError(
                f"the store at {self.state.path} holds no entry {shown}; nothing was deleted",
                hint="list the live ids with Store.entry_ids(), or pass missing_ok=True",
            )
        self.mark(positions)
        _io.crash_point("delete.marked")
        self.writer.flush(exact_ids=False)
        return plan

    def mark(self, victims: np.ndarray) -> int:
        """Mark records evicted (in memory) and account their bytes as dead;
        in a store of chunks, every part of a chunk one of them is in.
        Returns how many were marked."""
        victims = self.chunks.whole(victims)
        self.state.mark_evicted(victims)
        return len(victims)

    # ---- limits --------------------------------------------------------------------

    def needs_room(self, batch: PreparedBatch) -> bool:
        """Whether `batch` fits the limits only once make_room evicts; a
        batch that can never fit is refused here too.  Changes nothing:
        a put checks this beside queries, and takes the store's lock
        exclusively only to make room (Store.put)."""
        state = self.state
        cfg = state.config
        if not (cfg.max_entries or cfg.max_disk_bytes) or not len(batch):
            return False
        total = self._refuse_never_fitting(batch)
        if cfg.max_entries and len(state.live_positions()) + len(batch) > cfg.max_entries:
            return True
        return bool(cfg.max_disk_bytes) and self._usage_bytes() + total > cfg.max_disk_bytes

    def _refuse_never_fitting(self, batch: PreparedBatch) -> int:
        """The bytes `batch` adds to the store; raises when it can never fit."""
        state = self.state
        cfg = state.config
        # the shard the batch may open counts too, in index.json
        total = (
            int(np.sum(state.entry_file_bytes(batch.n_tokens)))
            + len(batch) * state.entry_overhead
            + INDEX_BYTES_PER_SHARD
        )
        if cfg.max_entries and len(batch) > cfg.max_entries:
            raise EntryTooLargeError(f"{len(batch)} entries can never fit max_entries={cfg.max_entries}")
        if cfg.max_disk_bytes and FIXED_OVERHEAD_BYTES + total > cfg.max_disk_bytes:
            raise EntryTooLargeError(
                f"{'this entry' if len(batch) == 1 else 'this batch'} needs {FIXED_OVERHEAD_BYTES + total} "
                f"bytes on disk with the store's fixed files; max_disk_bytes is {cfg.max_disk_bytes}",
                hint="raise max_disk_bytes or store smaller entries",
            )
        return total

    def make_room(self, batch: PreparedBatch) -> None:
        """Evict (and compact, for the disk limit) so that `batch` fits the
        limits; refuse a batch that can never fit.  Nothing is changed when
        it is refused."""
        state = self.state
        cfg = state.config
        if not (cfg.max_entries or cfg.max_disk_bytes) or not len(batch):
            return
        total = self._refuse_never_fitting(batch)
        live = state.live_positions()
        if cfg.max_entries and len(live) + len(batch) > cfg.max_entries:
            over = len(live) + len(batch) - cfg.max_entries
            self._evict_for_room(eviction_order(state.records, live)[:over])
        if cfg.max_disk_bytes and self._usage_bytes() + total > cfg.max_disk_bytes:
            self._make_disk_room(total)

    def _make_disk_room(self, total: int) -> None:
        """Evict and compact until `total` more bytes fit max_disk_bytes.

        Evicted bytes stay on disk until compaction, so the first round
        makes room down to 90% of the limit (the next puts need not compact
        again).  Compaction frees only shards whose dead share reaches
        MIN_DEAD_SHARE, so that it rewrites at most (1 - s) / s of what it
        frees (1x at s = 0.5): when the entries evicted so far are spread so
        thinly that it frees too little, the next round evicts the next
        entries in score order (another tenth of the limit), until the
        batch fits.  docs/format.md, "Disk usage and limits"."""
        state = self.state
        cfg = state.config
        needed = FIXED_OVERHEAD_BYTES + total
        budget = min(max(int(cfg.max_disk_bytes * DISK_LOW_WATER), needed), cfg.max_disk_bytes) - needed
        step = max(1, int(cfg.max_disk_bytes * (1 - DISK_LOW_WATER)))
        while True:
            order = eviction_order(state.records, state.live_positions())
            kept_bytes = (
                np.asarray(state.entry_file_bytes(state.records["n_tokens"][order].astype(np.int64)), dtype=np.int64)
                + state.entry_overhead
            )
            # evict the shortest prefix of `order` whose removal leaves at most `budget`
            remaining = kept_bytes.sum() - np.concatenate([[0], np.cumsum(kept_bytes)])
            self._evict_for_room(order[: int(np.argmax(remaining <= budget))])
            report = self.compaction.run(min_reclaim_share=0.0)
            if report.performed:
                state.count_limit_activity(
                    compactions=1, bytes_rewritten=report.bytes_rewritten, bytes_freed=report.bytes_freed
                )
            if self._usage_bytes() + total <= cfg.max_disk_bytes or not len(state.live_positions()):
                return
            budget = max(0, budget - step)

    def _evict_for_room(self, victims: np.ndarray) -> None:
        self.state.count_limit_activity(evicted=self.mark(victims))

    def _usage_bytes(self) -> int:
        """Bytes on disk now plus what the next flush will add: shards,
        records and their pooled.bin rows, and index.json's growth (evicted entries count until
        compaction)."""
        state = self.state
        # a shard a put sealed is being written on another thread: its file
        # counts whole once it is there (what it holds so far would count short)
        self.writer.settle()
        pending = (state.n - state.committed_n) * state.entry_overhead
        new_shards = len(state.shards) - state.shards_committed
        if state.builder is not None:
            pending += state.builder.file_bytes_bound()
            new_shards += 1
        pending += new_shards * INDEX_BYTES_PER_SHARD + len(state.dirty) * INDEX_BYTES_PER_UPDATE
        return state.stored_bytes() + pending
