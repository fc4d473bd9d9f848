/* A decoder layer's dense arithmetic for a step of a few rows, in two calls around the cache and the
 * attention, or, for a decode step on a paged cache that the native paged kernel reads, the whole layer
 * in one call: the same kernels of steps.c and paged_attention.c the layer's eager path and its slots call
 * one by one from Python, run in the same order on the same inputs, so the results are the same bits.
 * Built with the other kernels into one library (ablate/model/native/build.py), called through ctypes
 * (ablate/model/native/layers.py).
 *
 * Why: between two of a decode step's products the eager path makes some twenty torch and ctypes calls;
 * each dispatch reads interpreter and allocator state that the weights' stream has just evicted from the
 * caches, so on a machine with a small L3 a one-row layer spent more time between its products than in
 * them (docs/cpu-products.md). Here those calls are C, between the same products.
 */
#include <string.h>

/* steps.c */
void matvec(const float *w, const float *x, const float *b, float *y, long m, long d_out, long d_in, int threads);
void rms_norm(const float *x, const float *w, float *y, long rows, long n, float eps, int threads);
void rope(const float *x, const float *cosines, const float *sines, float *y, long rows, long heads, long dim,
          int threads);
void silu_mul(const float *gate_up, float *y, long rows, long f, int threads);

/* The layer's half before the cache: qkv = rms_norm(x) W_qkv^T (+ b), then q and k rotated.
 * x (m, d); w_qkv ((heads + 2 kv_heads) dim, d), b_qkv the same rows or NULL; cos, sin (m, dim);
 * q (m, heads, dim), k and v (m, kv_heads, dim); scratch m (d + (heads + 2 kv_heads) dim) floats. */
void layer_qkv(const float *x, const float *norm_w, float eps, const float *w_qkv, const float *b_qkv,
               const float *cosines, const float *sines, float *q, float *k, float *v, float *scratch, long m,
               long d, long heads, long kv_heads, long dim, int threads) {
    long width = (heads + 2 * kv_heads) * dim;
    float *normed = scratch, *qkv = scratch + m * d;
    rms_norm(x, norm_w, normed, m, d, eps, threads);
    matvec(w_qkv, normed, b_qkv, qkv, m, width, d, threads);
    for (long t = 0; t < m; t++) {                  /* row t: [q heads | k heads | v heads] */
        const float *row = qkv + t * width;
        rope(row, cosines + t * dim, sines + t * dim, q + t * heads * dim, 1, heads, dim, threads);
        rope(row + heads * dim, cosines + t * dim, sines + t * dim, k + t * kv_heads * dim, 1, kv_heads, dim,
             threads);
        memcpy(v + t * kv_heads * dim, row + (heads + kv_heads) * dim, kv_heads * dim * sizeof(float));
    }
}

/* The layer's half after the attention: h = x + attn W_o^T, then y = h + down(silu(gate) * up) of
 * rms_norm(h). x, y (m, d); attn (m, q_size); w_o (d, q_size); w_gate_up (2 f, d); w_down (d, f);
 * scratch m (2 d + 3 f) floats. y may be x. */
void layer_out_mlp(const float *x, const float *attn, const float *w_o, const float *norm_w, float eps,
                   const float *w_gate_up, const float *w_down, float *y, float *scratch, long m, long d,
                   long q_size, long f, int threads) {
    float *h = scratch, *gate_up = h + m * d, *act = gate_up + m * 2 * f;
    float *normed = act + m * f, *down = normed;        /* normed is dead once gate_up is made */
    matvec(w_o, attn, NULL, h, m, d, q_size, threads);
    for (long i = 0; i < m * d; i++) h[i] += x[i];
    rms_norm(h, norm_w, normed, m, d, eps, threads);
    matvec(w_gate_up, normed, NULL, gate_up, m, 2 * f, d, threads);
    silu_mul(gate_up, act, m, f, threads);
    matvec(w_down, act, NULL, down, m, d, f, threads);
    for (long i = 0; i < m * d; i++) y[i] = h[i] + down[i];
}

/* paged_attention.c */
void paged_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int *block_tables,
                            const int *context_lens, float *out, long batch, long heads, long kv_heads, long dim,
                            long block_size, long max_blocks, float scale, int threads);

/* A whole layer of a decode step (m sequences, a row each) whose cache is paged and whose attention is
 * paged_decode_attention: layer_qkv; k and v copied to rows slots[t] of the layer's pools (the cache's
 * write; k_pool, v_pool (num_blocks * block_size, kv_heads, dim)); the attention over the pools through
 * block_tables (m, max_blocks) and context_lens (m); layer_out_mlp. What the two calls and the slots
 * between them do, in their order, so the same bits. scratch: m ((heads + 2 kv_heads) dim + heads dim)
 * floats for q, k, v and the attention's output, then what the two calls take. y may be x. */
void layer_paged_decode(const float *x, const float *norm_w, float eps, const float *w_qkv, const float *b_qkv,
                        const float *cosines, const float *sines, float *k_pool, float *v_pool, const long *slots,
                        const int *block_tables, const int *context_lens, long block_size, long max_blocks,
                        float scale, const float *w_o, const float *mlp_norm_w, float mlp_eps,
                        const float *w_gate_up, const float *w_down, float *y, float *scratch, long m, long d,
                        long heads, long kv_heads, long dim, long f, int threads) {
    long row = kv_heads * dim;                       /* a token's keys (or values), all KV heads */
    float *q = scratch, *k = q + m * heads * dim, *v = k + m * row, *attn = v + m * row;
    float *rest = attn + m * heads * dim;
    layer_qkv(x, norm_w, eps, w_qkv, b_qkv, cosines, sines, q, k, v, rest, m, d, heads, kv_heads, dim, threads);
    for (long t = 0; t < m; t++) {
        memcpy(k_pool + slots[t] * row, k + t * row, row * sizeof(float));
        memcpy(v_pool + slots[t] * row, v + t * row, row * sizeof(float));
    }
    paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, attn, m, heads, kv_heads, dim, block_size,
                           max_blocks, scale, threads);
    layer_out_mlp(x, attn, w_o, mlp_norm_w, mlp_eps, w_gate_up, w_down, y, rest, m, d, heads * dim, f, threads);
}
