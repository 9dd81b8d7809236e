"""A store on object storage, worked on through a local working copy
(docs/format.md, "Stores on object storage").

An open store on object storage is an ordinary local store in a private
working directory (under the cache directory) plus a ``RemoteLink`` that
ties it to the objects:

- at open, the committed manifest is read and the store's small files
  (index.json, entries.bin, pooled.bin, sources.jsonl) are made from its
  state objects; shard files are not fetched: ``ShardFetcher`` fetches the
  byte ranges a read needs, once, into sparse local files, keeping at most
  ``cache_bytes`` of them;
- a writer holds the lease (``LeaseHolder``), and after each local commit
  ``publish`` uploads the new shard files and one state object with the
  bytes of the small files that changed, then replaces the manifest with a
  write conditional on the ETag it read: if another writer committed
  meanwhile, nothing is committed;
- a reader picks up new commits with ``Store.refresh()``.
"""

from __future__ import annotations

import concurrent.futures
import getpass
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from hmem import _io
from hmem.errors import (
    CorruptStoreError,
    Hint,
    InvalidArgumentError,
    NotAStoreError,
    StoreChangedError,
    StoreExistsError,
    StoreLockedError,
)
from hmem.formats import layout
from hmem.formats import remote as fmt
from hmem.formats.manifest import Manifest, Pending
from hmem.object_store import ConditionFailed, ObjectClient, ObjectMissing

CACHE_ENV = "HMEM_CACHE_DIR"
FETCH_BLOCK = 1 << 20  # shard bytes are fetched in whole blocks of this size
DEFAULT_CACHE_BYTES = 1 << 30
DEFAULT_LEASE_SECONDS = 60.0
DEFAULT_RETIRE_SECONDS = 900.0  # objects no commit names stay this long for readers of older commits
SNAPSHOT_AFTER = 16  # state objects past a snapshot before the next snapshot
_REMOTE_OPTIONS = ("cache_dir", "cache_bytes", "lease_seconds", "retire_seconds")


