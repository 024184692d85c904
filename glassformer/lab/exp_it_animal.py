"""Seed 000 §3.1: in "The animal didn't cross the street because it was too tired", attention
learns it → animal; with "too wide", "it" should look at street.

The test is the flip: one attention head, held fixed, must move the weight of "it" from the
first noun to the second when only the last word (the adjective) changes. That needs a
bidirectional model, where "it" sees the words after it: all-MiniLM-L6-v2 (a 6-layer BERT,
pretrained). The head is chosen on 12 sentence pairs, the seed's own and 11 more (the head whose
"it" moves toward the right noun in most of them), and then judged on 11 other pairs of the
same shape ("The trophy didn't fit in the suitcase because it was too big / small"), so choosing
and judging never see the same sentences. SmolLM2 is causal: there "it" cannot see the
adjective, its attention row is the same in both sentences, and the flip cannot be tested in
its attention (stated, with the numbers). What SmolLM2 can show is its reading of the whole
sentence: after '… too tired. Here "it" means the', is the right noun the likelier next word,
in both sentences of a held-out pair?
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from glassformer.inspect.capture import capture
from glassformer.lab import base as lab


@dataclass(frozen=True)
class SentencePair:
    """ "The {first} didn't {verb} the {second} because it was too {adjective}": first_adjective
    makes "it" the first noun, second_adjective makes it the second."""

    first: str
    verb: str
    second: str
    first_adjective: str
    second_adjective: str

    def sentence(self, adjective: str) -> str:
        return (
            f"The {self.first} didn't {self.verb} the {self.second} because it was too {adjective}"
        )

    @property
    def label(self) -> str:
        return f"{self.first}/{self.second}: {self.first_adjective}/{self.second_adjective}"


SELECTION = SentencePair("animal", "cross", "street", "tired", "wide")  # the seed's own pair
CHOOSING = (  # the seed's pair and 11 more: the head is chosen here
    SELECTION,
    SentencePair("man", "lift", "bag", "weak", "heavy"),
    SentencePair("child", "reach", "shelf", "short", "high"),
    SentencePair("bus", "go under", "bridge", "tall", "low"),
    SentencePair("sofa", "fit through", "window", "large", "narrow"),
    SentencePair("runner", "finish", "race", "tired", "long"),
    SentencePair("student", "solve", "problem", "tired", "hard"),
    SentencePair("key", "fit in", "lock", "big", "small"),
    SentencePair("tree", "fit in", "yard", "tall", "small"),
    SentencePair("box", "fit on", "shelf", "heavy", "narrow"),
    SentencePair("ship", "enter", "port", "big", "small"),
    SentencePair("girl", "carry", "box", "weak", "heavy"),
)
HELD_OUT = (  # the head is judged here
    SentencePair("trophy", "fit in", "suitcase", "big", "small"),
    SentencePair("truck", "cross", "bridge", "heavy", "narrow"),
    SentencePair("dog", "jump over", "fence", "tired", "high"),
    SentencePair("cat", "climb", "tree", "lazy", "tall"),
    SentencePair("horse", "jump over", "river", "old", "wide"),
    SentencePair("boat", "pass under", "bridge", "tall", "low"),
    SentencePair("car", "fit in", "garage", "long", "short"),
    SentencePair("bird", "fly over", "mountain", "weak", "high"),
    SentencePair("robot", "lift", "rock", "weak", "heavy"),
    SentencePair("piano", "fit through", "door", "wide", "narrow"),
    SentencePair("table", "fit in", "room", "large", "small"),
)
# Threshold, stated once: a head that ignores the adjective moves toward the right noun in a
# held-out pair by chance, probability 1/2. So a property counts only if it shows in at least
# the number of held-out pairs that a one-sided sign test at ALPHA needs (9 of 11 pairs); the
# same count for SmolLM2's reading (right in both sentences of a pair: chance 1/4, so the sign
# test's bar is a generous one). Precondition: the chosen head moves the right way in at least
# as many of the 12 choosing pairs as the sign test needs there (10): a head was found at all.
ALPHA = 0.05
QUESTION = ' Here "it" means the'
SPECIAL = ("[cls]", "[sep]", "<|endoftext|>", "<|im_start|>")  # not words of the sentence
ROW_KEYS_ZH = {
    "model": "模型",
    "sentence pair": "句对",
    "role": "用途",
    "head": "头",
    "it→1st − it→2nd, adj fits 1st": "it→第 1 个名词 − it→第 2 个名词，形容词指第 1 个",
    "it→1st − it→2nd, adj fits 2nd": "it→第 1 个名词 − it→第 2 个名词，形容词指第 2 个",
    "shift toward the right noun": "向正确名词的偏移",
    "right noun wins in both": "两句中正确名词都胜出",
    "right noun is the top word in both": "两句中正确名词都是权重最大的词",
}
ROLES_ZH = {
    "chooses the head": "用于选头",
    "held out": "留出",
    "causal: not testable": "因果模型：无法检验",
}


def sign_test_min(n: int, alpha: float = ALPHA) -> int:
    """The smallest k with P(Binomial(n, 1/2) >= k) <= alpha: successes a coin would rarely
    reach."""
    for k in range(n + 1):
        if sum(math.comb(n, j) for j in range(k, n + 1)) / 2**n <= alpha:
            return k
    return n + 1  # n too small for any count to be significant


@torch.no_grad()
def it_attention(model, tokenizer, sentence: str) -> tuple[torch.Tensor, list[str]]:
    """(L, H, T) attention of "it" over the sentence's tokens in every layer and head, and the
    tokens' texts (lower case, spaces stripped)."""
    ids = tokenizer.encode(sentence)
    words = [tokenizer.decode([i]).strip().lower() for i in ids]
    if words.count("it") != 1:
        raise ValueError(f"{sentence!r} must hold 'it' as one token, once: got {words}")
    with capture(model, residual=False) as cap:
        model(torch.tensor([ids]))
    query = words.index("it")
    return torch.stack([a[0, :, query].float() for a in cap.attention]), words  # (L, H, T)


