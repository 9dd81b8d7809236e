/*
 * INT8 row quantization loops (see _quantize.pyx for the rules).  Plain
 * loops over restrict pointers, so the compiler vectorises them at the
 * portable baseline; every step is one IEEE float32 operation, identical to
 * the numpy reference.
 */
#ifndef HMEM_QUANTIZE_H
#define HMEM_QUANTIZE_H

#include <stddef.h>
#include <stdint.h>
#include <float.h>
#include <math.h>
#include <string.h>

/* Adding and subtracting 1.5 * 2^23 rounds a float of magnitude < 2^22 to
   the nearest integer, ties to even (the default rounding mode). */
#define HM_ROUNDER 12582912.0f

static void hm_quantize_rows(const float *restrict rows, size_t n, size_t d,
                             int8_t *restrict q, float *restrict scales)
{
    for (size_t i = 0; i < n; i++) {
        const float *restrict x = rows + i * d;
        int8_t *restrict out = q + i * d;
        /* max |x| through the bit patterns: for finite non-negative floats
           integer order is float order, and an integer max vectorises */
        const uint32_t *restrict bits = (const uint32_t *)x;
        uint32_t peak_bits = 0;
        for (size_t j = 0; j < d; j++) {
            uint32_t a = bits[j] & 0x7FFFFFFFu;
            peak_bits = a > peak_bits ? a : peak_bits;
        }
        float peak;
        memcpy(&peak, &peak_bits, sizeof peak);
        float scale = peak / 127.0f;
        if (scale * 127.0f > FLT_MAX) /* rounded up at the top of the range: 127 * scale would be inf */
            scale = nextafterf(scale, 0.0f);
        scales[i] = scale;
        if (scale == 0.0f) {
            for (size_t j = 0; j < d; j++)
                out[j] = 0;
            continue;
        }
        for (size_t j = 0; j < d; j++) {
            float v = (x[j] / scale + HM_ROUNDER) - HM_ROUNDER;
            v = v < 127.0f ? v : 127.0f; /* |x| <= peak keeps v in range; be safe */
            v = v > -127.0f ? v : -127.0f;
            out[j] = (int8_t)v;
        }
    }
}

static void hm_dequantize_rows(const int8_t *restrict q, const float *restrict scales,
                               size_t n, size_t d, float *restrict out)
{
    for (size_t i = 0; i < n; i++) {
        float scale = scales[i];
        for (size_t j = 0; j < d; j++)
            out[i * d + j] = (float)q[i * d + j] * scale;
    }
}

#endif /* HMEM_QUANTIZE_H */
