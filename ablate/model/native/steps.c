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

/* Y = X W^T (+ b) for a few rows of X, on W as the model holds it: row-major (d_out, d_in), so the
 * weight needs no copy of its own. X (m, d_in), Y (m, d_out), b (d_out) or NULL.
 *
 * Each thread takes a contiguous band of blocks of ROWS rows of W. A block (ROWS x d_in floats: 18 KiB
 * for SmolLM2's d_in of 576) is read from memory once and stays in the core's caches while each row
 * of X runs over it, so m rows cost one pass over W. Within a row of X, the block's ROWS rows are ROWS
 * sequential streams, and their ROWS independent multiply-add chains keep the FMA units busy while
 * W streams in. (An earlier kernel read W repacked 16 columns at a time into one stream per band; on
 * the Xeon of docs/cpu-products.md the row-major kernel was as fast, and it saves the copy.) */
enum { ROWS = 8 };

/* The floats in each vector the kernels were compiled to (vectors.h: 16 on AVX-512, 8 on AVX2): the
 * library's state in a run's results says it */
int vector_floats(void) { return VEC; }

void matvec(const float *w, const float *x, const float *b, float *y, long m, long d_out, long d_in, int threads) {
    long blocks = (d_out + ROWS - 1) / ROWS, body = d_in / VEC * VEC;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long blk = 0; blk < blocks; blk++) {
        long first = blk * ROWS, rows = d_out - first < ROWS ? d_out - first : ROWS;
        const float *wb = w + first * d_in;
        for (long t = 0; t < m; t++) {
            const float *xt = x + t * d_in;
            vec acc[ROWS];
            for (int r = 0; r < ROWS; r++) acc[r] = (vec){0};
            if (rows == ROWS) {
                for (long c = 0; c < body; c += VEC) {
                    vec xv = load(xt + c);
#pragma GCC unroll 8                /* the ROWS sums in registers, not an array in memory */
                    for (int r = 0; r < ROWS; r++) acc[r] += load(wb + r * d_in + c) * xv;
                }
            } else {
                for (int r = 0; r < rows; r++)
                    for (long c = 0; c < body; c += VEC) acc[r] += load(wb + r * d_in + c) * load(xt + c);
            }
            for (int r = 0; r < rows; r++) {
                float s = hsum(acc[r]);
                for (long c = body; c < d_in; c++) s += wb[r * d_in + c] * xt[c];
                y[t * d_out + first + r] = s + (b ? b[first + r] : 0.0f);
            }
        }
    }
}

/* The same on bf16 W, X, b and Y: W is widened to fp32 as it streams in (half the bytes of an fp32 W, the
 * whole point at a few rows), the sums run in fp32 and Y is rounded to bf16 once, as PyTorch's bf16
 * products do.
 *
 * Widening pairs: 2 VEC bf16 of W are VEC 32-bit words, each holding an even-indexed bf16 in its low half
 * and the next one in its high half; their fp32 values are the words shifted left 16 and the words with
 * their low halves cleared (load_bf16_pairs). So X is split once per call the same way, each 2 VEC columns
 * into their VEC even and VEC odd ones, and a block's rows take two multiply-adds per 2 VEC columns of W.
 * `scratch` (m x d_in + d_out + m x d_out floats, the caller's) holds X split, b widened, and Y before
 * rounding. */
void matvec_bf16(const bf16 *w, const bf16 *x16, const bf16 *b16, bf16 *y16, float *scratch, long m, long d_out,
                 long d_in, int threads) {
    float *x = scratch, *b = b16 ? scratch + m * d_in : NULL, *y = scratch + m * d_in + d_out;
    long blocks = (d_out + ROWS - 1) / ROWS, body = d_in / (2 * VEC) * (2 * VEC);
    for (long t = 0; t < m; t++) {
        const bf16 *xt = x16 + t * d_in;
        float *split = x + t * d_in;
        for (long c = 0; c < body; c += 2 * VEC)
            for (int j = 0; j < VEC; j++) {
                split[c + j] = bf16_to_float(xt[c + 2 * j]);
                split[c + VEC + j] = bf16_to_float(xt[c + 2 * j + 1]);
            }
        for (long c = body; c < d_in; c++) split[c] = bf16_to_float(xt[c]);
    }
    for (long i = 0; b && i < d_out; i++) b[i] = bf16_to_float(b16[i]);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long blk = 0; blk < blocks; blk++) {
        long first = blk * ROWS, rows = d_out - first < ROWS ? d_out - first : ROWS;
        const bf16 *wb = w + first * d_in;
        for (long t = 0; t < m; t++) {
            const float *xt = x + t * d_in;
            vec acc[ROWS], even, odd;
            for (int r = 0; r < ROWS; r++) acc[r] = (vec){0};
            for (long c = 0; c < body; c += 2 * VEC) {
                vec xe = load(xt + c), xo = load(xt + c + VEC);
                for (int r = 0; r < rows; r++) {
                    load_bf16_pairs(wb + r * d_in + c, &even, &odd);
                    acc[r] += even * xe + odd * xo;
                }
            }
            for (int r = 0; r < rows; r++) {
                float s = hsum(acc[r]);
                for (long c = body; c < d_in; c++) s += bf16_to_float(wb[r * d_in + c]) * xt[c];
                y[t * d_out + first + r] = s + (b ? b[first + r] : 0.0f);
            }
        }
    }
    for (long i = 0; i < m * d_out; i++) y16[i] = float_to_bf16(y[i]);
}

