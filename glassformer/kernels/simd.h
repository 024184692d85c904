/* SIMD helpers the kernels share (matvec.c, decode.c): a vector of LANES floats (16 with
 * AVX-512, else 8 with AVX2), and loads that turn LANES weights of each storage into floats.
 * f32: 4 bytes; bf16: the top half of an fp32 (shift left 16); int8: times a scale later.
 */
#ifndef GLASSFORMER_SIMD_H
#define GLASSFORMER_SIMD_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#ifdef __AVX512F__
#define LANES 16
typedef __m512 vec;
static inline vec vec_zero(void) { return _mm512_setzero_ps(); }
static inline vec vec_set1(float v) { return _mm512_set1_ps(v); }
static inline vec vec_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vec_store(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vec_add(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vec_sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vec_mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vec_div(vec a, vec b) { return _mm512_div_ps(a, b); }
static inline vec vec_fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vec_clamp(vec v, float lo, float hi) {
    return _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(lo)), _mm512_set1_ps(hi));
}
static inline vec vec_round(vec v) {
    return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vec vec_pow2(vec n) { /* 2^n for whole numbers n in -126..127: the exponent bits */
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_castsi512_ps(bits);
}
static inline float vec_sum(vec v) { return _mm512_reduce_add_ps(v); }
/* LANES weights as floats, for each storage */
static inline vec load_f32(const float *w) { return _mm512_loadu_ps(w); }
static inline vec load_bf16(const uint16_t *w) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline vec load_f16(const uint16_t *w) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)w));
}
static inline vec bf16_pair_part(const uint16_t *w, int odd) { /* see bf16_order */
    const __m512i v = _mm512_loadu_si512(w);
    return _mm512_castsi512_ps(odd ? _mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u))
                                   : _mm512_slli_epi32(v, 16));
}
static inline void bf16_order(const float *x, float *out, int64_t in) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t i = 0; i < in; i += 32) {
        const vec a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
        _mm512_storeu_ps(out + i, _mm512_permutex2var_ps(a, even, b));
        _mm512_storeu_ps(out + i + 16, _mm512_permutex2var_ps(a, odd, b));
    }
}
static inline vec load_int8(const int8_t *w) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
}
/* int4 (a group of 32 weights in 16 bytes, nibbles q): the weights scale * q + min, each picked
 * from a table of the group's 16 values by its nibble. vpermps reads only an index's low 4
 * bits: each byte widened once to an int32 is its low nibble's index as it is, and shifted right
 * by 4 its high nibble's (no masks: 4 vector operations for 32 weights' indexes, not 7). */
#define Q4_VECS 2
static inline void q4_unpack(__m128i bytes, float scale, float min, vec w[Q4_VECS]) {
    const vec q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const vec table = _mm512_fmadd_ps(q, _mm512_set1_ps(scale), _mm512_set1_ps(min));
    const __m512i index = _mm512_cvtepu8_epi32(bytes);
    w[0] = _mm512_permutexvar_ps(index, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(index, 4), table);
}
#else
#define LANES 8
typedef __m256 vec;
static inline vec vec_zero(void) { return _mm256_setzero_ps(); }
static inline vec vec_set1(float v) { return _mm256_set1_ps(v); }
static inline vec vec_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vec_store(float *p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vec_add(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vec_sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vec_mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vec_div(vec a, vec b) { return _mm256_div_ps(a, b); }
static inline vec vec_fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vec_clamp(vec v, float lo, float hi) {
    return _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(lo)), _mm256_set1_ps(hi));
}
static inline vec vec_round(vec v) {
    return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vec vec_pow2(vec n) { /* 2^n for whole numbers n in -126..127: the exponent bits */
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_castsi256_ps(bits);
}
static inline float vec_sum(vec v) { /* in vec_sum4's order, as AVX-512's reduce_add is */
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_permute_ps(h, 0x4e)); /* 0 + 2, 1 + 3 */
    h = _mm_add_ps(h, _mm_permute_ps(h, 0xb1)); /* 0 + 1 */
    return _mm_cvtss_f32(h);
}
static inline vec load_f32(const float *w) { return _mm256_loadu_ps(w); }
static inline vec load_bf16(const uint16_t *w) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline vec load_f16(const uint16_t *w) { /* F16C: every AVX2 CPU has it */
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
}
static inline vec bf16_pair_part(const uint16_t *w, int odd) { /* see bf16_order */
    const __m256i v = _mm256_loadu_si256((const __m256i *)w);
    return _mm256_castsi256_ps(odd ? _mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u))
                                   : _mm256_slli_epi32(v, 16));
}
static inline void bf16_order(const float *x, float *out, int64_t in) {
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (int64_t i = 0; i < in; i += 16) {
        const vec a = _mm256_permutevar8x32_ps(_mm256_loadu_ps(x + i), order);
        const vec b = _mm256_permutevar8x32_ps(_mm256_loadu_ps(x + i + 8), order);
        _mm256_storeu_ps(out + i, _mm256_permute2f128_ps(a, b, 0x20));
        _mm256_storeu_ps(out + i + 8, _mm256_permute2f128_ps(a, b, 0x31));
    }
}
static inline vec load_int8(const int8_t *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}
#define Q4_VECS 4 /* 16 nibbles, 8 at a time: scale * q + min, as AVX-512's table holds */
static inline vec q4_eight(__m128i nibbles, vec scale, vec min) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nibbles)), scale, min);
}
static inline void q4_unpack(__m128i bytes, float scale, float min, vec w[Q4_VECS]) {
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const vec s = _mm256_set1_ps(scale), m = _mm256_set1_ps(min);
    w[0] = q4_eight(low, s, m);
    w[1] = q4_eight(_mm_srli_si128(low, 8), s, m);
    w[2] = q4_eight(high, s, m);
    w[3] = q4_eight(_mm_srli_si128(high, 8), s, m);
}
#endif

