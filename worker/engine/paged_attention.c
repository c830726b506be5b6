/* Paged attention over the KV pool in place (float32, CPU, OpenMP).
 *
 * One call per layer and step: write the step's new K/V rows into their pool slots, then attend
 * every query row over its sequence's context, read block by block through the block table.
 * Decode rows and prefill chunks (with or without a cached prefix) are the same case: query row t
 * belongs to sequence row_seq[t], sits at position row_pos[t] and sees keys 0..row_pos[t].
 *
 * Pool layout per layer: [kv_heads, num_blocks, block_size, head_dim], contiguous.
 * Query heads that share a KV head are handled together, so each K/V row is read once for them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE_ROWS 8      /* query rows of one sequence attended together */
#define MAX_GROUP 16     /* query heads per KV head */

static void write_kv(const float *src, int64_t tok_stride, int64_t head_stride, float *cache,
                     int64_t num_blocks, int block_size, int kv_heads, int head_dim,
                     const int64_t *slots, int num_tokens) {
    #pragma omp for collapse(2) schedule(static)
    for (int t = 0; t < num_tokens; t++) {
        for (int h = 0; h < kv_heads; h++) {
            int64_t slot = slots[t];
            float *dst = cache + ((int64_t)h * num_blocks * block_size + slot) * head_dim;
            memcpy(dst, src + t * tok_stride + h * head_stride, sizeof(float) * head_dim);
        }
    }
}

static void attend_tile(const float *q, int64_t q_tok, int64_t q_head, const float *k_cache,
                        const float *v_cache, int64_t num_blocks, int block_size, int group, int head_dim,
                        const int32_t *table, const int32_t *row_pos, int t0, int rows, int kvh, float scale,
                        float *out, int64_t o_tok, int64_t o_head, float *scores, float *acc) {
    const int n = rows * group;                  /* (row, head) pairs of this tile */
    const int ctx = row_pos[t0 + rows - 1] + 1;  /* keys the last row sees; rows are in position order */
    const float *qp[TILE_ROWS * MAX_GROUP];
    int limit[TILE_ROWS * MAX_GROUP];
    for (int r = 0; r < rows; r++) {
        for (int g = 0; g < group; g++) {
            qp[r * group + g] = q + (int64_t)(t0 + r) * q_tok + (int64_t)(kvh * group + g) * q_head;
            limit[r * group + g] = row_pos[t0 + r] + 1;
        }
    }
    const int64_t head_base = (int64_t)kvh * num_blocks * block_size;
    /* Scores: one pass over the keys, each key row read once for every (row, head). */
    for (int j = 0; j < ctx; j++) {
        const float *kj = k_cache + (head_base + (int64_t)table[j / block_size] * block_size
                                     + j % block_size) * head_dim;
        for (int i = 0; i < n; i++) {
            if (j >= limit[i]) continue;
            const float *qi = qp[i];
            float s = 0.f;
            #pragma omp simd reduction(+:s)
            for (int d = 0; d < head_dim; d++) s += qi[d] * kj[d];
            scores[(int64_t)i * ctx + j] = s * scale;
        }
    }
    float inv_sum[TILE_ROWS * MAX_GROUP];
    for (int i = 0; i < n; i++) {
        float *s = scores + (int64_t)i * ctx;
        const int m = limit[i];
        float mx = s[0];
        for (int j = 1; j < m; j++) mx = s[j] > mx ? s[j] : mx;
        float sum = 0.f;
        #pragma omp simd reduction(+:sum)
        for (int j = 0; j < m; j++) {
            float e = expf(s[j] - mx);
            s[j] = e;
            sum += e;
        }
        inv_sum[i] = 1.f / sum;
    }
    memset(acc, 0, sizeof(float) * n * head_dim);
    for (int j = 0; j < ctx; j++) {
        const float *vj = v_cache + (head_base + (int64_t)table[j / block_size] * block_size
                                     + j % block_size) * head_dim;
        for (int i = 0; i < n; i++) {
            if (j >= limit[i]) continue;
            const float p = scores[(int64_t)i * ctx + j];
            float *a = acc + (int64_t)i * head_dim;
            #pragma omp simd
            for (int d = 0; d < head_dim; d++) a[d] += p * vj[d];
        }
    }
    for (int r = 0; r < rows; r++) {
        for (int g = 0; g < group; g++) {
            const int i = r * group + g;
            float *o = out + (int64_t)(t0 + r) * o_tok + (int64_t)(kvh * group + g) * o_head;
            for (int d = 0; d < head_dim; d++) o[d] = acc[(int64_t)i * head_dim + d] * inv_sum[i];
        }
    }
}

/* Returns 0, or -1 when the shapes are outside what this kernel handles. */
int paged_attention_f32(const float *q, int64_t q_tok, int64_t q_head,
                        const float *k, int64_t k_tok, int64_t k_head,
                        const float *v, int64_t v_tok, int64_t v_head,
                        float *k_cache, float *v_cache, int64_t num_blocks, int block_size,
                        int heads, int kv_heads, int head_dim,
                        const int64_t *slots, int num_tokens,
                        const int32_t *row_seq, const int32_t *row_pos,
                        const int32_t *tables, int table_width, int max_context,
                        float scale, float *out, int num_threads) {
    const int group = heads / kv_heads;
    if (group > MAX_GROUP || group * kv_heads != heads) return -1;
    /* Tiles: runs of up to TILE_ROWS consecutive rows of one sequence. */
    int *tile_start = malloc(sizeof(int) * (num_tokens + 1));
    int num_tiles = 0;
    for (int t = 0; t < num_tokens; t++) {
        if (t == 0 || row_seq[t] != row_seq[t - 1] || t - tile_start[num_tiles - 1] == TILE_ROWS)
            tile_start[num_tiles++] = t;
    }
    tile_start[num_tiles] = num_tokens;
    const int64_t o_tok = (int64_t)heads * head_dim, o_head = head_dim;

    #pragma omp parallel num_threads(num_threads)
    {
        write_kv(k, k_tok, k_head, k_cache, num_blocks, block_size, kv_heads, head_dim, slots, num_tokens);
        write_kv(v, v_tok, v_head, v_cache, num_blocks, block_size, kv_heads, head_dim, slots, num_tokens);
        /* The implicit barrier of the loops above: every new row is in the pool before any is read. */
        float *scores = malloc(sizeof(float) * TILE_ROWS * group * (int64_t)max_context);
        float *acc = malloc(sizeof(float) * TILE_ROWS * group * (int64_t)head_dim);
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int tile = 0; tile < num_tiles; tile++) {
            for (int kvh = 0; kvh < kv_heads; kvh++) {
                const int t0 = tile_start[tile];
                const int rows = tile_start[tile + 1] - t0;
                const int32_t *table = tables + (int64_t)row_seq[t0] * table_width;
                attend_tile(q, q_tok, q_head, k_cache, v_cache, num_blocks, block_size, group, head_dim,
                            table, row_pos, t0, rows, kvh, scale, out, o_tok, o_head, scores, acc);
            }
        }
        free(scores);
        free(acc);
    }
    free(tile_start);
    return 0;
}
