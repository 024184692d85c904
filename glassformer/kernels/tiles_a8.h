/* Many rows of rounded inputs on the tile unit: the matrix product of w8a8 and w4a8 (a8.h's
 * function) when a prompt's tokens come at once, where a8.h's loops serve a decode step's few
 * rows. Per group g of 32 columns, with x's rows rounded as a8.h rounds them
 * (x_mk ~ d_mg q_mk, q in -127..127):
 *
 *   int8 weights w, scale s:        y_mn = sum_g s_ng d_mg (w_n . q_m)_g
 *   int4 weights s u + mn, u 0..15: y_mn = sum_g s_ng d_mg (u_n . q_m)_g + mn_ng d_mg sum_k q_mk
 *
 * The tile unit forms each group's integer sums for 16 weight rows by 16 inputs in one
 * instruction (TDPBSSD for signed int8 weights, TDPBUSD for unsigned nibbles), exact in int32;
 * what is left in floats is a conversion, a multiply and a multiply-add (int4: two) per weight
 * row, group and 16 inputs, on the sums the unit stores to memory. The weights
 * are the tile's A operand as they lie in memory (16 rows of a group's 32 bytes, int8), or as
 * their nibbles unpacked once per block of 16 rows (int4: a group's 16 bytes hold weights
 * 0..15 in their low nibbles and 16..31 in their high ones, so low then high is column order).
 * x is the B operand, which the unit takes in "VNNI" order: a group's 32 bytes of 16 inputs as
 * 8 rows of 64 bytes, row kk holding each input's 4 bytes q[m][4kk..4kk + 3].
 *
 * Sums run per (16 weight rows, 16 inputs), one register per weight row across the 16 inputs;
 * at the end they are turned (a 16 x 16 transpose) into rows of y.
 *
 * Why: a prefill's products were fp32 matmuls of the dequantized weights, about 74% of this
 * machine's fp32 peak (8 prompts of 128 tokens, SmolLM2 w8a8: 700 of 1,120 ms), while the
 * function computed takes its inputs in int8 anyway (llama.cpp's Q8_0 prefill multiplies int8
 * by int8 as well). Here the four matrices of a layer ran at 3.5-4.7x the GMAC/s
 * (benchmarks/prefill_tiles.py). What bounds it now, one thread on a 1024 x 576 x 1536 product
 * (3.5 ms, each part left out in turn): the unit's stores of its sums and the float work on
 * them, about 1.3 ms each; the products 0.7; rounding x and writing y 0.8.
 */
#ifndef GLASSFORMER_TILES_A8_H
#define GLASSFORMER_TILES_A8_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "step.h"

#if AMX
/* The fewest rows decode.c's step hands to the tile unit rather than a8.h's loops. A SmolLM2
 * step of 8, 16 and 32 rows (ms, w8a8 / w4a8): a8.h's 17.6 / 17.3, 33.2 / 33.4, 66.6 / 67.4;
 * here 18.8 / 23.0, 23.1 / 27.7, 36.9 / 42.4 (int4's nibbles are unpacked every call). */
#define TILES_A8_ROWS 16

/* x rounded for the tile unit, per tile t of 16 inputs and group g: 512 bytes of q in VNNI
 * order at q + (t G + g) 512, and the 16 inputs' d and d sum(q) at d + (t G + g) 16 and
 * sums + (t G + g) 16; inputs past the last are zeros */
typedef struct {
    int8_t *q;
    float *d, *sums;
} TileInputs;

static inline int64_t tile_inputs_bytes(int64_t rows, int64_t in) {
    return (rows + 15) / 16 * (in / 32) * (512 + 2 * 16 * (int64_t)sizeof(float));
}

/* tiles_a8's memory: x's tiles, then the weight blocks it lays out itself (weight_rows): every
 * block of an int4 matrix, else the last block where it has fewer than 16 rows */
static inline int64_t tiles_a8_bytes(const Linear *L, int64_t rows) {
    const int64_t own = L->storage == Q4 ? (L->out + 15) / 16 : L->out % 16 != 0;
    return tile_inputs_bytes(rows, L->in) + own * 16 * L->in;
}

