"""The batch import that `hmem put` runs (docs/cli.md, "hmem put"): every
file put whole or skipped with its reason, and recorded in the store's
import registry so that a file whose content the store already imported is
not imported again (hmem/formats/sources.py).  Reading a file into entries
is hmem/transfer/kv_import.py.

A file's entries go in together or not at all.  Small files are put
several at a time, with one put_many (what a put costs besides its data,
paid once for many files); when such a batch is refused, its files are put
one by one, so that only the bad ones are skipped.  A large file is put
alone, its rows made as the put takes them.  Files are hashed on a second
thread while they are read and put (hashlib lets go of the GIL), the next
files while a batch is put.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from hmem import _io, validation
from hmem.errors import BadFileError, InvalidArgumentError
from hmem.formats.sources import ImportedSource
from hmem.store import kv_layouts
from hmem.store.store import Entry, Store
from hmem.transfer.kv_import import KvFile, entries_of, find_files

__all__ = ["FileResult", "ImportReport", "import_files"]

LARGE_FILE_BYTES = 4 << 20  # from this size on a file is put alone, its rows made as the put takes them
HASH_BESIDE_BYTES = (
    64 << 10
)  # from this size on a file is hashed on the second thread (below, handing it over costs more)
BATCH_BYTES = 16 << 20  # small files put together, up to this many bytes of files
BATCH_FILES = 512  # or this many files
AHEAD_BYTES = 16 << 20  # files opened and hashed this many bytes ahead of the one being read


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
    files: tuple[FileResult, ...]  # the files done (imported, skipped or imported before), in order
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


@dataclasses.dataclass
class _Read:
    """A small file read and checked, waiting for its batch's put."""

    path: Path
    size: int
    digest: concurrent.futures.Future[str]  # its SHA-256, hashed beside the reading and the put
    entries: list[Entry]


@dataclasses.dataclass(frozen=True)
class _Options:
    layer: int | None
    importance: float | None
    layout: str | None
    chunk_tokens: int | None
    embed_dim: int
    dry_run: bool
    again: bool


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
    """Put the entries of every file, each file whole or not at all; skip
    bad files with their reason (and a hint; `layouts` when the file's
    layout is ambiguous).  `layout` (one of hmem.LAYOUTS) says how every
    per-head tensor is laid out; `chunk_tokens` stores each sequence as
    entries of that many tokens.  With `dry_run`, everything is read and
    checked and nothing is written (the store may be read-only).
    `progress` is called after each file, in order.  The caller flushes (or
    closes) the store.

    The store's own files are never imported (``find_files`` with `store`):
    a path that is the store or lies inside it raises InvalidArgumentError
    before anything is put.  `should_stop` is asked before each file; when
    it returns True the import ends there, every file before it done whole,
    and the report lists the files not started (``not_started``).

    Each file imported is recorded in the store's import registry (its
    SHA-256, size and name, committed with its entries), and a file whose
    content the registry holds (an earlier file of the same import
    included) is not imported again (``imported_before`` says as what) unless
    `again`: re-running an import stores exactly what is missing."""
    if layer is not None:
        layer = validation.layer_index(layer, "layer")
    if importance is not None:
        importance = validation.importance(importance)
    if layout is not None:
        layout = validation.choice(layout, "layout", kv_layouts.LAYOUTS)
    if chunk_tokens is not None:
        chunk_tokens = validation.integer(chunk_tokens, "chunk_tokens", low=1)
    again = validation.flag(again, "again")
    options = _Options(
        layer, importance, layout, chunk_tokens, store.config.embed_dim, validation.flag(dry_run, "dry_run"), again
    )
    files = find_files(paths, store=store.path)
    # Only a file of a size the registry holds can be in it: others are not looked up.
    known_sizes = {s.bytes for s in store.imported_sources()} if not again else set()  # grows as files go in
    results: list[FileResult] = []
    batch: list[_Read] = []
    batch_bytes = 0

    def done(*new: FileResult) -> None:
        for result in new:
            results.append(result)
            if progress is not None:
                progress(result)

    def put_batch() -> None:
        nonlocal batch_bytes
        done(*_put_batch(store, batch, options, known_sizes))
        batch.clear()
        batch_bytes = 0

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hmem-hash") as hashing:
        for i, (path, f, digest) in enumerate(_opened(files, hashing)):
            _io.crash_point("import.file")
            if should_stop is not None and should_stop():
                put_batch()
                return ImportReport(tuple(results), options.dry_run, tuple(str(p) for p in files[i:]))
            try:
                if isinstance(f, Exception):
                    raise f
                if f.size >= LARGE_FILE_BYTES:
                    put_batch()
                    done(_import_large(store, f, path, digest, known_sizes, options))
                    continue
                before = store.find_source(digest.result(), f.size) if not again and f.size in known_sizes else None
                if before is not None:
                    put_batch()
                    done(FileResult(str(path), (), 0, f.size, imported_before=before, sha256=before.sha256))
                    continue
                entries = list(entries_of(f, path.name, *_reading(options), words=True))
                batch.append(_Read(path, f.size, digest, entries))
                batch_bytes += f.size
            except (BadFileError, InvalidArgumentError) as exc:
                put_batch()
                done(_skip(path, exc))
                continue
            if len(batch) >= BATCH_FILES or batch_bytes >= BATCH_BYTES:
                put_batch()
        put_batch()
    return ImportReport(tuple(results), options.dry_run)