def split_options(options: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """storage_options split into the object client's and the link's own."""
    options = dict(options or {})
    own = {name: options.pop(name) for name in _REMOTE_OPTIONS if name in options}
    return options, own


def cache_root(cache_dir: Any = None) -> Path:
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hmem"
    return Path(cache_dir)


def _positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidArgumentError(f"storage option {name} must be a positive number, got {value!r}")
    return float(value)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def make_workdir(cache_dir: Any) -> Path:
    """A private working directory for one open store; the directories of
    processes that ended without closing theirs are removed first."""
    root = cache_root(cache_dir)
    _io.make_dir(root)
    for entry in os.scandir(root):
        parts = entry.name.split("-")
        if len(parts) == 3 and parts[0] == "remote" and parts[1].isdigit() and not _alive(int(parts[1])):
            _io.remove_tree(Path(entry.path))
    work = _io.make_private_dir(root, f"remote-{os.getpid()}-")
    _io.make_dir(work / "shards")
    return work


# ---- shard bytes, fetched on demand ---------------------------------------------------


class RemoteShardFile:
    """One shard's object, mirrored into a sparse local file block by block
    as reads need its bytes (the reads go through the file's memory map)."""

    def __init__(self, fetcher: ShardFetcher, key: str, path: Path, size: int) -> None:
        self.fetcher = fetcher
        self.key = key
        self.path = path
        self.size = size
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
        return [((first + int(lo)) * FETCH_BLOCK, min((first + int(hi)) * FETCH_BLOCK, self.size))
                for lo, hi in zip(edges[0::2], edges[1::2])]

    def store(self, begin: int, data: bytes) -> int:
        """Write fetched whole blocks from `begin`; returns the bytes newly held."""
        with self.lock:
            first, last = begin // FETCH_BLOCK, -(-(begin + len(data)) // FETCH_BLOCK)
            if self.present[first:last].all():
                return 0  # another thread fetched them meanwhile (the same bytes: objects never change)
            _io.write_cache_at(self.fd, self.path, begin, data)
            self.present[first:last] = True
            self.fetched_bytes += len(data)
            return len(data)

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
                self.present[first + int(lo): first + int(hi)] = True
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
    recently used shard's file goes first; readers still using it keep it)."""

    def __init__(self, client: ObjectClient, directory: Path, cache_bytes: int) -> None:
        self.client = client
        self.directory = directory
        self.cache_bytes = cache_bytes
        self.remote: dict[str, dict[str, Any]] = {}  # uid -> {"key", "bytes"} of shards that live remotely
        self._files: dict[str, RemoteShardFile] = {}
        self._bytes = 0
        self._lock = threading.RLock()
        self.on_drop: Any = None  # called with a uid whose file was dropped (the shard cache forgets its map)
        self.manifest_etag: str | None = None  # of the commit the shards were named by

    def missing(self, key: str) -> Exception:
        """The error for a shard object that is gone: the store changed
        (a newer commit retired and removed it) or it is damaged."""
        try:
            _, etag = self.client.get(fmt.MANIFEST_KEY)
        except ObjectMissing:
            etag = None
        if etag != self.manifest_etag:
            return StoreChangedError(f"{self.client.url} changed since it was opened (shard object {key} is gone)",
                                     hint=Hint.REFRESH)
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
                found = self._files[uid] = RemoteShardFile(self, info["key"], path, info["bytes"])
            return found

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
        """The first block of each of these shards (its header and entry
        index, which every read of a shard checks first), concurrently."""
        files = [found for found in (self.source(uid) for uid in uids) if found is not None]
        self.fetch_many([(found, 0, FETCH_BLOCK) for found in files])

    def fetch_many(self, spans: list[tuple[RemoteShardFile, int, int]]) -> None:
        """Make each (file, start, end) present, the missing blocks' ranged
        GETs made concurrently (obstore waits without the GIL)."""
        work: dict[tuple[int, int, int], RemoteShardFile] = {}
        for found, start, end in spans:
            for begin, stop in found.missing_runs(start, end):
                work[(id(found), begin, stop)] = found
        if not work:
            return
        if len(work) == 1:
            ((_, begin, stop), found), = work.items()
            found.ensure(begin, stop)
            return

        def fetch(item: tuple[tuple[int, int, int], RemoteShardFile]) -> int:
            (_, begin, stop), found = item
            found.last_used = time.monotonic()
            try:
                data = self.client.get_range(found.key, begin, stop)
            except ObjectMissing:
                raise self.missing(found.key) from None
            return found.store(begin, data)

        self.fetched(sum(_pool().map(fetch, work.items())))

    def cached_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def close(self) -> None:
        with self._lock:
            for found in self._files.values():
                found.close()
            self._files.clear()


_FETCHERS: concurrent.futures.ThreadPoolExecutor | None = None
_FETCHERS_LOCK = threading.Lock()
FETCH_THREADS = 16  # ranged GETs in flight at once; they wait on the network, not the CPU


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _FETCHERS
    with _FETCHERS_LOCK:
        if _FETCHERS is None:
            _FETCHERS = concurrent.futures.ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="hmem-fetch")
        return _FETCHERS


# ---- the writer's lease -------------------------------------------------------------


def _owner() -> dict[str, Any]:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "?"
    return {"host": socket.gethostname(), "pid": os.getpid(), "user": user}


