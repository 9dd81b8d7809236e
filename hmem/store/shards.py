"""Shard files: standard safetensors holding the K/V tensors of entries.

A shard is written once, whole, and never modified.  Layout of the file
(the safetensors format):

    u64 little-endian   N, the length of the JSON header
    N bytes             JSON header, padded with spaces to a multiple of 8
    data                the tensors' bytes, back to back

The data region starts with ``hmem_index``, an I64 tensor of
[entries + 1, 12]: a header row (magic "HMEMIDX1", version, entry count,
the shard uid as two 64-bit halves) and one row per entry (entry_id,
n_tokens, the data offsets of its k, v, p, ks, vs tensors, -1 where absent,
and the CRC-32C of each).  hmem reads shards through this index, a
zero-copy view that needs no JSON parsing, so opening a shard costs
microseconds whatever its number of tensors.  The JSON header still lists
every tensor, so any safetensors reader opens the file; ``verify`` checks
that both agree.

After the index come every F32 tensor, then every I8 tensor, so F32 data is
4-byte aligned and reads as zero-copy numpy views of the memory map.
``__metadata__`` holds ``format`` = "hmem-shard", ``format_version`` = "1",
``shard_uid`` and, per tensor, ``crc32c:<name>``.  docs/format.md lists
every name.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import mmap
import os
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np

from hmem import _io
from hmem.errors import CorruptStoreError, StoreChangedError
from hmem.kernels import checksum as checksum_kernels
from hmem.kernels import quantize as quantize_kernels

SHARD_FORMAT = "hmem-shard"
SHARD_FORMAT_VERSION = "1"
SHARD_NAME = re.compile(r"^shard_(\d{4,9})\.safetensors$")
CRC_PREFIX = "crc32c:"

INDEX_TENSOR = "hmem_index"
INDEX_MAGIC = int.from_bytes(b"HMEMIDX1", "little")
INDEX_VERSION = 1
INDEX_COLUMNS = 12
KINDS = ("k", "v", "p", "ks", "vs")  # index columns 2-6 (offsets) and 7-11 (CRCs)

DTYPES: dict[str, np.dtype] = {"F32": np.dtype("<f4"), "I8": np.dtype("i1"), "I64": np.dtype("<i8")}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_HEADER_ALIGN = 8
# Upper bound of one tensor's share of the JSON header: its entry with
# 20-digit offsets and shape numbers, plus its checksum in the metadata.
HEADER_BYTES_PER_TENSOR = 200
HEADER_FIXED_BYTES = 256 + INDEX_COLUMNS * 8  # the metadata, the length word, the index's header row
INDEX_ROW_BYTES = INDEX_COLUMNS * 8


def shard_file(index: int) -> str:
    return f"shard_{index:04d}.safetensors"


def entry_bytes(n_tokens: int, embed_dim: int, quantized: bool) -> int:
    """Tensor bytes one entry adds to a shard (keys, values, pooled key,
    scales), not counting its index row and header entries."""
    if quantized:
        return 2 * n_tokens * embed_dim + 4 * embed_dim + 2 * 4 * n_tokens
    return 2 * 4 * n_tokens * embed_dim + 4 * embed_dim


# ---- INT8 storage (SPEC §2.7) -------------------------------------------------------


def quantize_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric INT8 per row: scale = max|row| / 127 (0 for a zero row),
    q = round(x / scale) in [-127, 127]."""
    q = np.empty(rows.shape, dtype=np.int8)
    scales = np.empty(rows.shape[0], dtype=np.float32)
    quantize_kernels.quantize_rows(rows, q, scales)
    return q, scales


