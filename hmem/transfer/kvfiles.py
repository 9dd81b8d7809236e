"""K/V safetensors files in and out of a store: the batch import that
`hmem put` runs, and the export of query results (`hmem query --export`).

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
import json
import math
import mmap
import os
import re
import stat
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from hmem import _io
from hmem.errors import HmemError, InvalidArgumentError
from hmem.store.store import Entry, Store
from hmem import validation

SUFFIX = ".safetensors"

_LAYERED = re.compile(r"^layers?[._](\d{1,10})[._](k|v|keys|values)$")
_NUMBERED = re.compile(r"^(k|v|keys|values)[._](\d{1,18})$")
_SINGLE = {"k": "k", "v": "v", "keys": "k", "values": "v"}

_FLOAT_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8"), "BF16": None}
_ITEM_SIZES = {"F32": 4, "F16": 2, "F64": 8, "BF16": 2, "I8": 1, "U8": 1, "I16": 2, "U16": 2, "I32": 4,
               "U32": 4, "I64": 8, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class BadFileError(HmemError):
    """An import file that is skipped, with the reason."""


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
                if size < 8:
                    raise BadFileError(f"too short to be safetensors ({size} bytes)")
                self._map = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise BadFileError("no such file") from None
        except PermissionError:
            raise BadFileError("permission denied") from None
        except OSError as exc:
            raise BadFileError(f"cannot read it ({exc.strerror or exc})") from None
        self.size = size
        (length,) = struct.unpack_from("<Q", self._map, 0)
        if length > size - 8:
            raise BadFileError(f"header length {length} runs past the end of the file")
        try:
            header = json.loads(bytes(self._map[8 : 8 + length]))
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise BadFileError("the header is not valid JSON") from None
        if not isinstance(header, dict):
            raise BadFileError("the header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        self.metadata = metadata if isinstance(metadata, dict) else {}
        self._start = 8 + length
        self.tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        data_len = size - self._start
        for name, spec in header.items():
            try:
                dtype = str(spec["dtype"])
                shape = tuple(_header_int(x) for x in spec["shape"])
                begin, end = (_header_int(x) for x in spec["data_offsets"])
            except (KeyError, TypeError, ValueError, OverflowError):
                raise BadFileError(f"tensor {name!r} has a malformed header entry") from None
            if not 0 <= begin <= end <= data_len:
                raise BadFileError(f"tensor {name!r} lies outside the file's data")
            item = _ITEM_SIZES.get(dtype)
            if item is None:
                raise BadFileError(f"tensor {name!r} has unknown dtype {dtype}")
            if end - begin != math.prod(shape) * item:  # Python ints: no overflow
                raise BadFileError(f"tensor {name!r}: its byte size does not match shape {list(shape)}")
            self.tensors[name] = (dtype, shape, begin, end)
        # As safetensors requires: tensors back to back, covering the data.
        at = 0
        for name, (_, _, begin, end) in sorted(self.tensors.items(), key=lambda item: (item[1][2], item[1][3])):
            if begin != at:
                raise BadFileError(f"tensor {name!r} {'overlaps another' if begin < at else 'leaves a gap before it'}")
            at = end
        if at != data_len:
            raise BadFileError(f"{data_len - at} bytes after the last tensor belong to none")

    def array(self, name: str) -> np.ndarray:
        """The tensor as a float array (a view for F32/F16/F64, a float32 copy for BF16)."""
        dtype, shape, begin, end = self.tensors[name]
        if dtype not in _FLOAT_DTYPES:
            raise BadFileError(f"tensor {name!r} is {dtype}; K/V must be F32, F16, BF16 or F64")
        offset = self._start + begin
        if dtype == "BF16":  # bfloat16 is the top half of a float32
            raw = np.frombuffer(self._map, dtype="<u2", count=(end - begin) // 2, offset=offset)
            return (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)
        np_dtype = _FLOAT_DTYPES[dtype]
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


def _header_int(value: Any) -> int:
    """A non-negative integer of a header, refusing floats, bools and absurd sizes."""
    if type(value) is not int or not 0 <= value < 1 << 62:
        raise ValueError(f"{value!r} is not a size")
    return value


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


# ---- export ----------------------------------------------------------------------------


def export_results(results: Iterable[Any], path: Path, metadata: dict[str, str] | None = None) -> int:
    """Write query results to a safetensors file: ``k_{id}`` and ``v_{id}``
    (F32) per result, and in ``__metadata__`` the entry ids and scores in
    rank order (JSON lists) plus `metadata`.  Written atomically; returns
    the file size."""
    results = list(results)
    meta = {"format": "hmem-export", "entry_ids": json.dumps([r.entry_id for r in results]),
            "scores": json.dumps([r.score for r in results]), **(metadata or {})}
    header: dict[str, Any] = {"__metadata__": meta}
    buffers: list[Any] = []
    offset = 0
    for r in results:
        for kind, array in (("k", r.keys), ("v", r.values)):
            data = np.ascontiguousarray(np.asarray(array), dtype=np.float32)
            header[f"{kind}_{r.entry_id}"] = {"dtype": "F32", "shape": list(data.shape),
                                              "data_offsets": [offset, offset + data.nbytes]}
            buffers.append(memoryview(data).cast("B"))
            offset += data.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return _io.write_file(Path(path), [struct.pack("<Q", len(text)), text, *buffers])
