"""T5 name table (T5ForConditionalGeneration, T5 v1.0 and v1.1): a pre-norm encoder-decoder with
RMS norms (T5LayerNorm has no mean and no bias), no biases, no 1/sqrt(d) attention scale (T5
folds it into its init), and a bucketed relative position bias (position="relative") kept in
each stack's first layer and shared by all its layers.

Output head: tied to the shared table with the decoder output scaled by d_model**-0.5 (T5
v1.0), or a separate lm_head.weight without the scale (v1.1). transformers 5 writes the second
as `scale_decoder_outputs: false`; transformers 4 as `tie_word_embeddings: false`.
"""

from __future__ import annotations

from typing import Any

from glassformer.config import ModelConfig
from glassformer.interop.hf import Architecture, InteropError, WeightRule, fused, register, rename

# (gated, dense_act_fn) -> glassformer ffn
FFN_FROM_HF = {
    (False, "relu"): "relu",
    (False, "gelu"): "gelu",
    (False, "gelu_new"): "gelu_tanh",
    (False, "gelu_pytorch_tanh"): "gelu_tanh",
    (True, "gelu_new"): "geglu_tanh",
    (True, "gelu_pytorch_tanh"): "geglu_tanh",
    (True, "gelu"): "geglu",
    (True, "silu"): "swiglu",
}
FFN_TO_HF = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_tanh": "gelu_new",
    "geglu_tanh": "gated-gelu",
    "geglu": "gated-gelu_python",
    "swiglu": "gated-silu",
}
GATED = ("geglu_tanh", "geglu", "swiglu")


def _ffn(hf: dict[str, Any]) -> str:
    proj = hf.get("feed_forward_proj", "relu")
    gated = proj.startswith("gated-")
    act = proj.split("-", 1)[1] if gated else proj
    if proj == "gated-gelu":
        act = "gelu_new"  # T5Config's own special case
    act = {"gelu_python": "gelu"}.get(act, act)
    if (gated, act) not in FFN_FROM_HF:
        raise InteropError(
            f"t5 feed_forward_proj={proj!r} is not supported: supported are "
            f"{', '.join(FFN_TO_HF.values())}"
        )
    return FFN_FROM_HF[gated, act]


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    d_model = hf["d_model"]
    # transformers 5 names the d_model**-0.5 rescale; transformers 4 derives it from tying.
    scaled = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True))
    return ModelConfig(
        family="seq2seq",
        vocab_size=hf["vocab_size"],
        d_model=d_model,
        n_heads=hf["num_heads"],
        head_dim=hf["d_kv"],
        d_ff=hf["d_ff"],
        n_encoder_layers=hf["num_layers"],
        n_layers=hf.get("num_decoder_layers") or hf["num_layers"],
        max_seq_len=hf.get("n_positions", 512),  # only the default cache size: T5 has no limit
        position="relative",
        relative_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_max_distance=hf.get("relative_attention_max_distance", 128),
        norm="rms",
        norm_position="pre",
        norm_eps=hf.get("layer_norm_epsilon", 1e-6),
        norm_bias=False,
        ffn=_ffn(hf),
        bias=False,
        attention_scale=1.0,
        share_embeddings=True,
        tie_embeddings=True,
        output_scale=d_model**-0.5 if scaled else 1.0,
        pad_token_id=hf.get("pad_token_id", 0),
        eos_token_id=hf.get("eos_token_id", 1),
        decoder_start_token_id=hf.get("decoder_start_token_id", hf.get("pad_token_id", 0)),
        init_std=0.02,
    )


def refine_config(cfg: ModelConfig, names: set[str]) -> ModelConfig:
    # A separate output matrix in the file is an untied head (T5 v1.1).
    return cfg.replace(tie_embeddings="lm_head.weight" not in names)


def export_config(cfg: ModelConfig) -> ModelConfig:
    problems = []
    if cfg.family != "seq2seq":
        problems.append(f"family={cfg.family!r} (need 'seq2seq')")
    if cfg.position != "relative":
        problems.append(f"position={cfg.position!r} (need 'relative')")
    if (cfg.norm, cfg.norm_position) != ("rms", "pre") or cfg.embedding_norm:
        problems.append("norms (need pre-norm RMS norms and no embedding norm)")
    if cfg.ffn not in FFN_TO_HF:
        problems.append(f"ffn={cfg.ffn!r} (need one of {', '.join(FFN_TO_HF)})")
    if cfg.n_kv_heads != cfg.n_heads:
        problems.append("grouped key/value heads")
    if any(cfg.has_bias(part) for part in ("qkv", "attn_out", "mlp")) or cfg.lm_head_bias:
        problems.append("biases (T5 has none)")
    if cfg.attention_scale != 1.0:
        problems.append(f"attention_scale={cfg.attention_scale} (T5 does not scale: need 1.0)")
    if not cfg.share_embeddings or cfg.scale_embeddings:
        problems.append("separate or scaled embeddings")
    tied_scale = cfg.d_model**-0.5
    if cfg.output_scale != 1.0 and not (cfg.tie_embeddings and cfg.output_scale == tied_scale):
        problems.append(f"output_scale={cfg.output_scale} (need 1.0, or d_model**-0.5 if tied)")
    if cfg.sliding_window is not None:
        problems.append(f"sliding_window={cfg.sliding_window}")
    if problems:
        raise InteropError("this config has no Hugging Face T5 equivalent: " + "; ".join(problems))
    return cfg


