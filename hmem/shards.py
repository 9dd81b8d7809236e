"""Shard files: standard safetensors holding the K/V tensors of entries.

A shard is written once, whole, and never modified.  Layout of the file
(the safetensors format):

    u64 little-endian   N, the length of the JSON header
    N bytes             JSON header, padded with spaces to a multiple of 8
    data                the tensors' bytes, back to back

hmem writes every F32 tensor before every I8 tensor, so F32 data stays
4-byte aligned and reads as zero-copy numpy views of the memory map.
``__metadata__`` holds ``format`` = "hmem-shard", ``format_version`` = "1",
``shard_uid`` and, per tensor, ``crc32c:<name>`` = 8 hex digits of the
CRC-32C of the tensor's bytes.  Tensor names per entry are listed in
docs/format.md (``k_{id}``, ``v_{id}``, ``p_{id}``, and ``ks_{id}`` /
``vs_{id}`` when quantized).
"""

from __future__ import annotations

import collections
import json
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

SHARD_FORMAT = "hmem-shard"
SHARD_FORMAT_VERSION = "1"
SHARD_NAME = re.compile(r"^shard_(\d{4,})\.safetensors$")
CRC_PREFIX = "crc32c:"

DTYPES: dict[str, np.dtype] = {"F32": np.dtype("<f4"), "I8": np.dtype("i1")}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_HEADER_ALIGN = 8
# Upper bound of one tensor's share of the JSON header: its entry with
# 20-digit offsets and shape numbers, plus its checksum in the metadata.
_HEADER_PER_TENSOR = 200
_HEADER_FIXED = 256


def shard_file(index: int) -> str:
    return f"shard_{index:04d}.safetensors"


def tensor_names(entry_id: int, quantized: bool) -> tuple[str, ...]:
    """Every tensor one entry owns."""
    names = (f"k_{entry_id}", f"v_{entry_id}", f"p_{entry_id}")
    return names + (f"ks_{entry_id}", f"vs_{entry_id}") if quantized else names


def entry_bytes(n_tokens: int, embed_dim: int, quantized: bool) -> int:
    """Tensor bytes one entry adds to a shard (keys, values, pooled key, scales)."""
    if quantized:
        return 2 * n_tokens * embed_dim + 4 * embed_dim + 2 * 4 * n_tokens
    return 2 * 4 * n_tokens * embed_dim + 4 * embed_dim


def tensor_header_bound(quantized: bool) -> int:
    return len(tensor_names(0, quantized)) * _HEADER_PER_TENSOR


# ---- INT8 storage (SPEC §2.7) -------------------------------------------------------


def quantize_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric INT8 per row: scale = max|row| / 127 (0 for a zero row),
    q = round(x / scale) in [-127, 127]."""
    scales = (np.abs(rows).max(axis=1) / np.float32(127)).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1)).astype(np.float64)
    q = np.rint(rows.astype(np.float64) / safe[:, None])
    return np.clip(q, -127, 127).astype(np.int8), scales


def dequantize_rows(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return (q.astype(np.float32) * scales[:, None]).astype(np.float32)


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
    """The tensors of the entries put since the current shard began, copied
    into memory (two arenas: F32 data, then I8 data) until the shard is
    sealed into its file.  Views it hands out are valid until the arenas
    are reset for the next shard."""

    def __init__(self, index: int, uid: str, arenas: tuple[Arena, Arena]) -> None:
        self.index = index
        self.uid = uid
        self.entries = 0
        self.data_bytes = 0
        self._arenas = arenas
        for arena in arenas:
            arena.reset()
        # name -> (arena 0 or 1, dtype, shape, byte offset in that arena's data, place in the arena)
        self._tensors: dict[str, tuple[int, np.dtype, tuple[int, ...], int, tuple[int, int]]] = {}

    def add_entry(self, tensors: dict[str, np.ndarray]) -> None:
        for name, array in tensors.items():
            if array.dtype not in DTYPE_NAMES or not array.flags.c_contiguous:
                raise AssertionError(f"shard tensors are C-contiguous F32 or I8, got {array.dtype} for {name}")
            region = 0 if array.dtype == DTYPES["F32"] else 1
            offset = self._arenas[region].used
            place = self._arenas[region].append(array)
            self._tensors[name] = (region, array.dtype, array.shape, offset, place)
            self.data_bytes += array.nbytes
        self.entries += 1

    def file_bytes_bound(self) -> int:
        """An upper bound of the file size if sealed now."""
        return self.data_bytes + _HEADER_FIXED + _HEADER_PER_TENSOR * len(self._tensors)

    def get(self, name: str) -> np.ndarray:
        region, dtype, shape, _, place = self._tensors[name]
        return self._arenas[region].view(place, dtype, shape)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def encode(self) -> list[Any]:
        """The file's bytes as buffers: header, then the F32 and I8 data."""
        metadata = {"format": SHARD_FORMAT, "format_version": SHARD_FORMAT_VERSION, "shard_uid": self.uid}
        header: dict[str, Any] = {}
        f32_bytes = self._arenas[0].used
        for name, (region, dtype, shape, offset, _) in self._tensors.items():
            start = offset + (f32_bytes if region else 0)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [start, start + nbytes]}
            metadata[CRC_PREFIX + name] = f"{checksum_kernels.crc32c(_bytes_view(self.get(name))):08x}"
        text = json.dumps({"__metadata__": metadata, **header}, separators=(",", ":")).encode()
        text += b" " * (-len(text) % _HEADER_ALIGN)
        return [struct.pack("<Q", len(text)), text, *self._arenas[0].data(), *self._arenas[1].data()]

    def seal(self, path: Path) -> int:
        """Write the shard file durably; returns its size."""
        return _io.write_file(path, self.encode())


