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
static inline void q4_unpack(const uint8_t *bytes, float scale, float min, vec w[Q4_VECS]) {
    const vec q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const vec table = _mm512_fmadd_ps(q, _mm512_set1_ps(scale), _mm512_set1_ps(min));
    const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
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
static inline vec q4_eight(__m256i q, vec scale, vec min) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), scale, min);
}
/* Each half of the bytes widened once to int32s, straight from memory (a load and one shuffle):
 * its low nibbles are a mask of it, its high ones a shift (2 shuffles a group, not 6). */
static inline void q4_unpack(const uint8_t *bytes, float scale, float min, vec w[Q4_VECS]) {
    const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)bytes));
    const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bytes + 8)));
    const __m256i mask = _mm256_set1_epi32(0x0f);
    const vec s = _mm256_set1_ps(scale), m = _mm256_set1_ps(min);
    w[0] = q4_eight(_mm256_and_si256(first, mask), s, m);   /* weights 0-7 */
    w[1] = q4_eight(_mm256_and_si256(second, mask), s, m);  /* 8-15 */
    w[2] = q4_eight(_mm256_srli_epi32(first, 4), s, m);     /* 16-23 */
    w[3] = q4_eight(_mm256_srli_epi32(second, 4), s, m);    /* 24-31 */
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

/* sum_i (x_i - shift)^2, or sum_i (x_i - shift) where !square, in double (the norms' sums over
 * 576 and more values, which a float running sum would round): four sums of 8 doubles in
 * flight, in GCC's vector extension (one AVX-512 register each, or two AVX2 ones). One double
 * running sum waited 4 cycles on each addition: 3.3 kcycles a norm of SmolLM2's 576 values,
 * two of them a layer, on one thread while the other waited. */
typedef float float8 __attribute__((vector_size(32), aligned(4)));
typedef double double8 __attribute__((vector_size(64)));
static inline double sum_double(const float *x, int64_t n, double shift, int square) {
    double8 acc[4] = {{0}, {0}, {0}, {0}};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int k = 0; k < 4; ++k) {
            const double8 v = __builtin_convertvector(*(const float8 *)(x + i + 8 * k), double8) - shift;
            acc[k] += square ? v * v : v;
        }
    const double8 all = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    double total = 0.0;
    for (int k = 0; k < 8; ++k) total += all[k];
    for (; i < n; ++i) {
        const double v = x[i] - shift;
        total += square ? v * v : v;
    }
    return total;
}

/* The largest of x's n floats and the first index it stands at (torch.argmax's answer) into
 * *best and *at: each lane keeps its largest value and the first index it saw it at, then the
 * lanes' winners are compared, the smaller index winning a tie. Returns 0 where every value is
 * finite, else NOT_FINITE, with HAS_NAN where one is a NaN (whose comparisons are all false:
 * *at is then not torch's answer, the NaN's index). v * 0 is NaN for an infinity or a NaN and
 * 0 for the rest: one more operation a vector finds both. */
#define NOT_FINITE 1
#define HAS_NAN 2
static inline int best_of(const float *x, int64_t n, float *best_out, int64_t *at_out) {
    float best = -INFINITY;
    int64_t at = 0, i = 0;
    int odd = 0;
    if (n >= LANES) {
        float lane_best[LANES];
        int32_t lane_at[LANES];
        vec top = vec_load(x);
#ifdef __AVX512F__
        __m512i where = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i index = where;
        const vec zeroed = vec_mul(top, vec_zero());
        __mmask16 unordered = _mm512_cmp_ps_mask(zeroed, zeroed, _CMP_UNORD_Q);
        for (i = LANES; i + LANES <= n; i += LANES) {
            const vec v = vec_load(x + i), v0 = vec_mul(v, vec_zero());
            unordered |= _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q);
            index = _mm512_add_epi32(index, _mm512_set1_epi32(LANES));
            where = _mm512_mask_mov_epi32(where, _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ), index);
            top = _mm512_max_ps(v, top);
        }
        _mm512_storeu_si512(lane_at, where);
        odd = unordered != 0;
#else
        __m256i where = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), index = where;
        const vec zeroed = vec_mul(top, vec_zero());
        vec unordered = _mm256_cmp_ps(zeroed, zeroed, _CMP_UNORD_Q);
        for (i = LANES; i + LANES <= n; i += LANES) {
            const vec v = vec_load(x + i), v0 = vec_mul(v, vec_zero());
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v0, v0, _CMP_UNORD_Q));
            index = _mm256_add_epi32(index, _mm256_set1_epi32(LANES));
            const __m256i greater = _mm256_castps_si256(_mm256_cmp_ps(v, top, _CMP_GT_OQ));
            where = _mm256_blendv_epi8(where, index, greater);
            top = _mm256_max_ps(v, top);
        }
        _mm256_storeu_si256((__m256i *)lane_at, where);
        odd = _mm256_movemask_ps(unordered) != 0;
