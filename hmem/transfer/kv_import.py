"""K/V safetensors files into a store: the batch import that `hmem put`
runs (docs/cli.md, "Naming conventions and layouts").  The export of query
results is hmem/transfer/kv_export.py.

Which tensors pair up as keys and values, their layer and their layout
come from the naming conventions (hmem/transfer/kv_names.py, names matched
case-insensitively), the caller's ``layout``, or the tensor's shape and the
store's embed_dim; a shape two layouts fit with nothing to say which is
refused (AmbiguousLayoutError), never guessed.  Heads are flattened into
rows [tokens, kv_heads x head_dim] (hmem/store/layouts.py); each batch row
is its own entry, and with ``chunk_tokens`` each run of that many tokens;
each entry's meta records its source file, token range, chunk and batch row.

Layer: the tensor names when they carry one, else the caller's ``layer``,
else ``__metadata__["layer"]``, else 0.  Importance: the caller's, else
``__metadata__["importance"]``, else 1.0.  F32, F16, BF16 and F64 are read
and stored as the store's dtype (F16 and BF16 bit-exact in f16/bf16 stores).

A file that cannot be read, holds no K/V pair, holds a tensor that is not
float, or whose entries the store refuses (shape, NaN/Inf) is skipped
whole, with the reason: a file's entries go in together or not at all.
Other tensors in a file are ignored.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import mmap
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from hmem import validation
from hmem.errors import BadFileError, InvalidArgumentError, InvalidTensorError
from hmem.formats import safetensors
from hmem.formats.sources import ImportedSource
from hmem.store import layouts
from hmem.store.store import Entry, Store
from hmem.transfer import kv_names

__all__ = ["BadFileError", "FileResult", "ImportReport", "find_files", "import_files", "read_entries", "read_tensor"]

SUFFIX = ".safetensors"

# K/V tensors may be stored as these; BF16 is widened to float32 on reading.
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


@dataclasses.dataclass(frozen=True)
class FileResult:
    path: str
    entries: tuple[int, ...] = ()  # ids stored (empty on a dry run or a skip)
    planned: int = 0  # entries found in the file
    bytes: int = 0  # file size
    skipped: str | None = None  # why the file was skipped
    hint: str | None = None  # what to do about it, in library terms
    layouts: tuple[str, ...] = ()  # the layouts that fit, when the skip is an ambiguous layout (give one)
    imported_before: ImportedSource | None = None  # not imported: the store holds this import of its content
    sha256: str | None = None  # of the file's bytes (imported, already imported, or checked by a dry run)


@dataclasses.dataclass(frozen=True)
class ImportReport:
    files: tuple[FileResult, ...]  # the files done (imported or skipped), in order
    dry_run: bool
    not_started: tuple[str, ...] = ()  # the files left when `should_stop` stopped the import

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
    def already_imported(self) -> tuple[FileResult, ...]:
        return tuple(f for f in self.files if f.imported_before is not None)

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes for f in self.files)


def find_files(paths: Iterable[str | Path], *, store: str | os.PathLike | None = None) -> list[Path]:
    """The given files, and the *.safetensors files below given directories
    (sorted); a path that does not exist is returned as is and reported.

    With `store` (the store imported into), a store never imports its own
    files: a given path that is the store or lies inside it raises
    InvalidArgumentError naming it, and the files of a directory that
    contains the store leave out the store's subtree.  Paths are compared
    resolved (symlinks followed)."""
    root = Path(store).resolve() if store is not None else None
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if root is not None:
            _refuse_inside(path, root)
        if path.is_dir():
            found = sorted(p for p in path.rglob(f"*{SUFFIX}") if p.is_file())
            out.extend(found if root is None else [p for p in found if not _inside(p.resolve(), root)])
        else:
            out.append(path)
    return out


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _refuse_inside(path: Path, root: Path) -> None:
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError):  # a symlink loop: inside nothing; reported unreadable when read
        return
    if resolved == root:
        raise InvalidArgumentError(f"{path} is the store itself: a store never imports its own files",
                                   hint="give the files or directories to import into it")
    if root in resolved.parents:
        raise InvalidArgumentError(f"{path} lies inside the store {root}: a store never imports its own files",
                                   hint="import files kept outside the store directory")


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
        raw, bf16 = self.raw(name)
        return layouts.matrix(raw.reshape(-1), bf16_words=True).reshape(raw.shape) if bf16 else raw

    def data(self) -> Any:
        """The file's bytes (memory-mapped)."""
        return self._map

    def raw(self, name: str) -> tuple[np.ndarray, bool]:
        """The tensor as a view of the file, and whether it holds BF16 words
        (uint16: numpy has no bfloat16) rather than floats."""
        dtype, shape, begin, end = self.tensors[name]
        if dtype not in _FLOAT_DTYPES:
            raise BadFileError(f"tensor {name!r} is {dtype}; K/V must be F32, F16, BF16 or F64")
        np_dtype = np.dtype("<u2") if dtype == "BF16" else safetensors.NUMPY_DTYPES[dtype]
        view = np.frombuffer(self._map, dtype=np_dtype, count=(end - begin) // np_dtype.itemsize,
                             offset=self._start + begin).reshape(shape)
        return view, dtype == "BF16"


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


