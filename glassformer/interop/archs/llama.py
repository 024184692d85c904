"""Llama-family name tables: Llama, Qwen2 (q/k/v biases), Qwen3 (per-head RMSNorm on q and k),
Mistral (sliding window) and Mixtral (Mixture-of-Experts). One layout, a few switches; HF stores
q/k/v and gate/up separately, glassformer fuses them."""

from __future__ import annotations

from typing import Any

from glassformer.config import ModelConfig
from glassformer.interop.hf import (
    Architecture,
    InteropError,
    WeightRule,
    fused,
    register,
    rename,
)

GATED_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu"}


# --- RoPE settings: transformers 4.x (rope_theta + rope_scaling) and 5.x (rope_parameters) ----


# transformers' default rope_theta per model_type when a config.json names none
_DEFAULT_THETA = {"mixtral": 1e6}


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # As in transformers 5: the 4.x `rope_scaling` dict, when present, replaces
    # `rope_parameters`; rope_theta comes from that dict, else the top level, else the default.
    merged = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    default_theta = _DEFAULT_THETA.get(hf.get("model_type", ""), 10000.0)
    theta = _number("rope_theta", merged.get("rope_theta") or hf.get("rope_theta") or default_theta)
    if theta <= 1:  # the frequencies theta**(-2i/D) must fall; YaRN divides by log(theta)
        raise InteropError(f"rope_theta={theta!r} must be > 1 (RoPE's base, usually 10000 or more)")
    partial = merged.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is not None and _number("partial_rotary_factor", partial) != 1.0:
        raise InteropError(
            f"partial_rotary_factor={partial} is not supported: glassformer's RoPE rotates the "
            "whole head (as transformers' Llama-family models do)"
        )
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ("linear", "dynamic", "yarn", "llama3"):
        raise InteropError(
            f"rope type {kind!r} is not supported: supported are default, linear, dynamic, "
            "yarn, llama3"
        )
    max_pos = hf.get("max_position_embeddings", 2048)
    original = merged.get("original_max_position_embeddings") or max_pos
    original = _number("original_max_position_embeddings", original, integer=True)
    factor = merged.get("factor")
    if factor is None and kind == "yarn":
        factor = max_pos / original  # transformers' YaRN derives it likewise
    if factor is None:
        raise InteropError(f"rope type {kind!r} needs a 'factor' in rope_parameters")
    out: dict[str, Any] = {"type": kind, "factor": float(_number("factor", factor))}
    if kind == "dynamic":
        # transformers measures dynamic NTK against max_position_embeddings itself.
        out["original_max_seq_len"] = max_pos
    elif kind in ("yarn", "llama3"):
        out["original_max_seq_len"] = original
    for key in (
        "low_freq_factor",
        "high_freq_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    ):
        if merged.get(key) is not None:
            out[key] = merged[key]
    return theta, out


def _number(key: str, value: Any, integer: bool = False) -> float:
    """A RoPE setting that must be a number (an integer), or an InteropError naming it."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        wanted = "an integer" if integer else "a number"
        raise InteropError(
            f"rope_parameters {key}={value!r} ({type(value).__name__}) must be {wanted}"
        )
    return value


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling is not None:
        scaling = dict(cfg.rope_scaling)
        params["rope_type"] = scaling.pop("type")
        original = scaling.pop("original_max_seq_len", None)
        if original is not None and params["rope_type"] in ("yarn", "llama3"):
            params["original_max_position_embeddings"] = original
        params.update(scaling)
    # Both spellings, so transformers 4.x and 5.x read the same thing.
    legacy = None if cfg.rope_scaling is None else {**params, "type": params["rope_type"]}
    return {"rope_parameters": params, "rope_theta": cfg.rope_theta, "rope_scaling": legacy}


# --- config -----------------------------------------------------------------------------------


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    model_type = hf["model_type"]
    act = hf.get("hidden_act", "silu")
    if act not in GATED_ACTIVATIONS:
        raise InteropError(
            f"hidden_act={act!r} is not supported for {model_type}: supported are "
            f"{', '.join(GATED_ACTIVATIONS)}"
        )
    theta, scaling = rope_from_hf(hf)
    n_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
    attention_bias = hf.get("attention_bias", False)
    fields: dict[str, Any] = dict(
        family="gpt",
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        d_ff=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        position="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        norm="rms",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        norm_bias=False,
        ffn=GATED_ACTIVATIONS[act],
        bias=False,
        qkv_bias=attention_bias or model_type == "qwen2",
        attn_out_bias=attention_bias,
        qk_norm=model_type == "qwen3",
        mlp_bias=hf.get("mlp_bias", False),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        bos_token_id=_first(hf.get("bos_token_id")),
        eos_token_id=_first(hf.get("eos_token_id")),
    )
    qwen = model_type in ("qwen2", "qwen3")
    window = _qwen2_window(hf) if qwen else hf.get("sliding_window")
    if window is not None:
        fields["sliding_window"] = int(window)
    if model_type == "mixtral":
        fields.update(
            ffn="moe",
            moe_expert_ffn=GATED_ACTIVATIONS[act],
            n_experts=hf["num_local_experts"],
            n_experts_per_token=hf["num_experts_per_tok"],
            moe_aux_loss_coef=hf.get("router_aux_loss_coef", 0.01),
        )
    return ModelConfig(**fields)


def _qwen2_window(hf: dict[str, Any]) -> int | None:
    """Qwen2 and Qwen3 slide their window only in layers >= max_window_layers (or as
    `layer_types` says);
    glassformer has one window for every layer, so a mix of the two cannot load."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    if window is None:
        return None
    n_layers = hf["num_hidden_layers"]
    first_sliding = hf.get("max_window_layers", 28)
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= first_sliding else "full_attention" for i in range(n_layers)
    ]
    sliding = [kind == "sliding_attention" for kind in types]
    if not any(sliding):
        return None
    if not all(sliding):
        raise InteropError(
            f"qwen with a sliding window in only some layers (layer_types={types}) is not "
            "supported: glassformer applies sliding_window to every layer"
        )
    return int(window)


