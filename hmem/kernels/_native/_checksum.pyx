# cython: language_level=3
"""Native CRC-32C (Castagnoli), the checksum of hmem's files and tensors.

Data layout (stated once): the checksum covers the bytes of a C-contiguous
buffer in memory order: bytes, bytearray, memoryview, or a numpy array of
any plain dtype (its raw bytes, host byte order, which is little-endian on
every host hmem builds for).

crc32c(data, crc) continues a running checksum: crc32c(b, crc32c(a)) equals
crc32c(a + b), and crc32c(b"") == 0.  crc32c_rows checksums each row of a
C-contiguous uint8 matrix (n, row_bytes) on its own, leaving out the bytes
[skip_start, skip_end) of every row (where a record keeps its own checksum).
The twin is hmem._reference.checksum.
"""

import numpy as np

from libc.stdint cimport int64_t, uint8_t, uint32_t

cdef extern from "checksum.h" nogil:
    void hm_crc32c_init()
    uint32_t hm_crc32c(uint32_t crc, const uint8_t *p, size_t n)

include "cpu_paths.pxi"

# Every path but "portable" uses the SSE4.2 crc32 instruction when the CPU has it.
hm_crc32c_init()
hm_select_path(len(PATH_NAMES) - 1)


def _byte_view(data):
    """The bytes of any C-contiguous buffer, without a copy."""
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(f"crc32c needs a buffer (bytes, bytearray, memoryview, numpy array), "
                        f"not {type(data).__name__}") from None
    if not view.c_contiguous:
        raise ValueError("crc32c needs a C-contiguous buffer")
    try:
        return view.cast("B")
    except TypeError:  # a format memoryview cannot cast (numpy structured dtypes)
        return np.frombuffer(view, dtype=np.uint8)


def _check_crc(crc):
    if not 0 <= crc <= 0xFFFFFFFF:
        raise ValueError(f"crc must be a 32-bit unsigned value, got {crc}")


def crc32c(data, crc=0):
    """CRC-32C of the bytes of `data` (any C-contiguous buffer), continuing
    from the checksum `crc` of the bytes before it (0 to start)."""
    cdef const unsigned char[::1] view
    _check_crc(crc)
    try:
        view = data  # bytes, bytearray, uint8 arrays: no conversion
    except (TypeError, ValueError):
        view = _byte_view(data)
    cdef uint32_t state = <uint32_t>crc
    cdef size_t n = <size_t>view.shape[0]
    if n == 0:
        return state
    if n < 65536:  # releasing the GIL would cost more than it frees
        return hm_crc32c(state, &view[0], n)
    with nogil:
        state = hm_crc32c(state, &view[0], n)
    return state


def crc32c_rows(const unsigned char[:, ::1] rows, Py_ssize_t skip_start, Py_ssize_t skip_end):
    """Per row of `rows`: CRC-32C of bytes [0, skip_start) followed by bytes
    [skip_end, row length), as a uint32 array [n] (one checksum per record
    of entries.bin, leaving out the checksum field itself)."""
    cdef Py_ssize_t n = rows.shape[0], width = rows.shape[1], r
    if not 0 <= skip_start <= skip_end <= width:
        raise ValueError(f"skip range [{skip_start}, {skip_end}) is outside rows of {width} bytes "
                         f"(need 0 <= skip_start <= skip_end <= {width})")
    out = np.zeros(n, dtype=np.uint32)
    cdef uint32_t[::1] o = out
    cdef const uint8_t *row
    if n == 0 or width == 0:
        return out
    with nogil:
        for r in range(n):
            row = &rows[r, 0]
            o[r] = hm_crc32c(hm_crc32c(0, row, <size_t>skip_start),
                             row + skip_end, <size_t>(width - skip_end))
    return out


def crc32c_pieces(data, const int64_t[::1] bounds):
    """CRC-32C of each piece data[bounds[i] : bounds[i + 1]] of the bytes of
    `data` (any C-contiguous buffer), as a uint32 array [len(bounds) - 1]:
    the checksums of many tensors laid back to back, in one call."""
    cdef const unsigned char[::1] view
    try:
        view = data
    except (TypeError, ValueError):
        view = _byte_view(data)
    cdef Py_ssize_t n = bounds.shape[0] - 1, i, size = view.shape[0]
    if n < 0:
        raise ValueError("bounds must hold at least one offset")
    for i in range(n):
        if not 0 <= bounds[i] <= bounds[i + 1] <= size:
            raise ValueError(f"piece {i} [{bounds[i]}, {bounds[i + 1]}) is not inside {size} bytes in order")
    out = np.zeros(n, dtype=np.uint32)
    cdef uint32_t[::1] o = out
    if n == 0 or size == 0:
        return out
    with nogil:
        for i in range(n):
            o[i] = hm_crc32c(0, &view[0] + bounds[i], <size_t>(bounds[i + 1] - bounds[i]))
    return out
