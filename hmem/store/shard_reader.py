"""Reading shard files: memory-mapped readers that go through a shard's
hmem_index, and a bounded cache of them (the format is
hmem/formats/shard_file.py and docs/format.md)."""

from __future__ import annotations

import collections
import math
import mmap
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hmem import _io, file_reads
from hmem.errors import CorruptStoreError, Hint, StoreChangedError, storage_error
from hmem.formats import shard_file
from hmem.formats.shard_file import ShardIndex, bytes_view
from hmem.kernels import checksum as checksum_kernels

if TYPE_CHECKING:
    from hmem.formats.manifest import ShardInfo
    from hmem.store.placement import FetchedFile, ShardSource


class ShardState:
    """What this process has checked of one shard file (known by its uid),
    kept while its map comes and goes: shard files never change."""

    __slots__ = ("uid", "ids", "verified", "metadata")

    def __init__(self, uid: str) -> None:
        self.uid = uid
        self.ids: np.ndarray | None = None  # entry ids of the index, once it passed its checksum
        self.verified: set[tuple[int, str]] = set()  # (entry_id, kind) whose CRC matched
        self.metadata: dict[str, str] | None = None  # the JSON header's __metadata__, once read


class ShardReader:
    """One shard file, memory-mapped, read through its hmem_index tensor."""

    def __init__(self, path: Path, info: ShardInfo, state: ShardState, source: FetchedFile | None = None) -> None:
        """Map the file described by the ShardInfo `info`; check its index
        (checksum, header row, uid) unless `state` says it was checked.
        `source`: the shard of a store on object storage, a local file its
        bytes are fetched into as they are read (hmem/store/object_link.py)."""
        self.path = path
        self.uid = info.uid
        self.state = state
        self.source = source
        try:
            # never through a link: docs/security.md
            fd = os.dup(source.fd) if source is not None else _io.open_regular(path)
        except FileNotFoundError:
            raise CorruptStoreError(f"shard {path.name} is missing", hint=Hint.VERIFY) from None
        except OSError as exc:  # permissions, a disk error: docs/reliability.md, "OS errors"
            raise storage_error(exc, "read", path, writing=False) from exc
        try:
            found = os.fstat(fd)
            # the file this reader maps (its map keeps it alive): a file
            # opened by path later is this one only if it has the same identity
            self.identity = (found.st_dev, found.st_ino)
            actual = found.st_size
            if actual != info.bytes:
                raise CorruptStoreError(
                    f"shard {path.name} is {actual} bytes, the store expects {info.bytes}", hint=Hint.VERIFY
                )
            if actual < 8:
                raise CorruptStoreError(f"shard {path.name} is damaged: too short to be safetensors", hint=Hint.VERIFY)
            # mostly holes: its size was claimed for free, and reading it would cost what is not there
            sparse = file_reads.too_sparse(fd) if source is None else None
            if sparse is not None:
                raise CorruptStoreError(f"shard {path.name} is damaged: it {sparse}", hint=Hint.VERIFY_THEN_REPAIR)
            try:
                self._map = mmap.mmap(fd, actual, access=mmap.ACCESS_READ)
            except OSError as exc:
                raise storage_error(exc, "map", path, writing=False) from exc
        finally:
            os.close(fd)
        self.size = actual
        loaded = None
        head = source.head if source is not None else None
        if head is not None:
            # a shard on object storage whose head came with the state
            # objects: its first block is not fetched.  A head that does not
            # match the shard's index CRC is not trusted: the shard's own
            # bytes are read instead, as for a shard without one
            loaded = self._head_index(info.entries, info.index_crc, *head)
        if loaded is None:
            self._ensure(0, 8)
            loaded = self._load_index(info.entries, info.index_crc)
        self.data_start, self.index = loaded

    def _ensure(self, start: int, end: int) -> None:
        """Make bytes [start, end) of the file readable (fetched, for a
        shard on object storage)."""
        if self.source is not None:
            self.source.ensure(start, end)

    @property
    def verified(self) -> set[tuple[int, str]]:
        return self.state.verified

    def _bad(self, why: str) -> CorruptStoreError:
        return CorruptStoreError(f"shard {self.path.name} is damaged: {why}", hint=Hint.VERIFY)

    def _load_index(self, entries: int, index_crc: int) -> tuple[int, ShardIndex]:
        start = shard_file.data_start(self._map)
        if shard_file.head_bytes(start, entries) > self.size:
            raise self._bad("its header or index runs past the end of the file")
        self._ensure(0, shard_file.head_bytes(start, entries))
        index = ShardIndex.view(self._map, start, entries)
        if not index.names_uid(self.uid):
            raise StoreChangedError(
                f"shard {self.path.name} was replaced since the store was opened", hint=Hint.OPEN_AGAIN
            )
        if self.state.ids is None:
            problem = index.problem(entries, self.uid, index_crc)  # as verify checks it
            if problem is not None:
                raise self._bad(problem)
            self.state.ids = np.ascontiguousarray(index.ids)
        return start, index

    def _head_index(
        self, entries: int, index_crc: int, start: int, raw: bytes | memoryview
    ) -> tuple[int, ShardIndex] | None:
        """The index a head gives, once it checks out against the store's
        record of the shard (its CRC, entries, uid); None otherwise."""
        if len(raw) != shard_file.index_bytes(entries) or start + len(raw) > self.size:
            return None
        index = ShardIndex.view(raw, 0, entries)
        # checked each time (its CRC too): heads come with every commit read
        if index.problem(entries, self.uid, index_crc) is not None:
            return None
        if self.state.ids is None:
            self.state.ids = np.ascontiguousarray(index.ids)
        return start, index

    def _row(self, entry_id: int) -> int:
        """The entry's row of the index (after its header row)."""
        ids = self.state.ids
        assert ids is not None  # set by _load_index, which every reader runs first
        row = int(ids.searchsorted(entry_id))
        if row >= len(ids) or ids[row] != entry_id:
            raise self._bad(f"it holds no entry {entry_id}")
        return row + 1

    def _locate(self, entry_id: int, kind: str) -> tuple[int, int]:
        return self.index.locate(self._row(entry_id), kind)

    def pair(self, entry_id: int, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Read-only views of an entry's keys and values (tensors k and v),
        its index row found once for both."""
        k_start, v_start = self.index.pair_offsets(self._row(entry_id))
        return self._view(entry_id, "k", k_start, dtype, shape), self._view(entry_id, "v", v_start, dtype, shape)

    def tensor(self, entry_id: int, kind: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A read-only view of one tensor in the memory map (no copy)."""
        start, _ = self._locate(entry_id, kind)
        return self._view(entry_id, kind, start, dtype, shape)

    def _view(self, entry_id: int, kind: str, start: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor at data offset `start`, checked to lie in the file."""
        nbytes = math.prod(shape) * dtype.itemsize
        begin = self.data_start + start
        if start < 0 or begin + nbytes > self.size:
            raise self._bad(f"tensor {kind}_{entry_id} lies outside the file")
        self._ensure(begin, begin + nbytes)
        if nbytes >= 1 << 16:  # read ahead instead of faulting page by page
            aligned = begin - begin % mmap.PAGESIZE
            self._map.madvise(mmap.MADV_WILLNEED, aligned, begin + nbytes - aligned)
        count = nbytes // dtype.itemsize
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=begin).reshape(shape)

    def crc(self, entry_id: int, kind: str) -> int:
        """The CRC-32C the index records for a tensor."""
        return self._locate(entry_id, kind)[1]

    def span(self, entry_id: int, kind: str, nbytes: int) -> tuple[int, int]:
        """Bytes [begin, end) of the file that hold a tensor."""
        start, _ = self._locate(entry_id, kind)
        if start < 0 or self.data_start + start + nbytes > self.size:
            raise self._bad(f"tensor {kind}_{entry_id} lies outside the file")
        return self.data_start + start, self.data_start + start + nbytes

    def spans(self, entry_ids: np.ndarray, kind: str, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        """span() and crc() of one kind of tensor of many entries, each
        `nbytes` long: the file offsets where they begin and their recorded
        CRC-32C, found with array operations."""
        ids = self.state.ids
        assert ids is not None  # set by _load_index, which every reader runs first
        rows = ids.searchsorted(entry_ids)
        found = rows < len(ids)
        found[found] = ids[rows[found]] == entry_ids[found]
        if not found.all():
            raise self._bad(f"it holds no entry {int(entry_ids[~found][0])}")
        column = shard_file.KINDS.index(kind)
        starts = self.index.rows[rows + 1, 2 + column]
        outside = (starts < 0) | (self.data_start + starts + nbytes > self.size)
        if outside.any():
            raise self._bad(f"tensor {kind}_{int(entry_ids[outside][0])} lies outside the file")
        return self.data_start + starts, self.index.rows[rows + 1, 7 + column]

    def file_range(self, entry_id: int, kind: str, nbytes: int) -> _io.FileRange:
        """Where a tensor's bytes lie in the file."""
        begin, end = self.span(entry_id, kind, nbytes)
        self._ensure(begin, end)
        return _io.FileRange(self.path if self.source is None else self.source.path, begin, nbytes)

    def check(self, entry_id: int, kind: str, tensor: np.ndarray) -> bool:
        """Whether `tensor` (read from this shard) matches its recorded CRC-32C."""
        _, expected = self._locate(entry_id, kind)
        ok = checksum_kernels.crc32c(bytes_view(tensor)) == expected
        if ok:
            self.verified.add((entry_id, kind))
        return ok

    def meta(self, entry_id: int) -> str | None:
        """An entry's metadata (JSON) from the header's __metadata__, read
        once per shard file; None when it has none."""
        if self.state.metadata is None:
            self.state.metadata = self.header()[0]
        return shard_file.meta_of(self.state.metadata, entry_id)

    def header(self) -> tuple[dict[str, str], dict[str, tuple]]:
        """The JSON header, parsed and checked (for verify and tests)."""
        self._ensure(0, self.data_start)
        metadata, entries, _ = shard_file.parse_header(self._map, self.path.name)
        return metadata, entries


class ShardCache:
    """At most `capacity` shard files memory-mapped at once (least recently
    used is dropped first).  Arrays already handed out keep their own map
    alive until they are freed.  What was checked of each shard is kept
    across evictions (ShardState, by uid)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.fetcher: ShardSource | None = None  # a store on object storage: where its shards come from
        self._open: collections.OrderedDict[int, ShardReader] = collections.OrderedDict()
        self._states: dict[str, ShardState] = {}
        # queries of several threads share the cache; a reader dropped from
        # it stays mapped while a thread still reads through it
        self._lock = threading.RLock()

    def mapped(self, index: int, uid: str) -> ShardReader | None:
        """The reader of shard `index` if it is mapped (and still file `uid`)."""
        with self._lock:
            reader = self._open.get(index)
            if reader is None or reader.uid != uid:
                return None
            self._open.move_to_end(index)
            return reader

    def get(self, index: int, path: Path, info: ShardInfo) -> ShardReader:
        """The reader of shard `index` (file at `path`, described by the
        ShardInfo `info`)."""
        with self._lock:
            reader = self._open.get(index)
            if reader is not None and reader.uid == info.uid:
                self._open.move_to_end(index)
                return reader
            state = self._states.get(info.uid)
            if state is None:
                state = self._states[info.uid] = ShardState(info.uid)
            source = self.fetcher.source(info.uid) if self.fetcher is not None else None
            reader = ShardReader(path, info, state, source)
            self._open[index] = reader
            self._open.move_to_end(index)
            while len(self._open) > self.capacity:
                self._open.popitem(last=False)
            return reader

    def drop_uid(self, uid: str) -> None:
        """Unmap the shard file `uid` (its cached copy was dropped)."""
        with self._lock:
            for index in [i for i, reader in self._open.items() if reader.uid == uid]:
                del self._open[index]

    def open_count(self) -> int:
        return len(self._open)

    def drop(self, index: int | None = None) -> None:
        """Unmap one shard, or all; what was checked is kept."""
        with self._lock:
            if index is None:
                self._open.clear()
            else:
                self._open.pop(index, None)