/* The elementwise kernels below split their rows between `threads` threads once a call holds this many
 * floats; below it one thread does the call, sooner than the others could be woken. */
enum { PARALLEL_FLOATS = 32768 };

/* y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, for each of `rows` rows of n: one pass where torch's
 * composite rms_norm makes six operations (square, mean, add, rsqrt, two multiplies). */
void rms_norm(const float *x, const float *w, float *y, long rows, long n, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * n >= PARALLEL_FLOATS)
    for (long t = 0; t < rows; t++) {
        const float *xt = x + t * n;
        float *yt = y + t * n;
        float scale = 1.0f / sqrtf(dot(xt, xt, n) / (float)n + eps);
        for (long i = 0; i < n; i++) yt[i] = xt[i] * scale * w[i];
    }
}

/* The same for bf16 x and w, as the model's bf16 RMSNorm computes it: x normalised in fp32, rounded to
 * bf16, then times w rounded again (a bf16 product) */
void rms_norm_bf16(const bf16 *x, const bf16 *w, bf16 *y, long rows, long n, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * n >= PARALLEL_FLOATS)
    for (long t = 0; t < rows; t++) {
        const bf16 *xt = x + t * n;
        bf16 *yt = y + t * n;
        float squares = 0.0f;
        for (long i = 0; i < n; i++) squares += bf16_to_float(xt[i]) * bf16_to_float(xt[i]);
        float scale = 1.0f / sqrtf(squares / (float)n + eps);
        for (long i = 0; i < n; i++)
            yt[i] = float_to_bf16(bf16_to_float(w[i]) * bf16_to_float(float_to_bf16(bf16_to_float(xt[i]) * scale)));
    }
}

/* RoPE, rotate-half layout, over x (rows, heads, D) with cos, sin (rows, D), D = 2 half:
 * y[i] = x[i] cos[i] - x[i + half] sin[i],  y[i + half] = x[i + half] cos[i + half] + x[i] sin[i + half] */
void rope(const float *x, const float *cosines, const float *sines, float *y, long rows, long heads, long dim,
          int threads) {
    long half = dim / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * heads * dim >= PARALLEL_FLOATS)
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

/* SwiGLU's activation: y (rows, F) = silu(gate) * up for gate_up (rows, 2F) = [gate | up], silu(g) =
 * g sigmoid(g), VEC columns at a time. expv takes x <= 0, so with e = e^-|g|: sigmoid(g) = 1 / (1 + e)
 * for g >= 0 and e / (1 + e) for g < 0 (the same value, without e^-g overflowing for large -g). */
void silu_mul(const float *gate_up, float *y, long rows, long f, int threads) {
    const vec one = (vec){0} + 1.0f;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * f >= PARALLEL_FLOATS)
    for (long t = 0; t < rows; t++) {
        const float *g = gate_up + t * 2 * f, *u = g + f;
        float *yt = y + t * f;
        long i = 0;
        for (; i + VEC <= f; i += VEC) {
            vec gv = load(g + i);
            ivec neg = gv < 0.0f;
            vec e = expv((vec)(((ivec)gv & neg) | ((ivec)(-gv) & ~neg)));     /* e^-|g| */
            vec sigmoid = (vec)(((ivec)e & neg) | ((ivec)one & ~neg)) / (one + e);
            store(yt + i, gv * sigmoid * load(u + i));
        }
        for (; i < f; i++) yt[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
