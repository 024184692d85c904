/* Inputs rounded to int8: the precisions w8a8 and w4a8 (glassformer/nn/quant.py's
 * round_inputs; llama.cpp's Q8_0 and Q8_1 activations). Before a weight matrix multiplies x, x
 * is rounded in groups of 32 columns:
 *
 *   d = max_i |x_i| / 127,   q_i = round(x_i * (1 / d)) in -127..127,   x_i ~ d * q_i
 *
 * and a weight group's products with it become sums of small integers, exact in int32, which
 * the CPU forms four byte pairs per lane in one instruction (AVX512-VNNI's vpdpbusd; maddubs
 * then madd where it has none):
 *
 *   int8 weights w, one scale s per group:            s * d * sum_i w_i q_i
 *   int4 weights s * u + m, nibbles u in 0..15:       s * d * sum_i u_i q_i  +  m * d * sum_i q_i
 *
 * x's d * sum_i q_i is computed once, when x is rounded, and a row's mins times those sums are
 * one short float dot product. The byte products take an unsigned byte times a signed one:
 * int4 nibbles are unsigned as they are; int8 weights give |w| and x takes w's sign.
 *
 * Why: the weight-only dot products (simd.h) turn every weight into a float before its FMA, 16
 * weights an instruction and several instructions per 16; here 64 weights meet 64 values of x
 * in one instruction (AVX-512), and the step reads its bytes instead of converting them
 * (benchmarks/step_bandwidth.py). The price is x's rounding: a precision of its own, with its
 * perplexity measured (benchmarks/quantization.py), never the default.
 *
 * A chunk is the columns one round of the loop takes: int8 one vector of weights (64 columns
 * with AVX-512, 32 with AVX2); int4 one vector of packed bytes, four groups with AVX-512 (128
 * columns in 64 bytes) and two with AVX2: their low nibbles are one vector of bytes, their high
 * nibbles another, whose sums add lane by lane. x's rounded bytes are stored in the
 * order of the storage they meet (round_x): column order for int8; for int4, a chunk's low
 * nibbles' columns [g 0-15, g' 0-15, ...], then its high nibbles' [g 16-31, g' 16-31, ...].
 * Each int32 lane then sums columns of one group, LANES / (groups a chunk) lanes a group in
 * order, and `lanes` holds each lane's d, so a chunk's sums take their scales in one multiply.
 */
#ifndef GLASSFORMER_A8_H
#define GLASSFORMER_A8_H
#include <stdlib.h>
#include <string.h>

#include "groups.h"
#include "simd.h"
#include "step.h"

/* x rounded for one weight storage: q, a chunk's columns of bytes a chunk (zero past the last
 * group); lanes, LANES floats a chunk (each int32 lane's d); sums, d * sum(q) per group (the
 * int4 rows' min term) */
typedef struct {
    int8_t *q;
    float *lanes, *sums;
} Rounded;

#ifdef __AVX512F__
#define Q4_COLUMNS 128
#define I8_COLUMNS 64
typedef __m512i ivec;
typedef struct { ivec low, high; } Nibbles; /* an int4 chunk's low and high nibbles, as bytes */
static inline ivec load_bytes(const void *p) { return _mm512_loadu_si512(p); }
/* acc + the sum of 4 products u * s (unsigned u, signed s) per int32 lane */
static inline ivec dot_bytes(ivec acc, ivec u, ivec s) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}
static inline ivec int_zero(void) { return _mm512_setzero_si512(); }
static inline vec int_to_vec(ivec v) { return _mm512_cvtepi32_ps(v); }
/* the weight bytes of `count` of a chunk's groups (all there is to read of the last one) */
static inline ivec load_groups(const void *p, int count, int group_bytes) {
    return count * group_bytes == 64 ? _mm512_loadu_si512(p)
                                     : _mm512_maskz_loadu_epi8((1ull << (count * group_bytes)) - 1, p);
}
/* int4 chunk c: its groups' low nibbles as bytes, and their high ones */
static inline Nibbles q4_chunk(const uint8_t *w_row, int64_t c, int count) {
    const ivec bytes = load_groups(w_row + 64 * c, count, 16), mask = _mm512_set1_epi8(0x0f);
    return (Nibbles){_mm512_and_si512(bytes, mask), _mm512_and_si512(_mm512_srli_epi16(bytes, 4), mask)};
}
/* int8 chunk c: |w|, and which bytes are negative (x takes their sign) */
typedef __mmask64 sign_mask;
static inline ivec i8_chunk(const int8_t *w_row, int64_t c, int count, sign_mask *negative) {
    const ivec w = load_groups(w_row + 64 * c, count, 32);
    *negative = _mm512_movepi8_mask(w);
    return _mm512_abs_epi8(w);
}
static inline ivec signed_by(ivec x, sign_mask negative) {
    return _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
}
/* each lane's weight scale for a chunk of groups of 32 (one scale each, `per_chunk` a chunk,
 * LANES / per_chunk lanes each), the first `count` of them at s */