def _bytes_view(array: np.ndarray) -> memoryview:
    return memoryview(array).cast("B")


# ---- reading -----------------------------------------------------------------------


class ShardReader:
    """One shard file, memory-mapped, with its header parsed and checked."""

    def __init__(self, path: Path, *, uid: str | None = None, size: int | None = None) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise CorruptStoreError(f"shard {path.name} is missing", hint="run 'hmem verify'") from None
        try:
            actual = os.fstat(fd).st_size
            if size is not None and actual != size:
                raise CorruptStoreError(
                    f"shard {path.name} is {actual} bytes, the store expects {size}", hint="run 'hmem verify'"
                )
            if actual < 8:
                raise CorruptStoreError(f"shard {path.name} is too short to be safetensors ({actual} bytes)")
            self._map = mmap.mmap(fd, actual, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self.size = actual
        self.metadata, self._entries, self._data_start = _parse_header(self._map, path.name)
        if uid is not None and self.metadata.get("shard_uid") != uid:
            raise StoreChangedError(
                f"shard {path.name} was replaced since the store was opened", hint="open the store again"
            )
        self.verified: set[str] = set()

    def names(self) -> list[str]:
        return list(self._entries)

    def info(self, name: str) -> tuple[np.dtype, tuple[int, ...], int, int]:
        """(dtype, shape, start, end) of a tensor; offsets are absolute in the file."""
        try:
            return self._entries[name]
        except KeyError:
            raise CorruptStoreError(f"shard {self.path.name} has no tensor {name}", hint="run 'hmem verify'") from None

    def tensor(self, name: str) -> np.ndarray:
        """A read-only view of the tensor in the memory map (no copy)."""
        dtype, shape, start, end = self.info(name)
        if end - start >= 1 << 16:
            page = mmap.PAGESIZE
            aligned = start - start % page
            self._map.madvise(mmap.MADV_WILLNEED, aligned, end - aligned)
        count = (end - start) // dtype.itemsize
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=start).reshape(shape)

    def expected_crc(self, name: str) -> int | None:
        value = self.metadata.get(CRC_PREFIX + name)
        try:
            return int(value, 16) if value is not None else None
        except ValueError:
            return None

    def check(self, name: str) -> bool:
        """Whether the tensor's bytes match its recorded CRC-32C."""
        _, _, start, end = self.info(name)
        expected = self.expected_crc(name)
        ok = expected is not None and checksum_kernels.crc32c(memoryview(self._map)[start:end]) == expected
        if ok:
            self.verified.add(name)
        return ok


def _parse_header(buf: mmap.mmap, name: str) -> tuple[dict[str, str], dict[str, tuple], int]:
    def bad(why: str) -> CorruptStoreError:
        return CorruptStoreError(f"shard {name} has a damaged header: {why}", hint="run 'hmem verify'")

    (length,) = struct.unpack_from("<Q", buf, 0)
    if length > len(buf) - 8:
        raise bad(f"header length {length} runs past the end of the file")
    try:
        header = json.loads(bytes(buf[8 : 8 + length]))
    except (ValueError, UnicodeDecodeError):
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
            shape = tuple(int(x) for x in spec["shape"])
            start, end = (int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {tensor} has a malformed entry") from None
        if any(x < 0 for x in shape) or not 0 <= start <= end <= data_len:
            raise bad(f"tensor {tensor} lies outside the data")
        if end - start != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise bad(f"tensor {tensor}'s size does not match its shape")
        entries[tensor] = (dtype, shape, data_start + start, data_start + end)
    return metadata, entries, data_start


class ShardCache:
    """At most `capacity` shard files memory-mapped at once (least recently
    used is dropped first).  Arrays already handed out keep their own map
    alive until they are freed."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._open: collections.OrderedDict[int, ShardReader] = collections.OrderedDict()

    def get(self, index: int, path: Path, uid: str, size: int) -> ShardReader:
        reader = self._open.get(index)
        if reader is not None:
            self._open.move_to_end(index)
            return reader
        reader = ShardReader(path, uid=uid, size=size)
        self._open[index] = reader
        while len(self._open) > self.capacity:
            self._open.popitem(last=False)
        return reader

    def open_count(self) -> int:
        return len(self._open)

    def drop(self, index: int | None = None) -> None:
        if index is None:
            self._open.clear()
        else:
            self._open.pop(index, None)
