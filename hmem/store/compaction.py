"""Compaction: free the bytes of evicted entries, shard by shard
(docs/format.md, "Compaction").

Incremental by default: only shards whose dead share (evicted tensor bytes
over the file's bytes) reaches `min_dead_share` are touched, one commit
each, so the extra disk a compaction needs at any moment is one shard's
live bytes (the bound docs/reliability.md states) and the bytes it
rewrites are at most (1 - share) / share of the bytes it frees:

- a shard with no live entry left is dropped: the last shard of the list
  takes its index under a second name (a hard link, no byte copied), or
  it is simply cut from the end of the list;
- a shard with live entries is rewritten under a temporary name, holding
  only those, and renamed over itself (the same index: no record changes);
- the records of evicted entries are dropped (entries.bin and pooled.bin
  written anew, without them) once they are that share of the records.

`repack` keeps the whole-store rewrite (hmem/store/rewrite.py, shared with
repair): every live entry copied into shards packed from 0, which merges
small shards but needs room for a copy of all live data."""

from __future__ import annotations

import dataclasses
import errno
import functools
import math
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hmem import _io
from hmem.errors import CorruptStoreError, Hint, HmemError
from hmem.formats import manifest, records, shard_file, stamp, store_files
from hmem.formats.manifest import Manifest, Pending, ShardInfo
from hmem.formats.records import EVICTED
from hmem.formats.store_files import ENTRIES_FILE, POOLED_FILE
from hmem.kernels import checksum as checksum_kernels
from hmem.store import rewrite, shard_builder
from hmem.store.reading import EntryReader
from hmem.store.results import CompactionPlan, CompactionReport
from hmem.store.state import StoreState
from hmem.store.writer import Writer

Progress = Callable[[int, int], None]

# A shard is rewritten once half its bytes are dead: the live bytes copied
# are then at most the dead bytes freed (rewritten / freed <= (1 - s) / s).
MIN_DEAD_SHARE = 0.5
# link() errors of a file system without hard links: the shard is copied instead
_NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EXDEV}
TEMP_PREFIX = rewrite.TEMP_PREFIX


@dataclasses.dataclass(frozen=True)
class _Choice:
    """What an incremental compaction of the current shards would do."""

    dropped: tuple[int, ...]  # shards without live entries (indices, ascending)
    rewritten: tuple[int, ...]  # shards past the dead share with live entries
    drop_records: bool  # entries.bin and pooled.bin written without the evicted records
    freed: int  # bytes those steps free (orphan files aside)
    rewrite_bytes: int  # live bytes they copy
    dead_left: int  # dead bytes left where they are (below the share)