static inline TileInputs tile_inputs_at(char *memory, int64_t rows, int64_t in) {
    const int64_t blocks = (rows + 15) / 16 * (in / 32);
    return (TileInputs){(int8_t *)memory, (float *)(memory + blocks * 512),
                        (float *)(memory + blocks * 512) + blocks * 16};
}

/* Input m of tile t rounded, group by group: round_group's arithmetic (a8.h), its 32 bytes
 * written as 8 four-byte words into their rows */
static void round_to_tiles(const float *x, int64_t in, int64_t t, int64_t m, const TileInputs *X) {
    const int64_t G = in / 32;
    for (int64_t g = 0; g < G; ++g) {
        const int64_t at = t * G + g;
        int32_t *words = (int32_t *)(X->q + at * 512) + m;
        if (!x) { /* past the last input */
            for (int kk = 0; kk < 8; ++kk) words[16 * kk] = 0;
            X->d[at * 16 + m] = X->sums[at * 16 + m] = 0.0f;
            continue;
        }
        int8_t bytes[32] __attribute__((aligned(32)));
        int sum;
        const float d = round_group(x + 32 * g, bytes, bytes + 16, &sum);
        for (int kk = 0; kk < 8; ++kk) memcpy(words + 16 * kk, bytes + 4 * kk, 4);
        X->d[at * 16 + m] = d;
        X->sums[at * 16 + m] = d * (float)sum;
    }
}