def dequantize_rows(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    out = np.empty(q.shape, dtype=np.float32)
    quantize_kernels.dequantize_rows(q, scales, out)
    return out


# ---- writing ----------------------------------------------------------------------


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
        self._used = [0] * len(self._segments)
        self._current = 0
        self.used = 0

    def mark(self) -> tuple:
        return (self._current, list(self._used), self.used)

    def rollback(self, mark: tuple) -> None:
        """Forget what was appended since `mark`."""
        self._current, used, self.used = mark
        self._used = used + [0] * (len(self._segments) - len(used))

    def append(self, array: np.ndarray) -> tuple[int, int]:
        """Copy `array`'s bytes after the previous ones; returns (segment, offset)."""
        n = array.nbytes
        while self._current < len(self._segments) and self._used[self._current] + n > len(self._segments[self._current]):
            if self._used[self._current] == 0:  # too small for this tensor: replace it
                self._segments[self._current] = np.empty(max(n, self.SEGMENT_BYTES), dtype=np.uint8)
                break
            self._current += 1
        if self._current == len(self._segments):
            self._segments.append(np.empty(max(n, self.SEGMENT_BYTES), dtype=np.uint8))
            self._used.append(0)
        seg, offset = self._current, self._used[self._current]
        self._segments[seg][offset : offset + n] = np.frombuffer(_bytes_view(array), dtype=np.uint8)
        self._used[seg] += n
        self.used += n
        return seg, offset

    def view(self, where: tuple[int, int], dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        seg, offset = where
        count = int(np.prod(shape, dtype=np.int64))
        return self._segments[seg][offset : offset + count * dtype.itemsize].view(dtype).reshape(shape)

    def data(self) -> list[memoryview]:
        """The bytes appended since the last reset, in order, as buffers."""
        return [memoryview(seg[:used]) for seg, used in zip(self._segments, self._used) if used]


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

    @property
    def entries(self) -> int:
        return len(self._rows)

    def add_entry(self, entry_id: int, n_tokens: int, tensors: dict[str, np.ndarray]) -> None:
        """Copy one entry's tensors (kind -> array, kinds from KINDS) in."""
        for kind, array in tensors.items():
            if kind not in KINDS or array.dtype not in DTYPE_NAMES or not array.flags.c_contiguous:
                raise AssertionError(f"bad shard tensor {kind} ({array.dtype})")
            region = 0 if array.dtype == DTYPES["F32"] else 1
            place = self._arenas[region].append(array)
            self._tensors[(entry_id, kind)] = (region, array.dtype, array.shape, None, place, None)
            self.data_bytes += array.nbytes
        self._rows.append((entry_id, n_tokens))

    def add_lent_entry(self, entry_id: int, n_tokens: int,
                       tensors: dict[str, tuple[np.dtype, tuple[int, ...], _io.FileRange, int]]) -> None:
        """Add one entry whose tensors stay where they are (kind -> dtype,
        shape, the bytes in another file, their checked CRC): the sealed
        file copies them inside the kernel."""
        for kind, (dtype, shape, part, crc) in tensors.items():
            region = 0 if dtype == DTYPES["F32"] else 1
            self._tensors[(entry_id, kind)] = (region, dtype, tuple(shape), part, None, crc)
            self.data_bytes += part.length
        self._rows.append((entry_id, n_tokens))

    def mark(self) -> tuple:
        return (len(self._rows), self.data_bytes, tuple(arena.mark() for arena in self._arenas))

    def rollback(self, mark: tuple) -> None:
        """Forget the entries added since `mark`."""
        rows, self.data_bytes, arena_marks = mark
        for entry_id, _ in self._rows[rows:]:
            for kind in KINDS:
                self._tensors.pop((entry_id, kind), None)
        del self._rows[rows:]
        for arena, arena_mark in zip(self._arenas, arena_marks):
            arena.rollback(arena_mark)

    def file_bytes_bound(self) -> int:
        """An upper bound of the file size if sealed now."""
        return (self.data_bytes + HEADER_FIXED_BYTES + HEADER_BYTES_PER_TENSOR * len(self._tensors)
                + INDEX_ROW_BYTES * len(self._rows))

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
        header: dict[str, Any] = {INDEX_TENSOR: None}
        metadata = {"format": SHARD_FORMAT, "format_version": SHARD_FORMAT_VERSION, "shard_uid": self.uid}
        if self.store_config:
            metadata["store_config"] = self.store_config
        data: list[memoryview | _io.FileRange] = []
        start = index.nbytes
        for region in (0, 1):  # every F32 tensor, then every I8 tensor
            for (entry_id, kind), (reg, dtype, shape, lent, _, crc) in self._tensors.items():
                if reg != region:
                    continue
                view = lent if lent is not None else _bytes_view(self.get(entry_id, kind))
                if crc is None:
                    crc = checksum_kernels.crc32c(view)
                column = KINDS.index(kind)
                index[row_of[entry_id], 2 + column] = start
                index[row_of[entry_id], 7 + column] = crc
                name = f"{kind}_{entry_id}"
                nbytes = lent.length if lent is not None else len(view)
                header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                                "data_offsets": [start, start + nbytes]}
                metadata[CRC_PREFIX + name] = f"{crc:08x}"
                data.append(view)
                start += nbytes
        index_crc = checksum_kernels.crc32c(_bytes_view(index))
        header[INDEX_TENSOR] = {"dtype": "I64", "shape": [n + 1, INDEX_COLUMNS], "data_offsets": [0, index.nbytes]}
        metadata[CRC_PREFIX + INDEX_TENSOR] = f"{index_crc:08x}"
        text = json.dumps({"__metadata__": metadata, **header}, separators=(",", ":")).encode()
        text += b" " * (-len(text) % _HEADER_ALIGN)
        return [struct.pack("<Q", len(text)), text, _bytes_view(index), *data], index_crc

    def seal(self, path: Path) -> tuple[int, int]:
        """Write the shard file durably; returns (file size, index CRC)."""
        buffers, index_crc = self.encode()
        return _io.write_file(path, buffers), index_crc


def _bytes_view(array: np.ndarray) -> memoryview:
    return memoryview(array).cast("B")


# ---- reading -----------------------------------------------------------------------


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


class ShardState:
    """What this process has checked of one shard file (known by its uid),
    kept while its map comes and goes: shard files never change."""

    __slots__ = ("uid", "uid_halves", "ids", "verified")

    def __init__(self, uid: str) -> None:
        value = int(uid, 16)
        self.uid = uid
        self.uid_halves = (_signed64(value >> 64), _signed64(value & ((1 << 64) - 1)))
        self.ids: np.ndarray | None = None  # entry ids of the index, once it passed its checksum
        self.verified: set[tuple[int, str]] = set()  # (entry_id, kind) whose CRC matched


class ShardReader:
    """One shard file, memory-mapped, read through its hmem_index tensor."""

    def __init__(self, path: Path, info: Any, state: ShardState) -> None:
        """Map the file described by the ShardInfo `info`; check its index
        (checksum, header row, uid) unless `state` says it was checked."""
        self.path = path
        self.uid = info.uid
        self.state = state
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise CorruptStoreError(f"shard {path.name} is missing", hint="run 'hmem verify'") from None
        try:
            actual = os.fstat(fd).st_size
            if actual != info.bytes:
                raise CorruptStoreError(f"shard {path.name} is {actual} bytes, the store expects {info.bytes}",
                                        hint="run 'hmem verify'")
            self._map = mmap.mmap(fd, actual, access=mmap.ACCESS_READ) if actual else None
        finally:
            os.close(fd)
        self.size = actual
        self.data_start, self.index = self._load_index(info.entries, info.index_crc)

    @property
    def verified(self) -> set[tuple[int, str]]:
        return self.state.verified

    def _bad(self, why: str) -> CorruptStoreError:
        return CorruptStoreError(f"shard {self.path.name} is damaged: {why}", hint="run 'hmem verify'")

    def _load_index(self, entries: int, index_crc: int) -> tuple[int, np.ndarray]:
        if self._map is None or self.size < 8:
            raise self._bad("too short to be safetensors")
        (length,) = struct.unpack_from("<Q", self._map, 0)
        data_start = 8 + length
        index_bytes = (entries + 1) * INDEX_ROW_BYTES
        if length > self.size or data_start + index_bytes > self.size:
            raise self._bad("its header or index runs past the end of the file")
        index = np.frombuffer(self._map, dtype="<i8", count=(entries + 1) * INDEX_COLUMNS,
                              offset=data_start).reshape(entries + 1, INDEX_COLUMNS)
        if (int(index[0, 3]), int(index[0, 4])) != self.state.uid_halves:
            raise StoreChangedError(f"shard {self.path.name} was replaced since the store was opened",
                                    hint="open the store again")
        if self.state.ids is None:
            if checksum_kernels.crc32c(_bytes_view(index)) != index_crc:
                raise self._bad("its entry index fails its checksum")
            if index[0, 0] != INDEX_MAGIC or index[0, 1] != INDEX_VERSION or index[0, 2] != entries:
                raise self._bad("its entry index has a wrong header row")
            self.state.ids = np.ascontiguousarray(index[1:, 0])
        return data_start, index

    def _locate(self, entry_id: int, kind: str) -> tuple[int, int]:
        ids = self.state.ids
        row = int(np.searchsorted(ids, entry_id))
        if row >= len(ids) or ids[row] != entry_id:
            raise self._bad(f"it holds no entry {entry_id}")
        column = KINDS.index(kind)
        return int(self.index[row + 1, 2 + column]), int(self.index[row + 1, 7 + column])

    def tensor(self, entry_id: int, kind: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A read-only view of one tensor in the memory map (no copy)."""
        start, _ = self._locate(entry_id, kind)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        begin = self.data_start + start
        if start < 0 or begin + nbytes > self.size:
            raise self._bad(f"tensor {kind}_{entry_id} lies outside the file")
        if nbytes >= 1 << 16:  # read ahead instead of faulting page by page
            aligned = begin - begin % mmap.PAGESIZE
            self._map.madvise(mmap.MADV_WILLNEED, aligned, begin + nbytes - aligned)
        count = nbytes // dtype.itemsize
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=begin).reshape(shape)

    def crc(self, entry_id: int, kind: str) -> int:
        """The CRC-32C the index records for a tensor."""
        return self._locate(entry_id, kind)[1]

    def file_range(self, entry_id: int, kind: str, nbytes: int) -> _io.FileRange:
        """Where a tensor's bytes lie in the file."""
        start, _ = self._locate(entry_id, kind)
        if start < 0 or self.data_start + start + nbytes > self.size:
            raise self._bad(f"tensor {kind}_{entry_id} lies outside the file")
        return _io.FileRange(self.path, self.data_start + start, nbytes)

    def check(self, entry_id: int, kind: str, tensor: np.ndarray) -> bool:
        """Whether `tensor` (read from this shard) matches its recorded CRC-32C."""
        _, expected = self._locate(entry_id, kind)
        ok = checksum_kernels.crc32c(_bytes_view(tensor)) == expected
        if ok:
            self.verified.add((entry_id, kind))
        return ok

    def header(self) -> tuple[dict[str, str], dict[str, tuple]]:
        """The JSON header, parsed and checked (for verify and tests)."""
        metadata, entries, _ = _parse_header(self._map, self.path.name)
        return metadata, entries


def _parse_header(buf: mmap.mmap, name: str) -> tuple[dict[str, str], dict[str, tuple], int]:
    def bad(why: str) -> CorruptStoreError:
        return CorruptStoreError(f"shard {name} has a damaged header: {why}", hint="run 'hmem verify'")

    (length,) = struct.unpack_from("<Q", buf, 0)
    if length > len(buf) - 8:
        raise bad(f"header length {length} runs past the end of the file")
    try:
        header = json.loads(bytes(buf[8 : 8 + length]))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise bad("the header is not valid JSON") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or metadata.get("format") != SHARD_FORMAT:
        raise bad("it is not an hmem shard")
    data_start = 8 + length
    data_len = len(buf) - data_start
    entries: dict[str, tuple] = {}
    for tensor, spec in header.items():
        try:
            dtype = DTYPES[spec["dtype"]]
            shape = tuple(x for x in spec["shape"])
            start, end = (x for x in spec["data_offsets"])
            if not all(type(x) is int and 0 <= x < 1 << 62 for x in (*shape, start, end)):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {tensor} has a malformed entry") from None
        if not 0 <= start <= end <= data_len:
            raise bad(f"tensor {tensor} lies outside the data")
        if end - start != math.prod(shape) * dtype.itemsize:  # Python ints: no overflow
            raise bad(f"tensor {tensor}'s size does not match its shape")
        entries[tensor] = (dtype, shape, data_start + start, data_start + end)
    return metadata, entries, data_start


_NAME = re.compile(r"^(k|v|p|ks|vs)_(\d{1,20})$")


@dataclasses.dataclass
class ShardScan:
    """What a shard file holds, read through its hmem_index and its JSON
    header independently, for verify and repair (which must cope with
    damage to either)."""

    size: int
    metadata: dict[str, str]
    # (entry_id, kind) -> (dtype, shape, absolute start, absolute end, recorded CRC or None);
    # from hmem_index when it is sound, else from the JSON header
    tensors: dict[tuple[int, str], tuple[np.dtype, tuple[int, ...], int, int, int | None]]
    index_entries: np.ndarray | None  # [entries + 1, 12] view of a sound hmem_index
    problems: list[tuple[str, str]]  # (finding code, message)


def tensor_layout(kind: str, n_tokens: int, embed_dim: int, quantized: bool) -> tuple[np.dtype, tuple[int, ...]]:
    """dtype and shape of one tensor of an entry."""
    if kind in ("k", "v"):
        return (DTYPES["I8"] if quantized else DTYPES["F32"]), (n_tokens, embed_dim)
    return DTYPES["F32"], ((embed_dim,) if kind == "p" else (n_tokens,))


_MAGIC_BYTES = INDEX_MAGIC.to_bytes(8, "little")


def shard_metadata(path: Path) -> dict[str, str]:
    """The __metadata__ of a shard file (raises CorruptStoreError)."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 8:
            raise CorruptStoreError(f"shard {path.name} is too short to be safetensors")
        buf = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    return _parse_header(buf, path.name)[0]


def _find_index(buf: Any, data_start: int | None) -> tuple[np.ndarray | None, int]:
    """hmem_index and where it starts: at the data start the header gives,
    or, when that is damaged, at the first 8-aligned place holding its magic."""
    size = len(buf)
    candidates = [data_start] if data_start is not None else []
    at = 8
    while (at := buf.find(_MAGIC_BYTES, at)) != -1 and len(candidates) < 4:
        if at % 8 == 0:
            candidates.append(at)
        at += 1
    for start in candidates:
        if start is None or start + 2 * INDEX_ROW_BYTES > size:
            continue
        head = np.frombuffer(buf, dtype="<i8", count=INDEX_COLUMNS, offset=start)
        entries = int(head[2])
        if head[0] != INDEX_MAGIC or head[1] != INDEX_VERSION or not 0 <= entries <= (size - start) // INDEX_ROW_BYTES - 1:
            continue
        rows = entries + 1
        return np.frombuffer(buf, dtype="<i8", count=rows * INDEX_COLUMNS, offset=start).reshape(rows, INDEX_COLUMNS), start
    return None, -1


def scan_shard(path: Path, *, embed_dim: int, quantized: bool, index_crc: int | None = None) -> ShardScan:
    """Read a shard without trusting its header or its index.  `index_crc`
    is what index.json records for the index (None when it is lost)."""
    problems: list[tuple[str, str]] = []
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        buf = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else b""
    metadata: dict[str, str] = {}
    from_header: dict = {}
    data_start = None
    try:
        metadata, entries, data_start = _parse_header(buf, path.name)
        for name, (dtype, shape, start, end) in entries.items():
            match = _NAME.match(name)
            if match:
                crc_text = metadata.get(CRC_PREFIX + name)
                try:
                    crc = int(crc_text, 16) if crc_text is not None else None
                except ValueError:
                    crc = None
                from_header[(int(match.group(2)), match.group(1))] = (dtype, shape, start, end, crc)
            elif name != INDEX_TENSOR:
                problems.append(("shard.header", f"unexpected tensor {name}"))
    except CorruptStoreError as exc:
        problems.append(("shard.header", exc.message))
    index, index_start = _find_index(buf, data_start)
    if index is None:
        problems.append(("shard.index", "no readable hmem_index"))
    else:
        expected = index_crc
        if expected is None:
            try:
                expected = int(metadata[CRC_PREFIX + INDEX_TENSOR], 16)
            except (KeyError, ValueError):
                expected = None
        if expected is not None and checksum_kernels.crc32c(_bytes_view(index)) != expected:
            problems.append(("shard.index", "hmem_index fails its checksum"))
            index = None
    if index is None:
        return ShardScan(size, metadata, from_header, None, problems)
    from_index = {}
    for row in index[1:]:
        entry_id, n_tokens = int(row[0]), int(row[1])
        for column, kind in enumerate(KINDS):
            offset = int(row[2 + column])
            if offset < 0:
                continue
            dtype, shape = tensor_layout(kind, n_tokens, embed_dim, quantized)
            start = index_start + offset
            end = start + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            from_index[(entry_id, kind)] = (dtype, shape, start, end, int(row[7 + column]))
    if from_header:
        for key in from_header.keys() | from_index.keys():
            a, b = from_header.get(key), from_index.get(key)
            if a is None or b is None or a[2:] != b[2:] or tuple(a[1]) != tuple(b[1]):
                problems.append(("shard.mismatch", f"{key[1]}_{key[0]}: the JSON header and hmem_index disagree"))
    return ShardScan(size, metadata, from_index, index, problems)


class ShardCache:
    """At most `capacity` shard files memory-mapped at once (least recently
    used is dropped first).  Arrays already handed out keep their own map
    alive until they are freed.  What was checked of each shard is kept
    across evictions (ShardState, by uid)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._open: collections.OrderedDict[int, ShardReader] = collections.OrderedDict()
        self._states: dict[str, ShardState] = {}

    def get(self, index: int, path: Path, info: Any) -> ShardReader:
        """The reader of shard `index` (file at `path`, described by the
        ShardInfo `info`)."""
        reader = self._open.get(index)
        if reader is not None and reader.uid == info.uid:
            self._open.move_to_end(index)
            return reader
        state = self._states.get(info.uid)
        if state is None:
            state = self._states[info.uid] = ShardState(info.uid)
        reader = ShardReader(path, info, state)
        self._open[index] = reader
        self._open.move_to_end(index)
        while len(self._open) > self.capacity:
            self._open.popitem(last=False)
        return reader

    def open_count(self) -> int:
        return len(self._open)

    def drop(self, index: int | None = None) -> None:
        """Unmap one shard, or all; what was checked is kept."""
        if index is None:
            self._open.clear()
        else:
            self._open.pop(index, None)
