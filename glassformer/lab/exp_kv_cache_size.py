"""Seed 002 "KV Cache": about 0.5 MB of cache per token for a 7B fp16 model (a 4096-token chat is
about 2 GB), SmolLM2's bytes per token from the calculator and from a real filled cache, the
repeated work a cache saves for a 1000-token prompt + 500 new tokens (token positions fed to the
model, counted), and decode speed with and without the cache at two context lengths.
"""

from __future__ import annotations

import time

import torch

from glassformer import calc
from glassformer.config import ModelConfig
from glassformer.infer.engine import Engine
from glassformer.lab import base as lab
from glassformer.lab.exp_gqa_cache import written_bytes
from glassformer.models import build_model

MIB, GIB = 2**20, 2**30
PROMPT, NEW = 1000, 500  # the seed's example
# Thresholds: "约 0.5 MB" and "约 2 GB" within 10%; "几百倍" = a ratio in [100, 1000);
# "第 500 步要重算 1500 个 token" within one token; the cache must make decoding faster (>= 1x).
ABOUT = 0.1
UNITS_ZH = {
    "MiB": "MiB",
    "GiB": "GiB",
    "B": "字节",
    "tokens": "个 token",
    "x": "倍",
    "tok/s": "token/秒",
}
NAMES_ZH = {
    "SmolLM2-135M": "SmolLM2-135M",
    "SmolLM2-shaped (2 random layers, vocab 512)": "SmolLM2 形状（2 层随机权重，词表 512）",
}


def _tiny_gpt(max_seq_len: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        family="gpt",
        vocab_size=64,
        d_model=32,
        n_layers=1,
        n_heads=2,
        max_seq_len=max_seq_len,
        position="rope",
        norm="rms",
        ffn="swiglu",
    )
    return build_model(cfg).eval()


