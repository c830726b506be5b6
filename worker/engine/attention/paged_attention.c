/* Paged attention over the KV pool in place (float32 queries, a float32 or float16 pool; CPU, OpenMP).
 *
 * One call per layer and step: write the step's new K/V rows into their pool slots, then attend
 * every query row over its sequence's context, read block by block through the block table.
 * Decode rows and prefill chunks (with or without a cached prefix) are the same case: query row t
 * belongs to sequence row_seq[t], sits at position row_pos[t] and sees keys 0..row_pos[t].
 *
 * Pool layout per layer: [kv_heads, num_blocks, block_size, head_dim], contiguous.
 * Query heads that share a KV head are handled together, so each K/V row is read once for them.
 * Three paths, chosen when the library is built: AVX-512 (head sizes a multiple of 16), AVX2 with FMA and F16C (a
 * multiple of 8, at most 256), and the portable loops for the rest (or everything, with -DPAGED_PORTABLE).
 * A float16 pool (paged_attention_f16kv) holds each new K/V row rounded to nearest, as torch's .half() does, and is
 * read back to float32; all arithmetic is float32 either way, so its results are the float32 kernel's on those rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && !defined(PAGED_PORTABLE)   /* PAGED_PORTABLE: the portable path only */
#define PAGED_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(PAGED_PORTABLE)
#define PAGED_AVX2 1
#include <immintrin.h>
#endif

#define TILE_ROWS 8      /* query rows of one sequence attended together */
#define MAX_GROUP 16     /* query heads per KV head */
#define LANES 16         /* floats in an AVX-512 register */
#define PV_QUERIES 4     /* queries whose outputs the AVX-512 path accumulates in registers together */
#define LANES8 8         /* floats in an AVX2 register */
#define MAX_CHUNKS8 32   /* the AVX2 path's largest head size, in runs of 8 floats: 256 */
#define KEY_BLOCK 128    /* keys the AVX2 path reads from memory once for every query of a tile */
#define KEY_FLOATS 8192  /* keys' or values' floats the AVX-512 path reads from memory once for every query of a tile */
#define CONVERT_QUERIES 4   /* the AVX-512 path converts a float16 block once for a tile of more queries than this */

/* exp(x) for x <= 0 in the vector paths (exp16, exp8): Cephes' single-precision polynomial on r = x - n ln 2
 * (ln 2 in two parts), scaled by 2^n; 0 below EXP_MIN. */
#define EXP_MIN (-87.33654f)
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO (-2.12194440e-4f)
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

typedef _Float16 half;   /* the float16 pool's element */

/* A pool row of head_dim elements from element i on, as float32: in place, or converted into `buffer`. */
static inline const float *kv_row(const void *pool, int64_t i, int head_dim, int half_kv, float *buffer) {
    if (!half_kv) return (const float *)pool + i;
    for (int d = 0; d < head_dim; d++) buffer[d] = (float)((const half *)pool)[i + d];
    return buffer;
}

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

/* write_kv into a float16 pool, each value rounded to nearest. A function of its own, as the AVX-512 path's loads
 * of each type are written out apart: either type's test in the other's loop measured float32 calls 4-8% slower at
 * 128 tokens. */
static void write_kv_half(const float *src, int64_t tok_stride, int64_t head_stride, half *cache,
                          int64_t num_blocks, int block_size, int kv_heads, int head_dim,
                          const int64_t *slots, int num_tokens) {
    #pragma omp for collapse(2) schedule(static)
    for (int t = 0; t < num_tokens; t++) {
        for (int h = 0; h < kv_heads; h++) {
            half *dst = cache + ((int64_t)h * num_blocks * block_size + slots[t]) * head_dim;
            const float *row = src + t * tok_stride + h * head_stride;
            for (int d = 0; d < head_dim; d++) dst[d] = (half)row[d];
        }
    }
}

/* A tile's outputs: each (row, head) pair's accumulated values (acc, n = rows * group of them, head_dim apart) times
 * its softmax's 1 / sum, into the output rows. */
