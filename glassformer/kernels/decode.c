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
 * group scales and mins; activations are f32; the cache is f32, bf16 or f16. The softmax's,
 * SiLU's and GELU-tanh's exponentials are SIMD ones (simd.h's vec_exp, within about an ulp of
 * expf), RoPE's cosines and sines are computed once per token for every layer and head.
 *
 * glassformer/infer/fused.py fills the structs (step.h) through their ctypes mirror,
 * kernels/step.py. glassformer_layout() hands the mirror every struct's size and every field's
 * offset and size as this compiler lays them out, and the step refuses to run when they differ:
 * one field out of order would be read as another. A query head's attention is attention.h's;
 * a projection whose inputs are rounded to int8 first (w8a8, w4a8), a8.h's, or with many rows
 * (TILES_A8_ROWS) on Intel's tile unit tiles_a8.h's; an int8 or int4 one with many rows
 * (TILES_SPLIT_ROWS) on its bf16 products, tiles_split.h's, and an int4 one with fewer on its
 * byte products, amx.h's; the dot products of each weight storage, simd.h's (fp32, bf16) and
 * groups.h's (int8, int4).
 */
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <string.h>

#include "a8.h"
#include "amx.h"
#include "attention.h"
#include "groups.h"
#include "simd.h"
#include "step.h"
#include "tiles_a8.h"
#include "tiles_split.h"

/* --- pieces ---------------------------------------------------------------------------------- */

/* W[o] . x in lanes (simd.h's and groups.h's dot products) for one output row o; the storage
 * and the int8 group size constants where inlined with them (one_input). */
static inline __attribute__((always_inline)) vec row_lanes(const Linear *L, int64_t o,
                                                           const float *x, const int64_t storage,
                                                           const int64_t group) {
    const int64_t n_groups = L->in / group;
    const float *scale = L->scale ? L->scale + o * n_groups : 0;
    if (storage == Q4)
        return dot_q4((const uint8_t *)L->weight + o * (L->in / 2), x, scale,
                      L->mins + o * n_groups, L->in);
    if (storage == F32) return dot_f32((const float *)L->weight + o * L->in, x, scale, L->in, group);
    if (storage == BF16)
        return dot_bf16((const uint16_t *)L->weight + o * L->in, x, scale, L->in, group);
    return dot_int8((const int8_t *)L->weight + o * L->in, x, scale, L->in, group);
}

/* linear() for one input: four output rows at a time, their lanes summed in one pass of
 * shuffles (vec_sum4, in vec_sum's order: each row's value is vec_sum of its row_lanes, as the
 * batched tiles' are). Inlined once per storage and common int8 group, so that the dot
 * products are too: a call per row and each row's own sum were a third of an int8 step's
 * dot-product samples (perf annotate). */
static inline __attribute__((always_inline)) void one_input(const Linear *L, const float *x,
                                                            float *y, int accumulate,
                                                            const int64_t storage,
                                                            const int64_t group) {
#pragma omp for schedule(static)
    for (int64_t block = 0; block < (L->out + 3) / 4; ++block) {
        const int64_t first = 4 * block, count = L->out - first < 4 ? L->out - first : 4;
        vec dots[4] = {vec_zero(), vec_zero(), vec_zero(), vec_zero()};
        for (int64_t i = 0; i < count; ++i) dots[i] = row_lanes(L, first + i, x, storage, group);
        float sums[4];
        vec_sum4(dots, sums);
        for (int64_t i = 0; i < count; ++i) {
            const int64_t o = first + i;
            const float dot = L->bias ? sums[i] + L->bias[o] : sums[i];
            y[o] = accumulate ? y[o] + dot : dot;
        }
    }
}

/* W[o + j] . x[r] for `w_rows` weight rows (1, or OUT_TILE where the storage has a wider
 * tile) and R inputs x[r] = x + r * stride (R up to ROW_TILE; MAX_TILE for int8 and int4)
 * into dots[j * ROW_TILE + r], each bit for bit vec_sum(row_lanes(...)), one_input's value
 * without the bias. Inlined with R a constant (tile_dot). */
