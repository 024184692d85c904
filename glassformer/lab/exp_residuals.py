"""Seed 000 §5.2–5.3: the residual "+" lets gradients reach the lowest layers of a deep stack, and
Pre-LN (x + f(LN(x))) trains where the original Post-LN (LN(x + f(x))) is hard to train.

One deep, narrow GPT (12 layers, d_model 64, LayerNorm, GELU) on Shakespeare characters, trained
the same steps on the same batches at one learning rate in five variants: Pre-LN and Post-LN, each
with and without warmup, and Pre-LN without residuals (ModelConfig.residual=False). Reported: the
final train and val loss of each against the unigram entropy of the training characters (what a
model that ignores context reaches), and each layer's gradient norm at initialization on one
batch (Xiong et al. 2020: Post-LN's gradients differ from layer to layer, Pre-LN's do not).
"""

from __future__ import annotations

import torch

from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.lab.fit import Schedule, eval_loss, fit, shakespeare_chars, window_batches
from glassformer.models import build_model

# One learning rate for every variant, the middle of what small Transformers train at
# (nanoGPT's char-level Shakespeare: 1e-3; many small-model recipes: up to 3e-3). Warmup, where
# used: the first 10% of the steps, then cosine to lr/10 (fit.Schedule's default).
LEARNING_RATE = 2e-3
WARMUP_FRACTION = 0.1
# Thresholds, stated once. "Trains": val loss at least 0.3 nats below the unigram entropy (a model
# that uses no context at all sits at the unigram entropy; 0.3 nats is a clear use of context).
# "Struggles" / "fails": ends at least 0.1 nats (Post-LN without warmup) or 0.3 nats (no residual)
# above Pre-LN without warmup on the same batches, about 4% / 12% of a ~2.5-nat loss. "Without
# warmup" is part of the claim: Post-LN with warmup must end at least 0.1 nats below Post-LN
# without it.
MIN_BELOW_UNIGRAM = 0.3
MIN_POST_LN_GAP = 0.1
MIN_NO_RESIDUAL_GAP = 0.3

VARIANTS = {  # name: (norm_position, warmup, residual)
    "Pre-LN, warmup": ("pre", True, True),
    "Pre-LN, no warmup": ("pre", False, True),
    "Post-LN, warmup": ("post", True, True),
    "Post-LN, no warmup": ("post", False, True),
    "Pre-LN, no residual, warmup": ("pre", True, False),
}


def unigram_entropy(ids: torch.Tensor) -> float:
    """Entropy (nats) of the characters' frequencies: the loss of the best context-free model."""
    p = torch.bincount(ids).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def layer_gradient_norms(model, batch: dict[str, torch.Tensor]) -> list[float]:
    """|∂loss/∂θ| over each block's parameters, on one batch (the model is left unchanged)."""
    model.zero_grad(set_to_none=True)
    model.loss(**batch).ce_loss.backward()
    norms = []
    for block in model.blocks:
        grads = [p.grad.pow(2).sum() for p in block.parameters() if p.grad is not None]
        norms.append(float(torch.stack(grads).sum().sqrt()))
    model.zero_grad(set_to_none=True)
    return norms


