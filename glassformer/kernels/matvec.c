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
 * AVX-512, else 8 with AVX2 (glassformer/kernels/__init__.py picks the flags for the CPU).
 *
 * Built by glassformer/kernels/__init__.py with `cc -O3 -mavx2 -mfma [-mavx512f -mavx512bw]
 * -fopenmp` and called through ctypes; the plain torch path is the reference it is tested
 * against.
 */
#include <immintrin.h>
#include <stdint.h>

#ifdef __AVX512F__
#define LANES 16
typedef __m512 vec;
static inline vec vec_zero(void) { return _mm512_setzero_ps(); }
static inline vec vec_set1(float v) { return _mm512_set1_ps(v); }
static inline vec vec_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vec vec_add(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vec_fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vec_sum(vec v) { return _mm512_reduce_add_ps(v); }
/* LANES weights as floats, for each storage */
static inline vec load_f32(const float *w) { return _mm512_loadu_ps(w); }
static inline vec load_bf16(const uint16_t *w) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline vec load_int8(const int8_t *w) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
}
#else
#define LANES 8
typedef __m256 vec;
static inline vec vec_zero(void) { return _mm256_setzero_ps(); }
static inline vec vec_set1(float v) { return _mm256_set1_ps(v); }
static inline vec vec_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vec vec_add(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vec_fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vec_sum(vec v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_hadd_ps(h, h);
    h = _mm_hadd_ps(h, h);
    return _mm_cvtss_f32(h);
}
static inline vec load_f32(const float *w) { return _mm256_loadu_ps(w); }
static inline vec load_bf16(const uint16_t *w) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline vec load_int8(const int8_t *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}
#endif

#define STEP 32                  /* columns per inner iteration */
#define N_ACC (STEP / LANES)     /* independent accumulators: 2 (AVX-512) or 4 (AVX2) */

/* One function per storage. scale is NULL (f32, bf16) or holds one float per output row and
 * group of `group` columns (int8): row o's columns [g*group, (g+1)*group) are multiplied by
 * scale[o * (in / group) + g]; group = in is per-channel scaling. `in` and `group` must be
 * multiples of 32 (checked by the caller).
 *
 * Several accumulators per dot product keep several FMAs in flight: with one, each FMA would
 * wait for the previous one's result (4 cycles) and the loop would be compute-bound, not
 * memory-bound. Each group's partial sum is scaled once, then added to the row's total. */
#define DEFINE_MATVEC(NAME, WTYPE, LOAD)                                                      \
    void NAME(const float *x, const WTYPE *w, const float *scale, float *y, int64_t rows,     \
              int64_t in, int64_t out, int64_t group, int n_threads) {                        \
        const int64_t n_groups = in / group;                                                   \
        _Pragma("omp parallel for num_threads(n_threads) schedule(static)")                   \
        for (int64_t o = 0; o < out; ++o) {                                                    \
            const WTYPE *w_row = w + o * in;                                                   \
            for (int64_t b = 0; b < rows; ++b) {                                               \
                const float *x_row = x + b * in;                                               \
                vec total = vec_zero();                                                        \
                for (int64_t g = 0; g < n_groups; ++g) {                                       \
                    vec acc[N_ACC];                                                            \
                    for (int k = 0; k < N_ACC; ++k) acc[k] = vec_zero();                       \
                    for (int64_t i = g * group; i < (g + 1) * group; i += STEP)                \
                        for (int k = 0; k < N_ACC; ++k)                                        \
                            acc[k] = vec_fma(LOAD(w_row + i + LANES * k),                      \
                                             vec_load(x_row + i + LANES * k), acc[k]);         \
                    for (int k = 1; k < N_ACC; ++k) acc[0] = vec_add(acc[0], acc[k]);          \
                    total = vec_fma(acc[0], vec_set1(scale ? scale[o * n_groups + g] : 1.0f),  \
                                    total);                                                    \
                }                                                                              \
                y[b * out + o] = vec_sum(total);                                               \
            }                                                                                  \
        }                                                                                      \
    }

DEFINE_MATVEC(matvec_f32, float, load_f32)
DEFINE_MATVEC(matvec_bf16, uint16_t, load_bf16)
DEFINE_MATVEC(matvec_int8, int8_t, load_int8)
