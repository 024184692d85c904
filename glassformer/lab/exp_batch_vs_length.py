"""Seed 000 §2.3's table: "GPU 显存 | 激活值 ≈ batch × L × d × 层数 | batch 和长度此消彼长": under a
fixed memory budget, the longer the sequences, the fewer of them fit in a batch.

The budget is the activation memory (the bytes autograd saves for the backward pass, measured
as exp_activation_memory.py measures it) of a training step of a small GPT at batch B0 and
length L0. For each longer length the largest batch whose step still fits is found by search,
on the fused (sdpa) attention path and on the eager one, which also saves H x T x T scores.
"""

from __future__ import annotations

from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.lab.exp_activation_memory import measure

BACKENDS = ("sdpa", "eager")
# Thresholds, stated once. "此消彼长" as the seed's formula has it: on the sdpa path the largest
# batch that fits times the length stays within 25% of B0 x L0 at every length (memory linear in
# both); on the eager path the T x T scores make the largest batch fall faster than 1/L: at the
# longest length B x L is below B0 x L0.
KEEP_PRODUCT = 0.25


def largest_batch(cfg: ModelConfig, seq_len: int, budget: int, seed: int, limit: int) -> int:
    """The largest batch (1..limit) whose training step saves at most `budget` bytes."""
    low, high = 0, limit
    while low < high:
        mid = (low + high + 1) // 2
        if measure(cfg, mid, seq_len, seed)["bytes"] <= budget:
            low = mid
        else:
            high = mid - 1
    return low


@lab.register("batch-vs-length")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    say = ctx.say
    d, layers, heads = ctx.pick((128, 2, 4), (128, 2, 4), (32, 1, 2))
    b0, l0 = ctx.pick((32, 64), (16, 64), (4, 16))
    lengths = [l0 * f for f in (1, 2, 4, 8)]
    fits = {}
    for backend in BACKENDS:
        cfg = ModelConfig(
            vocab_size=256,
            d_model=d,
            n_layers=layers,
            n_heads=heads,
            max_seq_len=lengths[-1],
            attention_backend=backend,
        )
        budget = measure(cfg, b0, l0, ctx.seed)["bytes"]
        fits[backend] = [largest_batch(cfg, t, budget, ctx.seed, 2 * b0) for t in lengths]
    product = {
        b: [n * t / (b0 * l0) for n, t in zip(fits[b], lengths, strict=True)] for b in BACKENDS
    }
    group = say("batch and length trade off", "batch 和长度此消彼长")
    checks = [
        lab.at_most(
            say(
                "sdpa: largest |batch x length / (B0 x L0) - 1| over the lengths",
                "sdpa：各长度下 |batch x 长度 / (B0 x L0) - 1| 的最大值",
            ),
            max(abs(p - 1) for p in product["sdpa"]),
            KEEP_PRODUCT,
            group=group,
        ),
        lab.at_most(
            say(
                f"eager: batch x length / (B0 x L0) at length {lengths[-1]}",
                f"eager：长度 {lengths[-1]} 时的 batch x 长度 / (B0 x L0)",
            ),
            product["eager"][-1],
            1.0 - 1e-9,
            group=group,
        ),
        lab.at_least(
            say(
                f"sdpa: largest batch at length {l0} / at {lengths[-1]}",
                f"sdpa：长度 {l0} 时最大 batch / 长度 {lengths[-1]} 时",
            ),
            fits["sdpa"][0] / max(fits["sdpa"][-1], 1),
            4.0,
            group=group,
        ),
    ]
    t_col = say("length L", "长度 L")
    rows = [
        {
            t_col: t,
            **{say(f"largest batch, {b}", f"最大 batch，{b}"): fits[b][i] for b in BACKENDS},
            **{
                say(f"batch x L / (B0 x L0), {b}", f"batch x L / (B0 x L0)，{b}"): product[b][i]
                for b in BACKENDS
            },
        }
        for i, t in enumerate(lengths)
    ]
    notes = [
        ctx.say(
            f"a GPT of {layers} layers, d={d}, {heads} heads, fp32; the budget is the activation "
            f"memory of a training step at batch {b0} and length {l0} on each path; the largest "
            "batch "
            f"that fits is searched up to {2 * b0}",
            f"GPT：{layers} 层，d={d}，{heads} 个头，fp32；预算是每条路径上 batch {b0}、长度 {l0} "
            f"时一个训练步的激活值内存；在不超过 {2 * b0} 的范围内搜索装得下的最大 batch",
        )
    ]
    data = {"lengths": lengths, "fits": fits, "budget_batch": b0, "budget_length": l0}
    return lab.Result.from_checks(
        rows, checks, figure=_plot(lengths, fits, b0, l0), data=data, notes=notes
    )


def _plot(lengths: list[int], fits: dict, b0: int, l0: int):
    fig, ax = lab.new_figure(6.0, 3.4)
    for backend in BACKENDS:
        ax.plot(lengths, fits[backend], "o-", label=backend)
    ax.plot(lengths, [b0 * l0 / t for t in lengths], "k:", label="B0 x L0 / L")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="sequence length L",
        ylabel="largest batch in the budget",
        title="one activation-memory budget",
    )
    ax.legend(fontsize=7)
    return fig