/* r[i] (16 floats of row i) in place as the columns: r[j][i] = the old r[i][j] */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
#define PD(v) _mm512_castps_pd(v)
    for (int i = 0; i < 16; i += 4) { /* rows i..i + 3, one column per 128-bit lane a register */
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(PD(t[i]), PD(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(PD(t[i]), PD(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(PD(t[i + 1]), PD(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(PD(t[i + 1]), PD(t[i + 3])));
    }
#undef PD
    for (int j = 0; j < 4; ++j) { /* the 128-bit lanes of r[j], r[4 + j], ... as a 4 x 4 */
        const __m512 a = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x44);
        const __m512 b = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x44);
        const __m512 c = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xee);
        const __m512 e = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xee);
        t[j] = _mm512_shuffle_f32x4(a, b, 0x88), t[4 + j] = _mm512_shuffle_f32x4(a, b, 0xdd);
        t[8 + j] = _mm512_shuffle_f32x4(c, e, 0x88), t[12 + j] = _mm512_shuffle_f32x4(c, e, 0xdd);
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
}

/* sum[n] (weight row 16 b + n, across inputs 16 t..) plus the bias into y[m][16 b + n] (+=
 * with accumulate), turned by a 16 x 16 transpose into rows of y; rows past the matrix's last
 * and inputs past the last are not stored */
static inline void store_sums(const Linear *L, __m512 sum[16], int64_t b, int64_t t,
                              int64_t rows, float *y, int accumulate) {
    const int64_t first = 16 * b, count = L->out - first < 16 ? L->out - first : 16;
    if (L->bias)
        for (int64_t n = 0; n < count; ++n)
            sum[n] = _mm512_add_ps(sum[n], _mm512_set1_ps(L->bias[first + n]));
    transpose16(sum); /* sum[m]: input 16 t + m's 16 outputs */
    const __mmask16 valid = (__mmask16)((1u << count) - 1);
    for (int64_t m = 0; m < 16 && 16 * t + m < rows; ++m) {
        float *out = y + (16 * t + m) * L->out + first;
        const __m512 v = accumulate ? _mm512_add_ps(_mm512_maskz_loadu_ps(valid, out), sum[m]) : sum[m];
        _mm512_mask_storeu_ps(out, valid, v);
    }
}

/* The calling thread's memory for a tile kernel's inputs, which its whole team reads: grown
 * on demand and kept from call to call (fresh memory each call took a page fault per 4 KB: an
 * int4 matrix's unpacked blocks, 0.46 against 0.24 ms for int8's); apart from thread_scratch,
 * which each thread keeps for itself. NULL where it cannot be had. Hand it to the team as a
 * plain pointer: inside a parallel region each thread would read its own. */
static char *tiles_memory(int64_t bytes) {
    static _Thread_local char *kept;
    static _Thread_local int64_t capacity;
    if (bytes > capacity) {
        free(kept);
        capacity = (bytes + 4095) / 4096 * 4096;
        kept = aligned_alloc(64, (size_t)capacity);
        if (!kept) capacity = 0;
    }
    return kept;
}

/* The tiles, two sets used in turn (group g's in set g % 2, so that the unit multiplies the
 * next group while the last one's sums are scaled): 0 and 3 a group of 16 weight rows (16 x 32
 * bytes), 1 and 4 a group of 16 inputs (8 x 64 bytes in VNNI order), 2 and 5 their sums (16 x
 * 16 int32) */
static void tiles_a8_configure(void) {
    uint8_t config[64] = {1}; /* palette 1 */
    uint16_t *bytes_per_row = (uint16_t *)(config + 16);
    uint8_t *rows = config + 48;
    for (int set = 0; set < 6; set += 3) {
        bytes_per_row[set] = 32, rows[set] = 16;
        bytes_per_row[set + 1] = 64, rows[set + 1] = 8;
        bytes_per_row[set + 2] = 64, rows[set + 2] = 16;
    }
    _tile_loadconfig(config);
}

/* Weight rows 16 b .. 16 b + 15 of L as the A operand (a stride of L->in bytes): int8 where
 * they lie, else laid out in `own` (16 x in bytes), the int4 nibbles unpacked and rows past the
 * matrix's last zeros; NULL where they lie and nothing is to be done. */
static int8_t *weight_rows(const Linear *L, int64_t b, int8_t *own) {
    const int64_t first = 16 * b, count = L->out - first < 16 ? L->out - first : 16;
    if (L->storage == INT8 && count == 16) return 0;
    memset(own, 0, 16 * L->in);
    for (int64_t n = 0; n < count; ++n) {
        if (L->storage == INT8) {
            memcpy(own + n * L->in, (const int8_t *)L->weight + (first + n) * L->in, L->in);
            continue;
        }
        const uint8_t *packed = (const uint8_t *)L->weight + (first + n) * (L->in / 2);
        for (int64_t g = 0; g < L->in / 32; ++g) {
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(packed + 16 * g));
            const __m128i low = _mm_set1_epi8(0x0f);
            int8_t *to = own + n * L->in + 32 * g;
            _mm_storeu_si128((__m128i *)to, _mm_and_si128(bytes, low));
            _mm_storeu_si128((__m128i *)(to + 16), _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
        }
    }
    return own;
}

/* Group g's products into tile set g % 2 (the tile numbers must be constants) */
static inline void tiles_a8_multiply(const Linear *L, const int8_t *w, int64_t stride,
                                     const int8_t *q, int64_t g) {
    if (g % 2 == 0) {
        _tile_loadd(0, w + 32 * g, stride);
        _tile_loadd(1, q, 64);
        _tile_zero(2);
        if (L->storage == INT8) _tile_dpbssd(2, 0, 1);
        else _tile_dpbusd(2, 0, 1);
    } else {
        _tile_loadd(3, w + 32 * g, stride);
        _tile_loadd(4, q, 64);
        _tile_zero(5);
        if (L->storage == INT8) _tile_dpbssd(5, 3, 4);
        else _tile_dpbusd(5, 3, 4);
    }
}

/* sum[n] += group g's sums C (16 weight rows by 16 inputs) in floats: times the inputs' d and
 * the row's scale, plus (int4) the row's min times the inputs' d sum(q) */
static inline __attribute__((always_inline)) void tiles_a8_scale(
    const Linear *L, const int32_t *C, const TileInputs *X, int64_t at, int64_t g,
    const float *const *scale_of, const float *const *mins_of, int64_t per_scale, __m512 *sum) {
    const __m512 d = _mm512_loadu_ps(X->d + at * 16);
    const int64_t s = g / per_scale;
    for (int n = 0; n < 16; ++n) {
        const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(C + 16 * n)), d);
        sum[n] = _mm512_fmadd_ps(dot, _mm512_set1_ps(scale_of[n][s]), sum[n]);
    }
    if (L->storage == Q4) {
        const __m512 sums = _mm512_loadu_ps(X->sums + at * 16);
        for (int n = 0; n < 16; ++n)
            sum[n] = _mm512_fmadd_ps(sums, _mm512_set1_ps(mins_of[n][g]), sum[n]);
    }
}

