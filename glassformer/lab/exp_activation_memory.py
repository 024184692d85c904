"""Seed 000 §2.3: activation memory ≈ batch × L × d × layers. The bytes autograd saves for the
backward pass of one training forward (torch.autograd.graph.saved_tensors_hooks, every saved
storage once, parameters left out) for a GPT while B, T, d and the layer count are doubled one
at a time, with the fused sdpa attention and with the eager one that saves its H x T softmax
weights per token; `calc memory`'s term-by-term bill (calc.activation_bytes) checks the count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from glassformer import calc
from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.models import build_model

BACKENDS = ("sdpa", "eager")
FACTORS = ("batch B", "length T", "width d", "layers")
FACTOR_ZH = {"batch B": "批大小 B", "length T": "长度 T", "width d": "宽度 d", "layers": "层数"}
# Threshold: the seed's "≈" is a proportion, so doubling one factor should double the bytes; 10%
# slack admits the terms that do not scale with that factor (the head's logits, the final norm),
# while a T² term (eager: H x T weights per token) or a term independent of the factor (ratio
# near 1) falls outside.
RATIO, RATIO_TOL = 2.0, 0.2
CALC_TOL = 0.05  # calc leaves out norm statistics and small buffers: a few percent at most


def saved_bytes(
    forward: Callable[[], torch.Tensor], weights: Iterable[torch.Tensor]
) -> tuple[int, int]:
    """(bytes, storages) autograd holds for backward after forward(): each saved storage
    counted once (a tensor saved by two ops, or a view, is one allocation), the weights and
    views of them left out (they are parameters, not activations)."""
    weight_storages = {w.untyped_storage().data_ptr() for w in weights}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weight_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()  # kept alive until counted: its graph holds the saved tensors
        total = sum(saved.values())
    del out
    return total, len(saved)


def doubled(base: ModelConfig, batch: int, seq_len: int, factor: str):
    """(config, batch, seq_len) with `factor` doubled; d doubles at a fixed head size (twice the
    heads), as model families grow (GPT-2: 768/12, 1600/25 heads of 64)."""
    if factor == "batch B":
        return base, 2 * batch, seq_len
    if factor == "length T":
        return base, batch, 2 * seq_len
    if factor == "width d":
        return base.replace(d_model=2 * base.d_model, n_heads=2 * base.n_heads), batch, seq_len
    return base.replace(n_layers=2 * base.n_layers), batch, seq_len


def measure(cfg: ModelConfig, batch: int, seq_len: int, seed: int) -> dict:
    torch.manual_seed(seed)
    model = build_model(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    measured, n_tensors = saved_bytes(lambda: model.loss(ids, ids).loss, model.parameters())
    predicted = calc.activation_bytes(cfg, batch, seq_len, "fp32")
    return {"bytes": measured, "tensors": n_tensors, "calc": predicted}


@lab.register("activation-memory")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    d, layers, heads, vocab = ctx.pick((256, 4, 4, 256), (128, 2, 4, 256), (64, 2, 2, 64))
    batch, seq_len = ctx.pick((4, 256), (2, 128), (1, 64))
    rows, checks, ratios, points = [], [], {}, []
    for backend in BACKENDS:
        base = ModelConfig(
            vocab_size=vocab,
            d_model=d,
            n_layers=layers,
            n_heads=heads,
            max_seq_len=2 * seq_len,
            attention_backend=backend,
        )
        ref = measure(base, batch, seq_len, ctx.seed)
        points.append((f"{backend} base", ref))
        rows.append(
            _row(ctx, backend, f"base B={batch} T={seq_len} d={d} layers={layers}", ref, 1.0)
        )
        for factor in FACTORS:
            cfg, b, t = doubled(base, batch, seq_len, factor)
            got = measure(cfg, b, t, ctx.seed)
            ratio = got["bytes"] / ref["bytes"]
            ratios[(backend, factor)] = ratio
            points.append((f"{backend} {factor} x2", got))
            rows.append(_row(ctx, backend, f"{factor} x2", got, ratio))
            what = ctx.say(
                f"{backend}: bytes ratio with {factor} doubled",
                f"{backend}：{FACTOR_ZH[factor]}翻倍时的字节数之比",
            )
            group = ctx.say(f"linear in {factor}", f"与{FACTOR_ZH[factor]}成正比")
            checks.append(lab.approx(what, ratio, RATIO, RATIO_TOL, group=group))
    # Precondition: the hook counts what calc's bill lists (activations, not weights, each once).
    worst = max(abs(p["bytes"] / p["calc"] - 1) for _, p in points)
    checks.insert(
        0,
        lab.precondition(
            lab.at_most(
                ctx.say(
                    "largest |measured / calc memory - 1| over all runs",
                    "所有运行中 |实测 / calc memory - 1| 的最大值",
                ),
                worst,
                CALC_TOL,
            )
        ),
    )
    notes = _notes(ctx, ratios, batch, seq_len, heads)
    figure = _plot(ratios, points)
    data = {
        "ratios": {f"{b} {f}": r for (b, f), r in ratios.items()},
        "points": {name: p for name, p in points},
    }
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _row(ctx: lab.RunContext, backend: str, what: str, point: dict, ratio: float) -> dict:
    return {
        ctx.say("attention", "注意力实现"): backend,
        ctx.say("run", "运行"): what,
        ctx.say("saved MiB", "保存的 MiB"): point["bytes"] / 2**20,
        ctx.say("tensors", "张量数"): point["tensors"],
        ctx.say("calc MiB", "calc 估算 MiB"): point["calc"] / 2**20,
        ctx.say("ratio to base", "与基准之比"): ratio,
    }


def _doubling_note(ctx: lab.RunContext, backend: str, ratios: dict) -> str:
    """Which factors' doubling stays within x2 ± 10% for one backend, and which do not."""
    inside = [f for f in FACTORS if abs(ratios[(backend, f)] - RATIO) <= RATIO_TOL]
    off = [f for f in FACTORS if f not in inside]
    en_list = [f"{f} x{ratios[(backend, f)]:.2f}" for f in inside] or ["nothing near x2"]
    zh_list = [f"{FACTOR_ZH[f]} x{ratios[(backend, f)]:.2f}" for f in inside] or ["没有接近 x2 的"]
    en = f"{backend}: doubling gives " + ", ".join(en_list)
    zh = f"{backend}：翻倍得到 " + "、".join(zh_list)
    if off:
        en += "; off x2: " + ", ".join(f"{f} x{ratios[(backend, f)]:.2f}" for f in off)
        zh += "；偏离 x2 的：" + "、".join(
            f"{FACTOR_ZH[f]} x{ratios[(backend, f)]:.2f}" for f in off
        )
    return ctx.say(en, zh)


