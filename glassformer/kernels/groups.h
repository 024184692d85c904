/* The dot products of int8 and int4 weight rows, whose weights come in groups of columns with
 * a scale each (and int4 a min): one row with x, and one row with up to MAX_TILE inputs at
 * once, in lanes as simd.h's fp32 and bf16 ones. decode.c's linear and matvec.c's matvec_int8
 * and matvec_q4 call them; a8.h's rows with rounded inputs share the int4 prefetch. */
#ifndef GLASSFORMER_GROUPS_H
#define GLASSFORMER_GROUPS_H
#include "simd.h"

/* Scaled groups in flight. int8 and int4 rows carry one scale per group of columns, and a row's
 * dot product is sum_g scale_g * (q_g . x_g). With one running total, each group's scaling FMA
 * waits for the previous group's (4 cycles a group: for int4's 32 weights in 16 bytes, a cap of
 * 4 bytes a cycle, a third of what the memory gives). So group g goes into total g % IN_FLIGHT,
 * the totals are added at the end, and the groups' FMAs overlap. */
#define IN_FLIGHT (LANES == 16 ? 4 : 2)
static inline vec sum_in_flight(const vec t[IN_FLIGHT]) {
#if LANES == 16
    return vec_add(vec_add(t[0], t[1]), vec_add(t[2], t[3]));
#else
    return vec_add(t[0], t[1]);
#endif
}

/* int8 rows (glassformer's Int8Linear, GGUF's Q8_0): weight = q * scale, q in -127..127, one
 * scale per group of `group` columns (32 for Q8_0, 64 by default, `in` for one per row). A
 * group's q . x is summed in lanes, 32 columns at a time, alternating over two partial sums
 * (so a long group is not one chain of additions either). */
#define INT8_VECS (32 / LANES)
static inline void int8_load32(const int8_t *w, vec q[INT8_VECS]) { /* 32 weights as floats */
    if (((uintptr_t)w & 63) < 32) prefetch_ahead(w); /* once a line, however the rows align */
    for (int i = 0; i < INT8_VECS; ++i) q[i] = load_int8(w + i * LANES);
}
static inline vec int8_dot32(const vec q[INT8_VECS], const float *x) { /* q . x, in lanes */
    vec acc = vec_mul(q[0], vec_load(x));
    for (int i = 1; i < INT8_VECS; ++i) acc = vec_fma(q[i], vec_load(x + i * LANES), acc);
    return acc;
}
/* A group's chunks of 32 go to partial a (even chunks) or b (odd ones). */
static inline vec int8_group(const int8_t *w, const float *x, int64_t group) {
    vec a = vec_zero(), b = vec_zero(), q[INT8_VECS];
    for (int64_t c = 0; c < group / 32; ++c) {
        int8_load32(w + 32 * c, q);
        const vec p = int8_dot32(q, x + 32 * c);
        if (c % 2 == 0) a = c == 0 ? p : vec_add(a, p);
        else b = c == 1 ? p : vec_add(b, p);
    }
    return group == 32 ? a : vec_add(a, b);
}
/* int8_group for R inputs (up to MAX_TILE), each 32 weights converted once for all of them */
static inline __attribute__((always_inline)) void int8_group_tile(
    const int8_t *w, const float *x, int64_t x_stride, int64_t group, const int R,
    vec out[MAX_TILE]) {
    vec a[MAX_TILE], b[MAX_TILE], q[INT8_VECS];
    for (int64_t c = 0; c < group / 32; ++c) {
        int8_load32(w + 32 * c, q);
        for (int r = 0; r < R; ++r) {
            const vec p = int8_dot32(q, x + r * x_stride + 32 * c);
            if (c % 2 == 0) a[r] = c == 0 ? p : vec_add(a[r], p);
            else b[r] = c == 1 ? p : vec_add(b[r], p);
        }
    }
    for (int r = 0; r < R; ++r) out[r] = group == 32 ? a[r] : vec_add(a[r], b[r]);
}

