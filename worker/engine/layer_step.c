/* A whole decoder layer of a CPU step in one call (fused.py's fused_layer, w8a8 weights in tile kernels): RMSNorm,
 * q/k/v, rotary, paged attention, o, the residual add with the second RMSNorm, gate/up, SiLU-and-multiply, down and
 * the last residual add, each through the same C function fused_layer calls one by one, in the same order, so the
 * result is the same to the bit. Built with layer_ops.c, int8_rows.c and paged_attention.c (native.py); saves the
 * Python between those calls, about a tenth of a millisecond a layer. */
#include <stddef.h>
#include <stdint.h>

void rms_norm_f32(const float *x, int64_t rows, int64_t cols, int64_t stride, const float *weight, float eps,
                  float *out, int threads);
void add_rms_norm_f32(const float *x, int64_t x_stride, const float *y, int64_t y_stride, int64_t rows,
                      int64_t cols, const float *weight, float eps, float *sum, float *out, int threads);
int rotary_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride, int64_t tokens, int64_t heads,
               int64_t kv_heads, int64_t dim, const float *cos, const float *sin, const float *q_norm,
               const float *k_norm, float eps, float *q_out, float *k_out, int threads);
void silu_mul_f32(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride, int64_t rows,
                  int64_t cols, float *out, int threads);
int quantize_matmul_s8(const float *x, int64_t rows, int64_t k, int64_t stride, int64_t n, const int8_t *packed,
                       const int32_t *shift, const float *col_scales, float *out, int kernel, int threads);
int paged_attention_f32(const float *q, int64_t q_tok, int64_t q_head, const float *k, int64_t k_tok,
                        int64_t k_head, const float *v, int64_t v_tok, int64_t v_head, float *k_cache,
                        float *v_cache, int64_t num_blocks, int block_size, int heads, int kv_heads, int head_dim,
                        const int64_t *slots, int num_tokens, const int32_t *row_seq, const int32_t *row_pos,
                        const int32_t *tables, int table_width, int max_context, float scale, float *out,
                        int num_threads);
int paged_attention_f16kv(const float *q, int64_t q_tok, int64_t q_head, const float *k, int64_t k_tok,
                          int64_t k_head, const float *v, int64_t v_tok, int64_t v_head, _Float16 *k_cache,
                          _Float16 *v_cache, int64_t num_blocks, int block_size, int heads, int kv_heads,
                          int head_dim, const int64_t *slots, int num_tokens, const int32_t *row_seq,
                          const int32_t *row_pos, const int32_t *tables, int table_width, int max_context,
                          float scale, float *out, int num_threads);

/* One w8a8 product: int8 codes in tiles (int8_rows.c), per-channel shifts and scales, an optional bias; n outputs
 * of k inputs. kernel: 0 VNNI, 1 AMX, 2 AVX2 (native.INT8_KERNEL_CODES). */
typedef struct {
    const int8_t *tiles;
    const int32_t *shift;
    const float *scales, *bias;
    int64_t k, n;
    int32_t kernel;
} product;

/* A layer's weights and shapes, laid out once (fused.py's LayerWeights mirrors it). */
typedef struct {
    const float *norm1, *norm2, *q_norm, *k_norm;   /* q_norm, k_norm: Qwen3's per-head norms, or NULL */
    float eps1, eps2, qk_eps, scale;
    product qkv, o, gate_up, down;
    int64_t layer, heads, kv_heads, head_dim, hidden, inner;
} layer_weights;

/* What every layer of one step shares (fused.py's StepArgs): the packed tokens' rotary tables, their pool slots,
 * the attention kernel's rows and tables, the pool, and scratch for the layer's intermediates. */
typedef struct {
    int64_t tokens;
    const float *cos, *sin;                 /* [tokens, head_dim] */
    const int64_t *slots;                   /* [tokens] */
    const int32_t *row_seq, *row_pos, *tables;
    int64_t table_width, max_context;
    void *k_pool, *v_pool;                  /* layer 0's [kv_heads, blocks, block_size, head_dim] */
    int64_t layer_stride, num_blocks, block_size;   /* layer_stride in the pool's elements */
    float *scratch;                         /* layer_step_scratch() floats */
    int32_t threads;
    int32_t half_kv;                        /* 1: the pool is float16; 0: float32 */
} step_args;

