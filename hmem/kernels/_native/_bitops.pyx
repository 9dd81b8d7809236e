# cython: language_level=3
"""Native kernels over LSB-first packed bitmaps: bit primitives and the
prefix-hit fold / unfold.

Data layout (stated once): bit i is in byte i // 8 under mask 1 << (i % 8).
A presence map of G groups, C chunks and R kv-rank shards has N = G*C*R bits:

- group-major: bit g*C*R + j*R + r
- chunk-major: bit j*G*R + g*R + r

The grouped form takes one C-bit row per (group, rank) instead, each its own
buffer, read and written in place (fold_rows_into, unfold_rows_into).

Callers (hmem.kernels) validate every argument; these functions trust sizes,
except that a row buffer shorter than its C bits is refused.
Every function here has a same-named twin in hmem._reference.bitops.
"""

from libc.stdint cimport uint8_t, uint64_t, int64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy
from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer

cdef extern from "bitops.h" nogil:
    size_t hm_next_bit(const uint8_t *buf, size_t nbytes, size_t start, size_t end, int want)
    int64_t hm_highest_set(const uint8_t *buf, size_t nbits)
    void hm_set_range(uint8_t *buf, size_t start, size_t end)
    void hm_clear_range(uint8_t *buf, size_t start, size_t end)
    uint64_t hm_popcount(const uint8_t *buf, size_t nbytes)

include "cpu_paths.pxi"


cdef inline uint64_t hm_popcount_byte(unsigned x) noexcept nogil:
    cdef uint64_t n = 0
    while x:
        x &= x - 1
        n += 1
    return n


cdef inline const uint8_t *_rptr(const unsigned char[::1] buf):
    return &buf[0] if buf.shape[0] > 0 else NULL


cdef inline uint8_t *_wptr(unsigned char[::1] buf):
    return &buf[0] if buf.shape[0] > 0 else NULL


# ---- bit primitives -------------------------------------------------------

def popcount(const unsigned char[::1] buf, Py_ssize_t nbits):
    """Number of set bits in [0, nbits); bits past nbits are not counted."""
    cdef size_t whole = <size_t>(nbits >> 3)
    cdef unsigned tail = <unsigned>(nbits & 7)
    cdef uint64_t total = hm_popcount(_rptr(buf), whole)
    if tail:
        total += hm_popcount_byte(buf[whole] & ((1u << tail) - 1))
    return total


def highest_set_bit(const unsigned char[::1] buf, Py_ssize_t nbits):
    return hm_highest_set(_rptr(buf), <size_t>nbits)


def next_bit(const unsigned char[::1] buf, Py_ssize_t start, Py_ssize_t end, int want):
    """First index in [start, end) whose bit equals `want`, else `end`."""
    return hm_next_bit(_rptr(buf), <size_t>buf.shape[0], <size_t>start, <size_t>end, want)


def set_range(unsigned char[::1] buf, Py_ssize_t start, Py_ssize_t end):
    hm_set_range(_wptr(buf), <size_t>start, <size_t>end)


def clear_range(unsigned char[::1] buf, Py_ssize_t start, Py_ssize_t end):
    hm_clear_range(_wptr(buf), <size_t>start, <size_t>end)


# ---- fold / unfold --------------------------------------------------------

cdef long long *_windows_array(windows) except NULL:
    cdef Py_ssize_t g, n = len(windows)
    cdef long long *w = <long long *>malloc(max(n, 1) * sizeof(long long))
    if w == NULL:
        raise MemoryError()
    for g in range(n):
        w[g] = windows[g]
    return w


cdef size_t _fold_group_major(const uint8_t *found, size_t nbytes, size_t C,
                              size_t R, const long long *w, size_t G,
                              uint8_t *out) noexcept nogil:
    cdef size_t g, base, end, p, q, s, e, first, covered
    cdef size_t K = C
    # Full-attention groups first: each can serve exactly the lengths up to
    # its first absent chunk, and no group needs to be read past the
    # smallest such gap K.
    for g in range(G):
        if w[g] <= 0:
            base = g * C * R
            p = hm_next_bit(found, nbytes, base, base + K * R, 0)
            if p < base + K * R:
                K = (p - base) // R
    hm_set_range(out, 0, K)
    # A window-w group serves length L iff the run of present chunks ending
    # at chunk L-1 is at least min(w, L) long.  For each maximal run of
    # present chunks [s, e), it serves fold bits [s + w - 1, e), or [0, e)
    # when s = 0; every other bit below K is cleared.  Runs of set bits are
    # found with two scans each, so long gaps and long runs cost one scan.
    for g in range(G):
        if w[g] > 0:
            base = g * C * R
            end = base + K * R
            p = base
            covered = 0  # fold bits below this are decided for this group
            while p < end:
                p = hm_next_bit(found, nbytes, p, end, 1)
                if p >= end:
                    break
                q = hm_next_bit(found, nbytes, p, end, 0)
                s = (p - base + R - 1) // R  # first chunk wholly inside the run
                e = (q - base) // R          # one past the last such chunk
                if s < e:
                    first = 0 if s == 0 else s + <size_t>w[g] - 1
                    if first < e:
                        hm_clear_range(out, covered, first)
                        covered = e
                p = q
            hm_clear_range(out, covered, K)
    return K


