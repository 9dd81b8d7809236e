"""An LMCache cache directory, read from its files alone: what it holds
(``stats``), each chunk (``chunk``, ``read``), and what is wrong with it
(``verify``, whose checks are hmem/lmcache/checks.py's).  LMCache itself
is never imported.

A directory is one of LMCache's caches when at least one of its files is
named as LMCache names a chunk (hmem/lmcache/listing.py); it may hold the
chunks of several models, world sizes, ranks, dtypes, tags and layers, and
even of several backends (local_disk ``.pt`` beside fs ``.data``): each
file is read as what its name makes it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from hmem import file_reads
from hmem.errors import CorruptStoreError, EntryNotFoundError, Hint, NotAStoreError, storage_error
from hmem.formats import lmcache as fmt
from hmem.formats.store_files import files_without_index, is_store
from hmem.lmcache import checks
from hmem.lmcache.geometry import KVShape
from hmem.lmcache.listing import (
    CHUNK_KINDS,
    DEBRIS,
    FOREIGN,
    FS,
    KINDS,
    LOCAL_DISK,
    MP,
    OTHER,
    CacheListing,
    list_cache,
)

# numpy's type for each KV dtype's elements: bfloat16 as its 16-bit words
# (numpy has no bfloat16), fp8 as bytes
NUMPY_DTYPES = {
    "half": "<f2",
    "bfloat16": "<u2",
    "float": "<f4",
    "double": "<f8",
    "int8": "i1",
    "uint8": "u1",
    "int16": "<i2",
    "int32": "<i4",
    "int64": "<i8",
    "bool": "?",
    "fp8_e4m3fn": "u1",
    "fp8_e4m3fnuz": "u1",
    "fp8_e5m2": "u1",
    "fp8_e5m2fnuz": "u1",
}
_HEAD_BYTES = 8 + 20 * 4  # an fs header of up to four groups, read in one go


def directory_kind(path: str | os.PathLike[str]) -> str:
    """What a path given to a command that takes a store or a cache is:
    ``store`` (an hmem store, a directory holding a store's files without
    its index, or no directory at all: the store's own checks say what is
    wrong), ``cache`` (an LMCache cache), or ``neither``."""
    p = Path(path)
    if not p.is_dir() or is_store(p):
        return "store"
    if is_cache(p):  # first: it reads names only up to the first chunk
        return "cache"
    return "store" if files_without_index(p) else "neither"


def is_cache(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a directory holding at least one file named as an
    LMCache chunk (and is not an hmem store)."""
    p = Path(path)
    if not p.is_dir() or is_store(p):
        return False
    try:
        with os.scandir(p) as entries:  # names only, up to the first chunk: no stat, no whole listing
            return any(fmt.key_of_file(e.name) is not None or fmt.ObjectName.parse(e.name) is not None for e in entries)
    except OSError:
        return False


@dataclasses.dataclass(frozen=True)
class ChunkInfo:
    """One chunk file: its key's fields, its size and times, and its shape
    when known (``shape_source`` says from what)."""

    name: str
    kind: str  # "local_disk", "fs" or "mp"
    key: str  # the key (in-process) or object name (mp) the file name spells
    model: str
    world_size: int
    rank: int
    chunk_hash: str
    kv_dtype: str
    layer: int | None
    tags: str
    group: int | None
    size: int
    mtime: float
    atime: float
    shape: tuple[int, ...] | None
    memory_format: str | None
    shape_source: str

    @property
    def tokens(self) -> int | None:
        if self.shape is None:
            return None
        if self.memory_format == "KV_T2D":
            return self.shape[0]
        return self.shape[2] if len(self.shape) == 4 else self.shape[1]

    def to_dict(self) -> dict:
        out = dict(self.__dict__)  # every field a scalar or a tuple of ints: asdict's deep copy is 7x slower
        out["shape"] = list(self.shape) if self.shape is not None else None
        out["tokens"] = self.tokens
        return out


@dataclasses.dataclass(frozen=True)
class GroupStats:
    """The chunks of one (backend, model, world size, rank, dtype, tags,
    layer, object group)."""

    kind: str
    model: str
    world_size: int
    rank: int
    kv_dtype: str
    tags: str
    layer: int | None
    group: int | None
    chunks: int
    bytes: int