#endif
        vec_store(lane_best, top);
        best = lane_best[0], at = lane_at[0];
        for (int k = 1; k < LANES; ++k)
            if (lane_best[k] > best || (lane_best[k] == best && lane_at[k] < at))
                best = lane_best[k], at = lane_at[k];
    }
    for (; i < n; ++i) {
        odd |= !isfinite(x[i]);
        if (x[i] > best) best = x[i], at = i;
    }
    *best_out = best, *at_out = at;
    if (!odd) return 0;
    for (i = 0; i < n; ++i) /* rare: which kind */
        if (isnan(x[i])) return NOT_FINITE | HAS_NAN;
    return NOT_FINITE;
}

/* Software prefetch, once a line of weights: the line PREFETCH_BYTES further on in the same row
 * (and, past its end, the next rows: a thread's rows are contiguous) into the nearest cache,
 * and the line PREFETCH_FAR_BYTES on into L2. The hardware prefetcher alone left the int8 dot
 * waiting on memory at half its instructions: one thread, SmolLM2's shapes, 2 KB ahead took an
 * int8 matrix-vector product from 0.73 to 0.87 of a plain read of its bytes (1 and 4 KB: less).
 * The far request keeps more lines coming from memory at once than 2 KB in flight can: SmolLM2's
 * one-row step at position 128 (the C step alone, 3 rounds in turn, 2026-12-07) took int8
 * 5.3-5.8 -> 4.0-4.6 ms, bf16 9.9-10.5 -> 8.1-8.4, fp32 17.4-17.7 -> 16.1-16.6, int4 4.2-4.5 ->
 * 4.0-4.1 (16 KB: about the same; the keys' and values' rows with it: no gain). */
#define PREFETCH_BYTES 2048
#define PREFETCH_FAR_BYTES 8192
static inline void prefetch_ahead(const void *p) {
    _mm_prefetch((const char *)p + PREFETCH_BYTES, _MM_HINT_T0);
    _mm_prefetch((const char *)p + PREFETCH_FAR_BYTES, _MM_HINT_T1);
}

/* prefetch_ahead as an instruction GCC must keep where it stands: in the batched tiles below,
 * GCC 12 dropped _mm_prefetch's from the loop (objdump), and a 32-row fp32 step waited on the
 * weights. (In the one-row loops the builtin is kept, and there it schedules better.) */
static inline void prefetch_kept(const void *p) {
    __asm__ volatile("prefetcht0 %0" : : "m"(*((const char *)p + PREFETCH_BYTES)));
    __asm__ volatile("prefetcht1 %0" : : "m"(*((const char *)p + PREFETCH_FAR_BYTES)));
}

/* n floats from p on, a line at a time */
static inline void prefetch_floats(const float *p, int64_t n) {
    for (int64_t b = 0; b < n * (int64_t)sizeof(float); b += 64)
        _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}

/* Whether the one-row fp32 and bf16 dots (DEFINE_DOT) prefetch their weights as above. On AMD's
 * Zen 3 (a 2-core EPYC, AVX2) an fp32 dot's two prefetches a line took load slots its four FMAs'
 * loads wanted, and the hardware prefetcher kept up alone: step / read (step_bandwidth.py, 4
 * rounds in turn, 2026-12-07) SmolLM2 fp32 0.84-0.89x without them against 0.70-0.79x with,
 * bf16 0.76-0.83x against 0.61-0.74x, GPT-2 likewise; int8's and int4's dots, which do more
 * per byte, were not faster without. build.py passes FLOAT_PREFETCH=0 on AMD's CPUs. */
#ifndef FLOAT_PREFETCH
#define FLOAT_PREFETCH 1
#endif
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
                    if (FLOAT_PREFETCH) prefetch_ahead((const char *)(w_row + i) + b);        \
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
 * group)) with R inputs (x + r * x_stride, R up to ROW_TILE) into out[j * ROW_TILE + r]: each
 * LANES weights loaded (and converted) once for all the inputs, each input's LANES values once
 * for all the weight rows, and each (row, input) pair accumulated in the single-input order, so
 * every out[j * ROW_TILE + r] is bit for bit what NAME gives it alone. W_ROWS (1 or OUT_TILE)
 * and R are constants so that every accumulator stays in a register (AVX-512, two weight rows
 * and four inputs: 2 x 4 x (N_ACC + 1) of 32). pin() keeps an input's values in a register: GCC
 * would otherwise fold their load into each FMA, loading them again for every weight row. */