/* Floats of scratch a step of `tokens` needs for a layer of these shapes. */
int64_t layer_step_scratch(int64_t tokens, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           int64_t inner) {
    const int64_t q = heads * head_dim, kv = kv_heads * head_dim;
    return tokens * (hidden + (q + 2 * kv) + q + kv + q + hidden + hidden + 2 * inner + inner + hidden);
}

static int run_product(const product *p, const float *x, int64_t rows, int64_t stride, float *out, int threads) {
    const int rc = quantize_matmul_s8(x, rows, p->k, stride, p->n, p->tiles, p->shift, p->scales, out, p->kernel,
                                      threads);
    if (rc <= 0)
        return rc;
    if (p->bias != NULL)
        for (int64_t m = 0; m < rows; m++)
            for (int64_t j = 0; j < p->n; j++)
                out[m * p->n + j] += p->bias[j];
    return 1;
}

/* out [tokens, hidden] = the layer applied to x [tokens, hidden] (rows x_stride apart). Returns 0; 1 when a tile
 * kernel is not in this build; 2 when memory for a product's scratch runs out; 3 when the head size is past
 * layer_ops.c's; 4 when the attention kernel refuses the heads. */
int layer_step(const layer_weights *w, const step_args *s, const float *x, int64_t x_stride, float *out) {
    const int64_t t = s->tokens, d = w->head_dim, hidden = w->hidden, inner = w->inner;
    const int64_t nq = w->heads * d, nkv = w->kv_heads * d, nqkv = w->qkv.n;
    const int threads = s->threads;
    float *h = s->scratch, *qkv = h + t * hidden, *q_rot = qkv + t * nqkv, *k_rot = q_rot + t * nq;
    float *attended = k_rot + t * nkv, *a = attended + t * nq, *h2 = a + t * hidden, *gate_up = h2 + t * hidden;
    float *act = gate_up + t * 2 * inner, *down = act + t * inner;
    int rc;

    rms_norm_f32(x, t, hidden, x_stride, w->norm1, w->eps1, h, threads);
    if ((rc = run_product(&w->qkv, h, t, hidden, qkv, threads)) <= 0)
        return rc == 0 ? 1 : 2;
    if (!rotary_f32(qkv, nqkv, qkv + nq, nqkv, t, w->heads, w->kv_heads, d, s->cos, s->sin, w->q_norm, w->k_norm,
                    w->qk_eps, q_rot, k_rot, threads))
        return 3;
    const int64_t at = w->layer * s->layer_stride;
    const int refused = s->half_kv
        ? paged_attention_f16kv(q_rot, nq, d, k_rot, nkv, d, qkv + nq + nkv, nqkv, d, (_Float16 *)s->k_pool + at,
                                (_Float16 *)s->v_pool + at, s->num_blocks, (int)s->block_size, (int)w->heads,
                                (int)w->kv_heads, (int)d, s->slots, (int)t, s->row_seq, s->row_pos, s->tables,
                                (int)s->table_width, (int)s->max_context, w->scale, attended, threads)
        : paged_attention_f32(q_rot, nq, d, k_rot, nkv, d, qkv + nq + nkv, nqkv, d, (float *)s->k_pool + at,
                              (float *)s->v_pool + at, s->num_blocks, (int)s->block_size, (int)w->heads,
                              (int)w->kv_heads, (int)d, s->slots, (int)t, s->row_seq, s->row_pos, s->tables,
                              (int)s->table_width, (int)s->max_context, w->scale, attended, threads);
    if (refused)
        return 4;
    if ((rc = run_product(&w->o, attended, t, nq, a, threads)) <= 0)
        return rc == 0 ? 1 : 2;
    add_rms_norm_f32(x, x_stride, a, hidden, t, hidden, w->norm2, w->eps2, out, h2, threads);
    if ((rc = run_product(&w->gate_up, h2, t, hidden, gate_up, threads)) <= 0)
        return rc == 0 ? 1 : 2;
    silu_mul_f32(gate_up, 2 * inner, gate_up + inner, 2 * inner, t, inner, act, threads);
    if ((rc = run_product(&w->down, act, t, inner, down, threads)) <= 0)
        return rc == 0 ? 1 : 2;
    for (int64_t i = 0; i < t * hidden; i++)
        out[i] += down[i];
    return 0;
}