/* total + scale_g * (q_g . x_g) for group g */
static inline vec int8_scaled(const int8_t *w_row, const float *x, const float *scale_row,
                              int64_t g, int64_t group, vec total) {
    const vec scale = vec_set1(scale_row ? scale_row[g] : 1.0f);
    return vec_fma(int8_group(w_row + g * group, x + g * group, group), scale, total);
}

/* dot_int8 for one group size; always inlined, so a constant `group` folds the group's loop
 * and branches away */
static inline __attribute__((always_inline)) vec dot_int8_of(
    const int8_t *w_row, const float *x, const float *scale_row, int64_t in, int64_t group) {
    vec total[IN_FLIGHT];
    for (int k = 0; k < IN_FLIGHT; ++k) total[k] = vec_zero();
    const int64_t n = in / group;
    int64_t g = 0;
    for (; g + IN_FLIGHT <= n; g += IN_FLIGHT) /* whole rounds, k a constant: registers */
        for (int k = 0; k < IN_FLIGHT; ++k)
            total[k] = int8_scaled(w_row, x, scale_row, g + k, group, total[k]);
    for (int k = 0; k < IN_FLIGHT; ++k) /* the last groups, fewer than a round */
        if (g + k < n) total[k] = int8_scaled(w_row, x, scale_row, g + k, group, total[k]);
    return sum_in_flight(total);
}

/* One copy per common group size (32: Q8_0; 64: Int8Linear's default), each compiled with the
 * size a constant. With `group` a variable the loops and branches stay, and in the tile below
 * GCC kept the partial sums and totals on the stack, a load and a store per group and input
 * (perf annotate): a 32-row step of a Q8_0 SmolLM2 took 137-142 ms, 115-123 ms with the copies;
 * one row 10.9-11.9 ms, 9.1-10.0. */
static inline vec dot_int8(const int8_t *w_row, const float *x, const float *scale_row,
                             int64_t in, int64_t group) {
    if (group == 32) return dot_int8_of(w_row, x, scale_row, in, 32);
    if (group == 64) return dot_int8_of(w_row, x, scale_row, in, 64);
    return dot_int8_of(w_row, x, scale_row, in, group);
}

/* total[r][k] + scale_g * (q_g . x_r,g) for group g and each of the R inputs */
static inline __attribute__((always_inline)) void int8_scaled_tile(
    const int8_t *w_row, const float *x, int64_t x_stride, const float *scale_row, int64_t g,
    int64_t group, int k, const int R, vec total[MAX_TILE][IN_FLIGHT]) {
    const vec scale = vec_set1(scale_row ? scale_row[g] : 1.0f);
    vec sums[MAX_TILE];
    int8_group_tile(w_row + g * group, x + g * group, x_stride, group, R, sums);
    for (int r = 0; r < R; ++r) total[r][k] = vec_fma(sums[r], scale, total[r][k]);
}

/* dot_int8 of one weight row with R inputs (x + r * x_stride, R up to MAX_TILE) into out[r],
 * bit for bit what dot_int8 gives each alone: whole rounds of IN_FLIGHT groups as there, k a
 * constant in each, so the totals can live in registers. Inlined per group size and R, as
 * dot_int8_of. */
static inline __attribute__((always_inline)) void dot_int8_tile_of(
    const int8_t *w_row, const float *x, int64_t x_stride, const float *scale_row, int64_t in,
    int64_t group, const int R, float *out) {
    vec total[MAX_TILE][IN_FLIGHT];
    for (int r = 0; r < R; ++r)
        for (int k = 0; k < IN_FLIGHT; ++k) total[r][k] = vec_zero();
    const int64_t n = in / group;
    int64_t g = 0;
    for (; g + IN_FLIGHT <= n; g += IN_FLIGHT)
        for (int k = 0; k < IN_FLIGHT; ++k)
            int8_scaled_tile(w_row, x, x_stride, scale_row, g + k, group, k, R, total);
    for (int k = 0; k < IN_FLIGHT; ++k)
        if (g + k < n) int8_scaled_tile(w_row, x, x_stride, scale_row, g + k, group, k, R, total);
    for (int r = 0; r < R; ++r) out[r] = vec_sum(sum_in_flight(total[r]));
}

