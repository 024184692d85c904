"""Seed 000 §5.2–5.3: the residual "+" gives gradients a path back to the shallow layers; without
it the gradient vanishes along depth and a deep network does not train; Post-LN is hard to train
deep, Pre-LN much more stable.

Two measurements, repeated over seeds (mean ± spread, sample standard deviation):
1. The mechanism: on a deep stack ("几十层": DEEP_LAYERS blocks) at initialization, one batch of
   Shakespeare characters, each block's gradient norm, of its parameters (|∂loss/∂θ|) and of the
   hidden state entering it (|∂loss/∂h|), for Pre-LN, Post-LN and Pre-LN without residuals
   (ModelConfig.residual=False). Read: the first block's gradient over the last block's.
2. Training: the same three variants at a smaller depth, each trained at three learning rates on
   the same batches; the held-out loss of each against the unigram entropy of the training
   characters (the loss of a model that uses no context).
"""

from __future__ import annotations

import torch

from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.lab.fit import (
    Schedule,
    eval_loss,
    fit,
    shakespeare_chars,
    unigram_entropy,
    window_batches,
)
from glassformer.models import build_model

VARIANTS = {  # name: (norm_position, residual)
    "Pre-LN": ("pre", True),
    "Post-LN": ("post", True),
    "no residual (Pre-LN)": ("pre", False),
}
VARIANTS_ZH = {"Pre-LN": "Pre-LN", "Post-LN": "Post-LN", "no residual (Pre-LN)": "无残差（Pre-LN）"}
# A small sweep around what small Transformers train at (nanoGPT's char-level Shakespeare: 1e-3),
# a factor ~3 apart so that "at every rate" spans slow, usual and aggressive.
LEARNING_RATES = (1e-3, 3e-3, 1e-2)
WARMUP_FRACTION = 0.1  # every variant gets the same warmup (10% of the steps), then cosine
# Thresholds, stated once.
# "Vanished": the first block's gradient at most a tenth of the last block's, an order of
# magnitude lost across the stack (smaller ratios than that are not layer-to-layer variation).
# The seed predicts this without residuals and its absence with them; both are checked on the
# conservative side of the seeds' spread (mean + spread <= 0.1, mean - spread >= 0.1).
VANISHED = 0.1
# "Trains": a held-out loss at least 0.3 nats below the unigram entropy (a model that ignores
# context sits at the unigram entropy; 0.3 nats is a clear use of context). Pre-LN training at
# the sweep's middle rate is a precondition (the sweep is centred where the standard model
# trains, else it compares models that all failed); "深网络根本训不动" reads as no rate bringing
# the no-residual model that far.
MIN_BELOW_UNIGRAM = 0.3


def gradient_norms(model, batch: dict[str, torch.Tensor]) -> tuple[list[float], list[float]]:
    """Per block, on one batch: (|∂loss/∂θ| over the block's parameters, |∂loss/∂h| of the hidden
    state entering the block, the Frobenius norm over (B, T, C)). The model is left unchanged."""
    inputs: list[torch.Tensor] = []

    def keep_input(module, args):
        args[0].retain_grad()
        inputs.append(args[0])

    handles = [block.register_forward_pre_hook(keep_input) for block in model.blocks]
    model.zero_grad(set_to_none=True)
    model.loss(**batch).ce_loss.backward()
    for handle in handles:
        handle.remove()
    parameter_norms = []
    for block in model.blocks:
        squares = [p.grad.pow(2).sum() for p in block.parameters() if p.grad is not None]
        parameter_norms.append(float(torch.stack(squares).sum().sqrt()))
    hidden_norms = [float(h.grad.norm()) for h in inputs]
    model.zero_grad(set_to_none=True)
    return parameter_norms, hidden_norms


def variant_config(name: str, vocab_size: int, n_layers: int, d_model: int, length: int):
    norm_position, residual = VARIANTS[name]
    return ModelConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=4,
        max_seq_len=length,
        norm="layer",
        norm_position=norm_position,
        residual=residual,
        ffn="gelu",
        bias=True,
    )


def seeded_model(cfg: ModelConfig, seed: int):
    with torch.random.fork_rng():
        torch.manual_seed(seed)  # the same initial weights wherever the shapes agree
        return build_model(cfg)