def _opened(
    files: list[Path], hashing: concurrent.futures.Executor
) -> Iterator[tuple[Path, KvFile | BadFileError, concurrent.futures.Future[str]]]:
    """Each file opened (or why it cannot be) with its SHA-256 to come,
    opened and handed to the hashing thread up to AHEAD_BYTES before the
    caller takes it: the next batch is hashed while this one is put."""
    ahead: collections.deque[tuple[Path, KvFile | BadFileError, concurrent.futures.Future[str]]]
    ahead = collections.deque()
    queued = 0
    rest = iter(files)
    while True:
        while queued < AHEAD_BYTES and (path := next(rest, None)) is not None:
            try:
                opened = KvFile(path)
            except BadFileError as exc:
                ahead.append((path, exc, concurrent.futures.Future()))
                continue
            ahead.append((path, opened, _hash(hashing, opened)))
            queued += opened.size
        if not ahead:
            return
        item = ahead.popleft()
        if isinstance(item[1], KvFile):
            queued -= item[1].size
        yield item


def _reading(options: _Options) -> tuple[Any, ...]:
    return options.layer, options.importance, options.layout, options.chunk_tokens, options.embed_dim


def _put_batch(store: Store, batch: list[_Read], options: _Options, known_sizes: set[int]) -> list[FileResult]:
    """Put the files of `batch` with one put; when it is refused, file by
    file, each bad one skipped with its reason.  The sizes of the files
    recorded join `known_sizes` (a copy later in the import is found); a
    copy of an earlier file of the batch is found here."""
    if not batch:
        return []
    if not options.again:
        firsts: dict[tuple[str, int], _Read] = {}
        for read in batch:
            firsts.setdefault((read.digest.result(), read.size), read)
        if len(firsts) < len(batch):  # copies: put the firsts, then say the copies are in already
            put = dict(zip(firsts, _put_batch(store, list(firsts.values()), options, known_sizes)))
            return [
                put[key] if firsts[key] is read else _copy_of(store, read, put[key])
                for read, key in ((read, (read.digest.result(), read.size)) for read in batch)
            ]
    entries = [entry for read in batch for entry in read.entries]
    try:
        if options.dry_run:
            store.check_entries(entries)
            return [FileResult(str(r.path), (), len(r.entries), r.size, sha256=r.digest.result()) for r in batch]
        ids = store.put_many(entries)
    except (BadFileError, InvalidArgumentError) as exc:
        if len(batch) == 1:
            return [_skip(batch[0].path, exc)]
        return [result for read in batch for result in _put_batch(store, [read], options, known_sizes)]
    out, start = [], 0
    for read in batch:
        mine = ids[start : start + len(read.entries)]
        start += len(read.entries)
        digest = read.digest.result()
        store.record_source(read.path.name, digest, read.size, mine)  # committed with the entries
        known_sizes.add(read.size)
        out.append(FileResult(str(read.path), tuple(mine), len(mine), read.size, sha256=digest))
    return out


def _copy_of(store: Store, read: _Read, original: FileResult) -> FileResult:
    """A file of a batch whose content an earlier file of the batch had:
    imported before when that one was, skipped as that one was."""
    if original.entries:
        before = store.find_source(original.sha256 or "", read.size)
        if before is not None:
            return FileResult(str(read.path), (), 0, read.size, imported_before=before, sha256=before.sha256)
    return dataclasses.replace(original, path=str(read.path))  # skipped, or a dry run


def _import_large(
    store: Store,
    f: KvFile,
    path: Path,
    digest: concurrent.futures.Future[str],
    known_sizes: set[int],
    options: _Options,
) -> FileResult:
    """A large file alone: its rows made as the put takes them, hashed beside
    the put unless its size says it may be imported already."""
    if not options.again and f.size in known_sizes:
        before = store.find_source(digest.result(), f.size)
        if before is not None:
            return FileResult(str(path), (), 0, f.size, imported_before=before, sha256=before.sha256)
    entries = entries_of(f, path.name, *_reading(options), words=True)
    try:
        if options.dry_run:
            planned = store.check_entries(entries)
            result = FileResult(str(path), (), planned, f.size, sha256=digest.result())
        else:
            # put_many checks every entry before it stores any: the file goes in whole or not at all
            ids = store.put_many(entries)
            store.record_source(path.name, digest.result(), f.size, ids)  # committed with the entries
            known_sizes.add(f.size)
            result = FileResult(str(path), tuple(ids), len(ids), f.size, sha256=digest.result())
    except (BadFileError, InvalidArgumentError) as exc:
        return _skip(path, exc)
    return result


def _skip(path: Path, exc: BadFileError | InvalidArgumentError) -> FileResult:
    size = path.stat().st_size if path.is_file() else 0
    return FileResult(str(path), (), 0, size, skipped=exc.message, hint=exc.hint, layouts=getattr(exc, "layouts", ()))


def _hash(hashing: concurrent.futures.Executor, f: KvFile) -> concurrent.futures.Future[str]:
    """The file's SHA-256, on the second thread when the file is large
    enough to gain from it (hashlib lets go of the GIL while it hashes)."""
    if f.size >= HASH_BESIDE_BYTES:
        return hashing.submit(_sha256, f.data())
    done: concurrent.futures.Future[str] = concurrent.futures.Future()
    done.set_result(_sha256(f.data()))
    return done


def _sha256(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()
