/* The k best scores of each row and their columns, best first (the sampler's top-k/top-p candidates on CPU), in place
 * of torch.topk's selection: the largest score of each block of 16 in a vectorised pass, a bound just below the k-th
 * largest of those by radix counts, then only the scores at or above it through a heap. Equal scores rank the lower
 * column first, so the k kept are the same whatever the order they are met in. NaN scores are left out while the row
 * has k numbers (torch.topk puts them first); a row of NaN logits has no meaningful draw either way.
 *
 * Also each row's sum (top-p's normaliser), in one order whatever rows or threads there are, the same of the row's
 * exponentials in one pass, and each row's first largest score's column (greedy decoding's token). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 16                 /* scores a vector */
#define GROUP (BLOCK * BLOCK)   /* scores of one pass over 16 vectors */

typedef struct {
    float value;
    int64_t index;
} entry;

/* a ranks below b: a lower score, or the same score at a higher column */
static inline int below(const entry *a, const entry *b) {
    return a->value < b->value || (a->value == b->value && a->index > b->index);
}

/* min-heap by rank: heap[0] is the worst kept entry */
static void sift_down(entry *heap, int64_t k, int64_t i) {
    for (;;) {
        int64_t low = i, l = 2 * i + 1, r = l + 1;
        if (l < k && below(&heap[l], &heap[low]))
            low = l;
        if (r < k && below(&heap[r], &heap[low]))
            low = r;
        if (low == i)
            return;
        const entry t = heap[i];
        heap[i] = heap[low];
        heap[low] = t;
        i = low;
    }
}

/* the k best of n entries (n >= k) into heap: the best by rank, whatever order they come in */
static void select_entries(const entry *from, int64_t n, int64_t k, entry *heap) {
    for (int64_t j = 0; j < k; j++)
        heap[j] = from[j];
    for (int64_t i = k / 2 - 1; i >= 0; i--)
        sift_down(heap, k, i);
    for (int64_t j = k; j < n; j++)
        if (below(&heap[0], &from[j])) {
            heap[0] = from[j];
            sift_down(heap, k, 0);
        }
}

/* A float's bits as an unsigned key in the floats' order (-inf lowest). */
static inline uint32_t order_key(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}