class LeaseHolder:
    """The lease of a store's single writer, held and renewed in the
    background until ``release`` (docs/format.md, "The writer's lease")."""

    def __init__(self, client: ObjectClient, seconds: float, wait_seconds: float = 0.0) -> None:
        self.client = client
        self.seconds = seconds
        self.token = uuid.uuid4().hex
        self.owner = _owner()
        self.lost = False
        self._stop = threading.Event()
        self._etag = self._acquire(wait_seconds)
        self._thread = threading.Thread(target=self._renew_loop, name="hmem-lease", daemon=True)
        self._thread.start()

    def _document(self) -> bytes:
        self.expires = time.time() + self.seconds
        return fmt.Lease(self.token, self.owner, self.expires).to_bytes()

    def _acquire(self, wait_seconds: float) -> str:
        deadline = time.monotonic() + max(0.0, wait_seconds)
        while True:
            try:
                return self.client.put(fmt.LEASE_KEY, self._document(), create_only=True)
            except ConditionFailed:
                pass
            try:
                data, etag = self.client.get(fmt.LEASE_KEY)
            except ObjectMissing:
                continue  # released meanwhile
            held = fmt.Lease.parse(data)
            if held is None or held.expires < time.time():
                try:  # expired: take it over, unless someone else just did
                    return self.client.put(fmt.LEASE_KEY, self._document(), if_match=etag)
                except ConditionFailed:
                    continue
            if time.monotonic() >= deadline:
                owner = held.owner
                left = max(0.0, held.expires - time.time())
                raise StoreLockedError(
                    f"{self.client.url} is locked for writing by pid {owner.get('pid')} on {owner.get('host')} "
                    f"(user {owner.get('user')}); its lease runs {left:.0f} s more unless renewed",
                    hint=Hint.LOCK_WAIT)
            time.sleep(min(0.25, max(0.01, deadline - time.monotonic())))

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.seconds / 3):
            try:
                self._etag = self.client.put(fmt.LEASE_KEY, self._document(), if_match=self._etag)
            except ConditionFailed:
                self.lost = True  # taken over: this writer may not commit again
                return
            except Exception:  # the server is unreachable: try again while the lease lasts
                if time.time() >= self.expires:
                    self.lost = True
                    return

    def check(self) -> None:
        """Raise unless the lease is held with time to spare for a commit."""
        if self.lost or time.time() > self.expires - min(5.0, self.seconds / 4):
            self.lost = True
            raise StoreLockedError(f"this writer lost its lease on {self.client.url} (another writer may hold it "
                                   "now): nothing more is committed", hint=Hint.OPEN_AGAIN)

    def release(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=min(self.seconds, 5.0))
        if self.lost:
            return
        self.lost = True
        try:  # give it back at once rather than let it expire
            self.client.put(fmt.LEASE_KEY, fmt.Lease(self.token, self.owner, 0.0).to_bytes(), if_match=self._etag)
        except Exception:
            pass  # it expires by itself


# ---- the link between the working copy and the objects ---------------------------------


def _updated_positions(written: bytes | None, generation: int) -> np.ndarray | None:
    """The positions of the records a local commit changed in place (its
    index.json's pending updates), or None when `written` is not that
    commit's index.json."""
    if written is None:
        return None
    try:
        doc = json.loads(written)
        if doc.get("generation") != generation:
            return None
        return np.unique(Pending.from_json(doc["pending"]).record_updates["position"].astype(np.int64))
    except (ValueError, KeyError, TypeError):
        return None


def _changed_spans(positions: np.ndarray, record_size: int, before: dict[str, int],
                   after: dict[str, int]) -> list[tuple[int, int, int]]:
    """(file number, offset, length) of what one commit changed: its records
    updated in place (runs of consecutive positions), and what it appended
    to each file."""
    spans: list[tuple[int, int, int]] = []
    old_records = before[fmt.STATE_FILES[0]] // record_size
    positions = positions[positions < old_records]
    if len(positions):
        breaks = np.flatnonzero(np.diff(positions) != 1) + 1
        for run in np.split(positions, breaks):
            spans.append((0, int(run[0]) * record_size, len(run) * record_size))
    for number, name in enumerate(fmt.STATE_FILES):
        if after[name] > before[name]:
            spans.append((number, before[name], after[name] - before[name]))
    return spans


