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
 * of the distance loop while k is small.  For large k (the first stage of a
 * two-stage search keeps thousands of rows) each replacement's heap walk
 * costs more than the distance itself: there the rows are selected by
 * counting instead (hm_select_*): one pass keeps every distance and a
 * histogram of them, the histogram gives the k-th distance, and a second
 * pass over the kept distances places each row straight at its rank.
 *
 * CPU paths (hm_path of bitops.h): portable SWAR popcount, the POPCNT
 * instruction, and AVX-512 VPOPCNTDQ over 64-byte blocks with a masked load
 * for the last nbytes % 64 bytes, whose scans take 8 rows' distances at a
 * time (hm_dist8_avx512).  Each path's scan is compiled as its own function
 * so the per-row distance is inlined into it.
 */
#ifndef HMEM_HAMMING_H
#define HMEM_HAMMING_H

#include <stdlib.h>

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

/* The distances of 8 consecutive rows s, s + nbytes, ... into out[0, 8).
   Each row's popcounts stay in eight 64-bit lanes until the end, where the
   8 rows' lanes are summed together by a transpose tree (three rounds of
   shuffles and adds for all 8) instead of a full horizontal sum per row:
   on rows of one or two 64-byte blocks (span signatures, the first stage's
   prefixes) that sum cost more than the popcounts. */
