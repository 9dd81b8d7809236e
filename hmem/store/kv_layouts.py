"""Per-head K/V layouts into the rows hmem stores, and back.

A store's entry is a matrix [tokens, embed_dim].  Models keep K/V per head;
hmem flattens the heads into the row, so a store's embed_dim is
kv_heads x head_dim (grouped-query attention included: only the K/V heads
are stored).  The layouts a tensor may come in (docs/cli.md, "Layouts"):

    td      [tokens, embed_dim]                        one entry
    thd     [tokens, kv_heads, head_dim]               flash-attention / paged
    htd     [kv_heads, tokens, head_dim]
    bhtd    [batch, kv_heads, tokens, head_dim]        a transformers cache layer
    bthd    [batch, tokens, kv_heads, head_dim]
    l2thd   [layers, 2, tokens, kv_heads, head_dim]    every layer's keys and values

Batch > 1: each batch row becomes its own entry.  A long sequence may be cut
into chunks of `chunk_tokens` consecutive tokens, one entry each, as prefix
caches cut requests (the last chunk may be shorter).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from hmem import validation
from hmem.errors import InvalidTensorError
from hmem.store.storage import widen

LAYOUTS = ("td", "thd", "htd", "bhtd", "bthd", "l2thd")
RANKS = {"td": 2, "thd": 3, "htd": 3, "bhtd": 4, "bthd": 4, "l2thd": 5}
SHAPES = {
    "td": "[tokens, embed_dim]",
    "thd": "[tokens, kv_heads, head_dim]",
    "htd": "[kv_heads, tokens, head_dim]",
    "bhtd": "[batch, kv_heads, tokens, head_dim]",
    "bthd": "[batch, tokens, kv_heads, head_dim]",
    "l2thd": "[layers, 2, tokens, kv_heads, head_dim]",
}


class Chunk(NamedTuple):
    """Rows of one entry cut from a tensor: batch row, chunk number, token range."""

    batch: int
    chunk: int
    start: int
    stop: int
    view: np.ndarray  # token-major: ``matrix`` makes the rows a store takes


def token_major(array: np.ndarray, layout: str, what: str) -> list[np.ndarray]:
    """Views of a per-head tensor with the token axis first, one per batch
    row ("td", "thd", "htd" have one): [tokens, embed_dim] or [tokens,
    kv_heads, head_dim].  Nothing is copied: ``matrix`` makes each chunk's
    matrix, so that a long tensor is never transposed whole at once."""
    validation.choice(layout, "layout", LAYOUTS)
    if layout == "l2thd":
        raise InvalidTensorError(f"{what}: l2thd holds keys and values together; split it with split_l2thd")
    if array.ndim != RANKS[layout]:
        raise InvalidTensorError(
            f"{what} has shape {list(array.shape)}, which is not layout {layout} ({RANKS[layout]} dimensions)"
        )
    if layout in ("td", "thd"):
        return [array]
    if layout == "htd":
        return [array.transpose(1, 0, 2)]
    if layout == "bthd":
        return list(array)
    return [row.transpose(1, 0, 2) for row in array]  # bhtd


def matrix(view: np.ndarray, *, bf16_words: bool = False) -> np.ndarray:
    """A token-major view (or a chunk of one) as the float32 matrix
    [tokens, width] a store takes: the view itself when it already is one,
    else one copy that transposes and converts in the same pass.  With
    `bf16_words`, the view holds bfloat16 bit patterns (uint16), which
    become float32 exactly (a bfloat16 is the top half of a float32).
    Arrays of other dtypes than floats keep theirs."""
    width = math.prod(view.shape[1:])
    if not bf16_words and (view.dtype == np.float32 or view.dtype.kind != "f"):
        # float32 already, or not floats (kept as they are, for the put to refuse by dtype)
        return np.ascontiguousarray(view).reshape(view.shape[0], width)
    if bf16_words:
        return widen(view)
    out = np.empty((view.shape[0], width), dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # float64 overflow becomes inf, which a put refuses
        np.copyto(out.reshape(view.shape), view, casting="unsafe")
    return out


def row_width(shape: tuple[int, ...] | list[int], layout: str) -> int:
    """How many values a row holds when a tensor of `shape` is read as `layout`."""
    if layout == "td":
        return int(shape[1])
    if layout in ("htd", "thd"):
        return int(shape[1 if layout == "thd" else 0]) * int(shape[2])
    if layout in ("bhtd", "bthd"):
        return int(shape[1 if layout == "bhtd" else 2]) * int(shape[3])
    return int(shape[3]) * int(shape[4])  # l2thd


def fitting(shape: tuple[int, ...] | list[int], embed_dim: int) -> tuple[str, ...]:
    """The layouts of a tensor's rank under which its rows hold `embed_dim`
    values: for [a, b, c], thd when b*c == embed_dim and htd when
    a*c == embed_dim (both when a == b: heads as many as tokens); 4-D
    likewise bhtd and bthd; 5-D l2thd when shape[1] == 2."""
    rank = len(shape)
    if rank == 5 and shape[1] != 2:
        return ()
    return tuple(name for name in LAYOUTS if RANKS[name] == rank and row_width(shape, name) == embed_dim)


def split_l2thd(array: np.ndarray, what: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(keys, values) token-major views [tokens, kv_heads, head_dim] of every
    layer of an l2thd tensor (``matrix`` makes their matrices)."""
    if array.ndim != 5 or array.shape[1] != 2:
        raise InvalidTensorError(
            f"{what} has shape {list(array.shape)}, which is not layout l2thd [layers, 2, tokens, kv_heads, head_dim]"
        )
    return [(layer[0], layer[1]) for layer in array]