@dataclasses.dataclass(frozen=True)
class CacheStats:
    path: str
    kinds: tuple[str, ...]  # the backends whose chunks the directory holds
    chunks: int
    bytes: int
    groups: tuple[GroupStats, ...]
    debris: tuple[str, ...]  # .tmp files: writes never renamed (or in flight)
    debris_bytes: int
    foreign: tuple[str, ...]  # regular files whose name is no chunk
    other: tuple[str, ...]  # directories, links, special files (never entered)
    kv_shape: dict | None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class CacheDirectory:
    """An LMCache cache directory as its files are when it is opened (call
    ``reload`` to list it again).  ``kv_shape`` gives the shape of chunks
    whose files do not carry one (local_disk, mp)."""

    def __init__(self, path: str | os.PathLike[str], *, kv_shape: KVShape | None = None, chunk_size: int = 256):
        self.path = Path(path)
        self.chunk_size = chunk_size
        self._given_shape = kv_shape
        self.reload()

    def reload(self) -> None:
        """List the directory again."""
        try:
            self.listing: CacheListing = list_cache(self.path)
        except OSError as exc:
            raise storage_error(exc, "list", self.path, writing=False) from exc
        self.kv_shape = self._given_shape or self._inferred_shape()

    # ---- what the directory holds ---------------------------------------------------------

    @property
    def kinds(self) -> tuple[str, ...]:
        present = np.unique(self.listing.kind[self.listing.kind <= MP])
        return tuple(KINDS[int(k)] for k in present)

    @property
    def layerwise(self) -> bool:
        return bool((self.listing.layer >= 0).any())

    @property
    def kv_shape_origin(self) -> str:
        """Where the shape of chunks whose files carry none comes from:
        ``given`` (kv_shape), ``model config`` (kv_shape_of_model),
        ``inferred`` (layerwise local_disk sizes), ``headers`` (no chunk
        needs one: fs files carry theirs), or ``unknown``."""
        shape = self.kv_shape
        if shape is None:
            needs = any(kind in ("local_disk", "mp") for kind in self.kinds)
            return "unknown" if needs else "headers"
        source = shape.source
        if source.startswith("given"):
            return "given"
        if "model config" in source:
            return "model config"
        if source.startswith("inferred"):
            return "inferred"
        return source

    def _inferred_shape(self) -> KVShape | None:
        """A layerwise local_disk cache's shape from its files: layers from
        the layer numbers, hidden from the size of a full chunk's layer
        file ([chunk_size, 2, hidden])."""
        ls = self.listing
        rows = (ls.kind == LOCAL_DISK) & (ls.layer >= 0)
        if not rows.any():
            return None
        sizes = ls.size[rows]
        values, counts = np.unique(sizes, return_counts=True)
        full = int(values[np.argmax(counts)])
        itemsizes = {fmt.KV_DTYPE_BYTES[d] for d in np.unique(ls.kv_dtype[rows]).tolist()}
        if len(itemsizes) != 1:
            return None
        per_token = 2 * self.chunk_size * itemsizes.pop()
        if full % per_token:
            return None
        layers = int(ls.layer[rows].max()) + 1
        return KVShape(
            layers,
            full // per_token,
            source=f"inferred from the layerwise files: {layers} layers, "
            f"{full} bytes a full chunk's layer at chunk size {self.chunk_size}",
        )

    def stats(self) -> CacheStats:
        ls = self.listing
        chunk = ls.kind <= MP
        chunk_rows = np.flatnonzero(chunk)
        # one code per (kind, model, world size, rank, dtype, tags, layer, group): each column's values
        # numbered, the numbers combined column by column and numbered again (text labels joined from
        # eight columns made ~1 GB of temporaries at 100,000 files: 1.4 s on a process's first call)
        code = np.zeros(len(chunk_rows), np.int64)
        for column in (ls.kind, ls.model, ls.world_size, ls.rank, ls.kv_dtype, ls.tags, ls.layer, ls.group):
            values = column[chunk_rows]
            distinct, numbers = np.unique(values.astype(str) if values.dtype == object else values, return_inverse=True)
            code = np.unique(code * len(distinct) + numbers, return_inverse=True)[1]
        labels, first, inverse = np.unique(code, return_index=True, return_inverse=True)
        counts = np.bincount(inverse, minlength=len(labels))
        sizes = np.bincount(inverse, weights=ls.size[chunk], minlength=len(labels))
        rows = chunk_rows[first]
        groups = tuple(
            GroupStats(
                kind=KINDS[int(ls.kind[r])],
                model=str(ls.model[r]),
                world_size=int(ls.world_size[r]),
                rank=int(ls.rank[r]),
                kv_dtype=str(ls.kv_dtype[r]),
                tags=str(ls.tags[r]),
                layer=int(ls.layer[r]) if ls.layer[r] >= 0 else None,
                group=int(ls.group[r]) if ls.group[r] >= 0 else None,
                chunks=int(c),
                bytes=int(b),
            )
            for r, c, b in zip(rows.tolist(), counts.tolist(), sizes.tolist())
        )
        debris = ls.kind == DEBRIS
        return CacheStats(
            path=str(self.path),
            kinds=self.kinds,
            chunks=int(chunk.sum()),
            bytes=int(ls.size[chunk].sum()),
            groups=groups,
            debris=tuple(ls.name[debris].tolist()),
            debris_bytes=int(ls.size[debris].sum()),
            foreign=tuple(ls.name[ls.kind == FOREIGN].tolist()),
            other=tuple(ls.name[ls.kind == OTHER].tolist()),
            kv_shape=self.kv_shape.to_dict() if self.kv_shape else None,
        )

    # ---- chunks ---------------------------------------------------------------------------

    def select(
        self,
        *,
        model: str | None = None,
        world_size: int | None = None,
        rank: int | None = None,
        kv_dtype: str | None = None,
        tag: str | None = None,
        layer: int | None = None,
        kind: str | None = None,
    ) -> np.ndarray:
        """The rows of the chunks that match every given field (`tag`:
        ``name%value``, or ``none`` for untagged chunks; `model` matches a
        local_disk file's model with each "/" as "-")."""
        ls = self.listing
        mask = ls.kind <= MP
        if kind is not None:
            mask &= ls.kind == KINDS.index(kind)
        if model is not None:
            local = ls.kind == LOCAL_DISK
            mask &= np.where(local, ls.model == model.replace("/", "-"), ls.model == model)
        for column, value in ((ls.world_size, world_size), (ls.rank, rank), (ls.layer, layer)):
            if value is not None:
                mask &= column == value
        if kv_dtype is not None:
            mask &= ls.kv_dtype == kv_dtype
        if tag is not None:
            if tag == "none":
                mask &= ls.tags == ""
            else:
                tagged = np.char.add(np.char.add("@", ls.tags.astype(str)), "@")
                mask &= np.char.find(tagged, f"@{tag}@") >= 0
        return np.flatnonzero(mask)

    def row_of(self, name_or_key: str) -> int:
        """The row of a chunk given by its file name or its key."""
        ls = self.listing
        candidates = [name_or_key]
        if not name_or_key.endswith((fmt.LOCAL_DISK_SUFFIX, fmt.FS_SUFFIX)):
            key = fmt.ChunkKey.parse(name_or_key)
            if key is not None:
                candidates = [key.fs_name(), key.local_disk_name()]
            else:
                candidates = [name_or_key.replace("/", fmt.FS_SEPARATOR) + fmt.FS_SUFFIX]
        for candidate in candidates:
            at = int(np.searchsorted(ls.name.astype(str), candidate))
            if at < len(ls) and ls.name[at] == candidate and ls.kind[at] <= MP:
                return at
        raise EntryNotFoundError(f"no chunk {name_or_key!r} in {self.path}")

    def chunks(self, rows: np.ndarray | None = None) -> Iterator[ChunkInfo]:
        """ChunkInfo of the given rows (all chunks by default), without
        reading any file: shapes of fs files come from ``chunk``."""
        if rows is None:
            rows = np.flatnonzero(self.listing.kind <= MP)
        for row in rows.tolist():
            yield self._info(row, None)

    def chunk(self, row: int) -> ChunkInfo:
        """One chunk, an fs chunk's header read."""
        return self.chunk_and_header(row)[0]

    def chunk_and_header(self, row: int) -> tuple[ChunkInfo, fmt.FsHeader | None]:
        """One chunk and the fs header its file begins with (None for a
        chunk of another kind, or an fs file without one): what verify
        compares its key with.

        An fs connector configured with ``save_chunk_meta: false`` writes
        the bytes without a header.  An fs file whose start is no header is
        read as such a file when the cache has a K/V shape its size fits
        exactly, whole tokens and at most a chunk of them (a file with a
        header is 28 bytes longer, which no real model's token bytes
        divide); otherwise its header is reported bad (CorruptStoreError)."""
        if self.listing.kind[row] != FS:
            return self._info(row, None), None
        try:
            header = self._header(row)
        except CorruptStoreError:
            shape, _, _ = self._shape(row, None, headerless=True)
            if shape is None or self._tokens_of(shape) > self.chunk_size:
                raise
            return self._info(row, None, headerless=True), None
        return self._info(row, header), header

    @staticmethod
    def _tokens_of(shape: tuple[int, ...]) -> int:
        return shape[2] if len(shape) == 4 else shape[0]

    def _info(self, row: int, header: fmt.FsHeader | None, *, headerless: bool = False) -> ChunkInfo:
        ls = self.listing
        kind = int(ls.kind[row])
        name = str(ls.name[row])
        shape, memory_format, source = self._shape(row, header, headerless=headerless)
        if kind == MP:
            key = name[: -len(fmt.FS_SUFFIX)]
        else:
            key = name[: -len(fmt.FS_SUFFIX if kind == FS else fmt.LOCAL_DISK_SUFFIX)].replace(fmt.FS_SEPARATOR, "/")
        return ChunkInfo(
            name=name,
            kind=KINDS[kind],
            key=key,
            model=str(ls.model[row]),
            world_size=int(ls.world_size[row]),
            rank=int(ls.rank[row]),
            chunk_hash=str(ls.chunk_hash[row]),
            kv_dtype=str(ls.kv_dtype[row]) or (header.groups[0][0] if header else ""),  # mp names carry none
            layer=int(ls.layer[row]) if ls.layer[row] >= 0 else None,
            tags=str(ls.tags[row]),
            group=int(ls.group[row]) if ls.group[row] >= 0 else None,
            size=int(ls.size[row]),
            mtime=int(ls.mtime_ns[row]) / 1e9,
            atime=int(ls.atime_ns[row]) / 1e9,
            shape=shape,
            memory_format=memory_format,
            shape_source=source,
        )

    def _header(self, row: int) -> fmt.FsHeader:
        path = self.listing.path(row)
        with _open(path) as f:
            head = f.read(_HEAD_BYTES)
            size = os.fstat(f.fileno()).st_size
            if len(head) >= 8 and size > _HEAD_BYTES:  # more groups than one read holds
                groups = (size - 8 - int.from_bytes(head[:4], "little", signed=True)) // 20
                if 0 < groups and 8 + 20 * groups > len(head):
                    head += f.read(8 + 20 * groups - len(head))
        return fmt.read_fs_header(head, size, path.name)

    def _shape(
        self, row: int, header: fmt.FsHeader | None, *, headerless: bool = False
    ) -> tuple[tuple[int, ...] | None, str | None, str]:
        """(shape, memory format, where the shape comes from) of a chunk;
        `headerless`: an fs file without a header, shaped as a local_disk one."""
        ls = self.listing
        if header is not None:
            if len(header.groups) == 1:
                return header.groups[0][1], header.memory_format, "the file's header"
            return None, header.memory_format, f"the file's header: {len(header.groups)} groups"
        if ls.kind[row] == FS and not headerless:
            return None, None, "the file's header (not read)"
        dtype = str(ls.kv_dtype[row])
        if self.kv_shape is None or (ls.kind[row] == MP and not dtype):
            return None, None, "unknown: the file holds bytes only (give --kv-shape or --model-config)"
        shape = self.kv_shape
        no_header = "; no header: an fs file written with save_chunk_meta: false" if headerless else ""
        hidden = shape.hidden_for(int(ls.world_size[row]))
        size = int(ls.size[row])
        itemsize = fmt.KV_DTYPE_BYTES[dtype]
        if ls.layer[row] >= 0:  # one layer: [tokens, 2, hidden] ([tokens, hidden] under MLA)
            per_token = shape.planes * hidden * itemsize
            dims: tuple[int, ...] = (shape.planes, hidden) if not shape.mla else (hidden,)
            tokens, rest = divmod(size, per_token)
            if rest or not tokens:
                return None, None, f"{size} bytes fit no whole token of {shape.source}"
            return (tokens, *dims), ("KV_T2D" if not shape.mla else "KV_MLA_FMT"), shape.source + no_header
        per_token = shape.planes * shape.layers * hidden * itemsize
        tokens, rest = divmod(size, per_token)
        if rest or not tokens:
            return None, None, f"{size} bytes fit no whole token of {shape.source}"
        return (
            (shape.planes, shape.layers, tokens, hidden),
            "KV_2LTD" if not shape.mla else "KV_MLA_FMT",
            shape.source + no_header,
        )

    def read(self, row: int) -> tuple[ChunkInfo, np.ndarray]:
        """A chunk's K/V as an array of its shape (bfloat16 as uint16
        words, fp8 as bytes).  CorruptStoreError when the file does not
        hold what its name and header say; ValueError-free."""
        info = self.chunk(row)
        if info.shape is None:
            raise CorruptStoreError(f"{info.name}: its shape is {info.shape_source}")
        dtype = np.dtype(NUMPY_DTYPES[info.kv_dtype])
        offset = info.size - int(np.prod(info.shape)) * dtype.itemsize
        path = self.listing.path(row)
        with _open(path) as f:
            f.seek(offset)
            data = f.read()
        if len(data) != info.size - offset:
            raise CorruptStoreError(f"{info.name}: changed while it was read (LMCache may be writing it)")
        return info, np.frombuffer(data, dtype=dtype).reshape(info.shape)

    # ---- verify ---------------------------------------------------------------------------

    def verify(self, *, deep: bool = False) -> checks.CacheVerifyReport:
        """Check every chunk file against its name, header and the K/V shape:
        an fs header against the file's size and the key's dtype; a file's
        size against the shape (a chunk holds whole tokens, at most a
        chunk's worth); names that are no chunk; files that cannot be read.
        `deep` also reads every chunk's bytes: a chunk of zeros only (space
        allocated, data never written) and non-finite values are findings.
        The checks are hmem/lmcache/checks.py's."""
        return checks.verify_cache(self, deep=deep)