__attribute__((target("avx512f,avx512vpopcntdq"))) HM_INLINE
void hm_dist8_avx512(const uint8_t *q, const uint8_t *s, size_t nbytes, int32_t *out)
{
    __m512i v[8];
    for (int i = 0; i < 8; i++)
        v[i] = _mm512_setzero_si512();
    size_t j = 0;
    for (; j + 64 <= nbytes; j += 64) {
        __m512i qq = _mm512_loadu_si512(q + j);
        for (int i = 0; i < 8; i++)
            v[i] = _mm512_add_epi64(v[i], _mm512_popcnt_epi64(
                _mm512_xor_si512(qq, _mm512_loadu_si512(s + (size_t)i * nbytes + j))));
    }
    if (j < nbytes) { /* 1 to 7 words left: masked-off lanes read nothing */
        __mmask8 m = (__mmask8)((1u << ((nbytes - j) / 8)) - 1);
        __m512i qq = _mm512_maskz_loadu_epi64(m, q + j);
        for (int i = 0; i < 8; i++)
            v[i] = _mm512_add_epi64(v[i], _mm512_popcnt_epi64(
                _mm512_xor_si512(qq, _mm512_maskz_loadu_epi64(m, s + (size_t)i * nbytes + j))));
    }
    /* per 128-bit lane: [row a, row b] sums of that lane's two words */
    __m512i p01 = _mm512_add_epi64(_mm512_unpacklo_epi64(v[0], v[1]), _mm512_unpackhi_epi64(v[0], v[1]));
    __m512i p23 = _mm512_add_epi64(_mm512_unpacklo_epi64(v[2], v[3]), _mm512_unpackhi_epi64(v[2], v[3]));
    __m512i p45 = _mm512_add_epi64(_mm512_unpacklo_epi64(v[4], v[5]), _mm512_unpackhi_epi64(v[4], v[5]));
    __m512i p67 = _mm512_add_epi64(_mm512_unpacklo_epi64(v[6], v[7]), _mm512_unpackhi_epi64(v[6], v[7]));
    /* 128-bit lanes 0, 1 and 2, 3 added: [rows 0-1 (half), rows 0-1 (half), rows 2-3, rows 2-3] */
    __m512i q03 = _mm512_add_epi64(_mm512_shuffle_i64x2(p01, p23, 0x88), _mm512_shuffle_i64x2(p01, p23, 0xDD));
    __m512i q47 = _mm512_add_epi64(_mm512_shuffle_i64x2(p45, p67, 0x88), _mm512_shuffle_i64x2(p45, p67, 0xDD));
    /* the last halves added: rows 0 to 7 in order */
    __m512i sums = _mm512_add_epi64(_mm512_shuffle_i64x2(q03, q47, 0x88), _mm512_shuffle_i64x2(q03, q47, 0xDD));
    _mm256_storeu_si256((__m256i *)out, _mm512_cvtepi64_epi32(sums));
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
    size_t r = 0;
    for (; r + 8 <= n; r += 8)
        hm_dist8_avx512(q, sigs + r * nbytes, nbytes, out + r);
    for (; r < n; r++)
        out[r] = (int32_t)hm_dist_avx512(q, sigs + r * nbytes, nbytes);
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

/* Sort a max-heap of `size` entries into (distance, row) order: move the
   worst to the end, shrink, repeat. */
static void hm_heap_sort(int32_t *dists, int64_t *rows, size_t size)
{
    for (size_t end = size; end > 1; end--) {
        int32_t d = dists[0];
        int64_t r = rows[0];
        dists[0] = dists[end - 1];
        rows[0] = rows[end - 1];
        dists[end - 1] = d;
        rows[end - 1] = r;
        hm_heap_down(dists, rows, 0, end - 1);
    }
}

/* Offer row r at distance d to the heap (the scan's locals size, worst). */
#define HM_TOPK_KEEP(d, r)                                                \
    if (size < cap) {                                                     \
        dists[size] = (d);                                                \
        rows[size] = (int64_t)(r);                                        \
        hm_heap_up(dists, rows, size++);                                  \
        worst = dists[0];                                                 \
    } else if ((d) < worst) {                                             \
        dists[0] = (d);                                                   \
        rows[0] = (int64_t)(r);                                           \
        hm_heap_down(dists, rows, 0, size);                               \
        worst = dists[0];                                                 \
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
        HM_TOPK_KEEP(d, r)                                                \
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
    size_t size = 0;
    int32_t worst = 0;
    int32_t block[8];
    size_t r = 0;
    for (; r + 8 <= n; r += 8) { /* 8 rows' distances at once (dead rows' too, then passed over) */
        hm_dist8_avx512(q, sigs + r * nbytes, nbytes, block);
        for (size_t i = 0; i < 8; i++) {
            if (alive && !alive[r + i])
                continue;
            HM_TOPK_KEEP(block[i], r + i)
        }
    }
    for (; r < n; r++) {
        if (alive && !alive[r])
            continue;
        int32_t d = (int32_t)hm_dist_avx512(q, sigs + r * nbytes, nbytes);
        HM_TOPK_KEEP(d, r)
    }
    return size;
}
#endif

/* ---- top-k by counting, for large k -------------------------------- */

/* Caps from which counting beats the heap (measured: docs/benchmarks.md,
   "Two-stage search"), and the signature widths whose histogram of
   distances (nbits + 1 counters) stays small. */
#define HM_SELECT_MIN_CAP 128
#define HM_SELECT_MAX_BITS 65536

/*
 * Pass one: the distance of every row into dist[0, n) (a dead row gets
 * `dead`, above every distance) and the count of each distance into hist
 * (nbits + 1 counters, zeroed by the caller).
 */
#define HM_SELECT_PASS_BODY(DIST)                                         \
    for (size_t r = 0; r < n; r++) {                                      \
        if (alive && !alive[r]) {                                         \
            dist[r] = dead;                                               \
            continue;                                                     \
        }                                                                 \
        uint32_t d = DIST(q, sigs + r * nbytes, nbytes);                  \
        dist[r] = d;                                                      \
        hist[d]++;                                                        \
    }

static void hm_select_pass_portable(const uint8_t *q, const uint8_t *sigs, size_t n, size_t nbytes,
                                    const uint8_t *alive, uint32_t dead, uint32_t *dist, size_t *hist)
{
    HM_SELECT_PASS_BODY(hm_dist_portable)
}

#if HM_X86
__attribute__((target("popcnt")))
static void hm_select_pass_popcnt(const uint8_t *q, const uint8_t *sigs, size_t n, size_t nbytes,
                                  const uint8_t *alive, uint32_t dead, uint32_t *dist, size_t *hist)
{
    HM_SELECT_PASS_BODY(hm_dist_popcnt)
}

__attribute__((target("avx512f,avx512vpopcntdq")))
static void hm_select_pass_avx512(const uint8_t *q, const uint8_t *sigs, size_t n, size_t nbytes,
                                  const uint8_t *alive, uint32_t dead, uint32_t *dist, size_t *hist)
{
    size_t r = 0;
    for (; r + 8 <= n; r += 8) { /* 8 rows' distances at once, straight into dist */
        hm_dist8_avx512(q, sigs + r * nbytes, nbytes, (int32_t *)(dist + r));
        for (size_t i = r; i < r + 8; i++) {
            if (alive && !alive[i])
                dist[i] = dead;
            else
                hist[dist[i]]++;
        }
    }
    for (; r < n; r++) {
        if (alive && !alive[r]) {
            dist[r] = dead;
            continue;
        }
        uint32_t d = hm_dist_avx512(q, sigs + r * nbytes, nbytes);
        dist[r] = d;
        hist[d]++;
    }
}
#endif

/*
 * The best min(cap, live rows) rows in (distance, row) order, by counting;
 * returns how many, or (size_t)-1 when its buffers cannot be had (the
 * caller then takes the heap).
 */
static size_t hm_topk_select(const uint8_t *q, const uint8_t *sigs, size_t n, size_t nbytes,
                             const uint8_t *alive, size_t cap, int32_t *dists, int64_t *rows)
{
    const uint32_t nbits = (uint32_t)(nbytes * 8);
    uint32_t *dist = (uint32_t *)malloc((n ? n : 1) * sizeof(uint32_t));
    size_t *hist = (size_t *)calloc((size_t)nbits + 1, sizeof(size_t));
    if (!dist || !hist) {
        free(dist);
        free(hist);
        return (size_t)-1;
    }
#if HM_X86
    if (hm_path == HM_PATH_AVX512)
        hm_select_pass_avx512(q, sigs, n, nbytes, alive, nbits + 1, dist, hist);
    else if (hm_path == HM_PATH_POPCNT)
        hm_select_pass_popcnt(q, sigs, n, nbytes, alive, nbits + 1, dist, hist);
    else
#endif
        hm_select_pass_portable(q, sigs, n, nbytes, alive, nbits + 1, dist, hist);
    /* t: the distance of the last row kept; rows at distances below t are
       all kept, rows at t only the first `cap - below` of them. */
    size_t below = 0, t = 0;
    for (; t <= nbits; t++) {
        if (below + hist[t] >= cap)
            break;
        below += hist[t];
    }
    size_t size = t <= nbits ? cap : below; /* fewer live rows than cap: all of them */
    /* hist[d] for d < t becomes the rank of the next row at distance d
       (rows come in ascending order, so each distance's rows stay in row
       order, the tie rule) */
    size_t rank = 0;
    for (size_t d = 0; d < t && d <= nbits; d++) {
        size_t count = hist[d];
        hist[d] = rank;
        rank += count;
    }
    size_t tied = below; /* the next rank of a row at distance t */
    for (size_t r = 0; r < n; r++) {
        uint32_t d = dist[r];
        if (d < t) {
            size_t i = hist[d]++;
            dists[i] = (int32_t)d;
            rows[i] = (int64_t)r;
        } else if (d == t && tied < size) {
            dists[tied] = (int32_t)d;
            rows[tied++] = (int64_t)r;
        }
    }
    free(dist);
    free(hist);
    return size;
}

/*
 * The best min(cap, live rows) rows of the matrix, sorted by (distance, row)
 * into dists/rows (each of room for `cap` entries, cap >= 1); returns how
 * many.
 */
static size_t hm_topk(const uint8_t *q, const uint8_t *sigs, size_t n, size_t nbytes,
                      const uint8_t *alive, size_t cap, int32_t *dists, int64_t *rows)
{
    size_t size;
    if (cap >= HM_SELECT_MIN_CAP && nbytes * 8 <= HM_SELECT_MAX_BITS) {
        size = hm_topk_select(q, sigs, n, nbytes, alive, cap, dists, rows);
        if (size != (size_t)-1)
            return size;
    }
#if HM_X86
    if (hm_path == HM_PATH_AVX512)
        size = hm_topk_scan_avx512(q, sigs, n, nbytes, alive, cap, dists, rows);
    else if (hm_path == HM_PATH_POPCNT)
        size = hm_topk_scan_popcnt(q, sigs, n, nbytes, alive, cap, dists, rows);
    else
#endif
        size = hm_topk_scan_portable(q, sigs, n, nbytes, alive, cap, dists, rows);
    hm_heap_sort(dists, rows, size);
    return size;
}

/* ---- top-k of many queries ------------------------------------------ */

/* Four distances at once: queries q, q + nbytes, q + 2 nbytes, q + 3 nbytes
   against one row s.  Each word of the row is loaded once for the four, so
   a scan that is bound by loads does a quarter of them for the row. */
HM_INLINE void hm_dist4_portable(const uint8_t *q, const uint8_t *s, size_t nbytes, int32_t *out)
{
    uint64_t t0 = 0, t1 = 0, t2 = 0, t3 = 0;
    for (size_t i = 0; i < nbytes; i += 8) {
        uint64_t w = hm_word(s + i);
        t0 += hm_popcount64_swar(w ^ hm_word(q + i));
        t1 += hm_popcount64_swar(w ^ hm_word(q + nbytes + i));
        t2 += hm_popcount64_swar(w ^ hm_word(q + 2 * nbytes + i));
        t3 += hm_popcount64_swar(w ^ hm_word(q + 3 * nbytes + i));
    }
    out[0] = (int32_t)t0; out[1] = (int32_t)t1; out[2] = (int32_t)t2; out[3] = (int32_t)t3;
}

#if HM_X86
__attribute__((target("popcnt"))) HM_INLINE
void hm_dist4_popcnt(const uint8_t *q, const uint8_t *s, size_t nbytes, int32_t *out)
{
    uint64_t t0 = 0, t1 = 0, t2 = 0, t3 = 0;
    for (size_t i = 0; i < nbytes; i += 8) {
        uint64_t w = hm_word(s + i);
        t0 += (uint64_t)__builtin_popcountll(w ^ hm_word(q + i));
        t1 += (uint64_t)__builtin_popcountll(w ^ hm_word(q + nbytes + i));
        t2 += (uint64_t)__builtin_popcountll(w ^ hm_word(q + 2 * nbytes + i));
        t3 += (uint64_t)__builtin_popcountll(w ^ hm_word(q + 3 * nbytes + i));
    }
    out[0] = (int32_t)t0; out[1] = (int32_t)t1; out[2] = (int32_t)t2; out[3] = (int32_t)t3;
}

__attribute__((target("avx512f,avx512vpopcntdq"))) HM_INLINE
void hm_dist4_avx512(const uint8_t *q, const uint8_t *s, size_t nbytes, int32_t *out)
{
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 64 <= nbytes; i += 64) {
        __m512i w = _mm512_loadu_si512(s + i);
        a0 = _mm512_add_epi64(a0, _mm512_popcnt_epi64(_mm512_xor_si512(w, _mm512_loadu_si512(q + i))));
        a1 = _mm512_add_epi64(a1, _mm512_popcnt_epi64(_mm512_xor_si512(w, _mm512_loadu_si512(q + nbytes + i))));
        a2 = _mm512_add_epi64(a2, _mm512_popcnt_epi64(_mm512_xor_si512(w, _mm512_loadu_si512(q + 2 * nbytes + i))));
        a3 = _mm512_add_epi64(a3, _mm512_popcnt_epi64(_mm512_xor_si512(w, _mm512_loadu_si512(q + 3 * nbytes + i))));
    }
    if (i < nbytes) { /* 1 to 7 words left: masked-off lanes read nothing */
        __mmask8 m = (__mmask8)((1u << ((nbytes - i) / 8)) - 1);
        __m512i w = _mm512_maskz_loadu_epi64(m, s + i);
        a0 = _mm512_add_epi64(a0, _mm512_popcnt_epi64(_mm512_xor_si512(w, _mm512_maskz_loadu_epi64(m, q + i))));
        a1 = _mm512_add_epi64(a1, _mm512_popcnt_epi64(_mm512_xor_si512(w, _mm512_maskz_loadu_epi64(m, q + nbytes + i))));
        a2 = _mm512_add_epi64(a2, _mm512_popcnt_epi64(_mm512_xor_si512(w, _mm512_maskz_loadu_epi64(m, q + 2 * nbytes + i))));
        a3 = _mm512_add_epi64(a3, _mm512_popcnt_epi64(_mm512_xor_si512(w, _mm512_maskz_loadu_epi64(m, q + 3 * nbytes + i))));
    }
    out[0] = (int32_t)_mm512_reduce_add_epi64(a0);
    out[1] = (int32_t)_mm512_reduce_add_epi64(a1);
    out[2] = (int32_t)_mm512_reduce_add_epi64(a2);
    out[3] = (int32_t)_mm512_reduce_add_epi64(a3);
}
#endif

