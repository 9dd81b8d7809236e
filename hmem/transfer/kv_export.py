"""K/V safetensors files out of hmem: the export of query results
(`hmem query --export`, docs/cli.md) and standard safetensors files of
numpy arrays (`write_kv_file`), both written atomically.  Reading such
files back is hmem/transfer/kv_import.py."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hmem import _io, validation
from hmem.errors import InvalidArgumentError, storage_error
from hmem.formats import safetensors
from hmem.store import layouts

__all__ = ["EXPORT_LAYOUTS", "check_export_path", "export_results", "write_kv_file"]


def _write(path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None) -> int:
    """Write C-contiguous arrays of safetensors dtypes, back to back in the
    order given, atomically; returns the file size."""
    header = safetensors.encode(
        ((name, safetensors.DTYPE_NAMES[a.dtype], a.shape, a.nbytes) for name, a in tensors.items()), metadata)
    return _io.write_file(Path(path), [header, *(safetensors.bytes_view(a) for a in tensors.values())])


def write_kv_file(path: str | Path, tensors: Mapping[str, np.ndarray],
                  metadata: Mapping[str, str] | None = None) -> int:
    """Write `tensors` (name -> numpy array of float32, float16, float64,
    int8, int64 or another dtype safetensors names) to a standard
    safetensors file, in the order given, with `metadata` (strings) as its
    ``__metadata__``.  Written atomically: a reader sees the old file or the
    whole new one.  Returns the file size."""
    arrays: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        if not isinstance(name, str) or name == safetensors.METADATA:
            raise InvalidArgumentError(f"tensor names must be strings other than {safetensors.METADATA!r}, "
                                       f"got {name!r}")
        array = np.asarray(value)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        if array.dtype not in safetensors.DTYPE_NAMES:
            raise InvalidArgumentError(f"tensor {name!r} is {array.dtype}, which a safetensors file cannot hold",
                                       hint="give float32, float16, float64 or integer arrays")
        arrays[name] = np.ascontiguousarray(array)
    if metadata is not None:
        for key, text in metadata.items():
            if not (isinstance(key, str) and isinstance(text, str)):
                raise InvalidArgumentError(f"metadata must map strings to strings, got {key!r}: {text!r}")
    return _write(Path(path), arrays, metadata)


def check_export_path(path: str | Path) -> None:
    """Raise PathError when `path` cannot take an export: its directory is
    missing (or is a file), or `path` is a directory.  Checked before
    anything is written (docs/reliability.md, "OS errors")."""
    path = Path(path)
    if path.is_dir():
        code = errno.EISDIR
    elif not path.parent.is_dir():
        code = errno.ENOENT if not path.parent.exists() else errno.ENOTDIR
    else:
        return
    raise storage_error(OSError(code, os.strerror(code)), "write", path)


EXPORT_LAYOUTS = ("entries", "hf")


def export_results(results: Iterable[Any], path: Path, metadata: dict[str, str] | None = None, *,
                   layout: str = "entries", kv_heads: int | None = None) -> int:
    """Write query results to a safetensors file, in `layout`:

    - "entries" (the default): ``k_{id}`` and ``v_{id}`` [n_tokens,
      embed_dim] F32 per result;
    - "hf": the model's layout, ``past_key_values.{i}.key`` / ``.value``
      [1, kv_heads, tokens, head_dim] F32 (bhtd) for each layer i among the
      results, the rows of that layer's results concatenated along tokens
      in rank order (`kv_heads` required: embed_dim = kv_heads x head_dim).
      `hmem put` reads the file back as one entry per layer.

    ``__metadata__`` holds the entry ids and scores in rank order (JSON
    lists), the layout (and kv_heads and each entry's token count with
    "hf"), plus `metadata`.  Written atomically; returns the file size.  A
    missing directory or a directory as `path` is a PathError, a bad layout
    or kv_heads an InvalidArgumentError, before anything is written."""
    check_export_path(path)
    validation.choice(layout, "layout", EXPORT_LAYOUTS)
    if layout == "hf" and kv_heads is None:
        raise InvalidArgumentError("the hf export layout needs kv_heads, the number of K/V heads")
    if layout != "hf" and kv_heads is not None:
        raise InvalidArgumentError("kv_heads applies to the hf export layout only")
    results = list(results)
    meta = {"format": "hmem-export", "layout": layout, "entry_ids": json.dumps([r.entry_id for r in results]),
            "scores": json.dumps([r.score for r in results]), **(metadata or {})}
    tensors: dict[str, np.ndarray] = {}
    if layout == "entries":
        for r in results:
            for kind, array in (("k", r.keys), ("v", r.values)):
                tensors[f"{kind}_{r.entry_id}"] = np.ascontiguousarray(np.asarray(array), dtype=np.float32)
        return _write(path, tensors, meta)
    heads = validation.integer(kv_heads, "kv_heads", low=1)
    by_layer: dict[int, list[Any]] = {}
    for r in results:
        by_layer.setdefault(int(r.layer_idx), []).append(r)
    for layer in sorted(by_layer):
        for side, kind in (("keys", "key"), ("values", "value")):
            rows = np.concatenate([np.asarray(getattr(r, side), dtype=np.float32) for r in by_layer[layer]])
            if rows.shape[1] % heads:
                raise InvalidArgumentError(f"rows of {rows.shape[1]} values do not split into kv_heads={heads} "
                                           "heads of equal size")
            tensors[f"past_key_values.{layer}.{kind}"] = np.ascontiguousarray(layouts.to_heads(rows, heads)[None])
    meta.update(kv_heads=str(heads), entry_tokens=json.dumps([int(np.shape(r.keys)[0]) for r in results]))
    return _write(path, tensors, meta)
