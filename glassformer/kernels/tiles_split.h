/* int8 and int4 weights times float inputs, many rows at once, on the tile unit's bf16 products:
 * the function of int8 and int4 (the file's dequantized weights times x, nothing rounded) when
 * a prompt's tokens come at once, where the decode step's loops serve a few rows.
 *
 * The weights' integers are exact in bf16 (int8's q in -127..127, int4's nibbles u in 0..15:
 * 8 significant bits or fewer), and so is x, split in three: an fp32 value's 24 significant
 * bits are three bf16's 8, each piece what is left after the one before (bits cut, not
 * rounded, so the rest is exact):
 *
 *   x = x0 + x1 + x2,   x0 = bf16(x), x1 = bf16(x - x0), x2 = x - x0 - x1
 *
 * TDPBF16PS multiplies bf16 pairs exactly and sums them in fp32, so per chunk of 32 columns
 * (every group is whole chunks) the unit forms, for 16 weight rows by 16 inputs,
 *
 *   C = sum_k q_k x0_k + sum_k q_k x1_k + sum_k q_k x2_k    (fp32 sums of exact products)
 *
 * three instructions into one tile, the chunks of one scale group summed in it too; then
 *
 *   int8:  y += s C                       int4:  y += s C + m sum_k x_k
 *
 * per scale group, in floats: fp32 arithmetic as an fp32 matmul of the dequantized weights,
 * in another order (tests/test_kernels.py and test_fused.py hold it to the float64 products).
 *
 * Layout. The A operand is a block of 16 weight rows as bf16, a chunk's 32 columns (64 bytes)
 * a row, converted into the thread's scratch for each run of inputs; x is the B operand in
 * the unit's VNNI order, per tile of 16 inputs, chunk and piece 16 rows of 64 bytes, row kk
 * holding each input's pair (x[2kk], x[2kk + 1]) as two bf16.
 *
 * Why: prefill's products for int8 and int4 were fp32 matmuls of the weights dequantized a
 * slice at a time, near the cores' fp32 peak; the bf16 unit does 32 products for each of 16
 * by 16 pairs in one instruction. SmolLM2's four matrices at 128 rows: int8 1.8-2.3x the
 * GMAC/s, int4 1.4-1.6x (benchmarks/prefill_tiles.py).
 */
#ifndef GLASSFORMER_TILES_SPLIT_H
#define GLASSFORMER_TILES_SPLIT_H
#include <stdint.h>
#include <string.h>

#include "amx.h"
#include "step.h"
#include "tiles_a8.h" /* transpose16 */

#if AMX
/* The fewest rows decode.c's step hands to the tile unit's bf16 products: int8's, and int4's
 * (whose fewer rows take amx.h's byte products). A SmolLM2 step (FusedStep.rows, 128
 * positions, ms): int8 8 rows 25.3 through groups.h's loops, 34.8 here; 16 rows 46.5 there,
 * 26.5 here; 32 rows 97.0 there, 38.9 here. int4 16 rows 26-28 through amx.h, 28-29 here; 32
 * rows 58.8 there, 44.2 here. */
#define TILES_SPLIT_ROWS 16
#define TILES_SPLIT_Q4_ROWS 32

/* x split for the tile unit: per tile t of 16 inputs and chunk c, the three pieces' 16 x 64
 * bytes at pieces + (t C + c) 3 KB, and (int4) the 16 inputs' chunk sums at sums + (t C + c) 16 */
typedef struct {
    uint32_t *pieces;
    float *sums;
} SplitInputs;

static inline int64_t split_inputs_bytes(int64_t rows, int64_t in) {
    return (rows + 15) / 16 * (in / 32) * (3 * 1024 + 16 * (int64_t)sizeof(float));
}

static inline SplitInputs split_inputs_at(char *memory, int64_t rows, int64_t in) {
    const int64_t units = (rows + 15) / 16 * (in / 32);
    return (SplitInputs){(uint32_t *)memory, (float *)(memory + units * 3 * 1024)};
}

static inline __m512i bf16_bits(__m512 v) { /* v's top 16 bits (its bf16, cut), as int32 */
    return _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0xffff0000));
}

/* 16 floats' bf16 bits as 8 pairs: word kk = bf16(v[2kk]) | bf16(v[2kk + 1]) << 16 */
static inline __m256i bf16_pairs(__m512i bits) {
    const __m512i low = _mm512_and_si512(_mm512_srli_epi64(bits, 16), _mm512_set1_epi64(0xffff));
    const __m512i high = _mm512_and_si512(_mm512_srli_epi64(bits, 32), _mm512_set1_epi64(0xffff0000));
    return _mm512_cvtepi64_epi32(_mm512_or_si512(low, high));
}