#if HM_X86
/* AVX2 has no popcount instruction: each byte's count is looked up per
   nibble in a 16-entry table (vpshufb) and summed in byte lanes, which hold
   31 vectors' counts (at most 8 each) before they are widened to 64 bits. */
__attribute__((target("avx2"))) HM_INLINE
__m256i hm_popcount8_avx2(__m256i x, __m256i table, __m256i low)
{
    __m256i lo = _mm256_and_si256(x, low);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), low);
    return _mm256_add_epi8(_mm256_shuffle_epi8(table, lo), _mm256_shuffle_epi8(table, hi));
}

__attribute__((target("avx2"))) HM_INLINE
uint64_t hm_sum64_avx2(__m256i v)
{
    __m128i s = _mm_add_epi64(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    return (uint64_t)_mm_cvtsi128_si64(s) + (uint64_t)_mm_extract_epi64(s, 1);
}

__attribute__((target("avx2,popcnt"))) HM_INLINE
void hm_dist4_avx2(const uint8_t *q, const uint8_t *s, size_t nbytes, int32_t *out)
{
    const __m256i table = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4,
                                           0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4);
    const __m256i low = _mm256_set1_epi8(0x0f);
    const __m256i zero = _mm256_setzero_si256();
    __m256i a0 = zero, a1 = zero, a2 = zero, a3 = zero;
    size_t i = 0;
    while (i + 32 <= nbytes) {
        size_t stop = nbytes - i > 31 * 32 ? i + 31 * 32 : nbytes;
        __m256i b0 = zero, b1 = zero, b2 = zero, b3 = zero;
        for (; i + 32 <= stop; i += 32) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(s + i));
#define HM_BYTES(Q) _mm256_xor_si256(w, _mm256_loadu_si256((const __m256i *)(Q)))
            b0 = _mm256_add_epi8(b0, hm_popcount8_avx2(HM_BYTES(q + i), table, low));
            b1 = _mm256_add_epi8(b1, hm_popcount8_avx2(HM_BYTES(q + nbytes + i), table, low));
            b2 = _mm256_add_epi8(b2, hm_popcount8_avx2(HM_BYTES(q + 2 * nbytes + i), table, low));
            b3 = _mm256_add_epi8(b3, hm_popcount8_avx2(HM_BYTES(q + 3 * nbytes + i), table, low));
#undef HM_BYTES
        }
        a0 = _mm256_add_epi64(a0, _mm256_sad_epu8(b0, zero));
        a1 = _mm256_add_epi64(a1, _mm256_sad_epu8(b1, zero));
        a2 = _mm256_add_epi64(a2, _mm256_sad_epu8(b2, zero));
        a3 = _mm256_add_epi64(a3, _mm256_sad_epu8(b3, zero));
    }
    uint64_t t0 = hm_sum64_avx2(a0), t1 = hm_sum64_avx2(a1), t2 = hm_sum64_avx2(a2), t3 = hm_sum64_avx2(a3);
    for (; i < nbytes; i += 8) { /* 1 to 3 words left */
        uint64_t w = hm_word(s + i);
        t0 += (uint64_t)__builtin_popcountll(w ^ hm_word(q + i));
        t1 += (uint64_t)__builtin_popcountll(w ^ hm_word(q + nbytes + i));
        t2 += (uint64_t)__builtin_popcountll(w ^ hm_word(q + 2 * nbytes + i));
        t3 += (uint64_t)__builtin_popcountll(w ^ hm_word(q + 3 * nbytes + i));
    }
    out[0] = (int32_t)t0; out[1] = (int32_t)t1; out[2] = (int32_t)t2; out[3] = (int32_t)t3;
}
#endif