def noun_position(words: list[str], noun: str) -> int:
    if words.count(noun) != 1:
        raise ValueError(f"{noun!r} must be one token, once, among {words}: pick another noun")
    return words.index(noun)


@dataclass
class PairAttention:
    """What every head does with one pair. prefer_*: weight on the first noun minus weight on
    the second (L, H), in the sentence whose adjective fits the first / the second noun; top_*:
    (L, H) True where the noun the adjective fits gets the most weight of all the words."""

    pair: SentencePair
    prefer_first: torch.Tensor
    prefer_second: torch.Tensor
    top_first: torch.Tensor
    top_second: torch.Tensor
    rows: dict[str, torch.Tensor]  # adjective -> (L, H, T), for the causal comparison

    @property
    def shift(self) -> torch.Tensor:
        """(L, H) how far the preference moves toward the right noun when the adjective flips."""
        return self.prefer_first - self.prefer_second

    @property
    def resolved(self) -> torch.Tensor:
        """(L, H) True where the right noun outweighs the other in both sentences."""
        return (self.prefer_first > 0) & (self.prefer_second < 0)


def pair_attention(model, tokenizer, pair: SentencePair) -> PairAttention:
    prefer, top, rows = {}, {}, {}  # keyed by the noun the sentence's adjective fits
    for adjective, noun in (
        (pair.first_adjective, pair.first),
        (pair.second_adjective, pair.second),
    ):
        weights, words = it_attention(model, tokenizer, pair.sentence(adjective))  # (L, H, T)
        first, second = noun_position(words, pair.first), noun_position(words, pair.second)
        wordlike = torch.tensor([w not in SPECIAL for w in words])  # (T,)
        prefer[noun] = weights[..., first] - weights[..., second]  # (L, H)
        top[noun] = weights.masked_fill(~wordlike, -1.0).argmax(dim=-1) == words.index(noun)
        rows[adjective] = weights
    return PairAttention(
        pair, prefer[pair.first], prefer[pair.second], top[pair.first], top[pair.second], rows
    )


def _models(ctx: lab.RunContext) -> dict:
    from glassformer.interop.pretrained import from_pretrained

    names = ctx.pick(["minilm", "smollm2"], ["minilm", "smollm2"], ["minilm"])
    return {name: from_pretrained(name) for name in names}