def chunks(view: np.ndarray, chunk_tokens: int | None, batch: int = 0) -> Iterator[Chunk]:
    """A token-major view cut into consecutive chunks of `chunk_tokens`
    tokens (None: one chunk); each chunk is a view too."""
    total = view.shape[0]
    step = total if chunk_tokens is None else validation.integer(chunk_tokens, "chunk_tokens", low=1)
    for number, start in enumerate(range(0, max(total, 1), max(step, 1))):
        stop = min(start + step, total)
        yield Chunk(batch, number, start, stop, view[start:stop])


def to_heads(rows: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """[tokens, heads x head_dim] rows back to [heads, tokens, head_dim]."""
    heads = validation.integer(num_kv_heads, "num_kv_heads", low=1)
    if rows.shape[1] % heads:
        raise InvalidTensorError(f"rows of {rows.shape[1]} values do not split into {heads} heads")
    return rows.reshape(rows.shape[0], heads, -1).transpose(1, 0, 2)


class HeldKV(NamedTuple):
    """What one layer of a model's cache holds: keys and values of [batch,
    kv_heads, tokens, head_dim], token `start` of the sequence first."""

    keys: Any
    values: Any
    start: int = 0


def layer_pairs(cache: Any) -> list[HeldKV | None]:
    """What each layer of a transformers cache holds: a DynamicCache
    (``.layers[i].keys``/``.values``, or the older ``key_cache``/``value_cache``
    lists) or the legacy tuple of per-layer (key, value) pairs.

    None for a layer that holds no K/V: the linear-attention (mamba) layers
    of a hybrid model keep conv and recurrent states instead, and a layer
    not filled yet holds nothing.  A sliding-window layer (transformers'
    DynamicSlidingWindowLayer) holds only the sequence's last tokens and
    counts them all in ``cumulative_length``: its `start` is how many it
    dropped."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [
            _held(
                getattr(layer, "keys", None), getattr(layer, "values", None), getattr(layer, "cumulative_length", None)
            )
            for layer in layers
        ]
    if hasattr(cache, "key_cache") and hasattr(cache, "value_cache"):
        return [_held(k, v, None) for k, v in zip(cache.key_cache, cache.value_cache)]
    try:
        pairs = [tuple(layer) for layer in cache]
    except TypeError:
        raise InvalidTensorError(
            f"expected a transformers cache or a tuple of (key, value) pairs, got {type(cache).__name__}"
        ) from None
    if not all(len(pair) >= 2 for pair in pairs):
        raise InvalidTensorError("each layer of a legacy cache must be a (key, value) pair")
    return [HeldKV(pair[0], pair[1]) for pair in pairs]


def _held(keys: Any, values: Any, seen: Any) -> HeldKV | None:
    if keys is None or values is None:
        return None
    shape = tuple(getattr(keys, "shape", ()))
    if len(shape) < 4 and 0 in shape:
        return None  # the empty placeholder older hybrid caches keep for a mamba layer
    held = int(shape[-2]) if len(shape) >= 2 else 0
    start = int(seen) - held if isinstance(seen, int) and not isinstance(seen, bool) and seen > held else 0
    return HeldKV(keys, values, start)
