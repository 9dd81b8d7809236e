# cython: language_level=3
"""Native Hamming distances and top-k search over binary signatures.

Data layout (stated once): a signature is hdc_dim bits packed LSB-first in
nbytes = hdc_dim / 8 bytes, a positive multiple of 8.  `sigs` is a
C-contiguous uint8 matrix of shape (n, nbytes), one signature per row;
`alive` is None or one uint8 (or bool) per row, 0 = skip the row.

topk orders results by (distance ascending, row ascending); that tie rule is
part of hmem's documented query order.  The twin is hmem._reference.hamming.
"""

import operator

import numpy as np

from libc.stdint cimport uint8_t, int32_t, int64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

cdef extern from "hamming.h" nogil:
    void hm_distances(const uint8_t *q, const uint8_t *sigs, size_t n, size_t nbytes,
                      int32_t *out)
    size_t hm_topk(const uint8_t *q, const uint8_t *sigs, size_t n, size_t nbytes,
                   const uint8_t *alive, size_t cap, int32_t *dists, int64_t *rows)
    void hm_topk_many(const uint8_t *qs, size_t nq, const uint8_t *sigs, size_t lo,
                      size_t hi, size_t nbytes, const uint8_t *alive, size_t cap,
                      int32_t *dists, int64_t *rows, size_t *sizes)

include "cpu_paths.pxi"

hm_select_path(len(PATH_NAMES) - 1)


cdef Py_ssize_t _check_shapes(const unsigned char[::1] query,
                              const unsigned char[:, ::1] sigs) except -1:
    cdef Py_ssize_t nbytes = sigs.shape[1]
    if query.shape[0] != nbytes:
        raise ValueError(f"the query has {query.shape[0]} bytes but the signatures have {nbytes}")
    if nbytes <= 0 or nbytes % 8 or nbytes > (1 << 28):
        raise ValueError(f"a signature must be a positive multiple of 8 bytes (at most 2**28), got {nbytes}")
    return nbytes


cdef Py_ssize_t _check_range(Py_ssize_t lo, hi, Py_ssize_t n) except -1:
    cdef Py_ssize_t end = n if hi is None else hi
    if not 0 <= lo <= end <= n:
        raise ValueError(f"rows [{lo}, {end}) are outside a matrix of {n} rows")
    return end


def _check_k(k):
    try:
        k = operator.index(k)
    except TypeError:
        raise ValueError(f"k must be an integer >= 1, got {k!r}") from None
    if k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k}")
    return k


def distances(const unsigned char[::1] query, const unsigned char[:, ::1] sigs):
    """Hamming distance of each row of `sigs` to `query`: int32 array [n]."""
    cdef Py_ssize_t nbytes = _check_shapes(query, sigs)
    cdef Py_ssize_t n = sigs.shape[0]
    out = np.empty(n, dtype=np.int32)
    cdef int32_t[::1] o = out
    if n > 0:
        with nogil:
            hm_distances(&query[0], &sigs[0, 0], <size_t>n, <size_t>nbytes, &o[0])
    return out


def _alive_bytes(alive, Py_ssize_t n):
    """`alive` as one byte per row (bool arrays are viewed as uint8), or None."""
    if alive is None:
        return None
    if getattr(alive, "dtype", None) == np.bool_:
        alive = alive.view(np.uint8)
    cdef const unsigned char[::1] live = alive
    if live.shape[0] != n:
        raise ValueError(f"alive has {live.shape[0]} entries for {n} signatures")
    return alive


