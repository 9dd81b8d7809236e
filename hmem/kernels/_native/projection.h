/*
 * The signature projection: random signs + fast Walsh-Hadamard rounds.
 *
 * Data layout:
 * - rows: n float32 vectors of d values, row after row (token order);
 * - signs: one bit stream, bit p in byte p / 8 under mask 1 << (p % 8); the
 *   sign of element i of round r of block b is bit (b * rounds + r) * m + i,
 *   1 meaning "negate";
 * - out: hdc_dim bits packed LSB-first; bit b * m + i comes from element i
 *   of block b.
 *
 * The on-disk format fixes the result bit for bit, so the arithmetic is the
 * reference's exactly: the token sum is a float64 sum in token order
 * starting from +0.0, a sign flip is an IEEE negation (a flip of the sign
 * bit), and every transform output is one IEEE double add or subtract of the
 * same two operands as in the stage-by-stage definition.  Vector units
 * compute the same operations lane by lane, and nothing here multiplies, so
 * no fused multiply-add can creep in (the build also passes
 * -ffp-contract=off).  Two transform stages are done per pass over the
 * vector (radix 4) to halve the memory traffic; each value still goes
 * through the same stages in the same order.
 *
 * CPU paths: the body is compiled three times (baseline, AVX2, AVX-512F) so
 * the compiler vectorises the stage loops at each width.  The first pass of
 * a round (sign flip + stages 1 and 2) and the bit packing work inside a
 * vector, where the compiler's code is slow, so the AVX2 and AVX-512 bodies
 * use hand-written versions of those two.  hm_path "portable" runs the
 * baseline, "popcnt" AVX2 when the CPU has it, "avx512-vpopcntdq" AVX-512F.
 * Many entries at once (hm_signature_many) are taken four at a time, one
 * per vector lane, and eight at a time on the AVX-512 path.
 */
#ifndef HMEM_PROJECTION_H
#define HMEM_PROJECTION_H

#include <stdlib.h>

#include "bitops.h"

#define HM_PROJ_INLINE static inline __attribute__((always_inline))

/* Sign-bit masks of four doubles for each nibble of sign bits. */
static uint64_t hm_nibble_signs[16][4];
/* Sign-bit masks of the eight values of each byte of sign bits (hm_signature_many). */
static uint64_t hm_byte_flips[256][8];

/* ---- the generic pieces (every path) ---------------------------------- */

/* s[i] = sum over tokens of rows[t][i] (i < d), +0.0 for d <= i < m. */
HM_PROJ_INLINE void hm_proj_sum(double *restrict s, const float *restrict rows, size_t n,
                                size_t d, size_t m)
{
    for (size_t i = 0; i < m; i++)
        s[i] = 0.0;
    for (size_t t = 0; t < n; t++) {
        const float *row = rows + t * d;
        for (size_t i = 0; i < d; i++)
            s[i] += (double)row[i];
    }
}

HM_PROJ_INLINE double hm_bf16_value(uint16_t word)
{
    uint32_t bits = (uint32_t)word << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return (double)x;
}

/* s[i] = sum over tokens of the float32 value of the bfloat16 word at
   w[t * st + (i / b) * sa + (i % b) * sb] (i < a * b; strides in words),
   from +0.0 in token order: the sums hm_proj_sum makes of the same words
   widened to float32 rows (a widening is exact), without the rows. */
static void hm_bf16_token_sums(const uint16_t *restrict w, size_t n, size_t a, size_t b,
                               ptrdiff_t st, ptrdiff_t sa, ptrdiff_t sb, double *restrict s)
{
    for (size_t i = 0; i < a * b; i++)
        s[i] = 0.0;
    for (size_t t = 0; t < n; t++) {
        for (size_t h = 0; h < a; h++) {
            const uint16_t *row = w + (ptrdiff_t)t * st + (ptrdiff_t)h * sa;
            double *o = s + h * b;
            if (sb == 1) { /* the usual layouts: a contiguous run, which vectorises */
                for (size_t j = 0; j < b; j++)
                    o[j] += hm_bf16_value(row[j]);
            } else {
                for (size_t j = 0; j < b; j++)
                    o[j] += hm_bf16_value(row[(ptrdiff_t)j * sb]);
            }
        }
    }
}

/* Stages h and 2h on each block of 4h values: with quarters a, b, c, d,
   stage h maps (a, b) and (c, d), stage 2h then (a, c) and (b, d). */
HM_PROJ_INLINE void hm_fwht_radix4(double *v, size_t m, size_t h)
{
    for (size_t i = 0; i < m; i += 4 * h) {
        double *a = v + i, *b = a + h, *c = b + h, *d = c + h;
#pragma GCC ivdep
        for (size_t j = 0; j < h; j++) {
            double y0 = a[j] + b[j], y1 = a[j] - b[j];
            double y2 = c[j] + d[j], y3 = c[j] - d[j];
            a[j] = y0 + y2;
            b[j] = y1 + y3;
            c[j] = y0 - y2;
            d[j] = y1 - y3;
        }
    }
}

/* First pass of a round: negate v[i] where sign bit i of `signs` (m / 8
   bytes) is 1, then transform stages 1 and 2. */
