"""The live entries' metadata in a chosen order (``Store.entries``, `hmem
ls`): the columns of the records are copied and sorted with numpy, and
EntryInfo objects are made only as they are iterated, a batch at a time,
so that listing a store of millions of entries holds a few numpy columns
(about 50 bytes per entry) and no Python object per entry."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from hmem.store import policy
from hmem.store.results import EntryInfo

# Orders of a listing, each with its ties broken by ascending entry id:
# id ascending; score as eviction takes them (next to be evicted first);
# accesses most first; age oldest first; size largest first.
ENTRY_SORTS = ("id", "score", "accesses", "age", "size")

# The record fields a listing keeps (hmem/formats/records.py).
FIELDS = ("entry_id", "layer_idx", "n_tokens", "importance", "access_count", "timestamp", "shard_idx")

_BATCH = 4096
_INFO_FIELDS = tuple(field.name for field in dataclasses.fields(EntryInfo))


def order(columns: dict[str, np.ndarray], sort: str) -> np.ndarray:
    """The permutation of `columns` (ascending ids) that lists them by `sort`."""
    ids = columns["entry_id"]
    if sort == "id":
        return np.arange(len(ids))
    if sort == "score":
        return policy.order(columns["importance"], columns["access_count"], columns["timestamp"], ids)
    if sort == "accesses":
        return np.lexsort((ids, -columns["access_count"].astype(np.int64)))
    if sort == "age":
        return np.lexsort((ids, columns["timestamp"]))
    if sort == "size":  # an entry's bytes grow with its tokens alone
        return np.lexsort((ids, -columns["n_tokens"].astype(np.int64)))
    raise AssertionError(sort)


def listing(
    columns: dict[str, np.ndarray], sort: str, limit: int | None, sizes_of: Callable[[np.ndarray], Any]
) -> EntryListing:
    """The listing of the records `columns` (copies of FIELDS, ascending
    ids) by `sort`, the first `limit` of them (None: all); `sizes_of` gives
    the bytes of entries of n tokens."""
    chosen = order(columns, sort)[:limit]
    kept = {name: column[chosen] for name, column in columns.items()}
    sizes = np.asarray(sizes_of(kept["n_tokens"].astype(np.int64)), dtype=np.int64)
    return EntryListing(kept, sizes, len(columns["entry_id"]), sort)


class EntryListing:
    """What ``Store.entries`` returns: the listed entries' metadata, a
    snapshot taken when it was made.  Iterating gives EntryInfo in the
    listing's order, made a batch at a time; ``len()`` is how many are
    listed and ``total`` how many live entries matched before the limit."""

    def __init__(self, columns: dict[str, np.ndarray], sizes: np.ndarray, total: int, sort: str) -> None:
        self._columns = columns
        self._sizes = sizes
        self.total = total
        self.sort = sort

    def __len__(self) -> int:
        return len(self._sizes)

    def __iter__(self) -> Iterator[EntryInfo]:
        for batch in self.batches():
            yield from batch

    def batches(self, size: int = _BATCH) -> Iterator[list[EntryInfo]]:
        """The entries in lists of up to `size`."""
        for columns in self.column_batches(size):
            yield [EntryInfo(*row) for row in zip(*(columns[name] for name in _INFO_FIELDS))]

    def column_batches(self, size: int = _BATCH) -> Iterator[dict[str, list[Any]]]:
        """The entries a batch of up to `size` at a time, as columns: lists
        of Python numbers named as the fields of EntryInfo (for output that
        makes no object per entry)."""
        cols = self._columns
        for start in range(0, len(self), size):
            part = slice(start, start + size)
            importance, accesses = cols["importance"][part], cols["access_count"][part]
            yield {
                "entry_id": cols["entry_id"][part].tolist(),
                "layer_idx": cols["layer_idx"][part].tolist(),
                "n_tokens": cols["n_tokens"][part].tolist(),
                "importance": importance.astype(np.float64).tolist(),
                "access_count": accesses.tolist(),
                "created": cols["timestamp"][part].tolist(),
                "shard_idx": cols["shard_idx"][part].tolist(),
                "bytes": self._sizes[part].tolist(),
                "score": policy.scores(importance, accesses).tolist(),
            }

    def __repr__(self) -> str:
        return f"EntryListing({len(self)} of {self.total} entries, sort={self.sort!r})"
