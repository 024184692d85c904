/* One decode step of a pre-norm GPT-family model in one call (seed 000 §2.5.1: decode is
 * memory-bound, so a token should cost the time to stream the weights, nothing more).
 *
 * The torch path runs a token through ~40 small ops per layer, each with its own dispatch,
 * allocation and OpenMP fork/join. Here the whole token is one OpenMP parallel region: the
 * threads split every matrix-vector product by output rows and the attention by heads, and
 * meet at a barrier between steps; the small steps (norms, RoPE, the cache write) are split by
 * rows: one thread's work for one row (a 32-row Q8_0 SmolLM2 step spent 1.15 ms a step in each
 * norm on one thread while the other waited, 0.62 split). Nothing is allocated: the caller
 * hands in scratch buffers and the KV cache.
 * The same call also takes several rows at once, each a token at its own position of its own
 * cache row (the Engine's continuous batch), or a short run of consecutive tokens of one cache
 * row (a speculative round's check): each weight row is then read once for all of them, and
 * row r attends to the positions 0..positions[r] of its cache row.
 *
 * Per layer, for the token x at position pos (the reference is glassformer/nn, step by step):
 *
 *   h = norm(x)                                   attn_norm (RMSNorm or LayerNorm)
 *   q, k, v = split(W_qkv h + b)                  one fused projection
 *   q, k = rms(q) * g_q, rms(k) * g_k per head    Qwen3's qk_norm, when present
 *   q, k = rope(q, pos), rope(k, pos)             pairs (i, i + D/2), when the model has RoPE
 *   cache[pos] = k, v                             this layer's (Hkv, Tmax, D) block
 *   a_h = softmax(q_h . K_j * scale) . V_j        each query head over keys 0..pos (GQA)
 *   x = x + W_out a + b
 *   h = norm(x)                                   ffn_norm
 *   u = W_up h + b                                gate and up in one matrix when gated
 *   x = x + W_down act(u) + b                     act(gate) * up when gated
 *
 * then logits = W_head norm(x). Weights are f32, bf16, int8 with group scales or int4 with
 * group scales and mins (simd.h);
 * activations are f32; the cache is f32, bf16 or f16. The softmax's, SiLU's and GELU-tanh's
 * exponentials are SIMD ones (simd.h's vec_exp, within about an ulp of expf), RoPE's cosines
 * and sines are computed once per token for every layer and head.
 *
 * glassformer/infer/fused.py fills these structs through ctypes. glassformer_layout() hands it
 * every struct's size and every field's offset and size as this compiler lays them out, and
 * it refuses to run when its mirror differs: one field out of order would be read as another.
 */
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <string.h>

#include "a8.h"
#include "simd.h"

enum storage { F32 = 0, BF16 = 1, INT8 = 2, Q4 = 3 };
enum activation { RELU = 0, GELU = 1, GELU_TANH = 2, SILU = 3 };

typedef struct {
    const void *weight; /* (out, in); int4: (out, in / 2) bytes */
    const float *scale; /* int8, int4: (out, in / group); else NULL */
    const float *mins;  /* int4: (out, in / 32); else NULL */
    const float *bias;  /* (out,) or NULL */
    int64_t in, out, group;
    int64_t storage;
    int64_t round_inputs; /* 1: x rounded to int8 in groups of 32 first (a8.h: w8a8, w4a8) */
} Linear;

typedef struct {
    const float *attn_norm_weight, *attn_norm_bias; /* bias: LayerNorm with a shift only */
    const float *q_norm_weight, *k_norm_weight;     /* Qwen3's per-head gains, or NULL */
    const float *ffn_norm_weight, *ffn_norm_bias;
    Linear qkv, out, up, down;
    void *k_cache, *v_cache; /* this layer's block of the cache row: (Hkv, Tmax, D) */
} Layer;

typedef struct {
    int64_t n_layers, d_model, n_heads, n_kv_heads, head_dim, d_ff, vocab_size;
    int64_t cache_head_stride, cache_pos_stride; /* in elements */
    int64_t rms_norm, gated, activation, cache_kind, emb_storage; /* cache_kind: CACHE_* */
    float norm_eps, attn_scale, rope_factor;
    const float *inv_freq; /* (D/2,) RoPE frequencies, or NULL: no RoPE */
    const void *tok_emb;   /* (V, C) f32 or bf16 */
    const float *pos_emb;  /* (Tmax, C) learned or sinusoidal table, or NULL */
    const float *final_norm_weight, *final_norm_bias;
    Linear head;
    const Layer *layers;
    /* scratch for up to max_tokens rows: x, h (rows, C); qkv (rows, (H + 2 Hkv) D); att (rows,
     * H D); ff (rows, 2 d_ff); and scores (H, Tmax) */
    float *x, *h, *qkv, *att, *scores, *ff;
    int64_t max_positions;
} Model;