cdef size_t _fold_chunk_major(const uint8_t *found, size_t nbytes, size_t C,
                              size_t R, const long long *w, size_t G,
                              uint8_t *out) noexcept nogil:
    # One pass in chunk order; it ends at the first gap of any
    # full-attention group, since no length past it is servable.
    cdef size_t row = G * R
    cdef size_t end = C * row
    cdef size_t p = 0, j, g, hi
    cdef size_t K = C
    hm_set_range(out, 0, C)
    while True:
        p = hm_next_bit(found, nbytes, p, end, 0)
        if p >= end:
            break
        j = p // row
        g = (p - j * row) // R
        if w[g] <= 0:
            K = j
            break
        hi = j + <size_t>w[g]
        hm_clear_range(out, j, hi if hi < C else C)
        p = j * row + (g + 1) * R
    hm_clear_range(out, K, C)
    return K


def fold_into(const unsigned char[::1] found, Py_ssize_t C, Py_ssize_t R,
              windows, bint chunk_major, unsigned char[::1] out):
    """Write the C-bit servable map of `found` into the zeroed `out`."""
    cdef size_t G = len(windows)
    cdef long long *w = _windows_array(windows)
    cdef const uint8_t *src = _rptr(found)
    cdef uint8_t *dst = _wptr(out)
    cdef size_t nbytes = <size_t>found.shape[0]
    try:
        with nogil:
            if chunk_major:
                _fold_chunk_major(src, nbytes, C, R, w, G, dst)
            else:
                _fold_group_major(src, nbytes, C, R, w, G, dst)
    finally:
        free(w)


cdef void _tile_bytes(uint8_t *buf, size_t start, size_t unit, size_t count) noexcept nogil:
    # buf[start : start + unit] holds a pattern; repeat it `count` times in
    # total by doubling copies.
    cdef size_t done = 1, n
    while done < count:
        n = done if done <= count - done else count - done
        memcpy(buf + start + done * unit, buf + start, n * unit)
        done += n


cdef void _unfold_chunk_cells(uint8_t *out, size_t j0, size_t j1, size_t R,
                              size_t G, const size_t *lo) noexcept nogil:
    cdef size_t j, g, row = G * R
    for j in range(j0, j1):
        for g in range(G):
            if lo[g] <= j:
                hm_set_range(out, j * row + g * R, j * row + g * R + R)


