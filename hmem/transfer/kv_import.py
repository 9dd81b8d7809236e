"""Reading K/V safetensors files into entries: what `hmem put` imports
(docs/cli.md, "Naming conventions and layouts").  The import itself (files
put, skipped, or found already imported) is hmem/transfer/importing.py;
the export of entries is hmem/transfer/kv_export.py.

Which tensors pair up as keys and values, their layer and their layout
come from the naming conventions (hmem/transfer/kv_names.py, names matched
case-insensitively), the caller's ``layout``, or the tensor's shape and the
store's embed_dim; a shape two layouts fit with nothing to say which is
refused (AmbiguousLayoutError), never guessed.  Heads are flattened into
rows [tokens, kv_heads x head_dim] (hmem/store/kv_layouts.py); each batch row
is its own entry, and with ``chunk_tokens`` each run of that many tokens;
each entry's meta records its source file, token range, chunk and batch row.

Layer: the tensor names when they carry one, else the caller's ``layer``,
else ``__metadata__["layer"]``, else 0.  Importance: the caller's, else
``__metadata__["importance"]``, else 1.0.  F32, F16, BF16 and F64 are read
and stored as the store's dtype (F16 and BF16 bit-exact in f16/bf16 stores).

A file that cannot be read, holds no K/V pair or holds a tensor that is
not float raises BadFileError naming why.  Other tensors in a file are
ignored.
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from hmem import validation
from hmem.errors import BadFileError, InvalidArgumentError, InvalidTensorError
from hmem.formats import safetensors, shard_file
from hmem.formats.store_files import is_store
from hmem.store import kv_layouts
from hmem.store.storage import Bf16Rows
from hmem.store.store import Entry
from hmem.transfer import kv_names

__all__ = ["BadFileError", "KvFile", "entries_of", "find_files", "read_entries", "read_tensor"]

SUFFIX = ".safetensors"
# What to do instead of importing a store's files (hmem's shards are refused)
STORE_HINT = "copy a whole store with 'hmem copy', or export entries with 'hmem export' and import that file"

_READ_WHOLE_BYTES = 64 << 10  # files up to this size are read, larger ones mapped

# K/V tensors may be stored as these; BF16 is widened to float32 on reading.
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def find_files(paths: Iterable[str | Path], *, store: str | os.PathLike | None = None) -> list[Path]:
    """The given files, and the *.safetensors files below given directories
    (sorted); a path that does not exist is returned as is and reported.

    With `store` (the store imported into), a store never imports its own
    files: a given path that is the store or lies inside it raises
    InvalidArgumentError naming it, and the files of a directory that
    contains the store leave out the store's subtree.  Paths are compared
    resolved (symlinks followed)."""
    # "" would resolve to the current directory: refused, like a file as the store
    root = Path(validation.store_directory(store)).resolve() if store is not None else None
    out: list[Path] = []
    for raw in paths:
        path = Path(validation.path_text(raw, "a path to import"))  # "" is refused, never taken for "."
        if root is not None:
            _refuse_inside(path, root)
        if path.is_dir() and not is_store(path):
            found = sorted(_files_below(path))
            if root is not None:
                # The search enters no linked directory, so a file leads into the
                # store only when the store lies below this directory or the file
                # is a link: only those are resolved (each resolve costs a stat
                # per path component, which adds up over thousands of files).
                holds_store = _inside(root, path.resolve())
                found = [p for p in found if not ((holds_store or p.is_symlink()) and _inside(p.resolve(), root))]
            out.extend(found)
        else:
            out.append(path)
    return out


def _files_below(top: Path) -> Iterator[Path]:
    """The *.safetensors files below `top`, and in place of the files of
    each store directory below it the directory itself (KvFile refuses it
    with its reason): a store's shards are not K/V files to import.  Linked
    directories are not entered (as Path.rglob does not)."""
    for folder, dirs, files in os.walk(top):
        here = Path(folder)
        stores = [name for name in dirs if is_store(here / name) and not (here / name).is_symlink()]
        yield from (here / name for name in stores)
        dirs[:] = [name for name in dirs if name not in stores]
        yield from (p for p in (here / name for name in files if name.endswith(SUFFIX)) if p.is_file())


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _refuse_inside(path: Path, root: Path) -> None:
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError):  # a symlink loop: inside nothing; reported unreadable when read
        return
    if resolved == root:
        raise InvalidArgumentError(
            f"{path} is the store itself: a store never imports its own files",
            hint="give the files or directories to import into it",
        )
    if root in resolved.parents:
        raise InvalidArgumentError(
            f"{path} lies inside the store {root}: a store never imports its own files",
            hint="import files kept outside the store directory",
        )


# ---- reading one file ----------------------------------------------------------------


class KvFile:
    """A safetensors file, memory-mapped (read whole when small), with its
    header checked."""

    def __init__(self, path: Path) -> None:
        try:
            if is_store(path):
                raise BadFileError(
                    "an hmem store directory: its shard files are not K/V files to import",
                    hint=STORE_HINT,
                )
            if not stat.S_ISREG(os.stat(path).st_mode):
                raise BadFileError("not a regular file")
            with open(path, "rb") as f:
                size = f.seek(0, 2)
                if size > _READ_WHOLE_BYTES:
                    self._map: Any = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
                else:  # a small file: one read costs less than mapping it
                    f.seek(0)
                    self._map = f.read(size)
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
        if self.metadata.get("format") == shard_file.SHARD_FORMAT or shard_file.INDEX_TENSOR in self.tensors:
            # Read as K/V pairs its entries would all land in one layer with
            # importance 1 (shard tensors carry neither): refused, never guessed.
            raise BadFileError(
                "an hmem shard file (of a store, or a copy of one), not a K/V file: imported as K/V, its "
                "entries would lose their layers and importance",
                hint=STORE_HINT,
            )

    def array(self, name: str) -> np.ndarray:
        """The tensor as a float array (a view for F32/F16/F64, a float32 copy for BF16)."""
        raw, bf16 = self.raw(name)
        return kv_layouts.matrix(raw.reshape(-1), bf16_words=True).reshape(raw.shape) if bf16 else raw

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
        view = np.frombuffer(
            self._map, dtype=np_dtype, count=(end - begin) // np_dtype.itemsize, offset=self._start + begin
        ).reshape(shape)
        return view, dtype == "BF16"


def read_tensor(path: Path, names: tuple[str, ...]) -> np.ndarray:
    """The first tensor of `names` a file holds, or its only tensor."""
    f = KvFile(path)
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


def read_entries(
    path: Path,
    *,
    layer: int | None = None,
    importance: float | None = None,
    layout: str | None = None,
    chunk_tokens: int | None = None,
    embed_dim: int | None = None,
) -> tuple[list[Entry], int]:
    """The entries one file holds under the naming conventions, and its size.
    `embed_dim` (the store's) tells per-head layouts apart when neither
    `layout` nor the naming convention says; `chunk_tokens` cuts each
    sequence into entries of that many tokens."""
    f = KvFile(path)
    return list(entries_of(f, Path(path).name, layer, importance, layout, chunk_tokens, embed_dim)), f.size


def entries_of(
    f: KvFile,
    source: str,
    layer: int | None,
    importance: float | None,
    layout: str | None,
    chunk_tokens: int | None,
    embed_dim: int | None,
    *,
    words: bool = False,
) -> Iterator[Entry]:
    """A file's entries one by one, each chunk's rows made when it is reached
    (transposed and widened in one pass): a put of a large file never holds
    a converted copy of the whole file besides what the store keeps.  With
    `words`, BF16 tensors are given as their words (storage.Bf16Rows, for
    Store.put_many only): the put widens them entry by entry, and a bf16
    store keeps them as they are."""
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
            for index, (k, v) in enumerate(kv_layouts.split_l2thd(array, f"tensor {name!r}")):
                yield from _cut(k, v, bf16, index, imp, source, chunk_tokens, 0, 1, words)
            continue
        (k, k_bf16), (v, v_bf16) = f.raw(pair["k"]), f.raw(pair["v"])
        if k.shape != v.shape:
            raise InvalidTensorError(
                f"tensors {pair['k']!r} {list(k.shape)} and {pair['v']!r} {list(v.shape)} differ in shape"
            )
        if k_bf16 != v_bf16:  # one widening for both (F32/F16/F64 mix freely: each is converted as it is)
            k, v = (f.array(pair["k"]), f.array(pair["v"]))
            k_bf16 = False
        chosen = kv_names.layout_of(pair["k"], k.shape, convention, layout, embed_dim)
        key_views = kv_layouts.token_major(k, chosen, f"tensor {pair['k']!r}")
        value_views = kv_layouts.token_major(v, chosen, f"tensor {pair['v']!r}")
        entry_layer = number if convention in kv_names.CARRIES_LAYER else default_layer
        for batch, (key_view, value_view) in enumerate(zip(key_views, value_views)):
            yield from _cut(
                key_view, value_view, k_bf16, entry_layer, imp, source, chunk_tokens, batch, len(key_views), words
            )


def _cut(
    keys: np.ndarray,
    values: np.ndarray,
    bf16: bool,
    layer: int,
    importance: float,
    source: str,
    chunk_tokens: int | None,
    batch: int,
    batches: int,
    words: bool,
) -> Iterator[Entry]:
    """The entries of one sequence (token-major views): one, or one per chunk
    of `chunk_tokens`."""
    for ck, cv in zip(kv_layouts.chunks(keys, chunk_tokens, batch), kv_layouts.chunks(values, chunk_tokens, batch)):
        meta: dict[str, Any] = {"source": source, "tokens": [ck.start, ck.stop]}
        if chunk_tokens is not None:
            meta["chunk"] = ck.chunk
        if batches > 1:
            meta["batch"] = batch
        if bf16 and words:
            yield Entry(Bf16Rows(ck.view), Bf16Rows(cv.view), layer, importance, meta)
        else:
            yield Entry(
                kv_layouts.matrix(ck.view, bf16_words=bf16),
                kv_layouts.matrix(cv.view, bf16_words=bf16),
                layer,
                importance,
                meta,
            )
