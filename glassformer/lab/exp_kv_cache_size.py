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
from glassformer.models import build_model

MIB, GIB = 2**20, 2**30
PROMPT, NEW = 1000, 500  # the seed's example
# Thresholds: "约 0.5 MB" and "约 2 GB" within 10%; "几百倍" = a ratio in [100, 1000);
# "第 500 步要重算 1500 个 token" within one token; the cache must make decoding faster (>= 1x).
ABOUT = 0.1


def _tiny_gpt(max_seq_len: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        family="gpt", vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=max_seq_len,
        position="rope", norm="rms", ffn="swiglu",
    )  # fmt: skip
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
    rows, checks, notes = [], [], []
    llama = ModelConfig.preset("llama-7b")
    per_token = calc.kv_bytes_per_token(llama, "fp16")
    chat = calc.kv_cache_bytes(llama, 4096, "fp16")
    rows.append({"what": "Llama-7B fp16 KV per token (calc)", "value": per_token / MIB,
                 "unit": "MiB", "seed": "约 0.5 MB"})  # fmt: skip
    rows.append({"what": "Llama-7B fp16 KV, 4096 tokens (calc)", "value": chat / GIB,
                 "unit": "GiB", "seed": "约 2 GB"})  # fmt: skip
    checks.append(lab.approx("7B fp16 MiB per token", per_token / MIB, 0.5, 0.5 * ABOUT))
    checks.append(lab.approx("7B fp16 GiB for 4096 tokens", chat / GIB, 2.0, 2.0 * ABOUT))

    model, name = lab.smollm2_or_stand_in(ctx)
    cfg = model.cfg
    n_fill = ctx.pick(256, 64, 8)
    cache = model.new_cache(batch_size=1, max_seq_len=n_fill)
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (1, n_fill)), cache=cache, last_token_only=True)
    dtype = "fp32" if cache.k.dtype == torch.float32 else "fp16"
    calc_bytes = calc.kv_bytes_per_token(cfg, dtype)
    rows.append({"what": f"{name} KV bytes per token ({dtype}, calc)", "value": calc_bytes,
                 "unit": "B", "seed": ""})  # fmt: skip
    rows.append({"what": f"{name} filled cache / {n_fill} tokens", "value":
                 cache.filled_bytes / n_fill, "unit": "B", "seed": ""})  # fmt: skip
    # Preconditions: the setup does what it intends (the cache holds the bytes calc says, the
    # counter counts what is fed, caching changes no token); the claim's evidence follows.
    filled = lab.approx(f"{name}: filled bytes/token - calc",
                        cache.filled_bytes / n_fill - calc_bytes, 0, 0)  # fmt: skip
    checks.append(lab.precondition(filled))

    prompt_len, n_new = ctx.pick((PROMPT, NEW), (PROMPT, NEW), (20, 10))
    tiny = _tiny_gpt(prompt_len + n_new + 8, ctx.seed)
    prompt = torch.randint(0, tiny.cfg.vocab_size, (prompt_len,)).tolist()
    counted = count_positions(tiny, prompt, n_new)
    with_cache, without_cache = sum(counted["with"]), sum(counted["without"])
    closed_with = PROMPT + NEW - 1  # prefill, then each new token but the last is fed once
    closed_without = sum(PROMPT + i for i in range(NEW))
    rows += [
        {"what": f"positions fed, {prompt_len}+{n_new}, with cache (counted)",
         "value": with_cache, "unit": "tokens", "seed": ""},
        {"what": f"positions fed, {prompt_len}+{n_new}, without cache (counted)",
         "value": without_cache, "unit": "tokens", "seed": ""},
        {"what": f"last step without cache, {prompt_len}+{n_new} (counted)",
         "value": counted["without"][-1], "unit": "tokens", "seed": "1500 (at 1000+500)"},
        {"what": "repeated work ratio without/with, 1000+500 (closed form)",
         "value": closed_without / closed_with, "unit": "x", "seed": "几百倍"},
    ]  # fmt: skip
    checks += [lab.precondition(c) for c in (
        lab.approx("counted positions with cache - closed form",
                   with_cache - (prompt_len + n_new - 1), 0, 0),
        lab.approx("counted positions without cache - closed form",
                   without_cache - sum(prompt_len + i for i in range(n_new)), 0, 0),
        lab.approx("same greedy tokens with and without cache", counted["same_tokens"], 1, 0),
    )]  # fmt: skip
    ratio = closed_without / closed_with
    checks.append(lab.at_least("without/with ratio at 1000+500 ('几百倍' >= 100)", ratio, 100))
    checks.append(lab.at_most("without/with ratio at 1000+500 ('几百倍' < 1000)", ratio, 999.99))

    speeds = []
    n_decode = ctx.pick(32, 16, 3)
    for context in ctx.pick((128, 512, 1024), (128, 512), (8, 16)):
        prompt = _prompt_ids(ctx, context, cfg.vocab_size)
        cached, uncached = _decode_speed(model, prompt, n_decode)
        speeds.append((context, cached, uncached))
        rows.append({"what": f"{name} decode tok/s at context {context}: cached / uncached",
                     "value": f"{cached:.1f} / {uncached:.1f}", "unit": "tok/s",
                     "seed": "KV Cache 决定后面吐字快不快"})  # fmt: skip
        checks.append(lab.at_least(f"cache speedup at context {context}", cached / uncached, 1.0))
    if ctx.tiny:
        notes.append("tiny mode: a 2-layer random model of SmolLM2's shape stands in for SmolLM2")
    figure = _plot(counted, speeds, name)
    data = {"per_call_with_cache": counted["with"][:5], "speeds": speeds,
            "closed_form": {"with": closed_with, "without": closed_without}}  # fmt: skip
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
    lab.grouped_bars(right, contexts, {"KV cache": [s[1] for s in speeds],
                                   "no cache": [s[2] for s in speeds]})  # fmt: skip
    right.set_ylabel("decode tokens/s")
    right.set_title(name)
    right.legend(fontsize=7)
    return fig