def _notes(ctx: lab.RunContext, ratios: dict, batch: int, seq_len: int, heads: int) -> list[str]:
    notes = [_doubling_note(ctx, backend, ratios) for backend in BACKENDS]
    t_gap = ratios[("eager", "length T")] - ratios[("sdpa", "length T")]
    notes.append(
        ctx.say(
            f"length T: eager's ratio is {t_gap:+.2f} from sdpa's; eager saves {heads} x T softmax "
            "weights per token (a T² term), the fused kernel only a logsumexp per head and "
            "recomputes"
            " the scores in backward",
            f"长度 T：eager 的比值与 sdpa 相差 {t_gap:+.2f}；eager 为每个 token 保存 {heads} x T "
            "个 "
            "softmax 权重（一个 T² 项），融合 kernel 每个头只保存一个 logsumexp，"
            "反向时重算注意力分数",
        )
    )
    gpt2 = ModelConfig.preset("gpt2-124m")
    base = calc.activation_bytes(gpt2, batch, seq_len)
    wide = calc.activation_bytes(gpt2.replace(d_model=1536, n_heads=24), batch, seq_len)
    deep = calc.activation_bytes(gpt2.replace(n_layers=24), batch, seq_len)
    notes.append(
        ctx.say(
            f"calc memory for GPT-2 124M (vocab 50257): doubling d gives x{wide / base:.2f}, "
            "layers "
            f"x{deep / base:.2f}: a large vocabulary's logits do not grow with either",
            f"GPT-2 124M（词表 50257）的 calc memory：d 翻倍得到 x{wide / base:.2f}，层数翻倍 "
            f"x{deep / base:.2f}：大词表的 logits 不随二者增长",
        )
    )
    return notes


def _plot(ratios: dict, points: list):
    fig, (left, right) = lab.new_figure(9.0, 3.6, ncols=2)
    lab.grouped_bars(left, list(FACTORS), {b: [ratios[(b, f)] for f in FACTORS] for b in BACKENDS})
    left.axhspan(RATIO - RATIO_TOL, RATIO + RATIO_TOL, color="0.85", zorder=0, label="x2 ± 10%")
    left.set_ylim(0, 3)
    left.set_ylabel("saved bytes, doubled / base")
    left.set_xlabel("factor doubled")
    left.set_title("翻倍一个因子，激活字节数之比", fontsize=9)
    left.legend(fontsize=7, loc="upper left", ncol=3)
    measured = [p["bytes"] / 2**20 for _, p in points]
    predicted = [p["calc"] / 2**20 for _, p in points]
    right.plot(predicted, measured, "o")
    top = max(measured + predicted) * 1.1
    right.plot([0, top], [0, top], "k:", linewidth=1, label="measured = calc")
    right.set_xlabel("calc memory's activation bill (MiB)")
    right.set_ylabel("saved by autograd, measured (MiB)")
    right.set_title("实测 vs calc memory", fontsize=9)
    right.legend(fontsize=7)
    return fig
