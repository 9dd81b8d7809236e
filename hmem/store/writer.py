"""The write path: checking puts, storing them in the open shard, and
flushing (docs/format.md, "The write protocol").

``insert`` keeps each entry's tensors in the open shard (in memory) and its
record in memory; when the open shard would pass shard_max_bytes it is
sealed into its file, made durable on a thread of its own while the put
goes on (``settle`` waits for it before any other file is written and
before any commit).  ``flush`` makes everything durable in this order,
each step fsynced before the next:

  1. seal the open shard into shard_NNNN.safetensors;
  2. append the new records to entries.bin, their pooled keys to
     pooled.bin (hmem/formats/pooled.py), and the new source records to
     sources.jsonl (hmem/formats/sources.py);
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
import time
from collections.abc import Iterator

import numpy as np

from hmem import _io, memory
from hmem.errors import CorruptStoreError
from hmem.formats import manifest, pooled, records, shard_file, stamp, store_files
from hmem.formats import sources as source_registry
from hmem.formats.manifest import Manifest, Pending, ShardInfo
from hmem.formats.sources import SourcesInfo
from hmem.store.prepare import PreparedBatch
from hmem.store.search import SearchIndex
from hmem.store.shard_builder import SealInFlight, ShardBuilder
from hmem.store.state import StoreState

ROWS_PER_WRITE = 1 << 16  # records (and pooled.bin rows) a flush seals and writes at a time
ID_LEASE = 4096  # ids reserved per index.json write, at least
SEALS_IN_FLIGHT = 4  # full shards a bulk put writes at once (several files reach the page cache faster than one)
ID_LEASE_MAX = 1 << 24  # and at most, past those a batch needs (_reserve_ids)


class Writer:
    """Puts and flushes of one StoreState."""

    def __init__(self, state: StoreState) -> None:
        self.state = state

    # ---- storing ----------------------------------------------------------------------

    def insert(self, batch: PreparedBatch) -> list[int]:
        """Store a checked batch (the limits already made room); returns the
        new ids.  A failure, an interrupt included, takes the whole batch
        back: it is in (one last assignment) or every part of it is undone."""
        state = self.state
        count = len(batch)
        if not count:
            return []
        self._refuse_spent_counters(count)
        self._reserve_ids(count)
        first_id, start = state.next_id, state.n
        ids = np.arange(first_id, first_id + count, dtype=np.int64)
        sizes = np.asarray(state.entry_file_bytes(batch.n_tokens), dtype=np.int64)
        for position, text in batch.meta.items():  # as the open shard counts it (shard_builder)
            sizes[position] += shard_file.meta_bytes(text)
        plan = self._plan_shards(sizes)
        if len(plan) > 1 or plan[0][2]:
            # Seal what came before, so every shard sealed below holds
            # entries of this batch only and a failure can take them back.
            self.seal_open_shard(background=True)
            plan = self._plan_shards(sizes)
        builder = state.builder
        mark = builder.mark() if builder is not None else None
        undo = (len(state.shards), builder, mark, _index_mark(state.search_index))
        try:
            shard_of = np.zeros(count, dtype=np.uint32)
            for n, (lo, hi, _) in enumerate(plan):
                if n:
                    self.seal_open_shard(background=True)
                b = self._open_shard()
                b.add_entries(
                    ids[lo:hi],
                    batch.n_tokens[lo:hi],
                    _part_tensors(batch, lo, hi),
                    {int(ids[p]): t for p, t in batch.meta.items() if lo <= p < hi},
                )
                shard_of[lo:hi] = b.index
            # The shards of this batch are written several at once; a put
            # returns with at most one still in flight, as before, so that a
            # file that cannot be written fails the put that sealed it.
            self.settle(keep=1)
            state.grow(count)
            rows = state.records[start : start + count]  # past state.n: not yet part of the store
            rows["entry_id"] = ids
            rows["layer_idx"] = batch.layer_idx
            rows["n_tokens"] = batch.n_tokens
            rows["importance"] = batch.importance
            rows["timestamp"] = time.time_ns()
            rows["access_count"] = 0
            rows["shard_idx"] = shard_of
            rows["signature"] = batch.signatures
            if state.config.spans:
                rows["spans"] = batch.spans
            state.search_index.add_records(state.records, np.arange(start, start + count, dtype=np.int64))
            state.admit_batch(count, batch.pooled)  # the batch is in (its keys taken back below if not)
        except BaseException:
            if state.n == start:
                state.withdraw_pooled(batch.pooled)
                # Queries may have met the batch's rows in the search index
                # (a put runs beside them): they finish before it goes back.
                with state.lock.exclusive():
                    self._undo_insert(*undo)
            raise
        return ids.tolist()

    def _plan_shards(self, sizes: np.ndarray) -> list[tuple[int, int, bool]]:
        """How entries of these file sizes fill shards: (lo, hi, sealed
        before) per shard, the first one the open shard.  A shard takes
        entries while its bound stays within shard_max_bytes (an entry
        larger than the limit gets a shard of its own).  Every turn of the
        loop either seals the open shard or places at least one entry, so
        it ends whatever the limit: a limit below a shard's bound must not
        send the search back before `lo` (it once looped until the memory
        ran out)."""
        limit = self.state.config.shard_max_bytes
        b = self.state.builder
        bound = b.file_bytes_bound() if b is not None else shard_file.HEADER_FIXED_BYTES
        held = b.entries if b is not None else 0
        ends = np.cumsum(sizes)
        plan, lo, sealed = [], 0, False
        while lo < len(sizes):
            before = int(ends[lo - 1]) if lo else 0
            hi = max(lo, int(np.searchsorted(ends, before + limit - bound, side="right")))
            if hi == lo:
                if held:  # the open shard is full: seal it, start a fresh one
                    bound, held, sealed = shard_file.HEADER_FIXED_BYTES, 0, True
                    continue
                hi = lo + 1
            plan.append((lo, hi, sealed))
            lo, bound, held, sealed = hi, shard_file.HEADER_FIXED_BYTES, 0, True
        return plan

    def _undo_insert(
        self, shards_mark: int, builder: ShardBuilder | None, builder_mark: tuple | None, index_mark: dict[int, int]
    ) -> None:
        """Take back a failed batch: its rows in the search index, its
        entries in the open shard from before it (`builder`, which the batch
        sealed nothing of), and the shards sealed for it (not yet committed)."""
        state = self.state
        for sealing in state.sealing:
            if sealing.builder.index >= shards_mark:
                sealing.wait()  # a shard of the batch: its file goes below with the others
                state.seal_settled(sealing)
        _index_rollback(state.search_index, index_mark)
        if builder is not None and builder_mark is not None:
            builder.rollback(builder_mark)
        sealed = len(state.shards)
        state.unseal(shards_mark, builder)
        # Files of the shards sealed for the batch, and of one whose seal was cut short.
        try:
            _io.unlink_many([state.path / store_files.shard_file(i) for i in range(shards_mark, sealed + 1)])
        except OSError:
            pass  # nothing names them: the next writer removes them

    def _refuse_spent_counters(self, count: int) -> None:
        """Refuse, before anything is written, a batch whose commit would
        take a counter past the bound index.json is held to (only a crafted
        store has one so near: docs/security.md); a reservation and the
        flush commit once each."""
        state = self.state
        headroom = dataclasses.replace(
            state.committed,
            generation=state.committed.generation + 2,
            next_entry_id=state.next_id + count,
            record_count=state.n + count,
        )
        spent = manifest.counters_problem(headroom)
        if spent is not None:
            raise CorruptStoreError(
                f"{state.path}: {spent}; nothing was stored", hint="copy the store's entries into a new store"
            )

    def _reserve_ids(self, count: int) -> None:
        state = self.state
        if state.next_id + count <= state.id_limit:
            return
        # Commit a new reservation (state otherwise unchanged) before use:
        # room for ID_LEASE more ids, as many again as this batch, or as
        # many again as the store has handed out (up to ID_LEASE_MAX), so
        # that a bulk import commits a number of times that grows with the
        # log of its size, not once per batch or two: each commit is two
        # fsyncs, 50 of them in an import of 1M entries in batches of 10,000
        # before.  A crash skips at most the reserved ids, never reuses one.
        room = max(ID_LEASE, count, min(state.next_id, ID_LEASE_MAX))
        mf = dataclasses.replace(
            state.committed,
            generation=state.committed.generation + 1,
            next_entry_id=min(state.next_id + count + room, manifest.MAX_COUNT),
        )
        self.commit(mf)
        state.reserve_ids(mf.next_entry_id)

    def _open_shard(self) -> ShardBuilder:
        """The open shard, begun when there is none."""
        return self.state.open_shard()

    def seal_open_shard(self, *, background: bool = False) -> None:
        """Write the open shard into its file (not yet committed).  With
        `background` (a put whose entries fill the shard), the file is
        encoded here, then written and made durable on a thread of its own
        while the put goes on (SealInFlight, hmem/store/shard_builder.py): a
        bulk put's writes and fsyncs then overlap its work on the next
        entries; up to SEALS_IN_FLIGHT such files are written at once."""
        self.settle(keep=SEALS_IN_FLIGHT - 1 if background else 0)
        state = self.state
        b = state.builder
        if b is None or not b.entries:
            return
        name = store_files.shard_file(b.index)
        sealing = None
        if background:
            sealing = SealInFlight(b, state.path / name)
            size, index_crc = sealing.size, sealing.index_crc
        else:
            size, index_crc = b.seal(state.path / name)
        try:
            dead = state.builder_dead
            info = ShardInfo(
                file=name,
                bytes=size,
                uid=b.uid,
                entries=b.entries,
                index_crc=index_crc,
                dead_entries=dead.entries,
                dead_bytes=dead.bytes,
            )
            # One assignment: an interrupt leaves the shard listed and closed, or open and unlisted.
            state.seal(info, sealing)
        except BaseException:
            if sealing is not None and sealing not in state.sealing:
                sealing.discard()  # still open: sealed again later
            raise
        if sealing is not None:
            sealing.start()  # (an interrupt before this: settle starts it)

    def settle(self, keep: int = 0) -> None:
        """Wait for the shard a put sealed in the background to be durable
        under its name; if that failed, write its file again from memory
        (raising if that fails too: the next settle tries again).  Every
        write of a file and every commit waits here first, so the writer's
        I/O happens in the same order as if the seal had run in the put."""
        state = self.state
        while len(state.sealing) > keep:  # the oldest first: files are made durable in the order they were sealed
            sealing = state.sealing[0]
            if sealing.wait() is not None:
                sealing.write_again()
            state.seal_settled(sealing)  # its file is there: readers read it (hmem/store/reading.py)

    # ---- flushing ---------------------------------------------------------------------

    def flush(self, *, exact_ids: bool) -> None:
        """Make everything so far durable (the module docstring).  With
        `exact_ids`, the commit keeps no spare id reservation (at close).

        Readers may run meanwhile (Store.flush holds the store's lock in
        intent mode, hmem/store/rwlock.py): each change made to memory here
        is one a query may meet at any point, and the access counts queries
        add meanwhile are taken whole, each record with its own checksum,
        under state.counts_lock, by this flush or the next."""
        state = self.state
        self.settle()
        new = state.n - state.committed_n
        next_id = state.next_id if exact_ids else state.id_limit
        if (
            not new
            and not state.dirty
            and state.builder is None
            and tuple(state.shards) == state.committed.shards
            and next_id == state.committed.next_entry_id
            and not state.imports.pending
        ):
            return
        self.seal_open_shard()
        _io.crash_point("flush.shards_written")
        taken = state.take_dirty()
        try:
            self._write_and_commit(new, next_id, taken)
        except BaseException:
            state.return_dirty(taken)  # not written: the next flush writes them
            raise

    def _write_and_commit(self, new: int, next_id: int, taken: set[int]) -> None:
        """Steps 2 to 4 of a flush for the `new` records past the commit and
        the committed records whose counts changed (`taken`)."""
        state = self.state
        start, end = state.committed_n, state.n
        with state.counts_lock:
            dirty = np.array(sorted(p for p in taken if p < start), dtype=np.int64)
            touched = state.records[dirty]
            records.seal(touched)
            state.records["checksum"][dirty] = touched["checksum"]
            changed = records.updates_for(state.records, dirty)
        entries_path = state.path / store_files.ENTRIES_FILE
        if new:
            _io.write_at(entries_path, start * state.record_size, self._sealed_records(start, end), create=True)
            # over whatever rows a failed flush left past the commit: a
            # committed record's row is always its own (hmem/formats/pooled.py)
            assert sum(len(keys) for keys in state.fresh_pooled) == new
            _io.write_at(
                state.path / pooled.POOLED_FILE,
                start * pooled.row_bytes(state.config.pooled_width),
                self._pooled_rows(start),
                create=True,
            )
        _io.crash_point("flush.records_written")
        sources_info = self._append_sources()
        # Updates a failed earlier flush could not write in place go again.
        updates = records.merge_updates(state.committed.pending.record_updates, changed)
        mf = dataclasses.replace(
            state.committed,
            generation=state.committed.generation + 1,
            record_count=end,
            shards=tuple(state.shards),  # ShardInfos are never changed in place (eviction replaces them)
            next_entry_id=next_id,
            pending=Pending(record_updates=updates),
            sources=sources_info,
        )
        adds_files = bool(new) or len(state.shards) > state.shards_committed
        self.commit(mf)
        state.imports.flushed()
        if adds_files:
            # after the commit, never before: hmem/formats/stamp.py
            stamp.write(state.path, mf)
        state.flushed(end, next_id)
        _io.crash_point("flush.committed")
        _io.write_pieces(entries_path, records.update_pieces(updates, state.record_size))
        _io.crash_point("flush.updates_written")
        state.pending_done()  # applied; the next commit need not repeat them

    def _sealed_records(self, start: int, end: int) -> Iterator[memoryview]:
        """Records [start, end) sealed, ROWS_PER_WRITE at a time, each batch
        in the same reused buffer (a copy of every new record would map
        552 MB for a million: seconds on a virtual machine, hmem/memory.py).
        Each batch is one moment's access counts: queries go on counting."""
        state = self.state
        buffer = memory.POOL.take(min(end - start, ROWS_PER_WRITE) * state.record_size)
        try:
            for lo in range(start, end, ROWS_PER_WRITE):
                hi = min(end, lo + ROWS_PER_WRITE)
                rows = buffer[: (hi - lo) * state.record_size].view(state.records.dtype)
                with state.counts_lock:
                    rows[:] = state.records[lo:hi]
                    records.seal(rows)
                    state.records["checksum"][lo:hi] = rows["checksum"]
                yield rows.view(np.uint8).data
        finally:
            memory.POOL.give(buffer)

    def _pooled_rows(self, start: int) -> Iterator[memoryview]:
        """pooled.bin's rows of the records from `start` on (the puts'
        pooled keys, in order), ROWS_PER_WRITE at a time in one reused buffer."""
        state = self.state
        dtype = pooled.row_dtype(state.config.pooled_width)
        most = max((len(keys) for keys in state.fresh_pooled), default=0)
        buffer = memory.POOL.take(min(most, ROWS_PER_WRITE) * dtype.itemsize)
        try:
            at = start
            for keys in state.fresh_pooled:
                for lo in range(0, len(keys), ROWS_PER_WRITE):
                    part = keys[lo : lo + ROWS_PER_WRITE]
                    rows = buffer[: len(part) * dtype.itemsize].view(dtype)
                    pooled.make_rows(state.records["entry_id"][at : at + len(part)], part, out=rows)
                    at += len(part)
                    yield rows.view(np.uint8).data
        finally:
            memory.POOL.give(buffer)

    def _append_sources(self) -> SourcesInfo:
        """Append the import registry's new records past its committed
        length (over any tail a failed flush left); returns what the commit
        will say of the file."""
        state = self.state
        info = state.committed.sources
        if not state.imports.pending:
            return info
        data = source_registry.encode(state.imports.pending)
        _io.write_at(state.path / source_registry.SOURCES_FILE, info.bytes, [data], create=True)
        return source_registry.appended(info, data)

    def commit(self, mf: Manifest) -> None:
        """Write index.json: `mf` becomes the committed state."""
        self.settle()  # no commit may name a shard file not yet durable
        state = self.state
        state.committed_as(*manifest.write(state.path, mf))

    def close(self) -> None:
        """The writer's part of closing: flush with exact ids, and leave
        index.json listing no steps once every listed step is done."""
        state = self.state
        self.flush(exact_ids=True)
        if state.listed_pending and not state.committed.pending:
            self.commit(dataclasses.replace(state.committed, generation=state.committed.generation + 1))


