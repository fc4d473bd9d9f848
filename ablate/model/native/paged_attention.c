/* ablate's paged decode attention on the CPU: one query per sequence over its KV blocks, read where
 * they lie. Built with the other kernels into one library (ablate/model/native/build.py), called
 * through ctypes (ablate/model/native/attention.py); its parallel loop runs on torch's OpenMP pool.
 */
#include <math.h>
#include <string.h>

#include "vectors.h"

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
 * (attention.py: paged_decode_problem). */
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