def _row(model: str, role: str, found: PairAttention, head: tuple[int, int]) -> dict:
    layer, h = head
    return {
        "model": model,
        "sentence pair": found.pair.label,
        "role": role,
        "head": f"L{layer} H{h}",
        "it→1st − it→2nd, adj fits 1st": f"{found.prefer_first[layer, h].item():+.3f}",
        "it→1st − it→2nd, adj fits 2nd": f"{found.prefer_second[layer, h].item():+.3f}",
        "shift toward the right noun": found.shift[layer, h].item(),
        "right noun wins in both": bool(found.resolved[layer, h]),
        "right noun is the top word in both": bool(
            found.top_first[layer, h] & found.top_second[layer, h]
        ),
    }


@lab.register("it-animal")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    say = ctx.say
    for en, zh in (ROW_KEYS_ZH | ROLES_ZH).items():
        say(en, zh)
    models = _models(ctx)
    model, tokenizer = models["minilm"]
    choosing = [pair_attention(model, tokenizer, pair) for pair in CHOOSING]
    chosen_on = choosing[0]
    votes = sum((found.shift > 0).float() for found in choosing)  # (L, H) pairs shifted
    mean_shift = sum(found.shift for found in choosing) / len(choosing)
    n_heads = chosen_on.shift.shape[1]
    score = votes + mean_shift / (mean_shift.abs().max() + 1e-9) / 2  # ties: the larger shift
    head = divmod(int(score.argmax()), n_heads)  # (layer, head)
    held = [pair_attention(model, tokenizer, pair) for pair in HELD_OUT]

    rows = [_row("minilm", "chooses the head", found, head) for found in choosing]
    rows += [_row("minilm", "held out", found, head) for found in held]
    n, need = len(held), sign_test_min(len(held))
    shifted = sum(found.shift[head].item() > 0 for found in held)
    resolved = sum(bool(found.resolved[head]) for found in held)
    top = sum(bool(found.top_first[head] & found.top_second[head]) for found in held)
    # Precondition: the choice found a head that moves the right way on the seed's own pair.
    name, n_choosing = f"L{head[0]} H{head[1]}", len(CHOOSING)
    checks = [
        lab.precondition(
            lab.at_least(
                say(
                    f"minilm {name}: choosing pairs (of "
                    f"{n_choosing}) where it moves toward the right noun",
                    f"minilm {name}：选头句对（共 {n_choosing} 对）中它移向正确名词的对数",
                ),
                votes[head].item(),
                sign_test_min(len(CHOOSING)),
            )
        ),
        lab.at_least(
            say(
                f"held-out pairs (of {n}) where the chosen head's 'it' moves toward the "
                "right noun as the adjective flips",
                f"留出句对（共 {n} 对）中，形容词一换、所选头的 'it' 就移向正确名词的对数",
            ),
            shifted,
            need,
            group=say("the flip", "翻转"),
        ),
        lab.at_least(
            say(
                f"held-out pairs (of {n}) where the right noun outweighs the other in "
                "both sentences",
                f"留出句对（共 {n} 对）中，两句里正确名词的权重都超过另一个名词的对数",
            ),
            resolved,
            need,
            group=say("it → the right noun", "it → 正确的名词"),
        ),
        lab.at_least(
            say(
                f"held-out pairs (of {n}) where the right noun is the word 'it' weighs "
                "most ('权重最大') in both sentences",
                f"留出句对（共 {n} 对）中，两句里正确名词都是 'it' 权重最大的词"
                "（'权重最大'）的对数",
            ),
            top,
            need,
            group=say("权重最大", "权重最大"),
        ),
    ]

    pairs_shifted = sum((found.shift > 0).int() for found in held)  # (L, H) count per head
    consistent = [f"L{layer} H{h}" for layer, h in (pairs_shifted >= need).nonzero().tolist()]
    n_all, n_votes = chosen_on.shift.numel(), int(votes[head])
    seed_shift = chosen_on.shift[head].item()
    listed, ranks = ", ".join(consistent), _ranks_of(score, pairs_shifted >= need)
    notes = [
        say(
            f"minilm (bidirectional, {n_all} heads): the head is chosen on "
            f"{n_choosing} pairs ({name}, right in {n_votes} of them, on "
            f"the seed's pair a shift of {seed_shift:+.3f}); "
            f"on the {n} held-out pairs it moves toward the right noun in {shifted}, the right "
            f"noun outweighs the other in both sentences in {resolved}, and is the top word in "
            f"both in {top} (a sign test at {ALPHA} needs {need})",
            f"minilm（双向，共 {n_all} 个头）：头在 {n_choosing} 个句对上选出（{name}，其中 "
            f"{n_votes} 对方向正确，在原文的句对上偏移 {seed_shift:+.3f}）；在 {n} 个留出句对上，"
            f"它在 {shifted} 对中移向正确名词，在 {resolved} 对中两句里正确名词的权重都超过另一个"
            f"名词，在 {top} 对中两句里正确名词都是权重最大的词（显著性水平 {ALPHA} 的符号检验"
            f"需要 {need} 对）",
        ),
        say(
            f"for comparison, looking at the held-out pairs themselves (so not evidence): "
            f"{len(consistent)} of the {n_all} heads move toward the right noun in "
            f"at least {need} of the {n} ({listed or 'none'}); the choosing pairs "
            f"rank these at {ranks or 'no place'}",
            f"作为对照，直接看留出句对本身（因此不算证据）：{n_all} 个头中有 {len(consistent)} 个"
            f"在 {n} 对里至少 {need} 对移向正确名词（{listed or '没有'}）；"
            + (f"选头句对把它们排在第 {ranks} 位" if ranks else "选头句对没有给它们排名"),
        ),
    ]
    if "smollm2" in models:
        rows_smol, note = _causal(models["smollm2"], say)
        rows.append(rows_smol)
        notes.append(note)
        smol, smol_tok = models["smollm2"]
        readings = [reading(smol, smol_tok, pair) for pair in HELD_OUT]
        right = sum(a > 0 and b < 0 for a, b in readings)
        checks.append(
            lab.at_least(
                say(
                    f"smollm2: held-out pairs (of {n}) where, after the whole sentence, the right "
                    "noun "
                    "is the likelier next word in both sentences",
                    f"smollm2：留出句对（共 {n} 对）中，"
                    "读完整句后两句里正确名词都是更可能的下一个词的"
                    "对数",
                ),
                right,
                need,
                group=say("smollm2 reads it → the right noun", "smollm2 把 it 读作正确的名词"),
            )
        )
        per_pair = [
            f"{p.first}/{p.second} {a:+.2f}, {b:+.2f}"
            for p, (a, b) in zip(HELD_OUT, readings, strict=True)
        ]
        notes.append(
            say(
                f"smollm2's reading after {QUESTION!r}: log P(1st noun) - log P(2nd noun) "
                "per held-out pair, (adjective fits the 1st, fits the 2nd): " + "; ".join(per_pair),
                f"smollm2 在 {QUESTION!r} 之后的读法：每个留出句对的 log P(第 1 个名词) - "
                "log P(第 2 个名词)，（形容词指第 1 个名词，指第 2 个名词）："
                + "；".join(per_pair),
            )
        )
        data_smol = [list(r) for r in readings]
    else:
        data_smol = []
    data = {
        "smollm2_reading": data_smol,
        "votes": votes.tolist(),
        "head": list(head),
        "selection_shift": chosen_on.shift.tolist(),
        "held_out": {
            found.pair.label: {
                "prefer_first": found.prefer_first[head].item(),
                "prefer_second": found.prefer_second[head].item(),
            }
            for found in held
        },
    }
    figure = _plot(chosen_on, held, head)
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