cdef void _unfold_chunk_major(uint8_t *out, size_t hit, size_t R, size_t G,
                              const size_t *lo) noexcept nogil:
    # Chunk j keeps group g's ranks iff lo[g] <= j < hit.  Between two
    # consecutive distinct lo values the kept pattern of a chunk row is the
    # same, so each such segment is written once per tiling unit and copied.
    # A unit is one row when rows are whole bytes, else 8 rows (8*G*R bits
    # is always whole bytes).
    cdef size_t row = G * R
    cdef size_t unit_rows = 1 if row % 8 == 0 else 8
    cdef size_t unit_bytes = unit_rows * row // 8
    cdef size_t seg_start, seg_end, g, a, b
    seg_start = hit
    for g in range(G):
        if lo[g] < seg_start:
            seg_start = lo[g]
    while seg_start < hit:
        seg_end = hit
        for g in range(G):
            if lo[g] > seg_start and lo[g] < seg_end:
                seg_end = lo[g]
        # [a, b): whole units inside the segment, unit-aligned
        a = (seg_start + unit_rows - 1) // unit_rows * unit_rows
        b = seg_end // unit_rows * unit_rows
        if b >= a + 2 * unit_rows:
            _unfold_chunk_cells(out, seg_start, a + unit_rows, R, G, lo)
            _tile_bytes(out, a * row // 8, unit_bytes, (b - a) // unit_rows)
            _unfold_chunk_cells(out, b, seg_end, R, G, lo)
        else:
            _unfold_chunk_cells(out, seg_start, seg_end, R, G, lo)
        seg_start = seg_end


def unfold_into(Py_ssize_t hit, Py_ssize_t C, Py_ssize_t R, windows,
                bint chunk_major, unsigned char[::1] out):
    """Write the retain mask for `hit` (already clamped to C) into the zeroed
    G*C*R-bit `out`."""
    cdef size_t G = len(windows)
    cdef long long *w = _windows_array(windows)
    cdef size_t *lo = <size_t *>malloc(max(G, 1) * sizeof(size_t))
    cdef uint8_t *dst = _wptr(out)
    cdef size_t g, base
    if lo == NULL:
        free(w)
        raise MemoryError()
    try:
        for g in range(G):
            if w[g] <= 0 or w[g] >= hit:
                lo[g] = 0
            else:
                lo[g] = <size_t>(hit - w[g])
        with nogil:
            if chunk_major:
                _unfold_chunk_major(dst, hit, R, G, lo)
            else:
                for g in range(G):
                    base = g * C * R
                    hm_set_range(dst, base + lo[g] * R, base + <size_t>hit * R)
    finally:
        free(w)
        free(lo)


# ---- grouped form: one buffer per (group, rank) row -------------------------

cdef size_t _fold_rows(const uint8_t **rows, size_t nbytes, size_t C,
                       const long long *w, size_t n, uint8_t *out) noexcept nogil:
    # The group-major fold with one rank per row and each row in its own
    # buffer: full-attention rows bound the servable lengths by their first
    # absent chunk K, then each window row clears what its runs of present
    # chunks cannot serve below K (see _fold_group_major).
    cdef size_t i, p, q, first, covered
    cdef size_t K = C
    for i in range(n):
        if w[i] <= 0:
            p = hm_next_bit(rows[i], nbytes, 0, K, 0)
            if p < K:
                K = p
    hm_set_range(out, 0, K)
    for i in range(n):
        if w[i] > 0:
            p = 0
            covered = 0
            while p < K:
                p = hm_next_bit(rows[i], nbytes, p, K, 1)
                if p >= K:
                    break
                q = hm_next_bit(rows[i], nbytes, p, K, 0)
                first = 0 if p == 0 else p + <size_t>w[i] - 1
                if first < q:
                    hm_clear_range(out, covered, first)
                    covered = q
                p = q
            hm_clear_range(out, covered, K)
    return K


cdef class _RowBuffers:
    """The packed bytes of n row objects, held through the buffer protocol
    (so no row can be resized or freed while a kernel reads or writes it)."""

    cdef Py_buffer *views
    cdef uint8_t **ptrs
    cdef Py_ssize_t held

    def __cinit__(self, rows, Py_ssize_t nbytes, bint writable):
        cdef Py_ssize_t i, n = len(rows)
        cdef int flags = PyBUF_WRITABLE if writable else PyBUF_SIMPLE
        self.held = 0
        self.views = <Py_buffer *>malloc(max(n, 1) * sizeof(Py_buffer))
        self.ptrs = <uint8_t **>malloc(max(n, 1) * sizeof(uint8_t *))
        if self.views == NULL or self.ptrs == NULL:
            raise MemoryError()
        for i in range(n):
            PyObject_GetBuffer(rows[i], &self.views[i], flags)
            self.held += 1
            if self.views[i].len < nbytes:
                raise ValueError(f"row {i} holds {self.views[i].len} bytes, fewer than the {nbytes} its bits need")
            self.ptrs[i] = <uint8_t *>self.views[i].buf

    def __dealloc__(self):
        cdef Py_ssize_t i
        for i in range(self.held):
            PyBuffer_Release(&self.views[i])
        free(self.views)
        free(self.ptrs)


def fold_rows_into(rows, Py_ssize_t C, windows, unsigned char[::1] out):
    """Write the C-bit servable map of `rows` (row i: C bits under
    windows[i]) into the zeroed `out`."""
    cdef size_t n = len(rows)
    cdef size_t nbytes = <size_t>((C + 7) >> 3)
    cdef _RowBuffers held = _RowBuffers(rows, nbytes, False)
    cdef long long *w = _windows_array(windows)
    cdef uint8_t *dst = _wptr(out)
    try:
        with nogil:
            _fold_rows(<const uint8_t **>held.ptrs, nbytes, C, w, n, dst)
    finally:
        free(w)


def unfold_rows_into(Py_ssize_t hit, Py_ssize_t C, windows, outs):
    """Set chunks [lo, hit) of each zeroed C-bit row outs[i], lo = 0 under
    full attention and max(0, hit - w) under a window w; `hit` is already
    clamped to C."""
    cdef size_t i, lo, n = len(outs)
    cdef _RowBuffers held = _RowBuffers(outs, <Py_ssize_t>((C + 7) >> 3), True)
    cdef long long *w = _windows_array(windows)
    try:
        with nogil:
            for i in range(n):
                lo = 0 if w[i] <= 0 or w[i] >= hit else <size_t>(hit - w[i])
                hm_set_range(held.ptrs[i], lo, <size_t>hit)
    finally:
        free(w)
