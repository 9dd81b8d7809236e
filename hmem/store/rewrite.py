"""Rewriting a store's files: what compaction and repair share.

Given the records to keep and where each of their tensors lies now (a range
of an old shard file, already checked against its CRC), write fresh shards
packed up to shard_max_bytes and numbered from 0, a fresh entries.bin and
a fresh pooled.bin (hmem/formats/pooled.py), under temporary names; commit index.json naming them with pending renames
(temporary -> final) and deletes (old files); then do the renames and
deletes.  A crash before the commit leaves the old state (the temporary
files are leftovers the next writer removes); after it, the new state (the
next writer finishes the pending steps).  docs/format.md, "Compaction".
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from hmem import _io
from hmem.errors import CorruptStoreError, Hint, UnsafeFileError
from hmem.formats import manifest, pooled, records, shard_file, stamp, store_files
from hmem.formats.manifest import Manifest, Pending, ShardInfo
from hmem.formats.store_files import ENTRIES_FILE, POOLED_FILE
from hmem.kernels import checksum as checksum_kernels
from hmem.store import shard_builder

# kind -> (dtype, shape, where the bytes are, their checked CRC-32C)
TensorSources = dict[str, tuple[np.dtype, tuple[int, ...], _io.FileRange, int]]
# An entry's tensor sources and its metadata (JSON, or None), carried over as they are.
EntrySource = tuple[TensorSources, str | None]

TEMP_PREFIX = store_files.REWRITE_PREFIX


def pack(sizes: np.ndarray, limit: int) -> list[int]:
    """Entries per shard when entries of `sizes` bytes fill shards in order
    up to `limit` bytes each (an entry larger than the limit alone)."""
    counts = []
    ends = np.cumsum(sizes)
    start, total = 0, len(sizes)
    budget = limit - shard_file.HEADER_FIXED_BYTES
    while start < total:
        base = ends[start - 1] if start else 0
        stop = max(int(np.searchsorted(ends, base + budget, side="right")), start + 1)
        counts.append(stop - start)
        start = stop
    return counts


def rewrite(
    root: Path,
    base: Manifest,
    kept: np.ndarray,
    sources: Sequence[Callable[[], EntrySource]],
    sizes: np.ndarray,
    deletes: Sequence[str],
    *,
    config_json: str,
    crash_prefix: str,
    progress: Callable[[int, int], None] | None = None,
    more_renames: Sequence[tuple[str, str]] = (),
) -> tuple[Manifest, np.ndarray]:
    """Write the store anew with the records `kept` (in order; sources[i]()
    gives where record i's tensors are and its metadata, sizes[i] its bytes
    in a shard) and
    commit it over `base`; old files in `deletes` go after the commit.
    `more_renames`: (temporary, final) names of other files the caller wrote,
    renamed with the rest once committed (repair's new sources.jsonl).
    Returns the committed manifest and the new records."""
    groups = pack(sizes, base.config.shard_max_bytes)
    new_records = kept.copy()
    new_shards: list[ShardInfo] = []
    renames: list[tuple[str, str]] = []
    pooled_keys: list[tuple[_io.FileRange, int]] = []  # each entry's "p" tensor and its CRC
    start, done, total = 0, 0, int(sizes.sum())
    for j, count in enumerate(groups):
        builder = shard_builder.ShardBuilder(j, uuid.uuid4().hex, config_json)
        for i in range(start, start + count):
            tensors, meta = sources[i]()
            builder.add_lent_entry(int(kept["entry_id"][i]), int(kept["n_tokens"][i]), tensors, meta)
            pooled_keys.append((tensors["p"][2], tensors["p"][3]))
        name = store_files.shard_file(j)
        size, index_crc = builder.seal(root / (TEMP_PREFIX + name))
        new_shards.append(
            ShardInfo(file=name, bytes=size, uid=builder.uid, entries=builder.entries, index_crc=index_crc)
        )
        renames.append((TEMP_PREFIX + name, name))
        new_records["shard_idx"][start : start + count] = j
        start += count
        done += int(sizes[start - count : start].sum())
        _io.crash_point(f"{crash_prefix}.shard_written")
        if progress is not None:
            progress(done, total)
    _io.crash_point(f"{crash_prefix}.shards_written")
    records.seal(new_records)
    entries_temp = TEMP_PREFIX + ENTRIES_FILE
    _io.write_file(root / entries_temp, [new_records.tobytes()])
    renames.append((entries_temp, ENTRIES_FILE))
    pooled_temp = TEMP_PREFIX + POOLED_FILE
    _io.write_file(
        root / pooled_temp, [pooled_rows(new_records["entry_id"], pooled_keys, base.config.pooled_width).tobytes()]
    )
    renames.append((pooled_temp, POOLED_FILE))
    renames.extend(more_renames)
    _io.crash_point(f"{crash_prefix}.records_written")
    keep = {info.file for info in new_shards}
    mf = dataclasses.replace(
        base,
        generation=base.generation + 1,
        record_count=len(new_records),
        shards=tuple(new_shards),
        pending=Pending(renames=tuple(renames), deletes=tuple(sorted({name for name in deletes if name not in keep}))),
    )
    manifest.write(root, mf)
    stamp.write(root, mf)  # after the commit, never before (hmem/formats/stamp.py)
    _io.crash_point(f"{crash_prefix}.committed")
    finish_pending(root, mf)
    _io.crash_point(f"{crash_prefix}.finished")
    # Done: commit again without the finished steps (the store must not grow).
    clean = dataclasses.replace(mf, generation=mf.generation + 1, pending=Pending())
    committed = manifest.write(root, clean)[0]
    stamp.write(root, committed)
    return committed, new_records


def pooled_rows(entry_ids: np.ndarray, keys: Sequence[tuple[_io.FileRange, int]], width: int) -> np.ndarray:
    """pooled.bin's rows for the kept entries, their keys read from the
    shards and checked against their CRC-32C."""
    raw = np.frombuffer(_io.read_ranges([where for where, _ in keys]), dtype=np.uint8)
    raw = raw.reshape(len(keys), 4 * width)
    bad = np.flatnonzero(checksum_kernels.crc32c_rows(raw, 0, 0) != np.array([crc for _, crc in keys], np.uint32))
    if len(bad):
        where = keys[int(bad[0])][0]
        raise CorruptStoreError(
            f"tensor p_{int(entry_ids[bad[0]])} in {where.path.name} fails its checksum", hint=Hint.VERIFY_THEN_REPAIR
        )
    return pooled.make_rows(entry_ids, raw.view("<f4"))


def finish_pending(root: Path, mf: Manifest) -> None:
    """Redo the steps the last commit listed (all idempotent): renames first,
    then record fields in place, then deletions."""
    _io.rename_many([(root / src, root / dst) for src, dst in mf.pending.renames if (root / src).exists()])
    updates = mf.pending.record_updates
    if len(updates):
        # The updates name committed records (manifest.parse): entries.bin
        # must hold them all as data before any is written in place, or a
        # claimed record_count would grow it (docs/security.md)
        records.require_present(root / ENTRIES_FILE, mf.record_count, mf.config)
        size = store_files.record_bytes(mf.config)
        _io.write_pieces(
            root / ENTRIES_FILE, records.update_pieces(updates[updates["position"] < mf.record_count], size)
        )
    _io.unlink_many([root / name for name in mf.pending.deletes])


def refuse_unsafe(root: Path, files: store_files.DirectoryFiles) -> None:
    """Refuse (UnsafeFileError) a store where a file the commit names is a
    link or not a regular file, or where entries.bin, commit.stamp,
    pooled.bin or sources.jsonl, which are written in place, has other
    names (a hard link): nothing is read or written through them, so a
    writer would fail part way (docs/security.md)."""
    if files.unsafe:
        raise UnsafeFileError(
            f"{', '.join(files.unsafe)} in {root}: not a regular file (a symbolic link or the "
            "like); hmem writes no store whose own files are links",
            hint=Hint.VERIFY,
        )
    for name in (ENTRIES_FILE, store_files.STAMP_FILE, POOLED_FILE, store_files.SOURCES_FILE):
        if name in files.committed and os.lstat(root / name).st_nlink > 1:
            raise UnsafeFileError(
                f"{name} in {root} has other names (hard links); hmem writes no file in place that another name shares",
                hint="copy the store directory and use the copy, whose files are its own",
            )


def remove_leftovers(root: Path, mf: Manifest) -> None:
    """Remove what an interrupted writer left past the commit: temporary
    files, shards the commit does not name at indices it would use next,
    and records (and pooled.bin rows) past the committed count; first,
    refuse_unsafe."""
    files = store_files.classify(root, mf.shards, mf.pending)
    refuse_unsafe(root, files)
    for name in files.orphans:  # regular files only: a link or directory is never hmem's
        if name in files.temporary or (store_files.shard_index(name) or 0) >= len(mf.shards):
            _io.unlink(root / name)
    for name, row in (
        (ENTRIES_FILE, store_files.record_bytes(mf.config)),
        (POOLED_FILE, pooled.row_bytes(mf.config.pooled_width)),
    ):
        # rows past the commit: no reader ever reads them (nor has them mapped in use)
        path, committed_size = root / name, mf.record_count * row
        if path.exists() and path.stat().st_size > committed_size:
            _io.truncate(path, committed_size)
