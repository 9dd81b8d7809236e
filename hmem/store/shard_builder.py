"""Building a shard in memory and sealing it into its file (the format is
hmem/formats/shard_file.py and docs/format.md).

A shard's entries arrive in parts: the entries of one put_many that go to
this shard (one array per tensor kind, the entries' tensors back to back),
or, for compaction and repair, entries whose tensors stay in another file
until the shard is written.  A part is the format's EntryRun, whose
tensors shard_file.encode lays out and indexes block by block with array
operations and the kernels, never in a Python loop per tensor: a bulk put
of 100,000 small entries writes 300,000 tensors.  Put tensors are copied
into an arena whose memory is reused shard after shard, once nothing reads
the shard it held (SpareSegments).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import threading
import weakref
from pathlib import Path
from typing import Any, cast

import numpy as np

from hmem import _io, memory
from hmem.formats import shard_file
from hmem.formats.shard_file import DTYPE_NAMES, KINDS, PAIR, PER_ENTRY_KINDS, EntryRun, TensorBlock, bytes_view


class SpareSegments:
    """Arena segments that no open shard uses, kept for the next one.

    A sealed shard's segments come here only once nothing can read them any
    more: a query that took the open shard before it was sealed may still be
    copying an entry out of it while puts go on (Store.put holds the store's
    lock in intent mode, hmem/store/rwlock.py), so the segments are given
    back when the builder itself is freed, which that query's reference
    delays.  What the next open shard needs is taken from here first, else
    from memory.POOL, so steady-state puts copy into memory that is already
    mapped.

    A freed builder is noticed through a weak reference, looked at when the
    writer next takes a segment (puts are serialised; only the writer
    touches these lists).  No callback or finalizer runs when a builder is
    freed (at any moment, in any thread): nothing there can wait on a lock,
    and a Ctrl-C cannot land in one, where Python would print and drop it."""

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._watched: list[tuple[weakref.ref, Arena]] = []  # arenas whose builders were alive at the last take

    def watch(self, builder: object, arena: Arena) -> None:
        """Take `arena`'s segments back once `builder` is freed."""
        self._watched.append((weakref.ref(builder), arena))

    def _collect(self) -> None:
        """Move the segments of freed builders' arenas to the spares.  An
        interrupt here at worst lets some go with their arena, unused."""
        alive: list[tuple[weakref.ref, Arena]] = []
        freed: list[Arena] = []
        for ref, arena in self._watched:
            if ref() is None:
                freed.append(arena)
            else:
                alive.append((ref, arena))
        if freed:
            self._watched = alive
            for arena in freed:
                self._free.extend(arena.retire())

    def take(self, nbytes: int) -> np.ndarray:
        """A segment of at least `nbytes` (its contents undefined)."""
        self._collect()
        for i, segment in enumerate(self._free):
            if len(segment) >= nbytes:
                del self._free[i]
                return segment
        return memory.POOL.take(nbytes)

    def release(self) -> None:
        """Give every spare segment to memory.POOL (the store is closing);
        segments of builders still alive are freed with them."""
        self._collect()
        free, self._free, self._watched = self._free, [], []
        for segment in free:
            memory.POOL.give(segment)


