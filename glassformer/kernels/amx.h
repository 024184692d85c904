/* int4 products on AMX, the tile units of Intel's Xeons from Sapphire Rapids on: the same
 * function as groups.h's dot_q4, a row's dot product with x over its groups of 32 weights
 * scale * q + min (nibbles q in 0..15, GGUF's Q4_0/Q4_1 and Int4Linear), computed as
 *
 *   sum_k (s q_k + m) x_k  =  s * (q . x)  +  m * sum_k x_k
 *
 * with q . x exact, in integers. A group's 32 values of x become whole numbers against the
 * group's largest one: with e the exponent of max |x_k| (2^e <= max < 2^(e + 1)),
 *
 *   N_k = x_k * 2^(29 - e)   (|N_k| < 2^30),   N_k = sum_l 256^l digit_lk,  digits in -128..127
 *
 * Every x_k within a factor of 64 of the group's largest is exact (its 24 bits fit in 30); a
 * smaller one keeps every bit down to 2^-29 of the largest, below what an fp32 sum of the
 * group rounds away. The tile unit's TDPBSUD forms the byte products, signed digits times
 * unsigned nibbles, summed in int32 without rounding: 16 weight rows by 64 columns (two
 * groups) by 4 digits in one instruction. What is left in floats is per group and 16 rows:
 *
 *   dot += s * (sum_l 2^(e - 29 + 8l) * C_l)  +  m * sum_k x_k       (C_l: digit l's sums)
 *
 * in two running totals (even and odd groups), a group's scaled sum and its min term added
 * together. x's group sums are taken in doubles and rounded once. On random rows with outlier
 * inputs the results' mean distance from the float64 products was that of dot_q4's (9.45e-7
 * against 9.64e-7 at 576 columns, 1.97e-6 against 1.93e-6 at 1536); tests/test_fused.py holds
 * the two to the float64 products side by side.
 *
 * Why: dot_q4 turns every weight into a float before its FMA, 7 vector operations for 32
 * weights, bound by that arithmetic as much as by memory (performance.md). Here a pair of
 * groups costs a nibble split (3 operations for each 64 bytes) and the tile unit does the
 * products: in one SmolLM2-sized int4 matrix from memory (2 threads), 45 GB/s of its bytes
 * against dot_q4's 26.
 *
 * Layout. The tile unit takes a weight tile of 16 rows of 64 bytes in which row kk holds, for
 * each of 16 weight rows n, the 4 bytes q[n][4kk..4kk + 3] (the "VNNI" order). FusedStep
 * (infer/fused.py, kernels.pack_q4_tiles) copies each int4 matrix once into that order, one
 * stream of 768 bytes per 16 weight rows and 2 groups (a "pair", 64 columns): 512 bytes of
 * nibbles, 8 chunks of 64 whose low nibbles are tile row 2c and high nibbles row 2c + 1, then
 * the pair's scales and mins, (2 groups, 16 rows) floats each. A matrix with an odd number of
 * groups gets a zero group (scale and min 0); rows past the last whole 16 keep dot_q4.
 */
#ifndef GLASSFORMER_AMX_H
#define GLASSFORMER_AMX_H
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <omp.h>

#include "a8.h" /* thread_scratch */
#include "groups.h"
#include "step.h"

#if defined(GLASSFORMER_AMX) && LANES == 16
#define AMX 1
/* Linux hands a process the tile registers' state only when asked (arch_prctl
 * ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA): asked once. 1 where granted, -1 where refused
 * (a kernel before 5.16); 0 from a library built without the tile unit (below). */
static int amx_granted = 0;
int glassformer_amx(void) {
    if (amx_granted == 0) amx_granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return amx_granted;
}

/* The tiles: 0 the weights (16 x 64 bytes); 1 and 2 two inputs' digits and their sums (16
 * rows: 8 a input, digit l of group h in row l + 4h); 3 and 4 one input's (8 rows). */