/* Offer (d, row) to a bounded max-heap of `cap` entries holding *size. */
HM_INLINE void hm_heap_offer(int32_t *dists, int64_t *rows, size_t *size, size_t cap,
                             int32_t d, int64_t row)
{
    if (*size < cap) {
        dists[*size] = d;
        rows[*size] = row;
        hm_heap_up(dists, rows, (*size)++);
    } else if (d < dists[0]) {
        dists[0] = d;
        rows[0] = row;
        hm_heap_down(dists, rows, 0, *size);
    }
}

/*
 * Many queries over rows [lo, hi) of one matrix, each with its own bounded
 * max-heap (dists/rows + j * cap, sizes[j] entries).  The rows are taken in
 * blocks small enough to stay in the core's cache while every query scans
 * them, four queries per pass over a row: the matrix is read from memory
 * once for the whole batch instead of once per query.  Within a query rows
 * are still visited in ascending order, so the tie rule of hm_topk holds.
 */
#define HM_TOPK_MANY_BODY(DIST, DIST4)                                          \
    size_t block = nbytes >= 32768 ? 1 : 32768 / nbytes; /* ~32 KiB of rows */  \
    for (size_t b0 = lo; b0 < hi; b0 += block) {                                \
        size_t b1 = hi - b0 > block ? b0 + block : hi;                          \
        size_t j = 0;                                                           \
        for (; j + 4 <= nq; j += 4) {                                           \
            for (size_t r = b0; r < b1; r++) {                                  \
                if (alive && !alive[r])                                         \
                    continue;                                                   \
                int32_t d4[4];                                                  \
                DIST4(qs + j * nbytes, sigs + r * nbytes, nbytes, d4);          \
                for (size_t u = 0; u < 4; u++)                                  \
                    hm_heap_offer(dists + (j + u) * cap, rows + (j + u) * cap,  \
                                  sizes + j + u, cap, d4[u], (int64_t)r);       \
            }                                                                   \
        }                                                                       \
        for (; j < nq; j++) {                                                   \
            for (size_t r = b0; r < b1; r++) {                                  \
                if (alive && !alive[r])                                         \
                    continue;                                                   \
                int32_t d = (int32_t)DIST(qs + j * nbytes, sigs + r * nbytes, nbytes); \
                hm_heap_offer(dists + j * cap, rows + j * cap, sizes + j, cap, d, (int64_t)r); \
            }                                                                   \
        }                                                                       \
    }

