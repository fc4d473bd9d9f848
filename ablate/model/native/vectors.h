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

/* w[0:n] . x[0:n] */
static float dot(const float *w, const float *x, long n) {
    vec16 acc = {0};
    long i = 0;
    for (; i + 16 <= n; i += 16) acc += load16(w + i) * load16(x + i);
    float s = sum16(acc);
    for (; i < n; i++) s += w[i] * x[i];
    return s;
}

#endif
