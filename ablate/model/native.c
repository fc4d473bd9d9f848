/* ablate's own CPU kernels for one-token steps (a matrix-vector product, RMSNorm, RoPE, SwiGLU's
 * activation) and paged decode attention: built on first use by the machine's C compiler
 * (ablate/model/native.py) with -O3 -march=native -fopenmp, called through ctypes.
 *
 * GCC's generic vectors (vec16: 16 floats) become AVX-512, AVX2 or NEON instructions, whichever the
 * machine has. OpenMP regions run on the thread pool torch already loaded (the same libgomp.so.1),
 * so they never compete with torch's own workers for the cores.
 */
#include <math.h>
#include <string.h>

typedef float vec16 __attribute__((vector_size(64), aligned(4)));   /* loads need not be aligned */

/* matvec's packed layout (native.py: pack_rows): W (d_out, d_in) as blocks of ROWS rows, each block
 * stored 16 columns at a time for its ROWS rows: packed[blk][c][r][0:16] = W[blk*ROWS + r][16c : 16c+16],
 * zero past d_out and d_in. x is loaded once for ROWS rows, and their ROWS independent multiply-add
 * chains keep the FMA units busy while W streams in. */
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

/* acc[0:n] += p * v[0:n] */
static void axpy(float *acc, float p, const float *v, long n) {
    long i = 0;
    for (; i + 16 <= n; i += 16) {
        vec16 a = load16(acc + i) + p * load16(v + i);
        memcpy(acc + i, &a, sizeof a);
    }
    for (; i < n; i++) acc[i] += p * v[i];
}

/* Decode attention over a paged KV cache, reading each block where it lies (nothing is gathered):
 *   out[b, h] = sum_p softmax_p(scale * q[b, h] . K[b, p]) V[b, p]   over the context_lens[b] keys,
 * key p of sequence b at row p % bs of block block_tables[b, p / bs], KV head h / (heads / kv_heads).
 * q, out (B, H, D); k_cache, v_cache (num_blocks, bs, H_kv, D); block_tables (B, max_blocks) int32.
 *
 * One task per sequence: it reads each of its blocks whole (bs x H_kv x D, contiguous) while
 * prefetching the next, where a task per KV head would read every block in strided slices (1.65
 * against 1.33 ms a layer in SmolLM2's decode at batch 64). The softmax is online, one block at a
 * time (FlashAttention's recurrence): with m the running max and l the running sum, a block of
 * scores s_j moves m to m' = max(m, max_j s_j), rescales l and the output by exp(m - m'), and adds
 * exp(s_j - m') and exp(s_j - m') v_j. The caller checks that H * D and bs fit the stack arrays below
 * (native.py: paged_decode_problem). */
void paged_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int *block_tables,
                            const int *context_lens, float *out, long batch, long heads, long kv_heads, long dim,
                            long block_size, long max_blocks, float scale, int threads) {
    long group = heads / kv_heads;
    long key_stride = kv_heads * dim;                 /* floats from one key of a block to the next */
    long block_floats = block_size * key_stride;
#pragma omp parallel for schedule(dynamic) num_threads(threads)
    for (long b = 0; b < batch; b++) {
        long ctx = context_lens[b] < max_blocks * block_size ? context_lens[b] : max_blocks * block_size;
        const int *table = block_tables + b * max_blocks;
        float m[heads], l[heads], acc[heads * dim], s[(block_size + 15) / 16 * 16];   /* s: whole vectors */
        for (long h = 0; h < heads; h++) m[h] = -INFINITY, l[h] = 0.0f;
        memset(acc, 0, sizeof acc);
        memset(s, 0, sizeof s);                            /* lanes past a block's keys: read, unused */
        for (long start = 0; start < ctx; start += block_size) {
            long n = ctx - start < block_size ? ctx - start : block_size;
            const float *kb = k_cache + table[start / block_size] * block_floats;
            const float *vb = v_cache + table[start / block_size] * block_floats;
            if (start + block_size < ctx) {                /* the next block, a cache line at a time */
                const float *next_k = k_cache + table[start / block_size + 1] * block_floats;
                const float *next_v = v_cache + table[start / block_size + 1] * block_floats;
                for (long i = 0; i < block_floats; i += 16) {
                    __builtin_prefetch(next_k + i, 0, 3);
                    __builtin_prefetch(next_v + i, 0, 3);
                }
            }
            for (long h = 0; h < heads; h++) {
                const float *qh = q + (b * heads + h) * dim;
                const float *kh = kb + h / group * dim, *vh = vb + h / group * dim;   /* key j: + j * key_stride */
                float top = m[h];
                for (long j = 0; j < n; j++) {
                    s[j] = scale * dot(qh, kh + j * key_stride, dim);
                    top = s[j] > top ? s[j] : top;
                }
                for (long j = 0; j < n; j += 16) {                /* s_j -> exp(s_j - top), 16 at a time */
                    vec16 e = exp16(load16(s + j) - top);
                    memcpy(s + j, &e, sizeof e);
                }
                /* 0 on the first block (m = -inf), and where it would only make subnormals (exp16) */
                float rescale = m[h] - top < -60.0f ? 0.0f : expf(m[h] - top);
                float *acc_h = acc + h * dim;
                l[h] *= rescale;
                for (long i = 0; i < dim; i++) acc_h[i] *= rescale;
                for (long j = 0; j < n; j++) {
                    l[h] += s[j];
                    axpy(acc_h, s[j], vh + j * key_stride, dim);
                }
                m[h] = top;
            }
        }
        for (long h = 0; h < heads; h++) {
            float *o = out + (b * heads + h) * dim;
            float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;      /* no keys: zeros, as the reference gives */
            for (long i = 0; i < dim; i++) o[i] = acc[h * dim + i] * inv;
        }
    }
}