class RemoteLink:
    """Ties a local working copy to a store's objects (the module docstring)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None, *, cache_bytes: int | None = None) -> None:
        client_options, own = split_options(storage_options)
        self.client = ObjectClient(url, client_options)
        self.url = self.client.url
        bound = own.get("cache_bytes", cache_bytes if cache_bytes is not None else DEFAULT_CACHE_BYTES)
        self.lease_seconds = _positive(own.get("lease_seconds", DEFAULT_LEASE_SECONDS), "lease_seconds")
        self.retire_seconds = float(own.get("retire_seconds", DEFAULT_RETIRE_SECONDS))
        if self.retire_seconds < 0:
            raise InvalidArgumentError("storage option retire_seconds must be >= 0")
        self.workdir = make_workdir(own.get("cache_dir"))
        self.fetcher = ShardFetcher(self.client, self.workdir / "shards", int(_positive(bound, "cache_bytes")))
        self.lease: LeaseHolder | None = None
        self.manifest: fmt.RemoteManifest | None = None
        self.etag: str | None = None
        self.published_generation = -1  # the local commit last published
        self.published_local: Manifest | None = None  # and what it said
        self._dirs = 0

    # ---- reading the committed state -------------------------------------------------

    def read_manifest(self) -> fmt.RemoteManifest:
        try:
            data, etag = self.client.get(fmt.MANIFEST_KEY)
        except ObjectMissing:
            raise NotAStoreError(f"{self.url} holds no hmem store (no {fmt.MANIFEST_KEY})",
                                 hint=Hint.CREATE) from None
        mf = fmt.RemoteManifest.parse(data, f"{self.url}/{fmt.MANIFEST_KEY}")
        self.manifest, self.etag = mf, etag
        return mf

    def materialize(self) -> Path:
        """Make the committed state's small files in a new directory of the
        working copy; returns it.  Shards are fetched later, as reads need them."""
        mf = self.manifest
        assert mf is not None
        files = [bytearray(mf.sizes[name]) for name in fmt.STATE_FILES]
        def fetch(key: str) -> bytes:
            try:
                return self.client.get(key)[0]
            except ObjectMissing:
                raise StoreChangedError(f"{self.url} changed while it was being read (state object "
                                        f"{key} is gone)", hint=Hint.REFRESH) from None

        keys = [item["key"] for item in mf.state]
        # fetched concurrently, applied in order
        for key, data in zip(keys, _pool().map(fetch, keys) if len(keys) > 1 else map(fetch, keys)):
            fmt.apply_state(data, files, key)
        self._dirs += 1
        directory = self.workdir / f"store-{self._dirs}"
        _io.make_dir(directory)
        _io.write_file(directory / layout.INDEX_FILE, [mf.index])
        for name, content in zip(fmt.STATE_FILES, files):
            if content or name == layout.ENTRIES_FILE:
                _io.write_file(directory / name, [content])
        self.fetcher.remote = dict(mf.shards)
        self.fetcher.manifest_etag = self.etag
        return directory

    # ---- the writer ------------------------------------------------------------------

    def claim_new(self) -> None:
        """Before a new store is made at this URL: refuse one that holds a
        store (StoreExistsError), then take the lease.  The first commit is
        create-only all the same (create)."""
        try:
            self.read_manifest()
        except NotAStoreError:
            pass
        else:
            raise StoreExistsError(f"{self.url} already holds an hmem store", hint="open it, or choose a new URL")
        self.take_lease(0.0)

    def take_lease(self, wait_seconds: float) -> None:
        self.lease = LeaseHolder(self.client, self.lease_seconds, wait_seconds)

    def fence(self) -> None:
        """Commit the current state again under this writer's lease: from
        now on a writer whose lease expired cannot commit (its conditional
        write names an ETag that is gone)."""
        for _ in range(10):
            mf = self.read_manifest()
            assert self.lease is not None
            self.lease.check()
            fenced = fmt.RemoteManifest(generation=mf.generation + 1, index=mf.index, sizes=mf.sizes,
                                        state=mf.state, shards=mf.shards, retired=mf.retired,
                                        writer=self.lease.token)
            try:
                self.etag = self.client.put(fmt.MANIFEST_KEY, fenced.to_bytes(), if_match=self.etag)
            except ConditionFailed:
                continue  # the previous holder committed meanwhile: read again
            self.manifest = fenced
            self.fetcher.manifest_etag = self.etag
            return
        raise StoreLockedError(f"{self.url} kept changing under this writer's lease", hint=Hint.OPEN_AGAIN)

    def create(self, directory: Path, committed: Manifest) -> None:
        """Commit a new store's first state; StoreExistsError if the URL
        already holds one (a create-only write)."""
        assert self.lease is not None
        self.manifest = None
        self.publish(directory, committed, create=True)

    def publish(self, directory: Path, committed: Manifest, written: bytes | None = None, *, create: bool = False,
                snapshot: bool = False, data_only: bool = False) -> None:
        """Commit the working copy's last local commit (`committed`; `written`:
        the index.json it wrote, whose pending updates say which records it
        changed in place) to the object store: a state object with what that
        commit changed, or a snapshot (module docstring)."""
        generation = committed.generation
        if generation == self.published_generation and not create:
            return
        if data_only and self._same_data(committed, written):
            # A local commit of an id reservation alone: not needed here.  A
            # writer that stops loses its working copy, and with it every id
            # it handed out past the last commit: none of them is named anywhere.
            # The files are as published, so the next commit's changes are
            # still taken against them.
            self.published_generation, self.published_local = generation, committed
            return
        index_bytes = committed.to_bytes()
        shards = committed.shards
        lease = self.lease
        assert lease is not None
        lease.check()
        old = self.manifest
        now = time.time()
        mf_local = committed
        sizes = {
            layout.ENTRIES_FILE: mf_local.record_count * layout.record_bytes(mf_local.config),
            layout.POOLED_FILE: min(_file_size(directory / layout.POOLED_FILE),
                                    mf_local.record_count * _pooled_row(mf_local)),
            layout.SOURCES_FILE: mf_local.sources.bytes,
        }
        # shards: upload the new ones; retire the ones no longer named
        named: dict[str, dict[str, Any]] = {}
        for info in shards:
            if old is not None and info.uid in old.shards:
                named[info.uid] = old.shards[info.uid]
                continue
            key = fmt.shard_key(info.uid)
            self.client.put(key, directory / info.file)
            named[info.uid] = {"key": key, "bytes": info.bytes}
        retired = [] if old is None else [r for r in old.retired]
        expired = [r["key"] for r in retired if now - r["since"] >= self.retire_seconds]
        retired = [r for r in retired if r["key"] not in expired]
        if old is not None:
            retired += [{"key": s["key"], "since": now} for uid, s in old.shards.items() if uid not in named]
        # state: the bytes of the small files this local commit changed, or all of them
        record_size = layout.record_bytes(committed.config)
        changed = _updated_positions(written, generation)
        whole = (old is None or snapshot or changed is None or generation != self.published_generation + 1
                 or len(old.state) >= SNAPSHOT_AFTER
                 or any(sizes[name] < old.sizes[name] for name in fmt.STATE_FILES))
        pieces: list[tuple[int, int, Any]] = []
        if not whole:
            assert old is not None and changed is not None
            spans = _changed_spans(changed, record_size, old.sizes, sizes)
            pieces = [(number, offset, _read_range(directory / fmt.STATE_FILES[number], offset, length))
                      for number, offset, length in spans]
            carried = sum(item["bytes"] for item in old.state[1:])
            whole = carried + sum(length for _, _, length in spans) > sum(sizes.values()) // 2
        if whole:
            pieces = [(number, 0, _read_range(directory / name, 0, sizes[name]))
                      for number, name in enumerate(fmt.STATE_FILES)]
        next_generation = 0 if old is None else old.generation + 1
        state_list = [] if whole or old is None else list(old.state)
        if whole and old is not None:
            retired += [{"key": item["key"], "since": now} for item in old.state]
        if whole or pieces:  # a commit that changed none of these bytes (a close) needs no state object
            key = fmt.state_key(next_generation, lease.token[:8])
            body = fmt.encode_state(pieces)
            self.client.put(key, body)
            state_list.append({"key": key, "bytes": len(body)})
        new_mf = fmt.RemoteManifest(generation=next_generation, index=index_bytes, sizes=sizes, state=state_list,
                                    shards=named, retired=retired, writer=lease.token, committed=now)
        _io.crash_point("remote.objects_written")
        lease.check()
        try:
            if create:
                etag = self.client.put(fmt.MANIFEST_KEY, new_mf.to_bytes(), create_only=True)
            else:
                etag = self.client.put(fmt.MANIFEST_KEY, new_mf.to_bytes(), if_match=self.etag)
        except ConditionFailed:
            lease.lost = True
            if create:
                raise StoreExistsError(f"{self.url} already holds an hmem store", hint="open it instead") from None
            raise StoreLockedError(f"another writer committed to {self.url} after this writer's lease was "
                                   "taken over: nothing was committed", hint=Hint.OPEN_AGAIN) from None
        _io.crash_point("remote.committed")
        self.manifest, self.etag = new_mf, etag
        self.fetcher.manifest_etag = etag
        self.published_generation = generation
        self.published_local = committed
        # this writer's shards are complete local files: never fetched
        self.fetcher.remote = {uid: s for uid, s in named.items() if uid in self.fetcher.remote}
        if expired:
            try:
                self.client.delete(expired)
            except Exception:
                pass  # left for compaction to remove (an orphan object)

    def _same_data(self, committed: Manifest, written: bytes | None) -> bool:
        """Whether `committed` holds what the last published commit held."""
        last = self.published_local
        if last is None or self.published_generation < 0:
            return False
        changed = _updated_positions(written, committed.generation)
        return (changed is not None and not len(changed) and committed.record_count == last.record_count
                and [s.uid for s in committed.shards] == [s.uid for s in last.shards]
                and committed.sources == last.sources)

    # ---- whole objects, for verify and repair ------------------------------------------

    def download_shards(self, directory: Path, shards: list[Any]) -> None:
        """Every shard object whole into `directory` under its local name."""
        assert self.manifest is not None
        for info in shards:
            item = self.manifest.shards.get(info.uid)
            if item is None:
                continue
            try:
                data, _ = self.client.get(item["key"])
            except ObjectMissing:
                continue  # verify reports the shard missing
            _io.write_file(directory / info.file, [data])
        self.fetcher.remote = {}

    def orphan_sizes(self) -> dict[str, int]:
        """Objects under the store that its manifest does not name, retired
        or not, and their sizes (one listing)."""
        mf = self.manifest
        assert mf is not None
        named = {fmt.MANIFEST_KEY, fmt.LEASE_KEY, *(s["key"] for s in mf.state),
                 *(s["key"] for s in mf.shards.values()), *(r["key"] for r in mf.retired)}
        return {key: size for key, size in sorted(self.client.list()) if key not in named}

    def orphans(self) -> list[str]:
        return list(self.orphan_sizes())

    def remove_orphans(self) -> dict[str, int]:
        """Delete the objects no commit names (left by a writer that
        stopped between its uploads and its commit); a writer's job.
        Returns what it deleted, with sizes."""
        assert self.lease is not None
        self.lease.check()
        orphans = self.orphan_sizes()
        self.client.delete(list(orphans))
        return orphans

    def total_bytes(self) -> int:
        """Bytes of the objects the manifest names (retired ones aside)."""
        mf = self.manifest
        assert mf is not None
        return sum(s["bytes"] for s in mf.shards.values()) + sum(s["bytes"] for s in mf.state) \
            + len(mf.to_bytes())

    # ---- end -------------------------------------------------------------------------

    def close(self) -> None:
        if self.lease is not None:
            self.lease.release()
        self.fetcher.close()
        _io.remove_tree(self.workdir)


def _pooled_row(mf: Manifest) -> int:
    from hmem.formats import pooled

    return pooled.row_bytes(mf.config.pooled_width)


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _read_range(path: Path, offset: int, size: int) -> np.ndarray:
    """Bytes [offset, offset + size) of a store file (it may hold more: rows
    a failed flush left past the commit)."""
    out = np.zeros(size, np.uint8)
    if size == 0:
        return out
    fd = _io.open_regular(path)
    try:
        got = 0
        while got < size:  # a read returns at most 2 GiB
            n = os.preadv(fd, [out[got:].data], offset + got)
            if n <= 0:
                break
            got += n
    finally:
        os.close(fd)
    if got != size:
        raise CorruptStoreError(f"{path.name} is shorter than its commit says", hint=Hint.VERIFY)
    return out
