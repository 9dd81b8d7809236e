"""The shard bytes of a store on object storage, fetched as reads need
them (docs/format.md, "The working copy"): each shard's object mirrored
into a sparse local file, block by block, within a bound of cached bytes;
the blocks a query needs fetched all at once, the requests of a round
made concurrently."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hmem import _io
from hmem.errors import CorruptStoreError, Hint, StoreChangedError
from hmem.formats import objects as fmt
from hmem.object_store import ObjectClient, ObjectMissing

FETCH_BLOCK = 1 << 20  # shard bytes are fetched in whole blocks of this size
FETCH_THREADS = 16  # ranged GETs in flight at once; they wait on the network, not the CPU

_FETCHERS: concurrent.futures.ThreadPoolExecutor | None = None
_FETCHERS_LOCK = threading.Lock()


def fetch_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _FETCHERS
    with _FETCHERS_LOCK:
        if _FETCHERS is None:
            _FETCHERS = concurrent.futures.ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="hmem-fetch")
        return _FETCHERS


class RemoteShardFile:
    """One shard's object, mirrored into a sparse local file block by block
    as reads need its bytes (the reads go through the file's memory map)."""

    def __init__(
        self, fetcher: ShardFetcher, key: str, path: Path, size: int, head: tuple[int, Any] | None = None
    ) -> None:
        self.fd = -1  # set before anything that may fail: close (and __del__) need it
        self.fetcher = fetcher
        self.key = key
        self.path = path
        self.size = size
        # (data start, hmem_index bytes) from the state objects: a reader
        # need not fetch the shard's first block (docs/format.md, "State objects")
        self.head = head
        self.fd = _io.open_cache_file(path, size)
        self.present = np.zeros(-(-size // FETCH_BLOCK), dtype=bool)
        self.fetched_bytes = 0
        self.lock = threading.Lock()
        self.last_used = time.monotonic()

    def missing_runs(self, start: int, end: int) -> list[tuple[int, int]]:
        """Byte ranges [begin, stop) of the whole blocks of [start, end)
        not yet present, one per run of consecutive blocks."""
        end = min(end, self.size)
        if end <= start:
            return []
        first, last = start // FETCH_BLOCK, -(-end // FETCH_BLOCK)
        missing = ~self.present[first:last]
        if not missing.any():
            return []
        edges = np.flatnonzero(np.diff(np.concatenate(([0], missing.astype(np.int8), [0]))))
        return [
            ((first + int(lo)) * FETCH_BLOCK, min((first + int(hi)) * FETCH_BLOCK, self.size))
            for lo, hi in zip(edges[0::2], edges[1::2])
        ]

    def store(self, begin: int, data: bytes) -> int:
        """Write fetched whole blocks from `begin`; returns the bytes newly
        held (blocks already present, fetched again between two wanted
        ranges or by another thread meanwhile, are the same bytes: objects
        never change)."""
        with self.lock:
            first, last = begin // FETCH_BLOCK, -(-(begin + len(data)) // FETCH_BLOCK)
            new = ~self.present[first:last]
            if not new.any():
                return 0
            _io.write_cache_at(self.fd, self.path, begin, data)
            self.present[first:last] = True
            added = int(new.sum()) * FETCH_BLOCK
            if new[-1]:  # the file's last block may be short
                added -= last * FETCH_BLOCK - min(last * FETCH_BLOCK, self.size)
            self.fetched_bytes += added
            return added

    def ensure(self, start: int, end: int) -> None:
        """Make bytes [start, end) present in the local file."""
        end = min(end, self.size)
        if end <= start:
            return
        first, last = start // FETCH_BLOCK, -(-end // FETCH_BLOCK)
        self.last_used = time.monotonic()
        if self.present[first:last].all():
            return
        fetched = 0
        with self.lock:
            missing = ~self.present[first:last]
            if not missing.any():
                return
            # one ranged GET per run of missing blocks
            edges = np.flatnonzero(np.diff(np.concatenate(([0], missing.astype(np.int8), [0]))))
            for lo, hi in zip(edges[0::2], edges[1::2]):
                begin = (first + int(lo)) * FETCH_BLOCK
                stop = min((first + int(hi)) * FETCH_BLOCK, self.size)
                try:
                    data = self.fetcher.client.get_range(self.key, begin, stop) if stop > begin else b""
                except ObjectMissing:
                    raise self.fetcher.missing(self.key) from None
                _io.write_cache_at(self.fd, self.path, begin, data)
                self.present[first + int(lo) : first + int(hi)] = True
                self.fetched_bytes += len(data)
                fetched += len(data)
        # outside this file's lock: the cache may drop files and tell the
        # shard cache, whose lock a thread may hold while it waits for ours
        self.fetcher.fetched(fetched)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        self.close()


class ShardFetcher:
    """The shard files of a store on object storage that this process read
    from, by uid, within a bound of `cache_bytes` fetched bytes (the least
    recently used shard's file goes first; readers still using it keep it):
    the ShardSource (hmem/store/placement.py) of a store on object storage."""

    def __init__(self, client: ObjectClient, directory: Path, cache_bytes: int) -> None:
        self.client = client
        self.directory = directory
        self.cache_bytes = cache_bytes
        self.remote: dict[str, dict[str, Any]] = {}  # uid -> {"key", "bytes"} of shards that live remotely
        self.heads: dict[str, tuple[int, Any]] = {}  # uid -> (data start, index bytes) from the state objects
        self._files: dict[str, RemoteShardFile] = {}
        self._bytes = 0
        self._lock = threading.RLock()
        # called with a uid whose file was dropped (the shard cache forgets its map)
        self.on_drop: Callable[[str], None] | None = None
        self.manifest_etag: str | None = None  # of the commit the shards were named by
        self.coalesce_bytes = 0  # ranges of one shard this close are fetched by one GET (fetch_many)

    def missing(self, key: str) -> Exception:
        """The error for a shard object that is gone: the store changed
        (a newer commit retired and removed it) or it is damaged."""
        try:
            _, etag = self.client.get(fmt.MANIFEST_KEY, max_bytes=fmt.MAX_MANIFEST_BYTES)
        except ObjectMissing:
            etag = None
        if etag != self.manifest_etag:
            return StoreChangedError(
                f"{self.client.url} changed since it was opened (shard object {key} is gone)", hint=Hint.REFRESH
            )
        return CorruptStoreError(f"{self.client.url}: shard object {key} is missing", hint=Hint.VERIFY)

    def source(self, uid: str) -> RemoteShardFile | None:
        """The local mirror of shard `uid`, or None when its file is local
        (a shard this writer made)."""
        info = self.remote.get(uid)
        if info is None:
            return None
        with self._lock:
            found = self._files.get(uid)
            if found is None:
                path = self.directory / f"{uid}.safetensors"
                _io.unlink(path)  # a file dropped from the cache earlier
                found = self._files[uid] = RemoteShardFile(self, info["key"], path, info["bytes"], self.heads.get(uid))
            return found

    def remote_bytes(self, uid: str) -> int | None:
        info = self.remote.get(uid)
        return None if info is None else int(info["bytes"])

    def fetch_ranges(self, spans: list[tuple[str, int, int]]) -> None:
        files = {uid: self.source(uid) for uid in {uid for uid, _, _ in spans}}
        self.fetch_many([(found, start, end) for uid, start, end in spans if (found := files[uid]) is not None])

    def fetched(self, nbytes: int) -> None:
        """Count fetched bytes; past the bound, drop the least recently used
        files (called holding no lock: on_drop takes the shard cache's)."""
        dropped = []
        with self._lock:
            self._bytes += nbytes
            while self._bytes > self.cache_bytes and len(self._files) > 1:
                uid, victim = min(self._files.items(), key=lambda item: item[1].last_used)
                del self._files[uid]
                self._bytes -= victim.fetched_bytes
                _io.unlink(victim.path)  # readers that still map it keep its bytes
                dropped.append(uid)
        if self.on_drop is not None:
            for uid in dropped:
                self.on_drop(uid)

    def fetch_heads(self, uids: list[str]) -> None:
        """The first block of each of these shards whose head the state
        objects did not give (its header and entry index, which every read
        of a shard checks first), concurrently."""
        files = [found for found in (self.source(uid) for uid in uids) if found is not None and found.head is None]
        self.fetch_many([(found, 0, FETCH_BLOCK) for found in files])

    def fetch_many(self, spans: list[tuple[RemoteShardFile, int, int]]) -> None:
        """Make each (file, start, end) present, the missing blocks' ranged
        GETs made concurrently (obstore waits without the GIL).  Ranges of
        one file whose blocks touch, or lie at most `coalesce_bytes` apart
        (in whole blocks), are fetched by one GET (the blocks between them
        too, present or not)."""
        gap = self.coalesce_bytes // FETCH_BLOCK
        by_file: dict[int, tuple[RemoteShardFile, list[tuple[int, int]]]] = {}
        for found, start, end in spans:
            end = min(end, found.size)
            if end > start:
                by_file.setdefault(id(found), (found, []))[1].append((start // FETCH_BLOCK, -(-end // FETCH_BLOCK)))
        work: list[tuple[RemoteShardFile, int, int]] = []
        for found, blocks in by_file.values():
            runs: list[list[int]] = []
            for lo, hi in sorted(blocks):
                if runs and lo <= runs[-1][1]:
                    runs[-1][1] = max(runs[-1][1], hi)
                else:
                    runs.append([lo, hi])
            wanted: list[list[int]] = []  # the missing blocks of each run, runs at most `gap` blocks apart joined
            for lo, hi in runs:
                for begin, stop in found.missing_runs(lo * FETCH_BLOCK, hi * FETCH_BLOCK):
                    first, last = begin // FETCH_BLOCK, -(-stop // FETCH_BLOCK)
                    if wanted and first - wanted[-1][1] <= gap:
                        wanted[-1][1] = last
                    else:
                        wanted.append([first, last])
            work += [(found, first * FETCH_BLOCK, min(last * FETCH_BLOCK, found.size)) for first, last in wanted]
        if not work:
            return

        def fetch(item: tuple[RemoteShardFile, int, int]) -> int:
            found, begin, stop = item
            found.last_used = time.monotonic()
            try:
                data = self.client.get_range(found.key, begin, stop)
            except ObjectMissing:
                raise self.missing(found.key) from None
            return found.store(begin, data)

        self.fetched(fetch(work[0]) if len(work) == 1 else sum(fetch_pool().map(fetch, work)))

    def cached_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def close(self) -> None:
        with self._lock:
            for found in self._files.values():
                found.close()
            self._files.clear()
