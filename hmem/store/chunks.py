"""Chunks: entries stored together under an external key (docs/format.md,
"Chunks"), found by key without a scan.

`Chunks` is the component behind Store.put_chunks and the look-ups, over
the state's ChunkIndex (hmem/store/chunk_index.py).  A key names the
newest chunk put under it; that chunk is live while all its parts are,
which the records say: eviction and deletion take a chunk whole
(`whole`), so a key is never half there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from hmem.errors import EntryNotFoundError, InvalidArgumentError
from hmem.formats import chunk_keys
from hmem.formats.records import EVICTED
from hmem.store import prepare
from hmem.store.chunk_index import ChunkIndex
from hmem.store.reading import EntryReader
from hmem.store.results import StoreChunkInfo, StoredKV
from hmem.store.state import StoreState


class Chunks:
    """Chunks of one StoreState: put, looked up, read, and kept whole."""

    def __init__(self, state: StoreState, reader: EntryReader) -> None:
        self.state = state
        self.reader = reader

    @property
    def index(self) -> ChunkIndex:
        """The state's index, built at its first use."""
        index: ChunkIndex = self.state.chunk_index
        if not index.built:
            index.build(self.reader)
        return index

    def check_store(self) -> None:
        if not self.state.config.chunks:
            raise InvalidArgumentError(
                f"the store at {self.state.path} keeps no chunks",
                hint="create it with chunks=True (hmem init --chunks) to put entries under keys",
            )

    # ---- putting -----------------------------------------------------------------------

    def batch(self, chunks: Mapping[str, Sequence[Any]]) -> tuple[list[str], list[int], list[prepare.Entry]]:
        """The keys, part counts and entries of a put_chunks, each part's
        metadata given its chunk fields; checks the keys and parts only."""
        if not isinstance(chunks, Mapping):
            raise InvalidArgumentError(f"chunks must be a mapping of key -> entries, got {type(chunks).__name__}")
        keys, counts, entries = [], [], []
        for key, parts in chunks.items():
            chunk_keys.check_key(key)
            parts = list(parts)
            if not 1 <= len(parts) <= chunk_keys.MAX_PARTS:
                raise InvalidArgumentError(f"chunk {key!r} has {len(parts)} parts; 1 to {chunk_keys.MAX_PARTS}")
            for number, part in enumerate(parts):
                entry = prepare.Entry(*part) if not isinstance(part, prepare.Entry) else part
                meta = dict(entry.meta or {})
                clash = [name for name in chunk_keys.RESERVED_FIELDS if name in meta]
                if clash:
                    raise InvalidArgumentError(f"chunk {key!r}: meta field {clash[0]!r} is hmem's own for chunks")
                meta.update(chunk_keys.part_meta(key, number, len(parts)))
                entries.append(entry._replace(meta=meta))
            keys.append(key)
            counts.append(len(parts))
        return keys, counts, entries

    def fresh(self, keys: list[str]) -> list[bool]:
        """Which of `keys` the store holds no live chunk of (to be put)."""
        return [not held for held in self.has(keys)]

    def added(self, keys: list[str], counts: list[int], ids: list[int]) -> None:
        """The chunks a put just stored (ids in order, parts back to back)."""
        at = 0
        index = self.index
        for key, count in zip(keys, counts):
            index.add(key, ids[at], count)
            at += count

    # ---- looking up ----------------------------------------------------------------------

    def has(self, keys: Iterable[str]) -> list[bool]:
        """Whether each key names a live chunk: dict look-ups, then one
        vectorised check of the records."""
        index = self.index
        spans = [index.get(key) for key in keys]
        found = [i for i, span in enumerate(spans) if span is not None]
        out = [False] * len(spans)
        if found:
            firsts = np.array([spans[i][0] for i in found], dtype=np.int64)  # type: ignore[index]
            parts = np.array([spans[i][1] for i in found], dtype=np.int64)  # type: ignore[index]
            for i, ok in zip(found, self._live(firsts, parts).tolist()):
                out[i] = ok
        return out

    def _live(self, firsts: np.ndarray, parts: np.ndarray) -> np.ndarray:
        """Whether the chunks of these first ids and part counts are live:
        their first and last parts are live records with the ids expected
        (a chunk is evicted whole; a part repair could not keep is
        missing, which the ids show)."""
        state = self.state
        n = state.n
        if not n:
            return np.zeros(len(firsts), dtype=bool)
        ids = state.records["entry_id"][:n]
        shard = state.records["shard_idx"][:n]
        at = np.minimum(np.searchsorted(ids, firsts), n - 1)
        last = np.minimum(at + parts - 1, n - 1)
        return (
            (ids[at] == firsts) & (ids[last] == firsts + parts - 1) & (shard[at] != EVICTED) & (shard[last] != EVICTED)
        )

    def ids(self, key: str) -> list[int] | None:
        """The ids of the live chunk under `key`, in part order, or None."""
        chunk_keys.check_key(key)
        span = self.index.get(key)
        if span is None or not self._live(np.array([span[0]]), np.array([span[1]]))[0]:
            return None
        return list(range(span[0], span[0] + span[1]))

    def get(self, key: str) -> list[StoredKV]:
        """Every part of the chunk under `key`, as stored, in part order."""
        ids = self.ids(key)
        if ids is None:
            raise EntryNotFoundError(
                f"the store at {self.state.path} holds no chunk {key!r}", hint="list them with Store.chunk_keys()"
            )
        return [self.reader.stored_kv(self.reader.position(entry_id)) for entry_id in ids]

    def read_into(self, key: str, keys_out: Sequence[Any], values_out: Sequence[Any]) -> None:
        """Every part's keys and values, as stored, into the caller's
        writable buffers (one each per part, of the part's bytes): read from
        the shard files straight into them, a run of adjacent tensors per
        read (a chunk put in one commit lies in one run), then each checked
        against its CRC-32C; a chunk held in memory (not sealed yet) or on
        object storage is copied from where reads find it."""
        ids = self.ids(key)
        if ids is None:
            raise EntryNotFoundError(
                f"the store at {self.state.path} holds no chunk {key!r}", hint="list them with Store.chunks.keys()"
            )
        if len(keys_out) != len(ids) or len(values_out) != len(ids):
            raise InvalidArgumentError(f"chunk {key!r} has {len(ids)} parts; give a buffer of keys and values for each")
        if not all(_writable_bytes(out) for out in (*keys_out, *values_out)):
            raise InvalidArgumentError("read_into needs writable, C-contiguous buffers")
        reader = self.reader
        reader.read_tensors_into(reader.positions(np.asarray(ids, dtype=np.int64)), {"k": keys_out, "v": values_out})

    def keys(self) -> list[str]:
        """The keys of the live chunks, sorted."""
        index = self.index
        keys = sorted(index.by_key)
        held = self.has(keys)
        return [key for key, ok in zip(keys, held) if ok]

    def listing(self, keys: list[str]) -> list[StoreChunkInfo]:
        """The facts of the live chunks under `keys` (in that order; the
        others left out), from the records: a few array operations, then
        one object per chunk."""
        index = self.index
        spans = [index.get(key) for key in keys]
        chosen = [(key, span) for key, span in zip(keys, spans) if span is not None]
        if not chosen:
            return []
        firsts = np.array([span[0] for _, span in chosen], dtype=np.int64)
        parts = np.array([span[1] for _, span in chosen], dtype=np.int64)
        live = self._live(firsts, parts)
        state = self.state
        ids = state.records["entry_id"][: state.n]
        at = np.searchsorted(ids, firsts)
        out = []
        for (key, (first, count)), ok, start in zip(chosen, live.tolist(), at.tolist()):
            if not ok:
                continue
            rows = state.records[start : start + count]
            sizes = state.entry_file_bytes(rows["n_tokens"].astype(np.int64))
            out.append(
                StoreChunkInfo(
                    key=key,
                    entry_ids=tuple(range(first, first + count)),
                    layers=tuple(rows["layer_idx"].tolist()),
                    n_tokens=int(rows["n_tokens"][0]),
                    bytes=int(np.sum(sizes)),
                    created=int(rows["timestamp"][0]),
                    access_count=int(np.sum(rows["access_count"])),
                )
            )
        return out

    # ---- kept whole ----------------------------------------------------------------------

    def whole(self, positions: np.ndarray) -> np.ndarray:
        """`positions` (of live records) and every live record of the chunks
        they belong to, ascending: what an eviction or deletion takes."""
        if not self.state.config.chunks or not len(positions):
            return positions
        firsts, ends = self.index.spans()
        if not len(firsts):
            return positions
        state = self.state
        ids = state.records["entry_id"][: state.n]
        chosen = ids[positions]
        at = np.searchsorted(firsts, chosen, side="right") - 1
        inside = (at >= 0) & (chosen < ends[np.maximum(at, 0)])
        hit = np.unique(at[inside])
        if not len(hit):
            return positions
        lo = np.searchsorted(ids, firsts[hit])
        hi = np.searchsorted(ids, ends[hit])
        sibling = np.concatenate([np.arange(a, b) for a, b in zip(lo.tolist(), hi.tolist())])
        every = np.union1d(positions, sibling)
        return every[state.records["shard_idx"][every] != EVICTED]


def _writable_bytes(buffer: Any) -> bool:
    """Whether `buffer` can be read into, its bytes in one run."""
    if isinstance(buffer, np.ndarray):  # no new object for the usual case
        return bool(buffer.flags.writeable and buffer.flags.c_contiguous)
    view = memoryview(buffer)
    return not view.readonly and view.c_contiguous