static inline __attribute__((always_inline)) void write_outputs(const float *acc, const float *inv_sum, int n,
                                                                int group, int head_dim, int t0, int kvh, float *out,
                                                                int64_t o_tok, int64_t o_head) {
    for (int i = 0; i < n; i++) {
        float *o = out + (int64_t)(t0 + i / group) * o_tok + (int64_t)(kvh * group + i % group) * o_head;
        const float *a = acc + (int64_t)i * head_dim;
        #pragma omp simd
        for (int d = 0; d < head_dim; d++) o[d] = a[d] * inv_sum[i];
    }
}

static inline __attribute__((always_inline)) void attend_tile(
        const float *q, int64_t q_tok, int64_t q_head, const void *k_cache, const void *v_cache, int half_kv,
        int64_t num_blocks, int block_size, int group, int head_dim, const int32_t *table, const int32_t *row_pos,
        int t0, int rows, int kvh, float scale, float *out, int64_t o_tok, int64_t o_head, float *scores,
        float *acc) {
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
    float row[head_dim];   /* a float16 pool's key or value row, converted once for every (row, head) */
    /* Scores: one pass over the keys, each key row read once for every (row, head). */
    for (int j = 0; j < ctx; j++) {
        const float *kj = kv_row(k_cache, (head_base + (int64_t)table[j / block_size] * block_size
                                           + j % block_size) * head_dim, head_dim, half_kv, row);
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
        const float *vj = kv_row(v_cache, (head_base + (int64_t)table[j / block_size] * block_size
                                           + j % block_size) * head_dim, head_dim, half_kv, row);
        for (int i = 0; i < n; i++) {
            if (j >= limit[i]) continue;
            const float p = scores[(int64_t)i * ctx + j];
            float *a = acc + (int64_t)i * head_dim;
            #pragma omp simd
            for (int d = 0; d < head_dim; d++) a[d] += p * vj[d];
        }
    }
    write_outputs(acc, inv_sum, n, group, head_dim, t0, kvh, out, o_tok, o_head);
}

#ifdef PAGED_AVX512
/* Sixteen dot products at once: lane t of the result is the sum of a[t]'s lanes, by a fixed tree of shuffles
 * (so every score's arithmetic is the same whatever the tile around it). */
static inline __m512 sum16(__m512 a[LANES]) {
    __m512 b[8], c[4], d[2];
    for (int j = 0; j < 8; j++)
        b[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
    for (int j = 0; j < 4; j++)
        c[j] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * j], b[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * j], b[2 * j + 1], 0xEE));
    for (int j = 0; j < 2; j++)
        d[j] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