/* Tile t's 16 inputs (x + m stride for m < valid, zeros past them) split, chunk by chunk: each
 * input's 32 values give a column of 16 pairs per piece, and 16 columns turned (transpose16)
 * are the piece's 16 rows. One input at a time, a word at a time, took as long as the
 * products (a 128 x 576 x 1536 product, one thread: 0.44 of 0.91 ms). */
static void split_tile(const float *x, int64_t stride, int64_t valid, int64_t in, int64_t t,
                       const SplitInputs *X) {
    const int64_t chunks = in / 32;
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t at = t * chunks + c;
        __m512 v[16][2], column[3][16];
        for (int m = 0; m < 16; ++m) {
            const float *row = x + m * stride + 32 * c;
            v[m][0] = m < valid ? _mm512_loadu_ps(row) : _mm512_setzero_ps();
            v[m][1] = m < valid ? _mm512_loadu_ps(row + 16) : _mm512_setzero_ps();
            const __m512d s = _mm512_add_pd(_mm512_add_pd(as_doubles(v[m][0], 0), as_doubles(v[m][0], 1)),
                                            _mm512_add_pd(as_doubles(v[m][1], 0), as_doubles(v[m][1], 1)));
            X->sums[at * 16 + m] = (float)_mm512_reduce_add_pd(s);
            for (int p = 0; p < 3; ++p) {
                __m256i pairs[2];
                for (int h = 0; h < 2; ++h) {
                    const __m512i bits = bf16_bits(v[m][h]);
                    pairs[h] = bf16_pairs(bits);
                    v[m][h] = _mm512_sub_ps(v[m][h], _mm512_castsi512_ps(bits)); /* the rest, exact */
                }
                column[p][m] = _mm512_castsi512_ps(
                    _mm512_inserti64x4(_mm512_castsi256_si512(pairs[0]), pairs[1], 1));
            }
        }
        for (int p = 0; p < 3; ++p) {
            transpose16(column[p]); /* column[p][kk]: row kk, each input's pair kk */
            float *rows = (float *)(X->pieces + at * 768 + 256 * p);
            for (int kk = 0; kk < 16; ++kk) _mm512_store_ps(rows + 16 * kk, column[p][kk]);
        }
    }
}

/* Weight rows 16 b .. 16 b + 15 as bf16 A tiles, chunk c's at own + 512 c (rows past the
 * matrix's last zeros) */
static void split_weight_rows(const Linear *L, int64_t b, uint16_t *own) {
    const int64_t first = 16 * b, count = L->out - first < 16 ? L->out - first : 16;
    const int64_t chunks = L->in / 32;
    for (int64_t n = 0; n < 16; ++n)
        for (int64_t c = 0; c < chunks; ++c) {
            uint16_t *to = own + 512 * c + 32 * n;
            if (n >= count) {
                memset(to, 0, 64);
                continue;
            }
            __m512i ints[2];
            if (L->storage == INT8) {
                const int8_t *q = (const int8_t *)L->weight + (first + n) * L->in + 32 * c;
                ints[0] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q));
                ints[1] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)));
            } else { /* a chunk's 16 bytes: weights 0..15 low nibbles, 16..31 high */
                const uint8_t *u = (const uint8_t *)L->weight + (first + n) * (L->in / 2) + 16 * c;
                const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)u));
                ints[0] = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0f));
                ints[1] = _mm512_srli_epi32(bytes, 4);
            }
            for (int h = 0; h < 2; ++h) {
                const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(_mm512_cvtepi32_ps(ints[h])), 16);
                _mm256_storeu_si256((__m256i *)(to + 16 * h), _mm512_cvtepi32_epi16(bits));
            }
        }
}

/* The tiles: 0 a chunk of 16 weight rows (16 x 32 bf16), 1 a piece of a chunk of 16 inputs (16
 * x 64 bytes), 2 the sums (16 x 16 fp32) */
static void split_configure(void) {
    uint8_t config[64] = {1}; /* palette 1 */
    uint16_t *bytes_per_row = (uint16_t *)(config + 16);
    uint8_t *rows = config + 48;
    for (int tile = 0; tile < 3; ++tile) bytes_per_row[tile] = 64, rows[tile] = 16;
    _tile_loadconfig(config);
}

