"""copy_store: a store's last commit copied whole to a new place, between
a directory and object storage in either direction (or between two of
either): how a local store moves to S3, and how an object store is backed
up to disk (docs/cli.md, "hmem copy").

The copy is of the files, byte for byte: shard files, the records,
pooled.bin, sources.jsonl and index.json, so ids, scores, access counts and
the import registry come along.  The source is held still while it is read
(its writer lock, or its lease); the destination is written as a new store
would be: on disk index.json last (the commit point), on object storage the
manifest last, create-only.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from hmem import _io, file_reads, validation
from hmem.errors import CorruptStoreError, Hint, StoreExistsError
from hmem.formats import manifest, store_files
from hmem.formats.manifest import Manifest, Pending
from hmem.object_store import is_url
from hmem.store.object_link import ObjectLink, committed_sizes
from hmem.store.store import Store


@dataclasses.dataclass(frozen=True)
class CopyReport:
    source: str
    destination: str
    entries: int  # live entries
    records: int  # records copied (evicted ones included, until a compaction)
    shards: int
    bytes: int  # bytes of the files copied


def copy_store(
    source: str | os.PathLike,
    destination: str | os.PathLike,
    *,
    lock_wait: float = 0.0,
    source_options: dict[str, Any] | None = None,
    destination_options: dict[str, Any] | None = None,
) -> CopyReport:
    """Copy the store at `source` to `destination` (a missing or empty
    directory, or a URL holding no store).  Each may be a directory or
    s3://bucket/prefix, with its own storage_options.  The source's writer
    lock (or lease) is held while it is read, waiting up to `lock_wait`
    seconds for it."""
    lock_wait = validation.wait_seconds(lock_wait, "lock_wait")  # a URL's lease is taken here, not by open
    source_name, destination_name = str(source), str(destination)
    _refuse_existing(destination, destination_options)
    held: Store | None = None
    link: ObjectLink | None = None
    try:
        if is_url(source_name):
            link = ObjectLink(source_name, source_options)
            link.read_manifest()
            link.take_lease(lock_wait)  # nothing changes it meanwhile
            directory = link.materialize()
            assert link.manifest is not None
            committed = manifest.parse(directory, link.manifest.index)
            link.download_shards(directory, committed.shards)
        else:
            held = Store.open(source, lock_wait=lock_wait, storage_options=source_options)
            held.flush()
            directory, committed = held._state.path, held._state.committed
        report = _write(directory, committed, destination, destination_options)
        live = sum(info.entries - info.dead_entries for info in committed.shards)
        return dataclasses.replace(report, source=source_name, destination=destination_name, entries=live)
    finally:
        if held is not None:
            held.close()
        if link is not None:
            link.close()


def _refuse_existing(destination: Any, options: dict[str, Any] | None) -> None:
    if is_url(str(destination)):
        return  # the create-only commit refuses it; checked again before any upload
    root = Path(validation.store_directory(destination, "the destination"))  # "" and a file: as for every command
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise StoreExistsError(f"{root} exists and is not an empty directory", hint="choose a new path for the copy")


def _refuse_sparse(directory: Path, committed: Manifest) -> None:
    """Refuse (CorruptStoreError) to copy a store whose shard is mostly
    holes, before anything is written: a copy writes every byte of a shard
    as data, so a size claimed for free would cost the destination for real
    (docs/security.md, "Bounded memory and time").  A shard whose holes
    stand for runs of zeros (``cp --sparse=always``) is copied, its holes
    written as the zeros they read as."""
    for info in committed.shards:
        try:
            fd = _io.open_regular(directory / info.file)
        except FileNotFoundError:
            continue  # the copy itself reports it, as before
        try:
            sparse = file_reads.too_sparse(fd)
        finally:
            os.close(fd)
        if sparse is not None:
            raise CorruptStoreError(
                f"shard {info.file} of {directory} is damaged: it {sparse}; nothing was copied",
                hint=Hint.VERIFY_THEN_REPAIR,
            )


def _write(directory: Path, committed: Manifest, destination: Any, options: dict[str, Any] | None) -> CopyReport:
    _refuse_sparse(directory, committed)
    shard_bytes = sum(info.bytes for info in committed.shards)
    sizes = committed_sizes(directory, committed)
    total = shard_bytes + sum(sizes.values())
    report = CopyReport("", "", 0, committed.record_count, len(committed.shards), total)
    if is_url(str(destination)):
        target = ObjectLink(str(destination), options)
        try:
            target.claim_new()
            target.create(directory, committed)
        finally:
            target.close()
        return report
    root = Path(destination)
    _io.make_dir(root)
    for info in committed.shards:
        _io.write_file(root / info.file, [_io.FileRange(directory / info.file, 0, info.bytes)])
    for name, size in sizes.items():
        if size or name == store_files.ENTRIES_FILE:
            _io.write_file(root / name, [_io.FileRange(directory / name, 0, size)])
    # index.json last: until it exists the directory holds no store
    manifest.write(root, dataclasses.replace(committed, pending=Pending()))  # every step was done at the source
    return report


__all__ = ["CopyReport", "copy_store"]
