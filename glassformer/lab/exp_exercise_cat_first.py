"""Seed 002's hands-on code: take the last layer's attention, average the heads, read the row of
"它" in "那只猫没跳上桌子因为它太累了", print its top 3: "通常你会看到 '猫' 排在前面".

The seed runs bert-base-chinese, which is not installed here (and all-MiniLM-L6-v2's vocabulary
reads 猫 as [UNK]), so the code runs on SmolLM2-135M. It is causal, which this sentence allows:
猫 comes before 它. SmolLM2 cuts a Chinese character into byte pieces, so a character's
attention is the sum over its pieces, read from the last piece of 它. The seed's sentence, then
eight of the same shape with other animals and objects: does the animal outrank the object it
did not cross? Control: the same architecture with random weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glassformer.inspect import capture
from glassformer.lab import base as lab

SEED_SENTENCE = ("那只猫没跳上桌子因为它太累了", "它", "猫", "桌子")
VARIANTS = [  # (sentence, pronoun, the animal it refers to, the object)
    ("那只狗没跑过马路因为它太累了", "它", "狗", "马路"),
    ("那只鸟没飞过大楼因为它太累了", "它", "鸟", "大楼"),
    ("那匹马没跳过栅栏因为它太累了", "它", "马", "栅栏"),
    ("那只兔子没爬上山坡因为它太累了", "它", "兔子", "山坡"),
    ("那头牛没走过小桥因为它太累了", "它", "牛", "小桥"),
    ("那只猴子没爬上大树因为它太累了", "它", "猴子", "大树"),
    ("那条鱼没游过河口因为它太累了", "它", "鱼", "河口"),
    ("那只羊没跳过水沟因为它太累了", "它", "羊", "水沟"),
]
TOP = 3  # the seed prints the top 3
# Thresholds, stated once. "排在前面": in the seed's sentence 猫 is among the top 3 characters of
# 它's row; over the eight variants the animal gets more attention than the object in at least 6
# (a sign test's one-sided p = 0.145 at 6 of 8 by chance alone, 0.035 at 7: the bar is "usually",
# the seed's word, not significance), and more often than in the random-weights control.
MIN_VARIANTS = 6


@dataclass
class Row:
    """One sentence read by one model: each character's attention from the pronoun."""

    sentence: str
    weights: dict[int, float]  # character index -> summed attention from the pronoun
    pronoun_at: int  # character index of the pronoun

    def of(self, word: str) -> float:
        """A word's attention: the sum over its characters."""
        start = self.sentence.index(word)
        return sum(self.weights.get(i, 0.0) for i in range(start, start + len(word)))

    def top(self, k: int = TOP) -> list[str]:
        ranked = sorted(self.weights.items(), key=lambda item: -item[1])
        return [self.sentence[i] for i, _ in ranked[:k]]

    def rank_of(self, word: str) -> int:
        """1-based rank of the word's first character among the characters."""
        start = self.sentence.index(word)
        return 1 + sum(w > self.weights.get(start, 0.0) for w in self.weights.values())


def tokenizer_and_models(ctx: lab.RunContext):
    """(tokenizer, {"SmolLM2-135M": model, "random weights": model}, vocab limit): SmolLM2 and
    its random twin; in tiny mode a random 2-layer model of its shape stands in for both."""
    from glassformer.interop.gguf import read_gguf, tokenizer_from_gguf
    from glassformer.interop.pretrained import resolve
    from glassformer.models import build_model

    tokenizer = tokenizer_from_gguf(read_gguf(resolve("smollm2")))
    model, name = lab.smollm2_or_stand_in(ctx)
    torch.manual_seed(ctx.seed)
    twin = build_model(model.cfg).eval()
    return tokenizer, {name: model, "random weights": twin}, model.cfg.vocab_size


@torch.no_grad()
def read(model, tokenizer, vocab: int, sentence: str, pronoun: str) -> Row:
    """The seed's recipe: last layer, mean over heads, the pronoun's row; per character."""
    encoding = tokenizer.hf.encode(sentence, add_special_tokens=False)
    ids = torch.tensor([[i % vocab for i in encoding.ids]])  # % vocab: the tiny stand-in
    owner = [start for start, _ in encoding.offsets]  # the character each piece starts in
    at = sentence.index(pronoun)
    query = max(i for i, c in enumerate(owner) if c == at)  # the pronoun's last piece
    with capture(model, residual=False) as cap:
        model(ids)
    row = cap.attention[-1][0].float().mean(0)[query]  # (T,)
    weights: dict[int, float] = {}
    for piece, char in enumerate(owner[: query + 1]):
        weights[char] = weights.get(char, 0.0) + float(row[piece])
    return Row(sentence, weights, at)