def read_entries(path: Path, *, layer: int | None = None, importance: float | None = None,
                 layout: str | None = None, chunk_tokens: int | None = None,
                 embed_dim: int | None = None) -> tuple[list[Entry], int]:
    """The entries one file holds under the naming conventions, and its size.
    `embed_dim` (the store's) tells per-head layouts apart when neither
    `layout` nor the naming convention says; `chunk_tokens` cuts each
    sequence into entries of that many tokens."""
    f = _File(path)
    return list(_entries(f, Path(path).name, layer, importance, layout, chunk_tokens, embed_dim)), f.size


def _entries(f: _File, source: str, layer: int | None, importance: float | None, layout: str | None,
             chunk_tokens: int | None, embed_dim: int | None) -> Iterator[Entry]:
    """A file's entries one by one, each chunk's rows made when it is reached
    (transposed and widened in one pass): a put of a large file never holds
    a converted copy of the whole file besides what the store keeps."""
    meta_layer = _metadata_number(f.metadata, "layer", int)
    meta_importance = _metadata_number(f.metadata, "importance", float)
    default_layer = layer if layer is not None else (meta_layer if meta_layer is not None else 0)
    imp = importance if importance is not None else (meta_importance if meta_importance is not None else 1.0)
    groups = kv_names.groups(list(f.tensors), layout)
    for (convention, number), pair in sorted(groups.items(), key=lambda item: kv_names.order(item[0])):
        if convention == "all-layers":
            name = pair["kv"]
            array, bf16 = f.raw(name)
            kv_names.layout_of(name, array.shape, convention, layout, embed_dim)
            for index, (k, v) in enumerate(layouts.split_l2thd(array, f"tensor {name!r}")):
                yield from _cut(k, v, bf16, index, imp, source, chunk_tokens, 0, 1)
            continue
        (k, k_bf16), (v, v_bf16) = f.raw(pair["k"]), f.raw(pair["v"])
        if k.shape != v.shape:
            raise InvalidTensorError(f"tensors {pair['k']!r} {list(k.shape)} and {pair['v']!r} {list(v.shape)} "
                                     "differ in shape")
        if k_bf16 != v_bf16:  # one widening for both (F32/F16/F64 mix freely: each is converted as it is)
            k, v = (f.array(pair["k"]), f.array(pair["v"]))
            k_bf16 = False
        chosen = kv_names.layout_of(pair["k"], k.shape, convention, layout, embed_dim)
        key_views = layouts.token_major(k, chosen, f"tensor {pair['k']!r}")
        value_views = layouts.token_major(v, chosen, f"tensor {pair['v']!r}")
        entry_layer = number if convention in kv_names.CARRIES_LAYER else default_layer
        for batch, (key_view, value_view) in enumerate(zip(key_views, value_views)):
            yield from _cut(key_view, value_view, k_bf16, entry_layer, imp, source, chunk_tokens, batch, len(key_views))


def _cut(keys: np.ndarray, values: np.ndarray, bf16: bool, layer: int, importance: float, source: str,
         chunk_tokens: int | None, batch: int, batches: int) -> Iterator[Entry]:
    """The entries of one sequence (token-major views): one, or one per chunk
    of `chunk_tokens`."""
    for ck, cv in zip(layouts.chunks(keys, chunk_tokens, batch), layouts.chunks(values, chunk_tokens, batch)):
        meta: dict[str, Any] = {"source": source, "tokens": [ck.start, ck.stop]}
        if chunk_tokens is not None:
            meta["chunk"] = ck.chunk
        if batches > 1:
            meta["batch"] = batch
        yield Entry(layouts.matrix(ck.view, bf16_words=bf16), layouts.matrix(cv.view, bf16_words=bf16),
                    layer, importance, meta)


