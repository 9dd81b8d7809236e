"""Which a command's path is: an hmem store or an LMCache cache directory
(docs/lmcache.md).  Commands that take a store ask here first and hand an
LMCache cache to their LMCache view."""

from __future__ import annotations

from hmem.lmcache import CacheDirectory, KVShape, directory_kind, kv_shape_of_model, open_cache, parse_kv_shape


def kv_shape(kv_shape_text: str | None, model_config: str | None) -> KVShape | None:
    if kv_shape_text is not None:
        return parse_kv_shape(kv_shape_text)
    if model_config is not None:
        return kv_shape_of_model(model_config)
    return None


def cache_at(
    path: str, *, kv_shape_text: str | None = None, model_config: str | None = None, chunk_size: int = 256
) -> CacheDirectory | None:
    """The LMCache cache at `path`, or None when `path` is to be opened as
    a store (a URL, a store, a store that lost its index.json, no
    directory: the store's own checks say what is wrong).  A directory
    that is neither raises NotAStoreError saying so."""
    if not path or "://" in path or directory_kind(path) == "store":
        return None
    return open_cache(path, kv_shape=kv_shape(kv_shape_text, model_config), chunk_size=chunk_size)