#define ROW_TILE (LANES == 16 ? 4 : 2)
#define OUT_TILE (LANES == 16 ? 2 : 1)
/* The most inputs a tile of int8 or int4 weights takes: a batch's last tile may take one more
 * than a whole one, whose sums still fit in the registers (next_tile). */
#define MAX_TILE (ROW_TILE + 1)

/* How many of the `left` inputs the next tile takes: ROW_TILE, or the batch's last ones. Those
 * share each weight's conversion too: one at a time, each took its own (2 rows of SmolLM2 int4
 * decoded 277-279 tokens/s in all, one row alone 284-285; 386-395 in a tile of 2). And where
 * ROW_TILE + 1 are left, a storage whose tile takes MAX_TILE (`wide`: int8 and int4, with or
 * without rounded inputs) takes them in one: a tile of 4 and one of 1 convert each weight twice
 * (SmolLM2 int4, 5 rows: 451-455 tokens/s in all, fewer than 4 rows' 529-555; 554-565 in a
 * tile of 5). */
static inline int64_t next_tile(int64_t left, int wide) {
    if (wide && left == MAX_TILE) return MAX_TILE;
    return left < ROW_TILE ? left : ROW_TILE;
}
static inline vec pin(vec v) {
    __asm__("" : "+x"(v));
    return v;
}
#define DEFINE_DOT_TILE(NAME, WTYPE, LOAD)                                                    \
    static inline __attribute__((always_inline)) void NAME(                                   \
        const WTYPE *w_row, const float *x, int64_t x_stride, const float *scale_row,         \
        int64_t in, int64_t group, const int W_ROWS, const int R, float *out) {               \
        vec total[OUT_TILE][ROW_TILE], acc[OUT_TILE][ROW_TILE][N_ACC];                        \
        for (int j = 0; j < W_ROWS; ++j)                                                      \
            for (int r = 0; r < R; ++r) total[j][r] = vec_zero();                             \
        for (int64_t g = 0; g < in / group; ++g) {                                            \
            for (int j = 0; j < W_ROWS; ++j)                                                  \
                for (int r = 0; r < R; ++r)                                                   \
                    for (int k = 0; k < N_ACC; ++k) acc[j][r][k] = vec_zero();                \
            for (int64_t i = g * group; i < (g + 1) * group; i += STEP) {                     \
                for (int j = 0; j < W_ROWS; ++j) {                                            \
                    const char *line = (const char *)(w_row + j * in + i);                    \
                    prefetch_kept(line);                                                      \
                    if (sizeof(WTYPE) == 4) prefetch_kept(line + 64);                         \
                }                                                                             \
                for (int k = 0; k < N_ACC; ++k) {                                             \
                    vec w[OUT_TILE];                                                          \
                    for (int j = 0; j < W_ROWS; ++j) w[j] = LOAD(w_row + j * in + i, k);      \
                    for (int r = 0; r < R; ++r) {                                             \
                        const vec xv = pin(vec_load(x + r * x_stride + i + LANES * k));       \
                        for (int j = 0; j < W_ROWS; ++j)                                      \
                            acc[j][r][k] = vec_fma(w[j], xv, acc[j][r][k]);                   \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
            for (int j = 0; j < W_ROWS; ++j) {                                                \
                const vec scale =                                                             \
                    vec_set1(scale_row ? scale_row[j * (in / group) + g] : 1.0f);             \
                for (int r = 0; r < R; ++r) {                                                 \
                    for (int k = 1; k < N_ACC; ++k)                                           \
                        acc[j][r][0] = vec_add(acc[j][r][0], acc[j][r][k]);                   \
                    total[j][r] = vec_fma(acc[j][r][0], scale, total[j][r]);                  \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int j = 0; j < W_ROWS; ++j)                                                      \
            for (int r = 0; r < R; ++r) out[j * ROW_TILE + r] = vec_sum(total[j][r]);         \
    }

DEFINE_DOT_TILE(dot_f32_tile, float, load_f32_step)
DEFINE_DOT_TILE(dot_bf16_tile, uint16_t, load_bf16_step) /* x in bf16_order */

#endif