@torch.no_grad()
def reading(model, tokenizer, pair: SentencePair) -> tuple[float, float]:
    """For each sentence of the pair (adjective fitting the 1st noun, then the 2nd): log P(" 1st
    noun") - log P(" 2nd noun") as the next word after the sentence and QUESTION."""
    out = []
    for adjective in (pair.first_adjective, pair.second_adjective):
        prefix = tokenizer.encode(pair.sentence(adjective) + "." + QUESTION)
        scores = []
        for noun in (pair.first, pair.second):
            pieces = tokenizer.encode(" " + noun)
            logp = model(torch.tensor([prefix + pieces]))[0].float().log_softmax(-1)
            scores.append(sum(float(logp[len(prefix) - 1 + k, p]) for k, p in enumerate(pieces)))
        out.append(scores[0] - scores[1])
    return out[0], out[1]


def _ranks_of(shift: torch.Tensor, wanted: torch.Tensor) -> str:
    """Where the heads marked in `wanted` (L, H) fall when `shift` (L, H) ranks all heads (1 =
    largest)."""
    order = shift.flatten().argsort(descending=True)
    places = (wanted.flatten()[order]).nonzero().flatten() + 1
    return ", ".join(str(p) for p in places.tolist())


def _causal(loaded, say: Callable[[str, str], str]) -> tuple[dict, str]:
    """SmolLM2's row and note: the head that prefers animal most in the "tired" sentence, and
    how much the "it" row differs between the two sentences anywhere in the model."""
    model, tokenizer = loaded
    found = pair_attention(model, tokenizer, SELECTION)
    head = divmod(int(found.prefer_first.argmax()), found.prefer_first.shape[1])
    first, second = found.rows[SELECTION.first_adjective], found.rows[SELECTION.second_adjective]
    length = min(first.shape[-1], second.shape[-1])
    differs = (first[..., :length] - second[..., :length]).abs().max().item()
    row = _row("smollm2", "causal: not testable", found, head)
    layers, heads = found.shift.shape
    if differs < 1e-5:
        said = f"is the same in both sentences (largest difference {differs:.1e})"
        said_zh = f"在两句中完全相同（最大差异 {differs:.1e}）"
    else:
        said = f"differs between the sentences by up to {differs:.3g}"
        said_zh = f"在两句之间最多相差 {differs:.3g}"
    first_adj, second_adj = SELECTION.first_adjective, SELECTION.second_adjective
    note = say(
        f"smollm2 is causal: the two sentences are identical up to 'it', which cannot see "
        f"'{first_adj}' or '{second_adj}'; its attention row "
        f"over all {layers} layers x {heads} heads {said}, so the flip cannot be tested there",
        f"smollm2 是因果模型：两句在 'it' 之前完全相同，而 'it' 看不到 '{first_adj}' 或 "
        f"'{second_adj}'；它在全部 {layers} 层 x {heads} 个头上的注意力行{said_zh}，所以无法在"
        "这里检验翻转",
    )
    return row, note


