/* ablate's paged decode attention on the CPU: one query per sequence over its KV blocks, read where
 * they lie. Built with the other kernels into one library (ablate/model/native/build.py), called
 * through ctypes (ablate/model/native/attention.py); its parallel loop runs on torch's OpenMP pool.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "vectors.h"

/* The query heads one pass over a block serves together: they share the KV head whose keys and values
 * it reads once (grouped-query attention). A larger group is served in slices of this many. */
enum { SLICE = 8, MAX_BLOCK = 256 };

/* One block's n keys of one KV head for a slice of g <= SLICE query heads (q: g x dim, this slice's
 * queries; m, l, acc: their running max, sum and output, acc g x dim), FlashAttention's online
 * recurrence: with m the running max and l the running sum, the block's scores s_j move m to
 * m' = max(m, max_j s_j), rescale l and the output by exp(m - m'), and add exp(s_j - m') and
 * exp(s_j - m') v_j. kb, vb: the block's key and value of this KV head for key 0; key j at
 * + j * key_stride. Each key and value is read once for the slice's g heads, whose g multiply-add
 * chains are independent. */
static inline __attribute__((always_inline)) void
attend_block_of(const float *q, const float *kb, const float *vb, long n, long key_stride, long dim, const long g,
                float scale, float *m, float *l, float *acc) {
    long body = dim / VEC * VEC;
    float s[SLICE][MAX_BLOCK + VEC];                      /* scores, then weights; whole vectors read */
    for (long j = 0; j < n; j++) {                        /* s[i][j] = scale q_i . k_j */
        const float *kj = kb + j * key_stride;
        vec part[SLICE];
        for (long i = 0; i < g; i++) part[i] = (vec){0};
        for (long c = 0; c < body; c += VEC) {
            vec kv = load(kj + c);
            for (long i = 0; i < g; i++) part[i] += load(q + i * dim + c) * kv;
        }
        for (long i = 0; i < g; i++) {
            float t = hsum(part[i]);
            for (long c = body; c < dim; c++) t += q[i * dim + c] * kj[c];
            s[i][j] = scale * t;
        }
    }
    for (long i = 0; i < g; i++) {                        /* s -> exp(s - m'), l and the output rescaled */
        float top = m[i], sum = 0.0f;
        for (long j = 0; j < n; j++) top = s[i][j] > top ? s[i][j] : top;
        for (long j = n; j < (n + VEC - 1) / VEC * VEC; j++) s[i][j] = -INFINITY;   /* lanes past the keys: weight 0 */
        for (long j = 0; j < n; j += VEC) {
            vec e = expv(load(s[i] + j) - top);
            store(s[i] + j, e);
            sum += hsum(e);
        }
        /* 0 on the first block (m = -inf), and where it would only make subnormals (expv) */
        float rescale = m[i] - top < -60.0f ? 0.0f : expf(m[i] - top);
        l[i] = l[i] * rescale + sum;
        for (long c = 0; c < dim; c++) acc[i * dim + c] *= rescale;
        m[i] = top;
    }
    for (long c = 0; c < body; c += VEC) {                /* acc_i += sum_j w_ij v_j, VEC columns at a time */
        vec a[SLICE];
        for (long i = 0; i < g; i++) a[i] = load(acc + i * dim + c);
        for (long j = 0; j < n; j++) {
            vec vj = load(vb + j * key_stride + c);
            for (long i = 0; i < g; i++) a[i] += s[i][j] * vj;
        }
        for (long i = 0; i < g; i++) store(acc + i * dim + c, a[i]);
    }
    for (long c = body; c < dim; c++)
        for (long i = 0; i < g; i++)
            for (long j = 0; j < n; j++) acc[i * dim + c] += s[i][j] * vb[j * key_stride + c];
}

/* attend_block_of compiled once per slice width: with g a constant its loops over the heads unroll and
 * the g running sums stay in registers, where a runtime g kept them in memory, one store and reload
 * per multiply-add. */
static void attend_block(const float *q, const float *kb, const float *vb, long n, long key_stride, long dim, long g,
                         float scale, float *m, float *l, float *acc) {
    switch (g) {
#define WIDTH(G) case G: attend_block_of(q, kb, vb, n, key_stride, dim, G, scale, m, l, acc); break;
    WIDTH(1) WIDTH(2) WIDTH(3) WIDTH(4) WIDTH(5) WIDTH(6) WIDTH(7) WIDTH(8)
#undef WIDTH
    }
}

/* Decode attention over a paged KV cache, reading each block where it lies (nothing is gathered):
 *   out[b, h] = sum_p softmax_p(scale * q[b, h] . K[b, p]) V[b, p]   over the context_lens[b] keys,
 * key p of sequence b at row p % bs of block block_tables[b, p / bs], KV head h / (heads / kv_heads).
 * q, out (B, H, D); k_cache, v_cache (num_blocks, bs, H_kv, D); block_tables (B, max_blocks) int32.
 *
 * A task is a sequence, or one KV head of a sequence when there are too few sequences to keep every
 * thread busy (batch < 4 x threads), or a part of one KV head's blocks when even those are fewer than
 * 2 x threads (a batch-1 step: 3 KV heads on 2 threads would leave one thread idle a third of the time).
 * A task of whole sequences reads each block whole (bs x H_kv x D, contiguous) while prefetching the
 * next, where a task per KV head reads every block in strided slices; per KV head, each key and value is
 * read once for all the query heads that share it (attend_block). The parts of a KV head's blocks are
 * merged as FlashDecoding does: with M = max_c m_c, out = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c.
 * The caller checks that H * D and bs fit the stack arrays (attention.py: paged_decode_problem). */
