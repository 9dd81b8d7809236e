"""hmem: persistent, exact K/V memory on disk for LLM inference.

The public names of the library; everything else is internal.
"""

from hmem._version import __version__
from hmem.bitmap import Bitmap
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
from hmem.prefix_hit import (
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
from hmem.results import QueryResult, ShardStats, StoreStats
from hmem.store import Entry, Store

__all__ = [
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