HM_PROJ_INLINE void hm_round_first(double *v, const uint8_t *signs, size_t m)
{
    uint64_t *u = (uint64_t *)v; /* the build has -fno-strict-aliasing */
    for (size_t i = 0; i < m; i += 8) {
        const uint64_t *lo = hm_nibble_signs[signs[i >> 3] & 15];
        const uint64_t *hi = hm_nibble_signs[signs[i >> 3] >> 4];
        for (unsigned k = 0; k < 4; k++) {
            u[i + k] ^= lo[k];
            u[i + 4 + k] ^= hi[k];
        }
    }
    hm_fwht_radix4(v, m, 1);
}

/* Stages 4, 8, ..., m / 2 of the unnormalised Walsh-Hadamard transform in
   Sylvester order (stage h maps each pair (v[j], v[j+h]), j in the first
   half of a block of 2h, to (a + c, a - c)); m is a power of two >= 64. */
HM_PROJ_INLINE void hm_round_rest(double *v, size_t m)
{
    hm_fwht_radix4(v, m, 4); /* a constant h: the inner loop unrolls */
    size_t h = 16;
    for (; 4 * h <= m; h *= 4)
        hm_fwht_radix4(v, m, h);
    if (h < m) { /* an odd number of stages leaves the last one, h = m / 2 */
        double *a = v, *b = v + h;
#pragma GCC ivdep
        for (size_t j = 0; j < h; j++) {
            double x = a[j], y = b[j];
            a[j] = x + y;
            b[j] = x - y;
        }
    }
}

/* Bits [0, nbits) of out (nbits a multiple of 8): bit i = v[i] > 0. */
HM_PROJ_INLINE void hm_pack(uint8_t *out, const double *v, size_t nbits)
{
    for (size_t i = 0; i < nbits; i += 8) {
        unsigned byte = 0;
        for (unsigned k = 0; k < 8; k++)
            byte |= (unsigned)(v[i + k] > 0.0) << k;
        out[i >> 3] = (uint8_t)byte;
    }
}

typedef void (*hm_first_fn)(double *, const uint8_t *, size_t);
typedef void (*hm_pack_fn)(uint8_t *, const double *, size_t);

/* s and v are workspaces of m doubles each; with rows NULL, s holds the
   token sum already (zero from d to m).  `first` and `pack` are constants
   in each caller, so they are inlined. */
HM_PROJ_INLINE void hm_signature_body(const float *rows, size_t n, size_t d,
                                      const uint8_t *signs, size_t m, size_t rounds,
                                      size_t hdc_dim, uint8_t *out, double *s, double *v,
                                      hm_first_fn first, hm_pack_fn pack)
{
    if (rows != NULL)
        hm_proj_sum(s, rows, n, d, m);
    size_t blocks = (hdc_dim + m - 1) / m;
    for (size_t b = 0; b < blocks; b++) {
        memcpy(v, s, m * sizeof(double));
        for (size_t r = 0; r < rounds; r++) {
            first(v, signs + (b * rounds + r) * m / 8, m);
            hm_round_rest(v, m);
        }
        size_t nbits = hdc_dim - b * m < m ? hdc_dim - b * m : m;
        pack(out + b * m / 8, v, nbits);
    }
}

static void hm_signature_baseline(const float *rows, size_t n, size_t d, const uint8_t *signs,
                                  size_t m, size_t rounds, size_t hdc_dim, uint8_t *out,
                                  double *s, double *v)
{
    hm_signature_body(rows, n, d, signs, m, rounds, hdc_dim, out, s, v, hm_round_first, hm_pack);
}

/* ---- x86: AVX2 and AVX-512F -------------------------------------------- */

#if HM_X86
/* Per four values [x0, x1, x2, x3]: stage 1 gives [x0+x1, x0-x1, x2+x3,
   x2-x3] from the pairs (even, odd) duplicated across lanes, stage 2 the
   same on (low half, high half). */
__attribute__((target("avx2"))) HM_PROJ_INLINE
void hm_round_first_avx2(double *v, const uint8_t *signs, size_t m)
{
    for (size_t i = 0; i < m; i += 4) {
        __m256d flip = _mm256_loadu_pd((const double *)hm_nibble_signs[(signs[i >> 3] >> (i & 4)) & 15]);
        __m256d x = _mm256_xor_pd(_mm256_loadu_pd(v + i), flip);
        __m256d a = _mm256_movedup_pd(x), c = _mm256_permute_pd(x, 0xF);
        __m256d y = _mm256_blend_pd(_mm256_add_pd(a, c), _mm256_sub_pd(a, c), 0xA);
        a = _mm256_permute2f128_pd(y, y, 0x00);
        c = _mm256_permute2f128_pd(y, y, 0x11);
        _mm256_storeu_pd(v + i, _mm256_blend_pd(_mm256_add_pd(a, c), _mm256_sub_pd(a, c), 0xC));
    }
}

