"""hmem: persistent, exact K/V memory on disk for LLM inference.

The public names of the library; everything else is internal.
"""

from hmem._version import __version__
from hmem.prefix_hit.bitmap import Bitmap
from hmem.config import StoreConfig
from hmem.errors import (
    CorruptStoreError,
    EntryNotFoundError,
    EntryTooLargeError,
    Hint,
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
from hmem.prefix_hit.explain import GroupHit, PrefixHitReport, explain_prefix_hit
from hmem.prefix_hit.operators import (
    FULL_ATTENTION_WINDOW,
    Layout,
    TrimPolicy,
    chunks_present,
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
from hmem.formats.manifest import FORMAT_VERSION
from hmem.kernels import describe as kernel_info
from hmem.store.results import (
    CompactionPlan,
    CompactionReport,
    EntryInfo,
    EvictionPlan,
    QueryResult,
    ShardStats,
    StoredEntry,
    StoreStats,
)
from hmem.store.store import Entry, Store, is_store
from hmem.transfer.kv_export import export_results, write_kv_file
from hmem.transfer.kv_import import (
    BadFileError,
    FileResult,
    ImportReport,
    find_files as find_kv_files,
    import_files,
    read_entries as read_kv_file,
    read_tensor as read_tensor_file,
)
from hmem.recovery.verify import Finding, VerifyReport, verify

__all__ = [
    "BadFileError",
    "EntryInfo",
    "EntryNotFoundError",
    "FORMAT_VERSION",
    "FileResult",
    "ImportReport",
    "StoredEntry",
    "export_results",
    "find_kv_files",
    "import_files",
    "is_store",
    "kernel_info",
    "read_kv_file",
    "read_tensor_file",
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
    "write_kv_file",
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
    "Hint",
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
