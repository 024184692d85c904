/* One query head's attention over the keys and values of its cache row (decode.c's step):
 * softmax(q . K * scale) . V, the keys and values stored as f32, bf16 or f16 (step.h's
 * CACHE_*), read a position at a time with the next ones prefetched. */
#ifndef GLASSFORMER_ATTENTION_H
#define GLASSFORMER_ATTENTION_H
#include <math.h>

#include "simd.h"
#include "step.h"

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

#endif
