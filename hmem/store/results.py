"""What a query returns and what stats() reports."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from hmem.config import StoreConfig
from hmem.store import policy


@dataclasses.dataclass(frozen=True)
class QueryResult:
    """One retrieved entry.

    ``score`` ranks the results: the token-level max-sim when the query
    re-ranked by tokens (``token_score``), else the cosine of the pooled keys
    when it re-ranked its shortlist, else the signature similarity.  ``keys`` and
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
    token_score: float | None = None  # token-level max-sim, when re-ranked by tokens


class SkippedEntry(NamedTuple):
    """A result a query with ``on_damage="skip"`` left out: the entry, the
    shard file that holds its tensors, and what is wrong (the message the
    query would have raised as CorruptStoreError)."""

    entry_id: int
    shard: str
    reason: str


class QueryResults(list[QueryResult]):
    """What ``Store.query`` returns: the results, best first (a list), in
    ``skipped`` the damaged entries left out (always empty unless the query
    was made with ``on_damage="skip"``), in the order they were found, and
    in ``search`` how the layer was searched: "full", "two-stage" or
    "spans" (what "auto" chose)."""

    def __init__(self, results: Any = (), skipped: Any = (), search: str = "full") -> None:
        super().__init__(results)
        self.skipped: tuple[SkippedEntry, ...] = tuple(skipped)
        self.search = search

    def __repr__(self) -> str:
        return f"QueryResults({list.__repr__(self)}, skipped={self.skipped!r}, search={self.search!r})"


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
    score: float  # the eviction score, importance x (1 + ln(1 + access_count)) (hmem/store/policy.py)

    @classmethod
    def from_record(cls, row: Any, size: int) -> EntryInfo:
        """The info of a record of entries.bin (hmem/formats/records.py)."""
        return cls(
            entry_id=int(row["entry_id"]),
            layer_idx=int(row["layer_idx"]),
            n_tokens=int(row["n_tokens"]),
            importance=float(row["importance"]),
            access_count=int(row["access_count"]),
            created=int(row["timestamp"]),
            shard_idx=int(row["shard_idx"]),
            bytes=size,
            score=float(policy.scores(np.asarray(row["importance"]), np.asarray(row["access_count"]))),
        )


@dataclasses.dataclass(frozen=True)
class StoreChunkInfo:
    """One live chunk of a store of chunks (``Store.chunks.listing``)."""

    key: str
    entry_ids: tuple[int, ...]  # its parts', in part order (consecutive)
    layers: tuple[int, ...]  # each part's layer
    n_tokens: int  # of its first part
    bytes: int  # what its parts take in their shards
    created: int  # nanoseconds since the Unix epoch, when it was put
    access_count: int  # of all its parts

    @property
    def parts(self) -> int:
        return len(self.entry_ids)


@dataclasses.dataclass(frozen=True)
class StoredEntry:
    """One entry read back by id (``Store.get``): its metadata and its K/V,
    [n_tokens, embed_dim] float32 read-only arrays, bit-exact as put (INT8
    stores give the dequantized rows)."""

    info: EntryInfo
    keys: np.ndarray
    values: np.ndarray
    meta: dict[str, Any] | None = None  # what was put with it (e.g. source file, chunk, token range)

    @property
    def entry_id(self) -> int:
        return self.info.entry_id


@dataclasses.dataclass(frozen=True)
class StoredKV:
    """One entry's keys and values exactly as its shard holds them, not
    decoded (``Store.stored_kv``; docs/format.md, "Storage dtypes").

    ``dtype`` is their safetensors dtype: "F32" (float32), "F16" (float16),
    "BF16" (the raw bfloat16 words, as uint16: numpy has no bfloat16) or
    "I8" (int8, with float32 ``key_scales`` and ``value_scales``, one per
    row: row t reads back as ``keys[t] * key_scales[t]``).  The arrays are
    read-only, [n_tokens, embed_dim] (scales [n_tokens])."""

    info: EntryInfo
    storage_dtype: str  # the store's StoreConfig.storage_dtype: f32, f16, bf16 or int8
    dtype: str
    keys: np.ndarray
    values: np.ndarray
    key_scales: np.ndarray | None  # int8 stores only
    value_scales: np.ndarray | None
    meta: dict[str, Any] | None = None

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
class StoreHealth:
    """What ``Store.stats()`` finds from the file sizes alone, reading no
    tensor: every shard file present with the size the store recorded,
    entries.bin holding at least the committed records.  A shard that is
    missing or of the wrong size cannot be read at all, so its live entries
    are ``unreachable``: a query raises CorruptStoreError on them, or skips
    them with ``on_damage="skip"``.  ``ok`` says nothing about a flipped
    bit inside a file: ``hmem.verify(path, full=True)`` reads every tensor."""

    ok: bool
    problems: tuple[str, ...]  # one sentence per problem, naming the file
    advice: str  # what to do (an errors.Hint), "" when ok
    missing_shards: tuple[str, ...]  # shard files that are not there
    wrong_size_shards: tuple[str, ...]  # shard files whose size is not the recorded one
    unreachable_entries: int  # live entries in those shards
    entries_file_problem: str  # entries.bin missing or short of the committed records; "" when sound
    stale_index: str = ""  # why index.json is older than the store's files (verify's error too); "" when not