static void amx_configure(void) {
    uint8_t config[64] = {1}; /* palette 1 */
    uint16_t *bytes_per_row = (uint16_t *)(config + 16);
    uint8_t *rows = config + 48;
    const uint8_t tile_rows[5] = {16, 16, 16, 8, 8};
    for (int t = 0; t < 5; ++t) bytes_per_row[t] = 64, rows[t] = tile_rows[t];
    _tile_loadconfig(config);
}

/* x in digits for the tile unit: per input r, the tile rows of pair p at
 * digits + (p * R + r) * 512 (so two inputs' 16 rows are evenly spaced), and per group g the
 * powers 2^(e - 29 + 8l) at powers[(r * G + g) * 4 + l] and sum_k x_k at sums[r * G + g]. */
typedef struct {
    int8_t *digits;
    float *powers, *sums;
} Digits;

/* a matrix's groups of 32 columns, rounded up to whole pairs (the zero group of an odd count) */
static inline int64_t amx_groups(int64_t in) { return (in / 32 + 1) / 2 * 2; }

static inline float power_of_two(int k) { /* 2^k for k in -126..127: the exponent bits */
    const uint32_t bits = (uint32_t)(k + 127) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline __m512d as_doubles(__m512 v, int half) { /* 8 of v's floats */
    const __m256d part = half ? _mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)
                              : _mm512_castpd512_pd256(_mm512_castps_pd(v));
    return _mm512_cvtps_pd(_mm256_castpd_ps(part));
}

static void x_to_digits(const float *x, int64_t in, int64_t R, int64_t r, const Digits *d) {
    const int64_t groups = amx_groups(in);
    for (int64_t g = 0; g < groups; ++g) {
        int8_t *rows = d->digits + ((g / 2) * R + r) * 512;
        const int h = (int)(g % 2);
        float *powers = d->powers + (r * groups + g) * 4;
        if (g * 32 >= in) { /* the zero group of an odd count */
            memset(rows + 64 * 4 * h, 0, 4 * 64);
            memset(powers, 0, 4 * sizeof(float));
            d->sums[r * groups + g] = 0;
            continue;
        }
        const __m512 a = _mm512_loadu_ps(x + 32 * g), b = _mm512_loadu_ps(x + 32 * g + 16);
        const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        /* the sum in doubles, once rounded */
        const __m512d s = _mm512_add_pd(_mm512_add_pd(as_doubles(a, 0), as_doubles(a, 1)),
                                        _mm512_add_pd(as_doubles(b, 0), as_doubles(b, 1)));
        d->sums[r * groups + g] = (float)_mm512_reduce_add_pd(s);
        /* e from the largest's exponent bits (a subnormal's read as -127), kept in -97..127 so
         * that 2^(29 - e) and 2^(e - 29) are normal floats. NaN or infinity (the sum shows
         * both: max_ps passes a NaN by): NaN powers, so the rows' sums are NaN as dot_q4's are */
        const int finite = isfinite(d->sums[r * groups + g]);
        uint32_t bits;
        memcpy(&bits, &largest, 4);
        int e = (int)((bits >> 23) & 0xff) - 127;
        e = e < -97 ? -97 : e;
        for (int l = 0; l < 4; ++l) powers[l] = finite ? power_of_two(e - 29 + 8 * l) : NAN;
        const __m512 up = _mm512_set1_ps(finite ? power_of_two(29 - e) : 0.0f);
        __m512i n[2] = {_mm512_cvtps_epi32(_mm512_mul_ps(a, up)),
                        _mm512_cvtps_epi32(_mm512_mul_ps(b, up))};
        for (int l = 0; l < 4; ++l) {
            int8_t *row = rows + 64 * (l + 4 * h);
            /* the other group's half of the row */
            _mm256_storeu_si256((__m256i *)(row + 32 * (1 - h)), _mm256_setzero_si256());
            for (int i = 0; i < 2; ++i) {
                /* the low byte as a signed digit, and what is left of N after it */
                const __m512i digit = _mm512_srai_epi32(_mm512_slli_epi32(n[i], 24), 24);
                _mm_storeu_si128((__m128i *)(row + 32 * h + 16 * i), _mm512_cvtepi32_epi8(digit));
                n[i] = _mm512_srai_epi32(_mm512_sub_epi32(n[i], digit), 8);
            }
        }
    }
}