/* --- pieces ---------------------------------------------------------------------------------- */

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffff) > 0x7f800000) return (uint16_t)((bits >> 16) | 64); /* NaN */
    bits += 0x7fff + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

/* W[o] . x + b[o] for one output row o, whatever the weight's storage. */
static inline __attribute__((always_inline)) float row_dot(const Linear *L, int64_t o,
                                                           const float *x) {
    const int64_t n_groups = L->in / L->group;
    const float *scale = L->scale ? L->scale + o * n_groups : 0;
    float dot;
    if (L->storage == Q4)
        dot = dot_q4((const uint8_t *)L->weight + o * (L->in / 2), x, scale,
                     L->mins + o * n_groups, L->in);
    else if (L->storage == F32)
        dot = dot_f32((const float *)L->weight + o * L->in, x, scale, L->in, L->group);
    else if (L->storage == BF16)
        dot = dot_bf16((const uint16_t *)L->weight + o * L->in, x, scale, L->in, L->group);
    else
        dot = dot_int8((const int8_t *)L->weight + o * L->in, x, scale, L->in, L->group);
    return L->bias ? dot + L->bias[o] : dot;
}

/* W[o + j] . x[r] for `w_rows` weight rows (1, or OUT_TILE where the storage has a wider
 * tile) and ROW_TILE inputs x[r] = x + r * stride into dots[j * ROW_TILE + r], each bit for
 * bit row_dot's without the bias. */
static inline int64_t tile_rows(const Linear *L, int64_t left) {
    return (L->storage == F32 || L->storage == BF16) && left >= OUT_TILE ? OUT_TILE : 1;
}
static inline void tile_dot(const Linear *L, int64_t o, int64_t w_rows, const float *x,
                            int64_t stride, float *dots) {
    const int64_t n_groups = L->in / L->group;
    const float *scale = L->scale ? L->scale + o * n_groups : 0;
    if (L->storage == Q4)
        dot_q4_tile((const uint8_t *)L->weight + o * (L->in / 2), x, stride, scale,
                    L->mins + o * n_groups, L->in, dots);
    else if (L->storage == F32 && w_rows == OUT_TILE)
        dot_f32_tile((const float *)L->weight + o * L->in, x, stride, scale, L->in, L->group,
                     OUT_TILE, dots);
    else if (L->storage == F32)
        dot_f32_tile((const float *)L->weight + o * L->in, x, stride, scale, L->in, L->group, 1,
                     dots);
    else if (L->storage == BF16 && w_rows == OUT_TILE)
        dot_bf16_tile((const uint16_t *)L->weight + o * L->in, x, stride, scale, L->in,
                      L->group, OUT_TILE, dots);
    else if (L->storage == BF16)
        dot_bf16_tile((const uint16_t *)L->weight + o * L->in, x, stride, scale, L->in,
                      L->group, 1, dots);
    else
        dot_int8_tile((const int8_t *)L->weight + o * L->in, x, stride, scale, L->in, L->group,
                      dots);
}

/* W[o] . x[r] for inputs x rounded to int8 (a8.h), in lanes: `tile` ROW_TILE of them, or one;
 * the storage (int4, else int8 in groups of `group`) a constant where inlined */
