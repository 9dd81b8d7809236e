# cython: language_level=3
"""Native INT8 row quantization of K/V (docs/format.md, "INT8 storage").

Data layout: rows is a C-contiguous float32 [n, d] matrix; q the int8
[n, d] result and scales the float32 [n] per-row scales.

Per row: scale = max|x| / 127 in float32 (0 for a zero row; one step
smaller when 127 * scale would overflow); each element
q = round-half-even(x / scale), the division in float32, clamped to
[-127, 127].  Dequantization is float32(q) * scale in float32.  Every step
is one IEEE operation, so the reference twin (hmem._reference.quantize)
gives the same bytes.  The loops are in quantize.h.
"""

from libc.stdint cimport int8_t

cdef extern from "quantize.h" nogil:
    void hm_quantize_rows(const float *rows, size_t n, size_t d, int8_t *q, float *scales)
    void hm_dequantize_rows(const int8_t *q, const float *scales, size_t n, size_t d, float *out)

include "one_path.pxi"


def quantize_rows(const float[:, ::1] rows, int8_t[:, ::1] q, float[::1] scales):
    """Fill q and scales from rows (shapes [n, d], [n, d], [n])."""
    cdef Py_ssize_t n = rows.shape[0], d = rows.shape[1]
    if q.shape[0] != n or q.shape[1] != d or scales.shape[0] != n:
        raise ValueError("q must be [n, d] and scales [n] for rows of shape [n, d]")
    if n == 0 or d == 0:
        scales[:] = 0
        return
    with nogil:
        hm_quantize_rows(&rows[0, 0], n, d, &q[0, 0], &scales[0])


def dequantize_rows(const int8_t[:, ::1] q, const float[::1] scales, float[:, ::1] out):
    """out[i, j] = float32(q[i, j]) * scales[i]."""
    cdef Py_ssize_t n = q.shape[0], d = q.shape[1]
    if scales.shape[0] != n or out.shape[0] != n or out.shape[1] != d:
        raise ValueError("scales must be [n] and out [n, d] for q of shape [n, d]")
    if n == 0 or d == 0:
        return
    with nogil:
        hm_dequantize_rows(&q[0, 0], &scales[0], n, d, &out[0, 0])