/* Sixteen float16 values from p on, as floats. */
static inline __m512 load_half16(const half *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* exp(x) for x <= 0 (scores less their maximum): Cephes' single-precision polynomial on x - n ln 2, scaled by
 * 2^n; within 2 ulp of expf, and 0 below -87. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

/* Sixteen floats of a key or value row (float32, or float16 when `half_rows`), chunk c of it. */
static inline __attribute__((always_inline)) __m512 row16(const void *row, int c, const int half_rows) {
    return half_rows ? load_half16((const half *)row + c * LANES) : _mm512_loadu_ps((const float *)row + c * LANES);
}

/* A block of `count` pool rows (at pool + at[0..count-1]) for the AVX-512 path: where they are in the pool, or a
 * float16 pool's converted once into `buffer` (count * chunks * LANES floats) when `convert`. */
static inline __attribute__((always_inline)) void block_rows(const int chunks, const void *pool, const int half_kv,
                                                             const int convert, const int64_t *at, int count,
                                                             float *buffer, const void **rows) {
    for (int j = 0; j < count; j++) {
        if (half_kv && convert) {
            float *row = buffer + (int64_t)j * chunks * LANES;
            for (int c = 0; c < chunks; c++)
                _mm512_storeu_ps(row + c * LANES, load_half16((const half *)pool + at[j] + c * LANES));
            rows[j] = row;
        } else {
            rows[j] = half_kv ? (const void *)((const half *)pool + at[j])
                              : (const void *)((const float *)pool + at[j]);
        }
    }
}

/* One query's scores (into s) over the block's runs of keys from k0 on (rows: the block's, `count` of them). */
static inline __attribute__((always_inline)) void scores_block(const int chunks, const void **rows, const int half_rows,
                                                               const float *qi, int limit, int k0, int count,
                                                               __m512 vscale, float *s) {
    const int runs = (limit + LANES - 1) / LANES, block_end = (k0 + count) / LANES;
    if (k0 / LANES >= runs) return;
    __m512 qv[LANES];
    for (int c = 0; c < chunks; c++) qv[c] = _mm512_loadu_ps(qi + c * LANES);
    for (int b = k0 / LANES; b < (runs < block_end ? runs : block_end); b++) {
        __m512 a[LANES];
        for (int t = 0; t < LANES; t++) {
            const void *kt = rows[b * LANES - k0 + t];
            __m512 acc = _mm512_mul_ps(qv[0], row16(kt, 0, half_rows));
            for (int c = 1; c < chunks; c++) acc = _mm512_fmadd_ps(qv[c], row16(kt, c, half_rows), acc);
            a[t] = acc;
        }
        _mm512_storeu_ps(s + b * LANES, _mm512_mul_ps(sum16(a), vscale));
    }
}

/* Outputs of queries i0..i0+nq-1 (nq <= together) over the block's keys k0..j1-1, carried in acc_rows from block to
 * block. */
static inline __attribute__((always_inline)) void values_block(
        const int chunks, const int together, const void **rows, const int half_rows, const float *scores,
        int stride, int i0, int nq, int k0, int j1, int head_dim, float *acc_rows) {
    __m512 acc[PV_QUERIES][LANES];
    for (int g = 0; g < together; g++)
        for (int c = 0; c < chunks; c++)
            acc[g][c] = k0 == 0 || g >= nq ? _mm512_setzero_ps()
                                           : _mm512_loadu_ps(acc_rows + (int64_t)(i0 + g) * head_dim + c * LANES);
    const float *sc[PV_QUERIES];
    for (int g = 0; g < together; g++) sc[g] = scores + (int64_t)(i0 + (g < nq ? g : 0)) * stride;
    for (int j = k0; j < j1; j++) {
        const void *vj = rows[j - k0];
        __m512 p[PV_QUERIES];
        for (int g = 0; g < together; g++) p[g] = _mm512_set1_ps(sc[g][j]);
        for (int c = 0; c < chunks; c++) {
            const __m512 vc = row16(vj, c, half_rows);
            for (int g = 0; g < together; g++)   /* a fixed bound keeps acc in registers; the tail's lanes idle */
                if (g < nq) acc[g][c] = _mm512_fmadd_ps(p[g], vc, acc[g][c]);
        }
    }
    for (int g = 0; g < nq; g++)
        for (int c = 0; c < chunks; c++)
            _mm512_storeu_ps(acc_rows + (int64_t)(i0 + g) * head_dim + c * LANES, acc[g][c]);
}

/* attend_tile for a head size that is a multiple of 16 (at most 256): each run of 16 keys gets its scores from one
 * register tree (sum16), and each query's output stays in registers over a block of keys, PV_QUERIES queries at a
 * time, so a value row is loaded once for them. Keys and values go in blocks of KEY_FLOATS floats, read from memory
 * once for every query of the tile (block_rows); outputs carry from block to block in `acc_rows`. A query's scores
 * and output are computed the same way whichever rows share its tile, as in the portable path. */
static inline __attribute__((always_inline)) void attend_tile_avx512(
        const int chunks, const float *q, int64_t q_tok, int64_t q_head, const void *k_cache, const void *v_cache,
        const int half_kv, int64_t num_blocks, int block_size, int group, int head_dim, const int32_t *table,
        const int32_t *row_pos, int t0, int rows, int kvh, float scale, float *out, int64_t o_tok, int64_t o_head,
        float *scores, float *acc_rows, int64_t *row_at, float *buffer) {
    const int n = rows * group;
    const int ctx = row_pos[t0 + rows - 1] + 1;
    const int stride = (ctx + LANES - 1) / LANES * LANES;   /* a query's scores, padded to whole runs of keys */
    /* Keys a block: whole runs of LANES, as many as fill KEY_FLOATS. */
    const int per_block = KEY_FLOATS / head_dim / LANES * LANES > LANES ? KEY_FLOATS / head_dim / LANES * LANES : LANES;
    /* Queries accumulated together: as many as keep their outputs in registers. */
    const int together = chunks <= 4 ? PV_QUERIES : (chunks <= 8 ? 2 : 1);
    const int64_t head_base = (int64_t)kvh * num_blocks * block_size;
    /* Each key's row in the pool; the last run's keys past the context read key 0's row, and are masked. */
    for (int j = 0; j < stride; j++) {
        const int key = j < ctx ? j : 0;
        row_at[j] = (head_base + (int64_t)table[key / block_size] * block_size + key % block_size) * head_dim;
    }
    int limit[TILE_ROWS * MAX_GROUP];
    const float *qp[TILE_ROWS * MAX_GROUP];
    for (int r = 0; r < rows; r++) {
        for (int g = 0; g < group; g++) {
            qp[r * group + g] = q + (int64_t)(t0 + r) * q_tok + (int64_t)(kvh * group + g) * q_head;
            limit[r * group + g] = row_pos[t0 + r] + 1;
        }
    }
    const void *kv[KEY_FLOATS / LANES];   /* a block's rows */
    /* A float16 pool's block converted once for every query of the tile when there are more than CONVERT_QUERIES
     * of them; fewer convert each row as they read it. */
    const int convert = half_kv && n > CONVERT_QUERIES, half_rows = half_kv && !convert;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int k0 = 0; k0 < stride; k0 += per_block) {
        const int count = stride - k0 < per_block ? stride - k0 : per_block;
        block_rows(chunks, k_cache, half_kv, convert, row_at + k0, count, buffer, kv);
        for (int i = 0; i < n; i++) {
            float *s = scores + (int64_t)i * stride;
            if (half_rows) scores_block(chunks, kv, 1, qp[i], limit[i], k0, count, vscale, s);
            else scores_block(chunks, kv, 0, qp[i], limit[i], k0, count, vscale, s);
        }
    }
    float inv_sum[TILE_ROWS * MAX_GROUP];
    for (int i = 0; i < n; i++) {
        float *s = scores + (int64_t)i * stride;
        const int m = limit[i];
        const int whole = m / LANES * LANES;
        const __mmask16 tail = (__mmask16)((1u << (m - whole)) - 1);
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (int j = 0; j < whole; j += LANES) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j));
        vmax = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_maskz_loadu_ps(tail, s + whole));
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
        __m512 vsum = _mm512_setzero_ps();
        for (int j = 0; j < whole; j += LANES) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mx));
            _mm512_storeu_ps(s + j, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        if (tail) {   /* the last block's keys past this query's position weigh nothing */
            const __m512 e = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + whole), mx)));
            _mm512_storeu_ps(s + whole, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        for (int j = tail ? whole + LANES : whole; j < ctx; j++) s[j] = 0.f;
        inv_sum[i] = 1.f / _mm512_reduce_add_ps(vsum);
    }
    for (int k0 = 0; k0 < ctx; k0 += per_block) {
        const int count = ctx - k0 < per_block ? ctx - k0 : per_block;
        block_rows(chunks, v_cache, half_kv, convert, row_at + k0, count, buffer, kv);
        for (int i0 = 0; i0 < n; i0 += together) {
            const int nq = n - i0 < together ? n - i0 : together;
            int last = 0;
            for (int g = 0; g < nq; g++) last = limit[i0 + g] > last ? limit[i0 + g] : last;
            if (last <= k0) continue;   /* these queries' keys ended in an earlier block */
            const int j1 = last < k0 + count ? last : k0 + count;
            if (half_rows) values_block(chunks, together, kv, 1, scores, stride, i0, nq, k0, j1, head_dim, acc_rows);
            else values_block(chunks, together, kv, 0, scores, stride, i0, nq, k0, j1, head_dim, acc_rows);
        }
    }
    write_outputs(acc_rows, inv_sum, n, group, head_dim, t0, kvh, out, o_tok, o_head);
}
#endif