__attribute__((target("avx2"))) HM_PROJ_INLINE
void hm_pack_avx2(uint8_t *out, const double *v, size_t nbits)
{
    const __m256d zero = _mm256_setzero_pd();
    for (size_t i = 0; i < nbits; i += 8) {
        unsigned lo = (unsigned)_mm256_movemask_pd(_mm256_cmp_pd(_mm256_loadu_pd(v + i), zero, _CMP_GT_OQ));
        unsigned hi = (unsigned)_mm256_movemask_pd(_mm256_cmp_pd(_mm256_loadu_pd(v + i + 4), zero, _CMP_GT_OQ));
        out[i >> 3] = (uint8_t)(lo | hi << 4);
    }
}

__attribute__((target("avx2")))
static void hm_signature_avx2(const float *rows, size_t n, size_t d, const uint8_t *signs,
                              size_t m, size_t rounds, size_t hdc_dim, uint8_t *out,
                              double *s, double *v)
{
    hm_signature_body(rows, n, d, signs, m, rounds, hdc_dim, out, s, v,
                      hm_round_first_avx2, hm_pack_avx2);
}

/* As the AVX2 version on eight values; a byte of sign bits is the mask of
   the negation, and a masked subtract replaces add + sub + blend. */
__attribute__((target("avx512f"))) HM_PROJ_INLINE
void hm_round_first_avx512(double *v, const uint8_t *signs, size_t m)
{
    const __m512i sign = _mm512_set1_epi64((long long)(1ULL << 63));
    for (size_t i = 0; i < m; i += 8) {
        __m512i bits = _mm512_loadu_si512(v + i);
        __m512d x = _mm512_castsi512_pd(_mm512_mask_xor_epi64(bits, (__mmask8)signs[i >> 3], bits, sign));
        __m512d a = _mm512_movedup_pd(x), c = _mm512_permute_pd(x, 0xFF);
        __m512d y = _mm512_mask_sub_pd(_mm512_add_pd(a, c), 0xAA, a, c);
        a = _mm512_permutex_pd(y, 0x44);
        c = _mm512_permutex_pd(y, 0xEE);
        _mm512_storeu_pd(v + i, _mm512_mask_sub_pd(_mm512_add_pd(a, c), 0xCC, a, c));
    }
}

__attribute__((target("avx512f"))) HM_PROJ_INLINE
void hm_pack_avx512(uint8_t *out, const double *v, size_t nbits)
{
    const __m512d zero = _mm512_setzero_pd();
    for (size_t i = 0; i < nbits; i += 8)
        out[i >> 3] = (uint8_t)_mm512_cmp_pd_mask(_mm512_loadu_pd(v + i), zero, _CMP_GT_OQ);
}

__attribute__((target("avx512f")))
static void hm_signature_avx512(const float *rows, size_t n, size_t d, const uint8_t *signs,
                                size_t m, size_t rounds, size_t hdc_dim, uint8_t *out,
                                double *s, double *v)
{
    hm_signature_body(rows, n, d, signs, m, rounds, hdc_dim, out, s, v,
                      hm_round_first_avx512, hm_pack_avx512);
}
#endif

/* ---- dispatch ----------------------------------------------------------- */

static int hm_proj_has_avx2 = 0;

static void hm_projection_init(void)
{
    for (unsigned n = 0; n < 16; n++)
        for (unsigned k = 0; k < 4; k++)
            hm_nibble_signs[n][k] = (uint64_t)((n >> k) & 1) << 63;
    for (unsigned n = 0; n < 256; n++)
        for (unsigned k = 0; k < 8; k++)
            hm_byte_flips[n][k] = (uint64_t)((n >> k) & 1) << 63;
#if HM_X86
    __builtin_cpu_init();
    hm_proj_has_avx2 = __builtin_cpu_supports("avx2") != 0;
#endif
}

/* Name of the code the current path runs. */
static const char *hm_signature_variant(void)
{
#if HM_X86
    if (hm_path == HM_PATH_AVX512)
        return "avx512f";
    if (hm_path == HM_PATH_POPCNT && hm_proj_has_avx2)
        return "avx2";
#endif
    return "baseline";
}

/*
 * The signature of the n x d float32 rows (n >= 1, d <= m; m a power of two
 * >= 64; hdc_dim a positive multiple of 8) into out (hdc_dim / 8 bytes,
 * every byte written), and the float64 token sum into sum_out (d doubles)
 * unless it is NULL.  Returns 0, or -1 when the workspace cannot be
 * allocated.
 */
static int hm_signature(const float *rows, size_t n, size_t d, const uint8_t *signs,
                        size_t m, size_t rounds, size_t hdc_dim, uint8_t *out, double *sum_out)
{
    double *s = (double *)aligned_alloc(64, 2 * m * sizeof(double));
    if (s == NULL)
        return -1;
    double *v = s + m;
#if HM_X86
    if (hm_path == HM_PATH_AVX512)
        hm_signature_avx512(rows, n, d, signs, m, rounds, hdc_dim, out, s, v);
    else if (hm_path == HM_PATH_POPCNT && hm_proj_has_avx2)
        hm_signature_avx2(rows, n, d, signs, m, rounds, hdc_dim, out, s, v);
    else
#endif
        hm_signature_baseline(rows, n, d, signs, m, rounds, hdc_dim, out, s, v);
    if (sum_out != NULL) /* the token sum, which the store also needs (pooled key) */
        memcpy(sum_out, s, d * sizeof(double));
    free(s);
    return 0;
}

