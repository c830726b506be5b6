/* The elementwise work of a decoder layer between its matmuls, one call each, for CPU steps (fused.py): RMSNorm
 * (with the residual add before it), rotary position embedding (after a per-head RMSNorm where the model has one)
 * and SiLU-and-multiply, each transformers' float32 expression; the order of RMSNorm's sum of squares and SiLU's
 * exponential (a polynomial) round differently. Plain C that the compiler vectorises (-O3 -march=native); rows are
 * split over threads only where there are enough. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16
#define PARALLEL_ELEMENTS 65536   /* below this a row loop on one thread beats waking the others */
#define MAX_HEAD_DIM 512

/* sum of x[k]^2 over a row, in LANES partial sums (a fixed order, whatever the row's neighbours) */
static inline float sum_squares(const float *x, int64_t cols) {
    float part[LANES] = {0};
    int64_t k = 0;
    for (; k + LANES <= cols; k += LANES)
        for (int j = 0; j < LANES; j++)
            part[j] += x[k + j] * x[k + j];
    float total = 0.0f;
    for (int j = 0; j < LANES; j++)
        total += part[j];
    for (; k < cols; k++)
        total += x[k] * x[k];
    return total;
}

/* out[m] = weight * (x[m] * rsqrt(mean(x[m]^2) + eps)), as LlamaRMSNorm computes it in float32. */
static inline void norm_row(const float *x, int64_t cols, const float *weight, float eps, float *out) {
    const float r = 1.0f / sqrtf(sum_squares(x, cols) / (float)cols + eps);
    for (int64_t k = 0; k < cols; k++)
        out[k] = weight[k] * (x[k] * r);
}

void rms_norm_f32(const float *x, int64_t rows, int64_t cols, int64_t stride, const float *weight, float eps,
                  float *out, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * cols >= PARALLEL_ELEMENTS)
    for (int64_t m = 0; m < rows; m++)
        norm_row(x + m * stride, cols, weight, eps, out + m * cols);
}

/* sum[m] = x[m] + y[m] (the residual stream after a sublayer), then out[m] = RMSNorm(sum[m]). */
void add_rms_norm_f32(const float *x, int64_t x_stride, const float *y, int64_t y_stride, int64_t rows,
                      int64_t cols, const float *weight, float eps, float *sum, float *out, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * cols >= PARALLEL_ELEMENTS)
    for (int64_t m = 0; m < rows; m++) {
        float *s = sum + m * cols;
        for (int64_t k = 0; k < cols; k++)
            s[k] = x[m * x_stride + k] + y[m * y_stride + k];
        norm_row(s, cols, weight, eps, out + m * cols);
    }
}

/* Rotary embedding of one head: out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[h:], x[:h]). With a
 * norm weight (Qwen3's q_norm, k_norm) the head is first RMSNorm'd over its own dimensions, in a scratch row. */
static inline void rotate_head(const float *x, const float *norm, float eps, const float *cos, const float *sin,
                               int64_t dim, float *out) {
    float normed[MAX_HEAD_DIM];
    if (norm != NULL) {
        norm_row(x, dim, norm, eps, normed);
        x = normed;
    }
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i++)
        out[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
    for (int64_t i = half; i < dim; i++)
        out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

/* q [tokens, heads * dim] and k [tokens, kv_heads * dim] (row strides q_stride, k_stride), cos and sin
 * [tokens, dim] -> q_out [tokens, heads, dim] and k_out [tokens, kv_heads, dim], contiguous. q_norm and k_norm:
 * each head's RMSNorm weight [dim] (both NULL: none). Returns 0 for a head size past MAX_HEAD_DIM, else 1. */
int rotary_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride, int64_t tokens, int64_t heads,
               int64_t kv_heads, int64_t dim, const float *cos, const float *sin, const float *q_norm,
               const float *k_norm, float eps, float *q_out, float *k_out, int threads) {
    if (dim > MAX_HEAD_DIM)
        return 0;
#pragma omp parallel for num_threads(threads) if (tokens * (heads + kv_heads) * dim >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++)
            rotate_head(q + t * q_stride + h * dim, q_norm, eps, c, s, dim, q_out + (t * heads + h) * dim);
        for (int64_t h = 0; h < kv_heads; h++)
            rotate_head(k + t * k_stride + h * dim, k_norm, eps, c, s, dim, k_out + (t * kv_heads + h) * dim);
    }
    return 1;
}

/* exp(x) for x <= 0: Cephes' single-precision polynomial on x - n ln 2, scaled by 2^n through the exponent bits;
 * within 2 ulp of expf, and 0 below -87. Branch-free, so a loop of it vectorises. */
static inline float exp_nonpositive(float x) {
    x = x < -87.33654f ? -87.33654f : x;
    /* x / ln 2 rounded to the nearest integer by the float adder (|n| < 2^22) */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;   /* 2^n, n in [-126, 0] */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* One row: out = silu(gate) * up, silu(g) = g * sigmoid(g); sigmoid from exp(-|g|), which never overflows. */
static inline void silu_mul_row(const float *restrict g, const float *restrict u, int64_t cols,
                                float *restrict o) {
    for (int64_t k = 0; k < cols; k++) {
        const float e = exp_nonpositive(-fabsf(g[k]));
        const float sigmoid = (g[k] >= 0.0f ? 1.0f : e) / (1.0f + e);
        o[k] = g[k] * sigmoid * u[k];
    }
}

void silu_mul_f32(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride, int64_t rows,
                  int64_t cols, float *out, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * cols >= PARALLEL_ELEMENTS)
    for (int64_t m = 0; m < rows; m++)
        silu_mul_row(gate + m * gate_stride, up + m * up_stride, cols, out + m * cols);
}
