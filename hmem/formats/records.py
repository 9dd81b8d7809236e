"""entries.bin: one fixed-size record per entry, defined once here.

Record layout (little-endian, packed, 40 bytes + hdc_dim/8, plus the span
signatures of a store that keeps them):

    offset  field          type
         0  entry_id       u64
         8  layer_idx      u32
        12  n_tokens       u32
        16  importance     f32
        20  timestamp      u64   nanoseconds since the Unix epoch
        28  access_count   u32
        32  shard_idx      u32   0xFFFFFFFF once the entry is evicted
        36  checksum       u32   the seed's padding word: CRC-32C of bytes
                                 0-35 followed by the signature
        40  signature      hdc_dim/8 bytes, bit j in byte j//8, mask 1<<(j%8)
  40+hdc_dim/8  spans          signatures_per_entry - 1 span signatures of
                               min(hdc_dim, 512)/8 bytes each (none when
                               signatures_per_entry is 1), covered by the
                               checksum like the signature

Records are in ascending entry_id order.  Only access_count, shard_idx and
checksum of a committed record ever change, and they are adjacent (bytes
28-39), so an update is one 12-byte write.
"""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path

import numpy as np

from hmem import _io, file_reads, threads
from hmem.config import StoreConfig
from hmem.errors import CorruptStoreError, Hint, storage_error
from hmem.kernels import checksum as checksum_kernels

ENTRIES_FILE = "entries.bin"  # the store directory's files are listed in hmem/formats/store_files.py
HEADER_BYTES = 40
CHECKSUM_OFFSET = 36
MUTABLE_OFFSET = 28  # access_count, shard_idx, checksum
MUTABLE_BYTES = 12
EVICTED = 0xFFFFFFFF

HEADER_FIELDS = [
    ("entry_id", "<u8"),
    ("layer_idx", "<u4"),
    ("n_tokens", "<u4"),
    ("importance", "<f4"),
    ("timestamp", "<u8"),
    ("access_count", "<u4"),
    ("shard_idx", "<u4"),
    ("checksum", "<u4"),
]

# A committed record's new mutable fields, as carried in index.json until
# they are written in place (see hmem.manifest).
UPDATE_DTYPE = np.dtype([("position", "<u8"), ("access_count", "<u4"), ("shard_idx", "<u4"), ("checksum", "<u4")])


def record_dtype(config: StoreConfig | int) -> np.dtype:
    """The record of a store of this config: the header, the signature,
    and in a store with span signatures each span's, back to back.  An int
    stands for the signature bytes of a store without span signatures."""
    if isinstance(config, int):
        signature_bytes, spans, span_bytes = config, 0, 0
    else:
        signature_bytes, spans, span_bytes = config.signature_bytes, config.spans, config.span_signature_bytes
    fields: list[tuple] = [*HEADER_FIELDS, ("signature", "u1", (signature_bytes,))]
    if spans:
        fields.append(("spans", "u1", (spans, span_bytes)))
    dtype = np.dtype(fields)
    assert dtype.itemsize == HEADER_BYTES + signature_bytes + spans * span_bytes
    return dtype


def empty(count: int, config: StoreConfig | int) -> np.ndarray:
    return np.zeros(count, dtype=record_dtype(config))