#ifdef PAGED_AVX2
/* Four dot products at once, each half summed: lanes 0-3 of the result are the sums of lanes 0-3 of a0..a3, lanes
 * 4-7 those of their lanes 4-7 (a fixed tree of shuffles). */
static inline __m256 sum4_halves(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 b01 = _mm256_add_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
    const __m256 b23 = _mm256_add_ps(_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
    return _mm256_add_ps(_mm256_shuffle_ps(b01, b23, 0x44), _mm256_shuffle_ps(b01, b23, 0xEE));
}

/* Eight float16 values from p on, as floats. */
static inline __m256 load_half8(const half *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* Eight floats of a pool row from element i on, of either type. */
static inline __attribute__((always_inline)) __m256 load_kv8(const void *pool, int64_t i, const int half_kv) {
    return half_kv ? load_half8((const half *)pool + i) : _mm256_loadu_ps((const float *)pool + i);
}

/* exp16's polynomial, eight lanes at a time, for x <= 0; 2^n is built in the exponent field (n >= -126 here). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

/* The largest of eight lanes, and their sum (in a fixed order). */
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Eight keys' scores for one query: eight dot products in chunk order, then one tree of shuffles (lane t of the
 * result is key t's). The keys' rows are at pool + at[0..7]. */
static inline __attribute__((always_inline)) __m256 scores8(const int chunks, const float *q, const void *pool,
                                                            const int64_t *at, const int half_kv) {
    __m256 acc[LANES8];
    for (int t = 0; t < LANES8; t++) acc[t] = _mm256_setzero_ps();
    for (int c = 0; c < chunks; c++) {
        const __m256 qc = _mm256_loadu_ps(q + c * LANES8);
        for (int t = 0; t < LANES8; t++)
            acc[t] = _mm256_fmadd_ps(qc, load_kv8(pool, at[t] + c * LANES8, half_kv), acc[t]);
    }
    const __m256 lo = sum4_halves(acc[0], acc[1], acc[2], acc[3]), hi = sum4_halves(acc[4], acc[5], acc[6], acc[7]);
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

/* Two queries' outputs over keys j0..j1-1, `width` chunks of them from chunk c0 on: sums carried in `acc` (rows
 * a0 and a1, which may be the same row; its second sum then stores the first's) from block to block of keys. */
static inline __attribute__((always_inline)) void values_pair(
        const int width, const void *pool, const int64_t *row_at, const int half_kv, const float *s0, const float *s1,
        int j0, int j1, int c0, float *a0, float *a1) {
    __m256 sum0[4], sum1[4];
    for (int c = 0; c < width; c++) {
        sum0[c] = _mm256_loadu_ps(a0 + (c0 + c) * LANES8);
        sum1[c] = _mm256_loadu_ps(a1 + (c0 + c) * LANES8);
    }
    for (int j = j0; j < j1; j++) {
        const __m256 p0 = _mm256_broadcast_ss(s0 + j), p1 = _mm256_broadcast_ss(s1 + j);
        for (int c = 0; c < width; c++) {
            const __m256 vc = load_kv8(pool, row_at[j] + (c0 + c) * LANES8, half_kv);
            sum0[c] = _mm256_fmadd_ps(p0, vc, sum0[c]);
            sum1[c] = _mm256_fmadd_ps(p1, vc, sum1[c]);
        }
    }
    for (int c = 0; c < width; c++) {
        _mm256_storeu_ps(a1 + (c0 + c) * LANES8, sum1[c]);
        _mm256_storeu_ps(a0 + (c0 + c) * LANES8, sum0[c]);
    }
}

/* attend_tile for a head size that is a multiple of 8 (at most 256), in AVX2's sixteen registers: a query's scores
 * eight keys at a time (scores8), outputs two queries and 32 of their dimensions at a time, so a value row's
 * chunk is loaded once for both; keys and values in blocks of KEY_BLOCK, read from memory once for every query of
 * the tile. As in the other paths, a query's scores and output are computed the same way whichever rows share its
 * tile. */
static inline __attribute__((always_inline)) void attend_tile_avx2(
        const int chunks, const float *q, int64_t q_tok, int64_t q_head, const void *k_cache, const void *v_cache,
        const int half_kv, int64_t num_blocks, int block_size, int group, int head_dim, const int32_t *table,
        const int32_t *row_pos, int t0, int rows, int kvh, float scale, float *out, int64_t o_tok, int64_t o_head,
        float *scores, float *acc, int64_t *row_at) {
    const int n = rows * group;
    const int ctx = row_pos[t0 + rows - 1] + 1;
    const int stride = (ctx + LANES8 - 1) / LANES8 * LANES8;   /* a query's scores, padded to whole runs of keys */
    const int64_t head_base = (int64_t)kvh * num_blocks * block_size;
    /* Each key's row in the pool, block by block; the last run's keys past the context read key 0's row, and are
     * masked. */
    int j = 0;
    for (int blk = 0; j < ctx; blk++) {
        const int64_t first = (head_base + (int64_t)table[blk] * block_size) * head_dim;
        for (int o = 0; o < block_size && j < ctx; o++, j++) row_at[j] = first + (int64_t)o * head_dim;
    }
    for (; j < stride; j++) row_at[j] = row_at[0];
    int limit[TILE_ROWS * MAX_GROUP];
    const float *qp[TILE_ROWS * MAX_GROUP];
    for (int r = 0; r < rows; r++) {
        for (int g = 0; g < group; g++) {
            qp[r * group + g] = q + (int64_t)(t0 + r) * q_tok + (int64_t)(kvh * group + g) * q_head;
            limit[r * group + g] = row_pos[t0 + r] + 1;
        }
    }
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int k0 = 0; k0 < ctx; k0 += KEY_BLOCK) {
        for (int i = 0; i < n; i++) {
            const int runs = (limit[i] + LANES8 - 1) / LANES8, block_end = (k0 + KEY_BLOCK) / LANES8;
            for (int b = k0 / LANES8; b < (runs < block_end ? runs : block_end); b++)
                _mm256_storeu_ps(scores + (int64_t)i * stride + b * LANES8,
                                 _mm256_mul_ps(scores8(chunks, qp[i], k_cache, row_at + b * LANES8, half_kv), vscale));
        }
    }
    float inv_sum[TILE_ROWS * MAX_GROUP];
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int i = 0; i < n; i++) {
        float *s = scores + (int64_t)i * stride;
        const int m = limit[i];
        const int whole = m / LANES8 * LANES8;
        const __m256 tail = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(m - whole), lane));
        __m256 vmax = _mm256_set1_ps(-INFINITY);
        for (int j = 0; j < whole; j += LANES8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + j));
        if (m > whole)
            vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(s + whole), tail));
        const __m256 mx = _mm256_set1_ps(hmax8(vmax));
        __m256 vsum = _mm256_setzero_ps();
        for (int j = 0; j < whole; j += LANES8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mx));
            _mm256_storeu_ps(s + j, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        if (m > whole) {   /* the last run's keys past this query's position weigh nothing */
            const __m256 e = _mm256_and_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + whole), mx)));
            _mm256_storeu_ps(s + whole, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        for (int j = m > whole ? whole + LANES8 : whole; j < ctx; j++) s[j] = 0.f;
        inv_sum[i] = 1.f / hsum8(vsum);
    }
    memset(acc, 0, sizeof(float) * n * head_dim);
    for (int k0 = 0; k0 < ctx; k0 += KEY_BLOCK) {
        for (int i0 = 0; i0 < n; i0 += 2) {   /* a lone last query is its own pair */
            const int i1 = i0 + 1 < n ? i0 + 1 : i0;
            const int last = limit[i0] > limit[i1] ? limit[i0] : limit[i1];
            const int j1 = last < k0 + KEY_BLOCK ? last : k0 + KEY_BLOCK;
            const float *s0 = scores + (int64_t)i0 * stride, *s1 = scores + (int64_t)i1 * stride;
            float *a0 = acc + (int64_t)i0 * head_dim, *a1 = acc + (int64_t)i1 * head_dim;
            int c0 = 0;
            for (; c0 + 4 <= chunks; c0 += 4) values_pair(4, v_cache, row_at, half_kv, s0, s1, k0, j1, c0, a0, a1);
            switch (chunks - c0) {
                case 3: values_pair(3, v_cache, row_at, half_kv, s0, s1, k0, j1, c0, a0, a1); break;
                case 2: values_pair(2, v_cache, row_at, half_kv, s0, s1, k0, j1, c0, a0, a1); break;
                case 1: values_pair(1, v_cache, row_at, half_kv, s0, s1, k0, j1, c0, a0, a1); break;
            }
        }
    }
    write_outputs(acc, inv_sum, n, group, head_dim, t0, kvh, out, o_tok, o_head);
}
#endif

