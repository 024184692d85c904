"""Seed 002: "微调里常听到的 LoRA/PEFT，动的主要就是注意力那几个投影矩阵": are the attention
projections the place to put the adapters?

lora-works' setting (the lab's char GPT pretrained on the modern plays, fine-tuned on Folio
Hamlet until the validation loss on Folio Julius Caesar stops falling, the best weights judged on
Folio Macbeth), with LoRA in three places at the same steps and batches:
on the attention projections (q, k, v, o), on the FFN's two matrices (fc_in, fc_out), with ranks
chosen so that both train the same number of parameters, and on both at once (all linear
layers). Quality is the held-out loss.
"""

from __future__ import annotations

from glassformer.lab import base as lab
from glassformer.lab.char_gpt import char_gpt
from glassformer.lab.exp_lora_works import budget, fine_tune, folio_ids, plateau
from glassformer.lab.fit import eval_loss

# Equal budgets: per layer, LoRA of rank r on q, k, v, o (each d -> d) trains 4 * 2d * r numbers,
# on fc_in (d -> 4d) and fc_out (4d -> d) 2 * 5d * r: ranks 5 and 4 give 40d each.
SYSTEMS = {  # key -> (label, targets, rank)
    "attention": ("LoRA on attention (q,k,v,o), r=5", "q,k,v,o", 5),
    "ffn": ("LoRA on the FFN (fc_in, fc_out), r=4", "fc_in,fc_out", 4),
    "all": ("LoRA on both (all linear), r=4", "all-linear", 4),
}
SYSTEMS_ZH = {
    "attention": "注意力上的 LoRA（q,k,v,o），r=5",
    "ffn": "FFN 上的 LoRA（fc_in, fc_out），r=4",
    "all": "两处都加（全部线性层），r=4",
}
# Thresholds, stated once. Preconditions: every fine-tune reached its plateau (lora-works'
# rule) and the two equal budgets are equal (within 1%). "The attention projections are the
# place": at the same trainable parameters, LoRA on attention is not worse than LoRA on the FFN
# beyond the seeds' spread, and gets at least 80% of what LoRA on every linear layer gains over
# the base.
MAX_BUDGET_MISMATCH = 0.01
MIN_SHARE_OF_ALL = 0.8


@lab.register("lora-targets")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    say, seeds = ctx.say, ctx.seeds()
    runs = {key: [] for key in SYSTEMS}
    base_loss = []
    for seed in seeds:
        gpt = char_gpt(ctx, seed=seed)
        folio = folio_ids(gpt.tokenizer)
        base_loss.append(
            eval_loss(gpt.model, folio.test, gpt.recipe.context, budget(ctx).n_test, seed=seed)
        )
        for key, (_, targets, rank) in SYSTEMS.items():
            runs[key].append(fine_tune(ctx, gpt.model, targets, True, seed, folio, rank))
    base = lab.over_seeds(base_loss)
    held_out = {key: lab.over_seeds([r.held_out for r in rs]) for key, rs in runs.items()}
    for key, (label, _, _) in SYSTEMS.items():
        say(label, SYSTEMS_ZH[key])
    share = {key: rs[0].fraction for key, rs in runs.items()}
    checks = [plateau(ctx, SYSTEMS[k][0], SYSTEMS_ZH[k], runs[k]) for k in SYSTEMS]
    checks.append(
        lab.precondition(
            lab.at_most(
                say(
                    "trainable parameters, |attention / FFN - 1|", "可训练参数：|注意力 / FFN - 1|"
                ),
                abs(share["attention"] / share["ffn"] - 1),
                MAX_BUDGET_MISMATCH,
            )
        )
    )
    group = say("the attention projections are where LoRA goes", "LoRA 加在注意力投影上")
    gain_all = base.mean - held_out["all"].mean
    gain_attention = base.mean - held_out["attention"].mean
    combined = (held_out["ffn"].spread ** 2 + held_out["attention"].spread ** 2) ** 0.5
    checks += [
        lab.at_least(
            say(
                "held-out loss: LoRA on the FFN - LoRA on attention, equal parameters "
                "(nats; want >= - the seeds' spread)",
                "留出损失：FFN 上的 LoRA - "
                "注意力上的 LoRA，参数量相同（nats；要求 >= 负的随机种子波动）",
            ),
            held_out["ffn"].mean - held_out["attention"].mean,
            -combined,
            group=group,
        ),
        lab.at_least(
            say(
                "LoRA on attention's share of the gain of LoRA on every linear layer",
                "注意力上的 LoRA 拿到的“全部线性层 LoRA”增益的比例",
            ),
            gain_attention / gain_all if gain_all > 0 else 0.0,
            MIN_SHARE_OF_ALL,
            group=group,
        ),
    ]
    system, trainable = say("system", "方案"), say("trainable share", "可训练参数占比")
    loss = say("held-out Folio Macbeth loss (nats/char)", "留出的 Folio《麦克白》损失（nats/字符）")
    gain = say("gain over the base (nats/char)", "相对基座的增益（nats/字符）")
    rows = [
        {
            system: say("base, not fine-tuned", "基座，未微调"),
            trainable: "0",
            loss: str(base),
            gain: 0.0,
        }
    ]
    rows += [
        {
            system: SYSTEMS[k][0],
            trainable: f"{share[k]:.2%}",
            loss: str(held_out[k]),
            gain: base.mean - held_out[k].mean,
        }
        for k in SYSTEMS
    ]
    size = budget(ctx)
    notes = [
        ctx.say(
            f"base: the lab's char GPT, one per seed ({seeds}), fine-tuned up to {size.steps} "
            f"steps of {size.batch_size} windows on Folio Hamlet, the best weights on Folio "
            "Julius Caesar kept (the setting of lora-works); alpha = 2 x rank; the base's FFN is "
            "a GELU MLP (fc_in, fc_out)",
            f"基座：本实验室的字符级 GPT，每个随机种子一个（{seeds}），在第一对开本《哈姆雷特》上"
            f"最多微调 {size.steps} 步，每步 {size.batch_size} 个窗口，保留在 Folio《裘力斯·凯撒》"
            "上验证损失最好的权重（与 lora-works 相同）；alpha = 2 x 秩；基座的 FFN 是 GELU MLP"
            "（fc_in, fc_out）",
        )
    ]
    data = {
        "seeds": seeds,
        "base": base_loss,
        "fraction": share,
        "held_out": {k: [r.held_out for r in rs] for k, rs in runs.items()},
    }
    return lab.Result.from_checks(
        rows, checks, figure=_plot(held_out, base, share), data=data, notes=notes
    )


def _plot(held_out: dict, base: lab.Spread, share: dict):
    fig, ax = lab.new_figure(6.4, 3.6)
    keys = list(SYSTEMS)
    ax.bar(
        range(len(keys)),
        [base.mean - held_out[k].mean for k in keys],
        yerr=[held_out[k].spread for k in keys],
        capsize=4,
        color=["C0", "C1", "C2"],
    )
    ax.set_xticks(range(len(keys)), [f"{k}\n{100 * share[k]:.2g}% trained" for k in keys])
    ax.set(
        ylabel="gain over the base (nats/char, ± spread)",
        title="held-out Folio Macbeth: where the adapters go",
    )
    return fig