static inline vec group_scales(const float *s, int per_chunk, int count) {
    const __m512i of_lane = per_chunk == 4 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                                           : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    return _mm512_permutexvar_ps(of_lane, _mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1), s));
}
/* int8 with groups wider than 32: chunk c's two halves' scales */
static inline vec wide_scales(const float *scale_row, int64_t c, int64_t group, int count) {
    const float first = scale_row[64 * c / group];
    const float second = count == 2 ? scale_row[(64 * c + 32) / group] : first;
    return _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(first), _mm512_set1_ps(second));
}
/* The 32 values at x32 rounded: returns d, writes the q's as two runs of 16 bytes and their sum */
static inline float round_group(const float *x32, int8_t *first16, int8_t *second16, int *sum) {
    const vec a = _mm512_loadu_ps(x32), b = _mm512_loadu_ps(x32 + 16);
    const vec magnitude = _mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b));
    const float d = _mm512_reduce_max_ps(magnitude) / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inverse)));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inverse)));
    _mm_storeu_si128((__m128i *)first16, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)second16, _mm512_cvtepi32_epi8(qb));
    *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    return d;
}
#else
#define Q4_COLUMNS 64
#define I8_COLUMNS 32
typedef __m256i ivec;
typedef struct { ivec low, high; } Nibbles;
static inline ivec load_bytes(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline ivec dot_bytes(ivec acc, ivec u, ivec s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
static inline ivec int_zero(void) { return _mm256_setzero_si256(); }
static inline vec int_to_vec(ivec v) { return _mm256_cvtepi32_ps(v); }
static inline Nibbles q4_chunk(const uint8_t *w_row, int64_t c, int count) {
    const uint8_t *p = w_row + 32 * c;
    const ivec bytes = count == 2 ? load_bytes(p) : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)p));
    const ivec mask = _mm256_set1_epi8(0x0f);
    return (Nibbles){_mm256_and_si256(bytes, mask), _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask)};
}
typedef ivec sign_mask; /* AVX2's vpsignb takes the signs from the weights themselves */
static inline ivec i8_chunk(const int8_t *w_row, int64_t c, int count, sign_mask *w) { /* |w| */
    (void)count;
    *w = load_bytes(w_row + 32 * c);
    return _mm256_sign_epi8(*w, *w);
}
static inline ivec signed_by(ivec x, sign_mask w) { return _mm256_sign_epi8(x, w); }
static inline vec group_scales(const float *s, int per_chunk, int count) {
    if (per_chunk == 1) return _mm256_set1_ps(*s);
    const __m128 second = _mm_set1_ps(count > 1 ? s[1] : s[0]);
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(s[0])), second, 1);
}
static inline vec wide_scales(const float *scale_row, int64_t c, int64_t group, int count) {
    (void)count;
    return _mm256_set1_ps(scale_row[32 * c / group]);
}
static inline float round_group(const float *x32, int8_t *first16, int8_t *second16, int *sum) {
    const vec sign = _mm256_set1_ps(-0.0f);
    vec v[4], magnitude = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(x32 + 8 * i);
        magnitude = _mm256_max_ps(magnitude, _mm256_andnot_ps(sign, v[i]));
    }
    float m[8], d = 0.0f;
    _mm256_storeu_ps(m, magnitude);
    for (int i = 0; i < 8; ++i) d = m[i] > d ? m[i] : d;
    d /= 127.0f;
    const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t q[32];
    for (int i = 0; i < 4; ++i)
        _mm256_storeu_si256((__m256i *)(q + 8 * i),
                            _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse))));
    *sum = 0;
    for (int i = 0; i < 32; ++i) {
        (i < 16 ? first16 : second16)[i % 16] = (int8_t)q[i];
        *sum += q[i];
    }
    return d;
}
#endif

/* int4 chunk c's sums with x rounded (its bytes for the low nibbles, then for the high ones) */
static inline ivec q4_sums(Nibbles u, const int8_t *q) {
    return dot_bytes(dot_bytes(int_zero(), u.low, load_bytes(q)), u.high, load_bytes(q + Q4_COLUMNS / 2));
}

