"""`Store.chunks`: a store's chunks, entries put together under an external
key (an LMCache chunk key, say) and found by it without a scan
(docs/format.md, "Chunks").  Each part of a chunk is an ordinary entry
(searchable by query, listed, exported); the chunk comes back whole in one
call.  Eviction and deletion take a chunk whole.  The calls take the
store's lock as the Store's own do (docs/architecture.md, "Threads")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hmem import validation
from hmem.errors import EntryNotFoundError, InvalidArgumentError
from hmem.formats import chunk_keys
from hmem.store import prepare
from hmem.store.results import DeletePlan, StoreChunkInfo, StoredKV

if TYPE_CHECKING:
    from hmem.store.session import Session


class StoreChunks:
    """The chunks of one open Store (``Store.chunks``)."""

    def __init__(self, session: Session) -> None:
        self._session = session

    def put(self, chunks: Mapping[str, Sequence[Any]]) -> dict[str, list[int]]:
        """Store each chunk (key -> its parts, Entry or (keys, values,
        layer_idx, importance) tuples, in order) as consecutive entries,
        each part's meta given its chunk fields.  A key the store already
        holds a live chunk of is skipped: its ids are returned as they are.
        All the new chunks go in, or none does; returns the ids per key."""
        session = self._session
        session.state.check_writable()
        with session.reading() as parts:
            parts.chunks.check_store()
            keys, counts, entries = parts.chunks.batch(chunks)
            if len(set(keys)) != len(keys):
                raise InvalidArgumentError("a put_chunks names a key twice")
            held = parts.chunks.has(keys)
        out: dict[str, list[int]] = {}
        new_keys, new_counts, new_entries, at = [], [], [], 0
        for key, count, is_held in zip(keys, counts, held):
            if not is_held:
                new_keys.append(key)
                new_counts.append(count)
                new_entries.extend(entries[at : at + count])
            at += count
        if new_entries:
            ids = session.insert(prepare.prepare_all(session.state, new_entries))  # prepared before the lock
            with session.reading() as parts:
                parts.chunks.added(new_keys, new_counts, ids)
            at = 0
            for key, count in zip(new_keys, new_counts):
                out[key] = ids[at : at + count]
                at += count
        for key, is_held in zip(keys, held):
            if is_held:
                out[key] = self.ids(key) or []
        return out

    def contains(self, keys: Iterable[str]) -> list[bool]:
        """Whether each key names a live chunk (a dictionary look-up each)."""
        keys = [chunk_keys.check_key(key) for key in keys]
        with self._session.reading() as parts:
            return parts.chunks.has(keys)

    def ids(self, key: str) -> list[int] | None:
        """The ids of the live chunk under `key`, in part order; None when there is none."""
        with self._session.reading() as parts:
            return parts.chunks.ids(key)

    def get(self, key: str) -> list[StoredKV]:
        """Every part of the chunk under `key` as stored (StoredKV: bf16 as its
        words), in part order, each tensor's checksum checked as Store.get
        checks it.  EntryNotFoundError when the store holds no such chunk."""
        self._session.maybe_refresh()
        with self._session.reading() as parts:
            return parts.chunks.get(key)

    def read_into(self, key: str, keys_out: Sequence[Any], values_out: Sequence[Any]) -> None:
        """The chunk under `key`, as stored, into the caller's buffers: for
        each part, its keys into keys_out[i] and its values into
        values_out[i] (writable, of the tensors' bytes: bf16 as words),
        read from the shard files straight into them and checked against
        their CRC-32C.  EntryNotFoundError when the store holds no such
        chunk, CorruptStoreError when a tensor fails its checksum (the
        buffers then hold what was read)."""
        with self._session.reading() as parts:
            parts.chunks.read_into(chunk_keys.check_key(key), keys_out, values_out)

    def keys(self) -> list[str]:
        """The keys of the live chunks, sorted."""
        self._session.maybe_refresh()
        with self._session.reading() as parts:
            return parts.chunks.keys()

    def listing(self, keys: Iterable[str] | None = None) -> list[StoreChunkInfo]:
        """The facts of the live chunks (of `keys` only, in their order, when
        given; the others are left out): key, entry ids, layers, tokens,
        bytes, when put, accesses.  Sorted by key when `keys` is None."""
        self._session.maybe_refresh()
        with self._session.reading() as parts:
            chosen = parts.chunks.keys() if keys is None else [chunk_keys.check_key(key) for key in keys]
            return parts.chunks.listing(chosen)

    def delete(self, keys: Iterable[str], *, missing_ok: bool = False) -> DeletePlan:
        """Delete the chunks under `keys`, durably (Store.delete of their
        ids).  A key naming no live chunk raises EntryNotFoundError and
        deletes nothing, unless `missing_ok`."""
        missing_ok = validation.flag(missing_ok, "missing_ok")
        keys = [chunk_keys.check_key(key) for key in keys]
        with self._session.writing() as parts:
            ids, absent = [], []
            for key in keys:
                found = parts.chunks.ids(key)
                if found is None:
                    absent.append(key)
                else:
                    ids.extend(found)
            if absent and not missing_ok:
                more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
                raise EntryNotFoundError(
                    f"the store holds no chunk {absent[0]!r}{more}; nothing was deleted",
                    hint="list them with Store.chunks.keys(), or pass missing_ok=True",
                )
            plan = parts.eviction.delete(validation.entry_ids(ids), missing_ok=True)
            self._session.publish()
            return plan
