/*
 * CRC-32C (Castagnoli): reflected polynomial 0x82F63B78, initial value
 * 0xFFFFFFFF, final xor 0xFFFFFFFF; crc32c("123456789") = 0xE3069283.
 *
 * Data layout: a plain byte string; no alignment is assumed (words are
 * loaded with memcpy as little-endian u64).
 *
 * The functions here work on the raw register ("state"): callers pass
 * ~crc in and take ~state out, which makes crc32c(b, crc32c(a)) ==
 * crc32c(a + b).
 *
 * Paths: a table-driven slicing-by-8 loop everywhere, and on x86 the SSE4.2
 * crc32 instruction, 8 bytes per step over three independent streams (the
 * instruction has a latency of 3 cycles and a throughput of 1, so one
 * stream leaves two thirds of the unit idle).  The three streams' states
 * are joined by "shifting" a state over the bytes that follow it, a linear
 * map applied through four 256-entry tables.  On the AVX-512 path, when the
 * CPU has VPCLMULQDQ, inputs of HM_CRC_FOLD_MIN bytes and more are folded
 * 256 bytes a step by carry-less multiplication (four 512-bit accumulators:
 * a 128-bit lane a times x^(D+32) and x^(D-32) modulo the polynomial, D
 * the bits it moves forward, keeps the message's remainder), then the
 * last 16 bytes left are fed to the crc32 instruction.
 */
#ifndef HMEM_CHECKSUM_H
#define HMEM_CHECKSUM_H

#include "bitops.h"

#define HM_CRC32C_POLY 0x82F63B78u

/* hm_crc32c_init() must run once, before any other function here. */
static uint32_t hm_crc32c_table[8][256]; /* slicing-by-8 */

/* ---- GF(2) helpers: the effect of appending zero bytes ----------------- */

/* a * b modulo the polynomial, both in the reflected representation
   (bit 31 holds x^0). */
static uint32_t hm_crc32c_multmod(uint32_t a, uint32_t b)
{
    uint32_t product = 0;
    for (uint32_t m = 1u << 31; m; m >>= 1) {
        if (a & m)
            product ^= b;
        b = (b & 1) ? (b >> 1) ^ HM_CRC32C_POLY : b >> 1;
    }
    return product;
}

/* x^(8 * nbytes) modulo the polynomial: feeding nbytes zero bytes to a state
   multiplies it by this. */
static uint32_t hm_crc32c_xpow8n(size_t nbytes)
{
    uint32_t result = 1u << 31; /* x^0 */
    uint32_t square = 1u << 23; /* x^8 */
    while (nbytes) {
        if (nbytes & 1)
            result = hm_crc32c_multmod(square, result);
        square = hm_crc32c_multmod(square, square);
        nbytes >>= 1;
    }
    return result;
}

/* Tables of the linear map "feed `nbytes` zero bytes", one per state byte. */
static void hm_crc32c_shift_tables(uint32_t t[4][256], size_t nbytes)
{
    uint32_t op = hm_crc32c_xpow8n(nbytes);
    for (uint32_t n = 0; n < 256; n++)
        for (int j = 0; j < 4; j++)
            t[j][n] = hm_crc32c_multmod(op, n << (8 * j));
}

static inline uint32_t hm_crc32c_shift(uint32_t t[4][256], uint32_t state)
{
    return t[0][state & 0xFF] ^ t[1][(state >> 8) & 0xFF] ^
           t[2][(state >> 16) & 0xFF] ^ t[3][state >> 24];
}

/* Stream lengths of the three-way hardware loop.  Long streams let the
   hardware prefetchers ramp up on inputs read from memory (64 KB streams:
   ~22 GB/s here, 8 KB ones: ~15); short ones keep the three-way speed on
   inputs of a few KB.  The join costs 8 table lookups per 3 streams. */
#define HM_CRC_LONG 65536
#define HM_CRC_SHORT 256
static uint32_t hm_crc32c_long[4][256];
static uint32_t hm_crc32c_short[4][256];
static int hm_crc32c_has_sse42 = 0;
static int hm_crc32c_has_vpclmul = 0;
/* The fold constants (reflected, shifted left by one: 33-bit values) of
   the distances the VPCLMULQDQ path moves a lane by. */
static uint64_t hm_crc32c_fold_k[5][2]; /* 2048, 512, 384, 256, 128 bits; [x^(D+32), x^(D-32)] */
static const size_t hm_crc32c_fold_bits[5] = {2048, 512, 384, 256, 128};
#define HM_CRC_FOLD_MIN 1024