static inline float from_key(uint32_t key) {
    const uint32_t u = key & 0x80000000u ? key & 0x7fffffffu : ~key;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#define RADIX_BITS 11
#define RADIX (1 << RADIX_BITS)

/* A lower bound of the k-th largest of n values (1 <= k <= n, no NaN) that at most the values sharing its key's top
 * 2 * RADIX_BITS bits exceed needlessly: the k-th's bucket by the keys' top bits, then by the next ones, counted in
 * two passes without a data-dependent branch (a quickselect's mispredicted ones made it most of a row's time). */
static float kth_largest_bound(const float *v, int64_t n, int64_t k) {
    uint32_t count[RADIX];
    uint32_t prefix = 0;
    int64_t above = 0;   /* values in higher buckets than the one being narrowed */
    for (int level = 0; level < 2; level++) {
        const int shift = 32 - RADIX_BITS * (level + 1);
        memset(count, 0, sizeof count);
        for (int64_t j = 0; j < n; j++) {
            const uint32_t key = order_key(v[j]);
            if (level == 0 || key >> (shift + RADIX_BITS) == prefix)
                count[(key >> shift) & (RADIX - 1)]++;
        }
        int bucket = RADIX - 1;
        while (above + count[bucket] < k)
            above += count[bucket--];
        prefix = (prefix << RADIX_BITS) | (uint32_t)bucket;
    }
    const float bound = from_key(prefix << (32 - 2 * RADIX_BITS));
    return bound == bound ? bound : -INFINITY;   /* -inf's bucket's lowest bits spell a NaN */
}

/* One row. A group of GROUP scores is 16 vectors of 16; the largest of each lane across the group (a vectorised
 * pass) is the top of a "block" of 16 scores a vector apart. At or below the k-th largest block top, t has at least
 * k scores at or above it, so only scores >= t are candidates: about k blocks' worth on a row of distinct scores.
 * The candidates (and the tail past the last whole group) then go through the heap. pool: cols entries; tops:
 * cols / BLOCK. */
static void row_top_k(const float *x, int64_t cols, int64_t k, entry *heap, entry *pool, float *tops, float *values,
                      int64_t *indices) {
    const int64_t groups = cols / GROUP, blocks = groups * BLOCK;
    int64_t n = 0;
    if (blocks >= k) {
        for (int64_t g = 0; g < groups; g++) {
            const float *v = x + g * GROUP;
            float top[BLOCK];
            for (int l = 0; l < BLOCK; l++)
                top[l] = -INFINITY;   /* a NaN never becomes a top */
            for (int r = 0; r < BLOCK; r++)
                for (int l = 0; l < BLOCK; l++)
                    top[l] = v[r * BLOCK + l] > top[l] ? v[r * BLOCK + l] : top[l];
            for (int l = 0; l < BLOCK; l++)
                tops[g * BLOCK + l] = top[l];
        }
        const float t = kth_largest_bound(tops, blocks, k);
        for (int64_t b = 0; b < blocks; b++)
            if (tops[b] >= t) {
                const int64_t first = (b / BLOCK) * GROUP + b % BLOCK;
                for (int r = 0; r < BLOCK; r++)
                    if (x[first + r * BLOCK] >= t)
                        pool[n++] = (entry){x[first + r * BLOCK], first + r * BLOCK};
            }
        for (int64_t j = groups * GROUP; j < cols; j++)
            if (x[j] >= t)
                pool[n++] = (entry){x[j], j};
    }
    if (n < k) {   /* short rows, or fewer than k numbers (NaN): every score is a candidate */
        n = 0;
        for (int64_t j = 0; j < cols; j++)
            pool[n++] = (entry){x[j], j};
    }
    select_entries(pool, n, k, heap);
    for (int64_t m = k; m > 0; m--) {   /* pop the worst into the last free place: best first */
        values[m - 1] = heap[0].value;
        indices[m - 1] = heap[0].index;
        heap[0] = heap[m - 1];
        sift_down(heap, m - 1, 0);
    }
}

/* values [rows, k], indices [rows, k] for x [rows, cols] (rows `stride` apart), 0 < k <= cols. Returns 0, or -1 when
 * memory for the heaps runs out. */
int top_k_f32(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t k, float *values,
              int64_t *indices, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) if (rows > 1) reduction(| : failed)
    {
        entry *heap = malloc(sizeof(entry) * (size_t)k), *pool = malloc(sizeof(entry) * (size_t)cols);
        float *tops = malloc(sizeof(float) * (size_t)(cols / BLOCK + 1));
        const int ready = heap != NULL && pool != NULL && tops != NULL;
        failed = !ready;
#pragma omp for schedule(static)
        for (int64_t m = 0; m < rows; m++)
            if (ready)
                row_top_k(x + m * stride, cols, k, heap, pool, tops, values + m * k, indices + m * k);
        free(heap);
        free(pool);
        free(tops);
    }
    return failed ? -1 : 0;
}

/* Each row's sum: BLOCK running sums over the row's columns in turn, the rest of the row after them, then the running
 * sums added pairwise. A row is one thread's, so its bits are the same alone or among any other rows; torch's sum
 * splits a lone row's columns between threads, and a sampled request's draw then depends on its batch. */
void row_sums_f32(const float *x, int64_t rows, int64_t cols, int64_t stride, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t m = 0; m < rows; m++) {
        const float *row = x + m * stride;
        float sums[BLOCK] = {0}, rest = 0.0f;
        int64_t j = 0;
        for (; j + BLOCK <= cols; j += BLOCK)
            for (int l = 0; l < BLOCK; l++)
                sums[l] += row[j + l];
        for (; j < cols; j++)
            rest += row[j];
        for (int width = BLOCK / 2; width > 0; width /= 2)
            for (int l = 0; l < width; l++)
                sums[l] += sums[l + width];
        out[m] = sums[0] + rest;
    }
}

