"""BART name table (BartForConditionalGeneration, BartModel): the encoder-decoder of seed 000 §6.1
with learned positions offset by 2, a LayerNorm right after the embeddings, post-norm blocks,
GELU FFNs, biases everywhere and a fixed `final_logits_bias` on the output.

HF stores q/k/v separately; glassformer fuses them into qkv_proj (self-attention) and k/v into
kv_proj (cross-attention). The conditional-generation model prefixes the body with `model.`.
"""

from __future__ import annotations

from typing import Any

from glassformer.config import ModelConfig
from glassformer.interop.archs.bert import ACT_FROM_HF, ACT_TO_HF
from glassformer.interop.hf import Architecture, InteropError, WeightRule, fused, register, rename

POSITION_OFFSET = 2  # BartLearnedPositionalEmbedding: position p reads row p + 2


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    act = hf.get("activation_function", "gelu")
    if act not in ACT_FROM_HF:
        raise InteropError(
            f"bart activation_function={act!r} is not supported: supported are "
            f"{', '.join(ACT_FROM_HF)}"
        )
    heads = (hf.get("encoder_attention_heads", 16), hf.get("decoder_attention_heads", 16))
    ffn_dims = (hf.get("encoder_ffn_dim", 4096), hf.get("decoder_ffn_dim", 4096))
    if heads[0] != heads[1] or ffn_dims[0] != ffn_dims[1]:
        raise InteropError(
            f"bart with different encoder/decoder heads {heads} or FFN sizes {ffn_dims} is not "
            "supported: glassformer's encoder and decoder share one config"
        )
    return ModelConfig(
        family="seq2seq",
        vocab_size=hf["vocab_size"],
        d_model=hf["d_model"],
        n_layers=hf.get("decoder_layers", 12),
        n_encoder_layers=hf.get("encoder_layers", 12),
        n_heads=heads[0],
        d_ff=ffn_dims[0],
        max_seq_len=hf.get("max_position_embeddings", 1024),
        position="learned",
        position_offset=POSITION_OFFSET,
        scale_embeddings=hf.get("scale_embedding", False),
        norm="layer",
        norm_position="post",
        norm_eps=1e-5,
        ffn=ACT_FROM_HF[act],
        bias=True,
        embedding_norm=True,
        lm_head_bias=True,
        share_embeddings=True,
        tie_embeddings=hf.get("tie_word_embeddings", True),
        init_std=hf.get("init_std", 0.02),
        bos_token_id=hf.get("bos_token_id", 0),
        eos_token_id=hf.get("eos_token_id", 2),
        pad_token_id=hf.get("pad_token_id", 1),
        decoder_start_token_id=hf.get("decoder_start_token_id", 2),
    )


def refine_config(cfg: ModelConfig, names: set[str]) -> ModelConfig:
    # A separate output matrix in the file is an untied head, whatever the config says; a bare
    # BartModel has no final_logits_bias. transformers 5 with tie_word_embeddings=False unties
    # the encoder's and decoder's tables too (and leaves `shared` unused).
    p = _prefix(names)
    own_tables = {f"{p}encoder.embed_tokens.weight", f"{p}decoder.embed_tokens.weight"} <= names
    return cfg.replace(
        share_embeddings=cfg.tie_embeddings or not own_tables,
        tie_embeddings="lm_head.weight" not in names,
        lm_head_bias="final_logits_bias" in names,
    )


def export_config(cfg: ModelConfig) -> ModelConfig:
    """The config as BART stores it: biases everywhere (a zero final_logits_bias if needed)."""
    problems = []
    if cfg.family != "seq2seq":
        problems.append(f"family={cfg.family!r} (need 'seq2seq')")
    if cfg.position != "learned" or cfg.position_offset != POSITION_OFFSET:
        problems.append(
            f"position={cfg.position!r}, position_offset={cfg.position_offset} (need learned "
            f"positions with offset {POSITION_OFFSET})"
        )
    if (cfg.norm, cfg.norm_position, cfg.norm_bias, cfg.embedding_norm) != (
        "layer",
        "post",
        True,
        True,
    ):
        problems.append("norms (need post-LayerNorm with bias and an embedding LayerNorm)")
    if cfg.ffn not in ACT_TO_HF:
        problems.append(f"ffn={cfg.ffn!r} (need one of {', '.join(ACT_TO_HF)})")
    if cfg.n_kv_heads != cfg.n_heads or cfg.head_dim * cfg.n_heads != cfg.d_model:
        problems.append("grouped heads or a custom head_dim")
    if not cfg.share_embeddings and cfg.tie_embeddings:
        problems.append(
            "separate encoder/decoder embeddings with a tied output (BART ties all or none)"
        )
    if cfg.attention_scale is not None or cfg.output_scale != 1.0:
        problems.append("a custom attention_scale or output_scale")
    if cfg.sliding_window is not None:
        problems.append(f"sliding_window={cfg.sliding_window}")
    if problems:
        raise InteropError(
            "this config has no Hugging Face BART equivalent: " + "; ".join(problems)
        )
    return cfg.replace(
        bias=True, qkv_bias=None, attn_out_bias=None, mlp_bias=None, lm_head_bias=True
    )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    export_config(cfg)  # raises for what BART cannot express
    scaled = bool(cfg.scale_embeddings)
    return {
        "model_type": "bart",
        "architectures": ["BartForConditionalGeneration"],
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "encoder_layers": cfg.n_encoder_layers or cfg.n_layers,
        "decoder_layers": cfg.n_layers,
        "encoder_attention_heads": cfg.n_heads,
        "decoder_attention_heads": cfg.n_heads,
        "encoder_ffn_dim": cfg.d_ff,
        "decoder_ffn_dim": cfg.d_ff,
        "activation_function": ACT_TO_HF[cfg.ffn],
        "max_position_embeddings": cfg.max_seq_len,
        "scale_embedding": scaled,
        "dropout": cfg.dropout,
        "attention_dropout": 0.0,
        "activation_dropout": 0.0,
        "init_std": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "decoder_start_token_id": cfg.decoder_start_token_id
        if cfg.decoder_start_token_id is not None
        else cfg.bos_token_id,
        # transformers' BartConfig would otherwise force eos at max length in generate
        "forced_eos_token_id": None,
        "is_encoder_decoder": True,
        "torch_dtype": "float32",
    }


