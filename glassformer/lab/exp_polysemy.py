"""Seed 002 「第②步的主角：Embedding」: after the attention layers the same word has different
vectors in different sentences ("苹果发布会" vs "苹果真甜").

The contextual vector of apple/苹果 (the hidden state at the word: MiniLM's output, the mean of
its pieces; SmolLM2's residual stream after the middle block, at the word's last token) in two
fruit sentences and two company sentences. Precondition: the word enters as the same token ids
in every sentence, so its input embedding is identical. Evidence: two sentences of the same
sense give more similar vectors than two of different senses, and each vector is closer to its
sense's neighbour words (fruit words, company words; each in a neutral frame) than to the other
sense's. A causal model only sees the left context, so for SmolLM2 the word comes after the
words that decide its sense; the seed's own phrases, where 苹果 comes first, are reported too.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from glassformer.inspect import capture
from glassformer.lab import base as lab
from glassformer.lab.exp_embedding_distances import unreadable_tokens

# {language: {sense: sentences}}, with the word each sentence holds. MiniLM is bidirectional and
# uncased, so it gets the English sentences as given; SmolLM2 needs the sense before the word,
# and the same token (" apple": "Apple" at the start of a sentence is another token).
SENTENCES = {
    "minilm": {
        "en": {
            "fruit": ["I ate an apple", "She picked a ripe apple from the tree"],
            "company": ["Apple released a new iPhone", "He works as an engineer at Apple"],
        },
        "zh": {
            "fruit": ["苹果真甜", "我吃了一个苹果"],
            "company": ["苹果发布会", "乔布斯创办了苹果"],
        },
    },
    "smollm2": {
        "en": {
            "fruit": ["I ate an apple", "She picked a ripe apple"],
            "company": ["The new iPhone was released by apple", "He works as an engineer at apple"],
        },
        "zh": {
            "fruit": ["我吃了一个苹果", "她从树上摘了一个红苹果"],
            "company": ["乔布斯创办了苹果", "库克是这家科技公司苹果"],
        },
    },
}
WORD = {"en": "apple", "zh": "苹果"}
NEIGHBOURS = {
    "en": {
        "fruit": ["banana", "orange", "pear", "grape"],
        "company": ["Microsoft", "Google", "Samsung", "Amazon"],
    },
    "zh": {"fruit": ["香蕉", "橙子", "梨", "葡萄"], "company": ["微软", "谷歌", "三星", "亚马逊"]},
}
FRAME = {"en": "Word: {}", "zh": "词语：{}"}  # a neutral left context for SmolLM2's neighbours
SEED_PHRASES = ("苹果发布会", "苹果真甜")  # the seed's example: 苹果 comes first
LANGS_ZH = {"en": "英文", "zh": "中文"}
# Thresholds: a difference counts when it exceeds the pairs' own scatter (lab.exceeds_spread,
# no extra margin): within-sense similarities (2 pairs) against cross-sense ones (4 pairs); and
# for each sense, the similarities of its 2 word vectors to its 4 neighbours (8 values) against
# those to the other sense's 4 neighbours.


def word_span(tokenizer, text: str, word: str, specials: int) -> tuple[list[int], list[int]]:
    """(ids of the text, positions of the word's tokens): tokenize the text before the word,
    then up to its end; `specials` tokens ([CLS]) come first in the model's input."""
    end = text.lower().index(word.lower()) + len(word)  # MiniLM's "Apple" is its "apple"
    start = end - len(word)
    if start and text[start - 1] == " ":  # byte-level BPE: the space belongs to the word
        start -= 1
    before = tokenizer.encode(text[:start], False) if start else []
    through = tokenizer.encode(text[:end], False)
    if through[: len(before)] != before:
        raise ValueError(f"{word!r} merges with the text before it in {text!r}: reword it")
    positions = list(range(specials + len(before), specials + len(through)))
    return _model_ids(tokenizer, text, specials), positions


def _model_ids(tokenizer, text: str, specials: int) -> list[int]:
    return tokenizer.encode(text) if specials else tokenizer.encode(text, False)


@torch.no_grad()
def layer_vectors(
    model, tokenizer, texts: list[str], words: list[str], causal: bool
) -> tuple[list[torch.Tensor], list]:
    """Per layer, the (N, C) vectors of words[i] in texts[i]: the last token's state in a causal
    model (it has seen the whole word), the mean over the pieces in a bidirectional one."""
    specials = 0 if causal else 1
    spans = [word_span(tokenizer, t, w, specials) for t, w in zip(texts, words, strict=True)]
    width = max(len(ids) for ids, _ in spans)
    batch = torch.zeros(len(spans), width, dtype=torch.long)
    mask = torch.zeros(len(spans), width, dtype=torch.bool)
    for row, (ids, _) in enumerate(spans):
        batch[row, : len(ids)], mask[row, : len(ids)] = torch.tensor(ids), True
    with capture(model) as cap:
        if causal:  # right padding: a causal model never sees it from earlier positions
            model(batch)
        else:
            model(batch, padding_mask=mask)
    out = []
    for layer in range(len(cap.residual)):
        hidden = cap.residual[layer]  # (N, T, C)
        out.append(
            torch.stack(
                [
                    hidden[row, pos[-1]] if causal else hidden[row, pos].mean(0)
                    for row, (_, pos) in enumerate(spans)
                ]
            )
        )
    return out, spans


def cosine(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """(N, C), (M, C) -> (N, M) cosine similarities."""
    return (F.normalize(a.double(), dim=-1) @ F.normalize(b.double(), dim=-1).T).numpy()


def sense_scores(apples: torch.Tensor, neighbours: dict[str, torch.Tensor]) -> dict:
    """apples: (4, C), fruit sentences first. Within- and cross-sense similarities, and each
    sense's similarities to its own and to the other sense's neighbours."""
    sims = cosine(apples, apples)
    fruit, company = [0, 1], [2, 3]
    out = {
        "within": [sims[0, 1], sims[2, 3]],
        "cross": [sims[i, j] for i in fruit for j in company],
    }
    for sense, rows, other in (("fruit", fruit, "company"), ("company", company, "fruit")):
        out[f"{sense}: own"] = cosine(apples[rows], neighbours[sense]).ravel().tolist()
        out[f"{sense}: other"] = cosine(apples[rows], neighbours[other]).ravel().tolist()
    return out


def _models(ctx: lab.RunContext) -> dict:
    from glassformer.interop.pretrained import from_pretrained

    names = ctx.pick(["minilm", "smollm2"], ["minilm", "smollm2"], ["minilm"])
    return {name: from_pretrained(name) for name in names}


@lab.register("polysemy")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    say = ctx.say
    say("yes", "是")
    say("no: [UNK]", "否：[UNK]")
    differ = say("vectors differ by sense", "向量随词义而不同")
    closer = say("closer to its sense's neighbours", "更接近同一词义的近邻词")
    rows, checks, notes, curves = [], [], [], {}
    for name, (model, tokenizer) in _models(ctx).items():
        causal = model.cfg.family == "gpt"
        chosen = model.cfg.n_layers // 2 if causal else model.cfg.n_layers - 1
        for lang, senses in SENTENCES[name].items():
            word = WORD[lang]
            texts = senses["fruit"] + senses["company"]
            apples, spans = layer_vectors(model, tokenizer, texts, [word] * 4, causal)
            pieces = {tuple(ids[p] for p in pos) for ids, pos in spans}
            frames = [
                FRAME[lang].format(w) if causal else w
                for sense in ("fruit", "company")
                for w in NEIGHBOURS[lang][sense]
            ]
            words = [w for sense in ("fruit", "company") for w in NEIGHBOURS[lang][sense]]
            near, _ = layer_vectors(model, tokenizer, frames, words, causal)
            k = len(NEIGHBOURS[lang]["fruit"])
            where = say(
                f"{name}, {lang}, layer {chosen}", f"{name}，{LANGS_ZH[lang]}，第 {chosen} 层"
            )
            unreadable = unreadable_tokens(tokenizer, list(next(iter(pieces))))
            meaningful = not (set(unreadable) & {"[UNK]"})  # byte pieces compose in context
            per_layer = [
                sense_scores(a, {"fruit": n[:k], "company": n[k:]})
                for a, n in zip(apples, near, strict=True)
            ]
            curves[f"{name}, {lang}"] = [
                np.mean(s["within"]) - np.mean(s["cross"]) for s in per_layer
            ]
            scores = per_layer[chosen]
            stats = {key: lab.over_seeds(values) for key, values in scores.items()}
            where_zh = f"{name}，{LANGS_ZH[lang]}，第 {chosen} 层"
            rows.append(
                {
                    say("model, language, layer", "模型，语言，层"): where,
                    say("word pieces", "词的子词数"): len(next(iter(pieces))),
                    say("same input ids", "输入 id 相同"): len(pieces) == 1,
                    say("sim within sense", "同一词义内的相似度"): str(stats["within"]),
                    say("sim across senses", "不同词义间的相似度"): str(stats["cross"]),
                    say(
                        "fruit sense→fruit / company words", "水果义→水果词 / 公司词"
                    ): f"{stats['fruit: own'].mean:.3f} / {stats['fruit: other'].mean:.3f}",
                    say(
                        "company sense→company / fruit words", "公司义→公司词 / 水果词"
                    ): f"{stats['company: own'].mean:.3f} / {stats['company: other'].mean:.3f}",
                    say("evidence?", "算作证据？"): "yes" if meaningful else "no: [UNK]",
                }
            )
            checks.append(
                lab.precondition(
                    lab.approx(
                        say(
                            f"{name}, {lang}: distinct input id sequences of {word} over 4 "
                            "sentences",
                            f"{name}，{LANGS_ZH[lang]}：{word} 在 4 个句子中不同输入 id 序列的个数",
                        ),
                        len(pieces),
                        1,
                        0,
                    )
                )
            )
            if not meaningful:
                notes.append(
                    say(
                        f"{name}, {lang}: {word} is [UNK] to this tokenizer (and so is "
                        "every Chinese character): no evidence",
                        f"{name}，{LANGS_ZH[lang]}：{word} 对这个分词器是 [UNK]"
                        "（每个汉字也都是）：不算证据",
                    )
                )
                continue
            checks += [
                lab.exceeds_spread(
                    say(
                        f"{where}: sim within sense - across senses",
                        f"{where_zh}：同一词义内的相似度 - 不同词义间的相似度",
                    ),
                    stats["within"],
                    stats["cross"],
                    group=differ,
                ),
                lab.exceeds_spread(
                    say(
                        f"{where}: fruit-sense {word} → fruit - company words",
                        f"{where_zh}：水果义的 {word} → 水果词 - 公司词",
                    ),
                    stats["fruit: own"],
                    stats["fruit: other"],
                    group=closer,
                ),
                lab.exceeds_spread(
                    say(
                        f"{where}: company-sense {word} → company - fruit words",
                        f"{where_zh}：公司义的 {word} → 公司词 - 水果词",
                    ),
                    stats["company: own"],
                    stats["company: other"],
                    group=closer,
                ),
            ]
        if causal:
            phrases, _ = layer_vectors(model, tokenizer, list(SEED_PHRASES), ["苹果"] * 2, True)
            same = float(cosine(phrases[chosen][:1], phrases[chosen][1:])[0, 0])
            notes.append(
                say(
                    f"{name}: 苹果 in the seed's {SEED_PHRASES}: cosine {same:.4f} at "
                    f"layer {chosen}; a causal model sees only what comes before the "
                    "word, and here nothing does",
                    f"{name}：原文 {SEED_PHRASES} 中的 苹果 在第 {chosen} 层的余弦相似度"
                    f"为 {same:.4f}；因果模型只看得到这个词之前的内容，而这里它前面"
                    "什么也没有",
                )
            )
    figure = _plot(curves)
    return lab.Result.from_checks(
        rows, checks, figure=figure, data={"margins": curves}, notes=notes
    )


def _plot(curves: dict):
    fig, ax = lab.new_figure(6.4, 3.6)
    for label, values in curves.items():
        ax.plot(range(len(values)), values, marker="o", markersize=3, label=label)
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xlabel("layer (block output)")
    ax.set_ylabel("cosine within sense - across senses")
    ax.set_title("apple / 苹果: same word, different sense")
    ax.legend(fontsize=7)
    return fig