/* Bytes of scratch one rounded row of `in` columns takes (Rounded's arrays, at most: int4's
 * chunks round the columns up to Q4_COLUMNS, int8's lanes take a float per 4 columns). */
static inline int64_t rounded_bytes(int64_t in) {
    const int64_t columns = (in + Q4_COLUMNS - 1) / Q4_COLUMNS * Q4_COLUMNS;
    return columns + columns + (in / 32) * 4;
}
static inline Rounded rounded_at(char *memory, int64_t in) {
    const int64_t columns = (in + Q4_COLUMNS - 1) / Q4_COLUMNS * Q4_COLUMNS;
    Rounded r = {(int8_t *)memory, (float *)(memory + columns), 0};
    r.sums = (float *)(memory + 2 * columns);
    return r;
}

/* Round x (in columns, a multiple of 32) for a weight stored as int4 (`nibbles`) or int8. */
static void round_x(const float *x, int64_t in, int nibbles, Rounded *r) {
    const int64_t columns = nibbles ? Q4_COLUMNS : I8_COLUMNS, per_chunk = columns / 32;
    const int64_t n = in / 32, chunks = (n + per_chunk - 1) / per_chunk;
    const int lanes_per_group = LANES / (int)per_chunk;
    for (int64_t g = 0; g < chunks * per_chunk; ++g) {
        const int64_t c = g / per_chunk, k = g % per_chunk;
        int8_t *first = r->q + c * columns + (nibbles ? 16 * k : 32 * k);
        int8_t *second = nibbles ? first + columns / 2 : first + 16;
        float d = 0.0f; /* past the last group: nothing */
        if (g < n) {
            int sum;
            d = round_group(x + 32 * g, first, second, &sum);
            r->sums[g] = d * (float)sum;
        } else {
            memset(first, 0, 16), memset(second, 0, 16);
        }
        for (int i = 0; i < lanes_per_group; ++i) r->lanes[c * LANES + k * lanes_per_group + i] = d;
    }
}

/* acc + (chunk c's integer sums) * weight scales * d, lane by lane */
static inline vec a8_scaled(ivec sums, vec scales, const Rounded *x, int64_t c, vec acc) {
    return vec_fma(int_to_vec(sums), vec_mul(scales, vec_load(x->lanes + c * LANES)), acc);
}

/* int4 chunk c (`count` groups) against ROWS rounded inputs, into acc[r][k] */
static inline __attribute__((always_inline)) void q4_a8_chunk(
    const uint8_t *w_row, const Rounded *x, const float *scale_row, int64_t c, int count,
    const int ROWS, vec acc[][2], int k) {
    const int per_chunk = Q4_COLUMNS / 32;
    const Nibbles u = q4_chunk(w_row, c, count);
    const vec scales = group_scales(scale_row + per_chunk * c, per_chunk, count);
    for (int r = 0; r < ROWS; ++r)
        acc[r][k] = a8_scaled(q4_sums(u, x[r].q + c * Q4_COLUMNS), scales, &x[r], c, acc[r][k]);
}

/* int8 chunk c (`count` groups of 32 columns) against ROWS rounded inputs, into acc[r][k] */
static inline __attribute__((always_inline)) void i8_a8_chunk(
    const int8_t *w_row, const Rounded *x, const float *scale_row, int64_t c, int count,
    int64_t group, const int ROWS, vec acc[][2], int k) {
    const int per_chunk = I8_COLUMNS / 32;
    sign_mask sign;
    const ivec magnitude = i8_chunk(w_row, c, count, &sign);
    const vec scales = group == 32 ? group_scales(scale_row + per_chunk * c, per_chunk, count)
                                   : wide_scales(scale_row, c, group, count);
    for (int r = 0; r < ROWS; ++r) {
        const ivec q = signed_by(load_bytes(x[r].q + c * I8_COLUMNS), sign);
        acc[r][k] = a8_scaled(dot_bytes(int_zero(), magnitude, q), scales, &x[r], c, acc[r][k]);
    }
}

/* The first `count` (< LANES) floats at p, zeros after */
static inline vec load_first(const float *p, int64_t count) {
#ifdef __AVX512F__
    return _mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1), p);
#else
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count), lane));
#endif
}

