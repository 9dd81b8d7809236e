"""Plain-Python twin of hmem.kernels._native._checksum: CRC-32C (Castagnoli).

Reflected polynomial 0x82F63B78, initial value 0xFFFFFFFF, final xor
0xFFFFFFFF; crc32c(b"123456789") == 0xE3069283.  One table lookup per byte:
correct and slow (about a MB per second), for tests and HMEM_KERNELS=reference.

Data layout: the bytes of a C-contiguous buffer in memory order (bytes,
bytearray, memoryview, or a numpy array of any plain dtype).
crc32c(b, crc32c(a)) == crc32c(a + b).  crc32c_rows checksums each row of a
uint8 matrix (n, row_bytes) on its own, without the bytes [skip_start,
skip_end) of the row.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

# the CPU-path switch every kernel module offers hmem.kernels, re-exported
from hmem.kernels.reference._paths import PATH_NAMES as PATH_NAMES
from hmem.kernels.reference._paths import active_path as active_path
from hmem.kernels.reference._paths import best_path as best_path
from hmem.kernels.reference._paths import select_path as select_path

if TYPE_CHECKING:
    from typing import TypeAlias

    from numpy.typing import NDArray
    from typing_extensions import Buffer

    # Any C-contiguous buffer, as the native kernel takes it
    # (hmem/kernels/_native/_checksum.pyi).
    _AnyBuffer: TypeAlias = Buffer | NDArray[Any]

POLY = 0x82F63B78


def _make_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ POLY if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _make_table()


def _byte_view(data) -> memoryview:
    """The bytes of any C-contiguous buffer, without a copy."""
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(
            f"crc32c needs a buffer (bytes, bytearray, memoryview, numpy array), not {type(data).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError("crc32c needs a C-contiguous buffer")
    try:
        return view.cast("B")
    except TypeError:  # a format memoryview cannot cast (numpy structured dtypes)
        return np.frombuffer(view, dtype=np.uint8).data


def crc32c(data: _AnyBuffer, crc: int = 0) -> int:
    """CRC-32C of the bytes of `data`, continuing from the checksum `crc`
    of the bytes before it (0 to start)."""
    if not 0 <= crc <= 0xFFFFFFFF:
        raise ValueError(f"crc must be a 32-bit unsigned value, got {crc}")
    state = crc ^ 0xFFFFFFFF
    table = _TABLE
    for byte in _byte_view(data):
        state = table[(state ^ byte) & 0xFF] ^ (state >> 8)
    return state ^ 0xFFFFFFFF


def crc32c_rows(rows: NDArray[np.uint8], skip_start: int, skip_end: int) -> NDArray[np.uint32]:
    """Per row of a 2-d uint8 array: CRC-32C of bytes [0, skip_start)
    followed by bytes [skip_end, row length), as a uint32 array [n]."""
    matrix = np.asarray(rows)
    if matrix.dtype != np.uint8 or matrix.ndim != 2:
        raise ValueError(f"rows must be a 2-d uint8 array, got {matrix.ndim}-d {matrix.dtype}")
    width = matrix.shape[1]
    if not 0 <= skip_start <= skip_end <= width:
        raise ValueError(
            f"skip range [{skip_start}, {skip_end}) is outside rows of {width} bytes "
            f"(need 0 <= skip_start <= skip_end <= {width})"
        )
    return np.array(
        [crc32c(row[skip_end:].tobytes(), crc32c(row[:skip_start].tobytes())) for row in matrix], dtype=np.uint32
    )


def crc32c_pieces(data: _AnyBuffer, bounds: NDArray[np.int64]) -> NDArray[np.uint32]:
    """CRC-32C of each piece data[bounds[i] : bounds[i + 1]] of the bytes of
    `data`, as a uint32 array [len(bounds) - 1]."""
    view = _byte_view(data)
    edges = [int(b) for b in bounds]
    if not edges:
        raise ValueError("bounds must hold at least one offset")
    for i in range(len(edges) - 1):
        if not 0 <= edges[i] <= edges[i + 1] <= len(view):
            raise ValueError(f"piece {i} [{edges[i]}, {edges[i + 1]}) is not inside {len(view)} bytes in order")
    return np.array([crc32c(view[a:b]) for a, b in zip(edges, edges[1:])], dtype=np.uint32)


def read_checked(fd: int, offsets: NDArray[np.int64], buffers: list[Any], crcs: NDArray[np.uint32]) -> int:
    """Fill each writable buffer i with the bytes of the file `fd` at
    offsets[i], checking each against crcs[i]; -1 when every piece matched,
    else the index of the first that did not (nothing after it is read).
    OSError when a read fails, EOFError when the file ends before a piece."""
    if len(buffers) != len(offsets) or len(crcs) != len(offsets):
        raise ValueError(
            f"{len(offsets)} offsets, {len(buffers)} buffers and {len(crcs)} checksums: give one of each per piece"
        )
    for i, offset in enumerate(int(o) for o in offsets):
        if offset < 0:
            raise ValueError(f"piece {i}: offset {offset} is negative")
    views = [memoryview(b).cast("B") for b in buffers]
    for i, (offset, view) in enumerate(zip((int(o) for o in offsets), views)):
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise EOFError("the file ends before a piece")
            done += got
        if crc32c(view) != int(crcs[i]):
            return i
    return -1
