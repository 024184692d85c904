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


def _config(
    n_kv_heads: int, ctx: lab.RunContext, n_heads: int = N_HEADS, d_model: int | None = None
) -> ModelConfig:
    d_model = d_model or ctx.pick(512, 256, 64)
    return ModelConfig(
        family="gpt",
        vocab_size=256,
        d_model=d_model,
        n_layers=ctx.pick(8, 4, 1),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        max_seq_len=1024,
        position="rope",
        norm="rms",
        ffn="swiglu",
    )


@torch.no_grad()
def filled_cache_bytes(cfg: ModelConfig, n_tokens: int, seed: int) -> tuple[int, int]:
    """(filled bytes, bytes per token) of a real cache after a prefill of n_tokens (fp32)."""
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    cache = model.new_cache(batch_size=1, max_seq_len=n_tokens)
    ids, positions = torch.randint(0, cfg.vocab_size, (1, n_tokens)), torch.arange(n_tokens)
    model(ids, positions, cache=cache, last_token_only=True)
    return written_bytes(cache), cache.kv_bytes_per_token


def written_bytes(cache) -> int:
    """Bytes of the cache slots a forward wrote keys into (they hold zeros until written), in
    every row: what the cache holds, counted in its memory rather than from its size."""
    written = cache.k.ne(0).any(dim=-1).any(dim=2).any(dim=0)  # (B, slots)
    return int(written.sum()) * cache.kv_bytes_per_token