def _scaled_output(cfg: ModelConfig) -> bool:
    return cfg.tie_embeddings and cfg.output_scale != 1.0


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    export_config(cfg)
    scaled = _scaled_output(cfg)
    return {
        "model_type": "t5",
        "architectures": ["T5ForConditionalGeneration"],
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "d_kv": cfg.head_dim,
        "d_ff": cfg.d_ff,
        "num_heads": cfg.n_heads,
        "num_layers": cfg.n_encoder_layers or cfg.n_layers,
        "num_decoder_layers": cfg.n_layers,
        "relative_attention_num_buckets": cfg.relative_buckets,
        "relative_attention_max_distance": cfg.relative_max_distance,
        "layer_norm_epsilon": cfg.norm_eps,
        "feed_forward_proj": FFN_TO_HF[cfg.ffn],
        "dropout_rate": cfg.dropout,
        # Unscaled output is T5 v1.1's untied head; lm_head.weight is written for it either
        # way (a copy of the table when tied), which both transformers 4 and 5 read right.
        "tie_word_embeddings": scaled,
        "scale_decoder_outputs": scaled,
        "pad_token_id": cfg.pad_token_id if cfg.pad_token_id is not None else 0,
        "eos_token_id": cfg.eos_token_id if cfg.eos_token_id is not None else 1,
        "decoder_start_token_id": cfg.decoder_start_token_id
        if cfg.decoder_start_token_id is not None
        else cfg.bos_token_id,
        "is_encoder_decoder": True,
        "torch_dtype": "float32",
    }


# --- weights ----------------------------------------------------------------------------------


def _attention(gf: str, hf: str, cfg: ModelConfig, cross: bool) -> list[WeightRule]:
    size = cfg.n_heads * cfg.head_dim
    if cross:
        proj = [
            rename(f"{gf}.q_proj.weight", f"{hf}.q.weight"),
            fused(f"{gf}.kv_proj.weight", [f"{hf}.k.weight", f"{hf}.v.weight"], [size] * 2),
        ]
    else:
        qkv = [f"{hf}.{p}.weight" for p in "qkv"]
        proj = [fused(f"{gf}.qkv_proj.weight", qkv, [size] * 3)]
    return [*proj, rename(f"{gf}.out_proj.weight", f"{hf}.o.weight")]


def _ffn_rules(gf: str, hf: str, cfg: ModelConfig) -> list[WeightRule]:
    if cfg.ffn in GATED:
        gate_up = [f"{hf}.wi_0.weight", f"{hf}.wi_1.weight"]
        return [
            fused(f"{gf}.gate_up.weight", gate_up, [cfg.d_ff] * 2),
            rename(f"{gf}.down.weight", f"{hf}.wo.weight"),
        ]
    return [
        rename(f"{gf}.fc_in.weight", f"{hf}.wi.weight"),
        rename(f"{gf}.fc_out.weight", f"{hf}.wo.weight"),
    ]


def rules(cfg: ModelConfig, names: set[str]) -> list[WeightRule]:
    bias = "layer.0.SelfAttention.relative_attention_bias.weight"
    table = [
        rename("tok_emb.weight", "shared.weight"),
        rename("enc_rel.weight", f"encoder.block.0.{bias}"),
        rename("dec_rel.weight", f"decoder.block.0.{bias}"),
        rename("enc_final_norm.weight", "encoder.final_layer_norm.weight"),
        rename("dec_final_norm.weight", "decoder.final_layer_norm.weight"),
    ]
    for i in range(cfg.n_encoder_layers or cfg.n_layers):
        gf, hf = f"encoder.{i}", f"encoder.block.{i}"
        table += [
            *_attention(f"{gf}.attn", f"{hf}.layer.0.SelfAttention", cfg, cross=False),
            rename(f"{gf}.attn_norm.weight", f"{hf}.layer.0.layer_norm.weight"),
            *_ffn_rules(f"{gf}.ffn", f"{hf}.layer.1.DenseReluDense", cfg),
            rename(f"{gf}.ffn_norm.weight", f"{hf}.layer.1.layer_norm.weight"),
        ]
    for i in range(cfg.n_layers):
        gf, hf = f"decoder.{i}", f"decoder.block.{i}"
        table += [
            *_attention(f"{gf}.attn", f"{hf}.layer.0.SelfAttention", cfg, cross=False),
            rename(f"{gf}.attn_norm.weight", f"{hf}.layer.0.layer_norm.weight"),
            *_attention(f"{gf}.cross_attn", f"{hf}.layer.1.EncDecAttention", cfg, cross=True),
            rename(f"{gf}.cross_norm.weight", f"{hf}.layer.1.layer_norm.weight"),
            *_ffn_rules(f"{gf}.ffn", f"{hf}.layer.2.DenseReluDense", cfg),
            rename(f"{gf}.ffn_norm.weight", f"{hf}.layer.2.layer_norm.weight"),
        ]
    if not cfg.tie_embeddings:
        table.append(rename("lm_head.weight", "lm_head.weight"))
    elif not names and not _scaled_output(cfg):
        # Writing a tied, unscaled head: also store it as lm_head.weight (see config_to_hf).
        table[0] = WeightRule(
            "tok_emb.weight",
            ["shared.weight", "lm_head.weight"],
            lambda ts: ts[0],
            lambda t: [t, t],
        )
    return table


def _ignorable(name: str) -> bool:
    # Aliases of the shared table that some savers write out.
    return name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


register(
    Architecture(
        model_types=("t5",),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        rules=rules,
        ignorable=_ignorable,
        refine_config=refine_config,
        export_config=export_config,
    )
)