static inline __attribute__((always_inline)) void a8_dot(const Linear *L, int64_t o,
                                                         const Rounded *x, int tile, vec *out,
                                                         const int q4, const int64_t group) {
    const int64_t in = L->in, n_groups = in / group;
    const float *scale = L->scale + o * n_groups;
    if (q4 && tile) dot_q4_a8((const uint8_t *)L->weight + o * (in / 2), x, scale,
                              L->mins + o * n_groups, in, ROW_TILE, out);
    else if (q4) dot_q4_a8((const uint8_t *)L->weight + o * (in / 2), x, scale,
                           L->mins + o * n_groups, in, 1, out);
    else if (tile) dot_i8_a8((const int8_t *)L->weight + o * in, x, scale, in, group, ROW_TILE, out);
    else dot_i8_a8((const int8_t *)L->weight + o * in, x, scale, in, group, 1, out);
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
 * at a time, summed together (vec_sum4). More: each weight row against ROW_TILE inputs at a time
 * (read once for all of them, in the one-input order, so each input's outputs are bit for bit
 * what it gets alone), then the rest one by one. Inlined once per storage and common group size
 * (dispatched in linear_a8), so that each row's dot product is inlined too: a call and the
 * storage's branches per row were 15% of a w4a8 step. */
static inline __attribute__((always_inline)) void a8_rows(const Linear *L, const Rounded *x,
                                                          int64_t rows, float *y, int accumulate,
                                                          const int q4, const int64_t group) {
    if (rows == 1) {
#pragma omp for schedule(static)
        for (int64_t block = 0; block < (L->out + 3) / 4; ++block) {
            vec dots[4] = {vec_zero(), vec_zero(), vec_zero(), vec_zero()};
            const int count = L->out - 4 * block < 4 ? (int)(L->out - 4 * block) : 4;
            for (int i = 0; i < count; ++i) a8_dot(L, 4 * block + i, x, 0, &dots[i], q4, group);
            a8_store(L, dots, count, y, 4 * block, 1, 0, 0, accumulate);
        }
        return;
    }
#pragma omp for schedule(static)
    for (int64_t o = 0; o < L->out; ++o)
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            vec dots[4] = {vec_zero(), vec_zero(), vec_zero(), vec_zero()};
            const int64_t n = rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE;
            if (n == ROW_TILE) a8_dot(L, o, x + r0, 1, dots, q4, group);
            else
                for (int64_t r = 0; r < n; ++r) a8_dot(L, o, x + r0 + r, 0, &dots[r], q4, group);
            a8_store(L, dots, (int)n, y, o, 0, r0, 1, accumulate);
        }
}

/* linear() below for a weight whose inputs are rounded to int8 first (round_inputs). Each
 * thread rounds every input itself, into its own scratch: the same bytes in each thread, and
 * no barrier before the products (a few microseconds of work against a barrier's wait). */
static void linear_a8(const Linear *L, const float *x, int64_t stride, int64_t rows, float *y,
                      int accumulate) {
    const int64_t bytes = rounded_bytes(L->in);
    char *memory = a8_scratch(rows * bytes);
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

/* Output rows per block of the batched loop: their weights (OUT_BLOCK x in values, 9 KB of
 * int8 at in = 576) stay in the core's caches while every tile of inputs passes over them. */
#define OUT_BLOCK 16

/* y[r][o] (+)= W[o] . x[r] + b[o] for each of the `rows` inputs (x[r] at x + r * stride, y[r]
 * at y + r * out) and this thread's share of the output rows o; accumulate adds into y (the
 * residual stream). An orphaned `omp for`: called inside the token's parallel region, it ends
 * with the barrier that makes y whole for every thread. One input (a decode step) has its own
 * loop: the loop over inputs around the dot product costs a single step ~4% (GPT-2 fp32).
 * Several inputs are a small matrix product, blocked as one: a block of OUT_BLOCK weight rows
 * at a time, read from memory once, and within it ROW_TILE inputs at a time, whose values stay
 * in the nearest cache and whose sums stay in registers (tile_dot); the last inputs, fewer
 * than a tile, one at a time (row_dot). Each input's dot products run in the single-input
 * order, so its outputs are bit for bit what it gets alone. */
static void linear(const Linear *L, const float *x, int64_t stride, int64_t rows, float *y,
                   int accumulate) {
    if (L->round_inputs) {
        linear_a8(L, x, stride, rows, y, accumulate);
        return;
    }
    if (rows == 1) {
#pragma omp for schedule(static)
        for (int64_t o = 0; o < L->out; ++o)
            y[o] = accumulate ? y[o] + row_dot(L, o, x) : row_dot(L, o, x);
        return;
    }
    const int64_t blocks = (L->out + OUT_BLOCK - 1) / OUT_BLOCK;
#pragma omp for schedule(static)
    for (int64_t block = 0; block < blocks; ++block) {
        const int64_t first = block * OUT_BLOCK;
        const int64_t last = first + OUT_BLOCK < L->out ? first + OUT_BLOCK : L->out;
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            const int64_t n = rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE;
            const float *xs = x + r0 * stride;
            for (int64_t o = first; o < last;) {
                const int64_t w_rows = n == ROW_TILE ? tile_rows(L, last - o) : 1;
                float dots[OUT_TILE * ROW_TILE];
                if (n == ROW_TILE) tile_dot(L, o, w_rows, xs, stride, dots);
                for (int64_t j = 0; j < w_rows; ++j, ++o)
                    for (int64_t r = 0; r < n; ++r) {
                        const float d = dots[j * ROW_TILE + r];
                        const float dot = n == ROW_TILE ? (L->bias ? d + L->bias[o] : d)
                                                        : row_dot(L, o, xs + r * stride);
                        float *out = y + (r0 + r) * L->out + o;
                        *out = accumulate ? *out + dot : dot;
                    }
            }
        }
    }
}

