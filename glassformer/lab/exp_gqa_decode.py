"""Seed 000 §4.2: MQA / GQA share K/V between heads, "直接压缩 cache 显存、提升 Decode 吞吐". A
decode step reads every weight and the whole KV cache; sharing K/V makes the cache it reads
n_heads / n_kv_heads times smaller, so at a long context the step is faster.

Random glassformer models of one shape but for n_kv_heads (MHA, GQA with a quarter of the K/V
heads, MQA) decode with the Engine at batch 1 after a short and after a long prompt; decode
tokens per second, the median of interleaved repeats. Random weights decode as fast as trained
ones: the time is the reads, not the values.
"""

from __future__ import annotations

import torch

from glassformer import calc
from glassformer.config import ModelConfig
from glassformer.infer.engine import Engine
from glassformer.infer.sampling import NO_EOS
from glassformer.lab import base as lab
from glassformer.models import build_model

N_HEADS = 8
KINDS = {"MHA": N_HEADS, "GQA": N_HEADS // 4, "MQA": 1}
# Thresholds, stated once. "提升 Decode 吞吐": at the long context GQA decodes at least 1.2x as
# many tokens per second as MHA (the cache it reads is 4x smaller) beyond the repeats' spread,
# and the gain is larger at the long context than at the short one (where the cache is small
# beside the weights and sharing it cannot matter much).
MIN_SPEEDUP = 1.2


def config(ctx: lab.RunContext, n_kv: int, max_len: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=4096,
        d_model=ctx.pick(512, 512, 64),
        n_layers=ctx.pick(8, 6, 1),
        n_heads=N_HEADS,
        n_kv_heads=n_kv,
        max_seq_len=max_len,
        position="rope",
        norm="rms",
        ffn="swiglu",
        bias=False,
    )


def decode_rates(engines: dict, prompt: list[int], n_new: int, repeats: int) -> dict[str, list]:
    """Decode tokens per second of every engine, one generation each per repeat, interleaved."""
    for engine in engines.values():  # warm-up
        engine.generate(prompt[:16], 4, temperature=0.0, eos_token_id=NO_EOS)
    rates = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            stats = engine.generate(prompt, n_new, temperature=0.0, eos_token_id=NO_EOS).stats
            rates[name].append(stats.decode_tokens_per_s)
    return rates


@lab.register("gqa-decode-throughput")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    say = ctx.say
    short, long = ctx.pick((128, 4096), (128, 2048), (8, 64))
    n_new, repeats = ctx.pick(32, 24, 4), ctx.pick(7, 5, 2)
    engines, cfgs = {}, {}
    for name, n_kv in KINDS.items():
        cfgs[name] = config(ctx, n_kv, long + n_new + 8)
        torch.manual_seed(ctx.seed)
        engines[name] = Engine(build_model(cfgs[name]).eval())
    prompt = torch.randint(0, 4096, (long,), generator=torch.Generator().manual_seed(ctx.seed))
    rates = {
        length: {
            n: lab.over_seeds(r)
            for n, r in decode_rates(engines, prompt[:length].tolist(), n_new, repeats).items()
        }
        for length in (short, long)
    }
    speedup = {
        length: rates[length]["GQA"].mean / rates[length]["MHA"].mean for length in (short, long)
    }
    group = say("sharing K/V raises decode throughput", "共享 K/V 提升 Decode 吞吐")
    checks = [
        lab.exceeds_spread(
            say(
                f"context {long}: GQA - MHA decode tokens/s",
                f"上下文 {long}：GQA - MHA 的每秒解码 token 数",
            ),
            rates[long]["GQA"],
            rates[long]["MHA"],
            group=group,
        ),
        lab.at_least(
            say(
                f"context {long}: GQA / MHA decode tokens/s",
                f"上下文 {long}：GQA / MHA 的每秒解码 token 数",
            ),
            speedup[long],
            MIN_SPEEDUP,
            group=group,
        ),
        lab.at_least(
            say(
                f"GQA / MHA speed-up, context {long} / context {short}",
                f"GQA / MHA 的加速比：上下文 {long} / 上下文 {short}",
            ),
            speedup[long] / speedup[short],
            1.0,
            group=group,
        ),
    ]
    kind_col, kv_col = say("attention", "注意力"), say("KV heads", "KV 头数")
    cache_col = say(
        f"KV cache MiB at {long} tokens (fp32)", f"{long} token 时的 KV cache MiB（fp32）"
    )
    weights_col = say("weights MiB (fp32)", "权重 MiB（fp32）")
    rows = [
        {
            kind_col: name,
            kv_col: n_kv,
            weights_col: sum(p.numel() for p in engines[name].model.parameters()) * 4 / 2**20,
            cache_col: calc.kv_cache_bytes(cfgs[name], long, dtype="fp32") / 2**20,
            **{
                say(f"decode tok/s, context {length}", f"上下文 {length} 的每秒解码 token 数"): str(
                    rates[length][name]
                )
                for length in (short, long)
            },
        }
        for name, n_kv in KINDS.items()
    ]
    weights = sum(p.numel() for p in engines["MHA"].model.parameters()) * 4 / 2**20
    cfg = cfgs["MHA"]
    notes = [
        ctx.say(
            f"random models, {cfg.n_layers} layers, d_model {cfg.d_model}, {N_HEADS} query heads, "
            f"fp32, {weights:.0f} MiB of weights (MHA); Engine at batch 1, {n_new} tokens after "
            f"prompts of {short} and {long} tokens, {repeats} interleaved repeats; GQA speed-up "
            f"{speedup[short]:.2f}x at {short}, {speedup[long]:.2f}x at {long}. Sharing K/V also "
            "shrinks the K and V projections, the gain at the short context; the gain that grows "
            "with the context is the cache's",
            f"随机权重模型，{cfg.n_layers} 层，d_model {cfg.d_model}，{N_HEADS} 个查询头，fp32，"
            f"权重 {weights:.0f} MiB（MHA）；Engine 批大小 1，在 {short} 和 {long} token 的提示之后"
            f"生成 {n_new} 个 token，交错重复 {repeats} 次；GQA 加速比：{short} 时 "
            f"{speedup[short]:.2f} 倍，{long} 时 {speedup[long]:.2f} 倍。共享 K/V 也让 K、V "
            "投影变小，"
            "这是短上下文下的加速；随上下文变长而增大的那部分加速来自 cache",
        )
    ]
    data = {
        "rates": {str(k): {n: list(s.values) for n, s in v.items()} for k, v in rates.items()},
        "speedup": {str(k): v for k, v in speedup.items()},
    }
    return lab.Result.from_checks(
        rows, checks, figure=_plot(rates, short, long), data=data, notes=notes
    )


def _plot(rates: dict, short: int, long: int):
    fig, ax = lab.new_figure(6.0, 3.4)
    names = list(KINDS)
    for i, length in enumerate((short, long)):
        ax.bar(
            [j + (i - 0.5) * 0.38 for j in range(len(names))],
            [rates[length][n].mean for n in names],
            0.38,
            yerr=[rates[length][n].spread for n in names],
            capsize=3,
            label=f"context {length}",
        )
    ax.set_xticks(range(len(names)), names)
    ax.set(ylabel="decode tokens / s (mean ± spread)", title="decode throughput, batch 1")
    ax.legend(fontsize=7)
    return fig