@lab.register("gqa-cache")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    say = ctx.say
    n_tokens = ctx.pick(512, 256, 16)
    say(SHARING, "共享 K/V（GQA/MQA）让 cache 变小")
    say(MORE_HEADS, "头越多，cache 越大（每个头各存各的 K/V）")
    k_heads, k_kv = say("n_heads", "n_heads（头数）"), say("n_kv_heads", "n_kv_heads（KV 头数）")
    k_calc_tok = say("calc bytes/token", "calc 算出的字节/token")
    k_filled_tok = say("filled bytes/token", "实际填充的字节/token")
    k_calc = say(f"calc bytes ({n_tokens} tok)", f"calc 算出的字节（{n_tokens} 个 token）")
    k_filled = say(f"filled bytes ({n_tokens} tok)", f"实际填充的字节（{n_tokens} 个 token）")
    k_shrink_calc = say("shrink (calc)", "缩小倍数（calc）")
    k_shrink_filled = say("shrink (filled)", "缩小倍数（实际填充）")
    k_ratio = say("n_heads/n_kv_heads", "n_heads/n_kv_heads（头数之比）")
    k_attention = say("attention", "注意力")
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
                k_attention: kind,
                k_heads: N_HEADS,
                k_kv: n_kv,
                k_calc_tok: calc.kv_bytes_per_token(cfg, "fp32"),
                k_filled_tok: per_token,
                k_calc: from_calc,
                k_filled: filled,
                k_shrink_calc: mha_calc / from_calc,
                k_shrink_filled: mha_filled / filled,
                k_ratio: N_HEADS / n_kv,
            }
        )
        if n_kv == N_HEADS:  # setup: the baseline holds the bytes its shape says
            checks.append(
                lab.precondition(
                    lab.approx(
                        say("MHA: filled - calc bytes", "MHA：实际填充的字节 - calc 算出的字节"),
                        filled - from_calc,
                        0,
                        0,
                    )
                )
            )
        else:
            checks.append(
                lab.approx(
                    say(
                        f"{kind} n_kv={n_kv}: shrink of the filled cache",
                        f"{kind} n_kv={n_kv}：实际填充的 cache 缩小的倍数",
                    ),
                    mha_filled / filled,
                    N_HEADS / n_kv,
                    RATIO_TOL,
                    group=SHARING,
                )
            )
    by_heads, same_d_model = {}, {}
    d_k = _config(N_HEADS, ctx).d_model // N_HEADS
    for n_heads in HEAD_COUNTS:
        for store, cfg in (
            (by_heads, _config(n_heads, ctx, n_heads, d_model=n_heads * d_k)),
            (same_d_model, _config(n_heads, ctx, n_heads)),
        ):
            store[n_heads] = filled_cache_bytes(cfg, n_tokens, ctx.seed)[0]
            if store is same_d_model and cfg.d_model == n_heads * d_k:
                continue  # the same model as the row just written
            row_d_k = cfg.d_model // n_heads
            name = say(
                f"MHA, {n_heads} heads, d_k {row_d_k}, d_model {cfg.d_model}",
                f"MHA，{n_heads} 个头，d_k {row_d_k}，d_model {cfg.d_model}",
            )
            rows.append(
                {
                    k_attention: name,
                    k_heads: n_heads,
                    k_kv: n_heads,
                    k_filled: store[n_heads],
                    k_calc_tok: calc.kv_bytes_per_token(cfg, "fp32"),
                    k_filled_tok: store[n_heads] // n_tokens,
                }
            )
    fewest, most = HEAD_COUNTS[0], HEAD_COUNTS[-1]
    checks.append(
        lab.at_least(
            say(
                f"MHA filled cache, {most} heads / {fewest} heads (d_k {d_k})",
                f"MHA 实际填充的 cache：{most} 个头 / {fewest} 个头（d_k {d_k}）",
            ),
            by_heads[most] / by_heads[fewest],
            MIN_HEADS_GROWTH,
            group=MORE_HEADS,
        )
    )
    # The seed's own example, from the calculator (arithmetic on the published shapes: a row).
    llama = ModelConfig.preset("llama-2-70b")
    gqa = calc.kv_cache_bytes(llama, 4096, "fp16")
    mha = calc.kv_cache_bytes(llama.replace(n_kv_heads=llama.n_heads), 4096, "fp16")
    rows.append(
        {
            k_attention: say(
                "Llama-2-70B GQA (calc, fp16, 4096 tok)",
                "Llama-2-70B GQA（calc，fp16，4096 个 token）",
            ),
            k_heads: llama.n_heads,
            k_kv: llama.n_kv_heads,
            k_calc_tok: calc.kv_bytes_per_token(llama, "fp16"),
            k_shrink_calc: mha / gqa,
            k_ratio: llama.n_heads / llama.n_kv_heads,
        }
    )
    d_model = _config(N_HEADS, ctx).d_model
    few_b, most_b = by_heads[fewest], by_heads[most]
    same_few, same_most = same_d_model[fewest], same_d_model[most]
    heads, kv_heads = llama.n_heads, llama.n_kv_heads
    gqa_gib, mha_gib = gqa / 2**30, mha / 2**30
    notes = [
        say(
            f"filled caches after a prefill of {n_tokens} tokens, fp32, d_model {d_model}; the "
            "shrink is MHA's filled bytes over each model's",
            f"prefill {n_tokens} 个 token 之后实际填充的 cache，fp32，d_model {d_model}；缩小倍数"
            "是 MHA 填充的字节数除以各模型填充的字节数",
        ),
        say(
            f"with d_k {d_k} the MHA cache holds {few_b:,} bytes with {fewest} heads and "
            f"{most_b:,} with {most}: per token 2 x layers x n_heads x d_k. At one d_model "
            f"({d_model}) it holds {same_few:,} and {same_most:,}: with d_k = "
            "d_model / n_heads (seed 000 §4.1's split of one budget) the product does not depend "
            "on the head count, so the seed's sentence is about heads of a given size",
            f"d_k 为 {d_k} 时，MHA 的 cache 在 {fewest} 个头时占 {few_b:,} 字节，{most} 个头时占 "
            f"{most_b:,} 字节：每个 token 占 2 x 层数 x n_heads x d_k。在同一个 d_model"
            f"（{d_model}）下，它占 {same_few:,} 和 {same_most:,}：d_k = d_model / n_heads"
            "（教程 000 §4.1 把同一份预算分给各个头）时，这个乘积与头数无关，所以原文这句话说的是"
            "大小给定的头",
        ),
        say(
            f"Llama-2-70B ({heads} heads, {kv_heads} KV heads), 4096 tokens in "
            f"fp16: {gqa_gib:.2f} GiB with GQA, {mha_gib:.2f} GiB as MHA (calc)",
            f"Llama-2-70B（{heads} 个头，{kv_heads} 个 KV 头），fp16 下 4096 个 token：用 GQA 占 "
            f"{gqa_gib:.2f} GiB，若是 MHA 则占 {mha_gib:.2f} GiB（calc）",
        ),
    ]
    figure = _plot(rows[:4])
    data = {
        "n_tokens": n_tokens,
        "by_heads": by_heads,
        "same_d_model": same_d_model,
        "llama2_70b_gqa_bytes": gqa,
        "llama2_70b_mha_bytes": mha,
    }
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _plot(rows: list[dict]):
    fig, ax = lab.new_figure(6.0, 3.4)
    lab.grouped_bars(
        ax,
        [f"{r['attention']}\nn_kv_heads={r['n_kv_heads']}" for r in rows],
        {
            "calc.kv_bytes_per_token": [r["calc bytes/token"] / 1024 for r in rows],
            "filled cache / tokens": [r["filled bytes/token"] / 1024 for r in rows],
        },
    )
    ax.set_ylabel("KiB per token (fp32)")
    ax.set_title(f"KV cache per token, {N_HEADS} query heads: shrinks by n_heads / n_kv_heads")
    ax.legend(fontsize=8)
    return fig