/* out = norm(x) * weight (+ bias): RMSNorm, or LayerNorm (centred, biased variance). */
static void norm(const float *x, float *out, int64_t n, const float *weight, const float *bias,
                 int rms, float eps) {
    double mean = 0.0, square = 0.0;
    if (!rms) {
        for (int64_t i = 0; i < n; ++i) mean += x[i];
        mean /= n;
    }
    for (int64_t i = 0; i < n; ++i) square += (x[i] - mean) * (x[i] - mean);
    const float inv = 1.0f / sqrtf((float)(square / n) + eps);
    for (int64_t i = 0; i < n; ++i) {
        float v = (float)(x[i] - mean) * inv * weight[i];
        out[i] = bias ? v + bias[i] : v;
    }
}

/* Rotate the pairs (i, i + D/2) of one head by the angles pos * inv_freq[i], whose cosines and
 * sines (times the attention factor) the step computes once per token for every head. */
static void rope(float *v, int64_t head_dim, const float *cosines, const float *sines) {
    const int64_t half = head_dim / 2;
    for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cosines[i] - b * sines[i];
        v[i + half] = b * cosines[i] + a * sines[i];
    }
}

static inline float activate(float v, int64_t kind) {
    switch (kind) {
    case RELU: return v > 0.0f ? v : 0.0f;
    case GELU: return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    case GELU_TANH:
        return 0.5f * v * (1.0f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
    default: return v / (1.0f + expf(-v)); /* SILU */
    }
}

/* SiLU and GELU (tanh form) of LANES values: v sigmoid(t) = v / (1 + e^-t), with t = v for
 * SiLU and t = 2 sqrt(2/pi) (v + 0.044715 v^3) for GELU, as 1 + tanh(a) = 2 sigmoid(2a). */
static inline vec activate_lanes(vec v, int64_t kind) {
    vec t = v;
    if (kind == GELU_TANH)
        t = vec_mul(v, vec_fma(vec_mul(v, v), vec_set1(0.0713548162726f), vec_set1(1.5957691216f)));
    return vec_div(v, vec_add(vec_set1(1.0f), vec_exp(vec_sub(vec_zero(), t))));
}

/* For each of `rows` rows of ff (2F values when gated: the gates, then the ups; else F):
 * ff[i] = act(ff[i]) (times ff[F + i] when gated), this thread's share of the values, LANES at
 * a time where the activation has a SIMD form. */
static void activate_all(float *ff, int64_t F, int64_t kind, int gated, int64_t rows) {
    const int simd = kind == SILU || kind == GELU_TANH;
    const int64_t blocks = (F + LANES - 1) / LANES, stride = gated ? 2 * F : F;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < rows * blocks; ++b) {
        float *row = ff + (b / blocks) * stride;
        const int64_t start = (b % blocks) * LANES, end = start + LANES < F ? start + LANES : F;
        if (simd && end - start == LANES) {
            vec a = activate_lanes(vec_load(row + start), kind);
            vec_store(row + start, gated ? vec_mul(a, vec_load(row + F + start)) : a);
            continue;
        }
        for (int64_t i = start; i < end; ++i)
            row[i] = gated ? activate(row[i], kind) * row[F + i] : activate(row[i], kind);
    }
}

enum { CACHE_F32 = 0, CACHE_BF16 = 1, CACHE_F16 = 2 }; /* how the keys/values are stored */

static inline float cache_get(const void *cache, int64_t i, int kind) {
    const uint16_t *half = (const uint16_t *)cache;
    if (kind == CACHE_BF16) return bf16_to_f32(half[i]);
    if (kind == CACHE_F16) return _cvtsh_ss(half[i]);
    return ((const float *)cache)[i];
}

