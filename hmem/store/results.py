"""What a query returns and what stats() reports."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from hmem.config import StoreConfig


@dataclasses.dataclass(frozen=True)
class QueryResult:
    """One retrieved entry.

    ``score`` ranks the results: the cosine of the pooled keys when the query
    re-ranked its shortlist, else the signature similarity.  ``keys`` and
    ``values`` are [n_tokens, embed_dim] float32 (read-only views of the
    shard's memory map when stored as F32; torch tensors when the query
    asked for framework="torch").
    """

    entry_id: int
    layer_idx: int
    score: float
    similarity: float  # 1 - hamming / hdc_dim
    cosine: float | None  # pooled-key cosine, when re-ranked
    keys: Any
    values: Any
    n_tokens: int
    importance: float
    timestamp: int  # nanoseconds since the Unix epoch
    access_count: int  # including this query's access
    shard_idx: int


@dataclasses.dataclass(frozen=True)
class EntryInfo:
    """The metadata of one live entry (``Store.entries``)."""

    entry_id: int
    layer_idx: int
    n_tokens: int
    importance: float
    access_count: int
    created: int  # nanoseconds since the Unix epoch
    shard_idx: int
    bytes: int  # what the entry takes in its shard, index row and header entries included


@dataclasses.dataclass(frozen=True)
class StoredEntry:
    """One entry read back by id (``Store.get``): its metadata and its K/V,
    [n_tokens, embed_dim] float32 read-only arrays, bit-exact as put (INT8
    stores give the dequantized rows)."""

    info: EntryInfo
    keys: np.ndarray
    values: np.ndarray

    @property
    def entry_id(self) -> int:
        return self.info.entry_id


@dataclasses.dataclass(frozen=True)
class ShardStats:
    index: int
    file: str
    bytes: int
    entries: int
    dead_entries: int
    dead_bytes: int
    committed: bool


@dataclasses.dataclass(frozen=True)
class StoreStats:
    path: str
    format_version: int
    generation: int
    config: StoreConfig
    entries: int  # live entries
    evicted: int  # records of evicted entries still in entries.bin (dropped by compact)
    unflushed: int  # entries put since the last flush
    layers: dict[int, int]  # live entries per layer
    shards: list[ShardStats]
    bytes_on_disk: int  # every file in the store directory
    live_bytes: int  # tensor bytes of the live entries
    reclaimable_bytes: int  # what compact would free now
    orphan_files: list[str]  # leftovers hmem made and no commit names (compact removes them)
    foreign_files: list[str]  # files hmem did not make (never touched)
    total_accesses: int  # sum of access counts
    next_entry_id: int
    kernels: str

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["config"] = self.config.to_dict()
        out["layers"] = {str(k): v for k, v in self.layers.items()}
        return out


def as_framework(array: np.ndarray, framework: str) -> Any:
    if framework == "numpy":
        return array
    import torch  # framework="torch" was asked for explicitly

    return torch.from_numpy(np.array(array, copy=True))


@dataclasses.dataclass(frozen=True)
class EvictionPlan:
    """What evict(target_entries) would remove."""

    target_entries: int
    entries_before: int
    entry_ids: tuple[int, ...]  # in eviction order
    bytes_reclaimable: int  # freed by the compaction that follows
    lowest_score: float | None

    @property
    def count(self) -> int:
        return len(self.entry_ids)


@dataclasses.dataclass(frozen=True)
class CompactionPlan:
    """What compact() would do."""

    shards_before: int
    shards_after: int
    bytes_before: int
    bytes_after_estimate: int
    reclaimable_bytes: int
    reclaimable_share: float  # of bytes_before
    evicted_records: int  # records compact drops
    orphan_files: tuple[str, ...]
    needed: bool  # False: the store is already compact


@dataclasses.dataclass(frozen=True)
class CompactionReport:
    """What compact() did."""

    performed: bool
    reason: str
    shards_before: int
    shards_after: int
    bytes_before: int
    bytes_after: int
    bytes_freed: int
    entries: int  # live entries, all kept
    records_dropped: int
    orphans_removed: int
    seconds: float
