"""K/V safetensors files into a store: the batch import that `hmem put`
runs (docs/cli.md).  The export of query results is hmem/transfer/kv_export.py.

Naming conventions a file may follow (tensor names, case-sensitive):

- one entry: ``keys`` and ``values``, or ``k`` and ``v``;
- one entry per layer: ``layer.{i}.k`` / ``layer.{i}.v`` (also ``layers``,
  ``_`` instead of ``.``, ``keys`` / ``values`` instead of ``k`` / ``v``):
  entry i goes to layer i;
- several entries: ``k_{n}`` / ``v_{n}`` (also ``k.{n}``, ``keys_{n}``):
  one entry per n, in ascending n.

The layer of an entry comes from its tensor names when they carry one,
else from the caller's ``layer``, else from the file's ``__metadata__``
key ``layer``, else 0.  Importance: the caller's ``importance``, else
``__metadata__["importance"]``, else 1.0.  Tensors may be F32, F16, BF16
or F64; they are stored as the store's dtype.

A file that cannot be read, holds no K/V pair in these forms, holds a tensor
that is not float, or whose entries the store refuses (shape, NaN/Inf) is
skipped whole, with the reason: a file's entries go in together or not at
all.  Other tensors in a file are ignored.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import re
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from hmem import validation
from hmem.errors import BadFileError, InvalidArgumentError
from hmem.formats import safetensors
from hmem.store.store import Entry, Store

__all__ = ["BadFileError", "FileResult", "ImportReport", "find_files", "import_files", "read_entries", "read_tensor"]

SUFFIX = ".safetensors"

_LAYERED = re.compile(r"^layers?[._](\d{1,10})[._](k|v|keys|values)$")
_NUMBERED = re.compile(r"^(k|v|keys|values)[._](\d{1,18})$")
_SINGLE = {"k": "k", "v": "v", "keys": "k", "values": "v"}

# K/V tensors may be stored as these; BF16 is widened to float32 on reading.
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


@dataclasses.dataclass(frozen=True)
class FileResult:
    path: str
    entries: tuple[int, ...] = ()  # ids stored (empty on a dry run or a skip)
    planned: int = 0  # entries found in the file
    bytes: int = 0  # file size
    skipped: str | None = None  # why the file was skipped


@dataclasses.dataclass(frozen=True)
class ImportReport:
    files: tuple[FileResult, ...]
    dry_run: bool

    @property
    def entries_added(self) -> int:
        return sum(len(f.entries) for f in self.files)

    @property
    def entries_found(self) -> int:
        return sum(f.planned for f in self.files if f.skipped is None)

    @property
    def skipped(self) -> tuple[FileResult, ...]:
        return tuple(f for f in self.files if f.skipped is not None)

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes for f in self.files)


def find_files(paths: Iterable[str | Path]) -> list[Path]:
    """The given files, and the *.safetensors files below given directories
    (sorted); a path that does not exist is returned as is and reported."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            out.extend(sorted(p for p in path.rglob(f"*{SUFFIX}") if p.is_file()))
        else:
            out.append(path)
    return out


# ---- reading one file ----------------------------------------------------------------