/* as dot_int8: one copy per common group size */
static inline __attribute__((always_inline)) void dot_int8_tile(
    const int8_t *w_row, const float *x, int64_t x_stride, const float *scale_row, int64_t in,
    int64_t group, const int R, float *out) {
    if (group == 32) dot_int8_tile_of(w_row, x, x_stride, scale_row, in, 32, R, out);
    else if (group == 64) dot_int8_tile_of(w_row, x, x_stride, scale_row, in, 64, R, out);
    else dot_int8_tile_of(w_row, x, x_stride, scale_row, in, group, R, out);
}

/* int4 rows (GGUF's Q4_0 / Q4_1 / Q4_K, glassformer/nn/quant.py's Int4Linear): a group of 32
 * weights in 16 bytes, byte j holding weight j in its low nibble and weight j + 16 in its high
 * one (GGUF's order), each weight scale * q + min with q in 0..15 and one scale and one min per
 * group. A row's dot product with x is the plain one with those dequantized weights. With
 * AVX-512 a group's 16 possible values are a table, table[q] = scale * q + min (one FMA, the
 * rounding of matvec.c's dequant_q4), and its nibbles pick from it (vpermps); AVX2 has no such
 * table and sums the same products another way (below). The table replaced scale * (q . x) +
 * min * sum(x) group by group on AVX-512: a third vector operation per input and group in the
 * batched tile, and x's group sums with a barrier before every batched int4 product: 32 rows of
 * SmolLM2 Q4_1 step in 72.8-74.2 against 81.4-85.8 ms, one row 4.79-4.83 against 4.64-4.99 ms
 * (3 pairs in alternation). */
static inline void q4_weights(const uint8_t *w_row, int64_t g, const float *scale_row,
                              const float *min_row, vec w[Q4_VECS]) {
    if (g % 4 == 0) prefetch_ahead(w_row + 16 * g); /* one line: four groups */
    q4_unpack(w_row + 16 * g, scale_row[g], min_row[g], w);
}

/* A row's scales and mins are more streams beside its weights: ask for those of the row
 * Q4_AHEAD rows on, as prefetch_ahead does for the weights (SmolLM2 int4, one row: 7.4-7.8 ->
 * 7.1-7.3 ms per step). */
#define Q4_AHEAD 8
static inline void q4_prefetch_groups(const float *scale_row, const float *min_row, int64_t n) {
    prefetch_floats(scale_row + Q4_AHEAD * n, n);
    prefetch_floats(min_row + Q4_AHEAD * n, n);
}

/* How a group of 32 weights meets x, per SIMD width: q4_group loads group g as the products take
 * it, q4_products adds its products with one input to a running total, q4_finish turns a row's
 * totals into its dot product in lanes. dot_q4 and dot_q4_tile below are the same loops for
 * both widths. */
#if LANES == 16
#define Q4_PREPARED 0 /* dot_q4 takes x as it is */

/* the group's weights, dequantized (q4_weights above) */
static inline void q4_group(const uint8_t *w_row, int64_t g, const float *scale_row,
                            const float *min_row, vec w[Q4_VECS]) {
    q4_weights(w_row, g, scale_row, min_row, w);
}

/* total + w_g . x_g, lane by lane */
static inline vec q4_products(const vec w[Q4_VECS], const float *x_row, int64_t g,
                              const float *scale_row, vec total) {
    (void)scale_row; /* in the weights already */
    for (int i = 0; i < Q4_VECS; ++i)
        total = vec_fma(w[i], vec_load(x_row + 32 * g + i * LANES), total);
    return total;
}

