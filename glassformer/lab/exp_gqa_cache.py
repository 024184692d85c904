"""Seed 000 §4.2: the KV cache is kept per head, and MQA/GQA share keys and values between query
heads, so the cache shrinks by n_heads / n_kv_heads. Measured on caches actually filled by a
prefill of a random glassformer model, for n_kv_heads in {H, H/2, H/4, 1} (a cache that stored
the shared K/V once per query head would not shrink), and for MHA models with more heads of one
head size d_k (the seed's "每个头各存各的 K/V，头数越多 cache 越大"; at one d_model instead, d_k
shrinks as heads are added and the cache stays the same: a row); glassformer.calc gives the
expected bytes and the seed's Llama-2-70B example.
"""

from __future__ import annotations

import torch

from glassformer import calc
from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.models import build_model

N_HEADS = 8
HEAD_COUNTS = (4, 8, 16)  # MHA with one head size: d_model = n_heads x d_k
# Thresholds, stated once. "直接压缩 cache": the filled cache shrinks by n_heads / n_kv_heads, a
# ratio of integers, so to rounding (1e-9). "头数越多 cache 越大": with one d_k, the filled cache
# of 16 heads is at least 1.5x that of 4 heads (x4 the heads; 1.5 is any clear growth).
RATIO_TOL = 1e-9
MIN_HEADS_GROWTH = 1.5
SHARING = "sharing K/V (GQA/MQA) shrinks the cache"
MORE_HEADS = "more heads, bigger cache (each head stores its own K/V)"


def _config(n_kv_heads: int, ctx: lab.RunContext, n_heads: int = N_HEADS,
            d_model: int | None = None) -> ModelConfig:  # fmt: skip
    d_model = d_model or ctx.pick(512, 256, 64)
    return ModelConfig(
        family="gpt", vocab_size=256, d_model=d_model, n_layers=ctx.pick(8, 4, 1),
        n_heads=n_heads, n_kv_heads=n_kv_heads, max_seq_len=1024, position="rope", norm="rms",
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
        if n_kv == N_HEADS:  # setup: the baseline holds the bytes its shape says
            checks.append(lab.precondition(lab.approx("MHA: filled - calc bytes",
                                                      filled - from_calc, 0, 0)))  # fmt: skip
        else:
            checks.append(lab.approx(f"{kind} n_kv={n_kv}: shrink of the filled cache",
                                     mha_filled / filled, N_HEADS / n_kv, RATIO_TOL,
                                     group=SHARING))  # fmt: skip
    by_heads, same_d_model = {}, {}
    d_k = _config(N_HEADS, ctx).d_model // N_HEADS
    for n_heads in HEAD_COUNTS:
        for store, cfg in ((by_heads, _config(n_heads, ctx, n_heads, d_model=n_heads * d_k)),
                           (same_d_model, _config(n_heads, ctx, n_heads))):  # fmt: skip
            store[n_heads] = filled_cache_bytes(cfg, n_tokens, ctx.seed)[0]
            if store is same_d_model and cfg.d_model == n_heads * d_k:
                continue  # the same model as the row just written
            rows.append({"attention": f"MHA, {n_heads} heads, d_k {cfg.d_model // n_heads}, "
                                      f"d_model {cfg.d_model}",
                         "n_heads": n_heads, "n_kv_heads": n_heads,
                         f"filled bytes ({n_tokens} tok)": store[n_heads],
                         "calc bytes/token": calc.kv_bytes_per_token(cfg, "fp32"),
                         "filled bytes/token": store[n_heads] // n_tokens})  # fmt: skip
    fewest, most = HEAD_COUNTS[0], HEAD_COUNTS[-1]
    checks.append(lab.at_least(f"MHA filled cache, {most} heads / {fewest} heads (d_k {d_k})",
                               by_heads[most] / by_heads[fewest], MIN_HEADS_GROWTH,
                               group=MORE_HEADS))  # fmt: skip
    # The seed's own example, from the calculator (arithmetic on the published shapes: a row).
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
    d_model = _config(N_HEADS, ctx).d_model
    notes = [
        f"filled caches after a prefill of {n_tokens} tokens, fp32, d_model {d_model}; the "
        "shrink is MHA's filled bytes over each model's",
        f"with d_k {d_k} the MHA cache holds {by_heads[fewest]:,} bytes with {fewest} heads and "
        f"{by_heads[most]:,} with {most}: per token 2 x layers x n_heads x d_k. At one d_model "
        f"({d_model}) it holds {same_d_model[fewest]:,} and {same_d_model[most]:,}: with d_k = "
        "d_model / n_heads (seed 000 §4.1's split of one budget) the product does not depend on "
        "the head count, so the seed's sentence is about heads of a given size",
        f"Llama-2-70B ({llama.n_heads} heads, {llama.n_kv_heads} KV heads), 4096 tokens in "
        f"fp16: {gqa / 2**30:.2f} GiB with GQA, {mha / 2**30:.2f} GiB as MHA (calc)",
    ]
    figure = _plot(rows[:4])
    data = {"n_tokens": n_tokens, "by_heads": by_heads, "same_d_model": same_d_model,
            "llama2_70b_gqa_bytes": gqa,
            "llama2_70b_mha_bytes": mha}  # fmt: skip
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


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
