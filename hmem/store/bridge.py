"""The integration bridge (README.md, "The store"): retrieved K/V rows placed before a
sparse-attention cache, so attention sees both."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from hmem.errors import InvalidTensorError
from hmem.store.tensors import is_torch

if TYPE_CHECKING:
    from hmem.store.store import Store


@dataclasses.dataclass(frozen=True)
class Segment:
    """Rows [start, stop) of the merged K/V came from entry `entry_id`."""

    entry_id: int
    start: int
    stop: int
    score: float


@dataclasses.dataclass(frozen=True)
class AugmentedKV:
    """Merged keys and values: the retrieved entries' rows in rank order,
    then the cache rows (from row `cache_start` on)."""

    keys: Any
    values: Any
    segments: tuple[Segment, ...]
    cache_start: int


def _check_cache(cache_k: Any, cache_v: Any, embed_dim: int) -> None:
    for name, cache in (("cache_k", cache_k), ("cache_v", cache_v)):
        if not (isinstance(cache, np.ndarray) or is_torch(cache)):
            raise InvalidTensorError(f"{name} must be a numpy array or a torch tensor, got {type(cache).__name__}")
        shape = tuple(cache.shape)
        if len(shape) != 2 or shape[1] != embed_dim:
            raise InvalidTensorError(f"{name} must have shape [n_cache, {embed_dim}], got {list(shape)}")
    if tuple(cache_k.shape) != tuple(cache_v.shape):
        raise InvalidTensorError(f"cache_k {list(cache_k.shape)} and cache_v {list(cache_v.shape)} differ in shape")
    if is_torch(cache_k) != is_torch(cache_v):
        raise InvalidTensorError("cache_k and cache_v must both be numpy arrays or both torch tensors")


def augmented_kv(
    store: Store, query: Any, cache_k: Any, cache_v: Any, layer_idx: int, top_k: int = 5, **query_options: Any
) -> AugmentedKV:
    """Keys and values of the `top_k` retrieved entries (rank order)
    followed by the cache rows, and which rows came from which entry.
    numpy in, numpy out; torch in, torch out (the cache's dtype and
    device).  Nothing retrieved gives the cache back unchanged.
    Store.augmented_kv."""
    _check_cache(cache_k, cache_v, store.config.embed_dim)
    results = store.query(query, layer_idx, top_k, **query_options)
    if not results:
        return AugmentedKV(cache_k, cache_v, (), 0)
    segments, start = [], 0
    for r in results:
        segments.append(Segment(r.entry_id, start, start + r.n_tokens, r.score))
        start += r.n_tokens
    keys = [np.asarray(r.keys) for r in results]
    values = [np.asarray(r.values) for r in results]
    if is_torch(cache_k):
        import torch  # the caller's cache is a torch tensor

        def merge(parts: list[np.ndarray], cache: Any) -> Any:
            retrieved = torch.from_numpy(np.concatenate(parts)).to(device=cache.device, dtype=cache.dtype)
            return torch.cat([retrieved, cache])
    else:

        def merge(parts: list[np.ndarray], cache: Any) -> Any:
            return np.concatenate([*parts, cache]).astype(cache.dtype, copy=False)

    return AugmentedKV(merge(keys, cache_k), merge(values, cache_v), tuple(segments), start)
