"""Seed 002 「KV Cache」: "KV Cache 是空间换时间——代价是显存 … 为什么长对话的 API 又慢又贵、
为什么本地部署跑长 context 显存爆炸，账就在这里。" Running a local model at a longer context costs
memory in proportion to the context, at the KV cache's rate, and every generated token comes
slower.

SmolLM2-135M generates a few tokens after prompts of growing length with glassformer's Engine,
each in a fresh process: the rise of the peak resident memory (VmHWM, reset through
/proc/self/clear_refs once the model is loaded) over the generation, and the decode speed.
glassformer.calc gives the KV cache's bytes per token for the same model (fp32).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from glassformer import calc
from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.lab.exp_flash_attention_memory import CLEAR, peak_kib, reset_peak

N_NEW = 16
# Thresholds, stated once. "账就在这里": the memory a generation adds grows with the context at a
# rate (a least-squares slope over the lengths) between 0.8x and 2x the KV cache's bytes per
# token (the cache is what grows; the prefill's passing activations add less than it does);
# "又慢": decode at the longest context is at least 10% slower than at the shortest.
MIN_RATE, MAX_RATE, MAX_SPEED_SHARE = 0.8, 2.0, 0.9


def child(model_arg: str, n_tokens: int, seed: int) -> None:
    """In a fresh process: load, then print the peak rise (MiB) and decode tok/s of one
    generation of N_NEW tokens after n_tokens of prompt."""
    from glassformer.infer.engine import Engine
    from glassformer.infer.sampling import NO_EOS
    from glassformer.interop.pretrained import from_pretrained

    model = from_pretrained(model_arg)[0]
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(100, model.cfg.vocab_size, (n_tokens,), generator=generator).tolist()
    engine = Engine(model)
    reset_peak()
    before = peak_kib()
    stats = engine.generate(prompt, N_NEW, temperature=0.0, eos_token_id=NO_EOS).stats
    print(json.dumps({"mib": (peak_kib() - before) / 1024, "decode": stats.decode_tokens_per_s}))


def generation(model_arg: str, n_tokens: int, seed: int) -> dict:
    code = f"from {__name__} import child; child({model_arg!r}, {n_tokens}, {seed})"
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"generation after {n_tokens} tokens failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


def tiny_model_folder(ctx: lab.RunContext, folder) -> str:
    from glassformer.interop.hf import save_hf_model

    model, _ = lab.smollm2_or_stand_in(ctx, max_seq_len=512)
    save_hf_model(model, folder)
    return str(folder)


@lab.register("long-context-memory")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    if not CLEAR.exists():
        raise RuntimeError("long-context-memory reads /proc/self/clear_refs (Linux only)")
    import tempfile
    from pathlib import Path

    say = ctx.say
    lengths = ctx.pick([512, 1024, 2048, 4096], [512, 1024, 2048], [32, 64, 128])
    with tempfile.TemporaryDirectory(prefix="lab-long-context-") as tmp:
        model_arg = tiny_model_folder(ctx, Path(tmp) / "m") if ctx.tiny else "smollm2"
        runs = [generation(model_arg, n, ctx.seed) for n in lengths]
        tiny = lab.smollm2_or_stand_in(ctx, max_seq_len=512)[0].cfg if ctx.tiny else None
        cfg = tiny or ModelConfig.preset("smollm2-135m")
    per_token = calc.kv_bytes_per_token(cfg, "fp32")
    rate = slope(lengths, [r["mib"] * 2**20 for r in runs])  # bytes per context token
    speed = runs[-1]["decode"] / runs[0]["decode"]
    group = say(
        "long contexts cost memory, at the KV cache's rate, and time",
        "长 context 费显存（按 KV cache 的速率）也费时间",
    )
    checks = [
        lab.at_least(
            say(
                "memory added per context token / KV cache bytes per token",
                "每个上下文 token 增加的内存 / KV cache 每 token 字节数",
            ),
            rate / per_token,
            MIN_RATE,
            group=group,
        ),
        lab.at_most(
            say(
                "memory added per context token / KV cache bytes per token (upper)",
                "每个上下文 token 增加的内存 / KV cache 每 token 字节数（上限）",
            ),
            rate / per_token,
            MAX_RATE,
            group=group,
        ),
        lab.at_most(
            say(
                f"decode tok/s at {lengths[-1]} / at {lengths[0]} tokens",
                f"{lengths[-1]} token 时 / {lengths[0]} token 时的每秒解码 token 数",
            ),
            speed,
            MAX_SPEED_SHARE,
            group=group,
        ),
    ]
    t_col, m_col = (
        say("context tokens", "上下文 token 数"),
        say("peak rise (MiB)", "峰值增量（MiB）"),
    )
    kv_col, d_col = (
        say("KV cache (MiB, calc)", "KV cache（MiB，计算）"),
        say("decode tok/s", "每秒解码 token 数"),
    )
    rows = [
        {
            t_col: n + N_NEW,
            m_col: r["mib"],
            kv_col: per_token * (n + N_NEW) / 2**20,
            d_col: r["decode"],
        }
        for n, r in zip(lengths, runs, strict=True)
    ]
    seven_b = calc.kv_bytes_per_token(ModelConfig.preset("llama-7b"), "fp16")
    notes = [
        ctx.say(
            f"{'a SmolLM2-shaped stand-in' if ctx.tiny else 'SmolLM2-135M'} in a fresh "
            f"process per length, {N_NEW} tokens after a random prompt; KV cache "
            f"{per_token / 1024:.0f} KiB per token (fp32); measured {rate / 1024:.0f} KiB per "
            f"context token; decode {runs[0]['decode']:.0f} -> {runs[-1]['decode']:.0f} tok/s",
            f"{'SmolLM2 形状的替身' if ctx.tiny else 'SmolLM2-135M'}，每个长度一个新进程，随机"
            f"提示之后生成 {N_NEW} 个 token；KV cache 每 token {per_token / 1024:.0f} KiB"
            "（fp32）；"
            f"实测每个上下文 token {rate / 1024:.0f} KiB；解码 {runs[0]['decode']:.0f} -> "
            f"{runs[-1]['decode']:.0f} tok/s",
        ),
        ctx.say(
            f"the seed's 7B model (Llama-7B, fp16) holds {seven_b / 2**20:.2f} MiB per token "
            f"(calc), {seven_b * 4096 / 2**30:.1f} GiB at 4,096 tokens: the same account at "
            "the scale the seed means",
            f"原文的 7B 模型（Llama-7B，fp16）每 token {seven_b / 2**20:.2f} MiB（计算），"
            f"4,096 token 时 {seven_b * 4096 / 2**30:.1f} GiB：同一本账放到原文说的规模上",
        ),
    ]
    data = {"lengths": lengths, "runs": runs, "kv_bytes_per_token": per_token, "rate": rate}
    return lab.Result.from_checks(
        rows, checks, figure=_plot(lengths, runs, per_token), data=data, notes=notes
    )


def _plot(lengths: list[int], runs: list[dict], per_token: int):
    fig, (left, right) = lab.new_figure(9.0, 3.4, ncols=2)
    left.plot(lengths, [r["mib"] for r in runs], "o-", label="peak rise, measured")
    left.plot(lengths, [per_token * n / 2**20 for n in lengths], "k:", label="KV cache (calc)")
    left.set(xlabel="context tokens", ylabel="MiB", title="memory of one generation")
    left.legend(fontsize=7)
    right.plot(lengths, [r["decode"] for r in runs], "o-")
    right.set(xlabel="context tokens", ylabel="decode tokens / s", title="and its speed")
    return fig