static void hm_topk_many_portable(const uint8_t *qs, size_t nq, const uint8_t *sigs,
                                  size_t lo, size_t hi, size_t nbytes, const uint8_t *alive,
                                  size_t cap, int32_t *dists, int64_t *rows, size_t *sizes)
{
    HM_TOPK_MANY_BODY(hm_dist_portable, hm_dist4_portable)
}

#if HM_X86
__attribute__((target("popcnt")))
static void hm_topk_many_popcnt(const uint8_t *qs, size_t nq, const uint8_t *sigs,
                                size_t lo, size_t hi, size_t nbytes, const uint8_t *alive,
                                size_t cap, int32_t *dists, int64_t *rows, size_t *sizes)
{
    HM_TOPK_MANY_BODY(hm_dist_popcnt, hm_dist4_popcnt)
}

/* The popcnt path's batch scan on a CPU with AVX2 (as the projection's). */
__attribute__((target("avx2,popcnt")))
static void hm_topk_many_avx2(const uint8_t *qs, size_t nq, const uint8_t *sigs,
                              size_t lo, size_t hi, size_t nbytes, const uint8_t *alive,
                              size_t cap, int32_t *dists, int64_t *rows, size_t *sizes)
{
    HM_TOPK_MANY_BODY(hm_dist_popcnt, hm_dist4_avx2)
}

