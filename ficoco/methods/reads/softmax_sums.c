/* The statistics of a layer's attention a method reads, from a block of its q.k products, in one pass per row
   (ficoco.methods.reads.native builds and loads this file; ficoco.methods.reads.ops calls it).

   Each row of scores is what the model's eager attention computes, with the roundings it makes:
     x = s * scale                  (rounded to bfloat16 when the scores are bfloat16: `scores * scaling`)
     p = exp(x - max x) * (1 / sum) (in float32, as torch's softmax computes it; rounded to bfloat16 again)
   and only the statistic leaves the row: its probabilities added to column sums (`colsum_*`), to the
   head-mean of its query row (`rowsum_*`), or kept where larger than the other heads' (`rowmax_*`: the head-max of
   the row, FitPrune's statistic). Torch computes the same with a pass over the whole block per op
   (scale, softmax, a float32 copy, the sum); here a row stays in the first-level cache for all of them.
   Keys at or past a row's limit are masked (probability 0), as a causal mask's -inf gives them.

   Parallel over rows with OpenMP: the library links the OpenMP runtime torch has loaded, so that both share
   one pool of threads. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to the nearest bfloat16, ties to even (finite values; -inf stays -inf), as torch converts. */
static inline float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

/* exp(x) for x <= 0, within an ulp or two of libm's: 2^n * p(r) with n = round(x / ln 2) (Cody-Waite) and a
   degree-7 polynomial. Below -87.3 (where 2^n leaves float32's normal range) it is 0; expf's denormals there are
   below every probability a bfloat16 or a sum of float32 keeps. Written without a branch, so that the compiler
   vectorises it inside every loop that inlines it (a select it cannot convert keeps the whole loop scalar: 3 ns a
   probability instead of 0.3 on a 2-core EPYC). */
__attribute__((always_inline)) static inline float exp_nonpositive(float x) {
    float clamped = x > -104.0f ? x : -104.0f;
    float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = clamped - n * 0.693145751953125f;
    r = r - n * 1.428606765330187045e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t e = (int32_t)n + 127;
    e = e > 0 ? e : 0;  /* 2^n below the normal range: a zero scale */
    uint32_t bits = (uint32_t)e << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* A row's scaled scores into `x` (bfloat16 ones rounded again after the scale, as the model's product is), and
   their largest: one pass. */
static inline float scaled_bf16(const uint16_t *restrict s, int64_t limit, float scale, float *restrict x) {
    float top = -INFINITY;
#pragma omp simd reduction(max : top)
    for (int64_t j = 0; j < limit; j++) {
        float v = round_bf16(bf16_to_f32(s[j]) * scale);
        x[j] = v;
        top = v > top ? v : top;
    }
    return top;
}

static inline float scaled_f32(const float *restrict s, int64_t limit, float scale, float *restrict x) {
    float top = -INFINITY;
#pragma omp simd reduction(max : top)
    for (int64_t j = 0; j < limit; j++) {
        float v = s[j] * scale;
        x[j] = v;
        top = v > top ? v : top;
    }
    return top;
}

/* exp(x - top) into `x`, and 1 / their sum: the softmax's numerators and its normaliser (float32). */
__attribute__((noinline)) static float exponentials(float *restrict x, int64_t limit, float top) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < limit; j++) {
        float e = exp_nonpositive(x[j] - top);
        x[j] = e;
        sum += e;
    }
    return 1.0f / sum;
}

/* total[j] += p[j] = x[j] * inverse (rounded to bfloat16 with `round`): the probabilities go straight into the
   statistic, in the same order of operations as a pass that stores them first. */
static inline void add_probabilities(const float *restrict x, int64_t limit, float inverse, int round,
                                     float *restrict total) {
    if (round) {
#pragma omp simd
        for (int64_t j = 0; j < limit; j++) total[j] += round_bf16(x[j] * inverse);
    } else {
#pragma omp simd
        for (int64_t j = 0; j < limit; j++) total[j] += x[j] * inverse;
    }
}

/* total[j] = max(total[j], p[j]), p as `add_probabilities` computes it: the head-max of a row, heads in order (a
   maximum takes any order: the same value as torch's amax over the heads). */
static inline void max_probabilities(const float *restrict x, int64_t limit, float inverse, int round,
                                     float *restrict total) {
    if (round) {
#pragma omp simd
        for (int64_t j = 0; j < limit; j++) {
            float p = round_bf16(x[j] * inverse);
            total[j] = p > total[j] ? p : total[j];
        }
    } else {
#pragma omp simd
        for (int64_t j = 0; j < limit; j++) {
            float p = x[j] * inverse;
            total[j] = p > total[j] ? p : total[j];
        }
    }
}

