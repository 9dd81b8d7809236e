/*
 * Word-level primitives over LSB-first packed bitmaps, and the CPU-path
 * dispatch for popcount.
 *
 * Data layout: bit i of a bitmap lives in byte i / 8 under mask 1 << (i % 8).
 * A bitmap of n bits occupies ceil(n / 8) bytes; nothing here reads or writes
 * past that many bytes (the last, partial word is loaded byte by byte).
 * Loads reinterpret 8 bytes as a little-endian u64, so bit i of the word is
 * bit (8 * byte_offset + i) of the bitmap.  hmem is built for little-endian
 * hosts only (x86-64, aarch64); the build fails elsewhere.
 *
 * CPU paths: the file is compiled for the architecture's portable baseline.
 * On x86-64 the popcount loops are compiled three times, as a plain loop,
 * with the POPCNT instruction, and with AVX-512 VPOPCNTDQ, each through a
 * per-function target attribute, and hm_select_path() picks one at run time.
 */
#ifndef HMEM_BITOPS_H
#define HMEM_BITOPS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "hmem's kernels assume a little-endian host"
#endif

#if defined(__x86_64__) || defined(__i386__)
#define HM_X86 1
#include <immintrin.h>
#else
#define HM_X86 0
#endif

/* ---- loads ------------------------------------------------------------ */

/* 64 bits starting at byte `at`; bytes past `nbytes` read as zero. */
static inline uint64_t hm_load(const uint8_t *buf, size_t nbytes, size_t at)
{
    uint64_t w = 0;
    if (at + 8 <= nbytes) {
        memcpy(&w, buf + at, 8);
    } else if (at < nbytes) {
        memcpy(&w, buf + at, nbytes - at);
    }
    return w;
}

static inline uint64_t hm_low_mask(size_t n) /* n in [0, 64] */
{
    return n >= 64 ? ~(uint64_t)0 : (((uint64_t)1 << n) - 1);
}

/* ---- scans ------------------------------------------------------------ */

/* True when the 512 bits at `b` hold no bit equal to `want`. */
static inline int hm_block_lacks(const uint8_t *b, int want)
{
    uint64_t w[8];
    memcpy(w, b, 64);
    if (want)
        return ((w[0] | w[1]) | (w[2] | w[3]) | (w[4] | w[5]) | (w[6] | w[7])) == 0;
    return ((w[0] & w[1]) & (w[2] & w[3]) & (w[4] & w[5]) & (w[6] & w[7])) == ~(uint64_t)0;
}

/*
 * First position p in [start, end) whose bit equals `want` (0 or 1), or
 * `end` when there is none.  After the first step p is byte aligned; long
 * runs are then skipped 512 bits at a time.
 */
static inline size_t hm_next_bit(const uint8_t *buf, size_t nbytes,
                                 size_t start, size_t end, int want)
{
    size_t p = start;
    while (p < end) {
        if ((p & 7) == 0)
            while (end - p >= 512 && hm_block_lacks(buf + (p >> 3), want))
                p += 512;
        unsigned shift = (unsigned)(p & 7);
        uint64_t w = hm_load(buf, nbytes, p >> 3);
        if (!want)
            w = ~w;
        w >>= shift;
        size_t avail = 64 - shift;
        if (avail > end - p)
            avail = end - p;
        w &= hm_low_mask(avail);
        if (w)
            return p + (size_t)__builtin_ctzll(w);
        p += avail;
    }
    return end;
}

/* Highest set bit below `nbits`, or -1.  Bits at or past `nbits` in the
   last byte are ignored. */
static inline int64_t hm_highest_set(const uint8_t *buf, size_t nbits)
{
    if (nbits == 0)
        return -1;
    size_t i = (nbits - 1) >> 3; /* last byte */
    unsigned tail = buf[i] & (unsigned)hm_low_mask(nbits - (i << 3));
    if (tail)
        return (int64_t)((i << 3) + 31 - (size_t)__builtin_clz(tail));
    while (i >= 8) { /* bytes [0, i) remain */
        uint64_t w;
        memcpy(&w, buf + i - 8, 8);
        if (w)
            return (int64_t)(((i - 8) << 3) + 63 - (size_t)__builtin_clzll(w));
        i -= 8;
    }
    while (i > 0) {
        i--;
        if (buf[i])
            return (int64_t)((i << 3) + 31 - (size_t)__builtin_clz(buf[i]));
    }
    return -1;
}

/* ---- range writes ----------------------------------------------------- */