static inline void cache_set(void *cache, int64_t i, float v, int kind) {
    if (kind == CACHE_BF16)
        ((uint16_t *)cache)[i] = f32_to_bf16(v);
    else if (kind == CACHE_F16) /* round to nearest even, as torch's .half() does */
        ((uint16_t *)cache)[i] = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
    else
        ((float *)cache)[i] = v;
}

static inline vec cache_load(const void *cache, int64_t at, int kind) {
    if (kind == CACHE_BF16) return load_bf16((const uint16_t *)cache + at);
    if (kind == CACHE_F16) return load_f16((const uint16_t *)cache + at);
    return load_f32((const float *)cache + at);
}

/* q . k for one cached key row of D floats (f32, bf16 or f16), in SIMD when D is a multiple of
 * LANES; and out += p * v for one cached value row. */
static inline float key_dot(const float *q, const void *cache, int64_t at, int64_t D, int kind) {
    if (D % LANES == 0) {
        vec acc = vec_zero();
        for (int64_t d = 0; d < D; d += LANES)
            acc = vec_fma(vec_load(q + d), cache_load(cache, at + d, kind), acc);
        return vec_sum(acc);
    }
    float dot = 0.0f;
    for (int64_t d = 0; d < D; ++d) dot += q[d] * cache_get(cache, at + d, kind);
    return dot;
}

static inline void add_value(float *out, float p, const void *cache, int64_t at, int64_t D,
                             int kind) {
    if (D % LANES == 0) {
        const vec weight = vec_set1(p);
        for (int64_t d = 0; d < D; d += LANES)
            vec_store(out + d, vec_fma(weight, cache_load(cache, at + d, kind), vec_load(out + d)));
        return;
    }
    for (int64_t d = 0; d < D; ++d) out[d] += p * cache_get(cache, at + d, kind);
}

/* Ask for every line of the cache row at element `at`, a few positions before it is read: the
 * rows of a head are read in order, and without this a step's attention waited on them (a third
 * of an int4 step's time at position 950 went to these loops' loads). A prefetch past the end of
 * the cache is harmless: it never faults. */