/*
 * hm_signature of rows whose float64 token sum is given (d doubles): the
 * same bits, for callers that summed the tokens themselves (bfloat16 words:
 * hm_bf16_token_sums).  Returns 0, or -1 when the workspace cannot be
 * allocated.
 */
static int hm_signature_of_sum(const double *sum, size_t d, const uint8_t *signs, size_t m,
                               size_t rounds, size_t hdc_dim, uint8_t *out)
{
    double *s = (double *)aligned_alloc(64, 2 * m * sizeof(double));
    if (s == NULL)
        return -1;
    double *v = s + m;
    memcpy(s, sum, d * sizeof(double));
    for (size_t i = d; i < m; i++)
        s[i] = 0.0;
#if HM_X86
    if (hm_path == HM_PATH_AVX512)
        hm_signature_avx512(NULL, 0, d, signs, m, rounds, hdc_dim, out, s, v);
    else if (hm_path == HM_PATH_POPCNT && hm_proj_has_avx2)
        hm_signature_avx2(NULL, 0, d, signs, m, rounds, hdc_dim, out, s, v);
    else
#endif
        hm_signature_baseline(NULL, 0, d, signs, m, rounds, hdc_dim, out, s, v);
    free(s);
    return 0;
}

/* ---- many entries at once -------------------------------------------- */

/*
 * hm_signature_many computes the signatures of HM_LANES entries at a time
 * in "lane layout": value i of entry l at v[i * HM_LANES + l].  Every
 * transform stage then pairs whole groups of HM_LANES values, so each
 * vector add or subtract serves one value of each entry and no shuffle is
 * needed.  Each entry still goes through exactly the operations of
 * hm_signature_body in the same order (a sign flip, then stage 1, 2, 4, ...
 * of each round, each output one add or subtract of the same two
 * operands), so the bits are the same.  Three stages are done per pass
 * (radix 8), the first pass with the sign flip in it, which cuts the
 * stores, the bound of this loop, to a third of one pass per stage.
 */
#define HM_LANES 4

HM_PROJ_INLINE double hm_flip(double x, uint64_t mask)
{
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits ^= mask;
    memcpy(&x, &bits, sizeof bits);
    return x;
}

/* One radix-8 group: stages h, 2h and 4h of x[0..7] (offsets 0..7 times h
   within a block of 8h), in place. */
HM_PROJ_INLINE void hm_radix8(double *x)
{
    double a0 = x[0] + x[1], a1 = x[0] - x[1], a2 = x[2] + x[3], a3 = x[2] - x[3];
    double a4 = x[4] + x[5], a5 = x[4] - x[5], a6 = x[6] + x[7], a7 = x[6] - x[7];
    double b0 = a0 + a2, b2 = a0 - a2, b1 = a1 + a3, b3 = a1 - a3;
    double b4 = a4 + a6, b6 = a4 - a6, b5 = a5 + a7, b7 = a5 - a7;
    x[0] = b0 + b4; x[4] = b0 - b4; x[1] = b1 + b5; x[5] = b1 - b5;
    x[2] = b2 + b6; x[6] = b2 - b6; x[3] = b3 + b7; x[7] = b3 - b7;
}

/* Stages h, 2h, 4h of the n values of v (blocks of 8h). */
HM_PROJ_INLINE void hm_fwht_radix8(double *v, size_t n, size_t h)
{
    for (size_t i = 0; i < n; i += 8 * h) {
        double *p = v + i;
#pragma GCC ivdep
        for (size_t j = 0; j < h; j++) {
            double x[8];
            for (unsigned k = 0; k < 8; k++)
                x[k] = p[j + k * h];
            hm_radix8(x);
            for (unsigned k = 0; k < 8; k++)
                p[j + k * h] = x[k];
        }
    }
}

/* One round in lane layout: flip by `signs` (m / 8 bytes), then stages 1,
   2, 4, ..., m / 2. */
HM_PROJ_INLINE void hm_lanes_round(double *v, const uint8_t *signs, size_t m)
{
    for (size_t i = 0; i < m; i += 8) { /* one byte of signs: flip + stages 1, 2, 4 */
        unsigned byte = signs[i >> 3];
        double *p = v + i * HM_LANES;
#pragma GCC ivdep
        for (size_t l = 0; l < HM_LANES; l++) {
            double x[8];
            for (unsigned k = 0; k < 8; k++)
                x[k] = hm_flip(p[k * HM_LANES + l], (uint64_t)((byte >> k) & 1) << 63);
            hm_radix8(x);
            for (unsigned k = 0; k < 8; k++)
                p[k * HM_LANES + l] = x[k];
        }
    }
    size_t h = 8;
    for (; 8 * h <= m; h *= 8)
        hm_fwht_radix8(v, m * HM_LANES, h * HM_LANES);
    if (4 * h <= m) {
        hm_fwht_radix4(v, m * HM_LANES, h * HM_LANES);
        h *= 4;
    }
    if (2 * h <= m) { /* one stage left */
        double *a = v, *b = v + h * HM_LANES;
#pragma GCC ivdep
        for (size_t j = 0; j < h * HM_LANES; j++) {
            double x = a[j], y = b[j];
            a[j] = x + y;
            b[j] = x - y;
        }
    }
}