static inline void hm_set_range(uint8_t *buf, size_t start, size_t end)
{
    if (start >= end)
        return;
    size_t sb = start >> 3, eb = end >> 3;
    unsigned so = (unsigned)(start & 7), eo = (unsigned)(end & 7);
    if (sb == eb) {
        buf[sb] |= (uint8_t)(((1u << eo) - 1) & ~((1u << so) - 1));
        return;
    }
    if (so) {
        buf[sb] |= (uint8_t)(0xFFu << so);
        sb++;
    }
    memset(buf + sb, 0xFF, eb - sb);
    if (eo)
        buf[eb] |= (uint8_t)((1u << eo) - 1);
}

static inline void hm_clear_range(uint8_t *buf, size_t start, size_t end)
{
    if (start >= end)
        return;
    size_t sb = start >> 3, eb = end >> 3;
    unsigned so = (unsigned)(start & 7), eo = (unsigned)(end & 7);
    if (sb == eb) {
        buf[sb] &= (uint8_t)~(((1u << eo) - 1) & ~((1u << so) - 1));
        return;
    }
    if (so) {
        buf[sb] &= (uint8_t)((1u << so) - 1);
        sb++;
    }
    memset(buf + sb, 0x00, eb - sb);
    if (eo)
        buf[eb] &= (uint8_t)~((1u << eo) - 1);
}

/* ---- popcount with run-time CPU path ---------------------------------- */

enum { HM_PATH_PORTABLE = 0, HM_PATH_POPCNT = 1, HM_PATH_AVX512 = 2 };

static const char *hm_path_names[] = {"portable", "popcnt", "avx512-vpopcntdq"};

/* Portable: a SWAR popcount that needs no special instruction. */
static inline uint64_t hm_popcount64_swar(uint64_t x)
{
    x = x - ((x >> 1) & 0x5555555555555555ULL);
    x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0FULL;
    return (x * 0x0101010101010101ULL) >> 56;
}

static uint64_t hm_popcount_portable(const uint8_t *buf, size_t nbytes)
{
    uint64_t total = 0;
    size_t i = 0;
    for (; i + 8 <= nbytes; i += 8) {
        uint64_t w;
        memcpy(&w, buf + i, 8);
        total += hm_popcount64_swar(w);
    }
    if (i < nbytes)
        total += hm_popcount64_swar(hm_load(buf, nbytes, i));
    return total;
}

#if HM_X86
__attribute__((target("popcnt")))
static uint64_t hm_popcount_popcnt(const uint8_t *buf, size_t nbytes)
{
    uint64_t total = 0;
    size_t i = 0;
    for (; i + 8 <= nbytes; i += 8) {
        uint64_t w;
        memcpy(&w, buf + i, 8);
        total += (uint64_t)__builtin_popcountll(w);
    }
    if (i < nbytes)
        total += (uint64_t)__builtin_popcountll(hm_load(buf, nbytes, i));
    return total;
}

__attribute__((target("avx512f,avx512vpopcntdq,popcnt")))
static uint64_t hm_popcount_avx512(const uint8_t *buf, size_t nbytes)
{
    __m512i acc = _mm512_setzero_si512();
    size_t i = 0;
    for (; i + 64 <= nbytes; i += 64)
        acc = _mm512_add_epi64(acc, _mm512_popcnt_epi64(_mm512_loadu_si512(buf + i)));
    uint64_t total = (uint64_t)_mm512_reduce_add_epi64(acc);
    for (; i < nbytes; i += 8)
        total += (uint64_t)__builtin_popcountll(hm_load(buf, nbytes, i));
    return total;
}
#endif

/* Best path this CPU supports. */
static int hm_best_path(void)
{
#if HM_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vpopcntdq"))
        return HM_PATH_AVX512;
    if (__builtin_cpu_supports("popcnt"))
        return HM_PATH_POPCNT;
#endif
    return HM_PATH_PORTABLE;
}

static int hm_path = HM_PATH_PORTABLE;

/* Select a path no faster than `limit` and supported by this CPU; returns it. */
static int hm_select_path(int limit)
{
    int best = hm_best_path();
    hm_path = limit < best ? (limit < 0 ? 0 : limit) : best;
    return hm_path;
}

static uint64_t hm_popcount(const uint8_t *buf, size_t nbytes)
{
#if HM_X86
    if (hm_path == HM_PATH_AVX512)
        return hm_popcount_avx512(buf, nbytes);
    if (hm_path == HM_PATH_POPCNT)
        return hm_popcount_popcnt(buf, nbytes);
#endif
    return hm_popcount_portable(buf, nbytes);
}

#endif /* HMEM_BITOPS_H */