static inline int64_t tile_rows(const Linear *L, int64_t left) {
    return (L->storage == F32 || L->storage == BF16) && left >= OUT_TILE ? OUT_TILE : 1;
}
static inline __attribute__((always_inline)) void tile_dot_of(const Linear *L, int64_t o,
                                                              int64_t w_rows, const float *x,
                                                              int64_t stride, const int R,
                                                              float *dots) {
    const int64_t n_groups = L->in / L->group;
    const float *scale = L->scale ? L->scale + o * n_groups : 0;
    if (L->storage == Q4)
        dot_q4_tile((const uint8_t *)L->weight + o * (L->in / 2), x, stride, scale,
                    L->mins + o * n_groups, L->in, R, dots);
    else if (L->storage == INT8)
        dot_int8_tile((const int8_t *)L->weight + o * L->in, x, stride, scale, L->in, L->group,
                      R, dots);
    else if (R > ROW_TILE) /* never: next_tile gives fp32 and bf16 at most ROW_TILE */
        return;
    else if (L->storage == F32 && w_rows == OUT_TILE)
        dot_f32_tile((const float *)L->weight + o * L->in, x, stride, scale, L->in, L->group,
                     OUT_TILE, R, dots);
    else if (L->storage == F32)
        dot_f32_tile((const float *)L->weight + o * L->in, x, stride, scale, L->in, L->group, 1,
                     R, dots);
    else if (L->storage == BF16 && w_rows == OUT_TILE)
        dot_bf16_tile((const uint16_t *)L->weight + o * L->in, x, stride, scale, L->in,
                      L->group, OUT_TILE, R, dots);
    else if (L->storage == BF16)
        dot_bf16_tile((const uint16_t *)L->weight + o * L->in, x, stride, scale, L->in,
                      L->group, 1, R, dots);
}