static void hm_crc32c_init(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ HM_CRC32C_POLY : c >> 1;
        hm_crc32c_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = hm_crc32c_table[0][n];
        for (int k = 1; k < 8; k++) {
            c = hm_crc32c_table[0][c & 0xFF] ^ (c >> 8);
            hm_crc32c_table[k][n] = c;
        }
    }
    hm_crc32c_shift_tables(hm_crc32c_long, HM_CRC_LONG);
    hm_crc32c_shift_tables(hm_crc32c_short, HM_CRC_SHORT);
    for (int i = 0; i < 5; i++) {
        hm_crc32c_fold_k[i][0] = (uint64_t)hm_crc32c_xpow8n((hm_crc32c_fold_bits[i] + 32) / 8) << 1;
        hm_crc32c_fold_k[i][1] = (uint64_t)hm_crc32c_xpow8n((hm_crc32c_fold_bits[i] - 32) / 8) << 1;
    }
#if HM_X86
    __builtin_cpu_init();
    hm_crc32c_has_sse42 = __builtin_cpu_supports("sse4.2") != 0;
    hm_crc32c_has_vpclmul = hm_crc32c_has_sse42 && __builtin_cpu_supports("avx512f") &&
                            __builtin_cpu_supports("vpclmulqdq");
#endif
}

/* ---- portable: slicing-by-8 ------------------------------------------- */

static uint32_t hm_crc32c_portable(uint32_t state, const uint8_t *p, size_t n)
{
    uint32_t (*t)[256] = hm_crc32c_table;
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= state;
        state = t[7][w & 0xFF] ^ t[6][(w >> 8) & 0xFF] ^
                t[5][(w >> 16) & 0xFF] ^ t[4][(w >> 24) & 0xFF] ^
                t[3][(w >> 32) & 0xFF] ^ t[2][(w >> 40) & 0xFF] ^
                t[1][(w >> 48) & 0xFF] ^ t[0][w >> 56];
    }
    for (; n; p++, n--)
        state = t[0][(state ^ *p) & 0xFF] ^ (state >> 8);
    return state;
}

/* ---- x86: the SSE4.2 crc32 instruction --------------------------------- */

#if HM_X86
__attribute__((target("sse4.2")))
static inline uint64_t hm_crc32c_hw_words(uint64_t state, const uint8_t *p, size_t nwords)
{
    for (size_t i = 0; i < nwords; i++) {
        uint64_t w;
        memcpy(&w, p + 8 * i, 8);
        state = _mm_crc32_u64(state, w);
    }
    return state;
}

/* Three streams of `len` bytes each from p; returns the state after all
   3 * len bytes. */
__attribute__((target("sse4.2")))
static inline uint64_t hm_crc32c_hw_3way(uint64_t s0, const uint8_t *p, size_t len,
                                         uint32_t shift[4][256])
{
    uint64_t s1 = 0, s2 = 0;
    for (size_t i = 0; i < len; i += 8) {
        uint64_t w0, w1, w2;
        memcpy(&w0, p + i, 8);
        memcpy(&w1, p + len + i, 8);
        memcpy(&w2, p + 2 * len + i, 8);
        s0 = _mm_crc32_u64(s0, w0);
        s1 = _mm_crc32_u64(s1, w1);
        s2 = _mm_crc32_u64(s2, w2);
    }
    /* The state of a || b is shift(state after a, |b|) ^ (state of b from 0). */
    s0 = hm_crc32c_shift(shift, (uint32_t)s0) ^ s1;
    return hm_crc32c_shift(shift, (uint32_t)s0) ^ s2;
}

__attribute__((target("sse4.2")))
static uint32_t hm_crc32c_sse42(uint32_t state32, const uint8_t *p, size_t n)
{
    uint64_t state = state32;
    for (; n >= 3 * HM_CRC_LONG; p += 3 * HM_CRC_LONG, n -= 3 * HM_CRC_LONG)
        state = hm_crc32c_hw_3way(state, p, HM_CRC_LONG, hm_crc32c_long);
    for (; n >= 3 * HM_CRC_SHORT; p += 3 * HM_CRC_SHORT, n -= 3 * HM_CRC_SHORT)
        state = hm_crc32c_hw_3way(state, p, HM_CRC_SHORT, hm_crc32c_short);
    state = hm_crc32c_hw_words(state, p, n / 8);
    p += n & ~(size_t)7;
    for (n &= 7; n; p++, n--)
        state = _mm_crc32_u8((uint32_t)state, *p);
    return (uint32_t)state;
}

#define HM_FOLD_TARGET "avx512f,vpclmulqdq,pclmul,sse4.2"