def _first(value: Any) -> int | None:
    # eos_token_id may be a list (Llama 3); glassformer stops on the first.
    if isinstance(value, list):
        return value[0] if value else None
    return value


def config_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    act = "silu" if (cfg.moe_expert_ffn if cfg.ffn == "moe" else cfg.ffn) == "swiglu" else "gelu"
    hf: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [f"{_class_prefix(model_type)}ForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.d_ff,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_act": act,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "torch_dtype": "float32",
        **rope_to_hf(cfg),
    }
    if model_type == "llama":
        hf["attention_bias"] = cfg.has_bias("qkv")
        hf["mlp_bias"] = cfg.has_bias("mlp")
    if model_type == "qwen3":
        hf["attention_bias"] = cfg.has_bias("qkv")
    if model_type in ("mistral", "mixtral", "qwen2", "qwen3"):
        hf["sliding_window"] = cfg.sliding_window
    if model_type in ("qwen2", "qwen3"):
        # Qwen slides only from layer max_window_layers on: 0 means every layer.
        sliding = cfg.sliding_window is not None
        hf["use_sliding_window"] = sliding
        hf["max_window_layers"] = 0 if sliding else cfg.n_layers
        hf["layer_types"] = ["sliding_attention" if sliding else "full_attention"] * cfg.n_layers
    if cfg.rope_scaling is not None and cfg.rope_scaling["type"] == "dynamic":
        # transformers measures dynamic NTK against max_position_embeddings itself.
        hf["max_position_embeddings"] = int(
            cfg.rope_scaling.get("original_max_seq_len", cfg.max_seq_len)
        )
    if model_type == "mixtral":
        hf.update(
            num_local_experts=cfg.n_experts,
            num_experts_per_tok=cfg.n_experts_per_token,
            router_aux_loss_coef=cfg.moe_aux_loss_coef,
        )
    return hf


def export_config(cfg: ModelConfig, model_type: str) -> ModelConfig:
    """The config `model_type` stores for `cfg` (Llama's one attention_bias covers q/k/v and o;
    Qwen2 always has q/k/v biases: missing ones are written as zeros), or an InteropError
    naming the field this architecture cannot express."""
    gated = "swiglu or geglu"
    wants: dict[str, tuple[Any, Any]] = {
        "family": ("gpt", cfg.family),
        "position": ("rope", cfg.position),
        "norm": ("rms", cfg.norm),
        "norm_position": ("pre", cfg.norm_position),
        "residual": (True, cfg.residual),
        "qk_norm": (model_type == "qwen3", cfg.qk_norm),
    }
    if model_type == "mixtral":
        wants["ffn"] = ("moe", cfg.ffn)
        wants["moe_expert_ffn"] = (gated, _gated_or_value(cfg.moe_expert_ffn))
    else:
        wants["ffn"] = (gated, _gated_or_value(cfg.ffn))
    qkv, out, mlp = (cfg.has_bias(part) for part in ("qkv", "attn_out", "mlp"))
    if model_type == "llama":
        wants["sliding_window"] = (None, cfg.sliding_window)
        qkv = out = qkv or out
    elif model_type == "qwen3":  # one attention_bias for q/k/v and o; no MLP biases
        wants["mlp_bias"] = (False, mlp)
        qkv = out = qkv or out
    elif model_type == "qwen2":
        wants["attn_out_bias"] = (False, out)
        wants["mlp_bias"] = (False, mlp)
        qkv = True
    else:
        wants.update(qkv_bias=(False, qkv), attn_out_bias=(False, out), mlp_bias=(False, mlp))
    for name, (needed, value) in wants.items():
        if value != needed:
            raise InteropError(
                f"{model_type} cannot express {name}={value!r} (it needs {needed!r}): pick "
                "another model_type or keep the model in glassformer's own checkpoint format"
            )
    if (qkv, out, mlp) == tuple(cfg.has_bias(p) for p in ("qkv", "attn_out", "mlp")):
        return cfg
    return cfg.replace(qkv_bias=qkv, attn_out_bias=out, mlp_bias=mlp)


