# cython: language_level=3
"""Native signature projection: SplitMix64 sign bits + fast Walsh-Hadamard
rounds.  The on-disk format fixes every output bit forever; the twin
hmem._reference.projection is its executable definition, and the two agree
bit for bit on every CPU path.

Data layout (stated once):
- splitmix64(seed, count): outputs k = 0 .. count-1 of SplitMix64 seeded
  with `seed` (uint64 array);
- signs_table(seed, m, rounds, blocks): blocks*rounds*m sign bits as one
  stream, the little-endian bytes of splitmix64(seed, blocks*rounds*m/64);
  bit p = (b*rounds + r)*m + i negates element i in round r of block b;
- signature(rows, signs, m, rounds, hdc_dim, out): rows float32 (n, d),
  1 <= d <= m, m a power of two >= 64; out receives hdc_dim bits packed
  LSB-first (hdc_dim / 8 bytes), bit b*m + i = element i of block b > 0;
- signature_of_sum(sums, ...): the same bits from the rows' float64 token
  sum (d values) instead of the rows;
- bf16_token_sums(words, sums): words uint16 (n, a, b), bfloat16 bit
  patterns of n tokens' rows of a*b values (any strides);
  sums receives their float64 token sums, as signature(sums=) gives them
  for the same rows widened to float32.
"""

import operator

import numpy as np

from libc.stdint cimport int64_t, uint8_t, uint16_t, uint64_t

cdef extern from "projection.h" nogil:
    void hm_projection_init()
    const char *hm_signature_variant()
    int hm_signature(const float *rows, size_t n, size_t d, const uint8_t *signs,
                     size_t m, size_t rounds, size_t hdc_dim, uint8_t *out, double *sum_out)
    void hm_splitmix64(uint64_t seed, size_t count, uint64_t *out)
    int hm_signature_of_sum(const double *sum, size_t d, const uint8_t *signs, size_t m, size_t rounds,
                            size_t hdc_dim, uint8_t *out)
    void hm_bf16_token_sums(const uint16_t *w, size_t n, size_t a, size_t b, Py_ssize_t st, Py_ssize_t sa,
                            Py_ssize_t sb, double *s)
    int hm_signature_many(const float *rows, const int64_t *starts, size_t count, size_t d,
                          const uint8_t *signs, size_t m, size_t rounds, size_t hdc_dim,
                          uint8_t *out, double *sum_out)

include "cpu_paths.pxi"

hm_projection_init()
hm_select_path(len(PATH_NAMES) - 1)


def variant():
    """The code signature() runs on the current path: baseline, avx2 or avx512f."""
    return hm_signature_variant().decode()


def _index(name, value, lo):
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return value


def _check_m(m):
    m = _index("m", m, 64)
    if m & (m - 1):
        raise ValueError(f"m must be a power of two >= 64, got {m}")
    return m