/* e^v in every lane, within about 1 ulp of expf for v in [-87, 88] (Cephes' expf: v = n ln 2 + r
 * with |r| <= ln(2) / 2, e^r by its degree-7 polynomial, times 2^n). Outside that range v is
 * clamped to it: e^-87 and e^88 stand for 0 and infinity, which is exact enough for every caller
 * (softmax weights e^(s - max) and x / (1 + e^-x), where they change nothing in float32). */
static inline vec vec_exp(vec v) {
    v = vec_clamp(v, -87.0f, 88.0f);
    const vec n = vec_round(vec_mul(v, vec_set1(1.44269504088896341f)));
    vec r = vec_fma(n, vec_set1(-0.693359375f), v); /* ln 2 in two parts: r exact */
    r = vec_fma(n, vec_set1(2.12194440e-4f), r);
    vec p = vec_set1(1.9875691500e-4f);
    p = vec_fma(p, r, vec_set1(1.3981999507e-3f));
    p = vec_fma(p, r, vec_set1(8.3334519073e-3f));
    p = vec_fma(p, r, vec_set1(4.1665795894e-2f));
    p = vec_fma(p, r, vec_set1(1.6666665459e-1f));
    p = vec_fma(p, r, vec_set1(5.0000001201e-1f));
    p = vec_fma(p, vec_mul(r, r), vec_add(r, vec_set1(1.0f)));
    return vec_mul(p, vec_pow2(n));
}

/* The lanes of four vectors summed, each in the same order (lane i + lane i + LANES / 2, then
 * the same on the halves, and so on), so that a dot product's value is the same whichever
 * three others it is summed beside: one pass of shuffles for four dot products (four weight rows,
 * four inputs, four keys) where a sum of each alone cost more than its products' loop. */
static inline void vec_sum4(const vec v[4], float out[4]) {
#ifdef __AVX512F__
    /* [v0 lanes 0-7 + 8-15, v1 ...], [v2 ..., v3 ...] */
    const vec v01 = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x44), _mm512_shuffle_f32x4(v[0], v[1], 0xee));
    const vec v23 = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], 0x44), _mm512_shuffle_f32x4(v[2], v[3], 0xee));
    /* a 128-bit lane per vector: lanes 0-3 + 4-7 */
    vec t = _mm512_add_ps(_mm512_shuffle_f32x4(v01, v23, 0x88), _mm512_shuffle_f32x4(v01, v23, 0xdd));
    t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4e)); /* 0 + 2, 1 + 3 */
    t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xb1)); /* 0 + 1 */
    float lanes[16];
    _mm512_storeu_ps(lanes, t);
    for (int i = 0; i < 4; ++i) out[i] = lanes[4 * i];