class Arena:
    """Byte segments that one open shard's tensors are copied into, back to
    back.  Segments come from and go back to a SpareSegments (``retire``,
    once nothing reads the shard) and are never reallocated, so nothing is
    copied twice."""

    SEGMENT_BYTES = 16 << 20

    def __init__(self, spares: SpareSegments) -> None:
        self.spares = spares
        self._segments: list[np.ndarray] = []
        self._used: list[int] = []
        self._current = 0

    def mark(self) -> tuple:
        return (self._current, list(self._used))

    def rollback(self, mark: tuple) -> None:
        """Forget what was appended since `mark` (one assignment: an interrupt
        leaves the arena rolled back or not, never half)."""
        current, used = mark
        self._current, self._used = current, used + [0] * (len(self._segments) - len(used))

    def append(self, arrays: list[Any]) -> memoryview:
        """Copy the arrays' bytes, back to back, after the previous ones;
        returns where they now are."""
        target = self.append_space(sum(array.nbytes for array in arrays))
        at = 0
        for array in arrays:
            _copy_rows(array, target[at : at + array.nbytes])
            at += array.nbytes
        return target

    def append_pairs(self, keys: list[Any], values: list[Any], n_tokens: np.ndarray, row_bytes: int) -> memoryview:
        """Copy keys and values entry by entry (k_0, v_0, k_1, v_1, ...):
        `keys` and `values` are either one array of every entry's rows back
        to back or one array per entry, of `row_bytes` per token; returns
        where they now are (docs/format.md, "Shards": a result's K and V
        are then one byte range, one request on object storage)."""
        count = len(n_tokens)
        rows = int(n_tokens.sum())
        target = self.append_space(2 * rows * row_bytes)
        if len(keys) == count:
            at = 0
            for k, v in zip(keys, values):  # one array per entry already: a copy each, as append does
                for array in (k, v):
                    _copy_rows(array, target[at : at + array.nbytes])
                    at += array.nbytes
            return target
        (k,), (v,) = keys, values  # every entry's rows in one array (a batch joined by prepare)
        assert type(k) is np.ndarray and type(v) is np.ndarray
        n = int(n_tokens[0])
        if bool((n_tokens == n).all()):
            # entries of one length (a batch of chunks): two strided copies
            slots = np.frombuffer(target, dtype=np.uint8).reshape(count, 2, n * row_bytes)
            slots[:, 0] = np.frombuffer(bytes_view(k), dtype=np.uint8).reshape(count, n * row_bytes)
            slots[:, 1] = np.frombuffer(bytes_view(v), dtype=np.uint8).reshape(count, n * row_bytes)
            return target
        # entries of different lengths: each row goes to its entry's place,
        # one scatter per kind (token row r of entry i lands at row r + t_i
        # for keys, r + t_(i+1) for values, t the entries' token bounds)
        bounds = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(n_tokens, out=bounds[1:])
        row = np.dtype((np.void, row_bytes))
        out = np.frombuffer(target, dtype=row)
        base = np.arange(rows, dtype=np.int64)
        out[base + np.repeat(bounds[:-1], n_tokens)] = np.frombuffer(bytes_view(k), dtype=row)
        out[base + np.repeat(bounds[1:], n_tokens)] = np.frombuffer(bytes_view(v), dtype=row)
        return target

    def append_space(self, n: int) -> memoryview:
        """`n` bytes after the previous ones, to be filled by the caller."""
        while self._current < len(self._segments) and self._used[self._current] + n > len(
            self._segments[self._current]
        ):
            self._current += 1
        if self._current == len(self._segments):
            segment = self.spares.take(max(n, self.SEGMENT_BYTES))
            self._segments, self._used = [*self._segments, segment], [*self._used, 0]  # both or neither
        seg, offset = self._current, self._used[self._current]
        self._used[seg] += n
        return self._segments[seg].data[offset : offset + n]

    def retire(self) -> list[np.ndarray]:
        """Its segments, given up: nothing reads them any more."""
        segments, self._segments, self._used, self._current = self._segments, [], [], 0
        return segments


@dataclasses.dataclass
class _Part(EntryRun):
    # entries, tensors and data bytes of the builder up to this part
    # included: adding a part is one list append, which an interrupt
    # cannot cut in two
    totals: tuple[int, int, int] = (0, 0, 0)


