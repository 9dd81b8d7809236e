"""A store on object storage, worked on through a local working copy
(docs/format.md, "Stores on object storage").

An open store on object storage is an ordinary local store in a private
working directory (under the cache directory) plus an ``ObjectLink`` that
ties it to the objects, the Placement the Store facade calls
(hmem/store/placement.py):

- at open, the committed manifest is read and the store's small files
  (index.json, entries.bin, pooled.bin, sources.jsonl) are made from its
  state objects; shard files are not fetched: ``ShardFetcher``
  (hmem/store/object_fetch.py) fetches the byte ranges a read needs, once,
  into sparse local files, keeping at most ``cache_bytes`` of them;
- a writer holds the lease (``LeaseHolder``, hmem/store/lease.py), and after each local commit
  ``publish`` uploads the new shard files and one state object with the
  bytes of the small files that changed, then replaces the manifest with a
  write conditional on the ETag it read: if another writer committed
  meanwhile, nothing is committed;
- a reader picks up new commits with ``Store.refresh()``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hmem import _io, validation
from hmem.errors import (
    CorruptStoreError,
    Hint,
    HmemError,
    NotAStoreError,
    StorageError,
    StoreChangedError,
    StoreExistsError,
    StoreLockedError,
)
from hmem.formats import objects as fmt
from hmem.formats import pooled, shard_file, store_files
from hmem.formats.manifest import Manifest, Pending, ShardInfo
from hmem.object_store import ConditionFailed, ObjectClient, ObjectMissing
from hmem.store.lease import LeaseHolder
from hmem.store.object_fetch import ShardFetcher, fetch_pool
from hmem.store.placement import Capabilities
from hmem.store.results import RemoteStats, StoreHealth
from hmem.store.state import StoreState, open_reader
from hmem.store.state_cache import StateCache

CACHE_ENV = "HMEM_CACHE_DIR"
DEFAULT_CACHE_BYTES = 1 << 30
DEFAULT_LEASE_SECONDS = 60.0
DEFAULT_RETIRE_SECONDS = 900.0  # objects no commit names stay this long for readers of older commits
SNAPSHOT_AFTER = 16  # state objects past a snapshot before the next snapshot
_REMOTE_OPTIONS = ("cache_dir", "cache_bytes", "coalesce_bytes", "lease_seconds", "retire_seconds")


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
    return validation.positive(value, f"storage option {name}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def make_workdir(root: Path) -> Path:
    """A private working directory for one open store under the cache
    directory `root`; the directories of processes that ended without
    closing theirs are removed first."""
    _io.make_dir(root)
    for entry in os.scandir(root):
        parts = entry.name.split("-")
        if len(parts) == 3 and parts[0] == "remote" and parts[1].isdigit() and not _alive(int(parts[1])):
            _io.remove_tree(Path(entry.path))
    work = _io.make_private_dir(root, f"remote-{os.getpid()}-")
    _io.make_dir(work / "shards")
    return work


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


def _changed_spans(
    positions: np.ndarray, record_size: int, before: dict[str, int], after: dict[str, int]
) -> list[tuple[int, int, int]]:
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


class ObjectLink:
    """Ties a local working copy to a store's objects (the module docstring)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None, *, cache_bytes: int | None = None) -> None:
        client_options, own = split_options(storage_options)
        self.client = ObjectClient(url, client_options)
        self.url = self.client.url
        bound = int(
            _positive(
                own.get("cache_bytes", cache_bytes if cache_bytes is not None else DEFAULT_CACHE_BYTES), "cache_bytes"
            )
        )
        self.lease_seconds = _positive(own.get("lease_seconds", DEFAULT_LEASE_SECONDS), "lease_seconds")
        self.retire_seconds = validation.number(
            own.get("retire_seconds", DEFAULT_RETIRE_SECONDS), "storage option retire_seconds", low=0.0
        )
        coalesce = validation.count(own.get("coalesce_bytes", 0), "storage option coalesce_bytes")
        self.cache_root = cache_root(own.get("cache_dir"))
        self.workdir = make_workdir(self.cache_root)
        self.fetcher = ShardFetcher(self.client, self.workdir / "shards", bound)
        self.fetcher.coalesce_bytes = coalesce
        self.lease: LeaseHolder | None = None
        self.manifest: fmt.RemoteManifest | None = None
        self.etag: str | None = None
        self.published_generation = -1  # the local commit last published
        self.published_local: Manifest | None = None  # and what it said
        self.uploaded_bytes = 0  # shard and state objects this writer uploaded (consolidate)
        # state objects kept on this host between processes (use_state_cache);
        # verify and repair read the objects themselves
        self.state_cache: StateCache | None = None
        self._health_client: ObjectClient | None = None  # checked_health's (its own request counts)
        # the state objects checked by the last fence, for the materialize after it (_checked_state)
        self._checked: tuple[tuple[list[str], list[int]], list[fmt.StatePieces]] | None = None
        self._dirs = 0

    def use_state_cache(self) -> None:
        """Keep state objects on this host between processes, and take them
        from there (hmem/store/state_cache.py): for stores opened to be
        read and written, not for verify and repair, which read the objects."""
        self.state_cache = StateCache(self.cache_root, self.url)

    # ---- reading the committed state -------------------------------------------------

    def read_manifest(self) -> fmt.RemoteManifest:
        try:
            data, etag = self.client.get(fmt.MANIFEST_KEY, max_bytes=fmt.MAX_MANIFEST_BYTES)
        except ObjectMissing:
            raise NotAStoreError(f"{self.url} holds no hmem store (no {fmt.MANIFEST_KEY})", hint=Hint.CREATE) from None
        mf = fmt.RemoteManifest.parse(data, f"{self.url}/{fmt.MANIFEST_KEY}")
        self.manifest, self.etag = mf, etag
        return mf

    def _checked_state(self, mf: fmt.RemoteManifest) -> list[fmt.StatePieces]:
        """The state objects `mf` lists, fetched (or taken from this host's
        copies) and checked whole before anything is sized by them: each of
        the size the manifest says, passing its checksum, its pieces within
        the files' committed sizes, and the pieces holding at least those
        sizes: files a manifest claims cost no memory (docs/security.md).
        Kept for the materialize that follows a fence (same state list)."""
        keys = [item["key"] for item in mf.state]
        names = (*fmt.STATE_FILES, fmt.HEADS_FILE)
        sizes = [mf.sizes[name] for name in names]
        if self._checked is not None and self._checked[0] == (keys, sizes):
            return self._checked[1]
        claimed = {item["key"]: item["bytes"] for item in mf.state}

        def fetch(key: str) -> bytes:
            try:  # never more than the manifest says it is
                return self.client.get(key, max_bytes=claimed[key])[0]
            except ObjectMissing:
                raise self._missing_state(key) from None

        def check(key: str, data: bytes) -> fmt.StatePieces:
            if len(data) != claimed[key]:
                raise CorruptStoreError(
                    f"state object {key} is {len(data)} bytes, the manifest says {claimed[key]}", hint=Hint.VERIFY
                )
            pieces = fmt.read_state(data, key)
            pieces.check_within(sizes)
            return pieces

        cache = self.state_cache
        found = {key: cache.get(key) if cache is not None else None for key in keys}
        missing = [key for key in keys if found[key] is None]
        # fetched concurrently, checked in order
        found.update(zip(missing, fetch_pool().map(fetch, missing) if len(missing) > 1 else map(fetch, missing)))
        checked: list[fmt.StatePieces] = []
        for key in keys:
            data = found[key]
            assert data is not None
            try:
                checked.append(check(key, data))
            except CorruptStoreError:
                if key in missing:
                    raise
                data = fetch(key)  # this host's copy is damaged: the object's own bytes
                checked.append(check(key, data))
                missing.append(key)
            if cache is not None and key in missing:
                cache.put(key, data)
        held = np.zeros(len(names), dtype=np.int64)
        for pieces in checked:
            held += pieces.file_bytes(len(names))
        for number, name in enumerate(names):
            if sizes[number] > int(held[number]):
                raise CorruptStoreError(
                    f"{self.url}/{fmt.MANIFEST_KEY}: files.{name} claims {sizes[number]} bytes, "
                    f"its state objects hold {int(held[number])}",
                    hint=Hint.VERIFY,
                )
        self._checked = ((keys, sizes), checked)
        return checked

    def _missing_state(self, key: str) -> HmemError:
        """The error for a state object the manifest read names but that is
        gone: a newer commit retired it (the manifest changed meanwhile), or
        it is lost from the commit that still names it (damage)."""
        try:
            etag = self.client.get(fmt.MANIFEST_KEY, max_bytes=fmt.MAX_MANIFEST_BYTES)[1]
        except ObjectMissing:
            etag = None
        if etag != self.etag:
            return StoreChangedError(
                f"{self.url} changed while it was being read (state object {key} is gone)", hint=Hint.REFRESH
            )
        return CorruptStoreError(
            f"{self.url}: state object {key}, which the manifest names, is missing", hint=Hint.VERIFY_THEN_REPAIR
        )

    def materialize(self, *, keep_known: bool = False) -> Path:
        """Make the committed state's small files in a new directory of the
        working copy; returns it.  Shards are fetched later, as reads need
        them.  `keep_known`: the fetcher keeps knowing the shards of the
        commit read before too (a refresh, until it swaps the new one in)."""
        mf = self.manifest
        assert mf is not None
        checked = self._checked_state(mf)
        self._checked = None  # used once: a refresh reads the new commit's
        files = [bytearray(mf.sizes[name]) for name in (*fmt.STATE_FILES, fmt.HEADS_FILE)]
        for pieces in checked:  # applied in order
            pieces.apply(files)
        keys = [item["key"] for item in mf.state]
        cache = self.state_cache
        if cache is not None:
            cache.keep(keys)
        heads = fmt.parse_heads(files[fmt.HEADS], keys[-1])
        self._dirs += 1
        directory = self.workdir / f"store-{self._dirs}"
        _io.make_dir(directory)
        # the working copy's first files: copies of what the objects hold,
        # gone with the process if it stops (no fsync; its own commits have theirs)
        _io.write_cache_file(directory / store_files.INDEX_FILE, mf.index)
        for name, content in zip(fmt.STATE_FILES, files):
            if content or name == store_files.ENTRIES_FILE:
                _io.write_cache_file(directory / name, content)
        if keep_known:
            self.fetcher.remote = {**self.fetcher.remote, **mf.shards}
            self.fetcher.heads = {**self.fetcher.heads, **heads}
        else:
            self.fetcher.remote = dict(mf.shards)
            self.fetcher.heads = heads
            self.fetcher.manifest_etag = self.etag
        return directory

    # ---- the writer ------------------------------------------------------------------

    def claim_new(self) -> None:
        """Before a new store is made at this URL: refuse one that holds a
        store, or any object but what an interrupted init left, or lies
        inside another store (StoreExistsError), then take the lease.  The
        first commit is create-only all the same (create)."""
        try:
            self.read_manifest()
        except NotAStoreError:
            pass
        else:
            raise StoreExistsError(f"{self.url} already holds an hmem store", hint="open it, or choose a new URL")
        self._refuse_occupied()
        self._refuse_inside_a_store()
        self.take_lease(0.0)

    def _refuse_occupied(self) -> None:
        """Refuse a prefix that holds objects (another store in a sub-prefix,
        other stores beside a bucket's root, anything else), as a local store
        is made only in a missing or empty directory: what an interrupted
        init of this URL left aside.  One listing request for an empty
        prefix; past the first other object, it reads on only to the end of
        a page (1,000 keys), for a store's manifest to name in the message."""
        first: str | None = None
        for seen, (key, _) in enumerate(self.client.iter_list()):
            if key.endswith("/" + fmt.MANIFEST_KEY):
                raise StoreExistsError(
                    f"{self.url} holds another store ({self.url}/{key}): a store around another is refused",
                    hint="choose a prefix that holds no objects",
                )
            if first is None and not fmt.is_init_leftover(key):
                first = key
            if first is not None and seen >= 999:
                break
        if first is not None:
            key = first
            if key.startswith(fmt.SHARD_PREFIX) and fmt.is_own_key(key):
                raise StoreExistsError(
                    f"{self.url} holds shard objects ({key}, ...) but no {fmt.MANIFEST_KEY}: what an "
                    "interrupted copy left, or a store whose manifest was lost; nothing was created",
                    hint="remove them if they are not needed, or choose another prefix",
                )
            raise StoreExistsError(
                f"{self.url} is not empty (it holds {key}): a store is made only under a prefix that holds no objects",
                hint="choose a prefix that holds no objects",
            )

    def _refuse_inside_a_store(self) -> None:
        """Refuse a prefix inside another store: one request per enclosing
        prefix (s3://b/a/c: a/manifest.json, then manifest.json at the
        bucket's root), reading at most the first KiB of a manifest found."""
        parts = self.client.location.prefix.split("/") if self.client.location.prefix else []
        if not parts:
            return
        root = self.client.at("")
        for depth in range(len(parts) - 1, -1, -1):
            outer = "/".join(parts[:depth])
            key = f"{outer}/{fmt.MANIFEST_KEY}" if outer else fmt.MANIFEST_KEY
            start = root.get_start(key, 1024)
            if start is not None and f'"{fmt.FORMAT_NAME}"'.encode() in start:
                where = self.client.location.at(outer)
                raise StoreExistsError(
                    f"{self.url} lies inside the hmem store {where}: a store inside another is refused",
                    hint=f"choose a prefix outside {where}",
                )

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
            self._checked_state(mf)  # a state that cannot be read is refused before anything is written
            fenced = fmt.RemoteManifest(
                generation=mf.generation + 1,
                index=mf.index,
                sizes=mf.sizes,
                state=mf.state,
                shards=mf.shards,
                retired=mf.retired,
                writer=self.lease.token,
            )
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

    def consolidate(self, directory: Path, committed: Manifest) -> None:
        """At a writer's close: when the manifest lists more than one state
        object, commit the same state again as one snapshot, so that every
        reader opens it with two requests (the manifest, the snapshot);
        only when the snapshot is no bigger than what this writer uploaded
        since it opened, so that closing at most doubles a session's
        uploads (a writer that added one entry to a large store does not
        upload its records whole)."""
        mf = self.manifest
        if mf is None or len(mf.state) <= 1 or self.published_generation != committed.generation:
            return
        if sum(committed_sizes(directory, committed).values()) + mf.sizes[fmt.HEADS_FILE] > self.uploaded_bytes:
            return
        self.publish(directory, committed, snapshot=True, again=True)

    def publish(
        self,
        directory: Path,
        committed: Manifest,
        written: bytes | None = None,
        *,
        create: bool = False,
        snapshot: bool = False,
        data_only: bool = False,
        again: bool = False,
    ) -> None:
        """Commit the working copy's last local commit (`committed`; `written`:
        the index.json it wrote, whose pending updates say which records it
        changed in place) to the object store: a state object with what that
        commit changed, or a snapshot (module docstring).  `again`: commit
        a commit already published once more (consolidate)."""
        generation = committed.generation
        if generation == self.published_generation and not (create or again):
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
        sizes = committed_sizes(directory, committed)
        # shards: upload the new ones; retire the ones no longer named
        named: dict[str, dict[str, Any]] = {}
        new_heads: dict[str, tuple[int, Any]] = {}  # uid -> (data start, index bytes) of the shards uploaded
        for info in shards:
            if old is not None and info.uid in old.shards:
                named[info.uid] = old.shards[info.uid]
                continue
            key = fmt.shard_key(info.uid)
            self.client.put(key, directory / info.file)
            self.uploaded_bytes += info.bytes
            named[info.uid] = {"key": key, "bytes": info.bytes}
            new_heads[info.uid] = _local_head(directory / info.file, info)
        retired = [] if old is None else list(old.retired)
        expired = [r["key"] for r in retired if now - r["since"] >= self.retire_seconds]
        retired = [r for r in retired if r["key"] not in expired]
        if old is not None:
            retired += [{"key": s["key"], "since": now} for uid, s in old.shards.items() if uid not in named]
        # state: the bytes of the small files this local commit changed, or all of them
        record_size = store_files.record_bytes(committed.config)
        changed = _updated_positions(written, generation)
        whole = (
            old is None
            or snapshot
            or changed is None
            or generation != self.published_generation + 1
            or len(old.state) >= SNAPSHOT_AFTER
            or any(sizes[name] < old.sizes[name] for name in fmt.STATE_FILES)
        )
        appended_heads = b"".join(fmt.encode_head(uid, start, index) for uid, (start, index) in new_heads.items())
        pieces: list[tuple[int, int, Any]] = []
        if not whole:
            assert old is not None and changed is not None
            spans = _changed_spans(changed, record_size, old.sizes, sizes)
            pieces = [
                (number, offset, _read_range(directory / fmt.STATE_FILES[number], offset, length))
                for number, offset, length in spans
            ]
            if appended_heads:
                pieces.append((fmt.HEADS, old.sizes[fmt.HEADS_FILE], appended_heads))
            sizes[fmt.HEADS_FILE] = old.sizes[fmt.HEADS_FILE] + len(appended_heads)
            carried = sum(item["bytes"] for item in old.state[1:])
            whole = carried + sum(len(piece) for _, _, piece in pieces) > sum(sizes.values()) // 2
        if whole:
            # the heads of every shard named whose head this link knows (a
            # store written before heads existed has none for its older shards)
            known = {**self.fetcher.heads, **new_heads}
            heads = b"".join(fmt.encode_head(uid, known[uid][0], known[uid][1]) for uid in named if uid in known)
            pieces = [
                (number, 0, _read_range(directory / name, 0, sizes[name]))
                for number, name in enumerate(fmt.STATE_FILES)
            ]
            pieces.append((fmt.HEADS, 0, heads))
            sizes[fmt.HEADS_FILE] = len(heads)
        next_generation = 0 if old is None else old.generation + 1
        state_list = [] if whole or old is None else list(old.state)
        if whole and old is not None:
            # only names the store deletes (a state object of another name,
            # one a crafted manifest listed, is dropped: never deleted)
            retired += [{"key": item["key"], "since": now} for item in old.state if fmt.is_own_key(item["key"])]
        # a manifest lists at most MAX_RETIRED: the oldest past it become
        # orphans, which compaction removes
        retired = retired[-fmt.MAX_RETIRED :]
        body = None
        if whole or pieces:  # a commit that changed none of these bytes (a close) needs no state object
            key = fmt.state_key(next_generation, lease.token[:8])
            body = fmt.encode_state(pieces)
            self.client.put(key, body)
            self.uploaded_bytes += len(body)
            state_list.append({"key": key, "bytes": len(body)})
        new_mf = fmt.RemoteManifest(
            generation=next_generation,
            index=index_bytes,
            sizes=sizes,
            state=state_list,
            shards=named,
            retired=retired,
            writer=lease.token,
            committed=now,
        )
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
                # another process made the store first: the state object
                # uploaded for this store that never was is no one's
                if body is not None:
                    try:
                        self.delete_objects([state_list[-1]["key"]])
                    except Exception:
                        pass  # left for compaction to remove (an orphan object)
                raise StoreExistsError(f"{self.url} already holds an hmem store", hint="open it instead") from None
            raise StoreLockedError(
                f"another writer committed to {self.url} after this writer's lease was "
                "taken over: nothing was committed",
                hint=Hint.OPEN_AGAIN,
            ) from None
        _io.crash_point("remote.committed")
        self.manifest, self.etag = new_mf, etag
        self.fetcher.manifest_etag = etag
        self.published_generation = generation
        self.published_local = committed
        self.fetcher.heads = {**self.fetcher.heads, **new_heads}
        if self.state_cache is not None:  # a reader on this host then finds them here
            if body is not None:
                self.state_cache.put(state_list[-1]["key"], body)
            self.state_cache.keep([item["key"] for item in state_list])
        # this writer's shards are complete local files: never fetched
        self.fetcher.remote = {uid: s for uid, s in named.items() if uid in self.fetcher.remote}
        if expired:
            try:
                self.delete_objects(expired)
            except Exception:
                pass  # left for compaction to remove (an orphan object)

    def _same_data(self, committed: Manifest, written: bytes | None) -> bool:
        """Whether `committed` holds what the last published commit held."""
        last = self.published_local
        if last is None or self.published_generation < 0:
            return False
        changed = _updated_positions(written, committed.generation)
        return (
            changed is not None
            and not len(changed)
            and committed.record_count == last.record_count
            and [s.uid for s in committed.shards] == [s.uid for s in last.shards]
            and committed.sources == last.sources
        )

    # ---- whole objects, for verify and repair ------------------------------------------

    def download_shards(self, directory: Path, shards: Sequence[Any]) -> None:
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

    def listing(self, client: ObjectClient | None = None) -> dict[str, int]:
        """key -> size of every object under the store's shards/ and state/
        (two listings, a request per 1,000 objects): where its objects are,
        and nothing of a store in another sub-prefix or beside a bucket's root."""
        client = client or self.client
        return {key: size for prefix in (fmt.SHARD_PREFIX, fmt.STATE_PREFIX) for key, size in client.list(prefix)}

    def orphan_sizes(self, listed: dict[str, int] | None = None) -> dict[str, int]:
        """Objects under the store that its manifest does not name, retired
        or not, and their sizes: only names this store gives its shard and
        state objects (formats/objects.py, is_own_key), never another
        store's or an unknown object.  `listed`: the listing, if made."""
        mf = self.manifest
        assert mf is not None
        named = {
            *(s["key"] for s in mf.state),
            *(s["key"] for s in mf.shards.values()),
            *(r["key"] for r in mf.retired),
        }
        if listed is None:
            listed = self.listing()
        return {key: size for key, size in sorted(listed.items()) if key not in named and fmt.is_own_key(key)}

    def orphans(self) -> list[str]:
        return list(self.orphan_sizes())

    def checked_health(self, health: StoreHealth, shards: list[ShardInfo], shard_of: np.ndarray) -> StoreHealth:
        """`health` (the working copy's own check, which takes a shard not
        fetched at the size the manifest records) with what a listing of
        the objects says: each shard or state object the manifest names
        that is missing or of another size, which verify reports as an
        error (remote.missing, remote.size).  Two listings (shards/ and
        state/, a request per 1,000 objects); no object is read.  A state
        object carries the records, so its problem is an entries-file
        problem: this host may hold a copy, another cannot open the store.
        `shard_of`: each record's shard index."""
        mf = self.manifest
        if mf is None:
            return health
        if self._health_client is None:
            # its requests are counted apart: stats reports what the store
            # did, and asking for stats twice does not change the answer
            self._health_client = self.client.at(self.client.location.prefix, shared_counts=False)
        try:
            listed = self.listing(self._health_client)
        except StorageError as exc:  # not ok: nothing says the objects are there (stats itself still answers)
            return dataclasses.replace(
                health,
                ok=False,
                problems=(*health.problems, f"the store's objects could not be listed ({exc.message})"),
                advice=health.advice or Hint.OPEN_AGAIN,
            )
        problems = list(health.problems)
        missing, wrong_size = list(health.missing_shards), list(health.wrong_size_shards)
        for idx, info in enumerate(shards):
            item = mf.shards.get(info.uid)
            if item is None or info.file in missing or info.file in wrong_size:
                continue  # not committed yet, or already found
            size = listed.get(item["key"])
            if size == item["bytes"]:
                continue
            live = int(np.count_nonzero(shard_of == idx))
            held = f"{live} live {'entry' if live == 1 else 'entries'}"
            if size is None:
                missing.append(info.file)
                problems.append(f"shard {info.file} is missing: no object {item['key']} ({held})")
            else:
                wrong_size.append(info.file)
                problems.append(
                    f"shard {info.file} is {size} bytes in object {item['key']}, the store expects "
                    f"{item['bytes']} ({held})"
                )
        state_problems = [
            f"state object {item['key']} is missing"
            if listed.get(item["key"]) is None
            else f"state object {item['key']} is {listed[item['key']]} bytes, the manifest says {item['bytes']}"
            for item in mf.state
            if listed.get(item["key"]) != item["bytes"]
        ]
        if len(problems) == len(health.problems) and not state_problems:
            return health
        bad = [idx for idx, info in enumerate(shards) if info.file in missing or info.file in wrong_size]
        entries_problem = "; ".join(filter(None, [health.entries_file_problem, *state_problems]))
        problems += state_problems
        return dataclasses.replace(
            health,
            ok=False,
            problems=tuple(problems),
            advice=health.advice or Hint.VERIFY_THEN_REPAIR,
            missing_shards=tuple(missing),
            wrong_size_shards=tuple(wrong_size),
            unreachable_entries=int(np.count_nonzero(np.isin(shard_of, bad))) if bad else 0,
            entries_file_problem=entries_problem,
        )

    def remove_orphans(self) -> dict[str, int]:
        """Delete the objects no commit names (left by a writer that
        stopped between its uploads and its commit); a writer's job.
        Returns what it deleted, with sizes."""
        assert self.lease is not None
        self.lease.check()
        orphans = self.orphan_sizes()
        deleted = set(self.delete_objects(list(orphans)))
        return {key: size for key, size in orphans.items() if key in deleted}

    def delete_objects(self, keys: list[str]) -> list[str]:
        """Delete objects of the store: the one place hmem deletes an object
        (an expired retired object, an orphan).  Only names the store gives
        its own shard and state objects, directly under its prefix
        (formats/objects.py, is_own_key), and none the committed manifest
        names, whatever a manifest or a listing says: another store's
        objects, an unknown object and a live one are never deleted.
        Returns the keys it deleted."""
        mf = self.manifest
        live = set() if mf is None else {*(s["key"] for s in mf.state), *(s["key"] for s in mf.shards.values())}
        own = [key for key in keys if fmt.is_own_key(key) and key not in live]
        if own:
            self.client.delete(own)
        return own

    def total_bytes(self) -> int:
        """Bytes of the objects the manifest names (retired ones aside)."""
        mf = self.manifest
        assert mf is not None
        return sum(s["bytes"] for s in mf.shards.values()) + sum(s["bytes"] for s in mf.state) + len(mf.to_bytes())

    # ---- the Placement the Store facade calls (hmem/store/placement.py) -----------------

    capabilities = Capabilities(maps_in_place=False, conditional_writes=True, refreshes=True, lists_orphans=True)

    @property
    def location(self) -> str:
        return self.url

    def attach(self, state: StoreState) -> None:
        state.cache.fetcher = self.fetcher
        self.fetcher.on_drop = state.cache.drop_uid

    def after_write(self, state: StoreState, *, snapshot: bool = False, data_only: bool = False) -> None:
        if not state.read_only:
            self.publish(state.path, state.committed, state.manifest_bytes, snapshot=snapshot, data_only=data_only)

    def before_close(self, state: StoreState) -> None:
        try:  # readers then open with two requests
            self.consolidate(state.path, state.committed)
        except HmemError:
            pass  # everything is committed already: the state list stays as it was

    def newer_state(self, state: StoreState) -> StoreState | None:
        """The newest commit as a reader's state in a new directory of the
        working copy (one request when there is none), fetched while
        queries go on with `state`, whose shards stay known to the fetcher
        until swap_in.  A failure leaves the link on the commit it holds."""
        held, held_etag = self.manifest, self.etag
        held_shards, held_shards_etag = self.fetcher.remote, self.fetcher.manifest_etag
        assert held is not None
        try:
            if self.read_manifest().generation == held.generation:
                return None
            return open_reader(self.materialize(keep_known=True), state.verify_reads)
        except BaseException:  # still on the commit it holds: the next refresh tries again
            self.manifest, self.etag = held, held_etag
            self.fetcher.remote, self.fetcher.manifest_etag = held_shards, held_shards_etag
            raise

    def swap_in(self, old: StoreState, fresh: StoreState) -> None:
        fresh.cache.capacity = old.cache.capacity  # the bound open() was given, if any
        self.attach(fresh)
        assert self.manifest is not None
        self.fetcher.remote, self.fetcher.manifest_etag = dict(self.manifest.shards), self.etag

    def forget(self, old: StoreState) -> None:
        _io.remove_tree(old.path)

    def report(self) -> RemoteStats | None:
        if self.manifest is None:
            return None
        counts = self.client.stats
        return RemoteStats(
            url=self.url,
            endpoint=self.client.endpoint,
            generation=self.manifest.generation,
            state_objects=len(self.manifest.state),
            object_bytes=self.total_bytes(),
            requests=counts.requests,
            gets=counts.gets,
            puts=counts.puts,
            deletes=counts.deletes,
            lists=counts.lists,
            bytes_fetched=counts.bytes_fetched,
            bytes_sent=counts.bytes_sent,
            cached_shard_bytes=self.fetcher.cached_bytes(),
            cache_dir=str(self.workdir),
        )

    # ---- end -------------------------------------------------------------------------

    def close(self) -> None:
        if self.lease is not None:
            self.lease.release()
        self.fetcher.close()
        _io.remove_tree(self.workdir)


def committed_sizes(directory: Path, committed: Manifest) -> dict[str, int]:
    """The bytes of each small file (STATE_FILES) that the commit names: a
    file may hold more past them (what a failed flush left); pooled.bin may
    hold fewer rows (a store an older hmem wrote)."""
    try:
        pooled_bytes = (directory / store_files.POOLED_FILE).stat().st_size
    except FileNotFoundError:
        pooled_bytes = 0
    return {
        store_files.ENTRIES_FILE: committed.record_count * store_files.record_bytes(committed.config),
        store_files.POOLED_FILE: min(
            pooled_bytes, committed.record_count * pooled.row_bytes(committed.config.pooled_width)
        ),
        store_files.SOURCES_FILE: committed.sources.bytes,
    }


def _local_head(path: Path, info: Any) -> tuple[int, bytes]:
    """The head of a complete local shard file (ShardInfo `info`): where
    its data starts and its hmem_index bytes, for the state objects."""
    start = shard_file.data_start(_read_range(path, 0, shard_file.LENGTH_BYTES))
    return start, _read_range(path, start, shard_file.index_bytes(info.entries)).tobytes()


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
