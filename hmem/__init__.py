"""hmem: persistent, exact K/V memory on disk for LLM inference.

The public names of the library; everything else is internal.
"""

from hmem._version import __version__
from hmem.prefix_hit.bitmap import Bitmap
from hmem.config import StoreConfig
from hmem.errors import (
    CorruptStoreError,
    EntryTooLargeError,
    HmemError,
    InvalidArgumentError,
    InvalidTensorError,
    KernelUnavailableError,
    NotAStoreError,
    ReadOnlyStoreError,
    StoreChangedError,
    StoreClosedError,
    StoreExistsError,
    StoreLockedError,
    UnsupportedFormatError,
)
from hmem.prefix_hit.operators import (
    FULL_ATTENTION_WINDOW,
    GroupHit,
    Layout,
    PrefixHitReport,
    TrimPolicy,
    chunks_present,
    explain_prefix_hit,
    fold,
    fold_unfold,
    fold_unfold_ranked,
    group_rows,
    highest_set_bit,
    merge_bitmaps,
    presence_bits,
    presence_map,
    select_retained,
    unfold,
    unfold_range,
)
from hmem.store.bridge import AugmentedKV, Segment
from hmem.recovery.repair import RepairReport, repair
from hmem.store.results import CompactionPlan, CompactionReport, EvictionPlan, QueryResult, ShardStats, StoreStats
from hmem.store.store import Entry, Store
from hmem.recovery.verify import Finding, VerifyReport, verify

__all__ = [
    "AugmentedKV",
    "CompactionPlan",
    "CompactionReport",
    "EvictionPlan",
    "Finding",
    "RepairReport",
    "Segment",
    "VerifyReport",
    "repair",
    "verify",
    "CorruptStoreError",
    "Entry",
    "EntryTooLargeError",
    "InvalidTensorError",
    "NotAStoreError",
    "QueryResult",
    "ReadOnlyStoreError",
    "ShardStats",
    "Store",
    "StoreChangedError",
    "StoreClosedError",
    "StoreConfig",
    "StoreExistsError",
    "StoreLockedError",
    "StoreStats",
    "UnsupportedFormatError",
    "FULL_ATTENTION_WINDOW",
    "Bitmap",
    "GroupHit",
    "HmemError",
    "InvalidArgumentError",
    "KernelUnavailableError",
    "Layout",
    "PrefixHitReport",
    "TrimPolicy",
    "__version__",
    "chunks_present",
    "explain_prefix_hit",
    "fold",
    "fold_unfold",
    "fold_unfold_ranked",
    "group_rows",
    "highest_set_bit",
    "merge_bitmaps",
    "presence_bits",
    "presence_map",
    "select_retained",
    "unfold",
    "unfold_range",
]
