/* ablate's own CPU kernels for steps of a few tokens: a matrix-vector product, RMSNorm, RoPE and
 * SwiGLU's activation. Built on first use by the machine's C compiler with the other kernels into one
 * library (ablate/model/native/build.py: -O3 -march=native -fopenmp), called through ctypes
 * (ablate/model/native/steps.py).
 *
 * OpenMP regions run on the thread pool torch already loaded (the same libgomp.so.1), so they never
 * compete with torch's own workers for the cores.
 */
#include <math.h>
#include <string.h>

#include "vectors.h"

/* matvec's packed layout (steps.py: pack_rows): W (d_out, d_in) as blocks of ROWS rows, each block
 * stored 16 columns at a time for its ROWS rows: packed[blk][c][r][0:16] = W[blk*ROWS + r][16c : 16c+16],
 * zero past d_out and d_in. x is loaded once for ROWS rows, and their ROWS independent multiply-add
 * chains keep the FMA units busy while W streams in. */
enum { ROWS = 8 };

/* y = W x (+ b) on W packed as above; x (d_in), y (d_out); b may be NULL.
 *
 * A matrix-vector product reads each weight once, so it runs at the speed W streams from memory. Each
 * thread takes a contiguous band of blocks, which the packed layout makes one sequential stream that
 * the hardware prefetcher runs ahead of. Row-major W would be ROWS streams at once: 15% slower over
 * SmolLM2's products on a Zen 4, with software prefetching, which the packed stream does not need. */
void matvec(const float *packed, const float *x, const float *b, float *y, long d_out, long d_in, int threads) {
    long blocks = (d_out + ROWS - 1) / ROWS, chunks = (d_in + 15) / 16;
    float x_padded[d_in % 16 ? chunks * 16 : 1];       /* x is read 16 at a time: zeros past its end */
    if (d_in % 16) {
        memcpy(x_padded, x, d_in * sizeof(float));
        memset(x_padded + d_in, 0, (chunks * 16 - d_in) * sizeof(float));
        x = x_padded;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long blk = 0; blk < blocks; blk++) {
        const float *w = packed + blk * chunks * ROWS * 16;
        vec16 acc[ROWS];
        for (int r = 0; r < ROWS; r++) acc[r] = (vec16){0};
        for (long c = 0; c < chunks; c++, w += ROWS * 16) {
            vec16 xv = load16(x + c * 16);
            for (int r = 0; r < ROWS; r++) acc[r] += load16(w + r * 16) * xv;
        }
        for (int r = 0; r < ROWS && blk * ROWS + r < d_out; r++)
            y[blk * ROWS + r] = sum16(acc[r]) + (b ? b[blk * ROWS + r] : 0.0f);
    }
}

/* y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, for each of `rows` rows of n: one pass where torch's
 * composite rms_norm makes six operations (square, mean, add, rsqrt, two multiplies). */
void rms_norm(const float *x, const float *w, float *y, long rows, long n, float eps) {
    for (long t = 0; t < rows; t++) {
        const float *xt = x + t * n;
        float *yt = y + t * n;
        float scale = 1.0f / sqrtf(dot(xt, xt, n) / (float)n + eps);
        for (long i = 0; i < n; i++) yt[i] = xt[i] * scale * w[i];
    }
}

/* RoPE, rotate-half layout, over x (rows, heads, D) with cos, sin (rows, D), D = 2 half:
 * y[i] = x[i] cos[i] - x[i + half] sin[i],  y[i + half] = x[i + half] cos[i + half] + x[i] sin[i + half] */
void rope(const float *x, const float *cosines, const float *sines, float *y, long rows, long heads, long dim) {
    long half = dim / 2;
    for (long t = 0; t < rows; t++) {
        const float *c = cosines + t * dim, *s = sines + t * dim;
        for (long h = 0; h < heads; h++) {
            const float *xh = x + (t * heads + h) * dim;
            float *yh = y + (t * heads + h) * dim;
            for (long i = 0; i < half; i++) {
                yh[i] = xh[i] * c[i] - xh[i + half] * s[i];
                yh[i + half] = xh[i + half] * c[i + half] + xh[i] * s[i + half];
            }
        }
    }
}

/* SwiGLU's activation: y (rows, F) = silu(gate) * up for gate_up (rows, 2F) = [gate | up],
 * silu(g) = g / (1 + exp(-g)) */
void silu_mul(const float *gate_up, float *y, long rows, long f) {
    for (long t = 0; t < rows; t++) {
        const float *g = gate_up + t * 2 * f, *u = g + f;
        for (long i = 0; i < f; i++) y[t * f + i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
