"""GGUF files (llama.cpp's one-file format): the metadata becomes a ModelConfig and a tokenizer
with its chat template, and the (often quantized) tensors become float32 weights under
glassformer's names through the same strict name table machinery as Hugging Face folders.

Seed 002's point that a model is its numbers: a 4-bit file holds the same Transformer, each
weight stored as a small integer times a per-block scale; dequantizing gives the float back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from glassformer.config import ConfigError, ModelConfig
from glassformer.interop.gguf_file import (
    GGUFFile,
    LazyTensor,
    LazyTensors,
    dequantizing,
    read_gguf,
)
from glassformer.interop.hf import (
    InteropError,
    WeightRule,
    check_tensor_names,
    load_state,
    rename,
)
from glassformer.interop.integrity import (
    clip,
    count_values,
    memory_problem,
    oversized_claim,
)
from glassformer.models.gpt import GPT
from glassformer.tokenizers import PretrainedTokenizer

# llama.cpp's "llama" rotates adjacent pairs (2i, 2i+1), so its converter permutes the q/k rows
# of every Llama-layout model (Mistral files are "llama" too); "qwen2" and "qwen3" rotate
# (i, i + D/2) like Hugging Face and glassformer, and their rows are stored unpermuted.
SUPPORTED_ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False}  # -> q/k permuted

# llama.cpp's names for the token types of tokenizer.ggml.token_type
_CONTROL, _USER_DEFINED = 3, 4


# --- config -----------------------------------------------------------------------------------


def check_architecture(file: GGUFFile) -> None:
    if file.architecture not in SUPPORTED_ARCHITECTURES:
        raise InteropError(
            f"{file.path}: GGUF architecture {file.architecture!r} is not supported: supported "
            f"are {', '.join(SUPPORTED_ARCHITECTURES)} (Mistral files are 'llama')"
        )


def _rope_scaling(file: GGUFFile) -> dict[str, Any] | None:
    kind = file.arch_key("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise InteropError(
            f"{file.path}: rope scaling type {kind!r} is not supported: supported are none, "
            "linear, yarn"
        )
    scaling: dict[str, Any] = {"type": kind, "factor": file.number("rope.scaling.factor")}
    original = file.count("rope.scaling.original_context_length", default=None)
    if kind == "yarn" and original is not None:
        scaling["original_max_seq_len"] = original
    return scaling


def config_from_gguf(file: GGUFFile) -> ModelConfig:
    """A ModelConfig from the metadata (and which tensors exist: biases, a separate lm_head)."""
    check_architecture(file)
    names = set(file.tensors)
    tokens = file.strings("tokenizer.ggml.tokens")
    d_model = file.count("embedding_length")
    n_heads = file.count("attention.head_count")
    head_dim = file.count("attention.key_length", default=d_model // n_heads)
    rotary_dims = file.count("rope.dimension_count", default=head_dim)
    if rotary_dims != head_dim:
        raise InteropError(
            f"{file.path}: RoPE rotates {rotary_dims} of {head_dim} head dims; glassformer "
            "rotates whole heads only (partial rotary is not supported)"
        )
    if file.arch_key("expert_count"):
        raise InteropError(
            f"{file.path}: Mixture-of-Experts GGUF files ({file.arch_key('expert_count')} "
            "experts) are not supported yet; convert the Hugging Face folder instead"
        )
    vocab_size = len(tokens) if tokens else file.count("vocab_size")
    try:
        return ModelConfig(
            family="gpt",
            vocab_size=vocab_size,
            d_model=d_model,
            n_layers=file.count("block_count"),
            n_heads=n_heads,
            n_kv_heads=file.count("attention.head_count_kv", default=n_heads),
            head_dim=head_dim,
            d_ff=file.count("feed_forward_length"),
            max_seq_len=file.count("context_length", default=2048),
            position="rope",
            rope_theta=file.number("rope.freq_base", default=10000.0, above=1.0),
            rope_scaling=_rope_scaling(file),
            norm="rms",
            norm_eps=file.number("attention.layer_norm_rms_epsilon"),
            norm_bias=False,
            ffn="swiglu",
            bias=False,
            qkv_bias="blk.0.attn_q.bias" in names,
            attn_out_bias="blk.0.attn_output.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,  # Qwen3
            mlp_bias="blk.0.ffn_up.bias" in names,
            tie_embeddings="output.weight" not in names,
            bos_token_id=file.metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=file.metadata.get("tokenizer.ggml.eos_token_id"),
            pad_token_id=file.metadata.get("tokenizer.ggml.padding_token_id"),
        )
    except ConfigError as err:
        raise InteropError(f"{file.path}: the metadata gives an invalid model: {err}") from None


# --- weights ----------------------------------------------------------------------------------


def permute_rows(weight: Tensor, n_heads: int) -> Tensor:
    """llama.cpp's converter: within each head, rows (i, i + D/2) become rows (2i, 2i + 1)."""
    head_dim = weight.shape[0] // n_heads
    rest = weight.shape[1:]
    return weight.reshape(n_heads, 2, head_dim // 2, *rest).transpose(1, 2).reshape(weight.shape)


def unpermute_rows(weight: Tensor, n_heads: int) -> Tensor:
    """The inverse of `permute_rows`: adjacent row pairs back to (i, i + D/2) halves."""
    head_dim = weight.shape[0] // n_heads
    rest = weight.shape[1:]
    return weight.reshape(n_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


def _qkv_rule(target: str, sources: list[str], cfg: ModelConfig, permuted: bool) -> WeightRule:
    q_size, kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim

    def load(tensors: list[Tensor]) -> Tensor:
        q, k, v = tensors
        if permuted:
            # q has n_heads heads and k only n_kv_heads (GQA): each is permuted per own head.
            q, k = unpermute_rows(q, cfg.n_heads), unpermute_rows(k, cfg.n_kv_heads)
        return torch.cat((q, k, v), dim=0)

    def save(param: Tensor) -> list[Tensor]:
        q, k, v = param.split([q_size, kv_size, kv_size], dim=0)
        if permuted:
            q, k = permute_rows(q, cfg.n_heads), permute_rows(k, cfg.n_kv_heads)
        return [q, k, v]

    return WeightRule(target, sources, load, save)


def _gate_up_rule(target: str, sources: list[str], d_ff: int) -> WeightRule:
    return WeightRule(
        target, sources, lambda ts: torch.cat(ts, dim=0), lambda t: list(t.split(d_ff, dim=0))
    )


def rules(cfg: ModelConfig, permuted: bool) -> list[WeightRule]:
    """glassformer parameter <- GGUF tensor(s), for the Llama layout llama.cpp writes."""
    table = [rename("tok_emb.weight", "token_embd.weight")]
    for i in range(cfg.n_layers):
        blk, gf = f"blk.{i}", f"blocks.{i}"
        kinds = ["weight", "bias"] if cfg.has_bias("qkv") else ["weight"]
        for kind in kinds:
            sources = [f"{blk}.attn_{p}.{kind}" for p in "qkv"]
            table.append(_qkv_rule(f"{gf}.attn.qkv_proj.{kind}", sources, cfg, permuted))
        if cfg.qk_norm:
            for part in "qk":
                table.append(
                    rename(f"{gf}.attn.{part}_norm.weight", f"{blk}.attn_{part}_norm.weight")
                )
        table.append(rename(f"{gf}.attn.out_proj.weight", f"{blk}.attn_output.weight"))
        if cfg.has_bias("attn_out"):
            table.append(rename(f"{gf}.attn.out_proj.bias", f"{blk}.attn_output.bias"))
        table.append(rename(f"{gf}.attn_norm.weight", f"{blk}.attn_norm.weight"))
        table.append(rename(f"{gf}.ffn_norm.weight", f"{blk}.ffn_norm.weight"))
        for kind in ["weight", "bias"] if cfg.has_bias("mlp") else ["weight"]:
            sources = [f"{blk}.ffn_gate.{kind}", f"{blk}.ffn_up.{kind}"]
            table.append(_gate_up_rule(f"{gf}.ffn.gate_up.{kind}", sources, cfg.d_ff))
            table.append(rename(f"{gf}.ffn.down.{kind}", f"{blk}.ffn_down.{kind}"))
    table.append(rename("final_norm.weight", "output_norm.weight"))
    if not cfg.tie_embeddings:
        table.append(rename("lm_head.weight", "output.weight"))
    return table


def _ignorable(name: str) -> bool:
    # Old files carry precomputed rotary tables; glassformer computes its own.
    return name.endswith(".attn_rot_embd")


def _check_rope_freqs(file: GGUFFile) -> None:
    """Llama 3.1 files store their RoPE scaling as per-frequency factors in rope_freqs."""
    tensor = file.tensors.get("rope_freqs.weight")
    if tensor is not None and not torch.all(LazyTensor(tensor, str(file.path)).load() == 1.0):
        raise InteropError(
            f"{file.path} scales RoPE by per-frequency factors (rope_freqs.weight, as Llama 3.1 "
            "files do), which glassformer cannot express in its config; load the Hugging Face "
            "folder instead (its rope_scaling type llama3 is supported)"
        )


# --- tokenizer --------------------------------------------------------------------------------

# tokenizer.ggml.pre -> the split regex that llama.cpp applies before byte-level BPE
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    "gpt2": "gpt2",  # GPT-2's own split, built into ByteLevel
    "smollm": "digits",  # GPT-2's split after cutting every digit alone (StarCoder lineage)
    "starcoder": "digits",
    "refact": "digits",
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}


def _pre_tokenizer(kind: str | None, path: Path):
    from tokenizers import Regex, pre_tokenizers

    if kind is None:
        kind = "gpt2"  # files older than the tokenizer.ggml.pre key were GPT-2 style
    if not isinstance(kind, str) or kind not in PRE_TOKENIZERS:
        raise InteropError(
            f"{path}: tokenizer.ggml.pre={kind!r} is not supported: supported are "
            f"{', '.join(PRE_TOKENIZERS)}"
        )
    split = PRE_TOKENIZERS[kind]
    if split == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "digits":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def tokenizer_from_gguf(file: GGUFFile) -> PretrainedTokenizer:
    """The byte-level BPE tokenizer, special tokens and chat template the metadata describes."""
    from tokenizers import AddedToken, decoders, models, processors
    from tokenizers import Tokenizer as HFTokenizer

    meta = file.metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise InteropError(
            f"{file.path}: tokenizer.ggml.model={kind!r} is not supported: supported is 'gpt2' "
            "(byte-level BPE, as in SmolLM2, Llama 3, Qwen2)"
        )
    tokens = file.strings("tokenizer.ggml.tokens")
    if not tokens:
        raise InteropError(f"{file.path} has no tokenizer.ggml.tokens: the file is incomplete")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if not isinstance(types, list) or len(types) != len(tokens):
        kinds = f"{len(types)} token types" if isinstance(types, list) else f"types {clip(types)}"
        raise InteropError(f"{file.path}: {len(tokens)} tokens but {kinds}; the file is corrupt")
    merges = [tuple(m.split(" ", 1)) for m in file.strings("tokenizer.ggml.merges") or []]
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise InteropError(f"{file.path}: the token list repeats tokens; the file is corrupt")
    hf = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    hf.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"), file.path)
    hf.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) and user-defined ones are matched whole in text.
    typed = list(zip(tokens, types, strict=True))
    hf.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in typed if k == _CONTROL]
    )
    hf.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in typed if k == _USER_DEFINED]
    )

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        known = isinstance(token_id, int) and 0 <= token_id < len(tokens)
        return tokens[token_id] if known else None

    bos, eos = token("bos"), token("eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        prefix, suffix = ([f"{bos}:0"] if add_bos else []), ([f"{eos}:0"] if add_eos else [])
        specials = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        hf.post_processor = processors.TemplateProcessing(
            single=[*prefix, "$A:0", *suffix],
            pair=[*prefix, "$A:0", *suffix, "$B:1", *suffix],
            special_tokens=list(dict(specials).items()),
        )
    return PretrainedTokenizer(
        hf,
        bos_token=bos,
        eos_token=eos,
        pad_token=token("padding"),
        chat_template=_chat_template(file),
    )


def _chat_template(file: GGUFFile) -> str | None:
    template = file.metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise InteropError(
            f"{file.path}: tokenizer.chat_template={clip(template)} must be a string (a Jinja "
            "template): the file is damaged"
        )
    return template


# --- public entry point -----------------------------------------------------------------------


def load_gguf(path: str | Path) -> tuple[GPT, PretrainedTokenizer]:
    """A float32 glassformer GPT with the (dequantized) weights of a GGUF file, and its
    tokenizer. Strict: every tensor of the file is used and every parameter filled."""
    file = read_gguf(path)
    cfg = config_from_gguf(file)
    weights = {n: t for n, t in file.tensors.items() if n != "rope_freqs.weight"}
    tensors = LazyTensors(weights, str(file.path))
    table = _checked_rules(file, cfg, tensors)
    tokenizer = tokenizer_from_gguf(file)
    _check_rope_freqs(file)
    model = GPT(cfg)
    table = [dequantizing(rule) for rule in table]
    load_state(model, table, tensors, _ignorable, str(file.path))
    return model.eval(), tokenizer


def _checked_rules(file: GGUFFile, cfg: ModelConfig, tensors: LazyTensors) -> list[WeightRule]:
    """The name table, once the metadata's claims hold against the tensor headers, before a
    parameter is allocated: the size, every tensor the table reads, the memory it takes."""
    held = count_values(t.shape for t in tensors.values())
    problem = oversized_claim(cfg, held, f"the metadata of {file.path}", "its tensors")
    if problem:
        raise InteropError(problem)
    table = rules(cfg, permuted=SUPPORTED_ARCHITECTURES[file.architecture])
    check_tensor_names(table, tensors, _ignorable, str(file.path))
    problem = memory_problem(cfg, f"loading {file.path}")
    if problem:
        raise InteropError(problem)
    return table
