/*
 * Hamming distances and top-k search over binary signatures.
 *
 * Data layout: a signature is `nbytes` bytes (hdc_dim bits packed LSB-first;
 * nbytes is a positive multiple of 8, so it is read as nbytes / 8 u64
 * words).  A matrix of n signatures is n * nbytes contiguous bytes, row r at
 * byte r * nbytes.  An optional `alive` array holds one byte per row; a zero
 * byte excludes the row.
 *
 * Top-k order: (distance ascending, row ascending).  The k best rows are
 * kept in a bounded max-heap whose top is the worst kept (distance, row).
 * Rows are visited in ascending order, so a new row never beats a kept row
 * of equal distance: once the heap is full a row is rejected with the single
 * test `d >= worst kept distance`.  Replacements are rare after the first
 * rows (about k * ln(n / k) for random data), so the scan runs at the speed
 * of the distance loop.
 *
 * CPU paths (hm_path of bitops.h): portable SWAR popcount, the POPCNT
 * instruction, and AVX-512 VPOPCNTDQ over 64-byte blocks with a masked load
 * for the last nbytes % 64 bytes.  Each path's scan is compiled as its own
 * function so the per-row distance is inlined into it.
 */
#ifndef HMEM_HAMMING_H
#define HMEM_HAMMING_H

#include "bitops.h"

#define HM_INLINE static inline __attribute__((always_inline))

/* ---- one distance, per path ------------------------------------------- */

HM_INLINE uint64_t hm_word(const uint8_t *p)
{
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

HM_INLINE uint32_t hm_dist_portable(const uint8_t *a, const uint8_t *b, size_t nbytes)
{
    uint64_t total = 0;
    for (size_t i = 0; i < nbytes; i += 8)
        total += hm_popcount64_swar(hm_word(a + i) ^ hm_word(b + i));
    return (uint32_t)total;
}

#if HM_X86
__attribute__((target("popcnt"))) HM_INLINE
uint32_t hm_dist_popcnt(const uint8_t *a, const uint8_t *b, size_t nbytes)
{
    /* Four accumulators: fewer loop steps per word, and four independent
       popcnt + add chains. */
    uint64_t t0 = 0, t1 = 0, t2 = 0, t3 = 0;
    size_t i = 0;
    for (; i + 32 <= nbytes; i += 32) {
        t0 += (uint64_t)__builtin_popcountll(hm_word(a + i) ^ hm_word(b + i));
        t1 += (uint64_t)__builtin_popcountll(hm_word(a + i + 8) ^ hm_word(b + i + 8));
        t2 += (uint64_t)__builtin_popcountll(hm_word(a + i + 16) ^ hm_word(b + i + 16));
        t3 += (uint64_t)__builtin_popcountll(hm_word(a + i + 24) ^ hm_word(b + i + 24));
    }
    for (; i < nbytes; i += 8)
        t0 += (uint64_t)__builtin_popcountll(hm_word(a + i) ^ hm_word(b + i));
    return (uint32_t)(t0 + t1 + t2 + t3);
}

__attribute__((target("avx512f,avx512vpopcntdq"))) HM_INLINE
uint32_t hm_dist_avx512(const uint8_t *a, const uint8_t *b, size_t nbytes)
{
    __m512i acc = _mm512_setzero_si512();
    size_t i = 0;
    for (; i + 64 <= nbytes; i += 64) {
        __m512i x = _mm512_xor_si512(_mm512_loadu_si512(a + i), _mm512_loadu_si512(b + i));
        acc = _mm512_add_epi64(acc, _mm512_popcnt_epi64(x));
    }
    if (i < nbytes) { /* 1 to 7 words left: masked-off lanes read nothing */
        __mmask8 m = (__mmask8)((1u << ((nbytes - i) / 8)) - 1);
        __m512i x = _mm512_xor_si512(_mm512_maskz_loadu_epi64(m, a + i),
                                     _mm512_maskz_loadu_epi64(m, b + i));
        acc = _mm512_add_epi64(acc, _mm512_popcnt_epi64(x));
    }
    return (uint32_t)_mm512_reduce_add_epi64(acc);
}
#endif

/* ---- all distances ---------------------------------------------------- */

#define HM_DISTANCES_BODY(DIST)                                   \
    for (size_t r = 0; r < n; r++)                                \
        out[r] = (int32_t)DIST(q, sigs + r * nbytes, nbytes);

static void hm_distances_portable(const uint8_t *q, const uint8_t *sigs, size_t n,
                                  size_t nbytes, int32_t *out)
{
    HM_DISTANCES_BODY(hm_dist_portable)
}

#if HM_X86
__attribute__((target("popcnt")))
static void hm_distances_popcnt(const uint8_t *q, const uint8_t *sigs, size_t n,
                                size_t nbytes, int32_t *out)
{
    HM_DISTANCES_BODY(hm_dist_popcnt)
}

__attribute__((target("avx512f,avx512vpopcntdq")))
static void hm_distances_avx512(const uint8_t *q, const uint8_t *sigs, size_t n,
                                size_t nbytes, int32_t *out)
{
    HM_DISTANCES_BODY(hm_dist_avx512)
}
#endif

static void hm_distances(const uint8_t *q, const uint8_t *sigs, size_t n,
                         size_t nbytes, int32_t *out)
{
#if HM_X86
    if (hm_path == HM_PATH_AVX512)
        hm_distances_avx512(q, sigs, n, nbytes, out);
    else if (hm_path == HM_PATH_POPCNT)
        hm_distances_popcnt(q, sigs, n, nbytes, out);
    else
#endif
        hm_distances_portable(q, sigs, n, nbytes, out);
}

/* ---- top-k ------------------------------------------------------------ */

/* (da, ra) comes after (db, rb) in the result order. */
HM_INLINE int hm_after(int32_t da, int64_t ra, int32_t db, int64_t rb)
{
    return da > db || (da == db && ra > rb);
}

/* Restore the max-heap property below slot i of a heap of `size` entries. */
static void hm_heap_down(int32_t *dists, int64_t *rows, size_t i, size_t size)
{
    int32_t d = dists[i];
    int64_t r = rows[i];
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= size)
            break;
        if (c + 1 < size && hm_after(dists[c + 1], rows[c + 1], dists[c], rows[c]))
            c++;
        if (!hm_after(dists[c], rows[c], d, r))
            break;
        dists[i] = dists[c];
        rows[i] = rows[c];
        i = c;
    }
    dists[i] = d;
    rows[i] = r;
}

