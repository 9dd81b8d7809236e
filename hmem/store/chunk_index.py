"""The key index of a store of chunks (docs/format.md, "Chunks").

`ChunkIndex` maps each key to its chunk: (first entry id, parts); the
parts have consecutive ids.  It is built at its first use, from the first
part's metadata of every chunk in the committed shards
(hmem/formats/chunk_keys.py), each shard file's chunks read once: a
reader's refresh hands the tables of the shards it had to the new state's
index (`carry`), so only new shard files are read.  The puts of this
process add their chunks as they are stored.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np

from hmem.formats import chunk_keys, shard_file

if TYPE_CHECKING:
    from hmem.store.reading import EntryReader

_NONE = np.zeros(0, dtype=np.int64)
Table = list[tuple[str, int, int]]  # a shard file's chunks: (key, first id, parts)


class ChunkIndex:
    """Key -> (first id, parts) of every chunk a state knows of."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # puts add while other threads look up
        self._build_lock = threading.Lock()
        self.by_key: dict[str, tuple[int, int]] = {}
        # each committed shard file's chunks (key, first id, parts), by shard uid
        self.tables: dict[str, Table] = {}
        self.known: dict[str, Table] = {}  # the tables of the state this one replaced
        self.built = False
        self._firsts, self._ends = _NONE, _NONE  # sorted, for whole(); made again after a change
        self._sorted = True

    def carry(self, older: ChunkIndex) -> None:
        """This index replaces `older` (a refresh): its shard tables need not be read again."""
        self.known = older.tables if older.built else older.known

    def build(self, reader: EntryReader) -> None:
        """Read the chunks of every committed shard (or take them from the
        tables carried over), once, whichever thread comes first."""
        state = reader.state
        with self._build_lock:
            if self.built:
                return
            tables: dict[str, Table] = {}
            for index, info in enumerate(state.shards[: state.shards_committed]):
                table = self.known.get(info.uid)
                if table is None:
                    table = _shard_chunks(reader.shard(index).header()[0])
                tables[info.uid] = table
            with self._lock:
                self.tables, self.known = tables, {}
                for table in tables.values():
                    for key, first, parts in table:
                        self._set(key, first, parts)
                self.built = True

    def add(self, key: str, first: int, parts: int) -> None:
        with self._lock:
            self._set(key, first, parts)

    def _set(self, key: str, first: int, parts: int) -> None:
        held = self.by_key.get(key)
        if held is None or held[0] < first:  # the newest chunk of a key is the one it names
            self.by_key[key] = (first, parts)
            self._sorted = False

    def get(self, key: str) -> tuple[int, int] | None:
        return self.by_key.get(key)

    def spans(self) -> tuple[np.ndarray, np.ndarray]:
        """First ids (ascending) and the ids past the end of every chunk."""
        with self._lock:
            if not self._sorted:
                pairs = np.array(sorted(self.by_key.values()), dtype=np.int64).reshape(-1, 2)
                self._firsts, self._ends = pairs[:, 0].copy(), pairs[:, 0] + pairs[:, 1]
                self._sorted = True
            return self._firsts, self._ends


def _shard_chunks(metadata: dict[str, str]) -> Table:
    """The chunks whose first part a shard's metadata holds."""
    found = []
    for name, text in metadata.items():
        if name.startswith(shard_file.META_PREFIX) and isinstance(text, str):
            first = chunk_keys.first_part(text)
            if first is not None:
                try:
                    entry_id = int(name[len(shard_file.META_PREFIX) :])
                except ValueError:
                    continue
                found.append((first[0], entry_id, first[1]))
    return found