#else
    const vec v01 = _mm256_add_ps(_mm256_permute2f128_ps(v[0], v[1], 0x20), _mm256_permute2f128_ps(v[0], v[1], 0x31));
    const vec v23 = _mm256_add_ps(_mm256_permute2f128_ps(v[2], v[3], 0x20), _mm256_permute2f128_ps(v[2], v[3], 0x31));
    float lanes[2][8];
    const vec halves[2] = {v01, v23};
    for (int h = 0; h < 2; ++h) {
        vec t = _mm256_add_ps(halves[h], _mm256_permute_ps(halves[h], 0x4e));
        t = _mm256_add_ps(t, _mm256_permute_ps(t, 0xb1));
        _mm256_storeu_ps(lanes[h], t);
    }
    for (int i = 0; i < 4; ++i) out[i] = lanes[i / 2][4 * (i % 2)];
#endif
}

/* Software prefetch: each load of weights first asks for the cache line PREFETCH_BYTES further
 * on in the same row (and, past its end, the next rows: a thread's rows are contiguous). The
 * hardware prefetcher alone left the int8 dot waiting on memory at half its instructions: one
 * thread, SmolLM2's shapes, 2 KB ahead took an int8 matrix-vector product from 0.73 to 0.87 of
 * a plain read of its bytes (1 and 4 KB: less). */
#define PREFETCH_BYTES 2048
static inline void prefetch_ahead(const void *p) {
    _mm_prefetch((const char *)p + PREFETCH_BYTES, _MM_HINT_T0);
}

/* prefetch_ahead as an instruction GCC must keep where it stands: in the batched tiles below,
 * GCC 12 dropped _mm_prefetch's from the loop (objdump), and a 32-row fp32 step waited on the
 * weights. (In the one-row loops the builtin is kept, and there it schedules better.) */
static inline void prefetch_kept(const void *p) {
    __asm__ volatile("prefetcht0 %0" : : "m"(*((const char *)p + PREFETCH_BYTES)));
}

/* n floats from p on, a line at a time */
static inline void prefetch_floats(const float *p, int64_t n) {
    for (int64_t b = 0; b < n * (int64_t)sizeof(float); b += 64)
        _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}

#define STEP 32                  /* columns per inner iteration */
#define N_ACC (STEP / LANES)     /* independent accumulators: 2 (AVX-512) or 4 (AVX2) */

/* Vector k of the STEP weights at p, as the dot products below take them. fp32: columns
 * LANES * k on. bf16: two weights share an int32 lane, and a vector of them (2 * LANES weights)
 * gives LANES floats twice: the low halves shifted left by 16 (the even columns) and the high
 * halves as they are, masked (the odd ones): two operations for 2 * LANES weights, where
 * widening each weight to 32 bits first took four. x comes in the same order (bf16_order: each
 * 2 * LANES columns, the even ones, then the odd ones). */
static inline vec load_f32_step(const float *p, int k) { return load_f32(p + LANES * k); }
static inline vec load_bf16_step(const uint16_t *p, int k) {
    return bf16_pair_part(p + 2 * LANES * (k / 2), k % 2);
}

/* The dot product of one weight row (one scale per `group` columns, or none) with x, in lanes
 * (dot_f32, dot_bf16 and dot_int8, dot_q4 below give a row's LANES partial sums; vec_sum, or
 * vec_sum4 for four rows at once, adds them in one order): several accumulators keep several
 * FMAs in flight (with one, each FMA waits for the previous one's result and the loop is
 * compute-bound, not memory-bound); each group's partial sum is scaled once. `in` and `group`
 * are multiples of STEP. */
#define DEFINE_DOT(NAME, WTYPE, LOAD)                                                         \
    static inline vec NAME(const WTYPE *w_row, const float *x_row, const float *scale_row,    \
                           int64_t in, int64_t group) {                                       \
        vec total = vec_zero();                                                               \
        for (int64_t g = 0; g < in / group; ++g) {                                            \
            vec acc[N_ACC];                                                                   \
            for (int k = 0; k < N_ACC; ++k) acc[k] = vec_zero();                              \
            for (int64_t i = g * group; i < (g + 1) * group; i += STEP) {                     \
                for (int64_t b = 0; b < STEP * (int64_t)sizeof(WTYPE); b += 64)               \
                    prefetch_ahead((const char *)(w_row + i) + b);                            \
                for (int k = 0; k < N_ACC; ++k)                                               \
                    acc[k] = vec_fma(LOAD(w_row + i, k), vec_load(x_row + i + LANES * k),     \
                                     acc[k]);                                                 \
            }                                                                                 \
            for (int k = 1; k < N_ACC; ++k) acc[0] = vec_add(acc[0], acc[k]);                 \
            total = vec_fma(acc[0], vec_set1(scale_row ? scale_row[g] : 1.0f), total);        \
        }                                                                                     \
        return total;                                                                         \
    }