@dataclasses.dataclass(frozen=True)
class LimitActivity:
    """What keeping max_entries and max_disk_bytes did since the store was
    opened: puts evict the lowest-scored entries, and compact past
    max_disk_bytes (docs/format.md, "Eviction")."""

    evicted: int = 0  # entries evicted to make room
    compactions: int = 0  # compactions run to free their bytes
    bytes_rewritten: int = 0  # live bytes those compactions copied into new files
    bytes_freed: int = 0  # bytes those compactions freed


@dataclasses.dataclass(frozen=True)
class RemoteStats:
    """A store on object storage, as this Store object sees it."""

    url: str
    endpoint: str
    generation: int  # of manifest.json (each commit, and each writer's fencing, adds one)
    state_objects: int  # state objects the manifest lists (a snapshot and the changes since)
    object_bytes: int  # bytes of the objects the manifest names
    requests: int  # requests this Store object made: gets + puts + deletes + lists
    gets: int
    puts: int
    deletes: int
    lists: int
    bytes_fetched: int
    bytes_sent: int
    cached_shard_bytes: int  # shard bytes fetched and kept in the local cache
    cache_dir: str  # this Store object's working copy


@dataclasses.dataclass(frozen=True)
class StoreStats:
    path: str
    format_version: int
    generation: int
    config: StoreConfig
    entries: int  # live entries
    evicted: int  # records of evicted or deleted entries still in entries.bin (dropped by compact)
    unflushed: int  # entries put since the last flush
    layers: dict[int, int]  # live entries per layer
    shards: list[ShardStats]
    bytes_on_disk: int  # every file in the store directory
    live_bytes: int  # tensor bytes of the live entries
    reclaimable_bytes: int  # every evicted byte and orphan file: what compact(min_dead_share=0) would free now
    orphan_files: list[str]  # leftovers hmem made and no commit names (compact removes them)
    foreign_files: list[str]  # files hmem did not make (never touched)
    total_accesses: int  # sum of access counts
    next_entry_id: int
    kernels: str
    health: StoreHealth  # the cheap file check (no tensor read)
    limits: LimitActivity = LimitActivity()  # evictions and compactions of puts, since the store was opened
    remote: RemoteStats | None = None  # a store on object storage (hmem/store/object_link.py)

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
class DeletePlan:
    """What delete(entry_ids) removes (or removed)."""

    entry_ids: tuple[int, ...]  # the live entries among those asked for, ascending
    missing: tuple[int, ...]  # ids asked for that name no live entry, ascending
    bytes_reclaimable: int  # freed by the next compaction

    @property
    def count(self) -> int:
        return len(self.entry_ids)


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
    evicted_records: int  # records of evicted entries in entries.bin
    orphan_files: tuple[str, ...]
    needed: bool  # False: nothing to free (or nothing past the dead share)
    rewrite_bytes: int = 0  # live bytes compaction would copy to free reclaimable_bytes
    dead_bytes_left: int = 0  # evicted bytes it leaves where they are (their shard below the dead share)
    removed_at_open_files: int = 0  # leftovers this Store's open removed (an interrupted writer's files)
    removed_at_open_bytes: int = 0

    def with_orphan_objects(self, orphans: dict[str, int]) -> CompactionPlan:
        """The plan with the objects beside a store on object storage that no
        commit names (name: bytes), which compact() removes too."""
        if not orphans:
            return self
        extra = sum(orphans.values())
        reclaimable, before = self.reclaimable_bytes + extra, self.bytes_before + extra
        return dataclasses.replace(
            self,
            orphan_files=self.orphan_files + tuple(orphans),
            needed=True,
            bytes_before=before,
            bytes_after_estimate=before - reclaimable,
            reclaimable_bytes=reclaimable,
            reclaimable_share=reclaimable / before,
        )


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
    bytes_rewritten: int = 0  # live bytes copied into new files (shards, records) to free bytes_freed
    orphan_bytes_removed: int = 0  # of bytes_freed, the orphan files'
    removed_at_open_files: int = 0  # leftovers this Store's open removed, before the compaction
    removed_at_open_bytes: int = 0

    def with_orphan_objects(self, removed: dict[str, int]) -> CompactionReport:
        """The report with the orphan objects compact() then removed beside a
        store on object storage (name: bytes)."""
        if not removed:
            return self
        freed = sum(removed.values())
        return dataclasses.replace(
            self,
            performed=True,
            orphans_removed=self.orphans_removed + len(removed),
            bytes_before=self.bytes_before + freed,
            bytes_freed=self.bytes_freed + freed,
            reason=self.reason if self.performed else "removed orphan objects",
        )
