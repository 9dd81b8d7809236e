"""What a put is given, checked and converted before anything is stored
(hmem/store/writer.py stores it): keys and values as float32 rows of the
store's width, the layer and importance in range, the signature and pooled
key computed, the rows encoded in the storage dtype (overflow refused) and
the metadata as bounded JSON.  A batch is checked whole first, so one bad
entry stores nothing."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np

from hmem import validation
from hmem.errors import InvalidArgumentError, InvalidTensorError
from hmem.formats import shard_file
from hmem.store import storage as storage_codec
from hmem.store.state import StoreState
from hmem.store.tensors import as_rows


class Entry(NamedTuple):
    """One put of a batch (``Store.put_many``)."""

    keys: Any
    values: Any
    layer_idx: int = 0
    importance: float = 1.0
    meta: Mapping[str, Any] | None = None  # a small JSON object kept with the entry (source, chunk, tokens)


@dataclasses.dataclass
class PreparedEntry:
    """A checked put, ready to be stored.  It keeps only what goes into the
    shard, not the float32 rows it came from: a large put_many of a
    narrower storage dtype holds each entry's rows only while preparing it."""

    n_tokens: int
    layer_idx: int
    importance: float
    signature: np.ndarray
    pooled: np.ndarray
    tensors: dict[str, np.ndarray]  # what goes into the shard, in the store's storage dtype
    meta: str | None = None  # the entry's metadata as JSON


def prepare_all(state: StoreState, entries: Iterable[Entry | tuple]) -> list[PreparedEntry]:
    """Every entry checked and converted; the first bad one raises, naming it."""
    prepared = []
    for i, item in enumerate(entries):
        try:
            entry = Entry(*item)
        except TypeError:
            raise InvalidArgumentError(
                f"entry {i}: expected (keys, values[, layer_idx[, importance]]), got {type(item).__name__}"
            ) from None
        try:
            prepared.append(prepare(state, *entry))
        except InvalidArgumentError as exc:
            raise type(exc)(f"entry {i}: {exc.message}", hint=exc.hint) from None
    return prepared

def prepare(state: StoreState, keys: Any, values: Any, layer_idx: Any, importance: Any,
            meta: Any = None) -> PreparedEntry:
    """One put checked and converted; bad input raises and changes nothing."""
    dim = state.config.embed_dim
    k = as_rows(keys, "keys", dim)  # the open shard copies them
    v = as_rows(values, "values", dim)
    if k.shape != v.shape:
        raise InvalidTensorError(f"keys {list(k.shape)} and values {list(v.shape)} differ in shape")
    if k.shape[0] > validation.U32_MAX:
        raise InvalidTensorError(f"an entry holds at most {validation.U32_MAX} tokens")
    layer = validation.layer_index(layer_idx)
    imp = validation.importance(importance)
    signature, mean = state.projector.signature_and_mean(k)
    pooled = mean.astype(np.float32)
    tensors = _entry_tensors(k, v, pooled, state.config.storage_dtype)
    return PreparedEntry(int(k.shape[0]), layer, imp, signature, pooled, tensors, _meta_json(meta))


def _meta_json(meta: Any) -> str | None:
    """An entry's metadata as compact JSON: an object of at most
    META_MAX_BYTES, its keys strings, its values numbers, strings, booleans,
    null or lists of those."""
    if meta is None:
        return None
    if not isinstance(meta, Mapping) or not all(isinstance(key, str) for key in meta):
        raise InvalidArgumentError(f"meta must be a mapping of strings, got {type(meta).__name__}")
    scalar = (str, int, float, bool, type(None))
    for key, value in meta.items():
        if not (isinstance(value, scalar) or isinstance(value, (list, tuple)) and all(isinstance(x, scalar) for x in value)):
            raise InvalidArgumentError(f"meta[{key!r}] must be a number, a string or a list of them, got {value!r}")
    try:
        text = json.dumps(dict(meta), sort_keys=True, separators=(",", ":"), allow_nan=False)
    except ValueError:
        raise InvalidArgumentError("meta must hold finite numbers") from None
    if len(text) > shard_file.META_MAX_BYTES:
        raise InvalidArgumentError(f"meta takes {len(text)} bytes as JSON; at most {shard_file.META_MAX_BYTES}")
    return text


def _entry_tensors(keys: np.ndarray, values: np.ndarray, pooled: np.ndarray, storage: str) -> dict[str, np.ndarray]:
    """An entry's shard tensors: keys and values in the storage dtype (with
    their INT8 scales), and the float32 pooled key."""
    tensors = {"p": pooled}
    for kind, rows, what in (("k", keys, "keys"), ("v", values, "values")):
        for suffix, array in storage_codec.encode(rows, storage, what).items():
            tensors[kind + suffix] = array
    return tensors