def _plot(chosen_on: PairAttention, held: list[PairAttention], head: tuple[int, int]):
    fig, (left, right) = lab.new_figure(11.0, 4.0, ncols=2)
    shift = chosen_on.shift
    bound = shift.abs().max().item()
    image = left.imshow(shift.numpy(), cmap="RdBu", vmin=-bound, vmax=bound, aspect="auto")
    left.scatter(
        [head[1]],
        [head[0]],
        marker="s",
        s=120,
        facecolors="none",
        edgecolors="black",
        label="chosen head",
    )
    left.set(
        xlabel="head",
        ylabel="layer",
        xticks=range(shift.shape[1]),
        yticks=range(shift.shape[0]),
        title=f"MiniLM, the seed's pair ({SELECTION.label})",
    )
    left.legend(fontsize=7, loc="upper right")
    fig.colorbar(image, ax=left, label="shift toward the right noun (attention weight)")
    labels = [f"{f.pair.first}/{f.pair.second}" for f in held]
    lab.grouped_bars(
        right,
        labels,
        {
            "adjective fits the 1st noun": [f.prefer_first[head].item() for f in held],
            "adjective fits the 2nd noun": [f.prefer_second[head].item() for f in held],
        },
        rotation=45,
        ha="right",
        fontsize=7,
    )
    right.axhline(0, color="black", lw=0.8)
    right.set(
        ylabel="it→1st noun − it→2nd noun (weight)",
        title=f"held-out pairs, the same head L{head[0]} H{head[1]}",
    )
    right.legend(fontsize=7)
    return fig