/* One call's arguments (the exported functions' parameters), as every thread reads them. */
typedef struct {
    const float *q, *k, *v;
    int64_t q_tok, q_head, k_tok, k_head, v_tok, v_head;
    void *k_cache, *v_cache;
    int64_t num_blocks;
    int block_size, heads, kv_heads, head_dim;
    const int64_t *slots;
    int num_tokens;
    const int32_t *row_seq, *row_pos, *tables;
    int table_width, max_context;
    float scale;
    float *out;
    const int *tile_start;   /* tiles: runs of up to TILE_ROWS consecutive rows of one sequence */
    int num_tiles;
} call_args;

/* Scratch on whole cache lines: a vector load or store across two lines costs two. */
static void *alloc64(size_t bytes) {
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

/* A thread's share of a call, inside the caller's parallel region: the new rows written, then its tiles attended.
 * Inlined into each exported function with half_kv a constant, so each has a loop of its own pool type. */
static inline __attribute__((always_inline)) void each_thread(const call_args *a, const int half_kv) {
    const int group = a->heads / a->kv_heads, head_dim = a->head_dim;
    const int64_t o_tok = (int64_t)a->heads * head_dim, o_head = head_dim;
#if defined(PAGED_AVX512)
    const int vectorised = head_dim % LANES == 0 && head_dim <= LANES * LANES;
#elif defined(PAGED_AVX2)
    const int vectorised = head_dim % LANES8 == 0 && head_dim <= LANES8 * MAX_CHUNKS8;
#else
    const int vectorised = 0;
#endif
    if (half_kv) {
        write_kv_half(a->k, a->k_tok, a->k_head, a->k_cache, a->num_blocks, a->block_size, a->kv_heads, head_dim,
                      a->slots, a->num_tokens);
        write_kv_half(a->v, a->v_tok, a->v_head, a->v_cache, a->num_blocks, a->block_size, a->kv_heads, head_dim,
                      a->slots, a->num_tokens);
    } else {
        write_kv(a->k, a->k_tok, a->k_head, a->k_cache, a->num_blocks, a->block_size, a->kv_heads, head_dim, a->slots,
                 a->num_tokens);
        write_kv(a->v, a->v_tok, a->v_head, a->v_cache, a->num_blocks, a->block_size, a->kv_heads, head_dim, a->slots,
                 a->num_tokens);
    }
    /* The implicit barrier of the loops above: every new row is in the pool before any is read. */
    float *scores = alloc64(sizeof(float) * TILE_ROWS * group * ((int64_t)a->max_context + LANES));
    float *acc = alloc64(sizeof(float) * TILE_ROWS * group * (int64_t)head_dim);
    int64_t *row_at = vectorised ? malloc(sizeof(int64_t) * ((int64_t)a->max_context + LANES)) : NULL;
#ifdef PAGED_AVX512
    float *buffer = vectorised && half_kv ? alloc64(sizeof(float) * KEY_FLOATS) : NULL;   /* a block's rows as floats */
#endif
    #pragma omp for collapse(2) schedule(dynamic, 1)
    for (int tile = 0; tile < a->num_tiles; tile++) {
        for (int kvh = 0; kvh < a->kv_heads; kvh++) {
            const int t0 = a->tile_start[tile];
            const int rows = a->tile_start[tile + 1] - t0;
            const int32_t *table = a->tables + (int64_t)a->row_seq[t0] * a->table_width;
#ifdef PAGED_AVX512
            if (vectorised) {   /* the common head sizes get their register layout fixed at compile time */
#define ATTEND(chunks) attend_tile_avx512(chunks, a->q, a->q_tok, a->q_head, a->k_cache, a->v_cache, half_kv, \
                                          a->num_blocks, a->block_size, group, head_dim, table, a->row_pos, t0, \
                                          rows, kvh, a->scale, a->out, o_tok, o_head, scores, acc, row_at, \
                                          buffer)
                switch (head_dim / LANES) {
                    case 4: ATTEND(4); break;
                    case 8: ATTEND(8); break;
                    default: ATTEND(head_dim / LANES);
                }
#undef ATTEND
                continue;
            }
#elif defined(PAGED_AVX2)
            if (vectorised) {
#define ATTEND(chunks) attend_tile_avx2(chunks, a->q, a->q_tok, a->q_head, a->k_cache, a->v_cache, half_kv, \
                                        a->num_blocks, a->block_size, group, head_dim, table, a->row_pos, t0, \
                                        rows, kvh, a->scale, a->out, o_tok, o_head, scores, acc, row_at)
                switch (head_dim / LANES8) {
                    case 8: ATTEND(8); break;
                    case 16: ATTEND(16); break;
                    default: ATTEND(head_dim / LANES8);
                }
#undef ATTEND
                continue;
            }
#endif
            attend_tile(a->q, a->q_tok, a->q_head, a->k_cache, a->v_cache, half_kv, a->num_blocks, a->block_size,
                        group, head_dim, table, a->row_pos, t0, rows, kvh, a->scale, a->out, o_tok, o_head, scores,
                        acc);
        }
    }
    free(scores);
    free(acc);
    free(row_at);
