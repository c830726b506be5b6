/* w8a8's per-row work around torch._int_mm (quant_linear.Int8Matmul), bit-equal to its torch-op form:
 * quantising each row of activations to int8 at its own largest magnitude, and scaling the int32 products by
 * the row's and the output channel's scales. torch's ops for these took most of a w8a8 layer's time. */
#include <float.h>
#include <stdlib.h>
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

/* int8 weights in tiles, for AMX, AVX512-VNNI and AVX2: torch._int_mm lays its weights out again on every call, which
 * reads them from memory at a third of its speed; these tiles are laid out once (quantised.py's _tiles), so a step
 * streams each weight byte once. Tile t holds output channels 16t..16t+15 as [K/4][16][4] codes: one 64-byte line
 * per 4 inputs. VNNI's and AMX's instructions take unsigned activations: each code is shifted by 128 (c ^ 0x80),
 * and 128 times the channel's code sum (`shift`) is taken off after: int32 sums, exact, so the result is
 * torch._int_mm's and scale_rows_cols' to the bit. */

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#include <immintrin.h>

/* VNNI: one tile of 16 channels for a block of up to R rows of shifted activations, laid out [K/4][16 rows][4] so a
 * step's broadcasts read one 64-byte line: out = (acc - shift) * (row scale * channel scale), as
 * scale_rows_cols computes it. Each step also asks for a line of the next tile (the same size, next in memory: the
 * thread's next one) into L2: with the hardware prefetcher alone the model's matmuls at 16 rows took 1.36x as long
 * (AMX's 1.41x; docs/BENCHMARKS.md). Prefetches never fault, so the one past the last tile is harmless. */
#define TILE_ROWS(R)                                                                                        \
    static void tile_##R(const uint8_t *a, int64_t k, int64_t rows, const int8_t *tile, const int32_t *shift, \
                         const float *row_scales, const float *col_scales, float *out, int64_t n) {          \
        __m512i acc[R];                                                                                      \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_si512();                \
        for (int64_t i = 0; i < k / 4; i++) {                                                                \
            _mm_prefetch((const char *)(tile + k * 16 + i * 64), _MM_HINT_T1);                              \
            const __m512i w = _mm512_loadu_si512((const void *)(tile + i * 64));                             \
            const int32_t *four = (const int32_t *)(a + i * 64);                                             \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                             \
                acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(four[r]), w);                         \
        }                                                                                                    \
        const __m512i s = _mm512_loadu_si512((const void *)shift);                                           \
        const __m512 cs = _mm512_loadu_ps(col_scales);                                                       \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                               \
            if (r < rows) {                                                                                  \
                const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r], s));                            \
                _mm512_storeu_ps(out + r * n, _mm512_mul_ps(f, _mm512_mul_ps(_mm512_set1_ps(row_scales[r]), cs))); \
            }                                                                                                \
        }                                                                                                    \
    }
TILE_ROWS(1)
TILE_ROWS(2)
TILE_ROWS(4)
TILE_ROWS(8)
TILE_ROWS(16)

/* out[m, :] for rows codes[m, :] (int8, row stride k) against packed tiles; returns 0 when this build has no
 * VNNI (the caller then uses torch._int_mm). `shifted` is scratch of ceil(rows / 16) * 16 * k bytes. */
