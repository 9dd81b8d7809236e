# cython: language_level=3
"""Native safetensors header text of many tensors (docs/format.md, "Shards").

A shard's JSON header names every tensor and its checksum.  A bulk put of
100,000 small entries writes 300,000 tensors; formatting their entries in
Python costs about 1.5 us each, more than the rest of the put, so this
module writes them in one pass over the arrays.  The text is exactly what
hmem.kernels.reference.header_text, its twin, writes.

Data layout: ids, begins and ends are int64 [n]; shapes is int64 [n, r]
(r >= 0 dimensions per tensor); crcs is uint32 [n].  Each entry is followed
by a comma.
"""

from libc.stdint cimport int64_t, uint32_t
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

include "one_path.pxi"


cdef inline Py_ssize_t _put_int(char *out, int64_t value) noexcept nogil:
    """Decimal digits of value at out; returns how many bytes were written."""
    cdef char digits[24]
    cdef Py_ssize_t n = 0, i, at = 0
    cdef unsigned long long u
    if value < 0:
        out[0] = b'-'
        at = 1
        u = <unsigned long long>(-(value + 1)) + 1
    else:
        u = <unsigned long long>value
    while True:
        digits[n] = <char>(48 + u % 10)
        n += 1
        u //= 10
        if u == 0:
            break
    for i in range(n):
        out[at + i] = digits[n - 1 - i]
    return at + n


cdef inline Py_ssize_t _put(char *out, const char *text, Py_ssize_t n) noexcept nogil:
    memcpy(out, text, n)
    return n


def _checked_text(value, what):
    if not isinstance(value, bytes) or b'"' in value or b'\\' in value:
        raise ValueError(f"{what} must be bytes without quotes or backslashes, got {value!r}")
    return value


def tensor_entries(bytes prefix, const int64_t[::1] ids, bytes dtype, const int64_t[:, ::1] shapes,
                   const int64_t[::1] begins, const int64_t[::1] ends):
    """``"<prefix><id>":{"dtype":"<dtype>","shape":[..],"data_offsets":[b,e]},``
    for each tensor, as one bytes object."""
    _checked_text(prefix, "prefix")
    _checked_text(dtype, "dtype")
    cdef Py_ssize_t n = ids.shape[0], rank = shapes.shape[1], i, j, at = 0
    if shapes.shape[0] != n or begins.shape[0] != n or ends.shape[0] != n:
        raise ValueError("ids, shapes, begins and ends must have one row per tensor")
    cdef Py_ssize_t lp = len(prefix), ld = len(dtype)
    # 20 digits, a sign and a comma per number, and the fixed text around them
    cdef Py_ssize_t per = lp + ld + 22 * (3 + rank) + 64
    if n == 0:
        return b""
    cdef char *o = <char *>malloc(n * per)
    if o == NULL:
        raise MemoryError()
    cdef const char *p = prefix
    cdef const char *dt = dtype
    with nogil:
        for i in range(n):
            at += _put(o + at, b'"', 1)
            at += _put(o + at, p, lp)
            at += _put_int(o + at, ids[i])
            at += _put(o + at, b'":{"dtype":"', 12)
            at += _put(o + at, dt, ld)
            at += _put(o + at, b'","shape":[', 11)
            for j in range(rank):
                if j:
                    at += _put(o + at, b',', 1)
                at += _put_int(o + at, shapes[i, j])
            at += _put(o + at, b'],"data_offsets":[', 18)
            at += _put_int(o + at, begins[i])
            at += _put(o + at, b',', 1)
            at += _put_int(o + at, ends[i])
            at += _put(o + at, b']},', 3)
    try:
        return PyBytes_FromStringAndSize(o, at)
    finally:
        free(o)


def crc_entries(bytes prefix, const int64_t[::1] ids, const uint32_t[::1] crcs):
    """``"<prefix><id>":"<crc as 8 lower-case hex digits>",`` for each tensor."""
    _checked_text(prefix, "prefix")
    cdef Py_ssize_t n = ids.shape[0], i, k, at = 0
    if crcs.shape[0] != n:
        raise ValueError("ids and crcs must have one value per tensor")
    cdef Py_ssize_t lp = len(prefix)
    if n == 0:
        return b""
    cdef char *o = <char *>malloc(n * (lp + 21 + 16))
    if o == NULL:
        raise MemoryError()
    cdef const char *p = prefix
    cdef const char *hexdigits = b"0123456789abcdef"
    cdef uint32_t c
    with nogil:
        for i in range(n):
            at += _put(o + at, b'"', 1)
            at += _put(o + at, p, lp)
            at += _put_int(o + at, ids[i])
            at += _put(o + at, b'":"', 3)
            c = crcs[i]
            for k in range(8):
                o[at + k] = hexdigits[(c >> (28 - 4 * k)) & 15]
            at += 8
            at += _put(o + at, b'",', 2)
    try:
        return PyBytes_FromStringAndSize(o, at)
    finally:
        free(o)