#ifdef PAGED_AVX512
    free(buffer);
#endif
}

/* The call's tiles into a->tile_start (allocated; the caller frees it). Returns 0, or -1 when the heads are outside
 * what this kernel handles. */
static int plan(call_args *a) {
    const int group = a->heads / a->kv_heads;
    if (group > MAX_GROUP || group * a->kv_heads != a->heads) return -1;
    int *tile_start = malloc(sizeof(int) * (a->num_tokens + 1));
    int num_tiles = 0;
    for (int t = 0; t < a->num_tokens; t++) {
        if (t == 0 || a->row_seq[t] != a->row_seq[t - 1] || t - tile_start[num_tiles - 1] == TILE_ROWS)
            tile_start[num_tiles++] = t;
    }
    tile_start[num_tiles] = a->num_tokens;
    a->tile_start = tile_start;
    a->num_tiles = num_tiles;
    return 0;
}

/* The path this library was built with: 2 AVX-512, 1 AVX2, 0 the portable loops (head sizes a path cannot take
 * still take the portable loops). */
int paged_attention_path(void) {
#if defined(PAGED_AVX512)
    return 2;
#elif defined(PAGED_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* Each exported function opens its own parallel region: the compiler outlines a region before it inlines, so one
 * region in a shared helper would be one loop testing the pool's type at run time (each_thread's note). */