/* Bits [0, nbits) of each lane's output (nbits a multiple of 8): bit i =
   v[i * HM_LANES + l] > 0, gathered 64 at a time. */
HM_PROJ_INLINE void hm_lanes_pack(uint8_t *const *out, size_t at, size_t lanes, const double *v, size_t nbits)
{
    for (size_t w0 = 0; w0 < nbits; w0 += 64) {
        size_t count = nbits - w0 < 64 ? nbits - w0 : 64;
        uint64_t acc[HM_LANES] = {0};
        for (size_t i = 0; i < count; i++)
            for (size_t l = 0; l < HM_LANES; l++)
                acc[l] |= (uint64_t)(v[(w0 + i) * HM_LANES + l] > 0.0) << i;
        for (size_t l = 0; l < lanes; l++)
            for (size_t k = 0; k < count / 8; k++)
                out[l][(at + w0) / 8 + k] = (uint8_t)(acc[l] >> (8 * k));
    }
}

/* Up to HM_LANES entries (`lanes` of them): entry l has n[l] rows at
   rows[l].  s: HM_LANES * m doubles (per-entry sums); t and v: as many, in
   lane layout. */
HM_PROJ_INLINE void hm_signature_lanes_body(const float *const *rows, const size_t *n, size_t lanes,
                                            size_t d, const uint8_t *signs, size_t m, size_t rounds,
                                            size_t hdc_dim, uint8_t *const *out, double *s, double *t,
                                            double *v)
{
    for (size_t l = 0; l < HM_LANES; l++) {
        if (l < lanes)
            hm_proj_sum(s + l * m, rows[l], n[l], d, m);
        else
            memset(s + l * m, 0, m * sizeof(double));
    }
    for (size_t i = 0; i < m; i++)
        for (size_t l = 0; l < HM_LANES; l++)
            t[i * HM_LANES + l] = s[l * m + i];
    size_t blocks = (hdc_dim + m - 1) / m;
    for (size_t b = 0; b < blocks; b++) {
        memcpy(v, t, m * HM_LANES * sizeof(double));
        for (size_t r = 0; r < rounds; r++)
            hm_lanes_round(v, signs + (b * rounds + r) * m / 8, m);
        size_t nbits = hdc_dim - b * m < m ? hdc_dim - b * m : m;
        hm_lanes_pack(out, b * m, lanes, v, nbits);
    }
}

static void hm_signature_lanes_baseline(const float *const *rows, const size_t *n, size_t lanes, size_t d,
                                        const uint8_t *signs, size_t m, size_t rounds, size_t hdc_dim,
                                        uint8_t *const *out, double *s, double *t, double *v)
{
    hm_signature_lanes_body(rows, n, lanes, d, signs, m, rounds, hdc_dim, out, s, t, v);
}

#if HM_X86
/* The same in AVX2 intrinsics: one __m256d holds one value of each of the
   four entries, so every line below is the scalar code's line, lane by
   lane (the compiler's own vectorisation of the generic code spends more
   on moving values than on adding them). */
__attribute__((target("avx2"))) HM_PROJ_INLINE void hm_radix8_avx2(__m256d *x)
{
    __m256d a0 = _mm256_add_pd(x[0], x[1]), a1 = _mm256_sub_pd(x[0], x[1]);
    __m256d a2 = _mm256_add_pd(x[2], x[3]), a3 = _mm256_sub_pd(x[2], x[3]);
    __m256d a4 = _mm256_add_pd(x[4], x[5]), a5 = _mm256_sub_pd(x[4], x[5]);
    __m256d a6 = _mm256_add_pd(x[6], x[7]), a7 = _mm256_sub_pd(x[6], x[7]);
    __m256d b0 = _mm256_add_pd(a0, a2), b2 = _mm256_sub_pd(a0, a2);
    __m256d b1 = _mm256_add_pd(a1, a3), b3 = _mm256_sub_pd(a1, a3);
    __m256d b4 = _mm256_add_pd(a4, a6), b6 = _mm256_sub_pd(a4, a6);
    __m256d b5 = _mm256_add_pd(a5, a7), b7 = _mm256_sub_pd(a5, a7);
    x[0] = _mm256_add_pd(b0, b4); x[4] = _mm256_sub_pd(b0, b4);
    x[1] = _mm256_add_pd(b1, b5); x[5] = _mm256_sub_pd(b1, b5);
    x[2] = _mm256_add_pd(b2, b6); x[6] = _mm256_sub_pd(b2, b6);
    x[3] = _mm256_add_pd(b3, b7); x[7] = _mm256_sub_pd(b3, b7);
}

