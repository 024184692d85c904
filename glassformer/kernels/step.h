/* The structs of one decode step (decode.c), which glassformer/infer/fused.py fills through
 * their ctypes mirror, kernels/step.py (glassformer_layout() lets it check them field by
 * field), and the scalar bf16 <-> f32 conversions the step and the attention share. */
#ifndef GLASSFORMER_STEP_H
#define GLASSFORMER_STEP_H
#include <stdint.h>
#include <string.h>

enum storage { F32 = 0, BF16 = 1, INT8 = 2, Q4 = 3 };
enum activation { RELU = 0, GELU = 1, GELU_TANH = 2, SILU = 3 };
enum { CACHE_F32 = 0, CACHE_BF16 = 1, CACHE_F16 = 2 }; /* how the keys/values are stored */

typedef struct {
    const void *weight; /* (out, in); int4: (out, in / 2) bytes */
    const float *scale; /* int8, int4: (out, in / group); else NULL */
    const float *mins;  /* int4: (out, in / 32); else NULL */
    const float *bias;  /* (out,) or NULL */
    int64_t in, out, group;
    int64_t storage;
    int64_t round_inputs; /* 1: x rounded to int8 in groups of 32 first (a8.h: w8a8, w4a8) */
    const uint8_t *packed; /* int4 repacked for the tile unit (amx.h), or NULL */
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

#endif