/* Pair p's 512 bytes of nibbles as the weight tile's 16 rows of 64 bytes (low nibbles, high) */
static inline void amx_weight_tile(const uint8_t *pair, uint8_t *tile) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int c = 0; c < 8; ++c) {
        const __m512i bytes = _mm512_loadu_si512(pair + 64 * c);
        _mm512_store_si512(tile + 128 * c, _mm512_and_si512(bytes, low));
        _mm512_store_si512(tile + 128 * c + 64, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low));
    }
}

/* totals[h] += s * (sum_l power_l * C_l) + m * sum(x) for groups 2p and 2p + 1 of one input,
 * C its 8 rows of the stored sums (16 int32 each: the block's 16 weight rows), scale and mins
 * the pair's (2 groups x 16 rows each) */
static inline void amx_add(const int32_t *C, const float *scale, const float *mins,
                           const float *powers, const float *sums, int64_t p, __m512 totals[2]) {
    for (int h = 0; h < 2; ++h) {
        const int64_t g = 2 * p + h;
        const float *pw = powers + 4 * g;
        const int32_t *c = C + 64 * h; /* rows 4h..4h + 3 */
        __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 48)), _mm512_set1_ps(pw[3]));
        for (int l = 2; l >= 0; --l)
            f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * l)),
                                _mm512_set1_ps(pw[l]), f);
        const __m512 t = _mm512_fmadd_ps(_mm512_loadu_ps(mins + 16 * h), _mm512_set1_ps(sums[g]),
                                         _mm512_mul_ps(f, _mm512_loadu_ps(scale + 16 * h)));
        totals[h] = _mm512_add_ps(totals[h], t);
    }
}

/* The tile unit waits for a weight tile's stores to land before it can load it: the tile of
 * pair i + AMX_AHEAD is split while pair i's is multiplied (a ring of AMX_RING tiles). In one
 * SmolLM2-sized matrix (2 threads) that took the products from 0.054 to 0.025 ms. The ring
 * runs over a thread's blocks as one stream of pairs, where each block had started it afresh
 * and waited on its first split: SmolLM2 int4 step / read 0.75-0.79x -> 0.82-0.86x
 * (benchmarks/step_bandwidth.py, 3 rounds in turn). */
#define AMX_AHEAD 2
#define AMX_RING 4
#define AMX_PAIR 768 /* a block's pair: 512 bytes of nibbles, then 2 x 16 scales and mins */

/* Rows 16 b0 .. 16 b1 - 1 of L (whole blocks) against R inputs in digits:
 * y[r][o] (+)= dot + bias */
