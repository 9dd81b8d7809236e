"""LMCache chunks into an hmem store (docs/lmcache.md, "Import and
export"): ``import_cache`` puts a cache's chunks into a store as entries.

Import: one entry per layer per chunk: the layer's keys and values, rows
[tokens, hidden] (bfloat16 chunks as their words, so a bf16 store keeps
them bit-exact; half and float as they are).  A layerwise cache's file is
one layer of one chunk: one entry.  An MLA chunk ([1, layers, tokens,
latent]) has one latent per token and layer, not a key and a value: it is
stored as the entry's keys and as its values both (an entry needs both),
and written back once by an export.  Each entry's meta (flat, as an entry's meta is):
``source`` (the file name), ``tokens`` ([0, tokens]: the rows of the
chunk), ``lmcache_key`` (the key text: model, world size, rank, chunk
hash, dtype, layer and tags), ``lmcache_kind`` (local_disk, fs),
``lmcache_chunk_hash``, ``lmcache_layer``, ``lmcache_memory_format``,
``lmcache_shape`` (the file's), ``lmcache_mla`` for an MLA latent, and
``lmcache_request_tokens`` (the chunk's token range within a request)
when the requests' tokens are given: a file alone does not say which
chunk of a request it is (its hash depends on every chunk before it),
only how many tokens it holds.

A chunk file is recorded in the store's import registry (its SHA-256, size
and name): importing the same cache again adds nothing.  Files with the
same bytes under other names (a tagged request's chunks hold the same K/V
as the untagged ones) are other keys and are imported each.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hmem import validation
from hmem.errors import BadFileError, InvalidArgumentError
from hmem.formats import lmcache as fmt
from hmem.formats.sources import ImportedSource
from hmem.lmcache.cache import CacheDirectory
from hmem.lmcache.chunk_data import FLOAT_DTYPES, ChunkFile, chunk_rows, key_text, kv_layers, read_chunk_file
from hmem.store.prepare import Entry
from hmem.store.storage import Bf16Rows

if TYPE_CHECKING:
    from hmem.store.store import Store

__all__ = ["CacheImportReport", "ChunkImport", "import_cache"]

BATCH_BYTES = 16 << 20  # chunk files put together, up to this many bytes
BATCH_FILES = 512  # or this many files


@dataclasses.dataclass(frozen=True)
class ChunkImport:
    """One chunk file of an import: what it became, or why not."""

    name: str  # the file's name
    key: str  # the LMCache key its name spells
    entries: tuple[int, ...] = ()  # ids stored (empty on a dry run, a skip, or imported before)
    planned: int = 0  # entries found in the file
    bytes: int = 0
    skipped: str | None = None
    hint: str | None = None
    imported_before: ImportedSource | None = None
    sha256: str | None = None
    request_tokens: tuple[int, int] | None = None  # its token range within a request given, when found

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["entries"] = list(self.entries)
        out["request_tokens"] = list(self.request_tokens) if self.request_tokens else None
        return out


@dataclasses.dataclass(frozen=True)
class CacheImportReport:
    cache: str
    chunks: tuple[ChunkImport, ...]
    dry_run: bool
    not_started: tuple[str, ...] = ()  # files left when `should_stop` stopped the import

    @property
    def entries_added(self) -> int:
        return sum(len(c.entries) for c in self.chunks)

    @property
    def entries_found(self) -> int:
        return sum(c.planned for c in self.chunks if c.skipped is None)

    @property
    def imported(self) -> tuple[ChunkImport, ...]:
        return tuple(c for c in self.chunks if c.skipped is None and c.imported_before is None)

    @property
    def skipped(self) -> tuple[ChunkImport, ...]:
        return tuple(c for c in self.chunks if c.skipped is not None)

    @property
    def already_imported(self) -> tuple[ChunkImport, ...]:
        return tuple(c for c in self.chunks if c.imported_before is not None)

    @property
    def bytes_read(self) -> int:
        return sum(c.bytes for c in self.chunks)

    @property
    def located(self) -> int:
        """Chunks imported (or checked) whose token range the requests gave."""
        return sum(c.request_tokens is not None for c in self.chunks if c.skipped is None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "cache": self.cache,
            "chunks_located": self.located,
            "dry_run": self.dry_run,
            "chunks": len(self.chunks) + len(self.not_started),
            "chunks_imported": len(self.imported),
            "chunks_skipped": len(self.skipped),
            "chunks_already_imported": len(self.already_imported),
            "entries_added": self.entries_added,
            "entries_found": self.entries_found,
            "bytes_read": self.bytes_read,
            "files": [c.to_dict() for c in self.chunks],
            "not_started": list(self.not_started),
        }


@dataclasses.dataclass
class _Pending:
    chunk: ChunkFile
    digest: str
    entries: list[Entry]
    span: tuple[int, int] | None


def _request_ranges(
    requests: Iterable[Sequence[int]] | None, chunk_size: int, none_hash: int
) -> dict[int, tuple[int, int]]:
    """Chunk hash -> its token range within the first request that holds it."""
    ranges: dict[int, tuple[int, int]] = {}
    for tokens in requests or ():
        for index, value in enumerate(fmt.chunk_hashes(list(tokens), chunk_size, none_hash=none_hash)):
            ranges.setdefault(value, (index * chunk_size, (index + 1) * chunk_size))
    return ranges


def _entries(chunk: ChunkFile, importance: float, ranges: dict[int, tuple[int, int]]) -> list[Entry]:
    info = chunk.info
    if info.kv_dtype not in FLOAT_DTYPES:
        raise BadFileError(f"its K/V are {info.kv_dtype}: hmem imports float K/V only (half, bfloat16, float, double)")
    assert info.shape is not None
    common: dict[str, Any] = {
        "lmcache_key": info.key,
        "lmcache_kind": info.kind,
        "lmcache_chunk_hash": info.chunk_hash,
        "lmcache_memory_format": info.memory_format,
        "lmcache_shape": list(info.shape),
    }
    if info.memory_format == "KV_MLA_FMT":
        common["lmcache_mla"] = True  # the latent, stored as keys and as values
    span = ranges.get(int(info.chunk_hash, 16)) if ranges else None
    if span is not None:
        common["lmcache_request_tokens"] = list(span)
    out = []
    for layer, keys, values in kv_layers(info, chunk.array):
        meta = {"source": info.name, "tokens": [0, int(keys.shape[0])], **common, "lmcache_layer": layer}
        if info.kv_dtype == "bfloat16":
            out.append(Entry(Bf16Rows(keys), Bf16Rows(values), layer, importance, meta))
        else:
            out.append(Entry(keys, values, layer, importance, meta))
    return out


def import_cache(
    store: Store,
    cache: CacheDirectory,
    rows: Iterable[int] | np.ndarray | None = None,
    *,
    importance: float = 1.0,
    requests: Iterable[Sequence[int]] | None = None,
    none_hash: int = 0,
    again: bool = False,
    dry_run: bool = False,
    progress: Callable[[ChunkImport], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> CacheImportReport:
    """Put the chunks of `cache` (the listing rows `rows`, by default every
    chunk) into `store`: one entry per layer per chunk (see the module's
    docstring for its rows and meta), each file whole or not at all.  A
    file that cannot be imported (unknown shape: give the cache a kv_shape;
    a dtype hmem does not store; a multiprocess object; rows the store's
    embed_dim does not take) is skipped with the reason.

    Each file is recorded in the store's import registry (SHA-256 of its
    bytes, size, name); a file the registry holds under the same name and
    content is not imported again unless `again`.  `requests`: the token
    ids of requests, from which each chunk's token range within a request
    is found (chunk hashes from `none_hash`, the cache's chunk size).  With
    `dry_run`, files are read and checked and nothing is stored.  The
    caller flushes the store."""
    importance = validation.importance(importance)
    again = validation.flag(again, "again")
    dry_run = validation.flag(dry_run, "dry_run")
    chosen = chunk_rows(cache, rows)
    ranges = _request_ranges(requests, cache.chunk_size, none_hash)
    known: dict[tuple[str, int, str], ImportedSource] = (
        {} if again else {(s.sha256, s.bytes, s.name): s for s in store.imported_sources()}
    )
    results: list[ChunkImport] = []
    batch: list[_Pending] = []
    batch_bytes = 0

    def done(*new: ChunkImport) -> None:
        for result in new:
            results.append(result)
            if progress is not None:
                progress(result)

    def flush_batch() -> None:
        nonlocal batch_bytes
        done(*_put(store, batch, dry_run, known))
        batch.clear()
        batch_bytes = 0

    names = cache.listing.name
    for i, row in enumerate(chosen.tolist()):
        if should_stop is not None and should_stop():
            flush_batch()
            left = tuple(str(names[r]) for r in chosen[i:].tolist())
            return CacheImportReport(str(cache.path), tuple(results), dry_run, left)
        name = str(names[row])
        key = key_text(name)
        try:
            chunk = read_chunk_file(cache, row)
            digest = hashlib.sha256(chunk.data).hexdigest()
            before = known.get((digest, len(chunk.data), name))
            if before is not None:
                done(ChunkImport(name, key, bytes=len(chunk.data), imported_before=before, sha256=digest))
                continue
            entries = _entries(chunk, importance, ranges)
            span = ranges.get(int(chunk.info.chunk_hash, 16)) if ranges else None
        except BadFileError as exc:
            done(ChunkImport(name, key, bytes=int(cache.listing.size[row]), skipped=exc.message, hint=exc.hint))
            continue
        batch.append(_Pending(chunk, digest, entries, span))
        batch_bytes += len(chunk.data)
        if len(batch) >= BATCH_FILES or batch_bytes >= BATCH_BYTES:
            flush_batch()
    flush_batch()
    return CacheImportReport(str(cache.path), tuple(results), dry_run)


def _put(
    store: Store, batch: list[_Pending], dry_run: bool, known: dict[tuple[str, int, str], ImportedSource]
) -> list[ChunkImport]:
    """One put of the batch's files; when it is refused, file by file,
    each bad one skipped with its reason."""
    if not batch:
        return []
    entries = [entry for pending in batch for entry in pending.entries]
    try:
        if dry_run:
            store.check_entries(entries)
            return [
                ChunkImport(
                    p.chunk.info.name,
                    p.chunk.info.key,
                    (),
                    len(p.entries),
                    len(p.chunk.data),
                    sha256=p.digest,
                    request_tokens=p.span,
                )
                for p in batch
            ]
        ids = store.put_many(entries)
    except (BadFileError, InvalidArgumentError) as exc:
        if len(batch) == 1:
            info = batch[0].chunk.info
            return [ChunkImport(info.name, info.key, bytes=info.size, skipped=exc.message, hint=exc.hint)]
        return [result for pending in batch for result in _put(store, [pending], dry_run, known)]
    out, start = [], 0
    for pending in batch:
        info, size = pending.chunk.info, len(pending.chunk.data)
        mine = ids[start : start + len(pending.entries)]
        start += len(pending.entries)
        known[(pending.digest, size, info.name)] = store.record_source(info.name, pending.digest, size, mine)
        out.append(
            ChunkImport(
                info.name, info.key, tuple(mine), len(mine), size, sha256=pending.digest, request_tokens=pending.span
            )
        )
    return out