@lab.register("cat-ranked-first")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    say = ctx.say
    tokenizer, models, vocab = tokenizer_and_models(ctx)
    sentences = [SEED_SENTENCE, *VARIANTS]
    read_by = {
        name: [read(m, tokenizer, vocab, s, p) for s, p, _, _ in sentences]
        for name, m in models.items()
    }
    trained, control = list(models)
    wins = {
        name: sum(r.of(a) > r.of(o) for r, (_, _, a, o) in zip(rows[1:], VARIANTS, strict=True))
        for name, rows in read_by.items()
    }
    seed_row = read_by[trained][0]
    group = say("猫 usually ranks near the top", "通常你会看到“猫”排在前面")
    checks = [
        lab.at_most(
            say(
                f"rank of 猫 in 它's row, the seed's sentence ({trained})",
                f"原文句子中“猫”在“它”那一行里的名次（{trained}）",
            ),
            seed_row.rank_of("猫"),
            TOP,
            group=group,
        ),
        lab.at_least(
            say(
                f"variants where the animal outranks the object ({trained}, of {len(VARIANTS)})",
                f"动物得分高于物体的变体句数（{trained}，共 {len(VARIANTS)} 句）",
            ),
            wins[trained],
            MIN_VARIANTS,
            group=group,
        ),
        lab.at_least(
            say("variants won: trained - random weights", "胜出的变体句数：训练过的 - 随机权重"),
            wins[trained] - wins[control],
            1,
            group=group,
        ),
    ]
    rows = _rows(ctx, read_by, sentences)
    notes = _notes(ctx, read_by, trained, control, wins)
    data = {
        name: [
            {"sentence": r.sentence, "weights": {str(k): v for k, v in r.weights.items()}}
            for r in rows
        ]
        for name, rows in read_by.items()
    }
    figure = _plot(seed_row, read_by[control][0], trained)
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _rows(ctx, read_by: dict, sentences: list) -> list[dict]:
    say = ctx.say
    sentence_col, model_col = say("sentence", "句子"), say("model", "模型")
    top_col = say(f"top {TOP} characters of the pronoun's row", f"代词那一行的前 {TOP} 个字")
    animal_col, object_col = say("animal", "动物"), say("object", "物体")
    rows = []
    for name, read_rows in read_by.items():
        for r, (_, _, animal, thing) in zip(read_rows, sentences, strict=True):
            rows.append(
                {
                    sentence_col: r.sentence,
                    model_col: say(name, _zh(name)),
                    top_col: " ".join(r.top()),
                    animal_col: f"{animal} {r.of(animal):.3f}",
                    object_col: f"{thing} {r.of(thing):.3f}",
                }
            )
    return rows


def _zh(name: str) -> str:
    return "随机权重" if name == "random weights" else name


def _notes(ctx, read_by, trained, control, wins) -> list[str]:
    seed_row = read_by[trained][0]
    first = seed_row.sentence[0]
    return [
        ctx.say(
            f"{trained}, last layer, mean over heads, the row of 它's last byte piece (a "
            f"character's weight is the sum over its pieces); the seed's sentence gives the "
            f"top {TOP} {' '.join(seed_row.top())}",
            f"{trained}，最后一层，对所有头取平均，取“它”最后一个字节片段那一行（一个字的权重是"
            f"其各片段之和）；原文句子的前 {TOP} 名是 {' '.join(seed_row.top())}",
        ),
        ctx.say(
            f"the animal outranks the object in {wins[trained]} of {len(VARIANTS)} variants "
            f"({trained}) and in {wins[control]} with random weights",
            f"动物得分高于物体的变体句：{trained} {wins[trained]} 句（共 {len(VARIANTS)} 句），"
            f"随机权重 {wins[control]} 句",
        ),
        ctx.say(
            f"much of a causal model's last-layer attention goes to the first character "
            f"({first!r}: {seed_row.weights.get(0, 0.0):.2f} in the seed's sentence), a sink "
            "that ranks high in every row; the seed's BERT has [CLS] and [SEP] for that",
            f"因果模型最后一层的注意力有不少落在第一个字上（原文句子中“{first}”为 "
            f"{seed_row.weights.get(0, 0.0):.2f}），它在每一行里都排得靠前；原文用的 BERT "
            "里由 [CLS] 和 [SEP] 担任这个角色",
        ),
    ]


def _plot(seed_row: Row, control_row: Row, name: str):
    fig, ax = lab.new_figure(7.0, 3.4)
    chars = list(range(seed_row.pronoun_at + 1))
    labels = [seed_row.sentence[i] for i in chars]
    with lab.cjk_text():
        lab.grouped_bars(
            ax,
            labels,
            {
                name: [seed_row.weights.get(i, 0.0) for i in chars],
                "random weights": [control_row.weights.get(i, 0.0) for i in chars],
            },
        )
        ax.set(
            xlabel="character (up to 它)",
            ylabel="attention from 它 (last layer, head mean)",
            title="那只猫没跳上桌子因为它太累了",
        )
        ax.legend(fontsize=7)
    return fig
