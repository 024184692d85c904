"""Seed 002 练习 1 第 4 步: "把句子换成'律师把文件交给助理因为他快迟到了'，看'他'的注意力落在'律师'
还是'助理'——模型的判断跟你的直觉一致吗？"

The intuition: the one who hands the file over is the one about to be late, so 他 is 律师. Read
as the seed's hands-on code reads 它 (last layer, mean over heads, the pronoun's row; SmolLM2,
per character: exp_exercise_cat_first.py), on the seed's sentence, on five more pairs of roles
in it, and on the same twelve nouns with an ending that points the other way ("…因为他要签字":
the one who receives the file signs it, so 他 is 助理). The giver always comes first, so a model
that only prefers a position (the first noun, or the nearer one) is right in one ending and
wrong in the other; one that follows the meaning is right in both.

SmolLM2 is causal: 他's row is computed before the ending exists, so its attention is the same
in both endings and cannot follow them (a row, with the seed's sentence as the one check of the
exercise as written). The model's judgement, the seed's question, is read where it has seen the
whole sentence: after "…。他指的是", which noun is more likely next (the sum of its pieces' log
probabilities).
"""

from __future__ import annotations

import torch

from glassformer.lab import base as lab
from glassformer.lab.exp_exercise_cat_first import read, tokenizer_and_models

SEED = ("律师", "助理")
ROLES = [
    SEED,
    ("医生", "护士"),
    ("老师", "学生"),
    ("经理", "秘书"),
    ("司机", "乘客"),
    ("老板", "员工"),
]
TEMPLATE = "{giver}把文件交给{receiver}因为他快迟到了"  # the seed's: 他 is the giver
OTHER_WAY = "{giver}把文件交给{receiver}因为他要签字"  # 他 is the receiver
QUESTION = "。他指的是"
# Thresholds, stated once. "跟你的直觉一致": in the seed's sentence 律师 gets more of 他's attention
# than 助理; and over the six pairs in both endings (12 sentences) the model's judgement (the
# likelier noun after QUESTION) is the intended one in at least 9 (a positional preference alone
# is right in 6), and in more sentences than with random weights.
MIN_BOTH_ORDERS = 9