def _part_tensors(batch: PreparedBatch, lo: int, hi: int) -> dict[str, list[np.ndarray]]:
    """The shard tensors of entries lo .. hi - 1 of a batch, by kind: views
    of the batch's arrays whose rows, back to back, are those entries'."""
    if batch.joined:
        first, last = int(batch.starts[lo]), int(batch.starts[hi])
        tensors = {kind: [pieces[0][first:last]] for kind, pieces in batch.rows.items()}
    else:
        tensors = {kind: pieces[lo:hi] for kind, pieces in batch.rows.items()}
    pooled_keys = batch.pooled[lo:hi]
    if batch.spans is not None:
        # a store with span signatures keeps a row per signature: p is [S, embed_dim]
        per_entry = batch.spans.shape[1] + 1
        pooled_keys = pooled_keys.reshape(hi - lo, per_entry, pooled_keys.shape[1] // per_entry)
    tensors["p"] = [pooled_keys]
    return tensors


def _index_mark(index: SearchIndex) -> dict[int, int]:
    """The rows of each layer of the search index, to take a failed batch back."""
    return {layer_idx: layer.n for layer_idx, layer in index.layers.items()}


def _index_rollback(index: SearchIndex, mark: dict[int, int]) -> None:
    """Forget the rows appended since `mark` (appends only add rows past n)."""
    for layer_idx, layer in index.layers.items():
        layer.truncate(mark.get(layer_idx, 0))