@lab.register("residuals")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    deep_layers, n_layers = ctx.pick(32, 32, 4), ctx.pick(12, 8, 2)
    d_model, steps = ctx.pick(64, 32, 16), ctx.pick(400, 120, 3)
    batch_size, length, n_val = ctx.pick(16, 16, 2), ctx.pick(64, 32, 16), ctx.pick(256, 128, 4)
    seeds = ctx.seeds()
    corpus = shakespeare_chars(ctx.pick(None, None, 200_000))
    vocab_size, unigram = corpus.tokenizer.vocab_size, unigram_entropy(corpus.train)

    # 1. gradients at initialization, deep stack
    grads = {name: {"parameters": [], "hidden": []} for name in VARIANTS}
    for seed in seeds:
        batch = window_batches(corpus.train, batch_size, length, seed)(0)
        for name in VARIANTS:
            model = seeded_model(
                variant_config(name, vocab_size, deep_layers, d_model, length), seed
            )
            parameter_norms, hidden_norms = gradient_norms(model, batch)
            grads[name]["parameters"].append(parameter_norms)
            grads[name]["hidden"].append(hidden_norms)
    ratios = {  # first block over last block, per seed
        name: {
            kind: lab.over_seeds([g[0] / g[-1] for g in per_seed])
            for kind, per_seed in g_of.items()
        }
        for name, g_of in grads.items()
    }

    # 2. the learning-rate sweep, smaller depth
    val: dict[tuple[str, float], lab.Spread] = {}
    for name in VARIANTS:
        cfg = variant_config(name, vocab_size, n_layers, d_model, length)
        for lr in LEARNING_RATES:
            schedule = Schedule(
                max_steps=steps, learning_rate=lr, warmup_steps=int(steps * WARMUP_FRACTION)
            )
            finals = []
            for seed in seeds:
                model = seeded_model(cfg, seed)
                fit(model, window_batches(corpus.train, batch_size, length, seed), schedule)
                finals.append(eval_loss(model, corpus.val, length, n_val, seed=seed))
            val[name, lr] = lab.over_seeds(finals)

    say = ctx.say
    for name in VARIANTS:
        say(name, VARIANTS_ZH[name])
    last = deep_layers - 1
    rows = []
    for name in VARIANTS:
        row = {say("variant", "变体"): name}
        for lr in LEARNING_RATES:
            row[say(f"val loss, lr {lr:g}", f"验证损失，lr {lr:g}")] = str(val[name, lr])
        row[say(f"|∂L/∂θ| block 0 / block {last}", f"|∂L/∂θ| 第 0 块 / 第 {last} 块")] = str(
            ratios[name]["parameters"]
        )
        row[say(f"|∂L/∂h| block 0 / block {last}", f"|∂L/∂h| 第 0 块 / 第 {last} 块")] = str(
            ratios[name]["hidden"]
        )
        rows.append(row)
    unigram_row = {f"val loss, lr {lr:g}": round(unigram, 4) for lr in LEARNING_RATES}
    rows.append(
        {"variant": say("unigram entropy (no context)", "一元熵（不看上下文）"), **unigram_row}
    )

    pre, post, bare = "Pre-LN", "Post-LN", "no residual (Pre-LN)"
    middle = LEARNING_RATES[len(LEARNING_RATES) // 2]
    checks = [
        lab.precondition(
            lab.at_least(
                say(
                    f"unigram entropy - Pre-LN val loss at lr {middle:g} (nats)",
                    f"一元熵减 Pre-LN 在 lr {middle:g} 时的验证损失（nats）",
                ),
                unigram - val[pre, middle].mean,
                MIN_BELOW_UNIGRAM,
            )
        )
    ]
    gradient_path = say(
        "gradients reach the first layers only with the +", "只有加上“+”，梯度才能传到最前面的层"
    )
    for kind, symbol in (("parameters", "∂L/∂θ"), ("hidden", "∂L/∂h")):
        r_bare, r_pre = ratios[bare][kind], ratios[pre][kind]
        checks += [
            lab.at_most(
                say(
                    f"no residual, {deep_layers} blocks: |{symbol}| block 0 / block {last} "
                    "(mean + spread)",
                    f"无残差，{deep_layers} 块：|{symbol}| 第 0 块 / 第 {last} 块（均值 + 波动）",
                ),
                r_bare.mean + r_bare.spread,
                VANISHED,
                group=gradient_path,
            ),
            lab.at_least(
                say(
                    f"Pre-LN, {deep_layers} blocks: |{symbol}| block 0 / block {last} "
                    "(mean - spread)",
                    f"Pre-LN，{deep_layers} 块：|{symbol}| 第 0 块 / 第 {last} 块（均值 - 波动）",
                ),
                r_pre.mean - r_pre.spread,
                VANISHED,
                group=gradient_path,
            ),
        ]
    untrainable = say("deep stack without the + does not train", "没有“+”的深层网络训不动")
    for lr in LEARNING_RATES:
        what = say(
            f"val loss, no residual - Pre-LN, lr {lr:g} (nats)",
            f"验证损失，无残差减 Pre-LN，lr {lr:g}（nats）",
        )
        checks.append(lab.exceeds_spread(what, val[bare, lr], val[pre, lr], group=untrainable))
    lowest_bare = min(val[bare, lr].mean for lr in LEARNING_RATES)
    checks.append(
        lab.at_least(
            say(
                "no residual: lowest val loss over the rates - (unigram - 0.3)",
                "无残差：各学习率中最低的验证损失减（一元熵 - 0.3）",
            ),
            lowest_bare - (unigram - MIN_BELOW_UNIGRAM),
            0.0,
            group=untrainable,
        )
    )
    post_harder = say("Post-LN harder to train than Pre-LN", "Post-LN 比 Pre-LN 难训练")
    for lr in LEARNING_RATES:
        checks.append(
            lab.exceeds_spread(
                say(
                    f"val loss, Post-LN - Pre-LN, lr {lr:g} (nats)",
                    f"验证损失，Post-LN 减 Pre-LN，lr {lr:g}（nats）",
                ),
                val[post, lr],
                val[pre, lr],
                group=post_harder,
            )
        )

    warmup = int(steps * WARMUP_FRACTION)
    notes = [
        say(
            f"Gradients: {deep_layers} blocks, d_model {d_model}, 4 heads, LayerNorm, GELU, at "
            f"initialization, one batch of {batch_size}x{length} characters per seed (seeds "
            f"{seeds}); block 0 is next to the embeddings. Training: {n_layers} blocks of the same "
            f"width, {steps} steps of {batch_size}x{length} characters, warmup "
            f"{warmup} steps then cosine to lr/10, gradients clipped at 1.0, "
            f"val loss over {n_val} windows of the held-out tail; mean ± spread over the seeds.",
            f"梯度：{deep_layers} 块，d_model {d_model}，4 个头，LayerNorm，GELU，在初始化时测量，"
            f"每个随机种子一批 {batch_size}x{length} 个字符（随机种子 {seeds}）；第 0 块紧挨着"
            "嵌入层。"
            f"训练：{n_layers} 块、宽度相同，{steps} 步，每步 {batch_size}x{length} 个字符，先预热 "
            f"{warmup} 步，再按余弦降到 lr/10，梯度裁剪到 1.0，验证损失取留出尾部的 {n_val} 个"
            "窗口；各随机种子的均值 ± 波动。",
        ),
        say(
            "residual=False computes f(LN(x)) in place of x + f(LN(x)) in both sublayers; the "
            "out-projections keep GPT-2's 1/sqrt(2N) init in every variant.",
            "residual=False 时，两个子层都计算 f(LN(x))，而不是 x + f(LN(x))；每个变体的输出投影"
            "都保留 GPT-2 的 1/sqrt(2N) 初始化。",
        ),
    ]
    for name in VARIANTS:
        p, h = ratios[name]["parameters"].mean, ratios[name]["hidden"].mean
        verdict_en, verdict_zh = (
            ("vanished (<= 0.1) in both.", "两者都消失了（<= 0.1）。")
            if max(p, h) <= VANISHED
            else ("not vanished (> 0.1) in both.", "两者都没有消失（> 0.1）。")
            if min(p, h) > VANISHED
            else ("vanished in one of the two only.", "只在其中之一消失。")
        )
        notes.append(
            say(
                f"{name}: block 0's parameter gradient is {p:.3g}x block {last}'s "
                f"({'larger' if p > 1 else 'smaller'}), its hidden-state gradient {h:.3g}x "
                f"({'larger' if h > 1 else 'smaller'}); " + verdict_en,
                f"{VARIANTS_ZH[name]}：第 0 块的参数梯度是第 {last} 块的 {p:.3g} 倍"
                f"（{'更大' if p > 1 else '更小'}），隐藏状态梯度是 {h:.3g} 倍"
                f"（{'更大' if h > 1 else '更小'}）；" + verdict_zh,
            )
        )
    for name in (post, bare):
        gaps = [val[name, lr].mean - val[pre, lr].mean for lr in LEARNING_RATES]
        trained = [lr for lr in LEARNING_RATES if val[name, lr].mean <= unigram - MIN_BELOW_UNIGRAM]
        rates = ", ".join(f"{lr:g}" for lr in LEARNING_RATES)
        gaps_text = ", ".join(f"{g:+.3f}" for g in gaps)
        notes.append(
            say(
                f"{name} minus Pre-LN val loss at lr "
                + rates
                + ": "
                + gaps_text
                + " nats; it gets 0.3 nats below the "
                f"unigram entropy ({unigram:.3f}) at "
                + (", ".join(f"lr {lr:g}" for lr in trained) if trained else "no rate")
                + ".",
                f"{VARIANTS_ZH[name]} 减 Pre-LN 的验证损失，lr 为 {rates} 时分别是 {gaps_text} "
                "nats；"
                f"比一元熵（{unigram:.3f}）低 0.3 nats 的学习率："
                + ("、".join(f"lr {lr:g}" for lr in trained) if trained else "没有")
                + "。",
            )
        )
    figure = _plot(grads, val, unigram, n_layers, deep_layers)
    data = {
        "unigram_entropy": unigram,
        "steps": steps,
        "seeds": seeds,
        "deep_layers": deep_layers,
        "n_layers": n_layers,
        "learning_rates": LEARNING_RATES,
        "init_gradient_norms": grads,
        "val": {f"{name} @ {lr:g}": list(s.values) for (name, lr), s in val.items()},
    }
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _plot(grads: dict, val: dict, unigram: float, n_layers: int, deep_layers: int):
    fig, (sweep, theta, hidden) = lab.new_figure(14.0, 4.0, ncols=3)
    colors = {name: f"C{i}" for i, name in enumerate(VARIANTS)}  # the same colour everywhere
    for name in VARIANTS:
        spreads = [val[name, lr] for lr in LEARNING_RATES]
        sweep.errorbar(
            LEARNING_RATES,
            [s.mean for s in spreads],
            [s.spread for s in spreads],
            marker="o",
            capsize=3,
            color=colors[name],
            label=name,
        )
    sweep.axhline(unigram, color="gray", linestyle=":", label=f"unigram entropy {unigram:.2f}")
    n_seeds = len(next(iter(val.values())).values)
    sweep.set(
        xscale="log",
        xlabel="peak learning rate",
        ylabel="val loss (nats)",
        title=f"{n_layers} blocks trained, mean ± spread over {n_seeds} seeds",
    )
    sweep.set_xticks(LEARNING_RATES, [f"{lr:g}" for lr in LEARNING_RATES])
    sweep.minorticks_off()
    sweep.legend(fontsize=7)
    for ax, kind, symbol in (
        (theta, "parameters", "|∂loss/∂θ| of the block's parameters"),
        (hidden, "hidden", "|∂loss/∂h| of the block's input"),
    ):
        for name in VARIANTS:
            per_seed = torch.tensor(grads[name][kind])  # (seeds, layers)
            ax.plot(
                per_seed.mean(0).tolist(), marker="o", markersize=2, color=colors[name], label=name
            )
        ax.set(
            yscale="log",
            xlabel="block (0 = next to the embeddings)",
            ylabel=symbol,
            title=f"{deep_layers} blocks at initialization, mean over seeds",
        )
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=7)
    return fig
