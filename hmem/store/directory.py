"""A store directory made or opened as the StoreState of its writer: the
directory's lock taken, what an interrupted writer left finished and its
leftovers removed.  A store on object storage is made and opened the same
way in its working copy (hmem/store/object_opening.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from hmem import _io
from hmem.config import StoreConfig
from hmem.errors import CorruptStoreError, Hint, StoreExistsError
from hmem.formats import manifest, records, stamp, store_files
from hmem.formats.manifest import Manifest
from hmem.store import lock, rewrite
from hmem.store.projection import Projector
from hmem.store.state import StoreState, load_records


def create_directory(root: Path, config: StoreConfig) -> StoreState:
    """Make a new store in the missing or empty directory `root` and take
    its lock: the writer's state of an empty store."""
    if (root / store_files.INDEX_FILE).exists():
        raise StoreExistsError(f"{root} already holds an hmem store", hint="open it instead")
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise StoreExistsError(f"{root} exists and is not an empty directory", hint="choose a new path for the store")
    _io.make_dir(root)
    writer = lock.WriterLock(root)
    try:
        projection = Projector(config.embed_dim, config.hdc_dim, config.seed).describe()
        _io.write_file(root / store_files.ENTRIES_FILE, [])
        mf, data = manifest.write(root, Manifest(config=config, projection=projection))
    except BaseException:
        writer.release()
        raise
    return StoreState(root, mf, writer=writer, verify_reads=True, manifest_bytes=data, loaded=records.empty(0, config))


def open_writer(root: Path, verify_reads: bool, lock_wait: float) -> StoreState:
    """The writer's state of the store directory `root`: its lock taken
    (waiting up to `lock_wait` seconds), what an interrupted writer left
    finished, its leftovers removed."""
    manifest.read_bytes(root)  # "not a store" before any lock file is made
    writer = lock.WriterLock(root, wait_seconds=lock_wait)
    try:
        data = manifest.read_bytes(root)
        mf = manifest.parse(root, data)
        evidence = stamp.stale_evidence(root, mf)
        if evidence is not None:  # leftovers are newer data here: never remove them
            raise CorruptStoreError(f"{root}: {evidence}", hint=Hint.ROLL_FORWARD)
        before = _directory_files(root)
        rewrite.finish_pending(root, mf)
        rewrite.remove_leftovers(root, mf)
        after = _directory_files(root)
        loaded = load_records(root, mf, follow_renames=False)
        return StoreState(
            root,
            mf,
            writer=writer,
            verify_reads=verify_reads,
            manifest_bytes=data,
            loaded=loaded,
            # what an interrupted writer left and this open removed: `hmem compact` reports it
            removed_at_open=(max(0, before[0] - after[0]), max(0, before[1] - after[1])),
        )
    except BaseException:
        writer.release()
        raise


def _directory_files(root: Path) -> tuple[int, int]:
    """How many files a store directory holds and their bytes (the lock aside)."""
    files = sum(
        1 for entry in os.scandir(root) if entry.name != store_files.LOCK_FILE and entry.is_file(follow_symlinks=False)
    )
    return files, store_files.directory_bytes(root)