#define PREFETCH_POSITIONS 8
static inline void prefetch_row(const void *cache, int64_t at, int64_t D, int kind) {
    const int64_t size = kind == CACHE_F32 ? 4 : 2;
    const char *row = (const char *)cache + at * size;
    for (int64_t b = 0; b < D * size; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
}

/* out = sum_t p[t] * inverse * V[t] over the n value rows at base + t * stride, for a head of
 * VECS * LANES floats: the sums stay in registers, in two sets that take alternate positions
 * (accumulating into `out` in memory made each position wait for the last one's store, and one
 * set would wait on each FMA). Always inlined with VECS a constant, so the sets are registers. */
static inline __attribute__((always_inline)) void weighted_values(
    float *out, const float *p, float inverse, const void *cache, int64_t base, int64_t stride,
    int64_t n, int kind, const int VECS) {
    vec a[VECS], b[VECS];
    for (int i = 0; i < VECS; ++i) a[i] = b[i] = vec_zero();
    int64_t t = 0;
    for (; t + 1 < n; t += 2) {
        prefetch_row(cache, base + (t + PREFETCH_POSITIONS) * stride, VECS * LANES, kind);
        prefetch_row(cache, base + (t + 1 + PREFETCH_POSITIONS) * stride, VECS * LANES, kind);
        const vec pa = vec_set1(p[t] * inverse), pb = vec_set1(p[t + 1] * inverse);
        for (int i = 0; i < VECS; ++i) {
            a[i] = vec_fma(pa, cache_load(cache, base + t * stride + i * LANES, kind), a[i]);
            b[i] = vec_fma(pb, cache_load(cache, base + (t + 1) * stride + i * LANES, kind), b[i]);
        }
    }
    if (t < n) {
        const vec pa = vec_set1(p[t] * inverse);
        for (int i = 0; i < VECS; ++i)
            a[i] = vec_fma(pa, cache_load(cache, base + t * stride + i * LANES, kind), a[i]);
    }
    for (int i = 0; i < VECS; ++i) vec_store(out + i * LANES, vec_add(a[i], b[i]));
}

/* scores[t] = q . K_t * scale for the n key rows at base + t * stride, for a head of VECS *
 * LANES floats; returns the largest. q stays in registers, and four keys at a time are summed
 * in one pass of shuffles (vec_sum4): a sum per key, and a loop over the head's vectors, were
 * half of the attention's time at position 960 (perf annotate, SmolLM2 w4a8). Always inlined
 * with VECS a constant. */
static inline __attribute__((always_inline)) float key_scores(
    const float *q, const void *cache, int64_t base, int64_t stride, int64_t n, int kind,
    float scale, float *scores, const int VECS) {
    vec query[VECS];
    for (int i = 0; i < VECS; ++i) query[i] = vec_load(q + i * LANES);
    float best = -INFINITY;
    for (int64_t t = 0; t < n; t += 4) {
        const int count = n - t < 4 ? (int)(n - t) : 4;
        vec dots[4] = {vec_zero(), vec_zero(), vec_zero(), vec_zero()};
        for (int k = 0; k < count; ++k) {
            const int64_t at = base + (t + k) * stride;
            prefetch_row(cache, at + PREFETCH_POSITIONS * stride, VECS * LANES, kind);
            for (int i = 0; i < VECS; ++i)
                dots[k] = vec_fma(query[i], cache_load(cache, at + i * LANES, kind), dots[k]);
        }
        float sums[4];
        vec_sum4(dots, sums);
        for (int k = 0; k < count; ++k) {
            scores[t + k] = sums[k] * scale;
            best = scores[t + k] > best ? scores[t + k] : best;
        }
    }
    return best;
}

/* One query head of token `row` over the keys 0..pos of its key/value head, in the cache row
 * that starts `offset` elements after the layer's k_cache/v_cache: softmax(q . K * scale) . V,
 * with `scores` (pos + 1 floats) the caller's scratch. */
static void attend(const Model *m, const Layer *layer, int64_t head, int64_t row, int64_t pos,
                   int64_t offset, float *scores) {
    const int64_t D = m->head_dim, H = m->n_heads, kv_head = head / (H / m->n_kv_heads);
    const int kind = (int)m->cache_kind;
    const float *q = m->qkv + row * (H + 2 * m->n_kv_heads) * D + head * D;
    float *out = m->att + (row * H + head) * D;
    const int64_t base = offset + kv_head * m->cache_head_stride, stride = m->cache_pos_stride;
    float best = -INFINITY;
    if (D == 4 * LANES)
        best = key_scores(q, layer->k_cache, base, stride, pos + 1, kind, m->attn_scale, scores, 4);
    else if (D == 8 * LANES)
        best = key_scores(q, layer->k_cache, base, stride, pos + 1, kind, m->attn_scale, scores, 8);
    else
        for (int64_t t = 0; t <= pos; ++t) {
            prefetch_row(layer->k_cache, base + (t + PREFETCH_POSITIONS) * stride, D, kind);
            scores[t] = key_dot(q, layer->k_cache, base + t * stride, D, kind) * m->attn_scale;
            if (scores[t] > best) best = scores[t];
        }
    const vec top = vec_set1(best);
    vec sums = vec_zero();
    int64_t t = 0;
    for (; t + LANES <= pos + 1; t += LANES) {
        const vec e = vec_exp(vec_sub(vec_load(scores + t), top));
        vec_store(scores + t, e);
        sums = vec_add(sums, e);
    }
    float total = vec_sum(sums);
    for (; t <= pos; ++t) {
        scores[t] = expf(scores[t] - best);
        total += scores[t];
    }
    const float inverse = 1.0f / total; /* one division, not one per position */
    const void *values = layer->v_cache;
    if (D == 4 * LANES) /* 64 (AVX-512) or 32: SmolLM2, GPT-2, Llama 3.2 1B ... */
        weighted_values(out, scores, inverse, values, base, stride, pos + 1, kind, 4);
    else if (D == 8 * LANES) /* 128 (AVX-512) or 64 (AVX2): Llama, Qwen, Mistral */
        weighted_values(out, scores, inverse, values, base, stride, pos + 1, kind, 8);
    else { /* any other head size, through memory */
        for (int64_t d = 0; d < D; ++d) out[d] = 0.0f;
        for (int64_t t = 0; t <= pos; ++t) {
            prefetch_row(values, base + (t + PREFETCH_POSITIONS) * stride, D, kind);
            add_value(out, scores[t] * inverse, values, base + t * stride, D, kind);
        }
    }
}

/* --- the step -------------------------------------------------------------------------------- */

/* n rows, row r the token tokens[r] at position positions[r] of the cache row that starts
 * offsets[r] elements after each layer's k_cache/v_cache (which holds its positions
 * 0..positions[r]-1): writes each row's keys and values and the logits (n, V). Row r attends
 * to the keys 0..positions[r] of its cache row, so n consecutive tokens of one cache row (the
 * same offset, positions pos..pos+n-1) see each other as a forward over them would. */
void decode_rows(const Model *m, const int64_t *tokens, int64_t n, const int64_t *positions,
                 const int64_t *offsets, float *logits, int n_threads) {
    const int64_t C = m->d_model, D = m->head_dim, H = m->n_heads, Hkv = m->n_kv_heads;
    const int64_t QKV = (H + 2 * Hkv) * D, F = m->d_ff;
    const int rms = (int)m->rms_norm;
    float *x = m->x, *h = m->h, *qkv = m->qkv, *ff = m->ff;
    /* each row's RoPE rotation, every head's */
    float cosines[n * (D / 2) + 1], sines[n * (D / 2) + 1];
    for (int64_t r = 0; r < n; ++r)
        for (int64_t i = 0; m->inv_freq && i < D / 2; ++i) {
            const float angle = (float)positions[r] * m->inv_freq[i];
            cosines[r * (D / 2) + i] = cosf(angle) * m->rope_factor;
            sines[r * (D / 2) + i] = sinf(angle) * m->rope_factor;
        }
    for (int64_t r = 0; r < n; ++r)
        for (int64_t i = 0; i < C; ++i) {
            const int64_t at = tokens[r] * C + i;
            float e = m->emb_storage == BF16 ? bf16_to_f32(((const uint16_t *)m->tok_emb)[at])
                                             : ((const float *)m->tok_emb)[at];
            x[r * C + i] = m->pos_emb ? e + m->pos_emb[positions[r] * C + i] : e;
        }
#pragma omp parallel num_threads(n_threads)
    for (int64_t l = 0; l < m->n_layers; ++l) {
        const Layer *layer = &m->layers[l];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; ++r)
            norm(x + r * C, h + r * C, C, layer->attn_norm_weight, layer->attn_norm_bias, rms,
                 m->norm_eps);
        linear(&layer->qkv, h, C, n, qkv, 0);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; ++r) {
            float *row = qkv + r * QKV, *k = row + H * D, *v = k + Hkv * D;
            for (int64_t head = 0; head < H + Hkv; ++head) {
                float *vec = row + head * D; /* the query heads, then the key heads */
                const float *gain = head < H ? layer->q_norm_weight : layer->k_norm_weight;
                if (gain) norm(vec, vec, D, gain, 0, 1, m->norm_eps);
                if (m->inv_freq) rope(vec, D, cosines + r * (D / 2), sines + r * (D / 2));
            }
            for (int64_t head = 0; head < Hkv; ++head) {
                const int64_t at =
                    offsets[r] + head * m->cache_head_stride + positions[r] * m->cache_pos_stride;
                for (int64_t d = 0; d < D; ++d) {
                    cache_set(layer->k_cache, at + d, k[head * D + d], (int)m->cache_kind);
                    cache_set(layer->v_cache, at + d, v[head * D + d], (int)m->cache_kind);
                }
            }
        }
        /* The attention, shared out in units: with enough of them (several rows), a unit is
         * one row's key/value head with all its query heads, one after the other, each thread
         * with its own scores: the keys and values come from memory once, then from the
         * nearest cache (32 rows of SmolLM2, 9 query heads on 3: 13.2 against 14.4 ms a
         * step). Else (one row: 3 such units for 2 threads) a unit is a query head. */
        if (n * Hkv >= 4 * n_threads && n_threads <= H) {
#pragma omp for schedule(static)
            for (int64_t u = 0; u < n * Hkv; ++u) {
                const int64_t r = u / Hkv, first = (u % Hkv) * (H / Hkv);
                float *scores = m->scores + omp_get_thread_num() * m->max_positions;
                for (int64_t head = first; head < first + H / Hkv; ++head)
                    attend(m, layer, head, r, positions[r], offsets[r], scores);
            }
        } else {
#pragma omp for schedule(static)
            for (int64_t head = 0; head < H; ++head)
                for (int64_t r = 0; r < n; ++r)
                    attend(m, layer, head, r, positions[r], offsets[r],
                           m->scores + head * m->max_positions);
        }
        linear(&layer->out, m->att, H * D, n, x, 1);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; ++r)
            norm(x + r * C, h + r * C, C, layer->ffn_norm_weight, layer->ffn_norm_bias, rms,
                 m->norm_eps);
        linear(&layer->up, h, C, n, ff, 0);
        activate_all(ff, F, m->activation, (int)m->gated, n);
        linear(&layer->down, ff, m->gated ? 2 * F : F, n, x, 1);
    }
    for (int64_t r = 0; r < n; ++r)
        norm(x + r * C, h + r * C, C, m->final_norm_weight, m->final_norm_bias, rms, m->norm_eps);