/* A row's dot products with ROWS rounded inputs: chunk c into accumulator c % 2 (two chains of
 * FMAs in flight), the whole chunks in pairs, then a last whole one and a last part where there
 * are; each input alone in the one-input order, so out[r] is bit for bit what ROWS = 1 gives
 * it. CHUNK_FN(c, count, k) runs q4_a8_chunk or i8_a8_chunk on chunk c's first `count` groups
 * into acc[r][k]; a chunk is COLUMNS columns in BYTES bytes. */
#define A8_ROW(CHUNK_FN, COLUMNS, BYTES)                                                      \
    const int64_t n = in / 32, per_chunk = (COLUMNS) / 32, whole = n / per_chunk;            \
    vec acc[MAX_TILE][2];                                                                     \
    for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = vec_zero();                        \
    int64_t c = 0;                                                                            \
    for (; c + 2 <= whole; c += 2) {                                                          \
        for (int b = 0; b < 2 * (BYTES); b += 64) prefetch_kept((const char *)w_row + (BYTES) * c + b); \
        CHUNK_FN(c, per_chunk, 0);                                                            \
        CHUNK_FN(c + 1, per_chunk, 1);                                                        \
    }                                                                                         \
    if (c < whole) CHUNK_FN(c++, per_chunk, 0);                                               \
    if (n % per_chunk) {                                                                      \
        if (c % 2) CHUNK_FN(c, n % per_chunk, 1);                                             \
        else CHUNK_FN(c, n % per_chunk, 0);                                                   \
    }

/* int4 row . rounded x, ROWS inputs at once (each int4 chunk unpacked once for all): out[r]
 * is input r's dot product in lanes, for vec_sum4 */
static inline __attribute__((always_inline)) void dot_q4_a8(
    const uint8_t *w_row, const Rounded *x, const float *scale_row, const float *min_row,
    int64_t in, const int ROWS, vec *out) {
    q4_prefetch_groups(scale_row, min_row, in / 32);
#define Q4_CHUNK(c, count, k) q4_a8_chunk(w_row, x, scale_row, c, count, ROWS, acc, k)
    A8_ROW(Q4_CHUNK, Q4_COLUMNS, Q4_COLUMNS / 2)
#undef Q4_CHUNK
    for (int r = 0; r < ROWS; ++r) {
        vec total = vec_add(acc[r][0], acc[r][1]);
        int64_t g = 0;
        for (; g + LANES <= n; g += LANES)
            total = vec_fma(vec_load(min_row + g), vec_load(x[r].sums + g), total);
        if (g < n) total = vec_fma(load_first(min_row + g, n - g), load_first(x[r].sums + g, n - g), total);
        out[r] = total;
    }
}

/* int8 row (groups of `group` columns, a multiple of 32) . rounded x, as dot_q4_a8 */
static inline __attribute__((always_inline)) void dot_i8_a8(
    const int8_t *w_row, const Rounded *x, const float *scale_row, int64_t in, int64_t group,
    const int ROWS, vec *out) {
#define I8_CHUNK(c, count, k) i8_a8_chunk(w_row, x, scale_row, c, count, group, ROWS, acc, k)
    A8_ROW(I8_CHUNK, I8_COLUMNS, I8_COLUMNS)
#undef I8_CHUNK
    for (int r = 0; r < ROWS; ++r) out[r] = vec_add(acc[r][0], acc[r][1]);
}


/* Each thread's scratch for its copy of a projection's inputs (rounded here; bf16_order's in
 * decode.c), grown on demand and kept for the next call. */
static _Thread_local char *scratch_memory;
static _Thread_local int64_t scratch_capacity;
static char *thread_scratch(int64_t bytes) {
    if (bytes > scratch_capacity) {
        free(scratch_memory);
        scratch_capacity = (bytes + 4095) / 4096 * 4096;
        scratch_memory = aligned_alloc(64, (size_t)scratch_capacity);
        if (!scratch_memory) scratch_capacity = 0; /* none: asked again next time */
    }
    return scratch_memory;
}

/* --- a projection with rounded inputs (decode.c's linear, for round_inputs) ------------- */

/* W[o] . x[r] for ROWS inputs x rounded to int8 (a8.h), in lanes: the storage (int4, else int8
 * in groups of `group`) and ROWS constants where inlined */
static inline __attribute__((always_inline)) void a8_dot(const Linear *L, int64_t o,
                                                         const Rounded *x, const int ROWS,
                                                         vec *out, const int q4,
                                                         const int64_t group) {
    const int64_t in = L->in, n_groups = in / group;
    const float *scale = L->scale + o * n_groups;
    if (q4) dot_q4_a8((const uint8_t *)L->weight + o * (in / 2), x, scale,
                      L->mins + o * n_groups, in, ROWS, out);
    else dot_i8_a8((const int8_t *)L->weight + o * in, x, scale, in, group, ROWS, out);
}