def _gated_or_value(ffn: str) -> str:
    return "swiglu or geglu" if ffn in ("swiglu", "geglu") else ffn


def _class_prefix(model_type: str) -> str:
    prefixes = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}
    return {**prefixes, "mixtral": "Mixtral"}[model_type]


# --- weights ----------------------------------------------------------------------------------


def rules(cfg: ModelConfig, names: set[str]) -> list[WeightRule]:
    q_size, kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    table = [rename("tok_emb.weight", "model.embed_tokens.weight")]
    for i in range(cfg.n_layers):
        hf, gf = f"model.layers.{i}", f"blocks.{i}"
        qkv = [f"{hf}.self_attn.{p}_proj" for p in "qkv"]
        table.append(
            fused(
                f"{gf}.attn.qkv_proj.weight",
                [f"{n}.weight" for n in qkv],
                [q_size, kv_size, kv_size],
            )
        )
        if cfg.has_bias("qkv"):
            table.append(
                fused(
                    f"{gf}.attn.qkv_proj.bias",
                    [f"{n}.bias" for n in qkv],
                    [q_size, kv_size, kv_size],
                )
            )
        if cfg.qk_norm:
            for part in "qk":
                name = f"self_attn.{part}_norm.weight"
                table.append(rename(f"{gf}.attn.{part}_norm.weight", f"{hf}.{name}"))
        table.append(rename(f"{gf}.attn.out_proj.weight", f"{hf}.self_attn.o_proj.weight"))
        if cfg.has_bias("attn_out"):
            table.append(rename(f"{gf}.attn.out_proj.bias", f"{hf}.self_attn.o_proj.bias"))
        table.append(rename(f"{gf}.attn_norm.weight", f"{hf}.input_layernorm.weight"))
        table.append(rename(f"{gf}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight"))
        if cfg.ffn == "moe":
            moe = f"{hf}.block_sparse_moe"
            table.append(rename(f"{gf}.ffn.router.weight", f"{moe}.gate.weight"))
            for e in range(cfg.n_experts):
                expert = f"{moe}.experts.{e}"
                table += _gated(
                    f"{gf}.ffn.experts.{e}", f"{expert}.w1", f"{expert}.w3", f"{expert}.w2", cfg
                )
        else:
            mlp = f"{hf}.mlp"
            table += _gated(
                f"{gf}.ffn", f"{mlp}.gate_proj", f"{mlp}.up_proj", f"{mlp}.down_proj", cfg
            )
    table.append(rename("final_norm.weight", "model.norm.weight"))
    if not cfg.tie_embeddings:
        table.append(rename("lm_head.weight", "lm_head.weight"))
    return table


def _gated(gf: str, gate: str, up: str, down: str, cfg: ModelConfig) -> list[WeightRule]:
    table = [
        fused(f"{gf}.gate_up.weight", [f"{gate}.weight", f"{up}.weight"], [cfg.d_ff, cfg.d_ff]),
        rename(f"{gf}.down.weight", f"{down}.weight"),
    ]
    if cfg.has_bias("mlp"):
        table += [
            fused(f"{gf}.gate_up.bias", [f"{gate}.bias", f"{up}.bias"], [cfg.d_ff, cfg.d_ff]),
            rename(f"{gf}.down.bias", f"{down}.bias"),
        ]
    return table


def _ignorable(name: str) -> bool:
    # Old checkpoints carry rotary caches; tied models may still store lm_head.weight.
    return name.endswith("rotary_emb.inv_freq") or name == "lm_head.weight"


for _model_type in ("llama", "qwen2", "qwen3", "mistral", "mixtral"):
    register(
        Architecture(
            model_types=(_model_type,),
            config_from_hf=config_from_hf,
            config_to_hf=lambda cfg, mt=_model_type: config_to_hf(cfg, mt),
            rules=rules,
            ignorable=_ignorable,
            export_config=lambda cfg, mt=_model_type: export_config(cfg, mt),
        )
    )
