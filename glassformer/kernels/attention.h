/* The attention of query heads over the keys and values of their cache row (decode.c's step):
 * softmax(q . K * scale) . V, the keys and values stored as f32, bf16 or f16 (step.h's
 * CACHE_*), read a position at a time with the next ones prefetched; the query heads that share
 * a key/value head (GQA) in one pass over its rows. */
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

/* cache[at..at+n) = src[0..n), rounded to the cache's type as cache_set does, 8 values at a time
 * where F16C converts them (the one-row step wrote its keys and values one by one, with the
 * type's branch around each) */
static inline void cache_put(void *cache, int64_t at, const float *src, int64_t n, int kind) {
    int64_t i = 0;
    if (kind == CACHE_F32) {
        memcpy((float *)cache + at, src, (size_t)n * sizeof(float));
        return;
    }
    if (kind == CACHE_F16)
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)((uint16_t *)cache + at + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; ++i) cache_set(cache, at + i, src[i], kind);
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

/* scores[t] = e^(scores[t] - best) for the n scores; returns 1 / their sum (one division, not
 * one per position) */
static inline float softmax(float *scores, int64_t n, float best) {
    const vec top = vec_set1(best);
    vec sums = vec_zero();
    int64_t t = 0;
    for (; t + LANES <= n; t += LANES) {
        const vec e = vec_exp(vec_sub(vec_load(scores + t), top));
        vec_store(scores + t, e);
        sums = vec_add(sums, e);
    }
    float total = vec_sum(sums);
    for (; t < n; ++t) {
        scores[t] = expf(scores[t] - best);
        total += scores[t];
    }
    return 1.0f / total;
}

/* The most query heads a pass takes (KEY_HEADS below) and the most vectors a head has: the
 * sizes of the passes' arrays of sums, which with constant indexes stay in registers. */
#define MAX_G 3
#define MAX_VECS 8

/* out[g] = sum_t p[g][t] * inverse[g] * V[t] over the n value rows at base + t * stride, for
 * G query heads of one key/value head (each of VECS * LANES floats): each value row is loaded
 * (and converted) once for all G. The sums stay in registers, in two sets that take alternate
 * positions (accumulating into `out` in memory made each position wait for the last one's
 * store, and one set would wait on each FMA); each head's run in the one-head order, so its
 * output is bit for bit what it gets alone. Always inlined with VECS and G constants, so the
 * sets are registers. */
static inline __attribute__((always_inline)) void weighted_values(
    float *const out[], const float *const p[], const float inverse[], const void *cache,
    int64_t base, int64_t stride, int64_t n, int kind, const int VECS, const int G) {
    vec a[MAX_G][MAX_VECS], b[MAX_G][MAX_VECS]; /* fixed sizes: a VLA would live on the stack */
    for (int g = 0; g < G; ++g)
        for (int i = 0; i < VECS; ++i) a[g][i] = b[g][i] = vec_zero();
    int64_t t = 0;
    for (; t + 1 < n; t += 2) {
        prefetch_row(cache, base + (t + PREFETCH_POSITIONS) * stride, VECS * LANES, kind);
        prefetch_row(cache, base + (t + 1 + PREFETCH_POSITIONS) * stride, VECS * LANES, kind);
        vec pa[MAX_G], pb[MAX_G];
        for (int g = 0; g < G; ++g) {
            pa[g] = vec_set1(p[g][t] * inverse[g]);
            pb[g] = vec_set1(p[g][t + 1] * inverse[g]);
        }
        for (int i = 0; i < VECS; ++i) {
            const vec va = cache_load(cache, base + t * stride + i * LANES, kind);
            const vec vb = cache_load(cache, base + (t + 1) * stride + i * LANES, kind);
            for (int g = 0; g < G; ++g) {
                a[g][i] = vec_fma(pa[g], va, a[g][i]);
                b[g][i] = vec_fma(pb[g], vb, b[g][i]);
            }
        }
    }
    if (t < n)
        for (int g = 0; g < G; ++g) {
            const vec pa = vec_set1(p[g][t] * inverse[g]);
            for (int i = 0; i < VECS; ++i)
                a[g][i] = vec_fma(pa, cache_load(cache, base + t * stride + i * LANES, kind), a[g][i]);
        }
    for (int g = 0; g < G; ++g)
        for (int i = 0; i < VECS; ++i) vec_store(out[g] + i * LANES, vec_add(a[g][i], b[g][i]));
}

