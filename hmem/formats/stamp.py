"""commit.stamp: the newest generation that committed data, kept beside
index.json so that an index.json older than the store's files is told
from the leftovers of one interrupted flush (docs/format.md, "The commit
stamp").

Layout (40 bytes, little-endian):

    offset  field           type
         0  magic           8 bytes "HMEMSTMP"
         8  generation      u64   generation of the commit
        16  next_entry_id   u64   the id reservation that commit held
        24  record_count    u64   records of entries.bin it named
        32  checksum        u32   CRC-32C of bytes 0-31
        36  zero            u32

A writer rewrites it in place, fsynced, right after each commit that adds
records or shards or rewrites the store (after index.json, never before:
a stamp ahead of index.json then proves that a later commit happened).
Stores written before the stamp existed have none; hmem then relies on
entry ids alone (a writer only uses ids that index.json reserved first).
"""

from __future__ import annotations

import dataclasses
import os
import struct
from pathlib import Path

import numpy as np

from hmem import _io, file_reads
from hmem.errors import HmemError
from hmem.formats import records
from hmem.formats.manifest import MAX_COUNT, MAX_RECORDS, Manifest
from hmem.formats.store_files import ENTRIES_FILE, STAMP_FILE, record_bytes
from hmem.kernels import checksum as checksum_kernels

MAGIC = b"HMEMSTMP"
_LAYOUT = struct.Struct("<8sQQQII")
SIZE = _LAYOUT.size
MAX_LISTED_IDS = 10  # ids named in a staleness message, at most


@dataclasses.dataclass(frozen=True)
class Stamp:
    generation: int
    next_entry_id: int
    record_count: int


def encode(stamp: Stamp) -> bytes:
    head = _LAYOUT.pack(MAGIC, stamp.generation, stamp.next_entry_id, stamp.record_count, 0, 0)[:32]
    return head + struct.pack("<II", checksum_kernels.crc32c(head), 0)


def write(root: Path, mf: Manifest) -> None:
    """Stamp the commit `mf` (call after index.json holds it)."""
    data = encode(Stamp(mf.generation, mf.next_entry_id, mf.record_count))
    _io.write_at(root / STAMP_FILE, 0, [data], create=True)


def read(root: Path) -> Stamp | None:
    """The stamp, or None when there is none or it is damaged (then the
    store is judged by its entry ids alone)."""
    try:
        data = _io.read_regular(root / STAMP_FILE, SIZE)
    except (OSError, HmemError):
        return None
    if len(data) != SIZE:
        return None
    magic, generation, next_id, count, crc, _ = _LAYOUT.unpack(data)
    if magic != MAGIC or checksum_kernels.crc32c(data[:32]) != crc:
        return None
    # A crafted stamp passes its CRC (docs/security.md): numbers past the
    # bounds index.json is held to are no evidence, and never reach a commit.
    if generation > MAX_COUNT or next_id > MAX_COUNT or count > MAX_RECORDS:
        return None
    return Stamp(generation, next_id, count)


def stale_evidence(root: Path, mf: Manifest) -> str | None:
    """Why index.json (`mf`) is certainly older than what the store's files
    show, or None.  One interrupted flush can leave shards and records past
    the commit, but never a stamp of a later generation, nor records whose
    ids the commit never reserved."""
    found = read(root)
    if found is not None and found.generation > mf.generation:
        return (
            f"index.json holds generation {mf.generation}, but generation {found.generation} was "
            f"committed after it ({found.record_count} records): index.json is older than the store's files"
        )
    size = record_bytes(mf.config)
    try:  # a link or a file of another kind is no evidence: readers and writers refuse it (docs/security.md)
        fd = _io.open_regular(root / ENTRIES_FILE)
    except (OSError, HmemError):
        return None
    with open(fd, "rb") as f:
        whole = os.fstat(fd).st_size // size
        if whole <= mf.record_count:
            return None
        # the tail's records in data really present only: a sparse tail claims any size for free
        # (docs/security.md); an interrupted flush leaves its records as data
        start = mf.record_count * size
        present = file_reads.data_bytes(fd, whole * size, start=start) // size
        f.seek(start)
        tail = np.frombuffer(f.read(present * size), dtype=records.record_dtype(mf.config))
    sound = np.setdiff1d(np.arange(len(tail)), records.damaged(tail))
    ids = tail["entry_id"][sound]
    unreserved = ids[ids >= mf.next_entry_id]
    if not len(unreserved):
        return None
    shown = ", ".join(str(int(i)) for i in unreserved[:MAX_LISTED_IDS])
    more = f" and {len(unreserved) - MAX_LISTED_IDS} more" if len(unreserved) > MAX_LISTED_IDS else ""
    return (
        f"entries.bin holds {len(unreserved)} entries past the commit whose ids index.json never reserved "
        f"(next_entry_id {mf.next_entry_id}; found {shown}{more}): index.json is older than the store's files"
    )
