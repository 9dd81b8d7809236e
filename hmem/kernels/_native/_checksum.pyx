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
read_checked reads pieces of a file into buffers and checks each against
its checksum as it comes, without the GIL.
The twin is hmem.kernels.reference.checksum.
"""

import os

import numpy as np

from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.errno cimport errno
from libc.stdint cimport int64_t, uint8_t, uint32_t
from libc.stdlib cimport calloc, free
from posix.types cimport off_t
from posix.uio cimport iovec, preadv

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


DEF READ_RUN_BYTES = 1 << 20  # adjacent pieces read by one preadv, then checked while in the CPU's cache
DEF READ_RUN_PIECES = 512  # buffers one preadv fills at most (IOV_MAX is 1024 on Linux)


cdef int _read_run(int fd, iovec *iov, int count, off_t offset) noexcept nogil:
    """Fill the `count` buffers of iov, back to back, from the file at
    `offset`; 0, or -1 when the file ends first, or errno of a failed read.
    (iov is consumed.)"""
    cdef ssize_t got
    while True:
        while count > 0 and iov[0].iov_len == 0:  # empty pieces: nothing to read (a read of 0 bytes is the end)
            iov += 1
            count -= 1
        if count == 0:
            return 0
        got = preadv(fd, iov, count, offset)
        if got < 0:
            return errno
        if got == 0:
            return -1
        offset += got
        while count > 0 and <size_t>got >= iov[0].iov_len:
            got -= iov[0].iov_len
            iov += 1
            count -= 1
        if count > 0:
            iov[0].iov_base = <char *>iov[0].iov_base + got
            iov[0].iov_len -= got


def read_checked(int fd, const int64_t[::1] offsets, buffers, const uint32_t[::1] crcs):
    """Fill each writable buffer i with the bytes of the file `fd` at
    offsets[i], checking each against crcs[i] (CRC-32C) right after its read;
    adjacent pieces (each starting where the one before ends) are read a
    megabyte at a time by one preadv.  Returns -1 when every piece matched,
    else the index of the first that did not (nothing after it is read).
    Raises OSError when a read fails, EOFError when the file ends before a piece."""
    cdef Py_ssize_t n = offsets.shape[0], i, j, k
    if len(buffers) != n or crcs.shape[0] != n:
        raise ValueError(f"{n} offsets, {len(buffers)} buffers and {crcs.shape[0]} checksums: give one of each per piece")
    cdef Py_buffer *views = <Py_buffer *>calloc(n if n else 1, sizeof(Py_buffer))
    cdef iovec *iov = <iovec *>calloc(READ_RUN_PIECES, sizeof(iovec))
    if views == NULL or iov == NULL:
        free(views)
        free(iov)
        raise MemoryError()
    cdef Py_ssize_t held = 0, bad = -1
    cdef int failed = 0
    cdef size_t run
    try:
        for i in range(n):
            if offsets[i] < 0:
                raise ValueError(f"piece {i}: offset {offsets[i]} is negative")
            PyObject_GetBuffer(buffers[i], &views[i], PyBUF_WRITABLE)
            held += 1
        with nogil:
            i = 0
            while i < n and bad < 0 and failed == 0:
                j, run = i + 1, <size_t>views[i].len
                while (j < n and j - i < READ_RUN_PIECES and run < READ_RUN_BYTES
                       and offsets[j] == offsets[j - 1] + views[j - 1].len):
                    run += <size_t>views[j].len
                    j += 1
                for k in range(i, j):
                    iov[k - i].iov_base = views[k].buf
                    iov[k - i].iov_len = <size_t>views[k].len
                failed = _read_run(fd, iov, <int>(j - i), <off_t>offsets[i])
                if failed == 0:
                    for k in range(i, j):
                        if hm_crc32c(0, <const uint8_t *>views[k].buf, <size_t>views[k].len) != crcs[k]:
                            bad = k
                            break
                i = j
    finally:
        for i in range(held):
            PyBuffer_Release(&views[i])
        free(views)
        free(iov)
    if failed == -1:
        raise EOFError("the file ends before a piece")
    if failed:
        raise OSError(failed, os.strerror(failed))
    return bad
