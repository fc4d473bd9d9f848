/* The vector helpers ablate's native kernels share (steps.c, paged_attention.c).
 *
 * A vec is one of the machine's vector registers of floats, GCC's generic vectors: 16 floats on AVX-512,
 * 8 on AVX2, 4 on SSE and NEON (the library is built with -march=native: ablate/model/native/build.py).
 * The kernels step through their rows VEC floats at a time. A generic vector wider than the machine's
 * registers is no faster to write and far slower to run: GCC moves its halves through memory and the
 * integer registers between operations (a 16-float vector on AVX2 made the matrix-vector kernel a
 * stack-bound loop).
 */
#ifndef ABLATE_NATIVE_VECTORS_H
#define ABLATE_NATIVE_VECTORS_H

#include <string.h>

#if defined(__AVX512F__)
#define VECTOR_BYTES 64
#elif defined(__AVX__)
#define VECTOR_BYTES 32
#else
#define VECTOR_BYTES 16
#endif

enum { VEC = VECTOR_BYTES / 4 };        /* floats in a vec */

/* aligned(4): loads need not be aligned; may_alias: a vec may be read from any float's address */
typedef float vec __attribute__((vector_size(VECTOR_BYTES), aligned(4), may_alias));
typedef int ivec __attribute__((vector_size(VECTOR_BYTES)));
typedef unsigned int uvec __attribute__((vector_size(VECTOR_BYTES), aligned(4), may_alias));

/* v[0] + ... + v[VEC - 1] as a tree (halves added, then their halves, ...): log2(VEC) dependent
 * additions, where summing in order chains VEC */
static inline float hsum(vec v) {
    float s[VEC];
    memcpy(s, &v, sizeof s);
    for (int width = VEC / 2; width > 0; width /= 2)
        for (int k = 0; k < width; k++) s[k] += s[k + width];
    return s[0];
}

/* through a pointer to vec, as the compiler's own unaligned-load types do (__m256_u): one vector load or
 * store, where a memcpy into a local vec went through the stack */
static inline vec load(const float *p) { return *(const vec *)p; }

static inline void store(float *p, vec v) { *(vec *)p = v; }

/* bf16: the upper 16 bits of an fp32, so widening is a shift; rounding back is to nearest, ties to even */
typedef unsigned short bf16;

/* 2 VEC bf16 at p as fp32: the even-indexed VEC (low halves of the 32-bit words) and the odd-indexed VEC */
static inline void load_bf16_pairs(const bf16 *p, vec *even, vec *odd) {
    uvec words = *(const uvec *)p;
    *even = (vec)(words << 16);
    *odd = (vec)(words & 0xffff0000u);
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
static inline float dot(const float *w, const float *x, long n) {
    vec acc = {0};
    long i = 0;
    for (; i + VEC <= n; i += VEC) acc += load(w + i) * load(x + i);
    float s = hsum(acc);
    for (; i < n; i++) s += w[i] * x[i];
    return s;
}

/* e^x for x <= 0, VEC at a time: e^x = 2^n e^r with n = round(x / ln 2) and r = x - n ln 2 in
 * [-ln2/2, ln2/2], where e^r's Taylor series to r^6 is within 2e-7 of it; 2^n goes into the exponent
 * bits (round(): adding 1.5 * 2^23 leaves n in the low mantissa bits, also as an integer). Below
 * x = -60 the result is 0: e^-60 < 1e-26 is far beneath a softmax's precision, and weights that
 * small would make subnormal products, which cost a hundred cycles each on x86. */
static inline vec expv(vec x) {
    const vec zero = {0}, shift = zero + 12582912.0f;         /* 1.5 * 2^23 */
    ivec tiny = x < -60.0f;
    x = (vec)(((ivec)x & ~tiny) | ((ivec)(zero - 60.0f) & tiny));
    vec t = x * 1.44269504088896341f + shift;                  /* x / ln 2 + shift */
    vec n = t - shift;
    vec r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;    /* ln 2, split for precision */
    vec p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    return (vec)(((ivec)p + (((ivec)t - (ivec)shift) << 23)) & ~tiny);
}

#endif
