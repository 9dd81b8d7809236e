"""Compaction: rewrite the live entries into fresh shards and drop evicted
records and orphan files (docs/format.md, "Compaction").  The rewrite
itself is hmem/store/rewrite.py, shared with repair."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hmem import _io
from hmem.errors import CorruptStoreError, Hint, HmemError
from hmem.formats import layout, manifest, shard_file
from hmem.kernels import checksum as checksum_kernels
from hmem.store import rewrite
from hmem.store.reading import EntryReader
from hmem.store.results import CompactionPlan, CompactionReport
from hmem.store.state import StoreState
from hmem.store.writer import Writer

Progress = Callable[[int, int], None]


class Compaction:
    """Planning and running compaction on one StoreState."""

    def __init__(self, state: StoreState, writer: Writer, reader: EntryReader) -> None:
        self.state = state
        self.writer = writer
        self.reader = reader

    def orphans(self) -> list[str]:
        """Files of the store directory that hmem made and no commit names."""
        state = self.state
        return layout.classify(state.path, state.shards, state.committed.pending).orphans

    def plan(self) -> CompactionPlan:
        """What compact() would do and gain, without changing anything."""
        state = self.state
        live = state.live_positions()
        sizes = np.asarray(state.entry_file_bytes(state.records["n_tokens"][live].astype(np.int64)), dtype=np.int64)
        groups = rewrite.pack(sizes, state.config.shard_max_bytes)
        orphans = self.orphans()
        before = state.stored_bytes()
        dead = state.n - len(live)
        shard_count = len(state.shards) + (1 if state.builder is not None else 0)
        needed = bool(dead or orphans or len(groups) < shard_count or state.n > state.committed_n)
        # What compaction frees for sure: evicted tensors, records and pooled.bin rows, and
        # orphan files (merging shards saves a little more, not counted).
        reclaimable = (
            sum(info.dead_bytes for info in state.shards)
            + state.builder_dead.bytes
            + dead * state.entry_overhead
            + sum(_size(state.path / name) for name in orphans)
        )
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

    def run(self, min_reclaim_share: float, progress: Progress | None = None) -> CompactionReport:
        """Compact unless the store is compact or would gain less than
        `min_reclaim_share` of its bytes."""
        state = self.state
        started = time.perf_counter()
        plan = self.plan()
        if not plan.needed or plan.reclaimable_share < min_reclaim_share:
            reason = (
                "already compact"
                if not plan.needed
                else (f"would free {plan.reclaimable_share:.1%}, below the threshold of {min_reclaim_share:.1%}")
            )
            return CompactionReport(
                False,
                reason,
                plan.shards_before,
                plan.shards_before,
                plan.bytes_before,
                plan.bytes_before,
                0,
                state.live_count(),
                0,
                0,
                time.perf_counter() - started,
            )
        self.writer.flush(exact_ids=False)
        before = state.stored_bytes()
        shards_before = len(state.shards)
        orphans = self.orphans()
        if not plan.evicted_records and plan.shards_after >= len(state.shards):
            # Nothing to rewrite (no evicted data, no shards to merge): only
            # leftovers to delete.
            _io.unlink_many([state.path / name for name in orphans])
            after = state.stored_bytes()
            return CompactionReport(
                True,
                "removed orphan files",
                shards_before,
                shards_before,
                before,
                after,
                max(0, before - after),
                state.live_count(),
                0,
                len(orphans),
                time.perf_counter() - started,
            )
        live = state.live_positions()
        sizes = np.asarray(state.entry_file_bytes(state.records["n_tokens"][live].astype(np.int64)), dtype=np.int64)
        deletes = [info.file for info in state.shards] + orphans
        generation = state.committed.generation
        try:
            mf, new_records = rewrite.rewrite(
                state.path,
                state.committed,
                state.records[live],
                [self._sources(int(p)) for p in live],
                sizes,
                deletes,
                config_json=state.config_json,
                crash_prefix="compact",
                progress=progress,
            )
            state.cache.drop()
            state.adopt(mf, None, new_records)
        except BaseException:  # an interrupt included
            try:
                committed = manifest.load(state.path).generation != generation
            except HmemError:
                committed = True
            if committed:
                # Committed, but memory may still hold the old layout (or
                # part of the new one): close; opening the store again
                # finishes the job.
                state.shut()
            else:
                # The old state stands (everything was flushed above) and the
                # Store stays usable: drop the new files written so far.
                try:
                    rewrite.remove_leftovers(state.path, state.committed)
                except OSError:
                    pass  # the next writer removes them
            raise
        after = state.stored_bytes()
        return CompactionReport(
            True,
            "compacted",
            shards_before,
            len(mf.shards),
            before,
            after,
            max(0, before - after),
            state.n,
            plan.evicted_records,
            len(orphans),
            time.perf_counter() - started,
        )

    def _sources(self, pos: int) -> Callable[[], rewrite.EntrySource]:
        """Where the tensors of record `pos` lie; each is checked against its
        CRC as it is copied (compaction must never carry damage over)."""
        state = self.state
        kinds = shard_file.kinds(state.config.storage_dtype)

        def locate() -> rewrite.EntrySource:
            row = state.records[pos]
            entry_id = int(row["entry_id"])
            reader = self.reader.shard(int(row["shard_idx"]))
            found = {}
            for kind in kinds:
                dtype, shape = shard_file.tensor_layout(
                    kind,
                    int(row["n_tokens"]),
                    state.config.embed_dim,
                    state.config.storage_dtype,
                    state.config.signatures_per_entry,
                )
                nbytes = math.prod(shape) * dtype.itemsize
                crc = reader.crc(entry_id, kind)
                where = reader.file_range(entry_id, kind, nbytes)
                found[kind] = (dtype, shape, where._replace(check=_crc_check(crc, f"{kind}_{entry_id}", where)), crc)
            return found, reader.meta(entry_id)

        return locate


def _crc_check(expected: int, name: str, where: _io.FileRange) -> Callable[[memoryview], None]:
    """A check for _io's copy: the bytes must match their recorded CRC-32C."""

    def check(data: memoryview) -> None:
        if checksum_kernels.crc32c(data) != expected:
            raise CorruptStoreError(
                f"tensor {name} in {where.path.name} fails its checksum", hint=Hint.VERIFY_THEN_REPAIR
            )

    return check


def _size(path: Path) -> int:
    """A file's size; 0 once it is gone (a flush under way renames its temporary files)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