/* The scaled row at `offset` of the block into `x` (its first `limit` keys) and its largest score. */
static inline float load_row(const void *scores, int bf16, int64_t offset, int64_t limit, float scale, float *x) {
    return bf16 ? scaled_bf16((const uint16_t *)scores + offset, limit, scale, x)
                : scaled_f32((const float *)scores + offset, limit, scale, x);
}

/* Row r of a block of `rows` rows of `keys` scores sees keys [0, limit): limits[r] where given, else all. */
static inline int64_t row_limit(const int64_t *limits, int64_t r, int64_t keys) {
    if (!limits) return keys;
    int64_t limit = limits[r];
    return limit < 0 ? 0 : (limit > keys ? keys : limit);
}

/* columns[j] += sum over the `rows` rows of p[r, j]: each thread sums its rows in float32 (as torch's sum over a
   block does), the threads' sums are added in double. limits: per row, or NULL. */
static void colsum(const void *scores, int bf16, int64_t rows, int64_t keys, float scale, const int64_t *limits,
                   double *columns, int threads) {
    int round = bf16;
#pragma omp parallel num_threads(threads)
    {
        float *x = malloc(sizeof(float) * (size_t)(keys > 0 ? keys : 1));
        float *partial = calloc((size_t)(keys > 0 ? keys : 1), sizeof(float));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            int64_t limit = row_limit(limits, r, keys);
            if (limit == 0) continue;  /* no visible key: the masked softmax's NaN row, read as zeros */
            float top = load_row(scores, bf16, r * keys, limit, scale, x);
            add_probabilities(x, limit, exponentials(x, limit, top), round, partial);
        }
#pragma omp critical
        for (int64_t j = 0; j < keys; j++) columns[j] += (double)partial[j];
        free(x);
        free(partial);
    }
}

/* The block is (batch, heads, width, keys): out[b, w, j] += sum over heads of p[b, h, w, j] (float32, heads in
   order, as torch's sum over the head axes), or with `max`, out[b, w, j] = the largest of out[b, w, j] (zero, as
   the caller fills it) and every head's p[b, h, w, j]. limits: per (b, w), or NULL. */
static void rowsum(const void *scores, int bf16, int64_t batch, int64_t heads, int64_t width, int64_t keys,
                   float scale, const int64_t *limits, float *out, int threads, int max) {
    int round = bf16;
#pragma omp parallel num_threads(threads)
    {
        float *x = malloc(sizeof(float) * (size_t)(keys > 0 ? keys : 1));
#pragma omp for schedule(static)
        for (int64_t bw = 0; bw < batch * width; bw++) {
            int64_t b = bw / width, w = bw % width;
            int64_t limit = row_limit(limits, bw, keys);
            float *target = out + bw * keys;
            for (int64_t h = 0; h < heads && limit > 0; h++) {
                int64_t offset = ((b * heads + h) * width + w) * keys;
                float top = load_row(scores, bf16, offset, limit, scale, x);
                float inverse = exponentials(x, limit, top);
                if (max)
                    max_probabilities(x, limit, inverse, round, target);
                else
                    add_probabilities(x, limit, inverse, round, target);
            }
        }
        free(x);
    }
}

void ficoco_colsum_bf16(const uint16_t *scores, int64_t rows, int64_t keys, float scale, const int64_t *limits,
                        double *columns, int threads) {
    colsum(scores, 1, rows, keys, scale, limits, columns, threads);
}

void ficoco_colsum_f32(const float *scores, int64_t rows, int64_t keys, float scale, const int64_t *limits,
                       double *columns, int threads) {
    colsum(scores, 0, rows, keys, scale, limits, columns, threads);
}

void ficoco_rowsum_bf16(const uint16_t *scores, int64_t batch, int64_t heads, int64_t width, int64_t keys,
                        float scale, const int64_t *limits, float *out, int threads) {
    rowsum(scores, 1, batch, heads, width, keys, scale, limits, out, threads, 0);
}

void ficoco_rowsum_f32(const float *scores, int64_t batch, int64_t heads, int64_t width, int64_t keys, float scale,
                       const int64_t *limits, float *out, int threads) {
    rowsum(scores, 0, batch, heads, width, keys, scale, limits, out, threads, 0);
}