int matmul_vnni_s8(const int8_t *codes, int64_t rows, int64_t k, int64_t n, const int8_t *packed,
                   const int32_t *shift, const float *row_scales, const float *col_scales, float *out,
                   uint8_t *shifted, int threads) {
    const int64_t blocks = (rows + 15) / 16;
    for (int64_t b = 0; b < blocks; b++)   /* [block][K/4][16 rows][4], padding rows zero (0x80 shifted) */
        for (int64_t i = 0; i < k / 4; i++)
            for (int64_t r = 0; r < 16; r++) {
                const int64_t m = b * 16 + r;
                uint8_t *to = shifted + (b * (k / 4) + i) * 64 + r * 4;
                for (int j = 0; j < 4; j++)
                    to[j] = m < rows ? (uint8_t)codes[m * k + i * 4 + j] ^ 0x80 : 0x80;
            }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < n / 16; t++) {
        const int8_t *tile = packed + t * k * 16;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t m = b * 16, left = rows - m;
            const uint8_t *a = shifted + b * 16 * k;
            float *o = out + m * n + t * 16;
            const int32_t *s = shift + t * 16;
            const float *cs = col_scales + t * 16;
            /* a block of fewer rows runs the next kernel up, over padding rows it does not store */
            if (left > 8) tile_16(a, k, left, tile, s, row_scales + m, cs, o, n);
            else if (left > 4) tile_8(a, k, left, tile, s, row_scales + m, cs, o, n);
            else if (left > 2) tile_4(a, k, left, tile, s, row_scales + m, cs, o, n);
            else if (left == 2) tile_2(a, k, left, tile, s, row_scales + m, cs, o, n);
            else tile_1(a, k, left, tile, s, row_scales + m, cs, o, n);
        }
    }
    return 1;
}
#else
int matmul_vnni_s8(const int8_t *codes, int64_t rows, int64_t k, int64_t n, const int8_t *packed,
                   const int32_t *shift, const float *row_scales, const float *col_scales, float *out,
                   uint8_t *shifted, int threads) {
    return 0;
}
#endif

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512F__)
#include <sys/syscall.h>
#include <unistd.h>

/* AMX: one TDPBUSD multiplies 16 rows by 64 inputs by 16 channels. Its B tile is 16 lines of a packed tile
 * (64 inputs of 16 channels), so the same packing serves both; its A tile is 16 rows of 64 shifted bytes. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Linux hands out AMX's tile state only on request, once per process; 1 when granted. */
int amx_ready(void) {
    static int ready = -1;
    if (ready < 0)
        ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    return ready;
}

/* out[m, n] for one channel tile t and 16 rows from m0, from their int32 sums (16 x 16, row-major) */
static inline void amx_finish(const int32_t *acc, int64_t m0, int64_t rows, int64_t n, int64_t t,
                              const int32_t *shift, const float *row_scales, const float *col_scales, float *out) {
    const __m512i s = _mm512_loadu_si512((const void *)(shift + t * 16));
    const __m512 cs = _mm512_loadu_ps(col_scales + t * 16);
    for (int64_t r = 0; r < 16 && m0 + r < rows; r++) {
        const int64_t m = m0 + r;
        const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(acc + r * 16), s));
        _mm512_storeu_ps(out + m * n + t * 16, _mm512_mul_ps(f, _mm512_mul_ps(_mm512_set1_ps(row_scales[m]), cs)));
    }
}

int matmul_amx_s8(const int8_t *codes, int64_t rows, int64_t k, int64_t n, const int8_t *packed,
                  const int32_t *shift, const float *row_scales, const float *col_scales, float *out,
                  uint8_t *shifted, int threads) {
    if (k % 64 || !amx_ready())
        return 0;
    const int64_t blocks = (rows + 15) / 16, tiles = n / 16;
    for (int64_t i = 0; i < rows * k; i++)   /* row-major, padding rows zero (0x80 shifted) */
        shifted[i] = (uint8_t)codes[i] ^ 0x80;
    memset(shifted + rows * k, 0x80, (size_t)((blocks * 16 - rows) * k));
#pragma omp parallel num_threads(threads)
    {
        /* Two channel tiles by two row blocks a pass: sums in tiles 0 (t, b), 1 (t+1, b), 2 (t, b+1) and
         * 3 (t+1, b+1), rows in 4 and 5, weights in 6 and 7; four independent sums hide TDPBUSD's latency, and each
         * line of rows or weights loaded serves two products. */
        tile_config config;
        memset(&config, 0, sizeof config);
        config.palette = 1;
        for (int t = 0; t < 8; t++) {
            config.rows[t] = 16;
            config.colsb[t] = 64;
        }
        _tile_loadconfig(&config);
        int32_t acc[4][16 * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < (tiles + 1) / 2; pair++) {
            const int64_t t = pair * 2;
            const int two = t + 1 < tiles;
            const int8_t *w0 = packed + t * k * 16, *w1 = w0 + k * 16, *next = w0 + 2 * k * 16;
            for (int64_t b = 0; b < blocks; b += 2) {
                const int both = b + 1 < blocks;
                const uint8_t *a0 = shifted + b * 16 * k, *a1 = a0 + 16 * k;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t i = 0; i < k; i += 64) {
                    if (b == 0)   /* the next pair's lines for these inputs into L2, as the VNNI kernel does */
                        for (int64_t line = 0; line < 1024; line += 64) {
                            _mm_prefetch((const char *)(next + i * 16 + line), _MM_HINT_T1);
                            _mm_prefetch((const char *)(next + k * 16 + i * 16 + line), _MM_HINT_T1);
                        }
                    _tile_loadd(4, a0 + i, k);
                    _tile_loadd(6, w0 + i * 16, 64);
                    _tile_dpbusd(0, 4, 6);
                    if (two) {
                        _tile_loadd(7, w1 + i * 16, 64);
                        _tile_dpbusd(1, 4, 7);
                    }
                    if (both) {
                        _tile_loadd(5, a1 + i, k);
                        _tile_dpbusd(2, 5, 6);
                        if (two)
                            _tile_dpbusd(3, 5, 7);
                    }
                }
                _tile_stored(0, acc[0], 64);
                _tile_stored(1, acc[1], 64);
                _tile_stored(2, acc[2], 64);
                _tile_stored(3, acc[3], 64);
                amx_finish(acc[0], b * 16, rows, n, t, shift, row_scales, col_scales, out);
                if (two)
                    amx_finish(acc[1], b * 16, rows, n, t + 1, shift, row_scales, col_scales, out);
                if (both)
                    amx_finish(acc[2], b * 16 + 16, rows, n, t, shift, row_scales, col_scales, out);
                if (two && both)
                    amx_finish(acc[3], b * 16 + 16, rows, n, t + 1, shift, row_scales, col_scales, out);
            }
        }
        _tile_release();
    }
    return 1;
}
#else
int amx_ready(void) { return 0; }
int matmul_amx_s8(const int8_t *codes, int64_t rows, int64_t k, int64_t n, const int8_t *packed,
                  const int32_t *shift, const float *row_scales, const float *col_scales, float *out,
                  uint8_t *shifted, int threads) {
    return 0;
}
#endif