__attribute__((target("avx2"))) HM_PROJ_INLINE
void hm_lanes_round_avx2(double *v, const uint8_t *signs, size_t m)
{
    for (size_t i = 0; i < m; i += 8) {
        const uint64_t *flips = hm_byte_flips[signs[i >> 3]];
        __m256d x[8];
        for (unsigned k = 0; k < 8; k++)
            x[k] = _mm256_xor_pd(_mm256_load_pd(v + (i + k) * HM_LANES),
                                 _mm256_castsi256_pd(_mm256_set1_epi64x((long long)flips[k])));
        hm_radix8_avx2(x);
        for (unsigned k = 0; k < 8; k++)
            _mm256_store_pd(v + (i + k) * HM_LANES, x[k]);
    }
    size_t h = 8;
    for (; 8 * h <= m; h *= 8)
        for (size_t b = 0; b < m; b += 8 * h)
            for (size_t j = b; j < b + h; j++) {
                __m256d x[8];
                for (unsigned k = 0; k < 8; k++)
                    x[k] = _mm256_load_pd(v + (j + k * h) * HM_LANES);
                hm_radix8_avx2(x);
                for (unsigned k = 0; k < 8; k++)
                    _mm256_store_pd(v + (j + k * h) * HM_LANES, x[k]);
            }
    if (4 * h <= m) {
        hm_fwht_radix4(v, m * HM_LANES, h * HM_LANES);
        h *= 4;
    }
    if (2 * h <= m) {
        for (size_t j = 0; j < h; j++) {
            __m256d a = _mm256_load_pd(v + j * HM_LANES), b = _mm256_load_pd(v + (j + h) * HM_LANES);
            _mm256_store_pd(v + j * HM_LANES, _mm256_add_pd(a, b));
            _mm256_store_pd(v + (j + h) * HM_LANES, _mm256_sub_pd(a, b));
        }
    }
}

/* hm_lanes_pack with a compare per value of the four entries: bit i of
   each lane is gathered by masking the compare with 1 << i. */
__attribute__((target("avx2"))) HM_PROJ_INLINE
void hm_lanes_pack_avx2(uint8_t *const *out, size_t at, size_t lanes, const double *v, size_t nbits)
{
    const __m256d zero = _mm256_setzero_pd();
    for (size_t w0 = 0; w0 < nbits; w0 += 64) {
        size_t count = nbits - w0 < 64 ? nbits - w0 : 64;
        __m256i acc = _mm256_setzero_si256();
        for (size_t i = 0; i < count; i++) {
            __m256i gt = _mm256_castpd_si256(_mm256_cmp_pd(_mm256_load_pd(v + (w0 + i) * HM_LANES), zero, _CMP_GT_OQ));
            acc = _mm256_or_si256(acc, _mm256_and_si256(gt, _mm256_set1_epi64x((long long)(1ULL << i))));
        }
        uint64_t words[HM_LANES];
        _mm256_storeu_si256((__m256i *)words, acc);
        for (size_t l = 0; l < lanes; l++)
            for (size_t k = 0; k < count / 8; k++)
                out[l][(at + w0) / 8 + k] = (uint8_t)(words[l] >> (8 * k));
    }
}

__attribute__((target("avx2"))) HM_PROJ_INLINE
void hm_signature_lanes_avx2_body(const float *const *rows, const size_t *n, size_t lanes, size_t d,
                                  const uint8_t *signs, size_t m, size_t rounds, size_t hdc_dim,
                                  uint8_t *const *out, double *s, double *t, double *v)
{
    for (size_t l = 0; l < HM_LANES; l++) {
        if (l < lanes)
            hm_proj_sum(s + l * m, rows[l], n[l], d, m);
        else
            memset(s + l * m, 0, m * sizeof(double));
    }
    for (size_t i = 0; i < m; i++)
        for (size_t l = 0; l < HM_LANES; l++)
            t[i * HM_LANES + l] = s[l * m + i];
    size_t blocks = (hdc_dim + m - 1) / m;
    for (size_t b = 0; b < blocks; b++) {
        memcpy(v, t, m * HM_LANES * sizeof(double));
        for (size_t r = 0; r < rounds; r++)
            hm_lanes_round_avx2(v, signs + (b * rounds + r) * m / 8, m);
        size_t nbits = hdc_dim - b * m < m ? hdc_dim - b * m : m;
        hm_lanes_pack_avx2(out, b * m, lanes, v, nbits);
    }
}

__attribute__((target("avx2")))
static void hm_signature_lanes_avx2(const float *const *rows, const size_t *n, size_t lanes, size_t d,
                                    const uint8_t *signs, size_t m, size_t rounds, size_t hdc_dim,
                                    uint8_t *const *out, double *s, double *t, double *v)
{
    if (m == 64) /* the commonest block (embed_dim <= 64), a constant the compiler unrolls */
        hm_signature_lanes_avx2_body(rows, n, lanes, d, signs, 64, rounds, hdc_dim, out, s, t, v);
    else
        hm_signature_lanes_avx2_body(rows, n, lanes, d, signs, m, rounds, hdc_dim, out, s, t, v);
}

