"""An hmem store as a durable tier of LMCache chunks, without LMCache
(docs/lmcache.md, "hmem as LMCache's durable tier").

`ChunkTier` is what LMCache's remote storage plugin (hmem/lmcache/connector.py)
delegates to, in each process that writes or reads the tier.  One hmem
store of chunks (a directory or s3://...), any number of processes:

- a put is *staged*: its bytes are copied into the tier's memory, or kept
  where they are until committed (the plugin keeps LMCache's buffer by a
  reference), and the call returns; from then on the chunk is found
  (`contains`) and read (`fetch`) from there;
- a committer thread stores the staged chunks in groups, every
  `commit_seconds` or once `commit_bytes` are staged: it takes the store's
  writer lock (a lock file, or the lease on object storage) for that commit
  only, opens the store as its writer, which finishes or clears what a
  killed writer left, puts the chunks the store does not hold yet
  (``Store.chunks.put``: one entry per layer, bfloat16 words as they are),
  and closes it, which commits (write, fsync, rename: docs/format.md);
- readers see each commit whole: the tier's reader refreshes when
  index.json changed, then drops the chunks it committed from its memory.

So several writers share one store through its ordinary commit protocol, a
commit at a time, each seeing the others' chunks; what a crash loses is
the chunks staged since the last commit of the crashed process (at most
`commit_seconds`, or `commit_bytes`, of its puts), and `commit()` waits for
a commit of everything staged so far.  A committed chunk is read from its
shard files straight into the caller's buffer (``Store.chunks.read_into``)
and every tensor checked against its CRC-32C: one that fails is never
handed out (the read raises, the plugin's get gives None) and its key is
not reported again (`verify --full` names the entry).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from hmem import memory, validation
from hmem.errors import (
    CorruptStoreError,
    EntryNotFoundError,
    HmemError,
    InvalidArgumentError,
    InvalidTensorError,
    NotAStoreError,
    StoreChangedError,
    StoreExistsError,
    StoreLockedError,
)
from hmem.store.storage import Bf16Rows
from hmem.store.store import Entry, Store

log = logging.getLogger("hmem.lmcache.tier")

# LMCache's memory formats a tier keeps (lmcache.v1.memory_management.MemoryFormat names)
KV_2LTD = "KV_2LTD"  # [2, layers, tokens, hidden]: a chunk of every layer
KV_T2D = "KV_T2D"  # [tokens, 2, hidden]: one layer of a chunk (layerwise mode)
LAYOUTS = (KV_2LTD, KV_T2D)
# LMCache's dtype names -> a store's storage dtype and the numpy type its words are held as
DTYPES = {"bfloat16": ("bf16", np.uint16), "float16": ("f16", np.float16), "float32": ("f32", np.float32)}
FORMAT_FIELD = "lmcache_format"  # a chunk's first part's meta: the layout it came in

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class TierSettings:
    """How a tier commits and what store it makes (docs/lmcache.md)."""

    commit_seconds: float = 1.0  # staged chunks are committed at least this often
    commit_bytes: int = 256 * MiB  # ... and as soon as this much is staged
    max_staged_bytes: int = 2048 * MiB  # puts wait while this much awaits its commit
    max_bytes: int = 0  # a new store's byte cap (max_disk_bytes); 0: none
    lock_wait: float = 120.0  # how long a commit waits for another writer's
    refresh_seconds: float = 1.0  # other processes' commits are seen within this long
    hdc_dim: int = 1024  # signature bits of a new store's entries
    # a commit's shards are written several at once (hmem/store/writer.py,
    # SEALS_IN_FLIGHT): more, smaller files reach the page cache faster
    shard_max_bytes: int = 64 * MiB

    def __post_init__(self) -> None:
        validation.number(self.commit_seconds, "commit_seconds", low=0.0)
        validation.integer(self.commit_bytes, "commit_bytes", low=1)
        validation.integer(self.max_staged_bytes, "max_staged_bytes", low=1)
        validation.integer(self.max_bytes, "max_bytes", low=0)
        validation.number(self.lock_wait, "lock_wait", low=0.0)
        validation.number(self.refresh_seconds, "refresh_seconds", low=0.001)


@dataclasses.dataclass
class _Staged:
    data: np.ndarray  # the chunk's values: [2, L, T, H] or [T, 2, H]
    layout: str
    layer: int  # KV_T2D: the layer it holds
    # what frees `data` once the chunk is committed: the pool's buffer it was
    # copied into is given back, or the caller's buffer it lies in released
    free: Callable[[], None]
    readers: int = 0  # fetches copying out of it: it is freed after the last
    retired: bool = False  # committed (or removed): nothing new reads it


class _StagedReader:
    """A fetch of a staged chunk: its buffer stays the chunk's until released."""

    def __init__(self, chunk: _Staged, cond: threading.Condition) -> None:
        self.chunk, self.cond = chunk, cond

    def release(self) -> None:
        with self.cond:
            chunk = self.chunk
            chunk.readers -= 1
            if chunk.retired and not chunk.readers:
                chunk.free()