#pragma omp parallel num_threads(n_threads)
    linear(&m->head, h, C, n, logits, 0);
}

/* The tokens tokens[0..n-1] at positions pos..pos+n-1 of the cache row the layers point at
 * (which holds 0..pos-1): one decode step for n = 1, a short run of tokens (a speculative
 * round's check) for more. */
void decode_tokens(const Model *m, const int64_t *tokens, int64_t n, int64_t pos, float *logits,
                   int n_threads) {
    int64_t positions[n], offsets[n];
    for (int64_t r = 0; r < n; ++r) {
        positions[r] = pos + r;
        offsets[r] = 0;
    }
    decode_rows(m, tokens, n, positions, offsets, logits, n_threads);
}


/* One projection y (rows, out) = x (rows, in) W^T + b as the step computes it, on its own: the
 * tests hold each storage's products to the torch module's on the same input (inside a step,
 * an input differs from the torch path's by float rounding, and rounding it to int8 can then
 * land one step apart). */
void linear_rows(const Linear *L, const float *x, int64_t rows, float *y, int n_threads) {
#pragma omp parallel num_threads(n_threads)
    linear(L, x, L->in, rows, y, 0);
}

/* --- the layout, for the ctypes mirror -------------------------------------------------------- */

typedef struct {
    const char *name; /* "Model" for the struct's size, "Model.head" for a field */
    int64_t offset, size;
} LayoutEntry;