@lab.register("lawyer-assistant")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    say = ctx.say
    tokenizer, models, vocab = tokenizer_and_models(ctx)
    cases = [(TEMPLATE.format(giver=a, receiver=b), a, b) for a, b in ROLES]
    cases += [(OTHER_WAY.format(giver=a, receiver=b), b, a) for a, b in ROLES]
    margin = {}  # model -> per sentence: the intended noun's attention - the other's
    judged = {}  # model -> per sentence: log P(intended noun) - log P(other) after QUESTION
    for name, model in models.items():
        margin[name], judged[name] = [], []
        for sentence, meant, other in cases:
            row = read(model, tokenizer, vocab, sentence, "他")
            margin[name].append(row.of(meant) - row.of(other))
            judged[name].append(judgement(model, tokenizer, vocab, sentence, meant, other))
    trained, control = list(models)
    wins = {name: sum(m > 0 for m in ms) for name, ms in judged.items()}
    late_wins = {name: sum(m > 0 for m in ms[: len(ROLES)]) for name, ms in judged.items()}
    group = say("the model reads 他 as the intuition does", "模型对“他”的理解与直觉一致")
    checks = [
        lab.at_least(
            say(
                f"the seed's sentence: attention on 律师 - on 助理 ({trained})",
                f"原文句子：“律师”的注意力 - “助理”的（{trained}）",
            ),
            margin[trained][0],
            0.0,
            group=group,
        ),
        lab.at_least(
            say(
                f"sentences where the model judges 他 as the intuition does, both "
                f"endings ({trained}, of {len(cases)})",
                f"模型对“他”的判断与直觉一致的句子数，两种结尾（{trained}，共 {len(cases)} 句）",
            ),
            wins[trained],
            MIN_BOTH_ORDERS,
            group=group,
        ),
        lab.at_least(
            say("sentences won: trained - random weights", "胜出的句子数：训练过的 - 随机权重"),
            wins[trained] - wins[control],
            1,
            group=group,
        ),
    ]
    sentence_col, meant_col = say("sentence", "句子"), say("他 is", "“他”指")
    cols = {
        name: say(
            f"attention on 他's row: intended - other, {name}",
            f"“他”那一行的注意力：所指 - 另一个，{_zh(name)}",
        )
        for name in models
    }
    judge_cols = {
        name: say(
            f"log P after {QUESTION}: intended - other, {name}",
            f"{QUESTION}之后的 log P：所指 - 另一个，{_zh(name)}",
        )
        for name in models
    }
    rows = [
        {
            sentence_col: sentence,
            meant_col: meant,
            **{cols[n]: margin[n][i] for n in models},
            **{judge_cols[n]: judged[n][i] for n in models},
        }
        for i, (sentence, meant, _) in enumerate(cases)
    ]
    notes = [
        ctx.say(
            f"{trained}: the model's judgement after {QUESTION!r} is the intended noun in "
            f"{wins[trained]} of "
            f"{len(cases)} sentences ({late_wins[trained]} of {len(ROLES)} ending 快迟到了, "
            f"{wins[trained] - late_wins[trained]} ending 要签字); random weights "
            f"{wins[control]}",
            f"{trained}：在“{QUESTION}”之后，{len(cases)} 句中模型判断与直觉一致的有 "
            f"{wins[trained]} 句（以“快迟到了”结尾的 {len(ROLES)} 句中 {late_wins[trained]} "
            f"句，以“要签字”结尾的 {wins[trained] - late_wins[trained]} 句）；随机权重 "
            f"{wins[control]} 句",
        ),
        ctx.say(
            "他's attention is the same in both endings (it is computed before they exist): "
            "a causal model's pronoun cannot look at what comes after it; the seed's BERT "
            "could. The judgement is read after the whole sentence",
            "两种结尾下“他”的注意力完全相同（它在结尾出现之前就算完了）：因果模型的代词看不到"
            "后文，原文的 BERT 可以。模型的判断在读完整句之后读取",
        ),
        ctx.say(
            f"in the seed's sentence 律师 gets {margin[trained][0]:+.2f} more of 他's "
            "attention than 助理, but 律 is the first character, where a causal model parks "
            "most of its weight (see attention-sinks): the giver, first in every sentence, "
            "gets it whatever 他 means",
            f"原文句子里“律师”比“助理”多得 {margin[trained][0]:+.2f} 的注意力，但“律”是第一个"
            "字，因果模型把大部分权重停放在那里（见 attention-sinks）：递文件者在每句里都在"
            "最前，不管“他”指谁都会拿到这部分权重",
        ),
        ctx.say(
            "the giver comes first in every sentence: a model that favours the first noun is "
            "right in every 快迟到了 sentence and wrong in every 要签字 one, one that favours "
            "the nearer noun the other way round",
            "每句里递文件者都在前：偏爱第一个名词的模型在“快迟到了”的句子里全对、在“要签字”"
            "的句子里全错，偏爱更近名词的则反过来",
        ),
    ]
    data = {"cases": cases, "attention_margin": margin, "judgement": judged}
    return lab.Result.from_checks(rows, checks, figure=_plot(judged, cases), data=data, notes=notes)


@torch.no_grad()
def judgement(model, tokenizer, vocab: int, sentence: str, meant: str, other: str) -> float:
    """log P(meant | sentence + QUESTION) - log P(other | ...), each noun's pieces summed."""
    prefix = tokenizer.encode(sentence + QUESTION, add_special_tokens=False)

    def logprob(noun: str) -> float:
        pieces = tokenizer.encode(noun, add_special_tokens=False)
        ids = torch.tensor([[i % vocab for i in prefix + pieces]])
        logp = model(ids)[0].float().log_softmax(-1)  # (T, V)
        return sum(float(logp[len(prefix) - 1 + k, p % vocab]) for k, p in enumerate(pieces))

    return logprob(meant) - logprob(other)


def _zh(name: str) -> str:
    return "随机权重" if name == "random weights" else name


def _plot(judged: dict, cases: list):
    fig, ax = lab.new_figure(8.0, 3.4)
    labels = [f"{s[:2]}→{s[7:9]}，{'迟到' if '迟到' in s else '签字'}" for s, _, _ in cases]
    with lab.cjk_text():
        lab.grouped_bars(ax, labels, judged, rotation=60, fontsize=7)
        ax.axhline(0, color="k", linewidth=0.8)
        ax.set(
            ylabel=f"log P after {QUESTION}: intended - other", title=f"{TEMPLATE} / {OTHER_WAY}"
        )
        ax.legend(fontsize=7)
    return fig
