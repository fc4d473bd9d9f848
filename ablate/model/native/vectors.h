/* The vector helpers ablate's native kernels share (steps.c, paged_attention.c).
 *
 * GCC's generic vectors (vec16: 16 floats) become AVX-512, AVX2 or NEON instructions, whichever the
 * machine has (the library is built with -march=native: ablate/model/native/build.py).
 */
#ifndef ABLATE_NATIVE_VECTORS_H
#define ABLATE_NATIVE_VECTORS_H

#include <string.h>

typedef float vec16 __attribute__((vector_size(64), aligned(4)));   /* loads need not be aligned */

static inline float sum16(vec16 v) {
    float s = 0.0f;
    for (int k = 0; k < 16; k++) s += v[k];
    return s;
}

static inline vec16 load16(const float *p) {
    vec16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, vec16 v) { memcpy(p, &v, sizeof v); }

/* bf16: the upper 16 bits of an fp32, so widening is a shift; rounding back is to nearest, ties to even */
typedef unsigned short bf16;
typedef unsigned int u32x16 __attribute__((vector_size(64), aligned(4)));

/* 32 bf16 at p as fp32: the even-indexed 16 (low halves of the 32-bit words) and the odd-indexed 16 */
static inline void load32_bf16(const bf16 *p, vec16 *even, vec16 *odd) {
    u32x16 words, low, high;
    memcpy(&words, p, sizeof words);
    low = words << 16;
    high = words & 0xffff0000u;
    memcpy(even, &low, sizeof *even);
    memcpy(odd, &high, sizeof *odd);
}

static inline float bf16_to_float(bf16 h) {
    unsigned int bits = (unsigned int)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline bf16 float_to_bf16(float f) {
    unsigned int bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (bf16)((bits >> 16) | 0x40);   /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (bf16)(bits >> 16);
}

/* w[0:n] . x[0:n] */
static float dot(const float *w, const float *x, long n) {
    vec16 acc = {0};
    long i = 0;
    for (; i + 16 <= n; i += 16) acc += load16(w + i) * load16(x + i);
    float s = sum16(acc);
    for (; i < n; i++) s += w[i] * x[i];
    return s;
}

typedef int ivec16 __attribute__((vector_size(64)));

/* e^x for x <= 0, 16 at a time: e^x = 2^n e^r with n = round(x / ln 2) and r = x - n ln 2 in
 * [-ln2/2, ln2/2], where e^r's Taylor series to r^6 is within 2e-7 of it; 2^n goes into the exponent
 * bits (round(): adding 1.5 * 2^23 leaves n in the low mantissa bits, also as an integer). Below
 * x = -60 the result is 0: e^-60 < 1e-26 is far beneath a softmax's precision, and weights that
 * small would make subnormal products, which cost a hundred cycles each on x86. */
static inline vec16 exp16(vec16 x) {
    const vec16 zero = {0}, shift = zero + 12582912.0f;       /* 1.5 * 2^23 */
    ivec16 tiny = x < -60.0f;
    x = (vec16)(((ivec16)x & ~tiny) | ((ivec16)(zero - 60.0f) & tiny));
    vec16 t = x * 1.44269504088896341f + shift;                /* x / ln 2 + shift */
    vec16 n = t - shift;
    vec16 r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;    /* ln 2, split for precision */
    vec16 p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    return (vec16)(((ivec16)p + (((ivec16)t - (ivec16)shift) << 23)) & ~tiny);
}

#endif