def topk_many(const unsigned char[:, ::1] queries, const unsigned char[:, ::1] sigs, alive, k,
              Py_ssize_t lo=0, hi=None):
    """For every query (row of `queries`), the min(k, live rows in [lo, hi))
    rows of `sigs` nearest to it, by (distance, row).

    Returns (rows: int64 [nq, cap], dists: int32 [nq, cap], counts: int64
    [nq]) with cap = min(k, hi - lo); query j's results are the first
    counts[j] of its row (fewer than cap only when rows are dead).  The
    matrix is read once for the whole batch; the GIL is released while it
    is scanned, so threads may each scan their own [lo, hi).
    """
    cdef Py_ssize_t nbytes = sigs.shape[1]
    cdef Py_ssize_t n = sigs.shape[0]
    cdef Py_ssize_t nq = queries.shape[0]
    if queries.shape[1] != nbytes:
        raise ValueError(f"the queries have {queries.shape[1]} bytes but the signatures have {nbytes}")
    if nbytes <= 0 or nbytes % 8 or nbytes > (1 << 28):
        raise ValueError(f"a signature must be a positive multiple of 8 bytes (at most 2**28), got {nbytes}")
    k = _check_k(k)
    cdef Py_ssize_t end = _check_range(lo, hi, n)
    alive = _alive_bytes(alive, n)
    cdef const unsigned char[::1] live
    cdef const uint8_t *live_ptr = NULL
    if alive is not None and n > 0:
        live = alive
        live_ptr = &live[0]
    cdef Py_ssize_t cap = min(k, end - lo)
    rows = np.zeros((nq, cap), dtype=np.int64)
    dists = np.zeros((nq, cap), dtype=np.int32)
    counts = np.zeros(nq, dtype=np.int64)
    cdef int64_t[:, ::1] r = rows
    cdef int32_t[:, ::1] d = dists
    cdef int64_t[::1] c = counts
    if cap > 0 and nq > 0:
        with nogil:
            hm_topk_many(&queries[0, 0], <size_t>nq, &sigs[0, 0], <size_t>lo, <size_t>end,
                         <size_t>nbytes, live_ptr, <size_t>cap, &d[0, 0], &r[0, 0],
                         <size_t *>&c[0])  # int64 and size_t: both 64-bit where hmem builds
    return rows, dists, counts


def topk(const unsigned char[::1] query, const unsigned char[:, ::1] sigs, alive, k,
         Py_ssize_t lo=0, hi=None):
    """The min(k, live rows in [lo, hi)) rows nearest to `query`, by
    (distance, row).

    Returns (rows: int64 array [m], dists: int32 array [m]).  `alive` is None
    (every row is live) or a uint8/bool array of one entry per row.  The GIL
    is released during the scan, so threads may each scan their own [lo, hi).
    """
    cdef Py_ssize_t nbytes = _check_shapes(query, sigs)
    cdef Py_ssize_t n = sigs.shape[0]
    k = _check_k(k)
    cdef Py_ssize_t end = _check_range(lo, hi, n)

    alive = _alive_bytes(alive, n)
    cdef const unsigned char[::1] live
    cdef const uint8_t *live_ptr = NULL
    if alive is not None and n > 0:
        live = alive
        live_ptr = &live[0]
    cdef Py_ssize_t cap = min(k, end - lo)
    rows = np.empty(cap, dtype=np.int64)
    dists = np.empty(cap, dtype=np.int32)
    cdef int64_t[::1] r = rows
    cdef int32_t[::1] d = dists
    cdef size_t m = 0
    if cap > 0:
        with nogil:
            m = hm_topk(&query[0], &sigs[lo, 0], <size_t>(end - lo), <size_t>nbytes,
                        NULL if live_ptr == NULL else live_ptr + lo, <size_t>cap, &d[0], &r[0])
    if m < <size_t>cap:  # dead rows: fewer results than room
        rows, dists = rows[:m].copy(), dists[:m].copy()
    if lo:
        rows += lo
    return rows, dists


def gather_rows(const unsigned char[:, :] src, const int64_t[::1] rows, unsigned char[:, ::1] out):
    """out[i] = src[rows[i]]: signatures gathered out of the records (whose
    rows are further apart than their width) into a contiguous matrix.
    numpy's fancy indexing copies such rows an element at a time."""
    cdef Py_ssize_t n = rows.shape[0], width = src.shape[1], i, r
    if width > 1 and src.strides[1] != 1:
        raise ValueError("each row of src must be contiguous bytes")
    if out.shape[0] != n or out.shape[1] != width:
        raise ValueError(f"out has shape {(out.shape[0], out.shape[1])}, need {(n, width)}")
    for i in range(n):
        r = rows[i]
        if not 0 <= r < src.shape[0]:
            raise ValueError(f"row {r} is outside a matrix of {src.shape[0]} rows")
    if n == 0 or width == 0:
        return
    with nogil:
        for i in range(n):
            memcpy(&out[i, 0], &src[rows[i], 0], <size_t>width)
