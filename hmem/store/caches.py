"""A model's K/V cache into a store, and stored entries back into a cache
(README.md, "Real models' K/V").

``put_cache`` takes a transformers cache (a DynamicCache, or the legacy
tuple of per-layer (key, value) tensors of [batch, kv_heads, tokens,
head_dim]) and stores each layer's rows, heads flattened into the row
(hmem/store/kv_layouts.py), each batch row and each chunk of `chunk_tokens` as
its own entry, all in one batch: every entry goes in, or none does.  Layers
that hold no K/V (the mamba layers of a hybrid model) are left out.  An
entry's meta "tokens" is its range in the sequence: a sliding-window layer
holds only the last tokens, so its ranges end at the sequence's length.
A bfloat16 cache goes into the put as its tensors' 16-bit words
(storage.Bf16Rows): a bf16 store keeps them as they are, others widen them
entry by entry, and no float32 copy of the whole cache is made.

``cache_tensors`` turns entries read back (chunks of one sequence, in
order, per layer) into per-layer [1, kv_heads, tokens, head_dim] tensors
in the dtype and on the device the model's cache uses; torch is imported
only here, when asked for.  Stored F32, F16 and BF16 rows come back
bit-exact, so a cache rebuilt in the model's dtype equals the one stored.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hmem import validation
from hmem.errors import InvalidArgumentError, InvalidTensorError
from hmem.store import kv_layouts
from hmem.store.prepare import Entry
from hmem.store.storage import Bf16Rows
from hmem.store.tensors import bf16_words, to_numpy

if TYPE_CHECKING:
    from hmem.store.store import Store


def put_cache(
    store: Store,
    cache: Any,
    *,
    chunk_tokens: int | None = None,
    importance: float = 1.0,
    layers: Iterable[int] | None = None,
) -> dict[int, list[int]]:
    """Store a transformers cache (DynamicCache, or the legacy tuple of
    per-layer (key, value) [batch, kv_heads, tokens, head_dim]): each
    layer's batch rows, cut into chunks of `chunk_tokens` if given, heads
    flattened into the row (embed_dim = kv_heads x head_dim); layers
    without K/V (mamba) are left out, a sliding-window layer stores the
    tokens it holds.  All or nothing; returns the new ids per layer, in
    order (`hmem.cache_tensors` turns entries back).  Store.put_cache."""
    pairs = kv_layouts.layer_pairs(cache)
    held = [layer for layer, pair in enumerate(pairs) if pair is not None]
    chosen = held if layers is None else [validation.layer_index(x, "layers") for x in layers]
    for layer in chosen:
        if layer >= len(pairs):
            raise InvalidArgumentError(f"layers names layer {layer}; the cache has {len(pairs)}")
        if pairs[layer] is None:
            raise InvalidArgumentError(
                f"layers names layer {layer}, which holds no K/V (a mamba or linear-attention layer keeps other state)"
            )
    entries: list[Entry] = []
    owners: list[int] = []
    for layer in chosen:
        pair = pairs[layer]
        assert pair is not None  # checked above
        key_words, value_words = bf16_words(pair[0]), bf16_words(pair[1])
        words = key_words is not None and value_words is not None  # bfloat16 both: put as their words
        if key_words is not None and value_words is not None:
            keys, values = key_words, value_words
        else:
            keys, values = (to_numpy(t, f"layer {layer} {what}") for t, what in zip(pair[:2], ("keys", "values")))
        if keys.shape != values.shape:
            raise InvalidTensorError(f"layer {layer}: keys {list(keys.shape)} and values {list(values.shape)} differ")
        key_views = kv_layouts.token_major(keys, "bhtd", f"layer {layer} keys")
        value_views = kv_layouts.token_major(values, "bhtd", f"layer {layer} values")
        for batch, (k, v) in enumerate(zip(key_views, value_views)):
            if not k.shape[0]:
                continue  # an empty layer (no tokens cached) stores nothing
            for ck, cv in zip(kv_layouts.chunks(k, chunk_tokens, batch), kv_layouts.chunks(v, chunk_tokens, batch)):
                meta = {"batch": batch, "chunk": ck.chunk, "tokens": [pair.start + ck.start, pair.start + ck.stop]}
                if words:
                    entries.append(Entry(Bf16Rows(ck.view), Bf16Rows(cv.view), layer, importance, meta))
                else:
                    k_rows, v_rows = kv_layouts.matrix(ck.view), kv_layouts.matrix(cv.view)
                    entries.append(Entry(k_rows, v_rows, layer, importance, meta))
                owners.append(layer)
    ids = store.put_many(entries)
    out: dict[int, list[int]] = {layer: [] for layer in chosen}
    for layer, entry_id in zip(owners, ids):
        out[layer].append(entry_id)
    return out


def cache_tensors(
    layers: Mapping[int, Sequence[Any]] | Sequence[Sequence[Any]],
    num_kv_heads: int,
    *,
    dtype: Any = None,
    device: Any = None,
    framework: str = "torch",
) -> list[tuple[Any, Any]]:
    """Per-layer (keys, values) of [1, kv_heads, tokens, head_dim] from each
    layer's entries (StoredEntry or QueryResult, or (keys, values) rows), in
    order; layers in ascending order when given as a mapping.  With torch,
    in `dtype` (e.g. torch.bfloat16; float32 when None) on `device`; with
    numpy, float32."""
    validation.choice(framework, "framework", ("torch", "numpy"))
    ordered = [layers[k] for k in sorted(layers)] if isinstance(layers, Mapping) else list(layers)
    out = []
    for number, entries in enumerate(ordered):
        parts = [_rows(entry) for entry in entries]
        if not parts:
            raise InvalidArgumentError(f"layer {number} has no entries to build a cache from")
        pair = []
        for side in (0, 1):
            rows = np.concatenate([p[side] for p in parts]) if len(parts) > 1 else np.asarray(parts[0][side])
            heads = kv_layouts.to_heads(np.asarray(rows, dtype=np.float32), num_kv_heads)[None]
            pair.append(_framework(np.ascontiguousarray(heads), framework, dtype, device))
        out.append((pair[0], pair[1]))
    return out


def _rows(entry: Any) -> tuple[np.ndarray, np.ndarray]:
    if hasattr(entry, "keys") and hasattr(entry, "values") and not isinstance(entry, (tuple, list, dict)):
        return to_numpy(entry.keys, "keys"), to_numpy(entry.values, "values")
    keys, values = entry
    return to_numpy(keys, "keys"), to_numpy(values, "values")


def _framework(array: np.ndarray, framework: str, dtype: Any, device: Any) -> Any:
    if framework == "numpy":
        return array
    import torch  # only here: torch is optional for hmem

    tensor = torch.from_numpy(array)
    return tensor.to(device=device or "cpu", dtype=dtype or torch.float32)