def _rows(records: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(records).view(np.uint8).reshape(len(records), records.dtype.itemsize)


# Records a thread checksums at least: opening a large store checks every
# record, on every core.
_RECORDS_PER_THREAD = 65536


def checksums(records: np.ndarray) -> np.ndarray:
    """The checksum each record should carry (uint32 per record)."""
    rows = _rows(records)
    parts = threads.run_ranges(
        lambda lo, hi: checksum_kernels.crc32c_rows(rows[lo:hi], CHECKSUM_OFFSET, HEADER_BYTES),
        threads.split(len(rows), _RECORDS_PER_THREAD),
    )
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def seal(records: np.ndarray) -> None:
    """Set the checksum field of every record (in place)."""
    if len(records):
        records["checksum"] = checksums(records)


def damaged(records: np.ndarray) -> np.ndarray:
    """Positions of records whose checksum does not match their bytes."""
    if not len(records):
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(checksums(records) != records["checksum"])


def set_aside(records: np.ndarray, bad: np.ndarray, next_entry_id: int) -> list[tuple[int, int | None]]:
    """Make the damaged records at positions `bad` (ascending) read as
    evicted ones, in place, for a reader that reads past them (``on_damage=
    "skip"``): no shard, no tokens, no accesses, no signature, resealed in
    memory only (a reader never writes).  Each keeps its entry id when the
    id read lies between its sound neighbours' (the damage was elsewhere),
    else takes the next free one, so ids stay strictly increasing.
    Returns (position, entry id or None when unknown) per record.  A loop
    over the damaged records only, which are few."""
    ids = records["entry_id"]
    bad = np.asarray(bad, dtype=np.int64)
    sound = np.setdiff1d(np.arange(len(records)), bad)
    out: list[tuple[int, int | None]] = []
    previous = -1
    for i, position in enumerate(bad.tolist()):
        after = int(np.searchsorted(sound, position))  # the next sound record, if any
        if after:
            previous = max(previous, int(ids[sound[after - 1]]))
        if after < len(sound):
            following = int(ids[sound[after]])
            left = int(np.searchsorted(bad, sound[after])) - i - 1  # damaged records before it, after this one
        else:
            following, left = next_entry_id, len(bad) - i - 1
        read = int(ids[position])
        known = previous < read < following - left
        entry_id = read if known else previous + 1
        out.append((position, entry_id if known else None))
        previous = entry_id
        row = records[position : position + 1]
        row["entry_id"] = entry_id
        for field in ("layer_idx", "n_tokens", "importance", "timestamp", "access_count"):
            row[field] = 0
        row["shard_idx"] = EVICTED
        row["signature"] = 0
        if "spans" in (records.dtype.names or ()):
            row["spans"] = 0
        seal(row)
    return out


def problem(records: np.ndarray, shard_count: int, next_entry_id: int) -> str | None:
    """What in records that pass their checksums breaks the format (ids
    strictly increasing and below next_entry_id, each live record naming a
    shard of the commit), or None.  A crafted store can reseal any record
    (docs/security.md): verify reports these as record.order, record.id and
    record.shard."""
    ids = records["entry_id"]
    if len(ids) > 1 and not np.all(ids[1:] > ids[:-1]):
        return "entry ids are not strictly increasing"
    if len(ids) and int(ids[-1]) >= next_entry_id:
        return f"entry id {int(ids[-1])} is not below next_entry_id {next_entry_id}"
    shard = records["shard_idx"]
    bad = np.flatnonzero((shard != EVICTED) & (shard >= shard_count))
    if len(bad):
        return f"record {int(bad[0])} names shard {int(shard[bad[0]])}, which the store does not have"
    return None


def _check_present(path: Path, fd: int, count: int, record_size: int) -> None:
    """Refuse (CorruptStoreError) an entries.bin that does not hold `count`
    records in data really present: a sparse file's size costs nothing, so
    the records must lie in data before a byte is allocated or read for
    them (hmem writes entries.bin without holes: docs/security.md)."""
    size = os.fstat(fd).st_size
    need = count * record_size
    if size < need:
        raise CorruptStoreError(
            f"{path} holds {size // record_size} whole records but the store commits {count}", hint=Hint.VERIFY
        )
    present = file_reads.data_bytes(fd, need)
    if present < need:
        raise CorruptStoreError(
            f"{path} has holes where the store's {count} committed records must be: only {present} of "
            f"their {need} bytes are data",
            hint=Hint.VERIFY,
        )


def require_present(path: Path, count: int, config: StoreConfig | int) -> None:
    """Refuse an entries.bin at `path` that does not hold `count` records in
    data (missing, short, or sparse): what a writer checks before it writes
    a pending record update in place, so that no claimed count grows the
    file (docs/security.md)."""
    try:
        fd = _io.open_regular(path)
    except FileNotFoundError:
        if count == 0:
            return
        raise CorruptStoreError(f"{path} is missing but the store commits {count} records", hint=Hint.VERIFY) from None
    except OSError as exc:
        raise storage_error(exc, "read", path, writing=False) from exc
    try:
        _check_present(path, fd, count, record_dtype(config).itemsize)
    finally:
        os.close(fd)


def present_count(path: Path, count: int, config: StoreConfig | int) -> int:
    """How many of the first `count` records of the entries.bin at `path`
    lie in bytes present (data, not holes), at most; 0 when it is missing.
    What bounds verify's and repair's reads of a damaged file."""
    size = record_dtype(config).itemsize
    try:
        fd = _io.open_regular(path)
    except FileNotFoundError:
        return 0
    try:
        return file_reads.data_bytes(fd, count * size) // size
    finally:
        os.close(fd)


def read(path: Path, count: int, config: StoreConfig | int) -> np.ndarray:
    """The first `count` records of entries.bin (bytes past them are ignored)."""
    dtype = record_dtype(config)
    try:
        fd = _io.open_regular(path)
    except FileNotFoundError:
        if count == 0:
            return empty(0, config)
        raise CorruptStoreError(f"{path} is missing but the store commits {count} records", hint=Hint.VERIFY) from None
    except OSError as exc:  # permissions, a disk error: docs/reliability.md, "OS errors"
        raise storage_error(exc, "read", path, writing=False) from exc
    with open(fd, "rb") as f:
        _check_present(path, fd, count, dtype.itemsize)  # before anything is allocated for them
        try:
            return np.fromfile(f, dtype=dtype, count=count)
        except OSError as exc:
            raise storage_error(exc, "read", path, writing=False) from exc


_READ_CHUNK_BYTES = 32 << 20  # read_checked checks one chunk while it reads the next


def read_checked(path: Path, count: int, config: StoreConfig | int) -> tuple[np.ndarray, np.ndarray]:
    """read(), and the positions of the records whose checksum does not
    match (damaged), computed as the file comes in: a thread checks each
    chunk while the next is read (the read and the CRC kernel both run
    without the GIL), so opening a large store costs little more than
    reading its records."""
    dtype = record_dtype(config)
    try:
        fd = _io.open_regular(path)
    except FileNotFoundError:
        if count == 0:
            return empty(0, config), np.zeros(0, dtype=np.int64)
        raise CorruptStoreError(f"{path} is missing but the store commits {count} records", hint=Hint.VERIFY) from None
    except OSError as exc:  # permissions, a disk error: docs/reliability.md, "OS errors"
        raise storage_error(exc, "read", path, writing=False) from exc
    try:
        _check_present(path, fd, count, dtype.itemsize)  # before anything is allocated for them
        out = np.empty(count, dtype=dtype)
    except BaseException:
        os.close(fd)
        raise
    rows = out.view(np.uint8).reshape(count, dtype.itemsize)
    step = max(1, _READ_CHUNK_BYTES // dtype.itemsize)
    chunks: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
    bad: list[np.ndarray] = []

    def check() -> None:
        while (chunk := chunks.get()) is not None:
            lo, hi = chunk
            sums = checksum_kernels.crc32c_rows(rows[lo:hi], CHECKSUM_OFFSET, HEADER_BYTES)
            bad.append(np.flatnonzero(sums != out["checksum"][lo:hi]) + lo)

    checker = threading.Thread(target=check, name="hmem-records-check", daemon=True)
    checker.start()
    try:
        with open(fd, "rb") as f:
            for lo in range(0, count, step):
                hi = min(count, lo + step)
                view = rows[lo:hi].reshape(-1).data
                got = 0
                while got < len(view):
                    n = f.readinto(view[got:])
                    if not n:
                        raise CorruptStoreError(f"{path} ended while it was being read", hint=Hint.VERIFY)
                    got += n
                chunks.put((lo, hi))
    except OSError as exc:
        raise storage_error(exc, "read", path, writing=False) from exc
    finally:
        chunks.put(None)
        checker.join()
    return out, (np.concatenate(bad) if bad else np.zeros(0, dtype=np.int64))


def updates_for(records: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Update rows carrying the current mutable fields of `positions`."""
    out = np.zeros(len(positions), dtype=UPDATE_DTYPE)
    out["position"] = positions
    for field in ("access_count", "shard_idx", "checksum"):
        out[field] = records[field][positions]
    return out


def merge_updates(older: np.ndarray, newer: np.ndarray) -> np.ndarray:
    """One update row per position, the newer winning, ordered by position."""
    both = np.concatenate([older, newer])
    if not len(both):
        return both
    # np.unique keeps the first occurrence: look from the newest end.
    _, last = np.unique(both["position"][::-1], return_index=True)
    return both[::-1][last]


def apply_updates(records: np.ndarray, updates: np.ndarray) -> None:
    """Apply update rows to records in memory (positions past the end are ignored)."""
    updates = updates[updates["position"] < len(records)]
    positions = updates["position"].astype(np.int64)
    for field in ("access_count", "shard_idx", "checksum"):
        records[field][positions] = updates[field]


def update_pieces(updates: np.ndarray, record_size: int) -> list[tuple[int, bytes]]:
    """(file offset, 12 bytes) writes that put update rows in place."""
    mutable = np.zeros(len(updates), dtype=[("access_count", "<u4"), ("shard_idx", "<u4"), ("checksum", "<u4")])
    for field in ("access_count", "shard_idx", "checksum"):
        mutable[field] = updates[field]
    raw = mutable.tobytes()
    offsets = updates["position"].astype(np.int64) * record_size + MUTABLE_OFFSET
    return [(int(off), raw[i * MUTABLE_BYTES : (i + 1) * MUTABLE_BYTES]) for i, off in enumerate(offsets)]