static void amx_blocks(const Linear *L, int64_t b0, int64_t b1, const Digits *d, int64_t R,
                       float *y, int accumulate) {
    const int64_t groups = amx_groups(L->in), pairs = groups / 2;
    const int64_t stream = (b1 - b0) * pairs; /* the blocks' pairs follow one another */
    const uint8_t *w = L->packed + b0 * pairs * AMX_PAIR;
    uint8_t ring[AMX_RING][1024] __attribute__((aligned(64)));
    int32_t C[256] __attribute__((aligned(64)));
    __m512 totals[R][2];
    for (int64_t i = 0; i < AMX_AHEAD && i < stream; ++i) amx_weight_tile(w + AMX_PAIR * i, ring[i]);
    for (int64_t i = 0, p = 0, b = b0; i < stream; ++i) { /* pair p of block b */
        if (p == 0)
            for (int64_t r = 0; r < R; ++r) totals[r][0] = totals[r][1] = _mm512_setzero_ps();
        const uint8_t *next = w + AMX_PAIR * (i + AMX_AHEAD);
        if (i + AMX_AHEAD < stream) {
            for (int line = 0; line < AMX_PAIR / 64; ++line) prefetch_ahead(next + 64 * line);
            amx_weight_tile(next, ring[(i + AMX_AHEAD) % AMX_RING]);
        }
        const float *scale = (const float *)(w + AMX_PAIR * i + 512), *mins = scale + 32;
        _tile_loadd(0, ring[i % AMX_RING], 64);
        for (int64_t r = 0; r < R; r += 2) {
            const int8_t *digits = d->digits + (p * R + r) * 512;
            if (r + 1 < R) { /* two inputs */
                _tile_loadd(1, digits, 64);
                _tile_zero(2);
                _tile_dpbsud(2, 1, 0);
                _tile_stored(2, C, 64);
            } else {
                _tile_loadd(3, digits, 64);
                _tile_zero(4);
                _tile_dpbsud(4, 3, 0);
                _tile_stored(4, C, 64);
            }
            for (int64_t k = r; k < R && k < r + 2; ++k)
                amx_add(C + 128 * (k - r), scale, mins, d->powers + k * groups * 4,
                        d->sums + k * groups, p, totals[k]);
        }
        if (++p < pairs) continue;
        for (int64_t r = 0; r < R; ++r) { /* block b done */
            float dots[16], *out = y + r * L->out + 16 * b;
            _mm512_storeu_ps(dots, _mm512_add_ps(totals[r][0], totals[r][1]));
            for (int n = 0; n < 16; ++n) {
                const float dot = L->bias ? dots[n] + L->bias[16 * b + n] : dots[n];
                out[n] = accumulate ? out[n] + dot : dot;
            }
        }
        p = 0, ++b;
    }
}

/* decode.c's linear() for an int4 matrix FusedStep packed for the tile unit: each thread
 * writes every input's digits into its own scratch (as a8.h rounds them: the same bytes in
 * each thread, no barrier), then takes its share of the blocks of 16 rows, one run of whole
 * blocks a thread as schedule(static) would give them; the rows past the last whole block are
 * dot_q4's, the last thread's. */
static void linear_amx(const Linear *L, const float *x, int64_t stride, int64_t R, float *y,
                       int accumulate) {
    const int64_t groups = amx_groups(L->in), blocks = L->out / 16;
    char *memory = thread_scratch(R * groups * (256 + 5 * 4));
    const Digits d = {(int8_t *)memory, (float *)(memory + R * groups * 256),
                      (float *)(memory + R * groups * 256) + R * groups * 4};
    for (int64_t r = 0; r < R; ++r) x_to_digits(x + r * stride, L->in, R, r, &d);
    amx_configure();
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t share = (blocks + threads - 1) / threads;
    const int64_t b0 = t * share < blocks ? t * share : blocks;
    const int64_t b1 = b0 + share < blocks ? b0 + share : blocks;
    if (b1 > b0) amx_blocks(L, b0, b1, &d, R, y, accumulate);
    if (t == threads - 1)
        for (int64_t o = 16 * blocks; o < L->out; ++o)
            for (int64_t r = 0; r < R; ++r) {
                const float *row_scale = L->scale + o * (L->in / 32);
                const float dot = vec_sum(dot_q4((const uint8_t *)L->weight + o * (L->in / 2),
                                                 x + r * stride, row_scale,
                                                 L->mins + o * (L->in / 32), L->in)) +
                                  (L->bias ? L->bias[o] : 0.0f);
                float *out = y + r * L->out + o;
                *out = accumulate ? *out + dot : dot;
            }
#pragma omp barrier
}
#else /* built without the tile unit (GLASSFORMER_KERNELS=avx512 or avx2, or a CPU without) */
#define AMX 0
int glassformer_amx(void) { return 0; }
#endif

#endif