static inline vec q4_finish(const vec total[IN_FLIGHT], const float *min_row, const float *x_row,
                            int64_t in) {
    (void)min_row, (void)x_row, (void)in; /* the mins too */
    return sum_in_flight(total);
}
#else
/* AVX2 has no 16-entry table: its lanes hold 8 floats, and turning every weight into scale * q +
 * min cost 14 of a group's 18 vector operations on the two ports that also run the FMAs (two
 * shifts, four conversions, four FMAs for the weights, four for the products), so an int4 step
 * took 0.48-0.75 of a read of its bytes (benchmarks/step_bandwidth.py). Here the dot is
 * scale * (q . x) + min * sum(x) group by group, the same sum of the same dequantized weights'
 * products in another order, and the nibbles become floats without a shift: a byte masked with
 * 0xf0 is 16 times its high nibble, exactly, and meets x / 16 (q4_prepare), so each product is
 * q x itself. A group: two widening loads, four masks, four conversions, four FMAs and the
 * scale's one; the mins' term is one FMA per 8 groups with x's group sums (q4_mins). */
#define Q4_PREPARED 1 /* dot_q4 takes x as q4_prepare leaves it */

/* Floats q4_prepare writes for `in` inputs: x's in values, then its in / 32 group sums padded
 * with zeros to whole vectors. */
static inline int64_t q4_prepared_floats(int64_t in) {
    return in + (in / 32 + LANES - 1) / LANES * LANES;
}

/* x as dot_q4 takes it: each group's first 16 values as they are, its last 16 times 1/16 (a
 * power of two: exact, but for values below 2^-122, which lose bits as subnormals), then the
 * groups' sums of x as it was. */
static inline void q4_prepare(const float *x, int64_t in, float *out) {
    const int64_t n = in / 32, padded = q4_prepared_floats(in) - in;
    const vec sixteenth = vec_set1(0.0625f);
    for (int64_t g = 0; g < n; ++g) {
        const float *v = x + 32 * g;
        const vec a = vec_load(v), b = vec_load(v + 8), c = vec_load(v + 16), d = vec_load(v + 24);
        vec_store(out + 32 * g, a);
        vec_store(out + 32 * g + 8, b);
        vec_store(out + 32 * g + 16, vec_mul(c, sixteenth));
        vec_store(out + 32 * g + 24, vec_mul(d, sixteenth));
        out[in + g] = vec_sum(vec_add(vec_add(a, b), vec_add(c, d)));
    }
    for (int64_t g = n; g < padded; ++g) out[in + g] = 0.0f;
}

/* Group g's nibbles as floats: weights 0-15 their q, weights 16-31 16 q (see above) */
static inline void q4_group(const uint8_t *w_row, int64_t g, const float *scale_row,
                            const float *min_row, vec q[Q4_VECS]) {
    (void)scale_row, (void)min_row; /* q4_products and q4_finish take them */
    if (g % 4 == 0) prefetch_ahead(w_row + 16 * g); /* one line: four groups */
    const uint8_t *bytes = w_row + 16 * g;
    const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)bytes));
    const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bytes + 8)));
    const __m256i low = _mm256_set1_epi32(0x0f), high = _mm256_set1_epi32(0xf0);
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(first, low));   /* weights 0-7 */
    q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(second, low));  /* 8-15 */
    q[2] = _mm256_cvtepi32_ps(_mm256_and_si256(first, high));  /* 16-23, times 16 */
    q[3] = _mm256_cvtepi32_ps(_mm256_and_si256(second, high)); /* 24-31, times 16 */
}

/* total + scale_g * (q_g . x_g), x prepared */
static inline vec q4_products(const vec q[Q4_VECS], const float *x_row, int64_t g,
                              const float *scale_row, vec total) {
    const float *v = x_row + 32 * g;
    vec p = vec_mul(q[0], vec_load(v));
    for (int i = 1; i < Q4_VECS; ++i) p = vec_fma(q[i], vec_load(v + 8 * i), p);
    return vec_fma(p, vec_set1(scale_row[g]), total);
}