/* scores[g][t] = q[g] . K_t * scale for the n key rows at base + t * stride, for G query heads
 * of one key/value head (each of VECS * LANES floats); best[g], each head's largest. The
 * queries stay in registers, each key row is loaded (and converted) once for all G, and four
 * keys at a time are summed in one pass of shuffles (vec_sum4): a sum per key, and a loop over
 * the head's vectors, were half of the attention's time at position 960 (perf annotate, SmolLM2
 * w4a8). Each head's sums run in the one-head order, so its scores are bit for bit what it gets
 * alone. Always inlined with VECS and G constants. */
static inline __attribute__((always_inline)) void key_scores(
    const float *const q[], const void *cache, int64_t base, int64_t stride, int64_t n, int kind,
    float scale, float *const scores[], float best[], const int VECS, const int G) {
    vec query[MAX_G][MAX_VECS];
    for (int g = 0; g < G; ++g) {
        for (int i = 0; i < VECS; ++i) query[g][i] = vec_load(q[g] + i * LANES);
        best[g] = -INFINITY;
    }
    for (int64_t t = 0; t < n; t += 4) {
        const int count = n - t < 4 ? (int)(n - t) : 4;
        vec dots[MAX_G][4];
        for (int g = 0; g < G; ++g)
            for (int k = 0; k < 4; ++k) dots[g][k] = vec_zero();
        for (int k = 0; k < count; ++k) {
            const int64_t at = base + (t + k) * stride;
            prefetch_row(cache, at + PREFETCH_POSITIONS * stride, VECS * LANES, kind);
            for (int i = 0; i < VECS; ++i) {
                const vec key = cache_load(cache, at + i * LANES, kind);
                for (int g = 0; g < G; ++g) dots[g][k] = vec_fma(query[g][i], key, dots[g][k]);
            }
        }
        for (int g = 0; g < G; ++g) {
            float sums[4];
            vec_sum4(dots[g], sums);
            for (int k = 0; k < count; ++k) {
                scores[g][t + k] = sums[k] * scale;
                best[g] = scores[g][t + k] > best[g] ? scores[g][t + k] : best[g];
            }
        }
    }
}

/* How many query heads one pass takes, by the registers their sums need: AVX-512 has 32, so a
 * 64-float head (VECS 4) takes three at a time over the keys (12 for the queries, 12 for the
 * sums) and two over the values (16 sums); a 128-float head (VECS 8) two and one. AVX2's 16
 * hold one. */
#define KEY_HEADS(VECS) (LANES == 16 ? (VECS == 4 ? 3 : 2) : 1)
#define VALUE_HEADS(VECS) (LANES == 16 && VECS == 4 ? 2 : 1)

/* key_scores, then the softmax and weighted_values, for `count` query heads of one key/value
 * head, in passes of as many as the registers hold */