#if defined(__AVX2__)
#include <immintrin.h>

/* AVX2, for CPUs without VNNI, where oneDNN's int8 matmul runs at a fraction of float32's speed: the same tiles, with
 * VPMADDUBSW (unsigned times signed bytes, pairs summed to 16 bits) and VPMADDWD (pairs of those to 32 bits). The
 * activation's sign goes onto the weight (VPSIGNB) and its magnitude stays unsigned: |a| <= 127 and |w| <= 127, so a
 * pair's sum stays under 2 * 127 * 127 = 32258 and never saturates. Exact int32 sums, so the result is
 * torch._int_mm's and scale_rows_cols' to the bit, with no shift. Activations are laid out in blocks of 4 rows,
 * [K/4][4 rows] words of four codes, signed and magnitudes side by side, so each step broadcasts from one line. */
#define AVX2_ROWS(R)                                                                                          \
    static void avx2_tile_##R(const int32_t *a, const int32_t *ua, int64_t k, int64_t rows, const int8_t *tile,  \
                              const float *row_scales, const float *col_scales, float *out, int64_t n) {        \
        __m256i lo[R], hi[R];                                                                                  \
        const __m256i ones = _mm256_set1_epi16(1);                                                             \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_si256();             \
        for (int64_t i = 0; i < k / 4; i++) {                                                                  \
            _mm_prefetch((const char *)(tile + k * 16 + i * 64), _MM_HINT_T1);                                \
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(tile + i * 64));                           \
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(tile + i * 64 + 32));                      \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                              \
                const __m256i s = _mm256_set1_epi32(a[i * 4 + r]), u = _mm256_set1_epi32(ua[i * 4 + r]);       \
                lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(w0, s)), \
                                                                  ones));                                      \
                hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(w1, s)), \
                                                                  ones));                                      \
            }                                                                                                  \
        }                                                                                                      \
        const __m256 cs0 = _mm256_loadu_ps(col_scales), cs1 = _mm256_loadu_ps(col_scales + 8);                 \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                                  \
            if (r < rows) {                                                                                    \
                const __m256 rs = _mm256_set1_ps(row_scales[r]);                                               \
                _mm256_storeu_ps(out + r * n, _mm256_mul_ps(_mm256_cvtepi32_ps(lo[r]), _mm256_mul_ps(rs, cs0))); \
                _mm256_storeu_ps(out + r * n + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(hi[r]), _mm256_mul_ps(rs, cs1))); \
            }                                                                                                  \
        }                                                                                                      \
    }