#define STRUCT(S) {#S, 0, sizeof(S)}
#define FIELD(S, f) {#S "." #f, offsetof(S, f), sizeof(((S *)0)->f)}

static const LayoutEntry LAYOUT[] = {
    STRUCT(Linear),
    FIELD(Linear, weight), FIELD(Linear, scale), FIELD(Linear, mins), FIELD(Linear, bias),
    FIELD(Linear, in), FIELD(Linear, out), FIELD(Linear, group), FIELD(Linear, storage),
    FIELD(Linear, round_inputs),
    STRUCT(Layer),
    FIELD(Layer, attn_norm_weight), FIELD(Layer, attn_norm_bias), FIELD(Layer, q_norm_weight),
    FIELD(Layer, k_norm_weight), FIELD(Layer, ffn_norm_weight), FIELD(Layer, ffn_norm_bias),
    FIELD(Layer, qkv), FIELD(Layer, out), FIELD(Layer, up), FIELD(Layer, down),
    FIELD(Layer, k_cache), FIELD(Layer, v_cache),
    STRUCT(Model),
    FIELD(Model, n_layers), FIELD(Model, d_model), FIELD(Model, n_heads),
    FIELD(Model, n_kv_heads), FIELD(Model, head_dim), FIELD(Model, d_ff),
    FIELD(Model, vocab_size), FIELD(Model, cache_head_stride), FIELD(Model, cache_pos_stride),
    FIELD(Model, rms_norm), FIELD(Model, gated), FIELD(Model, activation),
    FIELD(Model, cache_kind), FIELD(Model, emb_storage), FIELD(Model, norm_eps),
    FIELD(Model, attn_scale), FIELD(Model, rope_factor), FIELD(Model, inv_freq),
    FIELD(Model, tok_emb), FIELD(Model, pos_emb), FIELD(Model, final_norm_weight),
    FIELD(Model, final_norm_bias), FIELD(Model, head), FIELD(Model, layers), FIELD(Model, x),
    FIELD(Model, h), FIELD(Model, qkv), FIELD(Model, att), FIELD(Model, scores),
    FIELD(Model, ff), FIELD(Model, max_positions),
};

/* Up to `capacity` entries of the table above: names[i], and offsets_and_sizes[2i], [2i + 1]
 * in bytes; returns how many there are. */
int64_t glassformer_layout(const char **names, int64_t *offsets_and_sizes, int64_t capacity) {
    const int64_t n = (int64_t)(sizeof(LAYOUT) / sizeof(LAYOUT[0]));
    for (int64_t i = 0; i < n && i < capacity; ++i) {
        names[i] = LAYOUT[i].name;
        offsets_and_sizes[2 * i] = LAYOUT[i].offset;
        offsets_and_sizes[2 * i + 1] = LAYOUT[i].size;
    }
    return n;
}
