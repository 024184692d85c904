"""GPT-2 name table (GPT2LMHeadModel, GPT2Model): learned positions, pre-LayerNorm, a GELU MLP,
biases everywhere, tied embeddings (seed 000 §6.2).

GPT-2's Conv1D layers store weights as (in, out), so every matrix is transposed. c_attn is
already the fused [q | k | v] projection in glassformer's order. GPT2LMHeadModel prefixes its
tensors with `transformer.`; GPT2Model (and the original OpenAI export) does not.
"""

from __future__ import annotations

from typing import Any

from glassformer.config import ModelConfig
from glassformer.interop.hf import (
    Architecture,
    InteropError,
    WeightRule,
    register,
    rename,
    transposed,
)

# transformers' activation_function -> glassformer's dense FFN kind
ACTIVATIONS = {
    "gelu_new": "gelu_tanh",  # tanh approximation, written out in NewGELUActivation
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}
_EXPORT_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise InteropError(
            f"gpt2 activation_function={act!r} is not supported: supported are "
            f"{', '.join(ACTIVATIONS)}"
        )
    # transformers scales scores by 1/sqrt(head_dim) only with these two at their defaults;
    # glassformer's attention always uses 1/sqrt(head_dim).
    if not hf.get("scale_attn_weights", True):
        raise InteropError(
            "gpt2 scale_attn_weights=false (unscaled attention scores) is not supported: "
            "glassformer always scales scores by 1/sqrt(head_dim)"
        )
    if hf.get("scale_attn_by_inverse_layer_idx", False):
        raise InteropError(
            "gpt2 scale_attn_by_inverse_layer_idx=true is not supported: glassformer scales "
            "every layer's scores by 1/sqrt(head_dim) alone"
        )
    if hf.get("add_cross_attention", False):
        raise InteropError(
            "gpt2 add_cross_attention=true (a GPT-2 decoder with cross-attention) is not "
            "supported: only decoder-only GPT-2 checkpoints load"
        )
    # reorder_and_upcast_attn only changes where the scale is applied and computes scores in
    # float32; glassformer scores in float32 too, so it needs no switch.
    d_model = hf["n_embd"]
    return ModelConfig(
        family="gpt",
        vocab_size=hf["vocab_size"],
        d_model=d_model,
        n_layers=hf["n_layer"],
        n_heads=hf["n_head"],
        d_ff=hf.get("n_inner") or 4 * d_model,
        max_seq_len=hf.get("n_positions", hf.get("n_ctx", 1024)),
        position="learned",
        norm="layer",
        norm_position="pre",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        norm_bias=True,
        ffn=ACTIVATIONS[act],
        bias=True,
        tie_embeddings=hf.get("tie_word_embeddings", True),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
    )


def export_config(cfg: ModelConfig) -> ModelConfig:
    """The config GPT-2 stores for `cfg`, or an InteropError naming what GPT-2 cannot express.

    GPT-2 always has biases: a glassformer model without them is written with zero biases,
    which computes the same thing."""
    wants = {
        "family": ("gpt", cfg.family),
        "position": ("learned", cfg.position),
        "norm": ("layer", cfg.norm),
        "norm_position": ("pre", cfg.norm_position),
        "residual": (True, cfg.residual),
        "n_kv_heads": (cfg.n_heads, cfg.n_kv_heads),
        "head_dim": (cfg.d_model // cfg.n_heads, cfg.head_dim),
        "sliding_window": (None, cfg.sliding_window),
    }
    for name, (needed, value) in wants.items():
        if value != needed:
            raise InteropError(
                f"GPT-2 cannot express {name}={value!r} (it needs {needed!r}); no Hugging Face "
                "architecture glassformer writes has this combination: keep the model in "
                "glassformer's own checkpoint format"
            )
    if cfg.ffn not in _EXPORT_ACTIVATIONS:
        raise InteropError(
            f"GPT-2 cannot express ffn={cfg.ffn!r}: its MLP is one of "
            f"{', '.join(_EXPORT_ACTIVATIONS)} (gated FFNs export as llama: position='rope', "
            "norm='rms')"
        )
    return cfg.replace(bias=True, qkv_bias=None, attn_out_bias=None, mlp_bias=None, norm_bias=True)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.d_ff,
        "n_positions": cfg.max_seq_len,
        "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": _EXPORT_ACTIVATIONS[cfg.ffn],
        "attn_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "resid_pdrop": cfg.dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": "float32",
    }


def _prefix(names: set[str]) -> str:
    # Saving (no names) writes GPT2LMHeadModel's layout; loading follows the checkpoint.
    if not names or any(n.startswith("transformer.") for n in names):
        return "transformer."
    return ""


def rules(cfg: ModelConfig, names: set[str]) -> list[WeightRule]:
    p = _prefix(names)
    table = [
        rename("tok_emb.weight", f"{p}wte.weight"),
        rename("pos_emb.weight", f"{p}wpe.weight"),
    ]
    layers = {  # glassformer module -> (GPT-2 module, Conv1D?)
        "attn_norm": ("ln_1", False),
        "attn.qkv_proj": ("attn.c_attn", True),
        "attn.out_proj": ("attn.c_proj", True),
        "ffn_norm": ("ln_2", False),
        "ffn.fc_in": ("mlp.c_fc", True),
        "ffn.fc_out": ("mlp.c_proj", True),
    }
    for i in range(cfg.n_layers):
        for gf, (hf, conv) in layers.items():
            gf_name, hf_name = f"blocks.{i}.{gf}", f"{p}h.{i}.{hf}"
            weight = transposed if conv else rename
            table.append(weight(f"{gf_name}.weight", f"{hf_name}.weight"))
            table.append(rename(f"{gf_name}.bias", f"{hf_name}.bias"))
    table += [rename(f"final_norm.{t}", f"{p}ln_f.{t}") for t in ("weight", "bias")]
    if not cfg.tie_embeddings:
        table.append(rename("lm_head.weight", "lm_head.weight"))
    return table


def _ignorable(name: str) -> bool:
    # attn.bias / attn.masked_bias are the causal-mask buffers older checkpoints saved; a tied
    # model may still store its lm_head (a copy of wte).
    return name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight"


register(
    Architecture(
        model_types=("gpt2",),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        rules=rules,
        ignorable=_ignorable,
        export_config=export_config,
    )
)
