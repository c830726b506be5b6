/* w8a8's per-row work around torch._int_mm (quant_linear.Int8Matmul), bit-equal to its torch-op form:
 * quantising each row of activations to int8 at its own largest magnitude, and scaling the int32 products by
 * the row's and the output channel's scales. torch's ops for these took most of a w8a8 layer's time. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* scales[m] = max(max_k |x[m, k]|, FLT_MIN) / 127; codes[m, k] = round-half-even(x[m, k] / scales[m]). */
void quantize_rows_s8(const float *x, int64_t rows, int64_t cols, int64_t stride, int8_t *codes, float *scales,
                      int threads) {
#pragma omp parallel for num_threads(threads) if (rows * cols >= 65536)
    for (int64_t m = 0; m < rows; m++) {
        const float *row = x + m * stride;
        /* The largest magnitude through the bits: for floats without their sign the integer order is the
         * numeric one, and an integer maximum vectorises. */
        uint32_t top = 0;
        for (int64_t k = 0; k < cols; k++) {
            uint32_t bits;
            memcpy(&bits, row + k, sizeof bits);
            bits &= 0x7fffffffu;
            top = bits > top ? bits : top;
        }
        float largest;
        memcpy(&largest, &top, sizeof largest);
        const float scale = (largest > FLT_MIN ? largest : FLT_MIN) / 127.0f;
        scales[m] = scale;
        int8_t *out = codes + m * cols;
        for (int64_t k = 0; k < cols; k++)
            out[k] = (int8_t)nearbyintf(row[k] / scale);
    }
}

/* out[m, n] = float(acc[m, n]) * (row_scales[m] * col_scales[n]): two products, no sum, so no fused
 * multiply-add can change the rounding. */
void scale_rows_cols(const int32_t *acc, int64_t rows, int64_t cols, const float *row_scales,
                     const float *col_scales, float *out, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * cols >= 65536)
    for (int64_t m = 0; m < rows; m++) {
        const float row_scale = row_scales[m];
        const int32_t *a = acc + m * cols;
        float *o = out + m * cols;
        for (int64_t n = 0; n < cols; n++)
            o[n] = (float)a[n] * (row_scale * col_scales[n]);
    }
}