/* BLOCK lanes in GCC's vector types: one AVX-512 register, two AVX2 ones, four SSE ones. */
typedef float lanes_f __attribute__((vector_size(BLOCK * sizeof(float))));
typedef int32_t lanes_i __attribute__((vector_size(BLOCK * sizeof(int32_t))));

#define EXP_MIN (-87.33654f)   /* below it exp underflows: such lanes (and -inf) give 0 */

/* exp(x) for x <= 0 in every lane, in place, 0 below EXP_MIN: Cephes' single-precision polynomial on x - n ln 2,
 * scaled by 2^n (within 2 ulp of expf). By pointer: a vector argument's ABI differs between CPUs' builds. */
static inline void exp_lanes(lanes_f *out) {
    lanes_f x = *out;
    const lanes_i under = x < EXP_MIN;
    x = (lanes_f)(((lanes_i)x & ~under) | ((lanes_i)(x - x + EXP_MIN) & under));
    const lanes_i n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, lanes_i);   /* round(x / ln 2) */
    const lanes_f nf = __builtin_convertvector(n, lanes_f);
    lanes_f r = x - nf * 0.693359375f;
    r = r - nf * -2.12194440e-4f;
    lanes_f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const lanes_f scale = (lanes_f)((n + 127) << 23);
    *out = (lanes_f)((lanes_i)(p * scale) & ~under);
}

/* Each row's sum of exp(x - row_max[m]) (top-p's normaliser over scores, row_max at least every score) in one pass:
 * BLOCK running sums, the rest of the row after them, then the running sums added pairwise, so a row's bits are the
 * same alone or among any rows. */
void exp_sums_f32(const float *x, int64_t rows, int64_t cols, int64_t stride, const float *row_max, float *out,
                  int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t m = 0; m < rows; m++) {
        const float *row = x + m * stride;
        const float top = row_max[m];
        lanes_f sums = {0};
        float rest = 0.0f;
        int64_t j = 0;
        for (; j + BLOCK <= cols; j += BLOCK) {
            lanes_f v;
            memcpy(&v, row + j, sizeof v);
            v -= top;
            exp_lanes(&v);
            sums += v;
        }
        for (; j < cols; j++)
            rest += row[j] - top < EXP_MIN ? 0.0f : expf(row[j] - top);
        for (int width = BLOCK / 2; width > 0; width /= 2)
            for (int l = 0; l < width; l++)
                sums[l] += sums[l + width];
        out[m] = sums[0] + rest;
    }
}

/* Each row's first largest score's column, as torch's max(dim=-1): the lowest column of the largest score, or of the
 * first NaN where a row has one. BLOCK lanes keep their own largest and its first column in one pass over the row. */

void first_largest_f32(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t m = 0; m < rows; m++) {
        const float *row = x + m * stride;
        lanes_f best;
        lanes_i at, odd = {0}, column;
        for (int l = 0; l < BLOCK; l++) {
            best[l] = -INFINITY;
            at[l] = -1;
            column[l] = l;
        }
        int64_t j = 0;
        for (; j + BLOCK <= cols; j += BLOCK) {
            lanes_f v;
            memcpy(&v, row + j, sizeof v);
            const lanes_i more = v > best;   /* -1 where larger; a NaN is never larger */
            odd |= v != v;
            best = (lanes_f)(((lanes_i)v & more) | ((lanes_i)best & ~more));
            at = (column & more) | (at & ~more);
            column += BLOCK;
        }
        float top = -INFINITY;
        int64_t first = -1;
        int nan = 0;
        for (int l = 0; l < BLOCK; l++) {
            nan |= odd[l] != 0;
            if (at[l] >= 0 && (best[l] > top || (best[l] == top && at[l] < first))) {
                top = best[l];
                first = at[l];
            }
        }
        for (; j < cols; j++) {   /* the tail, after every whole block: strictly larger only */
            nan |= row[j] != row[j];
            if (row[j] > top) {
                top = row[j];
                first = j;
            }
        }
        if (nan || first < 0)   /* a NaN (its first column), or a row of -inf only (column 0) */
            for (j = 0; j < cols; j++)
                if (row[j] != row[j] || (!nan && j == 0)) {
                    first = j;
                    break;
                }
        out[m] = first;
    }
}
