"""Seed 000 §4.2: MQA/GQA share keys and values between query heads, so the KV cache shrinks by
n_heads / n_kv_heads. Measured twice: from the calculator (glassformer.calc) and from caches
actually filled by a prefill of a random model, for n_kv_heads in {H, H/2, H/4, 1}.
"""

from __future__ import annotations

import torch

from glassformer import calc
from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.models import build_model

N_HEADS = 8
# Threshold: the shrink factor is a ratio of integers, so it must match exactly (to rounding).
RATIO_TOL = 1e-9


def _config(n_kv_heads: int, ctx: lab.RunContext) -> ModelConfig:
    return ModelConfig(
        family="gpt", vocab_size=256, d_model=ctx.pick(512, 256, 64), n_layers=ctx.pick(8, 4, 1),
        n_heads=N_HEADS, n_kv_heads=n_kv_heads, max_seq_len=1024, position="rope", norm="rms",
        ffn="swiglu",
    )  # fmt: skip


@torch.no_grad()
def filled_cache_bytes(cfg: ModelConfig, n_tokens: int, seed: int) -> tuple[int, int]:
    """(filled bytes, bytes per token) of a real cache after a prefill of n_tokens (fp32)."""
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    cache = model.new_cache(batch_size=1, max_seq_len=n_tokens)
    model(torch.randint(0, cfg.vocab_size, (1, n_tokens)), cache=cache, last_token_only=True)
    return cache.filled_bytes, cache.kv_bytes_per_token


@lab.register("gqa-cache")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    n_tokens = ctx.pick(512, 256, 16)
    rows, checks = [], []
    mha_calc = mha_filled = None
    for n_kv in (N_HEADS, N_HEADS // 2, N_HEADS // 4, 1):
        cfg = _config(n_kv, ctx)
        from_calc = calc.kv_cache_bytes(cfg, n_tokens, dtype="fp32")
        filled, per_token = filled_cache_bytes(cfg, n_tokens, ctx.seed)
        mha_calc, mha_filled = mha_calc or from_calc, mha_filled or filled
        kind = "MHA" if n_kv == N_HEADS else "MQA" if n_kv == 1 else "GQA"
        rows.append(
            {
                "attention": kind,
                "n_heads": N_HEADS,
                "n_kv_heads": n_kv,
                "calc bytes/token": calc.kv_bytes_per_token(cfg, "fp32"),
                "filled bytes/token": per_token,
                f"calc bytes ({n_tokens} tok)": from_calc,
                f"filled bytes ({n_tokens} tok)": filled,
                "shrink (calc)": mha_calc / from_calc,
                "shrink (filled)": mha_filled / filled,
                "n_heads/n_kv_heads": N_HEADS / n_kv,
            }
        )
        checks.append(lab.approx(f"{kind} n_kv={n_kv}: filled == calc bytes", filled - from_calc,
                                 0, 0))  # fmt: skip
        checks.append(lab.approx(f"{kind} n_kv={n_kv}: shrink of the filled cache",
                                 mha_filled / filled, N_HEADS / n_kv, RATIO_TOL))  # fmt: skip
    # The seed's own example, from the calculator: Llama-2-70B (64 heads, 8 KV heads) at 4096.
    llama = ModelConfig.preset("llama-2-70b")
    gqa = calc.kv_cache_bytes(llama, 4096, "fp16")
    mha = calc.kv_cache_bytes(llama.replace(n_kv_heads=llama.n_heads), 4096, "fp16")
    rows.append(
        {
            "attention": "Llama-2-70B GQA (calc, fp16, 4096 tok)",
            "n_heads": llama.n_heads,
            "n_kv_heads": llama.n_kv_heads,
            "calc bytes/token": calc.kv_bytes_per_token(llama, "fp16"),
            "shrink (calc)": mha / gqa,
            "n_heads/n_kv_heads": llama.n_heads / llama.n_kv_heads,
        }
    )
    checks.append(lab.approx("Llama-2-70B: MHA / GQA cache (calc)", mha / gqa,
                             llama.n_heads / llama.n_kv_heads, RATIO_TOL))  # fmt: skip
    figure = _plot(rows[:-1])
    data = {"n_tokens": n_tokens, "llama2_70b_gqa_bytes": gqa, "llama2_70b_mha_bytes": mha}
    return lab.Result.from_checks(rows, checks, figure=figure, data=data)


def _plot(rows: list[dict]):
    fig, ax = lab.new_figure(6.0, 3.4)
    lab.grouped_bars(ax, [f"{r['attention']}\nn_kv_heads={r['n_kv_heads']}" for r in rows], {
        "calc.kv_bytes_per_token": [r["calc bytes/token"] / 1024 for r in rows],
        "filled cache / tokens": [r["filled bytes/token"] / 1024 for r in rows],
    })  # fmt: skip
    ax.set_ylabel("KiB per token (fp32)")
    ax.set_title(f"KV cache per token, {N_HEADS} query heads: shrinks by n_heads / n_kv_heads")
    ax.legend(fontsize=8)
    return fig