class PositionCounter:
    """Counts the token positions a model is fed, one entry per forward call."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.per_call: list[int] = []
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.per_call.append(int(args[0].shape[1]))

    def close(self) -> None:
        self._handle.remove()


@torch.no_grad()
def generate_without_cache(model: torch.nn.Module, prompt: list[int], n_new: int) -> list[int]:
    """Greedy decoding that reruns the whole sequence for every new token (no KV cache)."""
    ids = list(prompt)
    for _ in range(n_new):
        logits = model(torch.tensor([ids]), last_token_only=True)  # (1, 1, V)
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


def count_positions(model: torch.nn.Module, prompt: list[int], n_new: int) -> dict:
    counter = PositionCounter(model)
    cached = Engine(model).generate(prompt, max_new_tokens=n_new, temperature=0.0).token_ids
    with_cache = list(counter.per_call)
    counter.per_call.clear()
    uncached = generate_without_cache(model, prompt, n_new)
    without_cache = list(counter.per_call)
    counter.close()
    return {"with": with_cache, "without": without_cache, "same_tokens": cached == uncached}


def _decode_speed(model, prompt: list[int], n_new: int) -> tuple[float, float]:
    """(tokens/s with the cache, tokens/s without) for greedy decoding after `prompt`."""
    with torch.no_grad():  # warm-up: the first big forward pays for allocation, not compute
        model(torch.tensor([prompt]), last_token_only=True)
    # The torch modules in both: the claim is about the cache, not about the fused C step.
    engine = Engine(model, fast=False)
    stats = engine.generate(prompt, max_new_tokens=n_new, temperature=0.0).stats
    t0 = time.perf_counter()
    generate_without_cache(model, prompt, n_new)
    return stats.decode_tokens_per_s, n_new / (time.perf_counter() - t0)


@lab.register("kv-cache-size")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    say = ctx.say
    for unit, unit_zh in UNITS_ZH.items():
        say(unit, unit_zh)
    what, value, unit, quote = (
        say("what", "项目"),
        say("value", "数值"),
        say("unit", "单位"),
        say("seed", "原文"),
    )
    rows, checks, notes = [], [], []
    llama = ModelConfig.preset("llama-7b")
    per_token = calc.kv_bytes_per_token(llama, "fp16")
    chat = calc.kv_cache_bytes(llama, 4096, "fp16")
    rows.append(
        {
            what: say(
                "Llama-7B fp16 KV per token (calc)", "Llama-7B fp16 每个 token 的 KV（计算器）"
            ),
            value: per_token / MIB,
            unit: "MiB",
            quote: say("约 0.5 MB", "约 0.5 MB"),
        }
    )
    rows.append(
        {
            what: say(
                "Llama-7B fp16 KV, 4096 tokens (calc)",
                "Llama-7B fp16 的 KV，4096 个 token（计算器）",
            ),
            value: chat / GIB,
            unit: "GiB",
            quote: say("约 2 GB", "约 2 GB"),
        }
    )
    checks.append(
        lab.approx(
            say("7B fp16 MiB per token", "7B fp16 每个 token 的 MiB 数"),
            per_token / MIB,
            0.5,
            0.5 * ABOUT,
        )
    )
    checks.append(
        lab.approx(
            say("7B fp16 GiB for 4096 tokens", "7B fp16 4096 个 token 的 GiB 数"),
            chat / GIB,
            2.0,
            2.0 * ABOUT,
        )
    )

    model, name = lab.smollm2_or_stand_in(ctx)
    name_zh = NAMES_ZH.get(name, name)
    cfg = model.cfg
    n_fill = ctx.pick(256, 64, 8)
    cache = model.new_cache(batch_size=1, max_seq_len=n_fill)
    with torch.no_grad():
        ids, positions = torch.randint(0, cfg.vocab_size, (1, n_fill)), torch.arange(n_fill)
        model(ids, positions, cache=cache, last_token_only=True)
    filled_bytes = written_bytes(cache)
    dtype = "fp32" if cache.k.dtype == torch.float32 else "fp16"
    calc_bytes = calc.kv_bytes_per_token(cfg, dtype)
    rows.append(
        {
            what: say(
                f"{name} KV bytes per token ({dtype}, calc)",
                f"{name_zh} 每个 token 的 KV 字节数（{dtype}，计算器）",
            ),
            value: calc_bytes,
            unit: "B",
            quote: "",
        }
    )
    rows.append(
        {
            what: say(
                f"{name} filled cache / {n_fill} tokens",
                f"{name_zh} 已填充的缓存 / {n_fill} 个 token",
            ),
            value: filled_bytes / n_fill,
            unit: "B",
            quote: "",
        }
    )
    # Preconditions: the setup does what it intends (the cache holds the bytes calc says, the
    # counter counts what is fed, caching changes no token); the claim's evidence follows.
    filled = lab.approx(
        say(f"{name}: filled bytes/token - calc", f"{name_zh}：实际填充的字节/token 减计算器的值"),
        filled_bytes / n_fill - calc_bytes,
        0,
        0,
    )
    checks.append(lab.precondition(filled))

    prompt_len, n_new = ctx.pick((PROMPT, NEW), (PROMPT, NEW), (20, 10))
    tiny = _tiny_gpt(prompt_len + n_new + 8, ctx.seed)
    prompt = torch.randint(0, tiny.cfg.vocab_size, (prompt_len,)).tolist()
    counted = count_positions(tiny, prompt, n_new)
    with_cache, without_cache = sum(counted["with"]), sum(counted["without"])
    closed_with = PROMPT + NEW - 1  # prefill, then each new token but the last is fed once
    closed_without = sum(PROMPT + i for i in range(NEW))
    size = f"{prompt_len}+{n_new}"
    rows += [
        {
            what: say(
                f"positions fed, {size}, with cache (counted)",
                f"送入的位置数，{size}，有缓存（实数）",
            ),
            value: with_cache,
            unit: "tokens",
            quote: "",
        },
        {
            what: say(
                f"positions fed, {size}, without cache (counted)",
                f"送入的位置数，{size}，无缓存（实数）",
            ),
            value: without_cache,
            unit: "tokens",
            quote: "",
        },
        {
            what: say(
                f"last step without cache, {size} (counted)", f"无缓存时的最后一步，{size}（实数）"
            ),
            value: counted["without"][-1],
            unit: "tokens",
            quote: say("1500 (at 1000+500)", "1500（在 1000+500 时）"),
        },
        {
            what: say(
                "repeated work ratio without/with, 1000+500 (closed form)",
                "重复计算量之比 无缓存/有缓存，1000+500（闭式解）",
            ),
            value: closed_without / closed_with,
            unit: "x",
            quote: say("几百倍", "几百倍"),
        },
    ]
    checks += [
        lab.precondition(c)
        for c in (
            lab.approx(
                say("counted positions with cache - closed form", "有缓存时实数的位置数减闭式解"),
                with_cache - (prompt_len + n_new - 1),
                0,
                0,
            ),
            lab.approx(
                say(
                    "counted positions without cache - closed form", "无缓存时实数的位置数减闭式解"
                ),
                without_cache - sum(prompt_len + i for i in range(n_new)),
                0,
                0,
            ),
            lab.approx(
                say("same greedy tokens with and without cache", "有无缓存时贪心解码的 token 相同"),
                counted["same_tokens"],
                1,
                0,
            ),
        )
    ]
    ratio = closed_without / closed_with
    checks.append(
        lab.at_least(
            say(
                "without/with ratio at 1000+500 ('几百倍' >= 100)",
                "1000+500 时 无缓存/有缓存 之比（'几百倍' >= 100）",
            ),
            ratio,
            100,
        )
    )
    checks.append(
        lab.at_most(
            say(
                "without/with ratio at 1000+500 ('几百倍' < 1000)",
                "1000+500 时 无缓存/有缓存 之比（'几百倍' < 1000）",
            ),
            ratio,
            999.99,
        )
    )

    speeds = []
    n_decode = ctx.pick(32, 16, 3)
    speed_quote = say("KV Cache 决定后面吐字快不快", "KV Cache 决定后面吐字快不快")
    for context in ctx.pick((128, 512, 1024), (128, 512), (8, 16)):
        prompt = _prompt_ids(ctx, context, cfg.vocab_size)
        cached, uncached = _decode_speed(model, prompt, n_decode)
        speeds.append((context, cached, uncached))
        rows.append(
            {
                what: say(
                    f"{name} decode tok/s at context {context}: cached / uncached",
                    f"{name_zh} 在上下文 {context} 时的解码速度 tok/s：有缓存 / 无缓存",
                ),
                value: f"{cached:.1f} / {uncached:.1f}",
                unit: "tok/s",
                quote: speed_quote,
            }
        )
        checks.append(
            lab.at_least(
                say(f"cache speedup at context {context}", f"上下文 {context} 时缓存带来的加速比"),
                cached / uncached,
                1.0,
            )
        )
    if ctx.tiny:
        notes.append(
            say(
                "tiny mode: a 2-layer random model of SmolLM2's shape stands in for SmolLM2",
                "tiny 模式：用一个 SmolLM2 形状、2 层随机权重的模型代替 SmolLM2",
            )
        )
    figure = _plot(counted, speeds, name)
    data = {
        "per_call_with_cache": counted["with"][:5],
        "speeds": speeds,
        "closed_form": {"with": closed_with, "without": closed_without},
    }
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _prompt_ids(ctx: lab.RunContext, n: int, vocab_size: int) -> list[int]:
    generator = torch.Generator().manual_seed(ctx.seed)
    return torch.randint(0, vocab_size, (n,), generator=generator).tolist()


def _plot(counted: dict, speeds: list, name: str):
    fig, (left, right) = lab.new_figure(8.4, 3.4, ncols=2)
    steps = range(1, len(counted["without"]) + 1)
    left.plot(steps, counted["without"], label="without cache: whole sequence")
    left.plot(steps, counted["with"], label="with cache: prefill, then 1")
    left.set_xlabel("forward call")
    left.set_ylabel("token positions fed")
    left.set_title(f"重复计算：{sum(counted['without'])} vs {sum(counted['with'])} positions")
    left.set_yscale("log")
    left.legend(fontsize=7)
    contexts = [f"context {s[0]}" for s in speeds]
    lab.grouped_bars(
        right, contexts, {"KV cache": [s[1] for s in speeds], "no cache": [s[2] for s in speeds]}
    )
    right.set_ylabel("decode tokens/s")
    right.set_title(name)
    right.legend(fontsize=7)
    return fig