void paged_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int *block_tables,
                            const int *context_lens, float *out, long batch, long heads, long kv_heads, long dim,
                            long block_size, long max_blocks, float scale, int threads) {
    long group = heads / kv_heads;
    long key_stride = kv_heads * dim;                 /* floats from one key of a block to the next */
    long block_floats = block_size * key_stride;
    long kv_per_task = batch >= 4L * threads ? kv_heads : 1;
    long tasks_per_seq = kv_heads / kv_per_task;
    /* parts of a KV head's blocks: enough tasks for 2 per thread */
    long parts = batch * kv_heads >= 2L * threads ? 1 : (2L * threads + batch * kv_heads - 1) / (batch * kv_heads);
    long part_floats = group * (dim + 2);             /* a part's m, l and acc for its query heads */
    float *partial = parts > 1 ? malloc(sizeof(float) * batch * kv_heads * parts * part_floats) : NULL;
    if (parts > 1 && partial == NULL) parts = 1;     /* no memory for the parts: whole KV heads */
#pragma omp parallel for schedule(dynamic) num_threads(threads)
    for (long task = 0; task < batch * tasks_per_seq * parts; task++) {
        long part = task % parts, head_task = task / parts;
        long b = head_task / tasks_per_seq, first_kv = head_task % tasks_per_seq * kv_per_task;
        long first_head = first_kv * group, task_heads = kv_per_task * group;
        long ctx = context_lens[b] < max_blocks * block_size ? context_lens[b] : max_blocks * block_size;
        long blocks = (ctx + block_size - 1) / block_size;
        long first_block = blocks * part / parts, end_block = blocks * (part + 1) / parts;
        const int *table = block_tables + b * max_blocks;
        const float *qb = q + (b * heads + first_head) * dim;
        float m[task_heads], l[task_heads], acc[task_heads * dim];
        for (long h = 0; h < task_heads; h++) m[h] = -INFINITY, l[h] = 0.0f;
        memset(acc, 0, sizeof acc);
        for (long blk = first_block; blk < end_block; blk++) {
            long start = blk * block_size, n = ctx - start < block_size ? ctx - start : block_size;
            const float *kb = k_cache + table[blk] * block_floats + first_kv * dim;
            const float *vb = v_cache + table[blk] * block_floats + first_kv * dim;
            if (blk + 1 < end_block) {                     /* the next block's rows of these KV heads */
                long next = table[blk + 1] * block_floats + first_kv * dim;
                for (long j = 0; j < block_size; j++)
                    for (long i = 0; i < kv_per_task * dim; i += 16) {      /* a 64-byte line */
                        __builtin_prefetch(k_cache + next + j * key_stride + i, 0, 3);
                        __builtin_prefetch(v_cache + next + j * key_stride + i, 0, 3);
                    }
            }
            for (long kv = 0; kv < kv_per_task; kv++)
                for (long h = kv * group; h < (kv + 1) * group; h += SLICE) {
                    long g = (kv + 1) * group - h < SLICE ? (kv + 1) * group - h : SLICE;
                    attend_block(qb + h * dim, kb + kv * dim, vb + kv * dim, n, key_stride, dim, g, scale,
                                 m + h, l + h, acc + h * dim);
                }
        }
        if (parts > 1) {                                   /* this part's m, l, acc, merged below */
            float *mine = partial + task * part_floats;
            memcpy(mine, m, sizeof m);
            memcpy(mine + task_heads, l, sizeof l);
            memcpy(mine + 2 * task_heads, acc, sizeof acc);
            continue;
        }
        for (long h = 0; h < task_heads; h++) {
            float *o = out + (b * heads + first_head + h) * dim;
            float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;      /* no keys: zeros, as the reference gives */
            for (long i = 0; i < dim; i++) o[i] = acc[h * dim + i] * inv;
        }
    }
    if (parts == 1)
        return;
    for (long head_task = 0; head_task < batch * kv_heads; head_task++) {   /* parts > 1: one KV head a task */
        const float *first = partial + head_task * parts * part_floats;
        long b = head_task / kv_heads, first_head = head_task % kv_heads * group;
        for (long h = 0; h < group; h++) {
            float top = -INFINITY, sum = 0.0f, *o = out + (b * heads + first_head + h) * dim;
            for (long c = 0; c < parts; c++) top = first[c * part_floats + h] > top ? first[c * part_floats + h] : top;
            memset(o, 0, sizeof(float) * dim);
            for (long c = 0; c < parts; c++) {
                const float *mine = first + c * part_floats;
                if (mine[group + h] == 0.0f) continue;     /* a part without keys */
                float w = expf(mine[h] - top);
                sum += w * mine[group + h];
                for (long i = 0; i < dim; i++) o[i] += w * mine[2 * group + h * dim + i];
            }
            float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            for (long i = 0; i < dim; i++) o[i] *= inv;
        }
    }
    free(partial);
}