def _checked_args(m, rounds, hdc_dim, sign_bytes):
    """(m, rounds, hdc_dim) as ints, checked, and the sign table's length against them."""
    m = _check_m(m)
    rounds = _index("rounds", rounds, 1)
    hdc_dim = _index("hdc_dim", hdc_dim, 8)
    if hdc_dim % 8:
        raise ValueError(f"hdc_dim must be a multiple of 8, got {hdc_dim}")
    blocks = -(-hdc_dim // m)
    if sign_bytes != blocks * rounds * m // 8:
        raise ValueError(f"signs has {sign_bytes} bytes; m={m}, rounds={rounds}, "
                         f"hdc_dim={hdc_dim} need {blocks * rounds * m // 8}")
    return m, rounds, hdc_dim


def splitmix64(seed, count):
    """Outputs 0 .. count-1 of SplitMix64 seeded with `seed` (0 <= seed < 2**64)."""
    seed = _index("seed", seed, 0)
    if seed >= 1 << 64:
        raise ValueError(f"seed must be below 2**64, got {seed}")
    count = _index("count", count, 0)
    out = np.empty(count, dtype=np.uint64)
    cdef uint64_t[::1] o = out
    if count > 0:
        hm_splitmix64(<uint64_t>seed, <size_t>count, &o[0])
    return out


def signs_table(seed, m, rounds, blocks):
    """The blocks*rounds*m sign bits, packed LSB-first: blocks*rounds*m/8 bytes."""
    m = _check_m(m)
    rounds = _index("rounds", rounds, 1)
    blocks = _index("blocks", blocks, 1)
    return splitmix64(seed, blocks * rounds * m // 64).astype("<u8").view(np.uint8)


def signature(const float[:, ::1] rows, const unsigned char[::1] signs, m, rounds, hdc_dim,
              unsigned char[::1] out, double[::1] sums=None):
    """Write the hdc_dim-bit signature of the token sum of `rows` into `out`,
    and the float64 token sum itself into `sums` (d values) when given."""
    m, rounds, hdc_dim = _checked_args(m, rounds, hdc_dim, signs.shape[0])
    cdef Py_ssize_t n = rows.shape[0], d = rows.shape[1]
    if n < 1 or d < 1 or d > m:
        raise ValueError(f"rows must be (n_tokens >= 1, d) with 1 <= d <= m = {m}, got ({n}, {d})")
    if out.shape[0] != hdc_dim // 8:
        raise ValueError(f"out has {out.shape[0]} bytes; hdc_dim={hdc_dim} needs {hdc_dim // 8}")
    cdef size_t cm = m, crounds = rounds, cdim = hdc_dim
    cdef int rc
    cdef double *sum_out = NULL
    if sums is not None:
        if sums.shape[0] != d:
            raise ValueError(f"sums has {sums.shape[0]} values; rows have {d} columns")
        sum_out = &sums[0]
    with nogil:
        rc = hm_signature(&rows[0, 0], <size_t>n, <size_t>d, &signs[0], cm, crounds, cdim, &out[0], sum_out)
    if rc != 0:
        raise MemoryError()


def signature_many(const float[:, ::1] rows, const int64_t[::1] starts, const unsigned char[::1] signs, m,
                   rounds, hdc_dim, unsigned char[:, ::1] out, double[:, ::1] sums=None):
    """signature() of many entries in one call: entry e is rows
    starts[e] .. starts[e + 1] - 1 (at least one row; starts[0] = 0 and
    starts[-1] = the row count); its signature goes to out[e] and, when
    `sums` is given, its float64 token sum to sums[e]."""
    m, rounds, hdc_dim = _checked_args(m, rounds, hdc_dim, signs.shape[0])
    cdef Py_ssize_t n = rows.shape[0], d = rows.shape[1], count = starts.shape[0] - 1
    if count < 0:
        raise ValueError("starts must hold at least one offset")
    if d < 1 or d > m:
        raise ValueError(f"rows must have 1 <= d <= m = {m} columns, got {d}")
    if out.shape[0] != count or out.shape[1] != hdc_dim // 8:
        raise ValueError(f"out must be ({count}, {hdc_dim // 8}), got ({out.shape[0]}, {out.shape[1]})")
    cdef Py_ssize_t e
    if starts[0] != 0 or starts[count] != n:
        raise ValueError(f"starts must run from 0 to the row count {n}")
    for e in range(count):
        if starts[e + 1] <= starts[e]:
            raise ValueError(f"entry {e} has no rows (starts must increase)")
    cdef double *sum_out = NULL
    if sums is not None:
        if sums.shape[0] != count or sums.shape[1] != d:
            raise ValueError(f"sums must be ({count}, {d}), got ({sums.shape[0]}, {sums.shape[1]})")
        if count:
            sum_out = &sums[0, 0]
    if count == 0:
        return
    cdef size_t cm = m, crounds = rounds, cdim = hdc_dim
    cdef int rc
    with nogil:
        rc = hm_signature_many(&rows[0, 0], &starts[0], <size_t>count, <size_t>d, &signs[0], cm, crounds, cdim,
                               &out[0, 0], sum_out)
    if rc != 0:
        raise MemoryError()


def signature_of_sum(const double[::1] sums, const unsigned char[::1] signs, m, rounds, hdc_dim,
                     unsigned char[::1] out):
    """Write into `out` the signature of rows whose float64 token sum is
    `sums` (d values): signature()'s bits for those rows."""
    m, rounds, hdc_dim = _checked_args(m, rounds, hdc_dim, signs.shape[0])
    cdef Py_ssize_t d = sums.shape[0]
    if d < 1 or d > m:
        raise ValueError(f"sums must hold 1 <= d <= m = {m} values, got {d}")
    if out.shape[0] != hdc_dim // 8:
        raise ValueError(f"out has {out.shape[0]} bytes; hdc_dim={hdc_dim} needs {hdc_dim // 8}")
    cdef size_t cm = m, crounds = rounds, cdim = hdc_dim
    cdef int rc
    with nogil:
        rc = hm_signature_of_sum(&sums[0], <size_t>d, &signs[0], cm, crounds, cdim, &out[0])
    if rc != 0:
        raise MemoryError()


def bf16_token_sums(const uint16_t[:, :, :] words, double[::1] sums):
    """Write into `sums` (a*b values) the float64 token sums of the
    float32 values of the bfloat16 words (n, a, b), in token order."""
    cdef Py_ssize_t n = words.shape[0], a = words.shape[1], b = words.shape[2]
    if sums.shape[0] != a * b:
        raise ValueError(f"sums has {sums.shape[0]} values; the words' rows have {a * b}")
    if n == 0 or a * b == 0:
        sums[:] = 0.0
        return
    cdef Py_ssize_t st = words.strides[0] // 2, sa = words.strides[1] // 2, sb = words.strides[2] // 2
    with nogil:
        hm_bf16_token_sums(&words[0, 0, 0], <size_t>n, <size_t>a, <size_t>b, st, sa, sb, &sums[0])
