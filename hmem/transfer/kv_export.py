"""K/V safetensors files out of hmem: the export of query results
(`hmem query --export`, docs/cli.md), of chosen entries exactly as stored
(`hmem export`), and standard safetensors files of numpy arrays
(`write_kv_file`), all written atomically.  Reading such files back is
hmem/transfer/kv_import.py."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hmem import _io, validation
from hmem.config import STORAGE_DTYPES
from hmem.errors import EntryNotFoundError, InvalidArgumentError
from hmem.formats import safetensors
from hmem.store import kv_layouts

if TYPE_CHECKING:
    from hmem.store.store import Store

__all__ = ["EXPORT_LAYOUTS", "check_export_path", "export_entries", "export_results", "write_kv_file"]


def _write(path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None) -> int:
    """Write C-contiguous arrays of safetensors dtypes, back to back in the
    order given, atomically; returns the file size."""
    return _write_typed(path, [(name, safetensors.DTYPE_NAMES[a.dtype], a) for name, a in tensors.items()], metadata)


def _write_typed(path: Path, tensors: list[tuple[str, str, np.ndarray]], metadata: Mapping[str, str] | None) -> int:
    """Write C-contiguous arrays, each under the safetensors dtype name given
    (BF16 for the uint16 words of bfloat16), atomically; returns the size."""
    header = safetensors.encode(((name, dtype, a.shape, a.nbytes) for name, dtype, a in tensors), metadata)
    return _io.write_file(Path(path), [header, *(safetensors.bytes_view(a) for _, _, a in tensors)])


def write_kv_file(
    path: str | Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> int:
    """Write `tensors` (name -> numpy array of float32, float16, float64,
    int8, int64 or another dtype safetensors names) to a standard
    safetensors file, in the order given, with `metadata` (strings) as its
    ``__metadata__``.  Written atomically: a reader sees the old file or the
    whole new one.  Returns the file size."""
    arrays: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        if not isinstance(name, str) or name == safetensors.METADATA:
            raise InvalidArgumentError(
                f"tensor names must be strings other than {safetensors.METADATA!r}, got {name!r}"
            )
        array = np.asarray(value)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        if array.dtype not in safetensors.DTYPE_NAMES:
            raise InvalidArgumentError(
                f"tensor {name!r} is {array.dtype}, which a safetensors file cannot hold",
                hint="give float32, float16, float64 or integer arrays",
            )
        arrays[name] = np.ascontiguousarray(array)
    if metadata is not None:
        for key, text in metadata.items():
            if not (isinstance(key, str) and isinstance(text, str)):
                raise InvalidArgumentError(f"metadata must map strings to strings, got {key!r}: {text!r}")
    return _write(Path(path), arrays, metadata)


def check_export_path(path: str | Path, store: str | os.PathLike[str] | None = None) -> None:
    """Raise PathError when `path` cannot take an export: its directory is
    missing (or is a file), or `path` is a directory; and
    InvalidArgumentError when it is empty or lies inside the store
    directory `store` (a local store's path; a URL names no directory),
    whose files only the store writes: an export there would replace a
    shard, index.json or entries.bin.  Paths are compared resolved, so a
    link to the store's directory is inside it too.  Every export (``hmem
    export``, ``hmem query --export``) checks here, before anything is
    written (docs/reliability.md, "OS errors")."""
    path = Path(validation.path_text(path, "the export path"))
    if store is not None and not _is_url(store):
        root = Path(store).resolve()
        target = path.resolve()
        if target == root or root in target.parents:
            raise InvalidArgumentError(
                f"{path} is inside the store at {store}: an export never writes there",
                hint="write it outside the store directory",
            )
    validation.file_to_write(path, "the export path")


def _is_url(store: str | os.PathLike[str]) -> bool:
    return "://" in os.fspath(store)


EXPORT_LAYOUTS = ("entries", "hf")


def export_results(
    results: Iterable[Any],
    path: str | Path,
    metadata: dict[str, str] | None = None,
    *,
    layout: str = "entries",
    kv_heads: int | None = None,
    storage_dtype: str | None = None,
    store: str | os.PathLike[str] | None = None,
) -> int:
    """Write query results to a safetensors file, in `layout`:

    - "entries" (the default): ``k_{id}`` and ``v_{id}`` [n_tokens,
      embed_dim] F32 per result;
    - "hf": the model's layout, ``past_key_values.{i}.key`` / ``.value``
      [1, kv_heads, tokens, head_dim] F32 (bhtd) for each layer i among the
      results, the rows of that layer's results concatenated along tokens
      in rank order (`kv_heads` required: embed_dim = kv_heads x head_dim).
      `hmem put` reads the file back as one entry per layer.

    The rows are F32 as the store reads them back: the stored values of
    an f32, f16 or bf16 store (widened without loss), the dequantized rows
    (int8 x row scale) of an int8 store; ``export_entries`` writes an
    entry as stored.  Given the store's `storage_dtype`, ``__metadata__``
    names it, and says ``"dequantized": "true"`` for int8.

    ``__metadata__`` holds the entry ids and scores in rank order (JSON
    lists), the layout (and kv_heads and each entry's token count with
    "hf"), plus `metadata`.  Written atomically; returns the file size.  A
    missing directory or a directory as `path` is a PathError, a bad layout
    or kv_heads an InvalidArgumentError, before anything is written; so is
    a path inside `store`, the directory of the store the results came
    from (check_export_path)."""
    check_export_path(path, store)
    validation.choice(layout, "layout", EXPORT_LAYOUTS)
    if layout == "hf" and kv_heads is None:
        raise InvalidArgumentError("the hf export layout needs kv_heads, the number of K/V heads")
    if layout != "hf" and kv_heads is not None:
        raise InvalidArgumentError("kv_heads applies to the hf export layout only")
    results = list(results)
    stored = (
        {}
        if storage_dtype is None
        else {"storage_dtype": validation.choice(storage_dtype, "storage_dtype", STORAGE_DTYPES)}
    )
    if storage_dtype == "int8":
        stored["dequantized"] = "true"
    meta = {
        "format": "hmem-export",
        "layout": layout,
        "entry_ids": json.dumps([r.entry_id for r in results]),
        "scores": json.dumps([r.score for r in results]),
        **stored,
        **(metadata or {}),
    }
    tensors: dict[str, np.ndarray] = {}
    if layout == "entries":
        for r in results:
            for kind, array in (("k", r.keys), ("v", r.values)):
                tensors[f"{kind}_{r.entry_id}"] = np.ascontiguousarray(np.asarray(array), dtype=np.float32)
        return _write(Path(path), tensors, meta)
    heads = validation.integer(kv_heads, "kv_heads", low=1)
    by_layer: dict[int, list[Any]] = {}
    for r in results:
        by_layer.setdefault(int(r.layer_idx), []).append(r)
    for layer in sorted(by_layer):
        for side, kind in (("keys", "key"), ("values", "value")):
            rows = np.concatenate([np.asarray(getattr(r, side), dtype=np.float32) for r in by_layer[layer]])
            if rows.shape[1] % heads:
                raise InvalidArgumentError(
                    f"rows of {rows.shape[1]} values do not split into kv_heads={heads} heads of equal size"
                )
            tensors[f"past_key_values.{layer}.{kind}"] = np.ascontiguousarray(kv_layouts.to_heads(rows, heads)[None])
    meta.update(kv_heads=str(heads), entry_tokens=json.dumps([int(np.shape(r.keys)[0]) for r in results]))
    return _write(Path(path), tensors, meta)


def export_entries(
    store: Store, entry_ids: Iterable[int], path: str | Path, metadata: Mapping[str, str] | None = None
) -> int:
    """Write the K/V of entries of `store` to a safetensors file exactly as
    the store holds them (``Store.stored_kv``), in the order given
    (repeated ids once):

    - ``k_{id}`` and ``v_{id}``, [n_tokens, embed_dim], in the store's
      storage dtype: F32, F16 or BF16 (bit-exact), or I8 in an int8 store;
    - int8 stores also ``k_scale_{id}`` and ``v_scale_{id}``, [n_tokens]
      F32: row t is ``k_{id}[t] * k_scale_{id}[t]``.

    ``__metadata__`` holds ``format`` "hmem-export", ``layout`` "entries",
    ``storage_dtype``, ``entry_ids`` and ``layers`` (JSON lists in file
    order), ``meta`` (each entry's meta, a JSON list), plus `metadata`;
    when every entry has the same layer (importance), ``layer``
    (``importance``) too, so that ``hmem put`` stores an F32, F16 or BF16
    export back as the same entries (the numbered convention k_{n}/v_{n}).
    An INT8 export does not import back: its K/V are integers.

    Checked before anything is written: the path (PathError, as
    check_export_path; InvalidArgumentError inside the store's directory,
    whose files only the store writes), the ids (InvalidArgumentError), and that every id
    names a live entry (EntryNotFoundError naming each one that does not).
    Written atomically; returns the file size."""
    check_export_path(path, store.path)
    if isinstance(entry_ids, (str, bytes)):
        raise InvalidArgumentError(f"entry_ids must be an iterable of integers, got {type(entry_ids).__name__}")
    ids = list(dict.fromkeys(validation.integer(i, "entry id", low=0) for i in entry_ids))
    if not ids:
        raise InvalidArgumentError("give at least one entry id to export")
    found = []
    missing = []
    for entry_id in ids:
        try:
            found.append(store.stored_kv(entry_id))
        except EntryNotFoundError:
            missing.append(entry_id)
    if missing:
        names = ", ".join(map(str, sorted(missing)))
        raise EntryNotFoundError(
            f"the store at {store.path} holds no {'entry' if len(missing) == 1 else 'entries'} {names}",
            hint="list the live ids with Store.entry_ids()",
        )
    storage = store.config.storage_dtype
    meta = {
        "format": "hmem-export",
        "layout": "entries",
        "storage_dtype": storage,
        "entry_ids": json.dumps(ids),
        "layers": json.dumps([e.info.layer_idx for e in found]),
        "meta": json.dumps([e.meta for e in found]),
    }
    layers = {e.info.layer_idx for e in found}
    if len(layers) == 1:
        meta["layer"] = str(layers.pop())
    if storage == "int8":
        meta["scales"] = "k_scale_{id}, v_scale_{id}: F32, one per row; row t is k_{id}[t] * k_scale_{id}[t]"
    importances = {e.info.importance for e in found}
    if len(importances) == 1:
        meta["importance"] = repr(importances.pop())
    tensors: list[tuple[str, str, np.ndarray]] = []
    for e in found:
        tensors += [(f"k_{e.entry_id}", e.dtype, e.keys), (f"v_{e.entry_id}", e.dtype, e.values)]
        if e.key_scales is not None and e.value_scales is not None:
            tensors += [
                (f"k_scale_{e.entry_id}", "F32", e.key_scales),
                (f"v_scale_{e.entry_id}", "F32", e.value_scales),
            ]
    return _write_typed(
        Path(path), [(name, dtype, np.ascontiguousarray(a)) for name, dtype, a in tensors], {**meta, **(metadata or {})}
    )
