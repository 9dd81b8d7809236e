"""Building a shard in memory and sealing it into its file (the format is
hmem/formats/shard_file.py and docs/format.md)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np

from hmem import _io
from hmem.formats import safetensors
from hmem.formats.shard_file import (
    CRC_PREFIX,
    DTYPE_NAMES,
    DTYPES,
    HEADER_BYTES_PER_TENSOR,
    HEADER_FIXED_BYTES,
    INDEX_COLUMNS,
    INDEX_MAGIC,
    INDEX_ROW_BYTES,
    INDEX_TENSOR,
    INDEX_VERSION,
    KINDS,
    META_PREFIX,
    SHARD_FORMAT,
    SHARD_FORMAT_VERSION,
    bytes_view,
)
from hmem.kernels import checksum as checksum_kernels


class Arena:
    """Byte segments that tensors are copied into back to back.

    One arena serves shard after shard (``reset`` keeps its segments), so
    steady-state puts copy into memory that is already mapped: copying into
    fresh allocations costs page faults and zero-fill, more than the copy
    itself.  Segments are never reallocated, so nothing is copied twice.
    """

    SEGMENT_BYTES = 16 << 20

    def __init__(self) -> None:
        self._segments: list[np.ndarray] = []
        self._used: list[int] = []
        self._current = 0
        self.used = 0

    def reset(self) -> None:
        self._current, self._used, self.used = 0, [0] * len(self._segments), 0

    def mark(self) -> tuple:
        return (self._current, list(self._used), self.used)

    def rollback(self, mark: tuple) -> None:
        """Forget what was appended since `mark` (one assignment: an interrupt
        leaves the arena rolled back or not, never half)."""
        current, used, total = mark
        self._current, self._used, self.used = current, used + [0] * (len(self._segments) - len(used)), total

    def append(self, array: np.ndarray) -> tuple[int, int]:
        """Copy `array`'s bytes after the previous ones; returns (segment, offset)."""
        n = array.nbytes
        while self._current < len(self._segments) and self._used[self._current] + n > len(self._segments[self._current]):
            if self._used[self._current] == 0:  # too small for this tensor: replace it
                self._segments[self._current] = np.empty(max(n, self.SEGMENT_BYTES), dtype=np.uint8)
                break
            self._current += 1
        if self._current == len(self._segments):
            segment = np.empty(max(n, self.SEGMENT_BYTES), dtype=np.uint8)
            self._segments, self._used = [*self._segments, segment], [*self._used, 0]  # both or neither
        seg, offset = self._current, self._used[self._current]
        self._segments[seg][offset : offset + n] = np.frombuffer(bytes_view(array), dtype=np.uint8)
        self._used[seg] += n
        self.used += n
        return seg, offset

    def view(self, where: tuple[int, int], dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        seg, offset = where
        count = math.prod(shape)
        return self._segments[seg][offset : offset + count * dtype.itemsize].view(dtype).reshape(shape)

    def data(self) -> list[memoryview]:
        """The bytes appended since the last reset, in order, as buffers."""
        return [seg[:used].data for seg, used in zip(self._segments, self._used) if used]


class ShardBuilder:
    """The tensors of the entries of one shard until it is sealed into its
    file.  Puts copy their tensors in (two arenas: F32 data, then I8 data),
    since the caller may change its arrays afterwards; compaction lends
    read-only views of the old shards instead, with their checked CRCs, so
    nothing is copied or checksummed twice.  Views handed out are valid
    until the arenas are reset for the next shard."""

    def __init__(self, index: int, uid: str, arenas: tuple[Arena, Arena], store_config: str = "") -> None:
        """`store_config`, the store's config as JSON, goes into the shard's
        metadata so that a lost index.json can be rebuilt."""
        self.index = index
        self.uid = uid
        self.store_config = store_config
        self.data_bytes = 0
        self._arenas = arenas
        for arena in arenas:
            arena.reset()
        self._rows: list[tuple[int, int]] = []  # (entry_id, n_tokens)
        # (entry_id, kind) -> (arena 0 or 1, dtype, shape, lent array or None, place in the arena, CRC or None)
        self._tensors: dict[tuple[int, str], tuple] = {}
        self._meta: dict[int, str] = {}  # entry_id -> its metadata as JSON (docs/format.md, "Shards")

    @property
    def entries(self) -> int:
        return len(self._rows)

    def add_entry(self, entry_id: int, n_tokens: int, tensors: dict[str, np.ndarray], meta: str | None = None) -> None:
        """Copy one entry's tensors (kind -> array, kinds from KINDS) in.

        The tensors go in before the entry's row: an exception part-way (an
        interrupt included) leaves tensors without a row, which ``rollback``
        to a mark taken before takes back with the rest."""
        for kind, array in tensors.items():
            if kind not in KINDS or array.dtype not in DTYPE_NAMES or not array.flags.c_contiguous:
                raise AssertionError(f"bad shard tensor {kind} ({array.dtype})")
            region = 0 if array.dtype == DTYPES["F32"] else 1
            place = self._arenas[region].append(array)
            self._tensors[(entry_id, kind)] = (region, array.dtype, array.shape, None, place, None)
            self.data_bytes += array.nbytes
        self._add_meta(entry_id, meta)
        self._rows.append((entry_id, n_tokens))

    def add_lent_entry(self, entry_id: int, n_tokens: int,
                       tensors: dict[str, tuple[np.dtype, tuple[int, ...], _io.FileRange, int]],
                       meta: str | None = None) -> None:
        """Add one entry whose tensors stay where they are (kind -> dtype,
        shape, the bytes in another file, their checked CRC): the sealed
        file copies them inside the kernel."""
        for kind, (dtype, shape, part, crc) in tensors.items():
            region = 0 if dtype == DTYPES["F32"] else 1
            self._tensors[(entry_id, kind)] = (region, dtype, tuple(shape), part, None, crc)
            self.data_bytes += part.length
        self._add_meta(entry_id, meta)
        self._rows.append((entry_id, n_tokens))

    def _add_meta(self, entry_id: int, meta: str | None) -> None:
        if meta is not None:
            self._meta[entry_id] = meta
            # its share of the JSON header, counted with the data so that the
            # size bound and a rollback cover it: the key, and the value with
            # every character escaped at worst
            self.data_bytes += 2 * len(meta) + 40

    def mark(self) -> tuple:
        return (len(self._rows), len(self._tensors), self.data_bytes, tuple(arena.mark() for arena in self._arenas))

    def rollback(self, mark: tuple) -> None:
        """Forget everything added since `mark`: every tensor, whether or not
        its entry's row went in (``add_entry`` cut short by an interrupt
        leaves tensors without a row, which would make ``encode`` fail)."""
        rows, tensors, data_bytes, arena_marks = mark
        kept = dict(itertools.islice(self._tensors.items(), tensors))  # a dict keeps insertion order
        kept_rows = self._rows[:rows]
        ids = {entry_id for entry_id, _ in kept_rows}
        kept_meta = {entry_id: meta for entry_id, meta in self._meta.items() if entry_id in ids}
        # One assignment: an interrupt leaves the builder rolled back or not, never half.
        self._rows, self._tensors, self._meta, self.data_bytes = kept_rows, kept, kept_meta, data_bytes
        for arena, arena_mark in zip(self._arenas, arena_marks):
            arena.rollback(arena_mark)  # an arena not rolled back only wastes its tail

    def file_bytes_bound(self) -> int:
        """An upper bound of the file size if sealed now."""
        return (self.data_bytes + HEADER_FIXED_BYTES + HEADER_BYTES_PER_TENSOR * len(self._tensors)
                + INDEX_ROW_BYTES * len(self._rows))

    def meta(self, entry_id: int) -> str | None:
        """An entry's metadata (JSON), if it has any."""
        return self._meta.get(entry_id)

    def get(self, entry_id: int, kind: str) -> np.ndarray:
        """A copied-in tensor (lent ones are not readable from here)."""
        region, dtype, shape, _, place, _ = self._tensors[(entry_id, kind)]
        return self._arenas[region].view(place, dtype, shape)

    def encode(self) -> tuple[list[Any], int]:
        """The file's bytes as buffers (header, index, F32 data, I8 data),
        and the CRC-32C of the index tensor."""
        n = len(self._rows)
        index = np.full((n + 1, INDEX_COLUMNS), -1, dtype="<i8")
        uid = int(self.uid, 16)
        index[0, :5] = [INDEX_MAGIC, INDEX_VERSION, n, *np.array([uid >> 64, uid & (2**64 - 1)], dtype="<u8").view("<i8")]
        row_of = {entry_id: r + 1 for r, (entry_id, _) in enumerate(self._rows)}
        for r, (entry_id, n_tokens) in enumerate(self._rows, start=1):
            index[r, :2] = (entry_id, n_tokens)
        specs = [(INDEX_TENSOR, "I64", (n + 1, INDEX_COLUMNS), index.nbytes)]  # hmem_index first, then the rest
        metadata = {"format": SHARD_FORMAT, "format_version": SHARD_FORMAT_VERSION, "shard_uid": self.uid}
        if self.store_config:
            metadata["store_config"] = self.store_config
        for entry_id, _ in self._rows:
            if entry_id in self._meta:
                metadata[META_PREFIX + str(entry_id)] = self._meta[entry_id]
        data: list[memoryview | _io.FileRange] = []
        start = index.nbytes
        for region in (0, 1):  # every F32 tensor, then every I8 tensor
            for (entry_id, kind), (reg, dtype, shape, lent, _, crc) in self._tensors.items():
                if reg != region:
                    continue
                view = lent if lent is not None else bytes_view(self.get(entry_id, kind))
                if crc is None:
                    crc = checksum_kernels.crc32c(view)
                column = KINDS.index(kind)
                index[row_of[entry_id], 2 + column] = start
                index[row_of[entry_id], 7 + column] = crc
                name = f"{kind}_{entry_id}"
                nbytes = lent.length if lent is not None else len(view)
                specs.append((name, DTYPE_NAMES[dtype], shape, nbytes))
                metadata[CRC_PREFIX + name] = f"{crc:08x}"
                data.append(view)
                start += nbytes
        index_crc = checksum_kernels.crc32c(bytes_view(index))
        metadata[CRC_PREFIX + INDEX_TENSOR] = f"{index_crc:08x}"
        return [safetensors.encode(specs, metadata), bytes_view(index), *data], index_crc

    def seal(self, path: Path) -> tuple[int, int]:
        """Write the shard file durably; returns (file size, index CRC)."""
        buffers, index_crc = self.encode()
        return _io.write_file(path, buffers), index_crc