AVX2_ROWS(1)
AVX2_ROWS(2)
AVX2_ROWS(4)

/* As matmul_vnni_s8, at any row count; `shift` is not read. `scratch` is 2 * ceil(rows / 4) * 4 * k bytes. */
int matmul_avx2_s8(const int8_t *codes, int64_t rows, int64_t k, int64_t n, const int8_t *packed,
                   const int32_t *shift, const float *row_scales, const float *col_scales, float *out,
                   uint8_t *scratch, int threads) {
    const int64_t blocks = (rows + 3) / 4, quads = k / 4;
    int32_t *a = (int32_t *)scratch, *ua = a + blocks * quads * 4;
    for (int64_t b = 0; b < blocks; b++)   /* [block][K/4][4 rows], padding rows zero */
        for (int64_t i = 0; i < quads; i++)
            for (int64_t r = 0; r < 4; r++) {
                const int64_t m = b * 4 + r, at = (b * quads + i) * 4 + r;
                int8_t four[4] = {0, 0, 0, 0}, mag[4] = {0, 0, 0, 0};
                if (m < rows)
                    for (int j = 0; j < 4; j++) {
                        four[j] = codes[m * k + i * 4 + j];
                        mag[j] = (int8_t)(four[j] < 0 ? -four[j] : four[j]);
                    }
                memcpy(a + at, four, 4);
                memcpy(ua + at, mag, 4);
            }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < n / 16; t++) {
        const int8_t *tile = packed + t * k * 16;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t m = b * 4, left = rows - m;
            const int32_t *ab = a + b * quads * 4, *ub = ua + b * quads * 4;
            float *o = out + m * n + t * 16;
            const float *cs = col_scales + t * 16;
            if (left > 2) avx2_tile_4(ab, ub, k, left, tile, row_scales + m, cs, o, n);
            else if (left == 2) avx2_tile_2(ab, ub, k, left, tile, row_scales + m, cs, o, n);
            else avx2_tile_1(ab, ub, k, left, tile, row_scales + m, cs, o, n);
        }
    }
    (void)shift;
    return 1;
}
#else
int matmul_avx2_s8(const int8_t *codes, int64_t rows, int64_t k, int64_t n, const int8_t *packed,
                   const int32_t *shift, const float *row_scales, const float *col_scales, float *out,
                   uint8_t *scratch, int threads) {
    return 0;
}
#endif

/* quantize_rows_s8, then the tile kernel (kernel: 0 VNNI, 1 AMX, 2 AVX2), in one call with the codes, row scales and
 * scratch taken from the heap: w8a8's usual path, without a call and three buffers from the caller for each part.
 * Returns the kernel's result (0: not in this build), or -1 when memory runs out. */
int quantize_matmul_s8(const float *x, int64_t rows, int64_t k, int64_t stride, int64_t n, const int8_t *packed,
                       const int32_t *shift, const float *col_scales, float *out, int kernel, int threads) {
    if (rows == 0)
        return 1;
    const size_t padded = (size_t)((rows + 15) / 16 * 16) * (size_t)k;
    int8_t *codes = aligned_alloc(64, (padded + 63) / 64 * 64);
    float *row_scales = aligned_alloc(64, ((size_t)rows * sizeof(float) + 63) / 64 * 64);
    const size_t scratch_bytes = kernel == 2 ? 2 * padded : padded;   /* AVX2: codes and their magnitudes */
    uint8_t *scratch = aligned_alloc(64, (scratch_bytes + 63) / 64 * 64);
    int rc = -1;
    if (codes != NULL && row_scales != NULL && scratch != NULL) {
        quantize_rows_s8(x, rows, k, stride, codes, row_scales, threads);
        if (kernel == 1)
            rc = matmul_amx_s8(codes, rows, k, n, packed, shift, row_scales, col_scales, out, scratch, threads);
        else if (kernel == 2)
            rc = matmul_avx2_s8(codes, rows, k, n, packed, shift, row_scales, col_scales, out, scratch, threads);
        else
            rc = matmul_vnni_s8(codes, rows, k, n, packed, shift, row_scales, col_scales, out, scratch, threads);
    }
    free(codes);
    free(row_scales);
    free(scratch);
    return rc;
}