static inline __attribute__((always_inline)) void attend_in_registers(
    const float *const q[], float *const out[], float *const scores[], int64_t count,
    const void *keys, const void *values, int64_t base, int64_t stride, int64_t n, int kind,
    float scale, const int VECS) {
    float best[count], inverse[count];
    int64_t h = 0;
    for (; KEY_HEADS(VECS) >= 3 && h + 3 <= count; h += 3)
        key_scores(q + h, keys, base, stride, n, kind, scale, scores + h, best + h, VECS, 3);
    for (; KEY_HEADS(VECS) >= 2 && h + 2 <= count; h += 2)
        key_scores(q + h, keys, base, stride, n, kind, scale, scores + h, best + h, VECS, 2);
    for (; h < count; ++h)
        key_scores(q + h, keys, base, stride, n, kind, scale, scores + h, best + h, VECS, 1);
    for (h = 0; h < count; ++h) inverse[h] = softmax(scores[h], n, best[h]);
    for (h = 0; VALUE_HEADS(VECS) >= 2 && h + 2 <= count; h += 2)
        weighted_values(out + h, (const float *const *)scores + h, inverse + h, values, base,
                        stride, n, kind, VECS, 2);
    for (; h < count; ++h)
        weighted_values(out + h, (const float *const *)scores + h, inverse + h, values, base,
                        stride, n, kind, VECS, 1);
}

/* Query heads first..first+count-1 of token `row`, which share one key/value head, over its
 * keys 0..pos, in the cache row that starts `offset` elements after the layer's
 * k_cache/v_cache: softmax(q . K * scale) . V for each, with scores[h] (pos + 1 floats) head
 * first + h's scratch. */
static void attend(const Model *m, const Layer *layer, int64_t first, int64_t count, int64_t row,
                   int64_t pos, int64_t offset, float *const scores[]) {
    const int64_t D = m->head_dim, H = m->n_heads, kv_head = first / (H / m->n_kv_heads);
    const int kind = (int)m->cache_kind;
    const float *q[count];
    float *out[count];
    for (int64_t h = 0; h < count; ++h) {
        q[h] = m->qkv + row * (H + 2 * m->n_kv_heads) * D + (first + h) * D;
        out[h] = m->att + (row * H + first + h) * D;
    }
    const int64_t base = offset + kv_head * m->cache_head_stride, stride = m->cache_pos_stride;
    const void *keys = layer->k_cache, *values = layer->v_cache;
    /* one copy per head size and cache kind, both constants: with the kind a variable, GCC
     * kept weighted_values' sums on the stack (a load and a store per FMA: perf annotate) */
#define ATTEND(KIND, VECS)                                                                   \
    attend_in_registers(q, out, scores, count, keys, values, base, stride, pos + 1, KIND,   \
                        m->attn_scale, VECS)
#define ATTEND_KINDS(VECS)                                                                   \
    if (kind == CACHE_F16) ATTEND(CACHE_F16, VECS);                                          \
    else if (kind == CACHE_BF16) ATTEND(CACHE_BF16, VECS);                                   \
    else ATTEND(CACHE_F32, VECS);                                                            \
    return;
    if (D == 4 * LANES) { /* 64 (AVX-512) or 32: SmolLM2, GPT-2, Llama 3.2 1B ... */
        ATTEND_KINDS(4)
    }
    if (D == 8 * LANES) { /* 128 (AVX-512) or 64 (AVX2): Llama, Qwen, Mistral */
        ATTEND_KINDS(8)
    }
#undef ATTEND_KINDS
#undef ATTEND
    for (int64_t h = 0; h < count; ++h) { /* any other head size, through memory */
        float best = -INFINITY;
        for (int64_t t = 0; t <= pos; ++t) {
            prefetch_row(keys, base + (t + PREFETCH_POSITIONS) * stride, D, kind);
            scores[h][t] = key_dot(q[h], keys, base + t * stride, D, kind) * m->attn_scale;
            if (scores[h][t] > best) best = scores[h][t];
        }
        const float inverse = softmax(scores[h], pos + 1, best);
        for (int64_t d = 0; d < D; ++d) out[h][d] = 0.0f;
        for (int64_t t = 0; t <= pos; ++t) {
            prefetch_row(values, base + (t + PREFETCH_POSITIONS) * stride, D, kind);
            add_value(out[h], scores[h][t] * inverse, values, base + t * stride, D, kind);
        }
    }
}

#endif