@dataclasses.dataclass
class ChunkRead:
    """A chunk found in the tier: its layout and shape as LMCache holds it.
    Copy it out (`copy_into`) or let it go (`close`), once."""

    layout: str
    shape: tuple[int, ...]
    _source: Any  # the staged array, or a function that reads the stored chunk into an array
    _staged: _StagedReader | None = None

    def copy_into(self, out: np.ndarray) -> None:
        """Write the chunk's values into `out` (a writable array of `shape`,
        in the tier's dtype), then let the chunk go.  Raises when the stored
        chunk cannot be read whole (evicted meanwhile, or damaged: then
        `out` holds no chunk and the tier reports the key no more)."""
        try:
            if isinstance(self._source, np.ndarray):
                out[...] = self._source
            else:
                self._source(out)
        finally:
            self.close()

    def close(self) -> None:
        staged, self._staged = self._staged, None
        if staged is not None:
            staged.release()


@dataclasses.dataclass(frozen=True)
class TierStats:
    staged_chunks: int
    staged_bytes: int
    commits: int
    committed_chunks: int
    failed_commits: int
    bad_chunks: int  # keys whose stored bytes failed their checksum


class ChunkTier:
    """One process's view of an hmem store used as a tier of chunks."""

    def __init__(
        self,
        location: str,
        *,
        embed_dim: int,
        dtype: str = "bfloat16",
        settings: TierSettings | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        validation.choice(dtype, "dtype", tuple(DTYPES))
        self.location = str(location)
        self.settings = settings or TierSettings()
        self.dtype = dtype
        self.word_type = DTYPES[dtype][1]
        self._options = storage_options
        self._ensure_store(validation.integer(embed_dim, "embed_dim", low=1), DTYPES[dtype][0])
        self._reader = Store.open(self.location, read_only=True, storage_options=storage_options)
        self._reader.chunks.contains([])  # the key index, built before the first lookup
        self._cond = threading.Condition()
        self._staged: dict[str, _Staged] = {}
        self._staged_bytes = 0
        self._first_staged = 0.0  # monotonic time the oldest staged chunk came
        self._sequence = 0  # puts staged so far
        self._committed_sequence = 0  # every put up to this one is committed (or was not new)
        self._flush_wanted = 0
        self._bad: set[str] = set()
        self._commits = self._committed_chunks = self._failed = 0
        self._last_error: BaseException | None = None
        self._closing = False
        # the memory of staged chunks and of a commit's open shard, reused
        memory.POOL.keep_at_least(4 * self.settings.commit_bytes)
        self._thread = threading.Thread(target=self._run, name="hmem-tier-committer", daemon=True)
        self._thread.start()
        # A process that ends without closing the tier (no engine shutdown)
        # still commits what it staged, when it ends normally.  Registered
        # where the interpreter calls it before thread pools stop taking work
        # (a commit seals shards on one): threading's own exit hooks.
        _at_exit(_close_at_exit, weakref.ref(self))

    # ---- the store ---------------------------------------------------------------------

    def _ensure_store(self, embed_dim: int, storage_dtype: str) -> None:
        """Make the store when there is none; check that one there can take these chunks."""
        s = self.settings
        try:
            Store.create(
                self.location,
                embed_dim=embed_dim,
                hdc_dim=s.hdc_dim,
                storage_dtype=storage_dtype,
                chunks=True,
                max_disk_bytes=s.max_bytes,
                shard_max_bytes=s.shard_max_bytes,
                storage_options=self._options,
            ).close()
        except (StoreExistsError, StoreLockedError):
            pass  # it was there, or another process made it first, or is making it (every rank starts at once)
        cfg = self._made_config()
        wrong = []
        if not cfg.chunks:
            wrong.append("it keeps no chunks (made without chunks=True)")
        if cfg.embed_dim != embed_dim:
            wrong.append(f"its rows are {cfg.embed_dim} wide, these chunks' {embed_dim}")
        if cfg.storage_dtype != storage_dtype:
            wrong.append(f"it stores {cfg.storage_dtype}, these chunks are {self.dtype}")
        if s.max_bytes and cfg.max_disk_bytes != s.max_bytes:
            wrong.append(f"its byte cap is {cfg.max_disk_bytes}, not the {s.max_bytes} asked for")
        if wrong:
            raise InvalidArgumentError(
                f"the store at {self.location} cannot be this tier: " + "; ".join(wrong),
                hint="give the tier a path of its own, or one made for the same model and settings",
            )

    def _made_config(self) -> Any:
        """The store's config, once the process making it has committed it
        (waiting up to lock_wait: LMCache's workers start together)."""
        end = time.monotonic() + self.settings.lock_wait
        while True:
            try:
                with Store.open(self.location, read_only=True, storage_options=self._options) as store:
                    return store.config
            except NotAStoreError:
                if time.monotonic() >= end:
                    raise
                time.sleep(0.05)  # another process is making it: its first commit is moments away

    # ---- putting -----------------------------------------------------------------------

    def stage(
        self,
        key: str,
        data: Any,
        layout: str,
        shape: Sequence[int],
        layer: int = 0,
        release: Callable[[], None] | None = None,
    ) -> bool:
        """Take a chunk (its bytes or array, in `layout` and `shape`) to be
        committed; returns False when the tier holds it already.  Waits
        while max_staged_bytes await their commit.

        Without `release`, the bytes are copied: the caller may reuse its
        buffer once this returns.  With it, the tier keeps `data` itself,
        which must not change until the tier calls `release()`: once, when
        the chunk is committed, found held already, removed, or refused
        (then before this raises).  A put's bytes are then written to the
        store without a copy of their own (LMCache's buffer, held by its
        reference count, docs/lmcache.md)."""
        try:
            validation.choice(layout, "layout", LAYOUTS)
            shape = tuple(int(n) for n in shape)
            if (layout == KV_2LTD and (len(shape) != 4 or shape[0] != 2)) or (
                layout == KV_T2D and (len(shape) != 3 or shape[1] != 2)
            ):
                raise InvalidArgumentError(f"a {layout} chunk cannot have shape {list(shape)}")
            array = np.frombuffer(data, dtype=self.word_type) if not isinstance(data, np.ndarray) else data
            if array.size != int(np.prod(shape)):
                raise InvalidArgumentError(f"chunk {key!r}: {array.size} values for shape {list(shape)}")
            if self.contains([key])[0]:
                if release is not None:
                    release()
                return False
        except BaseException:
            if release is not None:
                release()
            raise
        if release is not None:
            kept, free = array.reshape(shape), release
        else:
            # Fresh memory costs more than the copy into it (hmem/memory.py):
            # copies live in the pool's buffers, reused commit after commit.
            buffer = memory.POOL.take(array.nbytes)
            kept = buffer[: array.nbytes].view(self.word_type).reshape(shape)
            np.copyto(kept, array.reshape(shape))
            free = functools.partial(memory.POOL.give, buffer)
        with self._cond:
            while self._staged_bytes >= self.settings.max_staged_bytes and not self._closing:
                self._cond.wait()
            if key in self._staged or self._closing:
                free()
                self._check_open()
                return False
            if not self._staged:
                self._first_staged = time.monotonic()
            self._staged[key] = _Staged(kept, layout, layer, free)
            self._staged_bytes += kept.nbytes
            self._sequence += 1
            self._cond.notify_all()
        return True

    def commit(self, timeout: float | None = None) -> None:
        """Wait until every chunk staged before this call is committed (or
        `timeout` seconds); raises the committer's error if its commit failed."""
        with self._cond:
            target = self._sequence
            self._flush_wanted = max(self._flush_wanted, target)
            self._cond.notify_all()
            end = None if timeout is None else time.monotonic() + timeout
            while self._committed_sequence < target:
                self._check_open()
                if self._last_error is not None:
                    raise self._last_error
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"the tier at {self.location} did not commit within {timeout} s")
                self._cond.wait(left)

    # ---- reading -----------------------------------------------------------------------

    def contains(self, keys: Iterable[str]) -> list[bool]:
        """Whether the tier holds each key: staged, or committed and not
        found damaged.  Dictionary look-ups; safe from any thread."""
        keys = list(keys)
        with self._cond:
            staged = [key in self._staged for key in keys]
        rest = [key for key, held in zip(keys, staged) if not held]
        found = iter(self._committed(rest) if rest else [])
        bad = self._bad
        return [held or (next(found) and key not in bad) for key, held in zip(keys, staged)]

    def _committed(self, keys: list[str]) -> list[bool]:
        """Which keys the reader's commit holds.  A commit made meanwhile
        may have removed a shard file the reader has yet to read (`hmem
        compact`): then the newest commit is taken and asked again; if
        that keeps failing, the keys count as not held (a miss) until the
        next refresh, never as an error in LMCache's lookup."""
        for _ in range(3):
            try:
                return self._reader.chunks.contains(keys)
            except StoreChangedError:
                self._refresh()
            except CorruptStoreError as exc:  # a damaged shard header: verify names it
                log.warning("hmem tier: the key index of %s could not be read: %s", self.location, exc.message)
                break
        return [False] * len(keys)

    def fetch(self, key: str, layout: str = KV_2LTD) -> ChunkRead | None:
        """The chunk under `key` (held in `layout`), or None: not held,
        evicted meanwhile, or found damaged before (its key is then not
        reported again).  Reads nothing of a stored chunk yet: its size comes
        from the records, its bytes with ChunkRead.copy_into."""
        with self._cond:
            staged = self._staged.get(key)
            if staged is not None:
                staged.readers += 1
                return ChunkRead(staged.layout, staged.data.shape, staged.data, _StagedReader(staged, self._cond))
        if key in self._bad:
            return None
        for _ in range(2):
            try:
                found = self._reader.chunks.listing([key])
            except StoreChangedError:  # a shard its index needs was compacted away: take the newest commit
                self._refresh()
                continue
            except HmemError as exc:
                log.warning("hmem tier: chunk %s could not be looked up: %s", key, exc.message)
                return None
            if not found:
                return None
            info, width = found[0], self._reader.config.embed_dim
            if layout == KV_2LTD:
                shape: tuple[int, ...] = (2, info.parts, info.n_tokens, width)
            elif info.parts == 1:
                shape = (info.n_tokens, 2, width)
            else:
                log.warning("hmem tier: chunk %s holds %d layers, not the one of a %s chunk", key, info.parts, layout)
                return None
            return ChunkRead(layout, shape, functools.partial(self._read_stored, key, layout))
        return None

    def _read_stored(self, key: str, layout: str, out: np.ndarray) -> None:
        """A committed chunk's bytes into `out`, from the shard files straight
        into it (Store.chunks.read_into), each layer's checksum checked."""
        for attempt in range(2):
            try:
                if layout == KV_2LTD:
                    layers = range(out.shape[1])
                    self._reader.chunks.read_into(key, [out[0, i] for i in layers], [out[1, i] for i in layers])
                else:
                    (part,) = self._reader.chunks.get(key)
                    out[:, 0, :] = part.keys
                    out[:, 1, :] = part.values
                return
            except CorruptStoreError as exc:
                log.warning("hmem tier: chunk %s fails its checks and is a miss (%s)", key, exc.message)
                self._bad.add(key)
                raise
            except (StoreChangedError, EntryNotFoundError):
                if attempt or not self._reader.refresh():  # a commit meanwhile: a shard rewritten, or evicted
                    raise

    def keys(self) -> list[str]:
        with self._cond:
            staged = set(self._staged)
        return sorted(staged | {key for key in self._reader.chunks.keys() if key not in self._bad})

    def remove(self, key: str) -> bool:
        """Delete the chunk under `key` (staged or committed); whether there was one."""
        with self._cond:
            staged = self._staged.pop(key, None)
            if staged is not None:
                self._staged_bytes -= staged.data.nbytes
                self._retire(staged)
                self._cond.notify_all()
        with Store.open(self.location, lock_wait=self.settings.lock_wait, storage_options=self._options) as writer:
            plan = writer.chunks.delete([key], missing_ok=True)
        self._reader.refresh()
        return staged is not None or bool(plan.count)

    def stats(self) -> TierStats:
        with self._cond:
            staged = (len(self._staged), self._staged_bytes)
            return TierStats(*staged, self._commits, self._committed_chunks, self._failed, len(self._bad))

    # ---- the committer -------------------------------------------------------------------

    def _due(self) -> bool:
        s = self.settings
        if not self._staged:
            return False
        return (
            self._closing
            or self._flush_wanted > self._committed_sequence
            or self._staged_bytes >= s.commit_bytes
            or time.monotonic() - self._first_staged >= s.commit_seconds
        )

    def _run(self) -> None:
        """Commit what is due; between commits, take other processes'
        commits (and what `hmem` commands changed) every refresh_seconds."""
        s = self.settings
        while True:
            with self._cond:
                if not self._staged:  # nothing left to commit: every put so far is (or was never new)
                    self._committed_sequence = self._sequence
                    self._cond.notify_all()
                if not self._due() and not self._closing:
                    age = time.monotonic() - self._first_staged
                    wait = min(s.commit_seconds - age, s.refresh_seconds) if self._staged else s.refresh_seconds
                    self._cond.wait(max(wait, 0.001))
                if self._closing and not self._staged:
                    return
                due = self._due()
                batch, sequence = self._next_batch() if due else ({}, 0)
            if not due:
                self._refresh()
                continue
            try:
                stored = self._commit(batch)
                self._reader.refresh()  # the commit, whole, before the chunks leave memory
                self._reader.chunks.contains([])  # and its key index, before LMCache's next lookup
                error = None
            except BaseException as exc:  # logged and retried: the staged chunks stay found meanwhile
                stored, error = 0, exc
                log.error("hmem tier: a commit to %s failed, retrying: %s", self.location, exc)
            with self._cond:
                if error is None:
                    for key, chunk in batch.items():
                        if self._staged.get(key) is chunk:
                            del self._staged[key]
                            self._staged_bytes -= chunk.data.nbytes
                            self._retire(chunk)
                    self._first_staged = time.monotonic()
                    self._committed_sequence = max(self._committed_sequence, sequence)
                    self._commits += 1
                    self._committed_chunks += stored
                    self._last_error = None
                else:
                    self._failed += 1
                    self._last_error = error
                self._cond.notify_all()
                if error is not None and not self._closing:
                    self._cond.wait(min(max(s.commit_seconds, 0.05), 5.0))  # a pause before the retry
                elif error is not None:
                    return

    def _refresh(self) -> None:
        try:
            if self._reader.refresh():
                self._reader.chunks.contains([])  # its key index built here, not in LMCache's next lookup
        except HmemError as exc:  # the reader keeps the commit it has; the next round tries again
            log.warning("hmem tier: could not take the newest commit of %s: %s", self.location, exc.message)

    def _next_batch(self) -> tuple[dict[str, _Staged], int]:
        """The oldest staged chunks, up to twice commit_bytes (a commit holds
        its chunks in memory once more), and the put sequence number every
        put up to which the batch covers when it is all that is staged."""
        batch: dict[str, _Staged] = {}
        size, limit = 0, 2 * self.settings.commit_bytes
        for key, chunk in self._staged.items():
            if batch and size + chunk.data.nbytes > limit:
                return batch, self._committed_sequence  # more to come: no put waiting on commit() is done yet
            batch[key] = chunk
            size += chunk.data.nbytes
        return batch, self._sequence

    @staticmethod
    def _retire(chunk: _Staged) -> None:
        """`chunk` left the staged set (under the lock): its memory is freed
        now, or after the last fetch copying out of it."""
        chunk.retired = True
        if not chunk.readers:
            chunk.free()

    def _commit(self, batch: dict[str, _Staged]) -> int:
        """Put the chunks of `batch` the store does not hold yet, in one
        commit under the store's writer lock; returns how many went in."""
        with Store.open(self.location, lock_wait=self.settings.lock_wait, storage_options=self._options) as writer:
            held = writer.chunks.contains(list(batch))
            fresh = {key: _parts(chunk) for (key, chunk), is_held in zip(batch.items(), held) if not is_held}
            try:
                writer.chunks.put(fresh)
            except InvalidTensorError:
                # A chunk hmem refuses (values that are not finite: LMCache's
                # health check puts a chunk of uninitialised memory) costs
                # only itself: the others go in one by one.
                for key, parts in list(fresh.items()):
                    try:
                        writer.chunks.put({key: parts})
                    except InvalidTensorError as exc:
                        log.error("hmem tier: chunk %s is refused and not stored: %s", key, exc.message)
                        del fresh[key]
            return len(fresh)  # closing the writer commits

    # ---- the end -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closing:
            raise InvalidArgumentError(f"the tier at {self.location} is closed")

    def close(self) -> None:
        """Commit what is staged, stop the committer and close the store."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        self._reader.close()
        if self._staged:
            log.error("hmem tier: %d chunk(s) staged for %s were not committed", len(self._staged), self.location)
            with self._cond:
                for chunk in self._staged.values():
                    self._retire(chunk)


_at_exit = getattr(threading, "_register_atexit", atexit.register)


def _close_at_exit(tier: weakref.ref[ChunkTier]) -> None:
    alive = tier()
    if alive is not None:
        alive.close()


def _parts(chunk: _Staged) -> list[Entry]:
    """A staged chunk as the entries of its parts: a layer each."""
    data = chunk.data
    if chunk.layout == KV_2LTD:
        pairs = [(data[0, layer], data[1, layer], layer) for layer in range(data.shape[1])]
    else:
        pairs = [(data[:, 0, :], data[:, 1, :], chunk.layer)]
    parts = [Entry(_rows(k), _rows(v), layer) for k, v, layer in pairs]
    parts[0] = parts[0]._replace(meta={FORMAT_FIELD: chunk.layout})
    return parts


def _rows(array: np.ndarray) -> Any:
    return Bf16Rows(array) if array.dtype == np.uint16 else array