# --- weights ----------------------------------------------------------------------------------


def _linear(target: str, source: str) -> list[WeightRule]:
    return [
        rename(f"{target}.weight", f"{source}.weight"),
        rename(f"{target}.bias", f"{source}.bias"),
    ]


def _fused_linear(target: str, sources: list[str], size: int) -> list[WeightRule]:
    sizes = [size] * len(sources)
    return [
        fused(f"{target}.weight", [f"{s}.weight" for s in sources], sizes),
        fused(f"{target}.bias", [f"{s}.bias" for s in sources], sizes),
    ]


def _layer(gf: str, hf: str, d_model: int, cross: bool) -> list[WeightRule]:
    attn = f"{hf}.self_attn"
    table = [
        *_fused_linear(f"{gf}.attn.qkv_proj", [f"{attn}.{p}_proj" for p in "qkv"], d_model),
        *_linear(f"{gf}.attn.out_proj", f"{attn}.out_proj"),
        *_linear(f"{gf}.attn_norm", f"{hf}.self_attn_layer_norm"),
        *_linear(f"{gf}.ffn.fc_in", f"{hf}.fc1"),
        *_linear(f"{gf}.ffn.fc_out", f"{hf}.fc2"),
        *_linear(f"{gf}.ffn_norm", f"{hf}.final_layer_norm"),
    ]
    if cross:
        enc = f"{hf}.encoder_attn"
        table += [
            *_linear(f"{gf}.cross_attn.q_proj", f"{enc}.q_proj"),
            *_fused_linear(f"{gf}.cross_attn.kv_proj", [f"{enc}.k_proj", f"{enc}.v_proj"], d_model),
            *_linear(f"{gf}.cross_attn.out_proj", f"{enc}.out_proj"),
            *_linear(f"{gf}.cross_norm", f"{hf}.encoder_attn_layer_norm"),
        ]
    return table


def _prefix(names: set[str]) -> str:
    bare = bool(names) and not any(n.startswith("model.") for n in names)  # a saved BartModel
    return "" if bare else "model."


def _copies(target: str, sources: list[str]) -> WeightRule:
    """One table read from the first source and written to all (aliases transformers reads)."""
    return WeightRule(target, sources, lambda ts: ts[0], lambda t: [t] * len(sources))


def _tables(cfg: ModelConfig, p: str, saving: bool) -> list[WeightRule]:
    shared, enc, dec = (
        f"{p}shared.weight",
        f"{p}encoder.embed_tokens.weight",
        f"{p}decoder.embed_tokens.weight",
    )
    if not cfg.share_embeddings:
        return [_copies("tok_emb.weight", [enc, shared]), rename("dec_tok_emb.weight", dec)]
    if saving and not cfg.tie_embeddings:
        # transformers 5 reads an untied BART's encoder and decoder tables from their own names
        return [_copies("tok_emb.weight", [shared, enc, dec])]
    return [rename("tok_emb.weight", shared)]


def rules(cfg: ModelConfig, names: set[str]) -> list[WeightRule]:
    p = _prefix(names)
    table = [
        *_tables(cfg, p, saving=not names),
        rename("enc_pos.weight", f"{p}encoder.embed_positions.weight"),
        rename("dec_pos.weight", f"{p}decoder.embed_positions.weight"),
        *_linear("enc_emb_norm", f"{p}encoder.layernorm_embedding"),
        *_linear("dec_emb_norm", f"{p}decoder.layernorm_embedding"),
    ]
    for i in range(cfg.n_encoder_layers or cfg.n_layers):
        table += _layer(f"encoder.{i}", f"{p}encoder.layers.{i}", cfg.d_model, cross=False)
    for i in range(cfg.n_layers):
        table += _layer(f"decoder.{i}", f"{p}decoder.layers.{i}", cfg.d_model, cross=True)
    # final_logits_bias is a (1, V) buffer added to the logits: the output projection's bias.
    if cfg.lm_head_bias:
        table.append(
            WeightRule(
                "lm_head.bias",
                ["final_logits_bias"],
                lambda ts: ts[0].reshape(-1),
                lambda t: [t[None]],
            )
        )
    if not cfg.tie_embeddings:
        table.append(rename("lm_head.weight", "lm_head.weight"))
    return table


def _ignorable(name: str) -> bool:
    # Aliases of the shared table that some savers write out.
    return name.endswith(("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"))


register(
    Architecture(
        model_types=("bart",),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        rules=rules,
        ignorable=_ignorable,
        refine_config=refine_config,
        export_config=export_config,
    )
)