/*
 * The same on AVX-512F with eight entries at a time (HM_LANES8): one
 * __m512d holds one value of each of eight entries, so every vector add or
 * subtract serves twice the entries of the AVX2 code, lane by lane the same
 * operations.  Two more differences, neither changing an operation: the
 * first pass of a block's first round reads the transposed sums directly
 * (instead of a copy of them made first), and the bits are gathered with
 * a compare mask per value.
 */
#define HM_LANES8 8

__attribute__((target("avx512f"))) HM_PROJ_INLINE void hm_radix8_avx512(__m512d *x)
{
    __m512d a0 = _mm512_add_pd(x[0], x[1]), a1 = _mm512_sub_pd(x[0], x[1]);
    __m512d a2 = _mm512_add_pd(x[2], x[3]), a3 = _mm512_sub_pd(x[2], x[3]);
    __m512d a4 = _mm512_add_pd(x[4], x[5]), a5 = _mm512_sub_pd(x[4], x[5]);
    __m512d a6 = _mm512_add_pd(x[6], x[7]), a7 = _mm512_sub_pd(x[6], x[7]);
    __m512d b0 = _mm512_add_pd(a0, a2), b2 = _mm512_sub_pd(a0, a2);
    __m512d b1 = _mm512_add_pd(a1, a3), b3 = _mm512_sub_pd(a1, a3);
    __m512d b4 = _mm512_add_pd(a4, a6), b6 = _mm512_sub_pd(a4, a6);
    __m512d b5 = _mm512_add_pd(a5, a7), b7 = _mm512_sub_pd(a5, a7);
    x[0] = _mm512_add_pd(b0, b4); x[4] = _mm512_sub_pd(b0, b4);
    x[1] = _mm512_add_pd(b1, b5); x[5] = _mm512_sub_pd(b1, b5);
    x[2] = _mm512_add_pd(b2, b6); x[6] = _mm512_sub_pd(b2, b6);
    x[3] = _mm512_add_pd(b3, b7); x[7] = _mm512_sub_pd(b3, b7);
}

/* One round in eight-lane layout, reading the round's input from `src`
   (v itself, or the sums for a block's first round) and leaving it in v. */
__attribute__((target("avx512f"))) HM_PROJ_INLINE
void hm_lanes8_round_avx512(double *v, const double *src, const uint8_t *signs, size_t m)
{
    const __m512i sign = _mm512_set1_epi64((long long)(1ULL << 63));
    for (size_t i = 0; i < m; i += 8) {
        unsigned byte = signs[i >> 3];
        __m512d x[8];
        for (unsigned k = 0; k < 8; k++) {
            __m512i bits = _mm512_load_si512(src + (i + k) * HM_LANES8);
            x[k] = _mm512_castsi512_pd(_mm512_mask_xor_epi64(bits, (__mmask8)(0u - ((byte >> k) & 1u)), bits, sign));
        }
        hm_radix8_avx512(x);
        for (unsigned k = 0; k < 8; k++)
            _mm512_store_pd(v + (i + k) * HM_LANES8, x[k]);
    }
    size_t h = 8;
    for (; 8 * h <= m; h *= 8)
        for (size_t b = 0; b < m; b += 8 * h)
            for (size_t j = b; j < b + h; j++) {
                __m512d x[8];
                for (unsigned k = 0; k < 8; k++)
                    x[k] = _mm512_load_pd(v + (j + k * h) * HM_LANES8);
                hm_radix8_avx512(x);
                for (unsigned k = 0; k < 8; k++)
                    _mm512_store_pd(v + (j + k * h) * HM_LANES8, x[k]);
            }
    if (4 * h <= m) {
        hm_fwht_radix4(v, m * HM_LANES8, h * HM_LANES8);
        h *= 4;
    }
    if (2 * h <= m) {
        for (size_t j = 0; j < h; j++) {
            __m512d a = _mm512_load_pd(v + j * HM_LANES8), b = _mm512_load_pd(v + (j + h) * HM_LANES8);
            _mm512_store_pd(v + j * HM_LANES8, _mm512_add_pd(a, b));
            _mm512_store_pd(v + (j + h) * HM_LANES8, _mm512_sub_pd(a, b));
        }
    }
}

/* Bits [0, nbits) of each lane's output: the compare of value i of the
   eight entries is a mask whose set lanes get bit i. */
__attribute__((target("avx512f"))) HM_PROJ_INLINE
void hm_lanes8_pack_avx512(uint8_t *const *out, size_t at, size_t lanes, const double *v, size_t nbits)
{
    const __m512d zero = _mm512_setzero_pd();
    for (size_t w0 = 0; w0 < nbits; w0 += 64) {
        size_t count = nbits - w0 < 64 ? nbits - w0 : 64;
        __m512i acc = _mm512_setzero_si512();
        for (size_t i = 0; i < count; i++) {
            __mmask8 gt = _mm512_cmp_pd_mask(_mm512_load_pd(v + (w0 + i) * HM_LANES8), zero, _CMP_GT_OQ);
            acc = _mm512_mask_or_epi64(acc, gt, acc, _mm512_set1_epi64((long long)(1ULL << i)));
        }
        uint64_t words[HM_LANES8];
        _mm512_storeu_si512(words, acc);
        for (size_t l = 0; l < lanes; l++)
            for (size_t k = 0; k < count / 8; k++)
                out[l][(at + w0) / 8 + k] = (uint8_t)(words[l] >> (8 * k));
    }
}