#define CALL_ARGS {q, k, v, q_tok, q_head, k_tok, k_head, v_tok, v_head, k_cache, v_cache, num_blocks, block_size, \
                   heads, kv_heads, head_dim, slots, num_tokens, row_seq, row_pos, tables, table_width, \
                   max_context, scale, out, NULL, 0}

/* A float32 pool. Returns 0, or -1 when the shapes are outside what this kernel handles. */
int paged_attention_f32(const float *q, int64_t q_tok, int64_t q_head, const float *k, int64_t k_tok,
                        int64_t k_head, const float *v, int64_t v_tok, int64_t v_head, float *k_cache,
                        float *v_cache, int64_t num_blocks, int block_size, int heads, int kv_heads, int head_dim,
                        const int64_t *slots, int num_tokens, const int32_t *row_seq, const int32_t *row_pos,
                        const int32_t *tables, int table_width, int max_context, float scale, float *out,
                        int num_threads) {
    call_args a = CALL_ARGS;
    if (plan(&a) != 0) return -1;
    #pragma omp parallel num_threads(num_threads)
    each_thread(&a, 0);
    free((void *)a.tile_start);
    return 0;
}

/* A float16 pool: half the bytes read a key, half the memory a block. The same returns. */
int paged_attention_f16kv(const float *q, int64_t q_tok, int64_t q_head, const float *k, int64_t k_tok,
                          int64_t k_head, const float *v, int64_t v_tok, int64_t v_head, half *k_cache,
                          half *v_cache, int64_t num_blocks, int block_size, int heads, int kv_heads, int head_dim,
                          const int64_t *slots, int num_tokens, const int32_t *row_seq, const int32_t *row_pos,
                          const int32_t *tables, int table_width, int max_context, float scale, float *out,
                          int num_threads) {
    call_args a = CALL_ARGS;
    if (plan(&a) != 0) return -1;
    #pragma omp parallel num_threads(num_threads)
    each_thread(&a, 1);
    free((void *)a.tile_start);
    return 0;
}