/* Each 128-bit lane of x moved D bits forward (k: that distance's
   constants in every lane) and added to d. */
__attribute__((target(HM_FOLD_TARGET)))
static inline __m512i hm_crc32c_fold512(__m512i x, __m512i k, __m512i d)
{
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00),
                                     _mm512_clmulepi64_epi128(x, k, 0x11), d, 0x96);
}

__attribute__((target(HM_FOLD_TARGET)))
static inline __m512i hm_crc32c_fold_constant(int i)
{
    return _mm512_set_epi64((long long)hm_crc32c_fold_k[i][1], (long long)hm_crc32c_fold_k[i][0],
                            (long long)hm_crc32c_fold_k[i][1], (long long)hm_crc32c_fold_k[i][0],
                            (long long)hm_crc32c_fold_k[i][1], (long long)hm_crc32c_fold_k[i][0],
                            (long long)hm_crc32c_fold_k[i][1], (long long)hm_crc32c_fold_k[i][0]);
}

/* n >= 256: the state after the bytes of p. */
__attribute__((target(HM_FOLD_TARGET)))
static uint32_t hm_crc32c_vpclmul(uint32_t state, const uint8_t *p, size_t n)
{
    __m512i x0 = _mm512_loadu_si512((const void *)p);
    __m512i x1 = _mm512_loadu_si512((const void *)(p + 64));
    __m512i x2 = _mm512_loadu_si512((const void *)(p + 128));
    __m512i x3 = _mm512_loadu_si512((const void *)(p + 192));
    x0 = _mm512_xor_si512(x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)state)));
    p += 256;
    n -= 256;
    const __m512i k2048 = hm_crc32c_fold_constant(0);
    for (; n >= 256; p += 256, n -= 256) {
        x0 = hm_crc32c_fold512(x0, k2048, _mm512_loadu_si512((const void *)p));
        x1 = hm_crc32c_fold512(x1, k2048, _mm512_loadu_si512((const void *)(p + 64)));
        x2 = hm_crc32c_fold512(x2, k2048, _mm512_loadu_si512((const void *)(p + 128)));
        x3 = hm_crc32c_fold512(x3, k2048, _mm512_loadu_si512((const void *)(p + 192)));
    }
    const __m512i k512 = hm_crc32c_fold_constant(1);
    x1 = hm_crc32c_fold512(x0, k512, x1);
    x2 = hm_crc32c_fold512(x1, k512, x2);
    x3 = hm_crc32c_fold512(x2, k512, x3);
    /* x3's lanes 0, 1, 2 moved 384, 256, 128 bits forward onto lane 3 */
    const __m512i lanes = _mm512_set_epi64(
        0, 0, (long long)hm_crc32c_fold_k[4][1], (long long)hm_crc32c_fold_k[4][0],
        (long long)hm_crc32c_fold_k[3][1], (long long)hm_crc32c_fold_k[3][0],
        (long long)hm_crc32c_fold_k[2][1], (long long)hm_crc32c_fold_k[2][0]);
    __m512i moved = _mm512_xor_si512(_mm512_clmulepi64_epi128(x3, lanes, 0x00),
                                     _mm512_clmulepi64_epi128(x3, lanes, 0x11));
    __m128i r = _mm_xor_si128(_mm512_extracti32x4_epi32(x3, 3), _mm512_extracti32x4_epi32(moved, 0));
    r = _mm_xor_si128(r, _mm512_extracti32x4_epi32(moved, 1));
    r = _mm_xor_si128(r, _mm512_extracti32x4_epi32(moved, 2));
    uint64_t folded = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(r));
    folded = _mm_crc32_u64(folded, (uint64_t)_mm_extract_epi64(r, 1));
    return hm_crc32c_sse42((uint32_t)folded, p, n);
}
#endif

/* Hardware CRC when the selected path is not the portable one and the CPU
   has SSE4.2 (POPCNT does not imply it: early AMD64 parts have one only). */
static uint32_t hm_crc32c(uint32_t crc, const uint8_t *p, size_t n)
{
    uint32_t state = ~crc;
#if HM_X86
    if (hm_path == HM_PATH_AVX512 && hm_crc32c_has_vpclmul && n >= HM_CRC_FOLD_MIN)
        return ~hm_crc32c_vpclmul(state, p, n);
    if (hm_path != HM_PATH_PORTABLE && hm_crc32c_has_sse42)
        return ~hm_crc32c_sse42(state, p, n);
#endif
    return ~hm_crc32c_portable(state, p, n);
}

#endif /* HMEM_CHECKSUM_H */