class ShardBuilder:
    """The entries of one shard until it is sealed into its file.  Parts
    added by puts are copied into the store's arena; lent entries keep
    where their tensors lie and their checked CRCs, so nothing is copied or
    checksummed twice.  Views handed out are valid while the builder lives:
    its arena's segments go back to the spares when it is freed."""

    def __init__(self, index: int, uid: str, store_config: str = "", arena: Arena | None = None) -> None:
        """`store_config`, the store's config as JSON, goes into the shard's
        metadata so that a lost index.json can be rebuilt; `arena` is where
        put tensors are copied (builders of lent entries need none)."""
        self._arena = arena
        if arena is not None:
            # not at seal: a reader holding this builder may still copy out of it
            arena.spares.watch(self, arena)
        self.index = index
        self.uid = uid
        self.store_config = store_config
        self._parts: list[_Part] = []
        self._lent: list[tuple] = []  # lent entries not yet gathered into a part
        self._lent_totals = (0, 0, 0)  # their entries, tensors and data bytes

    def _totals(self) -> tuple[int, int, int]:
        """Entries, tensors and data bytes (metadata's share included)."""
        parts = self._parts[-1].totals if self._parts else (0, 0, 0)
        return (parts[0] + self._lent_totals[0], parts[1] + self._lent_totals[1], parts[2] + self._lent_totals[2])

    @property
    def entries(self) -> int:
        return self._totals()[0]

    @property
    def data_bytes(self) -> int:
        return self._totals()[2]

    def add_entries(
        self,
        ids: np.ndarray,
        n_tokens: np.ndarray,
        tensors: dict[str, list[np.ndarray]],
        meta: dict[int, str] | None = None,
    ) -> None:
        """Add entries (increasing ids, past every id here) whose tensors of
        each kind are the rows of the arrays tensors[kind], back to back:
        one row per entry for "p", n_tokens rows per entry for the others.
        The arrays are copied in.  The part goes in whole or not at all (an
        arena not rolled back only wastes its tail)."""
        self._gather_lent()
        assert self._arena is not None
        ids = np.asarray(ids, dtype=np.int64)
        n_tokens = np.asarray(n_tokens, dtype=np.int64)
        count = len(ids)
        token_bounds = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(n_tokens, out=token_bounds[1:])
        entry_bounds = np.arange(count + 1, dtype=np.int64)
        blocks = {}
        for kind, arrays in tensors.items():
            array = arrays[0]
            per_entry = kind in PER_ENTRY_KINDS
            row_shape = array.shape[1:]
            rows = count if per_entry else int(token_bounds[-1])
            if (
                kind not in KINDS
                or array.dtype not in DTYPE_NAMES
                or sum(len(a) for a in arrays) != rows
                or any(a.dtype != array.dtype or a.shape[1:] != row_shape or not _contiguous(a) for a in arrays)
            ):
                raise AssertionError(f"bad shard tensor {kind} ({array.dtype}, {len(arrays)} pieces)")
            if kind == "v":
                continue  # with the keys, below
            row_bytes = array.itemsize * math.prod(row_shape)
            if kind == "k":
                # keys and values entry by entry: one block of 2 × count tensors
                values = tensors["v"]
                if values[0].dtype != array.dtype or values[0].shape[1:] != row_shape:
                    raise AssertionError("keys and values of different dtypes or shapes")
                bounds = np.zeros(2 * count + 1, dtype=np.int64)
                np.cumsum(np.repeat(n_tokens * row_bytes, 2), out=bounds[1:])
                data = self._arena.append_pairs(arrays, values, n_tokens, row_bytes)
                blocks[PAIR] = TensorBlock(array.dtype, (row_shape, False), bounds, [data], None)
                continue
            bounds = (entry_bounds if per_entry else token_bounds) * row_bytes
            blocks[kind] = TensorBlock(array.dtype, (row_shape, per_entry), bounds, [self._arena.append(arrays)], None)
        if (PAIR in blocks) != ("v" in tensors):
            raise AssertionError("keys without values, or values without keys")
        meta = dict(meta or {})
        added = sum(int(b.bounds[-1]) for b in blocks.values()) + sum(shard_file.meta_bytes(m) for m in meta.values())
        entries, tensor_count, data_bytes = self._totals()
        tensors_added = count * (len(blocks) + (PAIR in blocks))  # the pair block holds two tensors an entry
        totals = (entries + count, tensor_count + tensors_added, data_bytes + added)
        self._parts.append(_Part(ids, n_tokens, blocks, meta, totals))  # one step: in or out, never half

    def add_lent_entry(
        self,
        entry_id: int,
        n_tokens: int,
        tensors: dict[str, tuple[np.dtype, tuple[int, ...], _io.FileRange, int]],
        meta: str | None = None,
    ) -> None:
        """Add one entry whose tensors stay where they are (kind -> dtype,
        shape, the bytes in another file, their checked CRC): the sealed
        file copies them inside the kernel."""
        self._lent.append((entry_id, n_tokens, tensors, meta))
        added = sum(part.length for _, _, part, _ in tensors.values())
        if meta is not None:
            added += shard_file.meta_bytes(meta)
        entries, count, data_bytes = self._lent_totals
        self._lent_totals = (entries + 1, count + len(tensors), data_bytes + added)

    def _gather_lent(self) -> None:
        """Turn the lent entries added so far into one part."""
        if not self._lent:
            return
        lent, self._lent = self._lent, []
        totals = self._totals()
        self._lent_totals = (0, 0, 0)
        ids = np.array([item[0] for item in lent], dtype=np.int64)
        n_tokens = np.array([item[1] for item in lent], dtype=np.int64)
        blocks = {}
        for kind in lent[0][2]:
            if kind == "v":
                continue  # with the keys, below
            specs = [item[2][kind] for item in lent]
            if kind == "k":
                # keys and values entry by entry (add_entries)
                specs = [spec for item in lent for spec in (item[2]["k"], item[2]["v"])]
                kind = PAIR
            dtype = specs[0][0]
            if any(spec[0] != dtype for spec in specs):
                raise AssertionError(f"lent {kind} tensors of different dtypes")
            shapes = np.array([spec[1] for spec in specs[:: 2 if kind == PAIR else 1]], dtype=np.int64).reshape(
                len(lent), -1
            )
            bounds = np.zeros(len(specs) + 1, dtype=np.int64)
            np.cumsum([spec[2].length for spec in specs], out=bounds[1:])
            blocks[kind] = TensorBlock(
                dtype,
                shapes,
                bounds,
                [spec[2] for spec in specs],
                np.array([spec[3] for spec in specs], dtype=np.uint32),
            )
        meta = {item[0]: item[3] for item in lent if item[3] is not None}
        self._parts.append(_Part(ids, n_tokens, blocks, meta, totals))

    def mark(self) -> tuple:
        self._gather_lent()
        arena = self._arena.mark() if self._arena is not None else None
        return (len(self._parts), arena)

    def rollback(self, mark: tuple) -> None:
        """Forget every part added since `mark` (one assignment: an
        interrupt leaves the builder rolled back or not, never half)."""
        parts, arena = mark
        self._parts = self._parts[:parts]
        if self._arena is not None:
            self._arena.rollback(arena)

    def file_bytes_bound(self) -> int:
        """An upper bound of the file size if sealed now."""
        return shard_file.file_bytes_bound(*self._totals())

    def _find(self, entry_id: int) -> tuple[_Part, int]:
        self._gather_lent()
        at = bisect.bisect_right(self._parts, entry_id, key=lambda part: int(part.ids[0])) - 1
        if at >= 0:
            part = self._parts[at]
            row = int(np.searchsorted(part.ids, entry_id))
            if row < len(part.ids) and part.ids[row] == entry_id:
                return part, row
        raise KeyError(entry_id)

    def meta(self, entry_id: int) -> str | None:
        """An entry's metadata (JSON), if it has any."""
        return self._find(entry_id)[0].meta.get(entry_id)

    def get(self, entry_id: int, kind: str) -> np.ndarray:
        """A tensor added by a put, as a read-only view (lent ones are not
        readable from here)."""
        part, row = self._find(entry_id)
        piece = row
        if kind in ("k", "v"):
            block, piece = part.blocks[PAIR], 2 * row + (kind == "v")
        else:
            block = part.blocks[kind]
        if len(block.data) != 1:
            raise AssertionError("a lent tensor is not readable from the open shard")
        raw = np.frombuffer(block.data[0], dtype=np.uint8)[block.bounds[piece] : block.bounds[piece + 1]]
        return raw.view(block.dtype).reshape(block.shape_of(part.n_tokens, row))

    def encode(self) -> tuple[list[Any], int]:
        """The file's bytes as buffers and file ranges, and the CRC-32C of
        its index tensor (hmem/formats/shard_file.py, encode)."""
        self._gather_lent()
        return shard_file.encode(self.uid, self.store_config, self._parts)

    def seal(self, path: Path) -> tuple[int, int]:
        """Write the shard file durably; returns (file size, index CRC)."""
        buffers, index_crc = self.encode()
        return _io.write_file(path, buffers), index_crc