/* Up to HM_LANES8 entries; s, t and v: HM_LANES8 * m doubles each. */
__attribute__((target("avx512f"))) HM_PROJ_INLINE
void hm_signature_lanes8_avx512_body(const float *const *rows, const size_t *n, size_t lanes, size_t d,
                                     const uint8_t *signs, size_t m, size_t rounds, size_t hdc_dim,
                                     uint8_t *const *out, double *s, double *t, double *v)
{
    for (size_t l = 0; l < HM_LANES8; l++) {
        if (l < lanes)
            hm_proj_sum(s + l * m, rows[l], n[l], d, m);
        else
            memset(s + l * m, 0, m * sizeof(double));
    }
    for (size_t i = 0; i < m; i++)
        for (size_t l = 0; l < HM_LANES8; l++)
            t[i * HM_LANES8 + l] = s[l * m + i];
    size_t blocks = (hdc_dim + m - 1) / m;
    for (size_t b = 0; b < blocks; b++) {
        for (size_t r = 0; r < rounds; r++) /* rounds >= 1: the callers check it */
            hm_lanes8_round_avx512(v, r == 0 ? t : v, signs + (b * rounds + r) * m / 8, m);
        size_t nbits = hdc_dim - b * m < m ? hdc_dim - b * m : m;
        hm_lanes8_pack_avx512(out, b * m, lanes, v, nbits);
    }
}

__attribute__((target("avx512f")))
static void hm_signature_lanes8_avx512(const float *const *rows, const size_t *n, size_t lanes, size_t d,
                                       const uint8_t *signs, size_t m, size_t rounds, size_t hdc_dim,
                                       uint8_t *const *out, double *s, double *t, double *v)
{
    if (m == 64)
        hm_signature_lanes8_avx512_body(rows, n, lanes, d, signs, 64, rounds, hdc_dim, out, s, t, v);
    else
        hm_signature_lanes8_avx512_body(rows, n, lanes, d, signs, m, rounds, hdc_dim, out, s, t, v);
}
#endif

/*
 * The signatures of `count` entries whose rows lie back to back in `rows`
 * (entry e has rows starts[e] .. starts[e + 1] - 1, at least one; d <= m
 * columns) into out (hdc_dim / 8 bytes per entry) and their float64 token
 * sums into sum_out (d doubles per entry) unless it is NULL: the same bytes
 * as hm_signature of each entry.  The AVX-512 path takes eight entries at
 * a time, the others four.  Returns 0, or -1 when the workspace cannot be
 * allocated.
 */
static int hm_signature_many(const float *rows, const int64_t *starts, size_t count, size_t d,
                             const uint8_t *signs, size_t m, size_t rounds, size_t hdc_dim,
                             uint8_t *out, double *sum_out)
{
    size_t step = HM_LANES;
#if HM_X86
    int wide = hm_path == HM_PATH_AVX512;
    if (wide)
        step = HM_LANES8;
#endif
    double *s = (double *)aligned_alloc(64, 3 * step * m * sizeof(double));
    if (s == NULL)
        return -1;
    double *t = s + step * m, *v = t + step * m;
    size_t sig_bytes = hdc_dim / 8;
    for (size_t e = 0; e < count; e += step) {
        size_t lanes = count - e < step ? count - e : step;
        const float *lane_rows[8];
        size_t lane_n[8];
        uint8_t *lane_out[8];
        for (size_t l = 0; l < lanes; l++) {
            lane_rows[l] = rows + (size_t)starts[e + l] * d;
            lane_n[l] = (size_t)(starts[e + l + 1] - starts[e + l]);
            lane_out[l] = out + (e + l) * sig_bytes;
        }
#if HM_X86
        if (wide)
            hm_signature_lanes8_avx512(lane_rows, lane_n, lanes, d, signs, m, rounds, hdc_dim, lane_out, s, t, v);
        else if (hm_path != HM_PATH_PORTABLE && hm_proj_has_avx2)
            hm_signature_lanes_avx2(lane_rows, lane_n, lanes, d, signs, m, rounds, hdc_dim, lane_out, s, t, v);
        else
#endif
            hm_signature_lanes_baseline(lane_rows, lane_n, lanes, d, signs, m, rounds, hdc_dim, lane_out, s, t, v);
        if (sum_out != NULL)
            for (size_t l = 0; l < lanes; l++)
                memcpy(sum_out + (e + l) * d, s + l * m, d * sizeof(double));
    }
    free(s);
    return 0;
}

/* ---- SplitMix64: the generator the format fixes ----------------------- */

static void hm_splitmix64(uint64_t seed, size_t count, uint64_t *out)
{
    for (size_t k = 0; k < count; k++) {
        uint64_t z = seed + (uint64_t)(k + 1) * 0x9E3779B97F4A7C15ULL;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        out[k] = z ^ (z >> 31);
    }
}

#endif /* HMEM_PROJECTION_H */