/* y[r][o] (+)= dot + b[o] for `count` (up to 4) dot products in lanes, at y + r * out + o */
static inline void a8_store(const Linear *L, const vec dots[4], int count, float *y, int64_t o,
                            int64_t o_step, int64_t r, int64_t r_step, int accumulate) {
    float sums[4];
    vec_sum4(dots, sums);
    for (int i = 0; i < count; ++i) {
        const int64_t at = o + i * o_step;
        const float value = sums[i] + (L->bias ? L->bias[at] : 0.0f);
        float *out = y + (r + i * r_step) * L->out + at;
        *out = accumulate ? *out + value : value;
    }
}

/* This thread's share of output rows against the rounded inputs. One input: four output rows
 * at a time, summed together (vec_sum4). More: each weight row against ROW_TILE inputs at a
 * time (read once for all of them, in the one-input order, so each input's outputs are bit for
 * bit what it gets alone), the last ones in a tile of their own (simd.h's next_tile). Inlined
 * once per storage and common group size (dispatched in linear_a8), so that each row's dot
 * product is inlined too: a call and the storage's branches per row were 15% of a w4a8 step. */
static inline __attribute__((always_inline)) void a8_rows(const Linear *L, const Rounded *x,
                                                          int64_t rows, float *y, int accumulate,
                                                          const int q4, const int64_t group) {
    if (rows == 1) {
#pragma omp for schedule(static)
        for (int64_t block = 0; block < (L->out + 3) / 4; ++block) {
            vec dots[4] = {vec_zero(), vec_zero(), vec_zero(), vec_zero()};
            const int count = L->out - 4 * block < 4 ? (int)(L->out - 4 * block) : 4;
            for (int i = 0; i < count; ++i) a8_dot(L, 4 * block + i, x, 1, &dots[i], q4, group);
            a8_store(L, dots, count, y, 4 * block, 1, 0, 0, accumulate);
        }
        return;
    }
#pragma omp for schedule(static)
    for (int64_t o = 0; o < L->out; ++o)
        for (int64_t r0 = 0, n = 0; r0 < rows; r0 += n) {
            vec dots[8]; /* up to MAX_TILE sums, stored in fours (a8_store) */
            for (int i = 0; i < 8; ++i) dots[i] = vec_zero();
            n = next_tile(rows - r0, 1);
            if (n == ROW_TILE) a8_dot(L, o, x + r0, ROW_TILE, dots, q4, group);
            else if (n == MAX_TILE) a8_dot(L, o, x + r0, MAX_TILE, dots, q4, group);
            else if (n == 1) a8_dot(L, o, x + r0, 1, dots, q4, group);
#if LANES == 16 /* ROW_TILE 4: partial tiles of 2 and 3 */
            else if (n == 2) a8_dot(L, o, x + r0, 2, dots, q4, group);
            else a8_dot(L, o, x + r0, 3, dots, q4, group);
#endif
            a8_store(L, dots, n < 4 ? (int)n : 4, y, o, 0, r0, 1, accumulate);
            if (n > 4) a8_store(L, dots + 4, (int)n - 4, y, o, 0, r0 + 4, 1, accumulate);
        }
}

/* decode.c's linear() for a weight whose inputs are rounded to int8 first (round_inputs). Each
 * thread rounds every input itself, into its own scratch: the same bytes in each thread, and
 * no barrier before the products (a few microseconds of work against a barrier's wait). */
static void linear_a8(const Linear *L, const float *x, int64_t stride, int64_t rows, float *y,
                      int accumulate) {
    const int64_t bytes = rounded_bytes(L->in);
    char *memory = thread_scratch(rows * bytes);
    Rounded rounded[rows];
    for (int64_t r = 0; r < rows; ++r) {
        rounded[r] = rounded_at(memory + r * bytes, L->in);
        round_x(x + r * stride, L->in, L->storage == Q4, &rounded[r]);
    }
    if (L->storage == Q4) a8_rows(L, rounded, rows, y, accumulate, 1, 32);
    else if (L->group == 32) a8_rows(L, rounded, rows, y, accumulate, 0, 32);
    else if (L->group == 64) a8_rows(L, rounded, rows, y, accumulate, 0, 64);
    else a8_rows(L, rounded, rows, y, accumulate, 0, L->group);
}

#endif
