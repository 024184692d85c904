"""Training memory and inference cost of a GPT-style config (seed 000 §2.3: "activation memory
grows with B × T × d × layers"; seed 002's prefill vs decode): what `glassformer calc memory` and
`glassformer calc cost` print, and the quick matmul / memory-read peaks the cost is timed at.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from glassformer.calc.formulas import attention_width, flops_per_token, kv_cache_bytes
from glassformer.calc.parameters import _meta_model, parameter_counts, parameter_rows
from glassformer.calc.render import format_bytes, format_count, format_flop_count
from glassformer.config import ModelConfig

TRAIN_DTYPES = ("fp32", "bf16")  # bf16: autocast over fp32 weights, as the trainer runs it
OPTIMIZERS = ("adamw", "sgd")
FP32 = 4


def _check_gpt(cfg: object, what: str) -> ModelConfig:
    if not isinstance(cfg, ModelConfig) or cfg.family != "gpt":
        family = getattr(cfg, "family", "?") if isinstance(cfg, ModelConfig) else cfg.name
        raise ValueError(
            f"calc {what} counts decoder-only (family='gpt') models, not {family!r}: pick a "
            "gpt-style preset such as smollm2-135m, gpt2-124m or llama-7b"
        )
    return cfg


def _check_positive(**sizes: int) -> None:
    for name, value in sizes.items():
        if value < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{name}={value} must be >= 1: pass {flag} 1 or more")


def check_cost_inputs(prompt_tokens: int, new_tokens: int, batch: int, dtype: str) -> None:
    """Refuse a bad count or dtype before anything is measured."""
    _check_positive(prompt_tokens=prompt_tokens, new_tokens=new_tokens, batch=batch)
    _check_choice("dtype", dtype, TRAIN_DTYPES)


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not known: pick one of {', '.join(allowed)}")


# --- training memory --------------------------------------------------------------------------


@dataclass
class Term:
    """One line of the activation bill: `elements` numbers of `bytes_each` bytes, per token
    (per layer when `per_layer`)."""

    name: str
    elements: int
    bytes_each: int
    per_layer: bool = True


def activation_terms(cfg: ModelConfig, seq_len: int, dtype: str = "fp32") -> list[Term]:
    """The tensors autograd saves for backward, per token, for a pre-norm block and the head.

    Per layer (C d_model, H heads, Hkv kv heads, D head_dim, F d_ff, T seq_len):
      norm inputs     2 x C      the residual stream entering each of the two norms (fp32 under
                                 autocast: the stream stays in the weights' dtype)
      norm outputs    2 x C      what the QKV and FFN matmuls read
      RMSNorm         2 x C      the normalized x its gain multiplies (fp32 under autocast)
      Q, K, V         (H + 2 Hkv) D   the projection's output, read by attention
      RoPE q, k       (H + Hkv) D     the rotated copies (rope only)
      scores          eager: H x T softmax probabilities per token (the T² term; under
                      autocast fp32 + a bf16 copy); sdpa: H logsumexps (fp32), the kernel
                      recomputes the scores in backward
      attn output     H x D      what W_O reads
      MLP             2 x F (pre- and post-activation) or 4 x F gated (gate+up, act(gate),
                      product); MoE: top-k experts' worth plus the E router logits
    Head: the final norm's input and output (2C, +C RMSNorm) and the loss's log-softmax, V per
    token in fp32 (the loss upcasts the logits). Left out as small: norm statistics (1-2 fp32
    per token per norm), token ids, the mask and RoPE tables. Dropout > 0 adds a mask per
    dropout. Times B x T tokens and (per layer) n_layers: seed 000 §2.3's B x T x d x layers.
    """
    _check_choice("dtype", dtype, TRAIN_DTYPES)
    act = 2 if dtype == "bf16" else FP32
    C, H, Hkv, D, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    fp32_under_autocast = FP32 if dtype == "bf16" else act  # autocast runs these in fp32
    window = min(seq_len, cfg.sliding_window or seq_len)
    terms = [
        Term("norm inputs (residual stream)", 2 * C, fp32_under_autocast),
        Term("norm outputs (QKV and MLP input)", 2 * C, act),
    ]
    if cfg.norm == "rms":
        terms.append(Term("RMSNorm pre-gain x", 2 * C, fp32_under_autocast))
    terms.append(Term("Q, K, V", (H + 2 * Hkv) * D, act))
    if cfg.position == "rope":
        terms.append(Term("RoPE-rotated q, k", (H + Hkv) * D, act))
    if cfg.attention_backend == "eager":
        # under autocast softmax keeps its fp32 output and AV matmul a bf16 copy: 6 bytes
        probs = FP32 + 2 if dtype == "bf16" else act
        terms.append(Term(f"softmax probabilities (eager, H x {window} keys)", H * window, probs))
    else:
        terms.append(Term("logsumexp (sdpa recomputes the scores)", H, FP32))
    terms.append(Term("attention output (W_O input)", H * D, act))
    gated = (cfg.moe_expert_ffn if cfg.ffn == "moe" else cfg.ffn) in (
        "swiglu",
        "geglu",
        "geglu_tanh",
    )
    mlp = (4 if gated else 2) * F
    if cfg.ffn == "moe":
        k = cfg.n_experts_per_token
        terms.append(Term(f"MoE: top-{k} experts' MLP", k * mlp, act))
        terms.append(Term("MoE router logits", cfg.n_experts, FP32))
    else:
        what = "gate+up, act(gate), product" if gated else "pre- and post-activation"
        terms.append(Term(f"MLP ({what})", mlp, act))
    head_norm = (3 if cfg.norm == "rms" else 2) * C  # input, (pre-gain x,) output
    terms.append(Term("final norm input and output", head_norm, act, per_layer=False))
    terms.append(Term("log-softmax of the logits (fp32)", cfg.vocab_size, FP32, per_layer=False))
    return terms


def _bytes(terms: list[Term], tokens: int, layers: int) -> int:
    return sum(t.elements * t.bytes_each * tokens * (layers if t.per_layer else 1) for t in terms)


def activation_bytes(
    cfg: ModelConfig, batch: int, seq_len: int, dtype: str = "fp32", checkpointing: bool = False
) -> int:
    """Bytes autograd holds at the end of a training forward (activation_terms x B x T).

    With activation checkpointing each layer keeps only its input, one (B, T, C) tensor, and
    backward recomputes one layer at a time: n_layers x B x T x C + one layer's activations."""
    _check_positive(batch=batch, seq_len=seq_len)
    cfg = _check_gpt(cfg, "memory")
    terms = activation_terms(cfg, seq_len, dtype)
    tokens = batch * seq_len
    if not checkpointing:
        return _bytes(terms, tokens, cfg.n_layers)
    stream = FP32  # the residual stream's dtype, under autocast too
    return cfg.n_layers * tokens * cfg.d_model * stream + _bytes(terms, tokens, 1)


def parameter_tensor_count(cfg: ModelConfig) -> int:
    """How many parameter tensors the model has (tied weights once): AdamW keeps a step per."""
    return sum(1 for _ in _meta_model(cfg).parameters())


def _matmul_weights(cfg: ModelConfig) -> int:
    # every Linear weight (a tied head is the embedding, multiplied: one copy); MoE: all experts
    return sum(r.count if r.component == "ffn" else r.matmul for r in parameter_rows(cfg))


def training_memory(
    cfg: ModelConfig,
    batch: int,
    seq_len: int,
    dtype: str = "fp32",
    optimizer: str = "adamw",
    checkpointing: bool = False,
) -> dict[str, int]:
    """Bytes of training: parameters, gradients, optimizer state, bf16 copies, activations, total.

    Weights, gradients and optimizer state are fp32 in both dtypes (bf16 means autocast: the
    matmuls run in bf16 on the fly, the fp32 master weights are what the optimizer updates);
    autocast holds a bf16 copy of every matmul weight until backward ("bf16 copies", 2 B each).
    AdamW: exp_avg and exp_avg_sq, 2 x fp32 per parameter, plus a 0-dim fp32 step per tensor;
    SGD without momentum keeps nothing."""
    cfg = _check_gpt(cfg, "memory")
    _check_choice("dtype", dtype, TRAIN_DTYPES)
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    n = parameter_counts(cfg)["total"]
    state = 2 * FP32 * n + FP32 * parameter_tensor_count(cfg) if optimizer == "adamw" else 0
    out = {
        "parameters": FP32 * n,
        "gradients": FP32 * n,
        "optimizer": state,
        "bf16 copies": 2 * _matmul_weights(cfg) if dtype == "bf16" else 0,
        "activations": activation_bytes(cfg, batch, seq_len, dtype, checkpointing),
    }
    out["total"] = sum(out.values())
    return out


def format_training_memory(
    cfg: ModelConfig,
    name: str,
    batch: int,
    seq_len: int,
    dtype: str = "fp32",
    optimizer: str = "adamw",
    checkpointing: bool = False,
) -> str:
    """The training-memory bill: the four parts, then the activations term by term."""
    mem = training_memory(cfg, batch, seq_len, dtype, optimizer, checkpointing)
    other = training_memory(cfg, batch, seq_len, dtype, optimizer, not checkpointing)
    n, tokens, L = parameter_counts(cfg)["total"], batch * seq_len, cfg.n_layers
    opt = "none (plain SGD, no momentum)"
    if optimizer == "adamw":
        opt = "2 x fp32 moments (exp_avg, exp_avg_sq) + a step per tensor"
    ckpt = "with" if checkpointing else "without"
    lines = [
        f"training memory of {name}: batch {batch} x seq_len {seq_len} = {tokens:,} tokens, "
        f"{dtype}, {optimizer}, {ckpt} activation checkpointing",
        f"  {format_count(n)} parameters | {L} layers | d_model {cfg.d_model} | {cfg.n_heads} "
        f"heads | vocab {cfg.vocab_size} | attention {cfg.attention_backend}",
        "",
        f"  {'parameters':<12}{format_bytes(mem['parameters']):>12}  fp32, 4 B x {n:,}",
        f"  {'gradients':<12}{format_bytes(mem['gradients']):>12}  fp32, one per parameter",
        f"  {'optimizer':<12}{format_bytes(mem['optimizer']):>12}  {opt}",
        f"  {'activations':<12}{format_bytes(mem['activations']):>12}  "
        f"{'checkpointed: ' if checkpointing else ''}saved for backward (below)",
        f"  {'total':<12}{format_bytes(mem['total']):>12}  "
        f"({'without' if checkpointing else 'with'} checkpointing: {format_bytes(other['total'])})",
    ]
    if dtype == "bf16":
        copies = f"  {'bf16 copies':<12}{format_bytes(mem['bf16 copies']):>12}  of matmul weights"
        lines.insert(-2, copies)
        lines.append(
            "  bf16 = autocast: weights, gradients and AdamW moments stay fp32; activations are "
            "saved in bf16 except the residual stream, RMSNorm's pre-gain x, logsumexps, eager "
            "softmax (fp32 + a bf16 copy) and the loss's log-softmax"
        )
    lines += _activation_lines(cfg, batch, seq_len, dtype, checkpointing)
    return "\n".join(lines)


def _activation_lines(
    cfg: ModelConfig, batch: int, seq_len: int, dtype: str, checkpointing: bool
) -> list[str]:
    terms, tokens, L = activation_terms(cfg, seq_len, dtype), batch * seq_len, cfg.n_layers
    width = max(len(t.name) for t in terms) + 2
    lines = [
        "",
        "activations (seed 000 §2.3: they grow with B x T x d x layers), per token:",
        f"  {'saved tensor':<{width}}{'numbers':>9}{'bytes':>7}{'x layers x B x T':>20}",
    ]
    for t in terms:
        total = t.elements * t.bytes_each * tokens * (L if t.per_layer else 1)
        scope = f"x {L} x {tokens:,}" if t.per_layer else f"x {tokens:,}"
        lines.append(
            f"  {t.name:<{width}}{t.elements:>9,}{t.bytes_each:>7}"
            f"{format_bytes(total):>12}  {scope}"
        )
    plain = activation_bytes(cfg, batch, seq_len, dtype, False)
    kept = activation_bytes(cfg, batch, seq_len, dtype, True)
    lines += [
        f"  {'all':<{width}}{'':>16}{format_bytes(plain):>12}",
        f"checkpointing keeps {L} x (B, T, C) fp32 layer inputs + one layer recomputed at a "
        f"time: {format_bytes(kept)} ({plain / kept:.1f}x less"
        + (", in use" if checkpointing else "; --checkpointing")
        + ")",
    ]
    return lines


# --- inference cost ---------------------------------------------------------------------------


def _head_matmul(cfg: ModelConfig) -> int:
    return sum(r.matmul for r in parameter_rows(cfg) if r.component == "lm_head")


def prefill_flops(cfg: ModelConfig, prompt_tokens: int, batch: int = 1) -> int:
    """FLOPs of the prefill forward as the engine runs it (logits of the last position only):
    B x (P x 2 x body matmul weights + 2 x V x C + 4 x layers x P² x H x D). Attention counts
    the full P x P square, as the kernels and torch's FLOP counter do."""
    cfg = _check_gpt(cfg, "cost")
    _check_positive(prompt_tokens=prompt_tokens, batch=batch)
    per_token = flops_per_token(cfg, prompt_tokens)
    head = 2 * _head_matmul(cfg)
    return batch * (prompt_tokens * (per_token["forward"] - head) + head)


def decode_flops(cfg: ModelConfig, prompt_tokens: int, new_tokens: int, batch: int = 1) -> int:
    """FLOPs of decoding new_tokens one at a time: each is 2N matmul FLOPs plus attention over
    the keys cached so far (P + 1 for the first, up to P + N)."""
    cfg = _check_gpt(cfg, "cost")
    _check_positive(prompt_tokens=prompt_tokens, new_tokens=new_tokens, batch=batch)
    matmul = flops_per_token(cfg, 1)["matmul"]
    layers, qk, v = attention_width(cfg)
    attention_per_key = 2 * layers * (qk + v)  # QK^T and AV for one query and one key
    window = cfg.sliding_window or prompt_tokens + new_tokens
    keys = sum(min(t, window) for t in range(prompt_tokens + 1, prompt_tokens + new_tokens + 1))
    return batch * (new_tokens * matmul + attention_per_key * keys)


def decode_step_bytes(cfg: ModelConfig, context: int, dtype: str = "bf16", batch: int = 1) -> int:
    """Bytes one decode step reads: every weight once (MoE: the active ones) and the whole KV
    cache of `context` positions for each of the batch's sequences."""
    cfg = _check_gpt(cfg, "cost")
    _check_choice("dtype", dtype, TRAIN_DTYPES)
    weights = parameter_counts(cfg)["active"] * (2 if dtype == "bf16" else FP32)
    return weights + kv_cache_bytes(cfg, context, dtype, batch)


def measure_peaks(seconds: float = 1.0, dtype: str = "fp32") -> tuple[float, float]:
    """(matmul GFLOP/s, memory-read GB/s) of this machine's CPU: the best of a few short
    repeats of a 1024² matmul and of summing a 256 MB tensor, about `seconds` in all."""
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    a = torch.randn(1024, 1024, dtype=torch_dtype)
    big = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB: larger than any cache
    best_mm, best_read, deadline = 0.0, 0.0, time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        a @ a
        best_mm = max(best_mm, 2 * 1024**3 / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        big.sum()
        best_read = max(best_read, big.numel() * 4 / (time.perf_counter() - start) / 1e9)
        if time.perf_counter() > deadline:
            return best_mm, best_read


def format_cost(
    cfg: ModelConfig,
    name: str,
    prompt_tokens: int,
    new_tokens: int,
    batch: int,
    gflops: float,
    gbps: float,
    dtype: str = "bf16",
) -> str:
    """Prefill (compute-bound) + decode (memory-bound) FLOPs, bytes and seconds."""
    pre = prefill_flops(cfg, prompt_tokens, batch)
    dec = decode_flops(cfg, prompt_tokens, new_tokens, batch)
    first = decode_step_bytes(cfg, prompt_tokens + 1, dtype, batch)
    last = decode_step_bytes(cfg, prompt_tokens + new_tokens, dtype, batch)
    weights = decode_step_bytes(cfg, 0, dtype, batch)
    prefill_s = pre / (gflops * 1e9)
    mean_step = (first + last) / 2  # the KV cache grows linearly from first to last
    memory_s, compute_s = mean_step / (gbps * 1e9), dec / new_tokens / (gflops * 1e9)
    step_s = max(memory_s, compute_s)  # a large batch can make decode compute-bound too
    bound = "memory-bound: bytes / read peak" if memory_s >= compute_s else "compute-bound"
    decode_s = new_tokens * step_s
    matmul_weights = flops_per_token(cfg, 1)["matmul_weights"]
    return "\n".join(
        [
            f"inference cost of {name}: batch {batch}, {prompt_tokens:,} prompt + "
            f"{new_tokens:,} new tokens, weights and KV cache in {dtype}",
            f"  this machine (measured): matmul {gflops:,.1f} GFLOP/s, memory read "
            f"{gbps:,.1f} GB/s",
            "",
            f"  prefill FLOPs   {format_flop_count(pre):>14}  B x (P x 2N + 4 x layers x P² x "
            "H x D), logits of the last position only",
            f"  decode FLOPs    {format_flop_count(dec):>14}  per token 2 x "
            f"{format_count(matmul_weights)} matmul weights + attention over the cache",
            f"  bytes per step  {format_bytes(first):>14}  first step: weights "
            f"{format_bytes(weights)} + KV cache of {prompt_tokens + 1:,} positions",
            f"                  {format_bytes(last):>14}  last step: KV cache of "
            f"{prompt_tokens + new_tokens:,} positions",
            "",
            f"  prefill         {prefill_s:>12.4f} s  compute-bound: FLOPs / matmul peak",
            f"  decode / token  {step_s * 1000:>12.3f} ms {bound} "
            f"({1 / step_s:,.1f} tokens/s per sequence)",
            f"  decode          {decode_s:>12.4f} s  {new_tokens:,} steps",
            f"  total           {prefill_s + decode_s:>12.4f} s  (seed 002: prefill is "
            "compute-bound, decode memory-bound)",
        ]
    )
