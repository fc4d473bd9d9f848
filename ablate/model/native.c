/* ablate's own CPU kernels for small products and norms: built on first use by the machine's C
 * compiler (ablate/model/native.py) with -O3 -march=native -fopenmp, called through ctypes.
 *
 * GCC's generic vectors (vec16: 16 floats) become AVX-512, AVX2 or NEON instructions, whichever the
 * machine has. OpenMP regions run on the thread pool torch already loaded (the same libgomp.so.1),
 * so they never compete with torch's own workers for the cores.
 */
#include <math.h>
#include <string.h>

typedef float vec16 __attribute__((vector_size(64), aligned(4)));   /* loads need not be aligned */

/* Rows of W per pass of matvec: x is loaded once for all of them, and their 8 independent
 * multiply-add chains keep the FMA units busy while W streams in. */
enum { ROWS = 8 };

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

/* y = W x (+ b): W (d_out, d_in) row-major, x (d_in), y (d_out); b may be NULL.
 *
 * A matrix-vector product reads each weight once, so it runs at the speed W streams from memory.
 * Each thread takes a contiguous band of rows and reads it front to back; while it multiplies one
 * block of ROWS rows it prefetches the next block (a prefetch never faults, past the end included),
 * so the memory system is never idle between blocks. */
void matvec(const float *w, const float *x, const float *b, float *y, long d_out, long d_in, int threads) {
    long blocks = (d_out + ROWS - 1) / ROWS;
    long vec_end = d_in - d_in % 16;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long blk = 0; blk < blocks; blk++) {
        long row = blk * ROWS;
        const float *wb = w + row * d_in;
        if (row + ROWS > d_out) {                     /* the last, partial block */
            for (long r = row; r < d_out; r++) y[r] = dot(w + r * d_in, x, d_in) + (b ? b[r] : 0.0f);
            continue;
        }
        vec16 acc[ROWS];
        for (int r = 0; r < ROWS; r++) acc[r] = (vec16){0};
        for (long i = 0; i < vec_end; i += 16) {
            vec16 xv = load16(x + i);
            for (int r = 0; r < ROWS; r++) __builtin_prefetch(wb + (r + ROWS) * d_in + i, 0, 0);
            for (int r = 0; r < ROWS; r++) acc[r] += load16(wb + r * d_in + i) * xv;
        }
        for (int r = 0; r < ROWS; r++) {
            float s = sum16(acc[r]);
            for (long i = vec_end; i < d_in; i++) s += wb[r * d_in + i] * x[i];
            y[row + r] = s + (b ? b[row + r] : 0.0f);
        }
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