DEFINE_DOT(dot_f32, float, load_f32_step)
DEFINE_DOT(dot_bf16, uint16_t, load_bf16_step) /* x in bf16_order */

/* The same dot product for W_ROWS weight rows (w_row + j * in, scales at scale_row + j * (in /
 * group)) with ROW_TILE inputs (x + r * x_stride) into out[j * ROW_TILE + r]: each LANES
 * weights loaded (and converted) once for all the inputs, each input's LANES values once for all
 * the weight rows, and each (row, input) pair accumulated in the single-input order, so every
 * out[j * ROW_TILE + r] is bit for bit what NAME gives it alone. W_ROWS (1 or OUT_TILE) and
 * ROW_TILE are constants so that every accumulator stays in a register (AVX-512, two weight
 * rows: 2 x 4 x (N_ACC + 1) of 32). pin() keeps an input's values in a register: GCC would
 * otherwise fold their load into each FMA, loading them again for every weight row. */
#define ROW_TILE (LANES == 16 ? 4 : 2)
#define OUT_TILE (LANES == 16 ? 2 : 1)
static inline vec pin(vec v) {
    __asm__("" : "+x"(v));
    return v;
}
#define DEFINE_DOT_TILE(NAME, WTYPE, LOAD)                                                    \
    static inline __attribute__((always_inline)) void NAME(                                  \
        const WTYPE *w_row, const float *x, int64_t x_stride, const float *scale_row,        \
        int64_t in, int64_t group, const int W_ROWS, float *out) {                            \
        vec total[OUT_TILE][ROW_TILE], acc[OUT_TILE][ROW_TILE][N_ACC];                        \
        for (int j = 0; j < W_ROWS; ++j)                                                      \
            for (int r = 0; r < ROW_TILE; ++r) total[j][r] = vec_zero();                      \
        for (int64_t g = 0; g < in / group; ++g) {                                            \
            for (int j = 0; j < W_ROWS; ++j)                                                  \
                for (int r = 0; r < ROW_TILE; ++r)                                            \
                    for (int k = 0; k < N_ACC; ++k) acc[j][r][k] = vec_zero();                \
            for (int64_t i = g * group; i < (g + 1) * group; i += STEP) {                     \
                for (int j = 0; j < W_ROWS; ++j) {                                            \
                    const char *line = (const char *)(w_row + j * in + i);                    \
                    prefetch_kept(line);                                                      \
                    if (sizeof(WTYPE) == 4) prefetch_kept(line + 64);                         \
                }                                                                             \
                for (int k = 0; k < N_ACC; ++k) {                                             \
                    vec w[OUT_TILE];                                                          \
                    for (int j = 0; j < W_ROWS; ++j) w[j] = LOAD(w_row + j * in + i, k);     \
                    for (int r = 0; r < ROW_TILE; ++r) {                                      \
                        const vec xv = pin(vec_load(x + r * x_stride + i + LANES * k));       \
                        for (int j = 0; j < W_ROWS; ++j)                                      \
                            acc[j][r][k] = vec_fma(w[j], xv, acc[j][r][k]);                   \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
            for (int j = 0; j < W_ROWS; ++j) {                                                \
                const vec scale =                                                             \
                    vec_set1(scale_row ? scale_row[j * (in / group) + g] : 1.0f);             \
                for (int r = 0; r < ROW_TILE; ++r) {                                          \
                    for (int k = 1; k < N_ACC; ++k)                                           \
                        acc[j][r][0] = vec_add(acc[j][r][0], acc[j][r][k]);                   \
                    total[j][r] = vec_fma(acc[j][r][0], scale, total[j][r]);                  \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int j = 0; j < W_ROWS; ++j)                                                      \
            for (int r = 0; r < ROW_TILE; ++r) out[j * ROW_TILE + r] = vec_sum(total[j][r]); \
    }

DEFINE_DOT_TILE(dot_f32_tile, float, load_f32_step)
DEFINE_DOT_TILE(dot_bf16_tile, uint16_t, load_bf16_step) /* x in bf16_order */

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
    prefetch_ahead(w);
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
/* int8_group for ROW_TILE inputs, each 32 weights converted once for all of them */
static inline void int8_group_tile(const int8_t *w, const float *x, int64_t x_stride,
                                   int64_t group, vec out[ROW_TILE]) {
    vec a[ROW_TILE], b[ROW_TILE], q[INT8_VECS];
    for (int64_t c = 0; c < group / 32; ++c) {
        int8_load32(w + 32 * c, q);
        for (int r = 0; r < ROW_TILE; ++r) {
            const vec p = int8_dot32(q, x + r * x_stride + 32 * c);
            if (c % 2 == 0) a[r] = c == 0 ? p : vec_add(a[r], p);
            else b[r] = c == 1 ? p : vec_add(b[r], p);
        }
    }
    for (int r = 0; r < ROW_TILE; ++r) out[r] = group == 32 ? a[r] : vec_add(a[r], b[r]);
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

/* total[r][k] + scale_g * (q_g . x_r,g) for group g and each of the ROW_TILE inputs */
static inline __attribute__((always_inline)) void int8_scaled_tile(
    const int8_t *w_row, const float *x, int64_t x_stride, const float *scale_row, int64_t g,
    int64_t group, int k, vec total[ROW_TILE][IN_FLIGHT]) {
    const vec scale = vec_set1(scale_row ? scale_row[g] : 1.0f);
    vec sums[ROW_TILE];
    int8_group_tile(w_row + g * group, x + g * group, x_stride, group, sums);
    for (int r = 0; r < ROW_TILE; ++r) total[r][k] = vec_fma(sums[r], scale, total[r][k]);
}

/* dot_int8 of one weight row with ROW_TILE inputs (x + r * x_stride) into out[r], bit for bit
 * what dot_int8 gives each alone: whole rounds of IN_FLIGHT groups as there, k a constant in
 * each, so the totals can live in registers. Inlined per group size, as dot_int8_of. */
static inline __attribute__((always_inline)) void dot_int8_tile_of(
    const int8_t *w_row, const float *x, int64_t x_stride, const float *scale_row, int64_t in,
    int64_t group, float *out) {
    vec total[ROW_TILE][IN_FLIGHT];
    for (int r = 0; r < ROW_TILE; ++r)
        for (int k = 0; k < IN_FLIGHT; ++k) total[r][k] = vec_zero();
    const int64_t n = in / group;
    int64_t g = 0;
    for (; g + IN_FLIGHT <= n; g += IN_FLIGHT)
        for (int k = 0; k < IN_FLIGHT; ++k)
            int8_scaled_tile(w_row, x, x_stride, scale_row, g + k, group, k, total);
    for (int k = 0; k < IN_FLIGHT; ++k)
        if (g + k < n) int8_scaled_tile(w_row, x, x_stride, scale_row, g + k, group, k, total);
    for (int r = 0; r < ROW_TILE; ++r) out[r] = vec_sum(sum_in_flight(total[r]));
}

/* as dot_int8: one copy per common group size */
static inline void dot_int8_tile(const int8_t *w_row, const float *x, int64_t x_stride,
                                 const float *scale_row, int64_t in, int64_t group, float *out) {
    if (group == 32) dot_int8_tile_of(w_row, x, x_stride, scale_row, in, 32, out);
    else if (group == 64) dot_int8_tile_of(w_row, x, x_stride, scale_row, in, 64, out);
    else dot_int8_tile_of(w_row, x, x_stride, scale_row, in, group, out);
}

/* int4 rows (GGUF's Q4_0 / Q4_1 / Q4_K, glassformer/nn/quant.py's Int4Linear): a group of 32
 * weights in 16 bytes, byte j holding weight j in its low nibble and weight j + 16 in its high
 * one (GGUF's order), each weight scale * q + min with q in 0..15 and one scale and one min per
 * group. A row's dot product with x is the plain one with those dequantized weights: a group's
 * 16 possible values are a table, table[q] = scale * q + min (one FMA, the rounding of
 * matvec.c's dequant_q4), and its nibbles pick from it (AVX-512's vpermps; AVX2 computes the
 * same FMA per weight). Before, the dot was scale * (q . x) + min * sum(x) group by group: a
 * third vector operation per input and group in the batched tile, and x's group sums with a
 * barrier before every batched int4 product: 32 rows of SmolLM2 Q4_1 step in 72.8-74.2 against
 * 81.4-85.8 ms, one row 4.79-4.83 against 4.64-4.99 ms (3 pairs in alternation). */
static inline void q4_weights(const uint8_t *w_row, int64_t g, const float *scale_row,
                              const float *min_row, vec w[Q4_VECS]) {
    if (g % 4 == 0) prefetch_ahead(w_row + 16 * g); /* one line: four groups */
    q4_unpack(_mm_loadu_si128((const __m128i *)(w_row + 16 * g)), scale_row[g], min_row[g], w);
}

/* A row's scales and mins are more streams beside its weights: ask for those of the row
 * Q4_AHEAD rows on, as prefetch_ahead does for the weights (SmolLM2 int4, one row: 7.4-7.8 ->
 * 7.1-7.3 ms per step). */
#define Q4_AHEAD 8
static inline void q4_prefetch_groups(const float *scale_row, const float *min_row, int64_t n) {
    prefetch_floats(scale_row + Q4_AHEAD * n, n);
    prefetch_floats(min_row + Q4_AHEAD * n, n);
}

/* total + w_g . x_g for group g's dequantized weights, lane by lane */
static inline vec q4_add(const vec w[Q4_VECS], const float *x_row, int64_t g, vec total) {
    for (int i = 0; i < Q4_VECS; ++i)
        total = vec_fma(w[i], vec_load(x_row + 32 * g + i * LANES), total);
    return total;
}

static inline vec dot_q4(const uint8_t *w_row, const float *x_row, const float *scale_row,
                         const float *min_row, int64_t in) {
    vec total[IN_FLIGHT], w[Q4_VECS];
    for (int k = 0; k < IN_FLIGHT; ++k) total[k] = vec_zero();
    const int64_t n = in / 32;
    q4_prefetch_groups(scale_row, min_row, n);
    int64_t g = 0;
    for (; g + IN_FLIGHT <= n; g += IN_FLIGHT)
        for (int k = 0; k < IN_FLIGHT; ++k) {
            q4_weights(w_row, g + k, scale_row, min_row, w);
            total[k] = q4_add(w, x_row, g + k, total[k]);
        }
    for (int k = 0; k < IN_FLIGHT; ++k)
        if (g + k < n) {
            q4_weights(w_row, g + k, scale_row, min_row, w);
            total[k] = q4_add(w, x_row, g + k, total[k]);
        }
    return sum_in_flight(total);
}

/* dot_q4 of one weight row with ROW_TILE inputs (x + r * x_stride) into out[r]: each group's
 * weights are dequantized once for all of them (unpacking, not reading, is what a 4-bit dot
 * costs), and each input's sums run in dot_q4's order, so out[r] is bit for bit what dot_q4
 * gives it alone. */
static inline void dot_q4_tile(const uint8_t *w_row, const float *x, int64_t x_stride,
                               const float *scale_row, const float *min_row, int64_t in,
                               float *out) {
    vec total[ROW_TILE][IN_FLIGHT], w[Q4_VECS];
    for (int r = 0; r < ROW_TILE; ++r)
        for (int k = 0; k < IN_FLIGHT; ++k) total[r][k] = vec_zero();
    const int64_t n = in / 32;
    int64_t g = 0;
    for (; g + IN_FLIGHT <= n; g += IN_FLIGHT)
        for (int k = 0; k < IN_FLIGHT; ++k) {
            q4_weights(w_row, g + k, scale_row, min_row, w);
            for (int r = 0; r < ROW_TILE; ++r)
                total[r][k] = q4_add(w, x + r * x_stride, g + k, total[r][k]);
        }
    for (int k = 0; k < IN_FLIGHT; ++k)
        if (g + k < n) {
            q4_weights(w_row, g + k, scale_row, min_row, w);
            for (int r = 0; r < ROW_TILE; ++r)
                total[r][k] = q4_add(w, x + r * x_stride, g + k, total[r][k]);
        }
    for (int r = 0; r < ROW_TILE; ++r) out[r] = vec_sum(sum_in_flight(total[r]));
}

#endif