__attribute__((target("avx512f,avx512vpopcntdq")))
static void hm_topk_many_avx512(const uint8_t *qs, size_t nq, const uint8_t *sigs,
                                size_t lo, size_t hi, size_t nbytes, const uint8_t *alive,
                                size_t cap, int32_t *dists, int64_t *rows, size_t *sizes)
{
    HM_TOPK_MANY_BODY(hm_dist_avx512, hm_dist4_avx512)
}
#endif

/*
 * For each of the nq queries (row j of qs), the best min(cap, live rows in
 * [lo, hi)) rows of the matrix, sorted by (distance, row) into dists/rows
 * + j * cap; sizes[j] says how many.
 */
static void hm_topk_many(const uint8_t *qs, size_t nq, const uint8_t *sigs, size_t lo,
                         size_t hi, size_t nbytes, const uint8_t *alive, size_t cap,
                         int32_t *dists, int64_t *rows, size_t *sizes)
{
    for (size_t j = 0; j < nq; j++)
        sizes[j] = 0;
#if HM_X86
    if (hm_path == HM_PATH_AVX512)
        hm_topk_many_avx512(qs, nq, sigs, lo, hi, nbytes, alive, cap, dists, rows, sizes);
    else if (hm_path == HM_PATH_POPCNT && __builtin_cpu_supports("avx2"))
        hm_topk_many_avx2(qs, nq, sigs, lo, hi, nbytes, alive, cap, dists, rows, sizes);
    else if (hm_path == HM_PATH_POPCNT)
        hm_topk_many_popcnt(qs, nq, sigs, lo, hi, nbytes, alive, cap, dists, rows, sizes);
    else
#endif
        hm_topk_many_portable(qs, nq, sigs, lo, hi, nbytes, alive, cap, dists, rows, sizes);
    for (size_t j = 0; j < nq; j++)
        hm_heap_sort(dists + j * cap, rows + j * cap, sizes[j]);
}

#endif /* HMEM_HAMMING_H */