/* sum_g min_g * sum(x_g) in lanes, from x's prepared group sums (zeros past the last group) */
static inline vec q4_mins(const float *min_row, const float *sums, int64_t n) {
    vec acc = vec_zero();
    int64_t g = 0;
    for (; g + LANES <= n; g += LANES)
        acc = vec_fma(vec_load(min_row + g), vec_load(sums + g), acc);
    if (g < n) { /* the last groups: the row's mins end here */
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - g)), lane);
        acc = vec_fma(_mm256_maskload_ps(min_row + g, mask), vec_load(sums + g), acc);
    }
    return acc;
}

static inline vec q4_finish(const vec total[IN_FLIGHT], const float *min_row, const float *x_row,
                            int64_t in) {
    return vec_add(sum_in_flight(total), q4_mins(min_row, x_row + in, in / 32));
}
#endif

static inline vec dot_q4(const uint8_t *w_row, const float *x_row, const float *scale_row,
                         const float *min_row, int64_t in) {
    vec total[IN_FLIGHT], w[Q4_VECS];
    for (int k = 0; k < IN_FLIGHT; ++k) total[k] = vec_zero();
    const int64_t n = in / 32;
    q4_prefetch_groups(scale_row, min_row, n);
    int64_t g = 0;
    for (; g + IN_FLIGHT <= n; g += IN_FLIGHT) /* k a constant: the totals stay in registers */
        for (int k = 0; k < IN_FLIGHT; ++k) {
            q4_group(w_row, g + k, scale_row, min_row, w);
            total[k] = q4_products(w, x_row, g + k, scale_row, total[k]);
        }
    for (int k = 0; k < IN_FLIGHT; ++k)
        if (g + k < n) {
            q4_group(w_row, g + k, scale_row, min_row, w);
            total[k] = q4_products(w, x_row, g + k, scale_row, total[k]);
        }
    return q4_finish(total, min_row, x_row, in);
}

/* dot_q4 of one weight row with R inputs (x + r * x_stride, R up to MAX_TILE) into out[r]:
 * each group is loaded (unpacked, converted) once for all of them (unpacking, not reading, is
 * what a 4-bit dot costs), and each input's sums run in dot_q4's order, so out[r] is bit for
 * bit what dot_q4 gives it alone. Inlined with R a constant. */
static inline __attribute__((always_inline)) void dot_q4_tile(
    const uint8_t *w_row, const float *x, int64_t x_stride, const float *scale_row,
    const float *min_row, int64_t in, const int R, float *out) {
    vec total[MAX_TILE][IN_FLIGHT], w[Q4_VECS];
    for (int r = 0; r < R; ++r)
        for (int k = 0; k < IN_FLIGHT; ++k) total[r][k] = vec_zero();
    const int64_t n = in / 32;
    int64_t g = 0;
    for (; g + IN_FLIGHT <= n; g += IN_FLIGHT)
        for (int k = 0; k < IN_FLIGHT; ++k) {
            q4_group(w_row, g + k, scale_row, min_row, w);
            for (int r = 0; r < R; ++r)
                total[r][k] = q4_products(w, x + r * x_stride, g + k, scale_row, total[r][k]);
        }
    for (int k = 0; k < IN_FLIGHT; ++k)
        if (g + k < n) {
            q4_group(w_row, g + k, scale_row, min_row, w);
            for (int r = 0; r < R; ++r)
                total[r][k] = q4_products(w, x + r * x_stride, g + k, scale_row, total[r][k]);
        }
    for (int r = 0; r < R; ++r)
        out[r] = vec_sum(q4_finish(total[r], min_row, x + r * x_stride, in));
}

#endif
