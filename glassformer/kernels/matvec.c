/* Matrix-vector products for decoding (seed 000 §2.5.1: decode is memory-bound).
 *
 * Decoding one token multiplies a few activation rows x (B, in), B = 1..8, by every weight
 * matrix W (out, in) of the model: y = x W^T. Each weight is read once and used B times, so
 * the time is the time to stream the weights from memory. torch's batch-1 F.linear reaches
 * about a third of this machine's memory bandwidth; these loops read each weight row once,
 * contiguously, and take the dot products with all B activation rows while the row is in
 * L1 cache. Rows are split across threads with OpenMP (torch's own libgomp at run time).
 *
 * Three weight storages, the same loop:
 *   f32   4 bytes per weight
 *   bf16  2 bytes: the top half of an fp32 (shift left 16 to get the float back)
 *   int8  1 byte, times an fp32 scale per output row, or per row and group of columns
 *         (symmetric quantization; glassformer/nn/quant.py)
 * Activations and outputs are fp32; accumulation is fp32 in SIMD vectors: 16 lanes with
 * AVX-512, else 8 with AVX2 (glassformer/kernels/build.py picks the flags for the CPU).
 *
 * Built by glassformer/kernels/build.py with `cc -O3 -mavx2 -mfma [-mavx512f -mavx512bw]
 * -fopenmp` and called through ctypes; the plain torch path is the reference it is tested
 * against.
 */
#include <stdlib.h>

#include "groups.h"
#include "simd.h"

/* One function per storage. scale is NULL (f32, bf16) or holds one float per output row and
 * group of `group` columns (int8): row o's columns [g*group, (g+1)*group) are multiplied by
 * scale[o * (in / group) + g]; group = in is per-channel scaling. `in` and `group` must be
 * multiples of 32 (checked by the caller). */
#define DEFINE_MATVEC(NAME, WTYPE, DOT)                                                       \
    void NAME(const float *x, const WTYPE *w, const float *scale, float *y, int64_t rows,     \
              int64_t in, int64_t out, int64_t group, int n_threads) {                        \
        const int64_t n_groups = in / group;                                                   \
        _Pragma("omp parallel for num_threads(n_threads) schedule(static)")                   \
        for (int64_t o = 0; o < out; ++o)                                                      \
            for (int64_t b = 0; b < rows; ++b)                                                 \
                y[b * out + o] = vec_sum(DOT(w + o * in, x + b * in,                           \
                                             scale ? scale + o * n_groups : 0, in, group));    \
    }

DEFINE_MATVEC(matvec_f32, float, dot_f32)
static DEFINE_MATVEC(bf16_ordered, uint16_t, dot_bf16)
DEFINE_MATVEC(matvec_int8, int8_t, dot_int8)

/* bf16's dot products take x in bf16_order (simd.h): x's rows put in it once for all rows of w */
void matvec_bf16(const float *x, const uint16_t *w, const float *scale, float *y, int64_t rows,
                 int64_t in, int64_t out, int64_t group, int n_threads) {
    float *ordered = aligned_alloc(64, (size_t)((rows * in * 4 + 63) / 64 * 64));
    if (!ordered) { /* no memory for every row at once: one row at a time, on the stack */
        float row[in];
        for (int64_t b = 0; b < rows; ++b) {
            bf16_order(x + b * in, row, in);
            bf16_ordered(row, w, scale, y + b * out, 1, in, out, group, n_threads);
        }
        return;
    }
    for (int64_t b = 0; b < rows; ++b) bf16_order(x + b * in, ordered + b * in, in);
    bf16_ordered(ordered, w, scale, y, rows, in, out, group, n_threads);
    free(ordered);
}

/* int4 (groups.h's dot_q4): w is (out, in / 2) bytes, scale and mins (out, in / 32). `in` must
 * be a multiple of 32. x's rows are `stride` floats apart, as dot_q4 takes them. */
static void q4_rows(const float *x, int64_t stride, const uint8_t *w, const float *scale,
                    const float *mins, float *y, int64_t rows, int64_t in, int64_t out,
                    int n_threads) {
    const int64_t n_groups = in / 32;
#pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t o = 0; o < out; ++o)
        for (int64_t b = 0; b < rows; ++b)
            y[b * out + o] = vec_sum(dot_q4(w + o * (in / 2), x + b * stride,
                                            scale + o * n_groups, mins + o * n_groups, in));
}

