"""pooled.bin: each entry's pooled key beside its record, defined once here.

A re-rank compares the query with the pooled key (the float32 mean of the
keys, the shard's "p" tensor) of every shortlisted entry.  Read from the
shards, a shortlist of 40 touches up to 40 shard files; read from here, it
is 40 rows of one file, gathered at once.

Row i belongs to record i of entries.bin.  Layout (little-endian, packed,
12 + 4 x embed_dim bytes):

    offset  field      type
         0  entry_id   u64   the record's entry id
         8  checksum   u32   CRC-32C of bytes 0-7 followed by the key
        12  key        f32 x embed_dim, bit-exact the entry's "p" tensor

The file repeats what the shards hold, so it is never the only copy of
anything: a row is used only when its entry id is its record's and its
checksum matches.  Any other row (a file an older hmem left behind, a hole,
a row a crash left) is read from the entry's shard instead.  The writer
writes the rows of new records before the commit that names them (over
whatever a failed flush left there), so a committed record's row, when
present, is its own; compaction and repair write the file anew.
docs/format.md, "Pooled keys".
"""

from __future__ import annotations

import numpy as np

from hmem import memory, threads
from hmem.kernels import checksum as checksum_kernels

POOLED_FILE = "pooled.bin"  # the store directory's files are listed in hmem/formats/store_files.py
CHECKSUM_OFFSET = 8
HEADER_BYTES = 12

_ROWS_PER_THREAD = 65536


def row_dtype(embed_dim: int) -> np.dtype:
    dtype = np.dtype([("entry_id", "<u8"), ("checksum", "<u4"), ("key", "<f4", (embed_dim,))])
    assert dtype.itemsize == HEADER_BYTES + 4 * embed_dim
    return dtype


def row_bytes(embed_dim: int) -> int:
    return HEADER_BYTES + 4 * embed_dim


def _checksums(rows: np.ndarray) -> np.ndarray:
    raw = np.ascontiguousarray(rows).view(np.uint8).reshape(len(rows), rows.dtype.itemsize)
    parts = threads.run_ranges(
        lambda lo, hi: checksum_kernels.crc32c_rows(raw[lo:hi], CHECKSUM_OFFSET, HEADER_BYTES),
        threads.split(len(raw), _ROWS_PER_THREAD),
    )
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def make_rows(entry_ids: np.ndarray, keys: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Sealed rows for these entries (keys: float32 [n, embed_dim]), made
    in `out` when given (rows of row_dtype, as many as the entries)."""
    rows = memory.filled_soon((len(entry_ids),), row_dtype(keys.shape[1])) if out is None else out
    assert rows.dtype == row_dtype(keys.shape[1]) and len(rows) == len(entry_ids) == len(keys)
    rows["entry_id"] = entry_ids
    rows["key"] = keys
    if len(rows):
        rows["checksum"] = _checksums(rows)
    return rows


def usable(rows: np.ndarray, entry_ids: np.ndarray) -> np.ndarray:
    """Which rows belong to these entry ids and pass their checksum (bool [n])."""
    if not len(rows):
        return np.zeros(0, dtype=bool)
    return (rows["entry_id"] == entry_ids) & (_checksums(rows) == rows["checksum"])