def _open(path: Path) -> BinaryIO:
    """A chunk file to read: a regular file, never through a link."""
    return os.fdopen(file_reads.open_regular(path), "rb")


def open_cache(
    path: str | os.PathLike[str], *, kv_shape: KVShape | None = None, chunk_size: int = 256
) -> CacheDirectory:
    """Open the LMCache cache in directory `path`.  NotAStoreError when it
    is no directory, an hmem store, or holds no file named as a chunk."""
    p = Path(path)
    if not p.is_dir():
        raise NotAStoreError(f"{p} is not a directory")
    if is_store(p):
        raise NotAStoreError(f"{p} is an hmem store, not an LMCache cache")
    cache = CacheDirectory(p, kv_shape=kv_shape, chunk_size=chunk_size)
    if not (cache.listing.kind <= MP).any() and not (cache.listing.kind == DEBRIS).any():
        raise NotAStoreError(
            f"{p} holds no hmem store (no index.json) and no LMCache cache: "
            + (f"none of its {len(cache.listing)} entries is" if len(cache.listing) else "it is empty, no file")
            + " named as LMCache names a chunk (model@world@worker@hash@dtype.pt or .data)",
            hint=Hint.CREATE,
        )
    return cache


__all__ = [
    "CHUNK_KINDS",
    "FS",
    "LOCAL_DISK",
    "MP",
    "CacheDirectory",
    "CacheStats",
    "ChunkInfo",
    "GroupStats",
    "directory_kind",
    "is_cache",
    "open_cache",
]