class _File:
    """A safetensors file, memory-mapped, with its header checked."""

    def __init__(self, path: Path) -> None:
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):
                raise BadFileError("not a regular file")
            with open(path, "rb") as f:
                size = f.seek(0, 2)
                self._map = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else b""
        except FileNotFoundError:
            raise BadFileError("no such file") from None
        except PermissionError:
            raise BadFileError("permission denied") from None
        except OSError as exc:
            raise BadFileError(f"cannot read it ({exc.strerror or exc})") from None
        self.size = size
        try:
            header = safetensors.parse(self._map, contiguous=True)  # as safetensors requires: no gap, no overlap
        except safetensors.SafetensorsError as exc:
            raise BadFileError(exc.message) from None
        self.metadata = header.metadata if isinstance(header.metadata, dict) else {}
        self._start = header.data_start
        self.tensors: dict[str, safetensors.TensorSpec] = header.tensors

    def array(self, name: str) -> np.ndarray:
        """The tensor as a float array (a view for F32/F16/F64, a float32 copy for BF16)."""
        dtype, shape, begin, end = self.tensors[name]
        if dtype not in _FLOAT_DTYPES:
            raise BadFileError(f"tensor {name!r} is {dtype}; K/V must be F32, F16, BF16 or F64")
        offset = self._start + begin
        if dtype == "BF16":  # bfloat16 is the top half of a float32
            raw = np.frombuffer(self._map, dtype="<u2", count=(end - begin) // 2, offset=offset)
            return (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)
        np_dtype = safetensors.NUMPY_DTYPES[dtype]
        return np.frombuffer(self._map, dtype=np_dtype, count=(end - begin) // np_dtype.itemsize,
                             offset=offset).reshape(shape)


def read_tensor(path: Path, names: tuple[str, ...]) -> np.ndarray:
    """The first tensor of `names` a file holds, or its only tensor."""
    f = _File(path)
    for name in names:
        if name in f.tensors:
            return f.array(name)
    if len(f.tensors) == 1:
        return f.array(next(iter(f.tensors)))
    raise BadFileError(f"no tensor named {' or '.join(names)} and more than one tensor")


def _metadata_number(metadata: dict, key: str, cast: Callable[[str], Any]) -> Any:
    value = metadata.get(key)
    if value is None:
        return None
    try:
        return cast(value)
    except (TypeError, ValueError):
        raise BadFileError(f"__metadata__[{key!r}] = {value!r} is not a number") from None


def read_entries(path: Path, *, layer: int | None = None, importance: float | None = None) -> tuple[list[Entry], int]:
    """The entries one file holds under the naming conventions, and its size."""
    f = _File(path)
    names = set(f.tensors)
    meta_layer = _metadata_number(f.metadata, "layer", int)
    meta_importance = _metadata_number(f.metadata, "importance", float)
    default_layer = layer if layer is not None else (meta_layer if meta_layer is not None else 0)
    imp = importance if importance is not None else (meta_importance if meta_importance is not None else 1.0)
    pairs: dict[tuple[str, int], dict[str, str]] = {}  # (form, number) -> {"k": name, "v": name}
    for name in names:
        if name in _SINGLE:
            pairs.setdefault(("single", 0), {})[_SINGLE[name]] = name
        elif (m := _LAYERED.match(name)) is not None:
            pairs.setdefault(("layer", int(m.group(1))), {})[_SINGLE[m.group(2)]] = name
        elif (m := _NUMBERED.match(name)) is not None:
            pairs.setdefault(("numbered", int(m.group(2))), {})[_SINGLE[m.group(1)]] = name
    if not pairs:
        shown = ", ".join(sorted(names)[:5]) or "no tensors"
        raise BadFileError(f"no K/V pair found (tensors: {shown}); see the naming conventions in 'hmem put --help'")
    for (form, number), pair in sorted(pairs.items()):
        missing = {"k", "v"} - set(pair)
        if missing:
            have = next(iter(pair.values()))
            raise BadFileError(f"tensor {have!r} has no {'values' if 'v' in missing else 'keys'} partner")
    entries = []
    for (form, number), pair in sorted(pairs.items()):
        entry_layer = number if form == "layer" else default_layer
        entries.append(Entry(f.array(pair["k"]), f.array(pair["v"]), entry_layer, imp))
    return entries, f.size


# ---- the import -------------------------------------------------------------------------


def import_files(
    store: Store,
    paths: Iterable[str | Path],
    *,
    layer: int | None = None,
    importance: float | None = None,
    dry_run: bool = False,
    progress: Callable[[FileResult], None] | None = None,
) -> ImportReport:
    """Put the entries of every file (files first checked whole, then stored
    with one batch put each); skip bad files with their reason.  With
    `dry_run`, everything is read and checked and nothing is written (the
    store may be read-only).  `progress` is called after each file.  The
    caller flushes (or closes) the store."""
    if layer is not None and (isinstance(layer, bool) or not 0 <= int(layer) <= 0xFFFFFFFF):
        raise InvalidArgumentError(f"layer must be between 0 and {0xFFFFFFFF}, got {layer}")
    if importance is not None:
        importance = validation.importance(importance)
    results = []
    for path in find_files(paths):
        try:
            entries, size = read_entries(path, layer=layer, importance=importance)
            if dry_run:
                store.check_entries(entries)
                result = FileResult(str(path), (), len(entries), size)
            else:
                ids = store.put_many(entries)
                result = FileResult(str(path), tuple(ids), len(entries), size)
        except (BadFileError, InvalidArgumentError) as exc:
            size = path.stat().st_size if path.is_file() else 0
            result = FileResult(str(path), (), 0, size, skipped=exc.message)
        results.append(result)
        if progress is not None:
            progress(result)
    return ImportReport(tuple(results), dry_run)
