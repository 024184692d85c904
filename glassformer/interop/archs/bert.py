"""BERT name table (seed 000 §6.3): BertModel (with or without its pooler), BertForMaskedLM,
BertForPreTraining (MLM + next-sentence heads) and BertForSequenceClassification.

HF stores query/key/value separately; glassformer fuses them into one qkv_proj. Which heads a
checkpoint holds is not in config.json (a BertModel saved without its pooler still says
"BertModel"), so `refine_config` reads it off the tensor names: a pooler if `pooler.dense` is
there, an MLM head if `cls.predictions.transform` is, an NSP head if `cls.seq_relationship` is,
a classifier if `classifier` is. Keys are bare (`embeddings.*`, a saved
BertModel) or prefixed `bert.` (BertForMaskedLM and the other task models).
"""

from __future__ import annotations

from typing import Any

from glassformer.config import ModelConfig
from glassformer.interop.hf import Architecture, InteropError, WeightRule, fused, register, rename

# transformers' hidden_act -> glassformer's ffn name (the tanh GELUs are one function)
ACT_FROM_HF = {
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}
# gelu_pytorch_tanh is exactly torch's tanh GELU (gelu_new differs in the last bits)
ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu", "silu": "silu"}

MLM = "cls.predictions"
NSP = "cls.seq_relationship"


# --- config -----------------------------------------------------------------------------------


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    act = hf.get("hidden_act", "gelu")
    if act not in ACT_FROM_HF:
        raise InteropError(
            f"hidden_act={act!r} is not supported for bert: supported are {', '.join(ACT_FROM_HF)}"
        )
    position_kind = hf.get("position_embedding_type", "absolute")
    if position_kind != "absolute":
        raise InteropError(
            f"position_embedding_type={position_kind!r} is not supported for bert: only "
            "'absolute' (learned position embeddings) is; relative_key variants add a distance "
            "embedding glassformer does not have"
        )
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise InteropError(
            "this BERT is configured as a decoder (is_decoder/add_cross_attention): only the "
            "bidirectional encoder (BertModel, BertForMaskedLM) is supported"
        )
    # A first guess from the class name; refine_config settles it from the tensors.
    architectures = hf.get("architectures") or ["BertModel"]
    n_labels = len(hf.get("id2label") or {0: "LABEL_0", 1: "LABEL_1"})
    return ModelConfig(
        family="bert",
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        d_ff=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 512),
        position="learned",
        type_vocab_size=hf.get("type_vocab_size", 2),
        norm="layer",
        norm_position="post",
        norm_eps=hf.get("layer_norm_eps", 1e-12),
        ffn=ACT_FROM_HF[act],
        bias=True,
        embedding_norm=True,
        pooler=bool({"BertModel", "BertForSequenceClassification"} & set(architectures)),
        mlm_head="BertForMaskedLM" in architectures,
        # num_labels is not saved; transformers derives it from id2label (default 2 labels)
        n_classes=n_labels if "BertForSequenceClassification" in architectures else 0,
        tie_embeddings=hf.get("tie_word_embeddings", True),
        pad_token_id=hf.get("pad_token_id"),
        init_std=hf.get("initializer_range", 0.02),
    )


def refine_config(cfg: ModelConfig, names: set[str]) -> ModelConfig:
    """The heads the checkpoint actually holds."""
    prefix = _prefix(names)
    return cfg.replace(
        pooler=f"{prefix}pooler.dense.weight" in names,
        mlm_head=f"{MLM}.transform.dense.weight" in names,
        nsp_head=f"{NSP}.weight" in names,
        n_classes=(cfg.n_classes or 2) if "classifier.weight" in names else 0,
    )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    ffn = cfg.ffn
    problems = []
    if cfg.family != "bert":
        problems.append(f"family={cfg.family!r} (need 'bert')")
    if cfg.position != "learned":
        problems.append(f"position={cfg.position!r} (need 'learned')")
    if (cfg.norm, cfg.norm_position, cfg.norm_bias) != ("layer", "post", True):
        problems.append(
            f"norm={cfg.norm!r}/{cfg.norm_position!r}/norm_bias={cfg.norm_bias} (need post "
            "LayerNorm with bias)"
        )
    if ffn not in ACT_TO_HF:
        problems.append(f"ffn={ffn!r} (need one of {', '.join(ACT_TO_HF)})")
    if cfg.n_kv_heads != cfg.n_heads or cfg.head_dim * cfg.n_heads != cfg.d_model:
        problems.append(
            "grouped heads or a custom head_dim (BERT has n_heads * head_dim = d_model)"
        )
    if not all(cfg.has_bias(part) for part in ("qkv", "attn_out", "mlp")):
        problems.append("linear layers without biases")
    if not cfg.embedding_norm or cfg.type_vocab_size < 1:
        problems.append("no embedding norm or no token types (type_vocab_size=0)")
    if cfg.sliding_window is not None:
        problems.append(f"sliding_window={cfg.sliding_window}")
    if cfg.n_classes and (cfg.mlm_head or cfg.nsp_head):
        problems.append("a classifier together with pretraining heads (no such transformers class)")
    if problems:
        raise InteropError(
            "this config has no Hugging Face BERT equivalent: " + "; ".join(problems)
        )
    labels = {"id2label": {str(i): f"LABEL_{i}" for i in range(cfg.n_classes)}}
    return {
        **(labels if cfg.n_classes else {}),
        "model_type": "bert",
        # With both heads this is BertForMaskedLM plus `bert.pooler.*`, which transformers'
        # BertForMaskedLM skips (glassformer reads both back).
        "architectures": [_architecture(cfg)],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "intermediate_size": cfg.d_ff,
        "hidden_act": ACT_TO_HF[ffn],
        "max_position_embeddings": cfg.max_seq_len,
        "type_vocab_size": cfg.type_vocab_size,
        "layer_norm_eps": cfg.norm_eps,
        "position_embedding_type": "absolute",
        "pad_token_id": cfg.pad_token_id if cfg.pad_token_id is not None else 0,
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.dropout,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": "float32",
    }