class SealInFlight:
    """A full shard sealed by a put: its bytes encoded by the put itself,
    then written (under a temporary name), made durable and given its name
    on a thread of its own, while the put goes on with the next entries.

    Until the writer has waited for it (Writer.settle, before its next
    write of any file and before any commit), the shard is read from the
    builder's memory, which this keeps, as it was while the shard was open
    (hmem/store/reading.py).  If the fsync or the rename fails, the bytes
    may never reach the disk: the writer writes the whole file again from
    that memory, synchronously, and raises if that fails too.  The same
    holds for a write that fails (a full disk): the put that sealed the
    shard has returned by then, and the flush (or the put) that waits for
    it raises, its entries still in memory, as with a failed fsync."""

    def __init__(self, builder: ShardBuilder, path: Path) -> None:
        """Encode the file (its size and index CRC are listed at once);
        start() then writes it and makes it durable on its own thread."""
        self.builder = builder
        self.path = path
        self._buffers, self.index_crc = builder.encode()
        self.size = sum(
            part.length if isinstance(part, _io.FileRange) else memoryview(part).nbytes for part in self._buffers
        )
        self.error: BaseException | None = None
        # finished once, by whichever thread claims it first: the seal's own,
        # or one waiting for it (a signal may cut start() short anywhere)
        self._claim = threading.Lock()
        self._done = threading.Event()

    def discard(self) -> None:
        """Give the file up before it was started (the shard stays open):
        nothing was written yet."""
        if self._claim.acquire(blocking=False):
            self._buffers = []
            self._done.set()

    def start(self) -> None:
        threading.Thread(target=self._finish, name="hmem-seal").start()

    def _finish(self) -> None:
        if not self._claim.acquire(blocking=False):
            return  # another thread finishes it (or has)
        try:
            size = _io.write_file(self.path, self._buffers)
            assert size == self.size, "a shard's file is not the size listed for it"
        except BaseException as exc:  # reported by wait(), in the writer's thread
            self.error = exc
        finally:
            self._buffers = []  # the builder's memory stays: reads and write_again use it
            self._done.set()

    def wait(self) -> BaseException | None:
        """Wait until the file is durable under its name, or has failed (the
        error, returned).  One whose thread never started (a signal came
        between sealing and starting, or inside start) is finished here."""
        self._finish()
        self._done.wait()
        return self.error

    def write_again(self) -> None:
        """The file, written again, synchronously, from the builder's memory
        (after a failed finish): the same bytes, as the shard's listed
        size and index CRC say."""
        size, index_crc = self.builder.seal(self.path)
        assert (size, index_crc) == (self.size, self.index_crc), "a shard's bytes changed between two writes"
        self.error = None


def _copy_rows(array: Any, target: memoryview) -> None:
    """Copy rows into `target` (exactly their bytes)."""
    if type(array) is np.ndarray:
        target[:] = bytes_view(array)
    else:  # storage.WideningRows: bfloat16 words widened as they are copied
        cast(Any, array).copy_into(target)


def _contiguous(rows: Any) -> bool:
    """Whether rows given to a shard can be copied in as they are: a
    C-contiguous array, or storage.WideningRows (widened as they are copied)."""
    return rows.flags.c_contiguous if type(rows) is np.ndarray else True