class Compaction:
    """Planning and running compaction on one StoreState."""

    def __init__(self, state: StoreState, writer: Writer, reader: EntryReader) -> None:
        self.state = state
        self.writer = writer
        self.reader = reader

    def orphans(self) -> list[str]:
        """Files of the store directory that hmem made and no commit names."""
        state = self.state
        return store_files.classify(state.path, state.shards, state.committed.pending).orphans

    # ---- planning ----------------------------------------------------------------------

    def _shards_to_be(self) -> list[ShardInfo]:
        """The shards as the flush that starts a compaction leaves them:
        the open shard counted as sealed (its bound as its size)."""
        state = self.state
        shards = list(state.shards)
        b = state.builder
        if b is not None and b.entries:
            dead = state.builder_dead
            shards.append(
                ShardInfo(
                    file=store_files.shard_file(b.index),
                    bytes=b.file_bytes_bound(),
                    uid=b.uid,
                    entries=b.entries,
                    index_crc=0,
                    dead_entries=dead.entries,
                    dead_bytes=dead.bytes,
                )
            )
        return shards

    def _choose(self, shards: list[ShardInfo], min_dead_share: float) -> _Choice:
        state = self.state
        dropped = tuple(i for i, s in enumerate(shards) if s.dead_entries >= s.entries)
        # Each shard's dead share: its dead bytes over dead + live, both counted
        # the same way (entry_file_bytes, as eviction counts dead bytes), so that
        # the live bytes a rewrite copies are at most (1 - share) / share of the
        # dead bytes it frees.
        live = state.live_positions()
        live_bytes = np.bincount(
            np.minimum(state.records["shard_idx"][live].astype(np.int64), len(shards)),
            weights=np.asarray(state.entry_file_bytes(state.records["n_tokens"][live].astype(np.int64)), np.float64),
            minlength=len(shards) + 1,
        )
        rewritten = tuple(
            i
            for i, s in enumerate(shards)
            if s.dead_entries < s.entries
            and s.dead_bytes
            and s.dead_bytes >= min_dead_share * (s.dead_bytes + live_bytes[i])
        )
        dead_records = state.n - len(state.live_positions())
        drop_records = bool(dead_records) and dead_records >= min_dead_share * state.n
        freed = sum(shards[i].bytes for i in dropped) + sum(shards[i].dead_bytes for i in rewritten)
        rewrite_bytes = int(sum(live_bytes[i] for i in rewritten))
        if drop_records:
            freed += dead_records * state.entry_overhead
            rewrite_bytes += (state.n - dead_records) * state.entry_overhead
        touched = set(dropped) | set(rewritten)
        dead_left = sum(s.dead_bytes for i, s in enumerate(shards) if i not in touched)
        if not drop_records:
            dead_left += dead_records * state.entry_overhead
        return _Choice(dropped, rewritten, drop_records, freed, rewrite_bytes, dead_left)

    def plan(self, min_dead_share: float = MIN_DEAD_SHARE, *, repack: bool = False) -> CompactionPlan:
        """What run() would do and gain, without changing anything."""
        state = self.state
        orphans = self.orphans()
        orphan_bytes = sum(_size(state.path / name) for name in orphans)
        before = state.stored_bytes()
        dead = state.n - len(state.live_positions())
        shards = self._shards_to_be()
        removed_files, removed_bytes = state.removed_at_open
        if repack:
            live = state.live_positions()
            sizes = np.asarray(state.entry_file_bytes(state.records["n_tokens"][live].astype(np.int64)), dtype=np.int64)
            groups = rewrite.pack(sizes, state.config.shard_max_bytes)
            needed = bool(dead or orphans or len(groups) < len(shards) or state.n > state.committed_n)
            # What repacking frees for sure: evicted tensors, records and pooled.bin rows, and
            # orphan files (merging shards saves a little more, not counted).
            reclaimable = min(
                sum(info.dead_bytes for info in shards) + dead * state.entry_overhead + orphan_bytes, before
            )
            shards_after, rewrite_bytes, dead_left = len(groups), int(sizes.sum()), 0
        else:
            choice = self._choose(shards, min_dead_share)
            # (unflushed entries too: a compaction flushes first, and always did)
            needed = bool(
                choice.dropped or choice.rewritten or choice.drop_records or orphans or state.n > state.committed_n
            )
            reclaimable = min(choice.freed + orphan_bytes, before)
            shards_after, rewrite_bytes, dead_left = (
                len(shards) - len(choice.dropped),
                choice.rewrite_bytes,
                (choice.dead_left),
            )
        return CompactionPlan(
            shards_before=len(shards),
            shards_after=shards_after,
            bytes_before=before,
            bytes_after_estimate=before - reclaimable,
            reclaimable_bytes=reclaimable,
            reclaimable_share=reclaimable / before if before else 0.0,
            evicted_records=dead,
            orphan_files=tuple(orphans),
            needed=needed,
            rewrite_bytes=rewrite_bytes,
            dead_bytes_left=dead_left,
            removed_at_open_files=removed_files,
            removed_at_open_bytes=removed_bytes,
        )

    # ---- running -----------------------------------------------------------------------

    def run(
        self,
        min_reclaim_share: float,
        progress: Progress | None = None,
        *,
        min_dead_share: float = MIN_DEAD_SHARE,
        repack: bool = False,
    ) -> CompactionReport:
        """Compact unless there is nothing to free or it would free less
        than `min_reclaim_share` of the store's bytes."""
        state = self.state
        started = time.perf_counter()
        plan = self.plan(min_dead_share, repack=repack)
        at_open = dict(
            removed_at_open_files=plan.removed_at_open_files, removed_at_open_bytes=plan.removed_at_open_bytes
        )
        if not plan.needed or plan.reclaimable_share < min_reclaim_share:
            if not plan.needed:
                reason = "already compact" if not plan.dead_bytes_left else "no shard past the dead share"
            else:
                reason = f"would free {plan.reclaimable_share:.1%}, below the threshold of {min_reclaim_share:.1%}"
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
                **at_open,
            )
        self.writer.flush(exact_ids=False)
        before = state.stored_bytes()
        shards_before = len(state.shards)
        dead_before = state.n - len(state.live_positions())
        orphans = self.orphans()
        orphan_bytes = sum(_size(state.path / name) for name in orphans)
        _io.unlink_many([state.path / name for name in orphans])  # no commit names them: nothing to rewrite
        generation = state.committed.generation
        if repack:
            written = self._repack(progress)
        else:
            written = self._steps(min_dead_share, progress)
        after = state.stored_bytes()
        return CompactionReport(
            True,
            "compacted" if state.committed.generation != generation else "removed orphan files",
            shards_before,
            len(state.shards),
            before,  # orphan files included: they are in the directory
            after,
            max(0, before - after),
            state.live_count(),
            dead_before - (state.n - len(state.live_positions())),
            len(orphans),
            time.perf_counter() - started,
            bytes_rewritten=written,
            orphan_bytes_removed=orphan_bytes,
            **at_open,
        )

    def _steps(self, min_dead_share: float, progress: Progress | None) -> int:
        """The incremental compaction, one commit per step; returns the bytes written."""
        state = self.state
        choice = self._choose(list(state.shards), min_dead_share)
        total = max(choice.rewrite_bytes, 1)
        done = [0]

        def advanced(nbytes: int) -> None:
            done[0] += nbytes
            if progress is not None:
                progress(min(done[0], total), total)

        # 1. shards without live entries, from the last one down: the tail is cut,
        #    one in the middle gets the last shard (whose index goes away)
        for index in sorted(choice.dropped, reverse=True):
            if index < len(state.shards):
                self._step(functools.partial(self._drop_shard, index, advanced))
        # 2. shards past the dead share, each rewritten over itself
        for index in self._choose(list(state.shards), min_dead_share).rewritten:
            self._step(functools.partial(self._rewrite_shard, index, index, advanced))
        # 3. the records of evicted entries
        if choice.drop_records:
            self._step(functools.partial(self._drop_records, advanced))
        return done[0]

    def _step(self, work: Callable[[], None]) -> None:
        """One step, committed whole or not at all.  Stopped before its
        commit (an exception from `progress` included), the store stands
        as the last step left it, and the Store stays usable: the files the
        step wrote go.  Stopped after it, the Store closes; opening the
        store again finishes the step."""
        generation = self.state.committed.generation
        try:
            work()
        except BaseException:  # an interrupt included
            self._after_failure(generation)
            raise

    def _drop_shard(self, index: int, advanced: Callable[[int], None]) -> None:
        """Take shard `index`, whose entries are all evicted, out of the list."""
        state = self.state
        last = len(state.shards) - 1
        while last > index and state.shards[last].dead_entries >= state.shards[last].entries:
            last -= 1  # dead shards at the end go with this step
        gone = [state.shards[i].file for i in range(last + 1, len(state.shards))]
        if last == index:
            shards = state.shards[:index]
            self._commit_step(shards, Pending(deletes=(state.shards[index].file, *gone)), moved=None)
            return
        # the last live shard takes this index: a second name for its file
        # (no byte copied), the old name deleted after the commit
        moved = state.shards[last]
        temp = TEMP_PREFIX + store_files.shard_file(index)
        source = state.path / moved.file
        linked = False
        if _local_file(state, moved):
            _io.unlink(state.path / temp)  # a leftover of an earlier attempt
            try:
                _io.link(source, state.path / temp)
                linked = True
            except OSError as exc:
                if exc.errno not in _NO_LINKS:
                    raise
        if not linked:
            # on object storage, a shard not held here (or a file system
            # without hard links): copy its live entries
            self._rewrite_shard(last, index, advanced)
            return
        _io.crash_point("compact.shard_written")
        advanced(0)
        shards = list(state.shards[:last])
        shards[index] = dataclasses.replace(moved, file=store_files.shard_file(index))
        self._commit_step(
            shards,
            Pending(renames=((temp, store_files.shard_file(index)),), deletes=(moved.file, *gone)),
            moved=(last, index),
        )

    def _rewrite_shard(self, source: int, index: int, advanced: Callable[[int], None]) -> None:
        """Write the live entries of shard `source` into a new file for
        shard `index` (the same one, or a dead one `source` replaces) and
        commit it; a later source shard leaves the list."""
        state = self.state
        old = state.shards[source]
        live = np.flatnonzero(state.records["shard_idx"][: state.n] == source)
        builder = shard_builder.ShardBuilder(index, uuid.uuid4().hex, state.config_json)
        for pos in live.tolist():
            tensors, meta = self._sources(int(pos))()
            row = state.records[pos]
            builder.add_lent_entry(int(row["entry_id"]), int(row["n_tokens"]), tensors, meta)
        name = store_files.shard_file(index)
        temp = TEMP_PREFIX + name
        size, index_crc = builder.seal(state.path / temp)
        _io.crash_point("compact.shard_written")
        advanced(size)  # a stop requested here leaves this step uncommitted
        info = ShardInfo(file=name, bytes=size, uid=builder.uid, entries=builder.entries, index_crc=index_crc)
        if source == index:
            shards = list(state.shards)
            shards[index] = info
            self._commit_step(shards, Pending(renames=((temp, name),)), moved=None)
            return
        gone = [s.file for s in state.shards[source + 1 :]]
        shards = list(state.shards[:source])
        shards[index] = info
        deletes = (old.file, *gone)  # the rename replaces shard `index`'s own file
        self._commit_step(shards, Pending(renames=((temp, name),), deletes=deletes), moved=(source, index))

    def _commit_step(self, shards: list[ShardInfo], pending: Pending, moved: tuple[int, int] | None) -> None:
        """Commit the shard list `shards` with the steps that follow it;
        `moved` = (from, to): the records of shard `from` now name `to`."""
        state = self.state
        positions = np.zeros(0, dtype=np.int64)
        if moved is not None:
            positions = np.flatnonzero(state.records["shard_idx"][: state.n] == moved[0])
        rows = state.records[positions]
        rows["shard_idx"] = moved[1] if moved is not None else 0
        records.seal(rows)
        updates = records.updates_for(rows, np.arange(len(rows)))
        updates["position"] = positions
        pending = dataclasses.replace(pending, record_updates=updates)
        _io.crash_point("compact.shards_written")
        mf = dataclasses.replace(
            state.committed, generation=state.committed.generation + 1, shards=tuple(shards), pending=pending
        )
        self._commit_and_finish(mf, lambda: state.apply_step(positions, rows, shards))

    def _drop_records(self, advanced: Callable[[int], None]) -> None:
        """entries.bin and pooled.bin written anew without the evicted records."""
        state = self.state
        live = state.live_positions()
        kept = state.records[live].copy()
        keys = []
        for pos in live.tolist():
            tensors, _ = self._sources(int(pos))()
            keys.append((tensors["p"][2], tensors["p"][3]))
        records.seal(kept)
        entries_temp, pooled_temp = TEMP_PREFIX + ENTRIES_FILE, TEMP_PREFIX + POOLED_FILE
        written = _io.write_file(state.path / entries_temp, [kept.tobytes()])
        written += _io.write_file(
            state.path / pooled_temp,
            [rewrite.pooled_rows(kept["entry_id"], keys, state.config.pooled_width).tobytes()],
        )
        _io.crash_point("compact.records_written")
        advanced(written)
        mf = dataclasses.replace(
            state.committed,
            generation=state.committed.generation + 1,
            record_count=len(kept),
            pending=Pending(renames=((entries_temp, ENTRIES_FILE), (pooled_temp, POOLED_FILE))),
        )

        def adopt() -> None:
            state.cache.drop()
            state.adopt(state.committed, None, kept)

        self._commit_and_finish(mf, adopt)

    def _commit_and_finish(self, mf: Manifest, apply: Callable[[], None]) -> None:
        """Commit `mf` (a step), do its pending steps, take it into memory,
        then commit again without them: a temporary name a later step
        writes again must never be one a commit still lists."""
        state = self.state
        self.writer.commit(mf)
        stamp.write(state.path, mf)  # after the commit, never before (hmem/formats/stamp.py)
        _io.crash_point("compact.committed")
        rewrite.finish_pending(state.path, mf)
        _io.crash_point("compact.finished")
        state.cache.drop()
        apply()
        clean = dataclasses.replace(state.committed, generation=state.committed.generation + 1, pending=Pending())
        self.writer.commit(clean)
        stamp.write(state.path, clean)

    def _after_failure(self, generation: int) -> None:
        """A step or repack that raised: close the Store when it committed
        (index.json's generation is no longer `generation`), else remove
        what it wrote."""
        state = self.state
        try:
            committed = manifest.load(state.path).generation != generation
        except HmemError:
            committed = True
        if committed:
            # Committed, but memory may not hold it: close; opening the
            # store again finishes the step.
            state.shut()
        else:
            try:
                rewrite.remove_leftovers(state.path, state.committed)
            except OSError:
                pass  # the next writer removes them

    def _repack(self, progress: Progress | None) -> int:
        """The whole-store rewrite: every live entry into shards packed from 0."""
        state = self.state
        live = state.live_positions()
        sizes = np.asarray(state.entry_file_bytes(state.records["n_tokens"][live].astype(np.int64)), dtype=np.int64)
        deletes = [info.file for info in state.shards]
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
            self._after_failure(generation)
            raise
        return sum(info.bytes for info in mf.shards) + len(new_records) * state.entry_overhead

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
                dtype, shape = shard_file.tensor_spec(
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


def _local_file(state: StoreState, info: ShardInfo) -> bool:
    """Whether shard `info`'s whole file is in the store directory (on
    object storage, a shard this writer did not make lives only there)."""
    fetcher = state.cache.fetcher
    if fetcher is not None and fetcher.remote_bytes(info.uid) is not None:
        return False
    try:
        return (state.path / info.file).stat().st_size == info.bytes
    except FileNotFoundError:
        return False


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


__all__ = ["EVICTED", "MIN_DEAD_SHARE", "Compaction"]