static void hm_heap_up(int32_t *dists, int64_t *rows, size_t i)
{
    int32_t d = dists[i];
    int64_t r = rows[i];
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!hm_after(d, r, dists[p], rows[p]))
            break;
        dists[i] = dists[p];
        rows[i] = rows[p];
        i = p;
    }
    dists[i] = d;
    rows[i] = r;
}

/*
 * Scan rows [0, n) and leave the best `cap` live rows in dists/rows as a
 * max-heap; returns how many were kept (min(cap, live rows)).
 */
#define HM_TOPK_BODY(DIST)                                                \
    size_t size = 0;                                                      \
    int32_t worst = 0;                                                    \
    for (size_t r = 0; r < n; r++) {                                      \
        if (alive && !alive[r])                                           \
            continue;                                                     \
        int32_t d = (int32_t)DIST(q, sigs + r * nbytes, nbytes);          \
        if (size < cap) {                                                 \
            dists[size] = d;                                              \
            rows[size] = (int64_t)r;                                      \
            hm_heap_up(dists, rows, size++);                              \
            worst = dists[0];                                             \
        } else if (d < worst) {                                           \
            dists[0] = d;                                                 \
            rows[0] = (int64_t)r;                                         \
            hm_heap_down(dists, rows, 0, size);                           \
            worst = dists[0];                                             \
        }                                                                 \
    }                                                                     \
    return size;

static size_t hm_topk_scan_portable(const uint8_t *q, const uint8_t *sigs, size_t n,
                                    size_t nbytes, const uint8_t *alive, size_t cap,
                                    int32_t *dists, int64_t *rows)
{
    HM_TOPK_BODY(hm_dist_portable)
}

#if HM_X86
__attribute__((target("popcnt")))
static size_t hm_topk_scan_popcnt(const uint8_t *q, const uint8_t *sigs, size_t n,
                                  size_t nbytes, const uint8_t *alive, size_t cap,
                                  int32_t *dists, int64_t *rows)
{
    HM_TOPK_BODY(hm_dist_popcnt)
}

__attribute__((target("avx512f,avx512vpopcntdq")))
static size_t hm_topk_scan_avx512(const uint8_t *q, const uint8_t *sigs, size_t n,
                                  size_t nbytes, const uint8_t *alive, size_t cap,
                                  int32_t *dists, int64_t *rows)
{
    HM_TOPK_BODY(hm_dist_avx512)
}
#endif

/*
 * The best min(cap, live rows) rows of the matrix, sorted by (distance, row)
 * into dists/rows (each of room for `cap` entries, cap >= 1); returns how
 * many.
 */
static size_t hm_topk(const uint8_t *q, const uint8_t *sigs, size_t n, size_t nbytes,
                      const uint8_t *alive, size_t cap, int32_t *dists, int64_t *rows)
{
    size_t size;
#if HM_X86
    if (hm_path == HM_PATH_AVX512)
        size = hm_topk_scan_avx512(q, sigs, n, nbytes, alive, cap, dists, rows);
    else if (hm_path == HM_PATH_POPCNT)
        size = hm_topk_scan_popcnt(q, sigs, n, nbytes, alive, cap, dists, rows);
    else
#endif
        size = hm_topk_scan_portable(q, sigs, n, nbytes, alive, cap, dists, rows);
    /* Heap sort: move the worst to the end, shrink, repeat. */
    for (size_t end = size; end > 1; end--) {
        int32_t d = dists[0];
        int64_t r = rows[0];
        dists[0] = dists[end - 1];
        rows[0] = rows[end - 1];
        dists[end - 1] = d;
        rows[end - 1] = r;
        hm_heap_down(dists, rows, 0, end - 1);
    }
    return size;
}

#endif /* HMEM_HAMMING_H */