# ---- the import -------------------------------------------------------------------------


def import_files(
    store: Store,
    paths: Iterable[str | Path],
    *,
    layer: int | None = None,
    importance: float | None = None,
    layout: str | None = None,
    chunk_tokens: int | None = None,
    dry_run: bool = False,
    progress: Callable[[FileResult], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    again: bool = False,
) -> ImportReport:
    """Put the entries of every file (files first checked whole, then stored
    with one batch put each); skip bad files with their reason (and a hint;
    `layouts` when the file's layout is ambiguous).  `layout` (one of
    hmem.LAYOUTS) says how every per-head tensor is laid out; `chunk_tokens`
    stores each sequence as entries of that many tokens.  With
    `dry_run`, everything is read and checked and nothing is written (the
    store may be read-only).  `progress` is called after each file.  The
    caller flushes (or closes) the store.

    The store's own files are never imported (``find_files`` with `store`):
    a path that is the store or lies inside it raises InvalidArgumentError
    before anything is put.  `should_stop` is asked before each file; when
    it returns True the import ends there, every file before it done whole,
    and the report lists the files not started (``not_started``).

    Each file imported is recorded in the store's import registry (its
    SHA-256, size and name, committed with its entries), and a file whose
    content the registry holds is not imported again (``imported_before``
    says as what) unless `again`: re-running an import stores exactly what
    is missing."""
    if layer is not None and (isinstance(layer, bool) or not 0 <= int(layer) <= 0xFFFFFFFF):
        raise InvalidArgumentError(f"layer must be between 0 and {0xFFFFFFFF}, got {layer}")
    if importance is not None:
        importance = validation.importance(importance)
    if layout is not None:
        layout = validation.choice(layout, "layout", layouts.LAYOUTS)
    if chunk_tokens is not None:
        chunk_tokens = validation.integer(chunk_tokens, "chunk_tokens", low=1)
    embed_dim = store.config.embed_dim
    files = find_files(paths, store=store.path)
    again = validation.flag(again, "again")
    known_sizes = {s.bytes for s in store.imported_sources()} if not again else set()
    results: list[FileResult] = []
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hmem-hash") as hashing:
        for i, path in enumerate(files):
            if should_stop is not None and should_stop():
                return ImportReport(tuple(results), dry_run, tuple(str(p) for p in files[i:]))
            try:
                result = _import_one(store, path, hashing, known_sizes, dry_run, layer, importance, layout,
                                     chunk_tokens, embed_dim)
            except (BadFileError, InvalidArgumentError) as exc:
                size = path.stat().st_size if path.is_file() else 0
                result = FileResult(str(path), (), 0, size, skipped=exc.message, hint=exc.hint,
                                    layouts=getattr(exc, "layouts", ()))
            results.append(result)
            if progress is not None:
                progress(result)
    return ImportReport(tuple(results), dry_run)


def _import_one(store: Store, path: Path, hashing: concurrent.futures.Executor, known_sizes: set[int],
                dry_run: bool, layer: int | None, importance: float | None, layout: str | None,
                chunk_tokens: int | None, embed_dim: int) -> FileResult:
    """One file: skipped when the store recorded its content as imported
    (only a file of a size recorded can be: others are hashed while they
    are imported), else put whole and recorded."""
    f = _File(path)
    digest = hashing.submit(_sha256, f.data())  # hashlib lets go of the GIL: it runs beside the put
    if f.size in known_sizes:
        before = store.find_source(digest.result(), f.size)
        if before is not None:
            return FileResult(str(path), (), 0, f.size, imported_before=before, sha256=before.sha256)
    entries = _entries(f, path.name, layer, importance, layout, chunk_tokens, embed_dim)
    if dry_run:
        return FileResult(str(path), (), store.check_entries(entries), f.size, sha256=digest.result())
    # The entries are made as put_many takes them; it checks them all before
    # storing any, so the file still goes in whole or not at all.
    ids = store.put_many(entries)
    store.record_source(path.name, digest.result(), f.size, ids)  # committed with the entries
    return FileResult(str(path), tuple(ids), len(ids), f.size, sha256=digest.result())


def _sha256(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()