/* y[m][16 b ..] (+)= the sums of weight rows 16 b.. and inputs 16 t.. over every group. A
 * block's rows past the matrix's last are zeros (weight_rows) and take the last row's scales;
 * their sums are never stored. The unit multiplies group g + 1 while group g's sums are stored
 * and group g - 1's, stored a round earlier, are scaled: each waits on nothing just issued. */
static void tiles_a8_block(const Linear *L, const int8_t *w, int64_t b,
                           const TileInputs *X, int64_t t, int64_t rows, float *y, int accumulate) {
    const int64_t G = L->in / 32, first = 16 * b;
    const int64_t count = L->out - first < 16 ? L->out - first : 16;
    const int64_t scale_groups = L->in / L->group, per_scale = L->group / 32;
    int32_t C[2][256] __attribute__((aligned(64)));
    const float *scale_of[16], *mins_of[16];
    for (int n = 0; n < 16; ++n) {
        const int64_t o = first + (n < count ? n : count - 1);
        scale_of[n] = L->scale + o * scale_groups;
        mins_of[n] = L->mins ? L->mins + o * G : 0;
    }
    __m512 sum[16];
    for (int n = 0; n < 16; ++n) sum[n] = _mm512_setzero_ps();
    tiles_a8_multiply(L, w, L->in, X->q + t * G * 512, 0);
    for (int64_t g = 0; g < G; ++g) {
        const int64_t at = t * G + g;
        if (g + 1 < G) tiles_a8_multiply(L, w, L->in, X->q + (at + 1) * 512, g + 1);
        if (g % 2 == 0) _tile_stored(2, C[0], 64);
        else _tile_stored(5, C[1], 64);
        if (g > 0)
            tiles_a8_scale(L, C[(g - 1) % 2], X, at - 1, g - 1, scale_of, mins_of, per_scale, sum);
    }
    tiles_a8_scale(L, C[(G - 1) % 2], X, t * G + G - 1, G - 1, scale_of, mins_of, per_scale, sum);
    store_sums(L, sum, b, t, rows, y, accumulate);
}

/* y (rows, out) (+)= L(x) for `rows` inputs x[r] = x + r * stride, rounded to int8 (w8a8,
 * w4a8), on the tile unit. Orphaned: called inside a parallel region, whose threads first
 * round the inputs' tiles and lay out the weight blocks that need it into `memory`
 * (tiles_a8_bytes, shared by all), then take (tile of inputs, block of weight rows) pairs in
 * that order, so that each thread writes whole rows of y one after the other (in the other
 * order a 1024-token prefill's stores took a third of the time); ends with the barrier that
 * makes y whole. */
static void tiles_a8(const Linear *L, const float *x, int64_t stride, int64_t rows, float *y,
                     int accumulate, char *memory) {
    const int64_t tiles = (rows + 15) / 16, blocks = (L->out + 15) / 16;
    const TileInputs X = tile_inputs_at(memory, rows, L->in);
    int8_t *own = (int8_t *)memory + tile_inputs_bytes(rows, L->in);
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < 16 * tiles; ++i)
        round_to_tiles(i < rows ? x + i * stride : 0, L->in, i / 16, i % 16, &X);
    const int64_t first_own = L->storage == Q4 ? 0 : blocks - 1;
#pragma omp for schedule(static)
    for (int64_t b = first_own; b < blocks; ++b)
        weight_rows(L, b, own + (b - first_own) * 16 * L->in);
    tiles_a8_configure();
#pragma omp for schedule(static)
    for (int64_t i = 0; i < tiles * blocks; ++i) {
        const int64_t t = i / blocks, b = i % blocks;
        const int own_block = L->storage == Q4 || (b == blocks - 1 && L->out % 16);
        const int8_t *w = own_block ? own + (b - first_own) * 16 * L->in
                                    : (const int8_t *)L->weight + 16 * b * L->in;
        tiles_a8_block(L, w, b, &X, t, rows, y, accumulate);
    }
}
#endif

#endif
