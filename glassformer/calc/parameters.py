"""The parameter table of seed 000 §2.1 (with MoE's total vs active, §2.5.3), from a config,
never from weights: `parameter_counts` builds the model on torch's meta device (shapes without
storage: exact at any size, instantly) and `parameter_rows` writes the same numbers as
closed-form formulas, one row per line of the tutorial's table. MLAMoEConfig is DeepSeek-V3's
shape, which glassformer counts but does not build.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from glassformer.config import ModelConfig
from glassformer.models import build_model

# --- the table of a built model -------------------------------------------------------------


def component_of(name: str) -> str:
    """Which row of the parameter table a parameter name belongs to."""
    if name.startswith(("tok_emb", "dec_tok_emb")):  # dec_tok_emb: a seq2seq decoder's own
        return "embedding"
    if name.startswith(("pos_emb", "enc_pos", "dec_pos", "enc_rel", "dec_rel")):
        return "positions"
    if name.startswith("lm_head"):
        return "lm_head"
    if ".ffn.router" in name:
        return "moe router"
    if "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1]:
        return "norms"
    if ".attn." in name or ".cross_attn." in name:
        return "attention"
    if ".ffn." in name:
        return "ffn"
    if name.startswith("rnn_layers."):
        return "recurrent"  # RNN family: W_xh, W_hh (and the LSTM/GRU gates)
    return "other"


def parameter_table(model: nn.Module) -> dict[str, int]:
    """Parameter counts by component; tied weights are counted once (under embedding)."""
    counts: dict[str, int] = defaultdict(int)
    for name, param in model.named_parameters():  # named_parameters skips tied duplicates
        counts[component_of(name)] += param.numel()
    return dict(counts)


# --- an architecture glassformer counts but does not build ------------------------------------


@dataclass(frozen=True)
class MLAMoEConfig:
    """DeepSeek-V3's shape, for counting only: Multi-head Latent Attention (q and kv pass through
    low-rank "latent" projections; the cache holds the kv latent, not per-head K and V) and a MoE
    FFN of shared + routed experts after a few dense layers. Field names follow its config.json.
    """

    name: str
    vocab_size: int
    d_model: int  # hidden_size
    n_layers: int  # num_hidden_layers (the multi-token-prediction module is not counted)
    n_heads: int  # num_attention_heads
    q_lora_rank: int  # queries: d_model -> q_lora_rank -> heads
    kv_lora_rank: int  # keys/values: d_model -> kv_lora_rank (cached) -> heads
    qk_rope_head_dim: int  # per head, the part of q/k that RoPE rotates (k's is shared by heads)
    qk_nope_head_dim: int  # per head, the part of q/k without positions
    v_head_dim: int
    d_ff: int  # intermediate_size: the dense layers' SwiGLU width
    moe_d_ff: int  # moe_intermediate_size: each expert's SwiGLU width
    n_routed_experts: int
    n_shared_experts: int  # always run, for every token
    n_experts_per_token: int  # num_experts_per_tok: routed experts each token runs
    n_dense_layers: int  # first_k_dense_replace: the first layers keep a dense FFN
    max_seq_len: int
    published: str  # the vendor's own numbers, printed beside ours
    tie_embeddings: bool = False
    family: str = "gpt"  # a decoder: everything below treats it as one


AnyConfig = ModelConfig | MLAMoEConfig


# --- the table of a config, in closed form ----------------------------------------------------


@dataclass
class Row:
    """One line of the parameter table. `count` is the total over `layers` (None: not a
    per-layer row); `active` is what one token uses (MoE: only its top-k experts); `matmul` is
    how many of the weights one token multiplies in a forward pass (FLOPs = 2 x that)."""

    name: str
    shape: str
    count: int
    component: str  # the parameter_table component these weights fall under
    layers: int | None = None
    active: int | None = None  # None: all of count
    matmul: int = 0

    def __post_init__(self) -> None:
        if self.active is None:
            self.active = self.count

    @property
    def per_layer(self) -> int | None:
        return None if self.layers is None else self.count // self.layers


def _m(*dims: int) -> str:
    return "[" + " x ".join(str(d) for d in dims) + "]"


def _times(n: int, shape: str) -> str:
    return shape if n == 1 else f"{n} x {shape}"


def norm_size(cfg: ModelConfig) -> int:
    # LayerNorm: gain gamma and shift beta; RMSNorm (and a bias-free LayerNorm): gamma only
    return cfg.d_model * (2 if cfg.norm == "layer" and cfg.norm_bias else 1)


def _norm_shape(cfg: ModelConfig, n: int = 1) -> str:
    """ "2 x ([768] + [768])": n norms, each a gain (and a shift)."""
    one = _m(cfg.d_model)
    one = f"({one} + {one})" if norm_size(cfg) == 2 * cfg.d_model else one
    return one if n == 1 else f"{n} x {one}"


def _norm_name(cfg: ModelConfig) -> str:
    if cfg.norm == "rms":
        return "RMSNorm gamma"
    return "LayerNorm gamma/beta" if cfg.norm_bias else "LayerNorm gamma"


def _attention_row(cfg: ModelConfig, layers: int, name: str) -> Row:
    d, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    weights = d * q + 2 * d * kv + q * d  # W_Q, W_K, W_V (kv heads only: GQA/MQA), W_O
    biases = (q + 2 * kv) * cfg.has_bias("qkv") + d * cfg.has_bias("attn_out")
    qk_norms = 2 * cfg.head_dim * cfg.qk_norm  # Qwen3's q/k RMSNorm gains
    mha = q == kv == d  # the tutorial's "4 x [4096 x 4096]"
    shape = f"4 x {_m(d, d)}" if mha else f"{_m(d, q)} + 2 x {_m(d, kv)} + {_m(q, d)}"
    shape += " + biases" if biases else ""
    shape += " + q/k norms" if qk_norms else ""
    biases += qk_norms
    return Row(
        name, shape, layers * (weights + biases), "attention", layers, matmul=layers * weights
    )


def _dense_ffn(kind: str, d: int, d_ff: int, bias: bool) -> tuple[int, int, str, str]:
    """(parameters, matmul weights, row name, shape) of one dense FFN."""
    if kind in ("swiglu", "geglu", "geglu_tanh"):
        gate = {"swiglu": "SwiGLU", "geglu": "GeGLU", "geglu_tanh": "GeGLU"}[kind]
        weights = 3 * d * d_ff
        return (
            weights + (2 * d_ff + d) * bias,
            weights,
            f"W_gate/W_up/W_down ({gate})",
            (f"3 x {_m(d, d_ff)}"),
        )
    weights = 2 * d * d_ff
    return weights + (d_ff + d) * bias, weights, f"W_in/W_out ({kind})", f"2 x {_m(d, d_ff)}"


def _ffn_rows(cfg: ModelConfig, layers: int) -> list[Row]:
    bias = cfg.has_bias("mlp")
    if cfg.ffn != "moe":
        count, weights, name, shape = _dense_ffn(cfg.ffn, cfg.d_model, cfg.d_ff, bias)
        shape += " + biases" if bias else ""
        return [Row(f"FFN {name}", shape, layers * count, "ffn", layers, matmul=layers * weights)]
    count, weights, name, shape = _dense_ffn(cfg.moe_expert_ffn, cfg.d_model, cfg.d_ff, bias)
    E, k = cfg.n_experts, cfg.n_experts_per_token
    experts = Row(
        f"MoE experts ({E} FFNs, each {name.split(' ')[-1].strip('()')})",
        f"{E} x {shape}",
        layers * E * count,
        "ffn",
        layers,
        active=layers * k * count,  # each token runs only its top-k experts (seed 000 §2.5.3)
        matmul=layers * k * weights,
    )
    router = Row("MoE router", _m(cfg.d_model, E), layers * cfg.d_model * E, "moe router", layers)
    router.matmul = router.count
    return [experts, router]


def _block_rows(cfg: ModelConfig, layers: int, cross: bool, prefix: str = "") -> list[Row]:
    rows = [_attention_row(cfg, layers, f"{prefix}Attention W_Q/W_K/W_V/W_O")]
    if cross:
        rows.append(_attention_row(cfg, layers, f"{prefix}Cross-attention W_Q/W_K/W_V/W_O"))
    rows += [
        Row(prefix + r.name, r.shape, r.count, r.component, layers, r.active, r.matmul)
        for r in _ffn_rows(cfg, layers)
    ]
    n_norms = 3 if cross else 2  # one before (or after) each sublayer
    rows.append(
        Row(
            f"{prefix}{_norm_name(cfg)}",
            _norm_shape(cfg, n_norms),
            layers * n_norms * norm_size(cfg),
            "norms",
            layers,
        )
    )
    return rows


def _embedding_rows(cfg: ModelConfig, n_tables: int = 1) -> list[Row]:
    V, d = cfg.vocab_size, cfg.d_model
    rows = [Row("Embedding table (token embedding)", _m(V, d), V * d, "embedding")]
    if cfg.family == "seq2seq" and not cfg.share_embeddings:
        rows.append(Row("Decoder embedding table", _m(V, d), V * d, "embedding"))
    if cfg.position == "learned":
        n = cfg.max_seq_len + (cfg.position_offset if cfg.family == "seq2seq" else 0)
        rows.append(
            Row(
                "Positions (learned table)",
                _times(n_tables, _m(n, d)),
                n_tables * n * d,
                "positions",
            )
        )
    if cfg.position == "relative":  # T5: a bias per (distance bucket, head), per stack
        B, H = cfg.relative_buckets, cfg.n_heads
        rows.append(
            Row("Relative position bias", _times(n_tables, _m(B, H)), n_tables * B * H, "positions")
        )
    return rows


def _output_row(cfg: ModelConfig) -> Row:
    V, d = cfg.vocab_size, cfg.d_model
    bias = V if cfg.family == "seq2seq" and cfg.lm_head_bias else 0
    if cfg.tie_embeddings:  # the same matrix read backwards: no new weights, same matmul
        return Row("Output head (tied to the embedding)", _m(d, V), bias, "lm_head", matmul=V * d)
    return Row("Output head (lm_head)", _m(d, V), V * d + bias, "lm_head", matmul=V * d)


def _final_norm_rows(cfg: ModelConfig, n: int, what: str = "Final norm") -> list[Row]:
    if cfg.norm_position != "pre":  # post-norm stacks end normalized
        return []
    return [Row(what, _norm_shape(cfg, n), n * norm_size(cfg), "norms")]


def _bert_rows(cfg: ModelConfig) -> list[Row]:
    d, V = cfg.d_model, cfg.vocab_size
    rows = _embedding_rows(cfg)
    if cfg.type_vocab_size:
        rows.append(
            Row(
                "Token types (segment A/B)",
                _m(cfg.type_vocab_size, d),
                cfg.type_vocab_size * d,
                "other",
            )
        )
    if cfg.embedding_norm:
        rows.append(Row("Embedding norm", _norm_shape(cfg), norm_size(cfg), "norms"))
    rows += _block_rows(cfg, cfg.n_layers, cross=False)
    rows += _final_norm_rows(cfg, 1)
    # The pooler and task heads read one vector per sequence: no per-token matmul.
    if cfg.pooler:
        rows.append(Row("Pooler tanh(W h_[CLS] + b)", _m(d, d), d * d + d, "other"))
    if cfg.mlm_head:
        rows.append(Row("Masked-LM head dense + bias", _m(d, d), d * d + d, "other", matmul=d * d))
        rows.append(Row("Masked-LM head norm", _norm_shape(cfg), norm_size(cfg), "norms"))
        decoder = 0 if cfg.tie_embeddings else V * d
        tied = " bias (weight tied)" if cfg.tie_embeddings else " + bias"
        rows.append(Row(f"Masked-LM decoder{tied}", _m(d, V), decoder + V, "other", matmul=V * d))
    if cfg.n_classes:
        n = cfg.n_classes
        rows.append(Row("Classifier head", _m(d, n), d * n + n, "other"))
    if cfg.nsp_head:
        rows.append(Row("Next-sentence head", _m(d, 2), 2 * d + 2, "other"))
    return rows


def _seq2seq_rows(cfg: ModelConfig) -> list[Row]:
    n_enc = cfg.n_encoder_layers or cfg.n_layers
    rows = _embedding_rows(cfg, n_tables=2)  # the encoder and the decoder have their own
    if cfg.embedding_norm:
        rows.append(Row("Embedding norms", _norm_shape(cfg, 2), 2 * norm_size(cfg), "norms"))
    rows += _block_rows(cfg, n_enc, cross=False, prefix="Encoder ")
    rows += _block_rows(cfg, cfg.n_layers, cross=True, prefix="Decoder ")
    rows += _final_norm_rows(cfg, 2, "Final norms (encoder, decoder)")
    return [*rows, _output_row(cfg)]


def _mla_moe_rows(cfg: MLAMoEConfig) -> list[Row]:
    """DeepSeek-V3, from the shapes of its weights (HF DeepseekV3ForCausalLM; no biases)."""
    d, H, L = cfg.d_model, cfg.n_heads, cfg.n_layers
    qk_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    n_moe = L - cfg.n_dense_layers
    attention = (
        d * cfg.q_lora_rank  # W_DQ: compress the query
        + cfg.q_lora_rank * H * qk_head  # W_UQ: expand it to every head's q (nope + rope parts)
        + d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)  # W_DKV: the cached latent + shared k_rope
        + cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim)  # W_UKV: k_nope and v
        + H * cfg.v_head_dim * d  # W_O
    )
    expert = 3 * d * cfg.moe_d_ff  # one SwiGLU expert: gate, up, down
    routed = n_moe * cfg.n_routed_experts * expert
    rows = [
        Row(
            "Embedding table (token embedding)",
            _m(cfg.vocab_size, d),
            cfg.vocab_size * d,
            "embedding",
        ),
        Row(
            "Attention (MLA) W_DQ/W_UQ/W_DKV/W_UKV/W_O",
            f"{_m(d, cfg.q_lora_rank)} + {_m(cfg.q_lora_rank, H * qk_head)} + "
            f"{_m(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim)} + "
            f"{_m(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim))} + "
            f"{_m(H * cfg.v_head_dim, d)}",
            L * attention,
            "attention",
            L,
            matmul=L * attention,
        ),
        Row(
            "MLA latent norms (q, kv)",
            f"{_m(cfg.q_lora_rank)} + {_m(cfg.kv_lora_rank)}",
            L * (cfg.q_lora_rank + cfg.kv_lora_rank),
            "norms",
            L,
        ),
        Row(
            f"FFN W_gate/W_up/W_down (SwiGLU), first {cfg.n_dense_layers} layers",
            f"3 x {_m(d, cfg.d_ff)}",
            cfg.n_dense_layers * 3 * d * cfg.d_ff,
            "ffn",
            cfg.n_dense_layers,
            matmul=cfg.n_dense_layers * 3 * d * cfg.d_ff,
        ),
        Row(
            "MoE shared experts (run for every token)",
            f"{cfg.n_shared_experts} x 3 x {_m(d, cfg.moe_d_ff)}",
            n_moe * cfg.n_shared_experts * expert,
            "ffn",
            n_moe,
            matmul=n_moe * cfg.n_shared_experts * expert,
        ),
        Row(
            f"MoE routed experts (top-{cfg.n_experts_per_token} per token)",
            f"{cfg.n_routed_experts} x 3 x {_m(d, cfg.moe_d_ff)}",
            routed,
            "ffn",
            n_moe,
            active=n_moe * cfg.n_experts_per_token * expert,
            matmul=n_moe * cfg.n_experts_per_token * expert,
        ),
        # the router's weight and its load-balancing bias (added to scores when picking experts)
        Row(
            "MoE router + selection bias",
            f"{_m(d, cfg.n_routed_experts)} + {_m(cfg.n_routed_experts)}",
            n_moe * (d + 1) * cfg.n_routed_experts,
            "moe router",
            n_moe,
            matmul=n_moe * d * cfg.n_routed_experts,
        ),
        Row("RMSNorm gamma", f"2 x {_m(d)}", L * 2 * d, "norms", L),
        Row("Final norm", _m(d), d, "norms"),
    ]
    V = cfg.vocab_size
    if cfg.tie_embeddings:
        rows.append(
            Row("Output head (tied to the embedding)", _m(d, V), 0, "lm_head", matmul=V * d)
        )
    else:
        rows.append(Row("Output head (lm_head)", _m(d, V), V * d, "lm_head", matmul=V * d))
    return rows


def parameter_rows(cfg: AnyConfig) -> list[Row]:
    """The parameter table of seed 000 §2.1 as closed-form formulas, one Row per kind of weight.
    Summed by component it equals parameter_table of the built model (tests hold it)."""
    if isinstance(cfg, MLAMoEConfig):
        return _mla_moe_rows(cfg)
    if cfg.family == "gpt":
        rows = _embedding_rows(cfg) + _block_rows(cfg, cfg.n_layers, cross=False)
        return rows + _final_norm_rows(cfg, 1) + [_output_row(cfg)]
    if cfg.family == "bert":
        return _bert_rows(cfg)
    if cfg.family == "seq2seq":
        return _seq2seq_rows(cfg)
    raise ValueError(
        f"family={cfg.family!r} has no closed-form table here (the recurrent cells differ): "
        "parameter_counts(cfg) counts it from the model built on the meta device"
    )


def _meta_model(cfg: ModelConfig) -> nn.Module:
    with torch.device("meta"):  # parameters get shapes but no storage: a 70B model in ~0.2 s
        return build_model(cfg)


def parameter_counts(cfg: AnyConfig) -> dict:
    """{"total": N, "active": N one token uses, "components": {component: N}}.

    A ModelConfig is built on the meta device and its parameters counted (exactly what
    build_model makes, tied weights once); a count-only config (deepseek-v3) is summed from its
    closed-form rows. active = total for dense models; for MoE everything but the experts plus
    the top-k of them (seed 000 §2.5.3: "671B total / 37B active").
    """
    if isinstance(cfg, MLAMoEConfig):
        rows = parameter_rows(cfg)
        components: dict[str, int] = defaultdict(int)
        for row in rows:
            components[row.component] += row.count
        total, active = sum(r.count for r in rows), sum(r.active for r in rows)
        return {"total": total, "active": active, "components": dict(components)}
    model = _meta_model(cfg)
    components = parameter_table(model)
    total = sum(components.values())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".ffn.experts." in n)
    # every expert has the same shape, so the top-k share of them is exact
    active = total - experts + experts * cfg.n_experts_per_token // cfg.n_experts
    return {"total": total, "active": active, "components": components}
