"""Seed 002 「第②步的主角：Embedding」: "猫" and "狗" live close, "猫" and "发票" ten streets apart.

Cosine similarities of 猫/狗/发票 and cat/dog/invoice in three representations: all-MiniLM-L6-v2
sentence embeddings (mean-pooled, the way it is trained), SmolLM2-135M's input embedding table
(a word = the mean of its tokens' rows), and SmolLM2's hidden state at the word's last token in
the middle layer (the bytes of a Chinese character composed into one vector). The margin a
difference must clear is the scatter of similarities between unrelated words in the same
representation. A (representation, language) whose words tokenize to [UNK] (MiniLM has no
Chinese characters) or, for the embedding table, to raw UTF-8 byte pieces is listed but is no
evidence: its vectors do not stand for the words.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from glassformer.infer.embed import embed
from glassformer.inspect import capture
from glassformer.lab import base as lab

WORDS = {"zh": ("猫", "狗", "发票"), "en": ("cat", "dog", "invoice")}
# Unrelated everyday nouns: their pairwise similarities are the baseline scatter of a model.
UNRELATED = {
    "zh": (
        "桌子",
        "河流",
        "音乐",
        "窗户",
        "面包",
        "山",
        "电脑",
        "鞋",
        "云",
        "钱",
        "花园",
        "信",
        "发动机",
        "纸",
        "学校",
        "锤子",
    ),
    "en": (
        "table",
        "river",
        "music",
        "window",
        "bread",
        "mountain",
        "computer",
        "shoe",
        "cloud",
        "money",
        "garden",
        "letter",
        "engine",
        "paper",
        "school",
        "hammer",
    ),
}
# Threshold: "住得近" vs "隔着十条街": sim(猫,狗) must beat sim(猫,发票) and sim(狗,发票) by at
# least one standard deviation of the similarities between unrelated words (the UNRELATED pairs)
# in the same representation, so that the gap is not within what any two unrelated words differ.
MARGIN_IN_SD = 1.0
FRAME = {"zh": "词语：{}", "en": "Word: {}"}  # a neutral left context for SmolLM2's hidden state
LANG_ZH = {"zh": "中文", "en": "英文"}


def cosine_matrix(vectors: torch.Tensor) -> np.ndarray:
    """(N, C) -> (N, N) cosine similarities."""
    unit = F.normalize(vectors.double(), dim=-1)
    return (unit @ unit.T).numpy()


def pair_similarities(sims: np.ndarray) -> np.ndarray:
    """The off-diagonal upper triangle of a similarity matrix: every unordered pair once."""
    rows, cols = np.triu_indices(len(sims), k=1)
    return sims[rows, cols]


def unreadable_tokens(tokenizer, ids: list[int]) -> list[str]:
    """The tokens that do not stand for text of their own: the unknown token ([UNK]) and
    byte-level pieces of a character (they decode to U+FFFD)."""
    unk = tokenizer.token_to_id("[UNK]") if hasattr(tokenizer, "token_to_id") else None
    bad = []
    for i in ids:
        text = tokenizer.decode([i])
        if (unk is not None and i == unk) or "\ufffd" in text:
            bad.append(text if "\ufffd" not in text else f"<byte piece {i}>")
    return bad


# --- the three representations: words -> (N, C) vectors, and which words are unreadable -------


def minilm_vectors(model, tokenizer, words: list[str]) -> tuple[torch.Tensor, list[str]]:
    ids = [tokenizer.encode(w) for w in words]  # [CLS] ... [SEP]
    bad = [w for w in words if unreadable_tokens(tokenizer, tokenizer.encode(w, False))]
    return embed(model, ids), bad


def table_vectors(model, tokenizer, words: list[str]) -> tuple[torch.Tensor, list[str]]:
    """SmolLM2's input embedding rows, averaged over a word's tokens; words carry a leading
    space, as they do inside running text."""
    table = model.tok_emb.weight.detach()
    ids = [tokenizer.encode(" " + w) for w in words]
    bad = [w for w, i in zip(words, ids, strict=True) if unreadable_tokens(tokenizer, i)]
    return torch.stack([table[i].mean(0) for i in ids]), bad


@torch.no_grad()
def hidden_vectors(model, tokenizer, words: list[str], lang: str) -> tuple[torch.Tensor, list]:
    """SmolLM2's residual stream after the middle block, at the word's last token, the word in
    a neutral frame. Right padding: a causal model never sees it from earlier positions."""
    frame = FRAME[lang]
    ids = [tokenizer.encode(frame.format(w)) for w in words]
    batch = torch.zeros(len(ids), max(len(i) for i in ids), dtype=torch.long)
    for row, i in enumerate(ids):
        batch[row, : len(i)] = torch.tensor(i)
    with capture(model) as cap:
        model(batch, last_token_only=True)
    hidden = cap.residual[model.cfg.n_layers // 2]  # (N, T, C)
    last = torch.tensor([len(i) - 1 for i in ids])
    return hidden[torch.arange(len(ids)), last], []


def _representations(ctx: lab.RunContext) -> dict:
    """English name -> (Chinese name, words -> vectors)."""
    from glassformer.interop.pretrained import from_pretrained

    minilm, minilm_tok = from_pretrained("minilm")
    found = {
        "MiniLM sentence embedding": (
            "MiniLM 句向量",
            lambda words, lang: minilm_vectors(minilm, minilm_tok, words),
        )
    }
    if not ctx.tiny:  # tiny mode: MiniLM only (SmolLM2 takes seconds to load)
        smol, smol_tok = from_pretrained("smollm2")
        layer = smol.cfg.n_layers // 2
        found["SmolLM2 input embedding"] = (
            "SmolLM2 输入嵌入表",
            lambda words, lang: table_vectors(smol, smol_tok, words),
        )
        found[f"SmolLM2 hidden, layer {layer}"] = (
            f"SmolLM2 第 {layer} 层隐藏状态",
            lambda words, lang: hidden_vectors(smol, smol_tok, words, lang),
        )
    return found


@lab.register("embedding-distances")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    rows, checks, notes, results = [], [], [], {}
    say = ctx.say
    for rep, (rep_zh, vectors_of) in _representations(ctx).items():
        for lang, (cat, dog, invoice) in WORDS.items():
            words = [cat, dog, invoice, *UNRELATED[lang]]
            vectors, unreadable = vectors_of(words, lang)
            sims = cosine_matrix(vectors)
            baseline = pair_similarities(sims[3:, 3:])  # unrelated pairs
            sd = float(baseline.std(ddof=1))
            cat_dog, cat_inv, dog_inv = sims[0, 1], sims[0, 2], sims[1, 2]
            meaningful = not unreadable
            where = say(f"{rep}, {lang}", f"{rep_zh}，{LANG_ZH[lang]}")
            results[where] = {
                "猫狗": cat_dog,
                "猫发票": cat_inv,
                "狗发票": dog_inv,
                "unrelated mean": float(baseline.mean()),
                "unrelated sd": sd,
                "meaningful": meaningful,
            }
            rows.append(
                {
                    say("representation", "表示"): rep,
                    say("words", "词"): f"{cat}/{dog}/{invoice}",
                    say("sim(猫,狗)", "相似度(猫,狗)"): cat_dog,
                    say("sim(猫,发票)", "相似度(猫,发票)"): cat_inv,
                    say("sim(狗,发票)", "相似度(狗,发票)"): dog_inv,
                    say("unrelated pairs: mean ± sd", "无关词对：均值 ± 标准差"): (
                        f"{baseline.mean():.3f} ± {sd:.3f}"
                    ),
                    say("evidence?", "算作证据？"): "yes"
                    if meaningful
                    else f"no: {len(set(unreadable))} of {len(words)} words unreadable",
                }
            )
            if not meaningful:
                targets = [w for w in (cat, dog, invoice) if w in unreadable]
                n_bad = len(set(unreadable))
                notes.append(
                    say(
                        f"{where}: not evidence, {n_bad} of {len(words)} "
                        f"words (among them {targets}) tokenize to [UNK] or byte pieces, "
                        "so their vectors do not stand for the words",
                        f"{ctx.zh[where]}：不算证据，{len(words)} 个词中有 {n_bad} 个（包括 "
                        f"{targets}）"
                        "被切成 [UNK] 或字节碎片，它们的向量代表不了这些词",
                    )
                )
                continue
            margin = MARGIN_IN_SD * sd
            where_zh = ctx.zh[where]
            for a, b in ((cat, invoice), (dog, invoice)):
                what = say(
                    f"{where}: sim({cat},{dog}) - sim({a},{b})",
                    f"{where_zh}：相似度({cat},{dog}) 减 相似度({a},{b})",
                )
                gap_ab = cat_dog - (cat_inv if a == cat else dog_inv)
                checks.append(lab.at_least(what, gap_ab, margin, group=where))
            gap = min(cat_dog - cat_inv, cat_dog - dog_inv) / sd if sd > 0 else float("nan")
            notes.append(
                say(
                    f"{where}: sim({cat},{dog}) exceeds the nearer of the two {invoice} "
                    f"pairs by {gap:.2f} sd of the unrelated pairs",
                    f"{where_zh}：相似度({cat},{dog}) 比两个含 {invoice} 的词对中较近的那个高出 "
                    f"{gap:.2f} 个无关词对标准差",
                )
            )
    figure = _plot(results)
    return lab.Result.from_checks(rows, checks, figure=figure, data=results, notes=notes)


def _plot(results: dict):
    fig, ax = lab.new_figure(max(7.0, 1.9 * len(results)), 4.0)
    names = list(results)
    labels = [
        name.replace(", ", "\n").replace(" ", "\n", 1)
        + ("" if results[name]["meaningful"] else "\n(not evidence)")
        for name in names
    ]
    series = {key: [results[n][key] for n in names] for key in ("猫狗", "猫发票", "狗发票")}
    lab.grouped_bars(ax, labels, {f"sim({k[0]},{k[1:]})": v for k, v in series.items()}, fontsize=7)
    x = np.arange(len(names))
    ax.errorbar(
        x,
        [results[n]["unrelated mean"] for n in names],
        yerr=[results[n]["unrelated sd"] for n in names],
        fmt="k_",
        markersize=14,
        capsize=4,
        label="unrelated pairs: mean ± sd",
    )
    ax.set_ylabel("cosine similarity")
    ax.set_title("猫/狗 住得近，猫/发票 隔着十条街？(zh and en: cat/dog/invoice)")
    ax.legend(fontsize=7)
    return fig
