"""The calculators' printed tables (the `glassformer calc` subcommands and `glassformer info`):
seed 000 §2.1's parameter table, seed 002's KV-cache bill and the FLOPs per token, plus the
byte, count and FLOP formatters they share.
"""

from __future__ import annotations

from glassformer.calc.formulas import (
    DTYPE_BYTES,
    attention_width,
    flops_per_token,
    kv_bytes_per_token,
    kv_cache_bytes,
)
from glassformer.calc.parameters import AnyConfig, MLAMoEConfig, parameter_counts, parameter_rows
from glassformer.config import ModelConfig


def format_bytes(n_bytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= size:
            return f"{n_bytes / size:.2f} {unit}"
    return f"{n_bytes:.0f} B"


def format_bytes_decimal(n_bytes: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n_bytes >= size:
            return f"{n_bytes / size:.1f} {unit}"
    return f"{n_bytes:.0f} B"


def format_count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def format_flop_count(n: float) -> str:
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} FLOP"


def describe(cfg: AnyConfig) -> str:
    """One line of sizes: layers, widths, heads, vocabulary."""
    if isinstance(cfg, MLAMoEConfig):
        return (
            f"{cfg.n_layers} layers ({cfg.n_dense_layers} dense) | d_model {cfg.d_model} | "
            f"{cfg.n_heads} heads, MLA (q latent {cfg.q_lora_rank}, kv latent "
            f"{cfg.kv_lora_rank}) | {cfg.n_shared_experts} shared + {cfg.n_routed_experts} "
            f"routed experts, top-{cfg.n_experts_per_token} | vocab {cfg.vocab_size}"
        )
    layers = f"{cfg.n_layers} layers"
    if cfg.family == "seq2seq":
        layers = f"{cfg.n_encoder_layers or cfg.n_layers} encoder + {cfg.n_layers} decoder layers"
    if cfg.family == "rnn":
        return f"{layers} | {cfg.cell} | hidden {cfg.d_model} | vocab {cfg.vocab_size}"
    moe = f" | {cfg.n_experts} experts, top-{cfg.n_experts_per_token}" if cfg.ffn == "moe" else ""
    return (
        f"{layers} | d_model {cfg.d_model} | {cfg.n_heads} heads ({cfg.n_kv_heads} kv heads, "
        f"head_dim {cfg.head_dim}) | d_ff {cfg.d_ff}{moe} | vocab {cfg.vocab_size} | "
        f"context {cfg.max_seq_len}"
    )


def format_parameter_table(cfg: AnyConfig, name: str) -> str:
    """Seed 000 §2.1's table for a config: one row per kind of weight, per layer and in all."""
    if isinstance(cfg, ModelConfig) and cfg.family == "rnn":
        counts = parameter_counts(cfg)
        return format_component_table(counts["components"], cfg.n_layers, name, describe(cfg))
    rows = parameter_rows(cfg)
    counts = parameter_counts(cfg)
    total = counts["total"]
    source = (
        "count-only preset: glassformer cannot build MLA, so these are the closed-form rows"
        if isinstance(cfg, MLAMoEConfig)
        else "a ModelConfig: closed-form rows, equal to the model built on the meta device"
    )
    width = max(len(r.name) for r in rows) + 2
    lines = [
        f"{name}: {total:,} parameters ({format_count(total)})",
        f"  {describe(cfg)}",
        f"  ({source})",
        "",
        f"{'parameter':<{width}}{'per layer':>14}{'layers':>8}{'total':>17}{'share':>8}  shape",
    ]
    for row in rows:
        per_layer = "-" if row.per_layer is None else f"{row.per_layer:,}"
        layers = "-" if row.layers is None else str(row.layers)
        lines.append(
            f"{row.name:<{width}}{per_layer:>14}{layers:>8}{row.count:>17,}"
            f"{100 * row.count / total:>7.1f}%  {row.shape}"
        )
    lines.append(f"{'total':<{width}}{'':>14}{'':>8}{total:>17,}{100.0:>7.1f}%")
    lines.append("")
    if counts["active"] != total:
        lines += _active_lines(cfg, counts)
    if isinstance(cfg, MLAMoEConfig):
        lines.append(f"published: {cfg.published}")
    fp16, fp32 = format_bytes_decimal(total * 2), format_bytes_decimal(total * 4)
    lines.append(
        f'weights: {fp16} in fp16/bf16, {fp32} in fp32 (seed 000 §2.1: a 7B model is "about '
        '14GB in fp16")'
    )
    if _gated(cfg):
        lines.append(
            "note: seed 000 §2.1 draws the FFN as two matrices (W_in, W_out); a gated FFN "
            "(SwiGLU) has three: act(x W_gate) * (x W_up), then W_down"
        )
    return "\n".join(lines)


def _gated(cfg: AnyConfig) -> bool:
    if isinstance(cfg, MLAMoEConfig):
        return True  # DeepSeek's FFNs and experts are all SwiGLU
    return (cfg.moe_expert_ffn if cfg.ffn == "moe" else cfg.ffn) in (
        "swiglu",
        "geglu",
        "geglu_tanh",
    )


def _active_lines(cfg: AnyConfig, counts: dict) -> list[str]:
    total, active = counts["total"], counts["active"]
    k = cfg.n_experts_per_token
    n = cfg.n_routed_experts if isinstance(cfg, MLAMoEConfig) else cfg.n_experts
    lines = [
        f"active per token: {active:,} ({format_count(active)}, {100 * active / total:.1f}% of "
        f"{format_count(total)}): everything but the experts, plus the top-{k} of {n} experts",
        "  (seed 000 §2.5.3: knowledge scales with the total, inference cost with the active)",
    ]
    lookup = counts["components"].get("embedding", 0) if not cfg.tie_embeddings else 0
    if lookup:
        lines.append(
            f"  without the input embedding table (a lookup, not a matmul): "
            f"{active - lookup:,} ({format_count(active - lookup)})"
        )
    return lines


def format_component_table(table: dict[str, int], n_layers: int, name: str, about: str) -> str:
    """The parameter_table of a built model (e.g. a checkpoint), by component."""
    total = sum(table.values())
    lines = [f"{name}: {total:,} parameters ({format_count(total)})", f"  {about}", ""]
    lines.append(f"{'component':<14}{'per layer':>14}{'total':>17}{'share':>8}")
    for component, count in sorted(table.items(), key=lambda kv: -kv[1]):
        per_layer = "-"
        if component in ("attention", "ffn", "moe router", "recurrent"):
            per_layer = f"{count // n_layers:,}"
        lines.append(f"{component:<14}{per_layer:>14}{count:>17,}{100 * count / total:>7.1f}%")
    lines.append(f"{'total':<14}{'':>14}{total:>17,}{100.0:>7.1f}%")
    return "\n".join(lines)


def _kv_formula(cfg: AnyConfig, dtype: str) -> str:
    if isinstance(cfg, MLAMoEConfig):
        return (
            f"{cfg.n_layers} layers x ({cfg.kv_lora_rank} kv latent + {cfg.qk_rope_head_dim} "
            f"shared RoPE key) x {DTYPE_BYTES[dtype]} bytes (MLA caches the latent, not K and V)"
        )
    return (
        f"2 (K and V) x {cfg.n_layers} layers x {cfg.n_kv_heads} kv heads x {cfg.head_dim} "
        f"head_dim x {DTYPE_BYTES[dtype]} bytes"
    )


def _kv_variants(cfg: AnyConfig, tokens: int, window: int) -> list[tuple[str, AnyConfig | int]]:
    """(label, config) rows that show what GQA/MQA and a sliding window do to the cache."""
    if isinstance(cfg, MLAMoEConfig):
        return []
    variants: list[tuple[str, AnyConfig]] = []
    for n_kv, kind in ((cfg.n_heads, "MHA"), (8, "GQA"), (1, "MQA")):
        if cfg.n_heads % n_kv or (kind == "GQA" and n_kv >= cfg.n_heads):
            continue
        own = " (this model)" if n_kv == cfg.n_kv_heads else ""
        variants.append((f"{kind}, n_kv_heads={n_kv}{own}", cfg.replace(n_kv_heads=n_kv)))
    if not any(c.n_kv_heads == cfg.n_kv_heads for _, c in variants):
        variants.insert(0, (f"GQA, n_kv_heads={cfg.n_kv_heads} (this model)", cfg))
    if cfg.sliding_window is None and tokens > window:
        variants.append((f"sliding window of {window}", cfg.replace(sliding_window=window)))
    return variants


def format_kv_cache(
    cfg: AnyConfig,
    name: str,
    tokens: int,
    dtype: str = "fp16",
    batch_size: int = 1,
    window: int = 4096,
) -> str:
    """Seed 002's KV-cache bill: bytes per token, for `tokens` tokens, and what GQA, MQA and a
    sliding window would make of it."""
    per_token = kv_bytes_per_token(cfg, dtype)
    total = kv_cache_bytes(cfg, tokens, dtype, batch_size)
    lines = [
        f"KV cache of {name} in {dtype}: {_kv_formula(cfg, dtype)}",
        f"  per token: {per_token:,} bytes ({format_bytes(per_token)}; seed 002: about 0.5 MB "
        "for a 7B model in fp16)",
        f"  {tokens:,} tokens x batch {batch_size}: {total:,} bytes ({format_bytes(total)}; "
        "seed 002: about 2 GB for a 4096-token conversation)",
    ]
    if getattr(cfg, "sliding_window", None) is not None and tokens > cfg.sliding_window:
        lines.append(f"  (sliding window {cfg.sliding_window}: only the last window is kept)")
    if getattr(cfg, "family", "") == "seq2seq":
        lines.append("  (decoder self-attention; cross-attention adds the same per source token)")
    if isinstance(cfg, MLAMoEConfig):
        heads = cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
        plain = cfg.n_layers * heads * DTYPE_BYTES[dtype]
        lines.append(
            f"  without MLA (every head's K and V cached): {plain:,} bytes per token "
            f"({format_bytes(plain)}), {plain / per_token:.0f}x more"
        )
    variants = _kv_variants(cfg, tokens, window)
    if variants:
        width = max(len(label) for label, _ in variants) + 2
        lines += [
            "",
            "what MQA/GQA (seed 000 §4.2) and a sliding window change:",
            f"  {'variant':<{width}}{'kv heads':>9}{'window':>8}{'per token':>13}"
            f"{f'{tokens:,} tokens':>16}",
        ]
        for label, variant in variants:
            window_text = "-" if variant.sliding_window is None else str(variant.sliding_window)
            lines.append(
                f"  {label:<{width}}{variant.n_kv_heads:>9}{window_text:>8}"
                f"{format_bytes(kv_bytes_per_token(variant, dtype)):>13}"
                f"{format_bytes(kv_cache_bytes(variant, tokens, dtype, batch_size)):>16}"
            )
    return "\n".join(lines)


def format_flops(cfg: AnyConfig, name: str, context: int) -> str:
    """Forward and training FLOPs per token, and how the attention part grows with context."""
    flops = flops_per_token(cfg, context)
    layers, qk, v = attention_width(cfg)
    seen = context
    if getattr(cfg, "sliding_window", None) is not None:
        seen = min(context, cfg.sliding_window)
    width = f"{qk:,}" if qk == v else f"({qk:,} + {v:,}) / 2"
    parts = [
        (f"matmuls: 2 x {flops['matmul_weights']:,} weights a token multiplies", "matmul"),
        (f"attention QK^T and AV: 2 x 2 x {layers} layers x {seen:,} keys x {width}", "attention"),
    ]
    label = max(len(text) for text, _ in parts) + 2
    lines = [f"FLOPs per token of {name} at a context of {context:,} tokens (multiply-add = 2):"]
    for text, key in parts:
        share = 100 * flops[key] / flops["forward"]
        lines.append(f"  {text:<{label}}{format_flop_count(flops[key]):>14}{share:>7.1f}%")
    lines += [
        f"  {'forward':<{label}}{format_flop_count(flops['forward']):>14}",
        f"  {'training: 3 x forward (6N + attention, PaLM/nanoGPT)':<{label}}"
        f"{format_flop_count(flops['training']):>14}",
        "",
        "how the context changes it (seed 002: twice the text, four times the attention work):",
        f"  {'context':>9}{'forward/token':>16}{'attention share':>17}{'forward/sequence':>19}",
    ]
    for scale in (0.25, 0.5, 1, 2, 4):
        n = max(1, int(context * scale))
        row = flops_per_token(cfg, n)
        share = 100 * row["attention"] / row["forward"]
        per_token = format_flop_count(row["forward"])
        per_sequence = format_flop_count(row["forward"] * n)
        lines.append(f"  {n:>9,}{per_token:>16}{share:>16.1f}%{per_sequence:>19}")
    return "\n".join(lines)