def _architecture(cfg: ModelConfig) -> str:
    if cfg.n_classes:
        return "BertForSequenceClassification"
    if cfg.nsp_head:
        return "BertForPreTraining"
    return "BertForMaskedLM" if cfg.mlm_head else "BertModel"


# --- weights ----------------------------------------------------------------------------------


def _prefix(names: set[str]) -> str:
    return "bert." if any(n.startswith("bert.") for n in names) else ""


def _linear(target: str, source: str) -> list[WeightRule]:
    return [
        rename(f"{target}.weight", f"{source}.weight"),
        rename(f"{target}.bias", f"{source}.bias"),
    ]


def rules(cfg: ModelConfig, names: set[str]) -> list[WeightRule]:
    # Saving (no names): the MLM layout is BertForMaskedLM's, prefixed; a bare encoder is
    # BertModel's, bare.
    prefix = _prefix(names) if names else ("" if _architecture(cfg) == "BertModel" else "bert.")
    emb = f"{prefix}embeddings"
    table = [
        rename("tok_emb.weight", f"{emb}.word_embeddings.weight"),
        rename("pos_emb.weight", f"{emb}.position_embeddings.weight"),
        rename("type_emb.weight", f"{emb}.token_type_embeddings.weight"),
        *_linear("emb_norm", f"{emb}.LayerNorm"),
    ]
    for i in range(cfg.n_layers):
        hf, gf = f"{prefix}encoder.layer.{i}", f"blocks.{i}"
        qkv = [f"{hf}.attention.self.{p}" for p in ("query", "key", "value")]
        sizes = [cfg.d_model] * 3
        table += [
            fused(f"{gf}.attn.qkv_proj.weight", [f"{n}.weight" for n in qkv], sizes),
            fused(f"{gf}.attn.qkv_proj.bias", [f"{n}.bias" for n in qkv], sizes),
            *_linear(f"{gf}.attn.out_proj", f"{hf}.attention.output.dense"),
            *_linear(f"{gf}.attn_norm", f"{hf}.attention.output.LayerNorm"),
            *_linear(f"{gf}.ffn.fc_in", f"{hf}.intermediate.dense"),
            *_linear(f"{gf}.ffn.fc_out", f"{hf}.output.dense"),
            *_linear(f"{gf}.ffn_norm", f"{hf}.output.LayerNorm"),
        ]
    if cfg.pooler:
        table += _linear("pooler.dense", f"{prefix}pooler.dense")
    if cfg.mlm_head:
        table += [
            *_linear("mlm_head.dense", f"{MLM}.transform.dense"),
            *_linear("mlm_head.norm", f"{MLM}.transform.LayerNorm"),
        ]
        table.append(_mlm_bias(names))
        if not cfg.tie_embeddings:
            table.append(rename("mlm_head.decoder.weight", f"{MLM}.decoder.weight"))
    if cfg.nsp_head:
        table += _linear("nsp_head", NSP)
    if cfg.n_classes:
        table += _linear("classifier", "classifier")
    return table


def _mlm_bias(names: set[str]) -> WeightRule:
    """The decoder's output bias. transformers ties `cls.predictions.decoder.bias` to
    `cls.predictions.bias` and files may hold either or both; untied (transformers 5 with
    tie_word_embeddings=False) only the decoder's is used. Read the decoder's when present;
    write both, so any transformers version finds the one it reads."""
    decoder_bias, head_bias = f"{MLM}.decoder.bias", f"{MLM}.bias"
    if not names:
        return WeightRule(
            "mlm_head.decoder.bias", [head_bias, decoder_bias], lambda ts: ts[0], lambda t: [t, t]
        )
    return rename("mlm_head.decoder.bias", decoder_bias if decoder_bias in names else head_bias)


def _ignorable(name: str) -> bool:
    # Index buffers (arange / zeros) and the aliases of tied tensors: the decoder's weight is
    # the word embedding when tied; of the two output biases the rules read one (_mlm_bias)
    # and the other is its copy or, untied, unused by transformers too. Whatever the rules
    # read is consumed, not ignored.
    return name.endswith(("embeddings.position_ids", "embeddings.token_type_ids")) or name in (
        f"{MLM}.decoder.weight",
        f"{MLM}.decoder.bias",
        f"{MLM}.bias",
    )


register(
    Architecture(
        model_types=("bert",),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        rules=rules,
        ignorable=_ignorable,
        refine_config=refine_config,
    )
)