void matvec_q4(const float *x, const uint8_t *w, const float *scale, const float *mins, float *y,
               int64_t rows, int64_t in, int64_t out, int n_threads) {
#if Q4_PREPARED /* AVX2: x's rows put as dot_q4 takes them (groups.h) once for all rows of w */
    const int64_t n = q4_prepared_floats(in);
    float *prepared = aligned_alloc(64, (size_t)((rows * n * 4 + 63) / 64 * 64));
    if (!prepared) { /* no memory for every row at once: one row at a time, on the stack */
        float row[n];
        for (int64_t b = 0; b < rows; ++b) {
            q4_prepare(x + b * in, in, row);
            q4_rows(row, n, w, scale, mins, y + b * out, 1, in, out, n_threads);
        }
        return;
    }
    for (int64_t b = 0; b < rows; ++b) q4_prepare(x + b * in, in, prepared + b * n);
    q4_rows(prepared, n, w, scale, mins, y, rows, in, out, n_threads);
    free(prepared);
#else
    q4_rows(x, in, w, scale, mins, y, rows, in, out, n_threads);
#endif
}

/* Dequantization for matrix-matrix products (prefill): rows [0, rows) of an int8 or int4
 * weight into fp32 `out` (rows, in), in the same arithmetic as the torch reference
 * (kernels.dequantize): q * scale, and scale * q + min. The caller hands a small slice of rows
 * at a time, so `out` stays in cache until torch's matmul reads it. */
void dequant_int8(const int8_t *w, const float *scale, float *out, int64_t rows, int64_t in,
                  int64_t group, int n_threads) {
    const int64_t n_groups = in / group;
#pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t o = 0; o < rows; ++o)
        for (int64_t g = 0; g < n_groups; ++g) {
            const float s = scale[o * n_groups + g];
            const int8_t *q = w + o * in + g * group;
            float *dst = out + o * in + g * group;
            for (int64_t i = 0; i < group; ++i) dst[i] = (float)q[i] * s;
        }
}

/* Each group's 32 weights scale * q + min, as the decode step's dot products take them
 * (groups.h's q4_weights), so prefill multiplies the same numbers. */
void dequant_q4(const uint8_t *w, const float *scale, const float *mins, float *out,
                int64_t rows, int64_t in, int n_threads) {
    const int64_t n_groups = in / 32;
#pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t o = 0; o < rows; ++o)
        for (int64_t g = 0; g < n_groups; ++g) {
            vec weights[Q4_VECS];
            float *dst = out + o * in + g * 32;
            q4_weights(w + o * (in / 2), g, scale + o * n_groups, mins + o * n_groups, weights);
            for (int i = 0; i < Q4_VECS; ++i) vec_store(dst + i * LANES, weights[i]);
        }
}

/* 1 if none of x's n floats is a NaN or an infinity, else 0: v * 0 is 0 for a finite v and
 * NaN for the others, and a NaN stays in a sum. One FMA a vector, four sums in flight; the
 * engine asks it of every step's logits (SmolLM2: 49,152 floats, under a microsecond against
 * torch's sum and isfinite at 20-60 us). */
int all_finite(const float *x, int64_t n) {
    vec acc[4] = {vec_zero(), vec_zero(), vec_zero(), vec_zero()};
    const vec zero = vec_zero();
    int64_t i = 0;
    for (; i + 4 * LANES <= n; i += 4 * LANES)
        for (int k = 0; k < 4; ++k) acc[k] = vec_fma(vec_load(x + i + k * LANES), zero, acc[k]);
    for (; i + LANES <= n; i += LANES) acc[0] = vec_fma(vec_load(x + i), zero, acc[0]);
    float sum = vec_sum(vec_add(vec_add(acc[0], acc[1]), vec_add(acc[2], acc[3])));
    for (; i < n; ++i) sum += x[i] * 0.0f;
    return sum == 0.0f;
}

/* out[r] = the index of the largest of x's row r (n floats), the first where several are equal,
 * as torch.argmax (simd.h's best_of); -1 for a row holding a NaN (torch's answer is the NaN's
 * index: the caller asks torch). Returns how many rows held one. For greedy decoding's pick
 * over a vocabulary's logits (SmolLM2: 49,152 floats), where torch's argmax took 66 us a row. */
int64_t argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
    int64_t with_nan = 0;
    for (int64_t r = 0; r < rows; ++r) {
        float best;
        const int nan = best_of(x + r * n, n, &best, &out[r]) & HAS_NAN;
        if (nan) out[r] = -1;
        with_nan += nan != 0;
    }
    return with_nan;
}