@lab.register("residuals")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    steps = ctx.pick(1000, 300, 3)
    n_layers, d_model = ctx.pick(12, 12, 2), ctx.pick(64, 64, 16)
    batch_size, length = ctx.pick(16, 16, 2), ctx.pick(64, 64, 16)
    n_val = ctx.pick(256, 128, 4)
    corpus = shakespeare_chars(ctx.pick(None, None, 200_000))
    batches = window_batches(corpus.train, batch_size, length, ctx.seed)
    unigram = unigram_entropy(corpus.train)
    warmup_steps = int(steps * WARMUP_FRACTION)

    runs = {}
    for name, (norm_position, warmup, residual) in VARIANTS.items():
        cfg = ModelConfig(vocab_size=corpus.tokenizer.vocab_size, d_model=d_model,
                          n_layers=n_layers, n_heads=4, max_seq_len=length, norm="layer",
                          norm_position=norm_position, residual=residual, ffn="gelu",
                          bias=True)  # fmt: skip
        with torch.random.fork_rng():
            torch.manual_seed(ctx.seed)  # the same initial weights wherever the shapes agree
            model = build_model(cfg)
        grads = layer_gradient_norms(model, batches(0))
        schedule = Schedule(max_steps=steps, learning_rate=LEARNING_RATE,
                            warmup_steps=warmup_steps if warmup else 0)  # fmt: skip
        losses = fit(model, batches, schedule)
        tail = losses[-max(1, steps // 20) :]
        runs[name] = {
            "losses": losses,
            "train": sum(tail) / len(tail),
            "val": eval_loss(model, corpus.val, length, n_val, seed=ctx.seed),
            "init_grad_norms": grads,
        }

    pre = runs["Pre-LN, no warmup"]["val"]
    rows = []
    for name, r in runs.items():
        g = r["init_grad_norms"]
        rows.append({
            "variant": name,
            "final train loss": round(r["train"], 4),
            "val loss": round(r["val"], 4),
            "val - Pre-LN no warmup": round(r["val"] - pre, 4),
            "init |grad| layer 0": f"{g[0]:.3g}",
            f"init |grad| layer {len(g) - 1}": f"{g[-1]:.3g}",
        })  # fmt: skip
    rows.append({"variant": "unigram entropy (no context)", "val loss": round(unigram, 4)})
    checks = [
        lab.at_least("unigram entropy - val loss, Pre-LN no warmup (nats)", unigram - pre,
                     MIN_BELOW_UNIGRAM),
        lab.at_least("val loss, Post-LN no warmup - Pre-LN no warmup (nats)",
                     runs["Post-LN, no warmup"]["val"] - pre, MIN_POST_LN_GAP),
        lab.at_least("val loss, Post-LN no warmup - Post-LN warmup (nats; warmup is the cure)",
                     runs["Post-LN, no warmup"]["val"] - runs["Post-LN, warmup"]["val"],
                     MIN_POST_LN_GAP),
        lab.at_least("val loss, no residual - Pre-LN no warmup (nats)",
                     runs["Pre-LN, no residual, warmup"]["val"] - pre, MIN_NO_RESIDUAL_GAP),
    ]  # fmt: skip
    notes = [
        f"{n_layers} layers, d_model {d_model}, 4 heads, LayerNorm, GELU; {steps} steps of "
        f"{batch_size}x{length} characters at lr {LEARNING_RATE:g}, warmup {warmup_steps} steps "
        "where used, cosine decay to lr/10, gradients clipped at 1.0 (fit's default) for all.",
        "The no-residual variant gets warmup, its best chance; residual=False computes "
        "f(LN(x)) in place of x + f(LN(x)).",
        f"Final train loss: mean of the last {max(1, steps // 20)} steps; val loss: {n_val} "
        f"windows of the held-out tail; unigram entropy from the training characters' counts.",
        "Gradient norms at init: one batch, all of a block's parameters, before any step. "
        "Gradient clipping at 1.0 softens what a large Post-LN gradient does to a step.",
    ]
    post_warm, post_cold = runs["Post-LN, warmup"]["val"], runs["Post-LN, no warmup"]["val"]
    pre_warm = runs["Pre-LN, warmup"]["val"]
    notes.append(
        f"Warmup: Post-LN val {post_warm:.3f} with, {post_cold:.3f} without "
        f"({post_cold - post_warm:+.3f} nats from dropping it); Pre-LN {pre_warm:.3f} with, "
        f"{pre:.3f} without ({pre - pre_warm:+.3f}). Post-LN "
        + ("trains here only with warmup" if post_warm < unigram - MIN_BELOW_UNIGRAM
           else "does not get below the unigram entropy by the margin even with warmup here")
        + "."
    )  # fmt: skip
    pre_g, post_g = (
        runs["Pre-LN, no warmup"]["init_grad_norms"],
        runs["Post-LN, no warmup"]["init_grad_norms"],
    )
    notes.append(
        f"Initial gradient, layer 0 / layer {n_layers - 1}: Pre-LN {pre_g[0] / pre_g[-1]:.2f}, "
        f"Post-LN {post_g[0] / post_g[-1]:.2f}. Xiong et al. 2020 describe Post-LN's gradients "
        "as growing toward the output layer and Pre-LN's as level; compare the figure's right "
        "panel with that direction."
    )
    figure = _plot(runs, unigram)
    data = {"unigram_entropy": unigram, "steps": steps, "learning_rate": LEARNING_RATE,
            "warmup_steps": warmup_steps, "runs": runs}  # fmt: skip
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _plot(runs: dict, unigram: float):
    fig, (left, right) = lab.new_figure(11.0, 3.8, ncols=2)
    window = max(1, len(next(iter(runs.values()))["losses"]) // 25)
    colors = {name: f"C{i}" for i, name in enumerate(runs)}  # the same colour in both panels
    for name, r in runs.items():
        left.plot(lab.trailing_mean(r["losses"], window), label=f"{name} (val {r['val']:.2f})",
                  color=colors[name])  # fmt: skip
    # warmup changes no initial weight: one line per architecture
    for name, label in (("Pre-LN, no warmup", "Pre-LN"), ("Post-LN, no warmup", "Post-LN"),
                        ("Pre-LN, no residual, warmup", "Pre-LN, no residual")):  # fmt: skip
        g = runs[name]["init_grad_norms"]
        right.plot(range(len(g)), g, marker="o", markersize=3, color=colors[name], label=label)
    left.axhline(unigram, color="gray", linestyle=":", label=f"unigram entropy {unigram:.2f}")
    left.set(xlabel="step", ylabel=f"train loss (nats, mean of {window} steps)",
             title="training loss, same batches and lr")  # fmt: skip
    right.set(xlabel="layer (0 = next to the embeddings)", ylabel="|∂loss/∂θ| of the block",
              yscale="log", title="gradient norm per layer at initialization")  # fmt: skip
    right.xaxis.get_major_locator().set_params(integer=True)
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    return fig
