"""hmem's LMCache chunks back out (docs/lmcache.md, "Import and
export"): ``export_fs_cache`` writes chunks (of a cache, or imported into a
store by hmem/lmcache/importing.py) as an LMCache ``fs`` connector cache
that LMCache 0.5.6 reads bit-exactly, and ``export_safetensors`` writes a
cache's chunks to a safetensors file.

Export to fs: each chunk becomes ``ChunkKey.fs_name()`` holding the fs
header (``fs_header_bytes``) and the chunk's bytes [2, layers, tokens,
hidden] (a layer of a layerwise cache: [tokens, 2, hidden]).  local_disk
names turn each "/" of the model name into "-", which LMCache's lookup
then never matches: give ``model`` (the name LMCache serves) to restore
it.  A file already there with the same bytes is left as it is; one with
other bytes is refused unless ``force``.  Every file is written under a
temporary name and renamed (hmem/_io.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hmem import _io, file_reads, validation
from hmem.errors import BadFileError, HmemError, InvalidArgumentError
from hmem.formats import lmcache as fmt
from hmem.formats import safetensors
from hmem.formats.sources import ImportedSource
from hmem.formats.store_files import is_store
from hmem.lmcache.cache import NUMPY_DTYPES, CacheDirectory
from hmem.lmcache.chunk_data import (
    FLOAT_DTYPES,
    ChunkFile,
    chunk_rows,
    fs_header,
    key_text,
    kv_layers,
    read_chunk_file,
)
from hmem.store.storage import from_bf16_words, to_bf16_words

if TYPE_CHECKING:
    from hmem.store.results import StoredKV
    from hmem.store.store import Store

__all__ = [
    "ExportedChunk",
    "FsExportReport",
    "SafetensorsExport",
    "export_fs_cache",
    "export_safetensors",
]

SAFETENSORS_LAYOUTS = ("split", "model")
# the safetensors dtypes of a store's entries, and the K/V dtype each holds without loss
_STORED_DTYPES = {"F16": "half", "BF16": "bfloat16", "F32": "float"}


# ---- export as an fs connector cache ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExportedChunk:
    """One chunk of an fs export: the file it is, and what was done."""

    name: str  # the fs file's name in the destination
    key: str  # its key
    source: str  # the cache file it comes from, or the store's source file name
    status: str  # "written", "replaced", "unchanged" (the same bytes were there), "refused", "skipped"
    bytes: int = 0
    reason: str | None = None  # why refused or skipped
    entries: tuple[int, ...] = ()  # the store entries it was made of
    exact: bool = True  # False: the store's dtype held the chunk's values with loss

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["entries"] = list(self.entries)
        return out


@dataclasses.dataclass(frozen=True)
class FsExportReport:
    destination: str
    source: str
    files: tuple[ExportedChunk, ...]
    dry_run: bool
    notes: tuple[str, ...] = ()
    # models of local_disk keys written with each "/" as "-" (no `model` given to restore them)
    dashed_models: tuple[str, ...] = ()

    def count(self, status: str) -> int:
        return sum(f.status == status for f in self.files)

    @property
    def problems(self) -> tuple[ExportedChunk, ...]:
        return tuple(f for f in self.files if f.status in ("refused", "skipped"))

    @property
    def bytes_written(self) -> int:
        return sum(f.bytes for f in self.files if f.status in ("written", "replaced"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "destination": self.destination,
            "source": self.source,
            "dry_run": self.dry_run,
            "files": len(self.files),
            **{status: self.count(status) for status in ("written", "replaced", "unchanged", "refused", "skipped")},
            "bytes_written": self.bytes_written,
            "notes": list(self.notes),
            "dashed_models": list(self.dashed_models),
            "chunks": [f.to_dict() for f in self.files],
        }


def _renamed(key: fmt.ChunkKey, model: str | None) -> fmt.ChunkKey:
    """`key` with the model `model` when its model is that one (a
    local_disk name's model has each "/" as "-")."""
    if model is not None and key.model != model and key.model == model.replace("/", "-"):
        return dataclasses.replace(key, model=model)
    return key


def _destination(dest_dir: str | os.PathLike[str], source: Path | None, dry_run: bool) -> Path:
    """The directory an fs export writes: never an hmem store, a link, or
    the source cache; made when missing (not on a dry run)."""
    dest = Path(validation.path_text(dest_dir, "the export directory"))
    if dest.is_symlink():
        raise InvalidArgumentError(f"{dest} is a symbolic link: an export writes through no link")
    if dest.exists() and not dest.is_dir():
        raise InvalidArgumentError(f"{dest} is not a directory")
    if is_store(dest):
        raise InvalidArgumentError(f"{dest} is an hmem store: an fs export writes an LMCache cache directory")
    resolved = dest.resolve()
    for parent in (resolved, *resolved.parents):
        if is_store(parent):
            raise InvalidArgumentError(f"{dest} lies inside the hmem store {parent}: an export never writes there")
    if source is not None and resolved == source.resolve():
        raise InvalidArgumentError(
            f"{dest} is the cache exported: write the fs cache to another directory",
            hint="LMCache's fs connector reads a directory of its own (its path setting)",
        )
    if not dest.exists() and not dry_run:
        _io.make_dir(dest)
    return dest


def _place(
    dest: Path, name: str, parts: list[bytes | memoryview], force: bool, dry_run: bool
) -> tuple[str, str | None]:
    """Write one file (temporary name, then renamed); returns its status."""
    target = dest / name
    size = sum(len(p) for p in parts)
    status = "written"
    if os.path.lexists(target):
        same = False
        if not target.is_symlink() and target.is_file() and target.stat().st_size == size:
            try:
                with os.fdopen(file_reads.open_regular(target), "rb") as f:
                    same = f.read() == b"".join(parts)
            except (HmemError, OSError):
                same = False
        if same:
            return "unchanged", None
        if not force:
            return "refused", "a different file of that name is there (force replaces it)"
        status = "replaced"
    if not dry_run:
        _io.write_file(target, parts)
    return status, None


def export_fs_cache(
    source: Store | CacheDirectory,
    dest_dir: str | os.PathLike[str],
    *,
    rows: Iterable[int] | np.ndarray | None = None,
    entry_ids: Iterable[int] | None = None,
    model: str | None = None,
    force: bool = False,
    dry_run: bool = False,
) -> FsExportReport:
    """Write chunks as an LMCache fs connector cache in `dest_dir` (made
    when missing): from a CacheDirectory its chunks (`rows`, by default
    all; local_disk files need the cache's kv_shape), from a Store the
    chunks its entries were imported from (``import_cache``; `entry_ids`
    selects the chunks of those entries, by default every chunk the
    import registry names), each made again from its entries.  `model`
    restores the "/" of a model name local_disk names turned into "-".
    An existing file of other bytes is refused unless `force`.  Nothing is
    written on a `dry_run`."""
    force = validation.flag(force, "force")
    dry_run = validation.flag(dry_run, "dry_run")
    if model is not None:
        model = validation.path_text(model, "the model name")
    if isinstance(source, CacheDirectory):
        if entry_ids is not None:
            raise InvalidArgumentError("entry_ids select the chunks of a store; give rows for a cache")
        dest = _destination(dest_dir, source.path, dry_run)
        files = _fs_from_cache(source, dest, rows, model, force, dry_run)
        origin = str(source.path)
    else:
        if rows is not None:
            raise InvalidArgumentError("rows select the chunks of a cache; give entry_ids for a store")
        dest = _destination(dest_dir, None, dry_run)
        files = _fs_from_store(source, dest, entry_ids, model, force, dry_run)
        origin = str(source.path)
    notes = []
    if model is not None and not any(f.key.split("@", 1)[0] == model for f in files):
        notes.append(f"no chunk is of the model {model!r}: every key was kept as it was")
    local_models = {f.key.split("@", 1)[0] for f in files if f.source.endswith(fmt.LOCAL_DISK_SUFFIX)}
    dashed = sorted(m for m in local_models if "-" in m and "/" not in m)
    if model is not None:
        dashed = []
    if dashed:
        notes.append(
            "local_disk names turn each '/' of the model name into '-': keys of the model(s) "
            + ", ".join(repr(m) for m in dashed)
            + " were written so, which LMCache serving the model under its own name never looks up"
        )
    return FsExportReport(str(dest), origin, tuple(files), dry_run, tuple(notes), tuple(dashed))


def _fs_from_cache(
    cache: CacheDirectory,
    dest: Path,
    rows: Iterable[int] | np.ndarray | None,
    model: str | None,
    force: bool,
    dry_run: bool,
) -> list[ExportedChunk]:
    chosen = chunk_rows(cache, rows)
    out = []
    for row in chosen.tolist():
        name = str(cache.listing.name[row])
        try:
            chunk = read_chunk_file(cache, row)
            key = fmt.ChunkKey.parse(chunk.info.key)
            if key is None:
                raise BadFileError("its name is no LMCache key")
            key = _renamed(key, model)
            parts: list[bytes | memoryview] = [fs_header(chunk.info), chunk.payload]
            status, reason = _place(dest, key.fs_name(), parts, force, dry_run)
        except (BadFileError, ValueError) as exc:
            parsed = fmt.key_of_file(name)
            fs_name = _renamed(parsed, model).fs_name() if parsed is not None else ""
            reason = str(getattr(exc, "message", exc))
            out.append(ExportedChunk(fs_name, key_text(name), name, "skipped", reason=reason))
            continue
        out.append(ExportedChunk(key.fs_name(), key.text, name, status, len(chunk.data), reason))
    return out


def _fs_from_store(
    store: Store, dest: Path, entry_ids: Iterable[int] | None, model: str | None, force: bool, dry_run: bool
) -> list[ExportedChunk]:
    """The chunks of the import records named as cache files: the latest
    record of each key, its live entries made into the chunk again."""
    records = [s for s in store.imported_sources() if fmt.key_of_file(s.name) is not None and s.entries]
    live = np.asarray(store.entry_ids(), dtype=np.int64)
    if entry_ids is not None:
        wanted = {validation.integer(i, "entry id", low=0) for i in entry_ids}
        asked = np.fromiter(wanted, dtype=np.int64, count=len(wanted))
        missing = sorted(asked[~np.isin(asked, live)].tolist())
        if missing:
            raise InvalidArgumentError(f"the store holds no entries {', '.join(map(str, missing[:10]))}")
        records = [s for s in records if wanted.intersection(s.entry_ids)]
        outside = wanted - {i for s in records for i in s.entry_ids}
        if outside:
            raise InvalidArgumentError(
                f"entries {', '.join(map(str, sorted(outside)[:10]))} were not imported from an LMCache cache"
            )
    latest: dict[str, ImportedSource] = {}
    for record in records:  # oldest first: a later import of the same key wins
        key = fmt.key_of_file(record.name)
        assert key is not None
        latest[_renamed(key, model).fs_name()] = record
    out = []
    for name, record in latest.items():
        span = np.arange(record.first_id, record.first_id + record.entries, dtype=np.int64)
        ids = span[np.isin(span, live)].tolist()
        try:
            key, parts, exact = _chunk_of_entries(store, ids, record.name, model)
            status, reason = _place(dest, name, parts, force, dry_run)
        except (BadFileError, ValueError) as exc:
            message = str(getattr(exc, "message", exc))
            skipped = ExportedChunk(
                name, key_text(record.name), record.name, "skipped", reason=message, entries=tuple(ids)
            )
            out.append(skipped)
            continue
        size = sum(len(p) for p in parts)
        out.append(ExportedChunk(name, key.text, record.name, status, size, reason, tuple(ids), exact))
    return out


def _chunk_of_entries(
    store: Store, ids: list[int], file_name: str, model: str | None
) -> tuple[fmt.ChunkKey, list[bytes | memoryview], bool]:
    """The fs file (header and bytes) of one imported chunk, from its
    entries (one per layer)."""
    stored = [store.stored_kv(i) for i in ids]
    metas = [s.meta if isinstance(s.meta, dict) and "lmcache_key" in s.meta else None for s in stored]
    if not stored or any(m is None for m in metas):
        raise BadFileError("its entries carry no LMCache meta (imported otherwise)")
    first: dict[str, Any] = metas[0]  # type: ignore[assignment]
    key = fmt.ChunkKey.parse(str(first["lmcache_key"]))
    if key is None:
        raise BadFileError(f"its meta's key {first['lmcache_key']!r} is no LMCache key")
    kv_dtype, form = key.kv_dtype, first.get("lmcache_memory_format")
    shape = tuple(first.get("lmcache_shape") or ())
    key = _renamed(key, model)
    if kv_dtype not in FLOAT_DTYPES or kv_dtype == "double":
        raise BadFileError(f"its dtype {kv_dtype!r} is not one hmem writes back")
    by_layer: dict[int, StoredKV] = {}
    for s, m in zip(stored, metas):
        assert m is not None
        by_layer[int(m.get("lmcache_layer", 0))] = s  # ids ascend: a repeated layer's latest entry wins
    exact = True

    def side(s: StoredKV, values: bool) -> np.ndarray:
        nonlocal exact
        array, lossless = _as_kv_dtype(s, values, str(kv_dtype))
        exact = exact and lossless
        return array

    if form in ("KV_2LTD", "KV_MLA_FMT") and len(shape) == 4:
        planes, layers = shape[0], shape[1]
        gone = sorted(set(range(layers)) - set(by_layer))
        if gone:
            raise BadFileError(f"the entries of layers {gone} are gone (evicted or deleted)")
        parts = [[side(by_layer[layer], plane == 1) for layer in range(layers)] for plane in range(planes)]
        array = np.stack([np.stack(p) for p in parts])
    elif form in ("KV_T2D", "KV_2TD", "KV_MLA_FMT") and len(by_layer) == 1:
        (s,) = by_layer.values()
        if form == "KV_T2D":
            array = np.stack([side(s, False), side(s, True)], axis=1)
        elif form == "KV_2TD":
            array = np.stack([side(s, False), side(s, True)])
        else:
            array = side(s, False)
    else:
        raise BadFileError(f"memory format {form!r} of shape {list(shape)}: not one hmem writes back")
    if tuple(array.shape) != shape:
        raise BadFileError(f"its entries make {list(array.shape)}, its meta says {list(shape)}")
    array = np.ascontiguousarray(array)
    return key, [fmt.fs_header_bytes(str(form), [(str(kv_dtype), shape)]), safetensors.bytes_view(array)], exact


def _as_kv_dtype(s: StoredKV, values: bool, kv_dtype: str) -> tuple[np.ndarray, bool]:
    """An entry's keys (values) as the chunk's dtype (bfloat16 as words),
    and whether the store held them without loss."""
    raw = np.asarray(s.values if values else s.keys)
    if s.dtype == "BF16" and kv_dtype == "bfloat16":
        return raw, True
    if s.dtype == "F16" and kv_dtype == "half":
        return raw, True
    if s.dtype == "BF16":
        floats = from_bf16_words(raw)
    elif s.dtype == "I8":
        scales = s.value_scales if values else s.key_scales
        assert scales is not None
        floats = raw.astype(np.float32) * np.asarray(scales, dtype=np.float32)[:, None]
    else:
        floats = raw.astype(np.float32)
    lossless = s.dtype == "F32" or _STORED_DTYPES.get(s.dtype) == kv_dtype
    if kv_dtype == "bfloat16":
        return to_bf16_words(floats), lossless
    return floats.astype(np.dtype(NUMPY_DTYPES[kv_dtype])), lossless


# ---- export as safetensors ----------------------------------------------------------------


def _check_file_path(path: str | os.PathLike[str]) -> None:
    """PathError when `path` cannot take a file: a directory, or its
    directory missing (as hmem's other exports check, before reading)."""
    target = Path(validation.path_text(path, "the export path"))
    if is_store(target.parent) or any(is_store(p) for p in target.resolve().parents):
        raise InvalidArgumentError(f"{target} is inside an hmem store: an export never writes there")
    validation.file_to_write(target, "the export path")


@dataclasses.dataclass(frozen=True)
class SafetensorsExport:
    path: str
    layout: str
    chunks: tuple[str, ...]  # the keys exported, in file order
    entries: int  # ("split") the entries `hmem put` makes of the file
    bytes: int
    skipped: tuple[tuple[str, str], ...]  # (file name, why)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["skipped"] = [{"name": n, "reason": r} for n, r in self.skipped]
        out["chunks"] = list(self.chunks)
        return out


def export_safetensors(
    cache: CacheDirectory,
    path: str | os.PathLike[str],
    rows: Iterable[int] | np.ndarray | None = None,
    *,
    layout: str = "split",
    model: str | None = None,
) -> SafetensorsExport:
    """Write chunks of `cache` (`rows`, by default all) to a safetensors
    file, in their own dtype (BF16 bit-exact), in `layout`:

    - "split": hmem's per-layer entries, ``past_key_values.{layer}.key`` and
      ``.value`` [chunks, 1, tokens, hidden] (the convention hmem's hf
      export writes), one batch row per chunk: ``hmem put`` imports the
      file back as one entry per layer per chunk, layers kept.
      ``__metadata__["chunks"]`` lists each layer's chunk keys in batch
      order.  Every chunk of a layer must hold as many tokens.
    - "model": each chunk as it is, one tensor named by its key, shaped as
      LMCache keeps it ([2, layers, tokens, hidden]; a layer of a
      layerwise cache [tokens, 2, hidden]), ``__metadata__["memory_formats"]``
      giving each one's format.  Not a file ``hmem put`` reads.

    Chunks that cannot be read are skipped and listed; when none can,
    BadFileError.  `model` restores the model name of local_disk keys (as
    in ``export_fs_cache``)."""
    layout = validation.choice(layout, "layout", SAFETENSORS_LAYOUTS)
    _check_file_path(path)
    chosen = chunk_rows(cache, rows)
    chunks: list[tuple[str, ChunkFile]] = []
    skipped: list[tuple[str, str]] = []
    for row in chosen.tolist():
        name = str(cache.listing.name[row])
        try:
            chunk = read_chunk_file(cache, row)
            if chunk.info.kv_dtype not in FLOAT_DTYPES:
                raise BadFileError(f"its K/V are {chunk.info.kv_dtype}: only float K/V are exported")
            key = fmt.ChunkKey.parse(chunk.info.key)
            text = _renamed(key, model).text if key is not None else chunk.info.key
            if layout == "split":
                kv_layers(chunk.info, chunk.array)  # a format hmem cannot split is refused here
        except BadFileError as exc:
            skipped.append((name, exc.message))
            continue
        chunks.append((text, chunk))
    if not chunks:
        raise BadFileError(
            "no chunk to export" + (f": {skipped[0][0]}: {skipped[0][1]}" if skipped else ""),
            hint="local_disk files need the K/V shape (kv_shape, --kv-shape or --model-config)",
        )
    dtypes = {FLOAT_DTYPES[c.info.kv_dtype] for _, c in chunks}
    meta: dict[str, str] = {"format": "hmem-lmcache-export", "layout": layout, "cache": str(cache.path)}
    tensors: list[tuple[str, str, np.ndarray]] = []
    entries = 0
    if layout == "model":
        for text, c in chunks:
            tensors.append((text, FLOAT_DTYPES[c.info.kv_dtype], np.ascontiguousarray(c.array)))
        meta["memory_formats"] = json.dumps({text: c.info.memory_format for text, c in chunks})
    else:
        if len(dtypes) > 1:
            raise InvalidArgumentError(
                f"the chunks are of several dtypes ({', '.join(sorted(dtypes))}): export each dtype's chunks alone"
            )
        by_layer: dict[int, list[tuple[str, np.ndarray, np.ndarray]]] = {}
        for text, c in chunks:
            for layer, keys, values in kv_layers(c.info, c.array):
                by_layer.setdefault(layer, []).append((text, keys, values))
        listing: dict[str, list[str]] = {}
        for layer in sorted(by_layer):
            rows_of = by_layer[layer]
            shapes = {k.shape for _, k, _ in rows_of}
            if len(shapes) > 1:
                raise InvalidArgumentError(
                    f"layer {layer}'s chunks hold different token counts ({sorted(s[0] for s in shapes)}): "
                    "export them apart (a partial chunk alone)"
                )
            dtype = dtypes.copy().pop()
            for role, index in (("key", 1), ("value", 2)):
                stacked = np.stack([item[index] for item in rows_of])[:, None]  # [chunks, 1 head, tokens, hidden]
                tensors.append((f"past_key_values.{layer}.{role}", dtype, np.ascontiguousarray(stacked)))
            listing[str(layer)] = [text for text, _, _ in rows_of]
            entries += len(rows_of)
        meta["chunks"] = json.dumps(listing)
    header = safetensors.encode(((n, d, a.shape, a.nbytes) for n, d, a in tensors), meta)
    size = _io.write_file(Path(path), [header, *(safetensors.bytes_view(a) for _, _, a in tensors)])
    return SafetensorsExport(str(path), layout, tuple(t for t, _ in chunks), entries, size, tuple(skipped))