/* y[m][16 b ..] (+)= weight rows 16 b.. (converted, at w) times inputs 16 t.. over every chunk */
static void split_block(const Linear *L, const uint16_t *w, int64_t b, const SplitInputs *X,
                        int64_t t, int64_t rows, float *y, int accumulate) {
    const int64_t chunks = L->in / 32, per_group = L->group / 32, groups = L->in / L->group;
    const int64_t first = 16 * b, count = L->out - first < 16 ? L->out - first : 16;
    float C[256] __attribute__((aligned(64)));
    __m512 sum[16];
    for (int n = 0; n < 16; ++n) sum[n] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        _tile_zero(2);
        for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
            const uint32_t *pieces = X->pieces + (t * chunks + c) * 768;
            _tile_loadd(0, w + 512 * c, 64);
            for (int p = 0; p < 3; ++p) {
                _tile_loadd(1, pieces + 256 * p, 64);
                _tile_dpbf16ps(2, 0, 1);
            }
        }
        _tile_stored(2, C, 64);
        for (int n = 0; n < 16; ++n) {
            const int64_t o = first + (n < count ? n : count - 1);
            sum[n] = _mm512_fmadd_ps(_mm512_load_ps(C + 16 * n),
                                     _mm512_set1_ps(L->scale[o * groups + g]), sum[n]);
        }
        if (L->storage == Q4) { /* groups are chunks: + m sum(x) */
            const __m512 sums = _mm512_loadu_ps(X->sums + (t * chunks + g) * 16);
            for (int n = 0; n < 16; ++n) {
                const int64_t o = first + (n < count ? n : count - 1);
                sum[n] = _mm512_fmadd_ps(sums, _mm512_set1_ps(L->mins[o * groups + g]), sum[n]);
            }
        }
    }
    store_sums(L, sum, b, t, rows, y, accumulate);
}

/* Tiles of inputs taken together against each block of weights: 8 (128 inputs, their pieces
 * 432 KB at 576 columns) stay in the core's own cache while the blocks pass; all of a 1024-row
 * prefill's did not, and came from the shared cache once per block (a 1024 x 576 x 1536
 * product: 9.7 ms against the fp32 matmul's 6.1, 0.44 against 0.56 ms at 128 rows). */
#define SPLIT_TILES 8

/* y (rows, out) (+)= L(x) for an int8 or int4 L and `rows` inputs x[r] = x + r * stride, on the
 * tile unit. Orphaned, as tiles_a8: the threads split x into `memory` (split_inputs_bytes,
 * shared by all), then take (SPLIT_TILES tiles of inputs, block of 16 weight rows) pairs in
 * that order, so that a thread's share is whole rows of y where there are many; each block is
 * turned into bf16 tiles in the thread's scratch, where they stay while the tiles of inputs
 * pass (through a buffer shared by the threads, written once a call, they came from the
 * shared cache: 0.4 ms of a 128 x 576 x 1536 product's 0.91 on one thread). Ends with the
 * barrier that makes y whole. */
static void tiles_split(const Linear *L, const float *x, int64_t stride, int64_t rows, float *y,
                        int accumulate, char *memory) {
    const int64_t tiles = (rows + 15) / 16, blocks = (L->out + 15) / 16;
    const int64_t runs = (tiles + SPLIT_TILES - 1) / SPLIT_TILES;
    const SplitInputs X = split_inputs_at(memory, rows, L->in);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t)
        split_tile(x + 16 * t * stride, stride, rows - 16 * t, L->in, t, &X);
    split_configure();
    uint16_t *own = (uint16_t *)thread_scratch(16 * L->in * 2);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < runs * blocks; ++i) {
        const int64_t run = i / blocks, b = i % blocks, last = (run + 1) * SPLIT_TILES;
        split_weight_rows(L, b, own);
        for (int64_t t = run * SPLIT_TILES; t < (last < tiles ? last : tiles); ++t)
            split_block(L, own, b, &X, t, rows, y, accumulate);
    }
}
#endif

/* The tile kernels as one entry point: y (rows, out) = x (rows, in) through an int8 (`group`
 * columns a scale, a multiple of 32) or int4 weight (storage INT8 or Q4, scale and mins as a
 * Linear holds them), x rounded to int8 first (round_inputs: w8a8, w4a8; tiles_a8) or not
 * (tiles_split). Returns 1, or 0 from a library built without the tile unit, or where Linux
 * refused it its registers, or without the memory for x's tiles: the caller computes y its
 * own way. */
int matmul_tiles(const float *x, int64_t rows, const void *weight, int64_t storage,
                 const float *scale, const float *mins, int64_t in, int64_t out, int64_t group,
                 int64_t round_inputs, float *y, int n_threads) {
#if AMX
    if (glassformer_amx() != 1) return 0;
    const Linear L = {.weight = weight, .scale = scale, .mins = mins, .in = in, .out = out,
                      .group = group, .storage = storage, .round_inputs = round_inputs};
    char *memory = tiles_memory(round_inputs ? tiles_a8_bytes(&L, rows) : split_inputs_bytes(rows, in));
    if (!memory) return 0;
#pragma omp parallel num_threads(n_threads)
    {
        if (round_inputs) tiles_a8(&L, x, in, rows, y, 0, memory);
        else tiles_split(&L, x, in, rows, y, 0, memory);
    }
    return 1;
#else
    (void)x, (void)rows, (void)weight, (void)storage, (void)scale, (void)mins, (void)in;
    (void)out, (void)group, (void)round_inputs, (void)y, (void)n_threads;
    return 0;
#endif
}

#endif
