"""hmem: persistent, exact K/V memory on disk for LLM inference.

The public names of the library; everything else is internal.  The names
of the prefix-hit operators, verify and repair, export and copy are
imported at their first use (``_LAZY``), as is the code of stores on
object storage: every ``hmem`` command starts by importing this package,
and most need none of them (docs/benchmarks.md, "Command start-up").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hmem._version import __version__
from hmem.config import StoreConfig
from hmem.errors import (
    AmbiguousLayoutError,
    CorruptStoreError,
    EntryNotFoundError,
    EntryTooLargeError,
    Hint,
    HmemError,
    InvalidArgumentError,
    InvalidTensorError,
    KernelUnavailableError,
    NoSpaceError,
    NotAStoreError,
    ObjectStoreError,
    PathError,
    PermissionDeniedError,
    ReadOnlyStoreError,
    StorageError,
    StoreChangedError,
    StoreClosedError,
    StoreExistsError,
    StoreLockedError,
    UnsafeFileError,
    UnsupportedFormatError,
)
from hmem.formats.manifest import FORMAT_VERSION
from hmem.formats.sources import ImportedSource
from hmem.kernels import describe as kernel_info
from hmem.object_store import is_url as is_store_url
from hmem.prefix_hit.bitmap import Bitmap
from hmem.store.caches import cache_tensors
from hmem.store.compaction import MIN_DEAD_SHARE
from hmem.store.kv_layouts import LAYOUTS
from hmem.store.listing import ENTRY_SORTS, EntryListing
from hmem.store.results import (
    CompactionPlan,
    CompactionReport,
    DeletePlan,
    EntryInfo,
    EvictionPlan,
    LimitActivity,
    QueryResult,
    QueryResults,
    RemoteStats,
    ShardStats,
    SkippedEntry,
    StoreChunkInfo,
    StoredEntry,
    StoredKV,
    StoreHealth,
    StoreStats,
)
from hmem.store.storage import Bf16Rows
from hmem.store.store import Entry, Store, is_store
from hmem.transfer.importing import FileResult, ImportReport, import_files
from hmem.transfer.kv_import import (
    BadFileError,
)
from hmem.transfer.kv_import import (
    find_files as find_kv_files,
)
from hmem.transfer.kv_import import (
    read_entries as read_kv_file,
)
from hmem.transfer.kv_import import (
    read_tensor as read_tensor_file,
)

# name -> (module, name there): imported when first asked for
_LAZY: dict[str, tuple[str, str]] = {
    **{name: ("hmem.prefix_hit.explain", name) for name in ("GroupHit", "PrefixHitReport", "explain_prefix_hit")},
    **{name: ("hmem.prefix_hit.grouped", name) for name in ("fold_grouped", "fold_unfold_grouped", "unfold_grouped")},
    **{
        name: ("hmem.prefix_hit.operators", name)
        for name in (
            "FULL_ATTENTION_WINDOW",
            "Layout",
            "TrimPolicy",
            "chunks_present",
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
        )
    },
    **{name: ("hmem.store.bridge", name) for name in ("AugmentedKV", "Segment")},
    **{name: ("hmem.recovery.checks", name) for name in ("repair", "verify")},
    "RepairReport": ("hmem.recovery.repair", "RepairReport"),
    **{name: ("hmem.recovery.verify", name) for name in ("Finding", "VerifyReport")},
    **{name: ("hmem.store.copying", name) for name in ("CopyReport", "copy_store")},
    **{
        name: ("hmem.transfer.kv_export", name)
        for name in ("EXPORT_LAYOUTS", "check_export_path", "export_entries", "export_results", "write_kv_file")
    },
    "OBJECT_FORMAT_VERSION": ("hmem.formats.objects", "FORMAT_VERSION"),
}


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'hmem' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # the next lookup finds it directly
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # what the names above are, for type checkers
    from hmem.formats.objects import FORMAT_VERSION as OBJECT_FORMAT_VERSION
    from hmem.prefix_hit.explain import GroupHit, PrefixHitReport, explain_prefix_hit
    from hmem.prefix_hit.grouped import fold_grouped, fold_unfold_grouped, unfold_grouped
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
    from hmem.recovery.checks import repair, verify
    from hmem.recovery.repair import RepairReport
    from hmem.recovery.verify import Finding, VerifyReport
    from hmem.store.bridge import AugmentedKV, Segment
    from hmem.store.copying import CopyReport, copy_store
    from hmem.transfer.kv_export import EXPORT_LAYOUTS, check_export_path, export_entries, export_results, write_kv_file

__all__ = [
    "BadFileError",
    "Bf16Rows",
    "StoreChunkInfo",
    "AmbiguousLayoutError",
    "EXPORT_LAYOUTS",
    "EntryInfo",
    "EntryNotFoundError",
    "FORMAT_VERSION",
    "FileResult",
    "ImportReport",
    "StoredEntry",
    "StoredKV",
    "ENTRY_SORTS",
    "EntryListing",
    "export_entries",
    "check_export_path",
    "export_results",
    "find_kv_files",
    "import_files",
    "is_store",
    "copy_store",
    "CopyReport",
    "is_store_url",
    "OBJECT_FORMAT_VERSION",
    "RemoteStats",
    "cache_tensors",
    "LAYOUTS",
    "kernel_info",
    "read_kv_file",
    "read_tensor_file",
    "AugmentedKV",
    "CompactionPlan",
    "MIN_DEAD_SHARE",
    "DeletePlan",
    "ImportedSource",
    "LimitActivity",
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
    "QueryResults",
    "SkippedEntry",
    "StoreHealth",
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
    "UnsafeFileError",
    "StorageError",
    "PermissionDeniedError",
    "NoSpaceError",
    "ObjectStoreError",
    "PathError",
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
    "fold_grouped",
    "fold_unfold_grouped",
    "unfold_grouped",
    "group_rows",
    "highest_set_bit",
    "merge_bitmaps",
    "presence_bits",
    "presence_map",
    "select_retained",
    "unfold",
    "unfold_range",
]