void ficoco_rowmax_bf16(const uint16_t *scores, int64_t batch, int64_t heads, int64_t width, int64_t keys,
                        float scale, const int64_t *limits, float *out, int threads) {
    rowsum(scores, 1, batch, heads, width, keys, scale, limits, out, threads, 1);
}

void ficoco_rowmax_f32(const float *scores, int64_t batch, int64_t heads, int64_t width, int64_t keys, float scale,
                       const int64_t *limits, float *out, int threads) {
    rowsum(scores, 0, batch, heads, width, keys, scale, limits, out, threads, 1);
}

/* The probabilities p = x * inverse of a scaled row (rounded to bfloat16 with `round`) written over its scores in
   their own dtype, zero at or past the row's limit (a masked key's weight in P.V), and added to (or, with `max`, kept
   where larger in) `target` when given: one pass, the row still in cache. */
static inline void store_probabilities(const float *restrict x, int64_t limit, int64_t keys, float inverse, int bf16,
                                       void *row, float *restrict target, int max) {
    if (bf16) {
        uint16_t *restrict out = (uint16_t *)row;
#pragma omp simd
        for (int64_t j = 0; j < limit; j++) {
            float p = round_bf16(x[j] * inverse);
            uint32_t u;
            memcpy(&u, &p, 4);
            out[j] = (uint16_t)(u >> 16);
            if (target) target[j] = max ? (p > target[j] ? p : target[j]) : target[j] + p;
        }
        for (int64_t j = limit; j < keys; j++) out[j] = 0;
    } else {
        float *restrict out = (float *)row;
#pragma omp simd
        for (int64_t j = 0; j < limit; j++) {
            float p = x[j] * inverse;
            out[j] = p;
            if (target) target[j] = max ? (p > target[j] ? p : target[j]) : target[j] + p;
        }
        for (int64_t j = limit; j < keys; j++) out[j] = 0.0f;
    }
}

/* The softmax of a block of scores (batch, heads, width, keys), in place, for the product P.V that gives the layer's
   output, and the statistic a method reads of it in the same pass: `combined` (float32, NULL: none) gets at
   [b * batch_stride + w * row_stride + j] the sum over heads of p[b, h, w, j] (heads in order), or their largest with
   `max`. limits: per (b, w), or NULL. */
static void attend(void *scores, int bf16, int64_t batch, int64_t heads, int64_t width, int64_t keys, float scale,
                   const int64_t *limits, float *combined, int64_t batch_stride, int64_t row_stride, int max,
                   int threads) {
    size_t element = bf16 ? 2 : 4;
#pragma omp parallel num_threads(threads)
    {
        float *x = malloc(sizeof(float) * (size_t)(keys > 0 ? keys : 1));
#pragma omp for schedule(static)
        for (int64_t bw = 0; bw < batch * width; bw++) {
            int64_t b = bw / width, w = bw % width;
            int64_t limit = row_limit(limits, bw, keys);
            float *target = combined ? combined + b * batch_stride + w * row_stride : NULL;
            for (int64_t h = 0; h < heads; h++) {
                int64_t offset = ((b * heads + h) * width + w) * keys;
                char *row = (char *)scores + (size_t)offset * element;
                if (limit == 0) {  /* no visible key: a zero row (the masked softmax's NaN, read as zeros) */
                    memset(row, 0, (size_t)keys * element);
                    continue;
                }
                float top = load_row(scores, bf16, offset, limit, scale, x);
                float inverse = exponentials(x, limit, top);
                store_probabilities(x, limit, keys, inverse, bf16, row, target, max);
            }
        }
        free(x);
    }
}

void ficoco_attend_bf16(uint16_t *scores, int64_t batch, int64_t heads, int64_t width, int64_t keys, float scale,
                        const int64_t *limits, float *combined, int64_t batch_stride, int64_t row_stride, int max,
                        int threads) {
    attend(scores, 1, batch, heads, width, keys, scale, limits, combined, batch_stride, row_stride, max, threads);
}

void ficoco_attend_f32(float *scores, int64_t batch, int64_t heads, int64_t width, int64_t keys, float scale,
                       const int64_t *limits, float *combined, int64_t batch_stride, int64_t row_stride, int max,
                       int threads) {
    attend(scores, 0, batch, heads, width, keys, scale, limits, combined, batch_stride, row_stride, max, threads);
}

/* The version of this file's interface; the loader checks it. */
int ficoco_reads_abi(void) { return 3; }
