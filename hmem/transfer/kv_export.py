"""K/V safetensors files out of hmem: the export of query results
(`hmem query --export`, docs/cli.md) and standard safetensors files of
numpy arrays (`write_kv_file`), both written atomically.  Reading such
files back is hmem/transfer/kv_import.py."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hmem import _io
from hmem.errors import InvalidArgumentError
from hmem.formats import safetensors

__all__ = ["export_results", "write_kv_file"]


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


def export_results(results: Iterable[Any], path: Path, metadata: dict[str, str] | None = None) -> int:
    """Write query results to a safetensors file: ``k_{id}`` and ``v_{id}``
    (F32) per result, and in ``__metadata__`` the entry ids and scores in
    rank order (JSON lists) plus `metadata`.  Written atomically; returns
    the file size."""
    results = list(results)
    meta = {"format": "hmem-export", "entry_ids": json.dumps([r.entry_id for r in results]),
            "scores": json.dumps([r.score for r in results]), **(metadata or {})}
    tensors = {}
    for r in results:
        for kind, array in (("k", r.keys), ("v", r.values)):
            tensors[f"{kind}_{r.entry_id}"] = np.ascontiguousarray(np.asarray(array), dtype=np.float32)
    return _write(path, tensors, meta)
