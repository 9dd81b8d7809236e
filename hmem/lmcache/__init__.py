"""LMCache's caches, administered by hmem from their files alone (LMCache
is never imported), and an hmem store as LMCache's durable tier
(`ChunkTier`; LMCache's plugin is hmem.lmcache.connector, which LMCache
imports): docs/lmcache.md."""

from hmem.formats.lmcache import LMCACHE_VERSION
from hmem.lmcache.cache import (
    CacheDirectory,
    CacheStats,
    ChunkInfo,
    GroupStats,
    directory_kind,
    is_cache,
    open_cache,
)
from hmem.lmcache.checks import CacheVerifyReport, Finding
from hmem.lmcache.chunk_table import CHUNK_SORTS, chunk_dicts, chunk_json_lines, sort_rows
from hmem.lmcache.chunk_values import as_float32, non_finite_count, value_sample
from hmem.lmcache.cleaning import (
    CleanPlan,
    CleanReport,
    MountInfo,
    PlannedFile,
    SkippedFile,
    clean,
    plan_clean,
    unreachable_files,
)
from hmem.lmcache.exporting import (
    SAFETENSORS_LAYOUTS,
    ExportedChunk,
    FsExportReport,
    SafetensorsExport,
    export_fs_cache,
    export_safetensors,
)
from hmem.lmcache.geometry import KVShape, kv_shape_of_model, parse_kv_shape
from hmem.lmcache.hit_explanation import (
    CELL_MEANINGS,
    HASH_ALGORITHMS,
    Deployment,
    NearMiss,
    Request,
    RequestHit,
    explain,
    none_hash_of_seed,
    parse_requests,
    read_requests,
)
from hmem.lmcache.importing import CacheImportReport, ChunkImport, import_cache
from hmem.lmcache.tier import ChunkRead, ChunkTier, TierSettings, TierStats

__all__ = [
    "ChunkRead",
    "ChunkTier",
    "TierSettings",
    "TierStats",
    "CELL_MEANINGS",
    "CHUNK_SORTS",
    "LMCACHE_VERSION",
    "HASH_ALGORITHMS",
    "Deployment",
    "NearMiss",
    "Request",
    "RequestHit",
    "explain",
    "none_hash_of_seed",
    "parse_requests",
    "read_requests",
    "SAFETENSORS_LAYOUTS",
    "CacheDirectory",
    "CacheImportReport",
    "CacheStats",
    "CacheVerifyReport",
    "ChunkImport",
    "ChunkInfo",
    "CleanPlan",
    "CleanReport",
    "ExportedChunk",
    "Finding",
    "FsExportReport",
    "GroupStats",
    "KVShape",
    "MountInfo",
    "PlannedFile",
    "SafetensorsExport",
    "SkippedFile",
    "as_float32",
    "chunk_dicts",
    "chunk_json_lines",
    "clean",
    "export_fs_cache",
    "export_safetensors",
    "import_cache",
    "directory_kind",
    "is_cache",
    "kv_shape_of_model",
    "non_finite_count",
    "open_cache",
    "parse_kv_shape",
    "plan_clean",
    "sort_rows",
    "unreachable_files",
    "value_sample",
]