/* tile_dot_of for a tile of n inputs (next_tile), n a constant in each copy */
static void tile_dot(const Linear *L, int64_t o, int64_t w_rows, const float *x,
                     int64_t stride, int64_t n, float *dots) {
    if (n == ROW_TILE) tile_dot_of(L, o, w_rows, x, stride, ROW_TILE, dots);
    else if (n == 1) tile_dot_of(L, o, w_rows, x, stride, 1, dots);
#if LANES == 16 /* ROW_TILE 4: partial tiles of 2 and 3 */
    else if (n == 2) tile_dot_of(L, o, w_rows, x, stride, 2, dots);
    else if (n == 3) tile_dot_of(L, o, w_rows, x, stride, 3, dots);
#endif
    else tile_dot_of(L, o, w_rows, x, stride, MAX_TILE, dots); /* int8 and int4 only */
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
 * in the nearest cache and whose sums stay in registers (tile_dot), the last inputs in a tile
 * of their own (next_tile). Each input's dot products run in the single-input
 * order, so its outputs are bit for bit what it gets alone. */
static void linear(const Linear *L, const float *x, int64_t stride, int64_t rows, float *y,
                   int accumulate) {
    if (L->round_inputs) {
#if AMX
        if (rows >= TILES_A8_ROWS && glassformer_amx() == 1) {
            char *memory;
#pragma omp single copyprivate(memory)
            memory = tiles_memory(tiles_a8_bytes(L, rows)); /* one thread's, shared */
            if (memory) {
                tiles_a8(L, x, stride, rows, y, accumulate, memory);
                return;
            }
        }
#endif
        linear_a8(L, x, stride, rows, y, accumulate);
        return;
    }
#if AMX
    if (((L->storage == INT8 && rows >= TILES_SPLIT_ROWS) ||
         (L->storage == Q4 && rows >= TILES_SPLIT_Q4_ROWS)) &&
        glassformer_amx() == 1) {
        char *memory;
#pragma omp single copyprivate(memory)
        memory = tiles_memory(split_inputs_bytes(rows, L->in)); /* one thread's, shared */
        if (memory) {
            tiles_split(L, x, stride, rows, y, accumulate, memory);
            return;
        }
    }
    if (L->packed && glassformer_amx() == 1) { /* int4 on the tile unit */
        linear_amx(L, x, stride, rows, y, accumulate);
        return;
    }
#endif
    if (L->storage == BF16) { /* each thread puts its own copy of x in bf16_order (simd.h) */
        float *ordered = (float *)thread_scratch(rows * L->in * (int64_t)sizeof(float));
        for (int64_t r = 0; r < rows; ++r) bf16_order(x + r * stride, ordered + r * L->in, L->in);
        x = ordered, stride = L->in;
    }
#if Q4_PREPARED /* AVX2: each thread its own copy of x as dot_q4 takes it (groups.h) */
    if (L->storage == Q4) {
        const int64_t prepared = q4_prepared_floats(L->in);
        float *own = (float *)thread_scratch(rows * prepared * (int64_t)sizeof(float));
        for (int64_t r = 0; r < rows; ++r) q4_prepare(x + r * stride, L->in, own + r * prepared);
        x = own, stride = prepared;
    }
#endif
    if (rows == 1) {
        if (L->storage == Q4) one_input(L, x, y, accumulate, Q4, 32);
        else if (L->storage == F32) one_input(L, x, y, accumulate, F32, L->group);
        else if (L->storage == BF16) one_input(L, x, y, accumulate, BF16, L->group);
        else if (L->group == 32) one_input(L, x, y, accumulate, INT8, 32);
        else if (L->group == 64) one_input(L, x, y, accumulate, INT8, 64);
        else one_input(L, x, y, accumulate, INT8, L->group);
        return;
    }
    const int64_t blocks = (L->out + OUT_BLOCK - 1) / OUT_BLOCK;
#pragma omp for schedule(static)
    for (int64_t block = 0; block < blocks; ++block) {
        const int64_t first = block * OUT_BLOCK;
        const int64_t last = first + OUT_BLOCK < L->out ? first + OUT_BLOCK : L->out;
        for (int64_t r0 = 0, n = 0; r0 < rows; r0 += n) {
            n = next_tile(rows - r0, L->storage == Q4 || L->storage == INT8);
            const float *xs = x + r0 * stride;
            for (int64_t o = first; o < last;) {
                const int64_t w_rows = tile_rows(L, last - o);
                float dots[OUT_TILE * ROW_TILE + 1]; /* room for MAX_TILE in one weight row */
                tile_dot(L, o, w_rows, xs, stride, n, dots);
                for (int64_t j = 0; j < w_rows; ++j, ++o)
                    for (int64_t r = 0; r < n; ++r) {
                        const float d = dots[j * ROW_TILE + r];
                        const float dot = L->bias ? d + L->bias[o] : d;
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
    const double mean = rms ? 0.0 : sum_double(x, n, 0.0, 0) / n;
    const float inv = 1.0f / sqrtf((float)(sum_double(x, n, mean, 1) / n) + eps);
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

/* picks[r] = the index of row r's largest logit, the first of equal ones (torch.argmax's), or
 * -1 where one of its logits is a NaN or an infinity: greedy decoding's token, found inside the
 * step, where each thread has its share of the head's rows still in its own cache. Found after
 * the step, by Python, it was the engine's slowest part of a token outside the step (90 us to
 * check the logits finite and 125 us for their argmax, every cache cold after the step's 110 MB
 * of SmolLM2 int4 weights, against 8 us warm). Each thread takes its share of every row's
 * columns (best_of), then one thread compares the shares: best[], at[] and odd[] hold a slot
 * per thread and row. */
static void pick_rows(const float *logits, int64_t n, int64_t V, float *best, int64_t *at,
                      int *odd, int64_t *picks) {
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t start = V * me / threads, end = V * (me + 1) / threads;
    for (int64_t r = 0; r < n; ++r) {
        const int64_t slot = me * n + r;
        odd[slot] = best_of(logits + r * V + start, end - start, &best[slot], &at[slot]);
        at[slot] += start;
    }
#pragma omp barrier
#pragma omp single
    for (int64_t r = 0; r < n; ++r) {
        int64_t winner = r, bad = odd[r];
        for (int64_t t = 1; t < threads; ++t) { /* a later share wins only when larger */
            bad |= odd[t * n + r];
            if (best[t * n + r] > best[winner]) winner = t * n + r;
        }
        picks[r] = bad ? -1 : at[winner];
    }
}

/* --- the step -------------------------------------------------------------------------------- */

/* n rows, row r the token tokens[r] at position positions[r] of the cache row that starts
 * offsets[r] elements after each layer's k_cache/v_cache (which holds its positions
 * 0..positions[r]-1): writes each row's keys and values, the logits (n, V) and, unless picks is
 * NULL, each row's greedy pick (pick_rows). Row r attends to the keys 0..positions[r] of its
 * cache row, so n consecutive tokens of one cache row (the same offset, positions
 * pos..pos+n-1) see each other as a forward over them would. */
void decode_rows(const Model *m, const int64_t *tokens, int64_t n, const int64_t *positions,
                 const int64_t *offsets, float *logits, int64_t *picks, int n_threads) {
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
                cache_put(layer->k_cache, at, k + head * D, D, (int)m->cache_kind);
                cache_put(layer->v_cache, at, v + head * D, D, (int)m->cache_kind);
            }
        }
        /* The attention, shared out in units: with enough of them (several rows), a unit is
         * one row's key/value head with all its query heads, one after the other, each thread
         * with its own scores: the keys and values come from memory once, then from the
         * nearest cache (32 rows of SmolLM2, 9 query heads on 3: 13.2 against 14.4 ms a
         * step). Else (one row: 3 such units for 2 threads) each thread takes a contiguous
         * share of the query heads (as OpenMP's static schedule would), and those of its share
         * that have one key/value head go through its rows in one pass (attend). */
        if (n * Hkv >= 4 * n_threads && n_threads <= H) {
#pragma omp for schedule(static)
            for (int64_t u = 0; u < n * Hkv; ++u) {
                const int64_t r = u / Hkv, first = (u % Hkv) * (H / Hkv);
                float *scores = m->scores + omp_get_thread_num() * m->max_positions;
                for (int64_t head = first; head < first + H / Hkv; ++head)
                    attend(m, layer, head, 1, r, positions[r], offsets[r], &scores);
            }
        } else {
            const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
            const int64_t share = H / threads, extra = H % threads;
            const int64_t start = me * share + (me < extra ? me : extra);
            const int64_t end = start + share + (me < extra);
            const int64_t group = H / Hkv; /* query heads per key/value head */
            for (int64_t r = 0; r < n; ++r)
                for (int64_t head = start; head < end;) {
                    const int64_t next = (head / group + 1) * group; /* the next key/value head */
                    const int64_t count = (next < end ? next : end) - head;
                    float *scores[count];
                    for (int64_t h = 0; h < count; ++h)
                        scores[h] = m->scores + (head + h) * m->max_positions;
                    attend(m, layer, head, count, r, positions[r], offsets[r], scores);
                    head += count;
                }
#pragma omp barrier
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
    float best[n_threads * n];
    int64_t at[n_threads * n];
    int odd[n_threads * n];
#pragma omp parallel num_threads(n_threads)
    {
        linear(&m->head, h, C, n, logits, 0);
        if (picks) pick_rows(logits, n, m->head.out, best, at, odd, picks);
    }
}

/* The tokens tokens[0..n-1] at positions pos..pos+n-1 of the cache row the layers point at
 * (which holds 0..pos-1): one decode step for n = 1, a short run of tokens (a speculative
 * round's check) for more. */
void decode_tokens(const Model *m, const int64_t *tokens, int64_t n, int64_t pos, float *logits,
                   int64_t *picks, int n_threads) {
    int64_t positions[n], offsets[n];
    for (int64_t r = 0; r < n; ++r) {
        positions[r] = pos + r;
        offsets[r] = 0;
    }
    decode_rows(m, tokens, n, positions, offsets, logits, picks, n_threads);
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
    FIELD(Linear, round_inputs), FIELD(Linear, packed),
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
