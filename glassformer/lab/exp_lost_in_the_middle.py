"""Seed 002 练习 2 第 3 步: put a key fact in the middle of a long prompt and at its end, ask the
model each time, and see which answer is right: "lost in the middle".

Measured with SmolLM2-135M-Instruct (real weights). Each trial's prompt holds N facts "The secret
number of <name> is <4 digits>." spread evenly through Shakespeare filler, from its start to its
end, followed by a question; the model is asked about every fact in turn, so the facts at every
position share one prompt and one prefill (each question is written over the last). Per
fact: the log-probability of the right digits after "The secret number of <name> is", and
whether greedy decoding would write exactly them (every digit the argmax: the teacher-forced
equivalent of temperature-0 generation). Accuracy and mean log-prob per position of the fact.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import nn

from glassformer.lab import base as lab

NAMES = (
    "Alice",
    "Bruno",
    "Chen",
    "Dmitri",
    "Elena",
    "Farah",
    "Goran",
    "Hana",
    "Ivan",
    "Julia",
    "Kenji",
    "Lena",
    "Marco",
    "Nadia",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tara",
    "Umar",
    "Vera",
    "Wen",
    "Yusuf",
    "Zoe",
)
# Thresholds, stated once. The seed's claim: the fact at the end is answered better than the
# fact in the middle. "Better" by at least 0.10 accuracy (one trial in ten) and by at least 0.5
# nats of mean log-prob of the answer's digits (e^0.5 ≈ 1.6x as likely), each judged on the
# lower end of the paired difference's 2-standard-error band over the trials (every trial asks
# about both facts in one prompt, so the difference is taken trial by trial). Setup: somewhere
# the model must beat picking one of the N numbers at random (accuracy 1 / N), else it cannot do
# the task at all and the comparison says nothing.
MIN_ACCURACY_GAP = 0.10
MIN_LOGPROB_GAP = 0.5
END_BEATS_MIDDLE = "the fact at the end is answered better than the one in the middle"
LABELS_ZH = {"": "", " (start)": "（开头）", " (middle)": "（中间）", " (end)": "（末尾）"}


def paired_gap(later: list[float], earlier: list[float]) -> tuple[float, float]:
    """(mean, standard error) of later[i] - earlier[i] over the trials (SE 0 for one trial)."""
    gaps = lab.over_seeds([a - b for a, b in zip(later, earlier, strict=True)])
    return gaps.mean, gaps.spread / len(gaps.values) ** 0.5


@dataclass(frozen=True)
class Fact:
    name: str
    number: int

    @property
    def answer_prefix(self) -> str:
        return f"The secret number of {self.name} is"

    @property
    def answer(self) -> str:
        return f" {self.number}"

    @property
    def sentence(self) -> str:
        # the notes state the fact in the very words the answer is scored on
        return f"{self.answer_prefix}{self.answer}."

    @property
    def question(self) -> str:
        return f"What is the secret number of {self.name}?"


def make_facts(n_facts: int, rng: random.Random) -> list[Fact]:
    """n_facts facts with distinct names and distinct 4-digit numbers."""
    names = rng.sample(NAMES, n_facts)
    numbers = rng.sample(range(1000, 10000), n_facts)
    return [Fact(n, x) for n, x in zip(names, numbers, strict=True)]


def filler_pieces(text: str, n_pieces: int, chars: int, rng: random.Random) -> list[str]:
    """n_pieces excerpts of about `chars` characters from random places in `text`, cut at word
    boundaries, on one line each."""
    pieces = []
    for _ in range(n_pieces):
        start = rng.randrange(0, len(text) - 2 * chars)
        words = " ".join(text[start : start + chars + 40].split()).split(" ")
        pieces.append(" ".join(words[1:-1]))  # drop the cut words at both ends
    return pieces


def build_context(facts: list[Fact], fillers: list[str]) -> tuple[str, list[int]]:
    """Fact 0, filler, fact 1, filler, ..., fact N-1: the facts evenly spaced from the start to
    the end. Returns the text and each fact's character offset in it."""
    if len(fillers) != len(facts) - 1:
        raise ValueError(f"{len(facts)} facts need {len(facts) - 1} fillers, got {len(fillers)}")
    parts, offsets, length = [], [], 0
    for i, fact in enumerate(facts):
        offsets.append(length)
        parts.append(fact.sentence)
        length += len(fact.sentence)
        if i < len(fillers):
            parts.append(" " + fillers[i] + " ")
            length += len(fillers[i]) + 2
    return "".join(parts), offsets


def prompt_parts(tokenizer, context: str, fact: Fact) -> tuple[str, str]:
    """(shared, query): the chat-formatted prompt split where the question begins, so every
    fact's query continues the same shared prefix. The template is rendered whole and split on
    the text, so the split adds no tokens of its own."""
    user = f"Read these notes.\n\n{context}\n\nQuestion: {fact.question}"
    messages = [{"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    text += fact.answer_prefix
    cut = text.index("\n\nQuestion: ")
    return text[:cut], text[cut:]


@torch.no_grad()
def score_continuation(
    model: nn.Module, cache, held: int, query_ids: list[int], answer_ids: list[int]
):
    """Given a cache whose first `held` positions hold the shared prefix: (sum of log p(answer |
    prefix + query), whether every answer token is the argmax: greedy decoding would write the
    answer). The query goes right after the prefix, where the next question is written over it."""
    ids = torch.tensor([query_ids + answer_ids], device=model.device)
    positions = torch.arange(held, held + ids.shape[1], device=model.device)
    logits = model(ids, positions, cache=cache)[0].float()  # (T, V)
    predicting = logits[len(query_ids) - 1 : -1]  # the positions that predict the answer
    target = torch.tensor(answer_ids, device=logits.device)
    logprobs = predicting.log_softmax(dim=-1)
    logprob = float(logprobs.gather(1, target[:, None]).sum())
    greedy = bool((predicting.argmax(dim=-1) == target).all())
    return logprob, greedy


@torch.no_grad()
def run_trial(model, tokenizer, facts: list[Fact], fillers: list[str]) -> list[tuple[float, bool]]:
    """One prompt with every fact in it, a question about each: per fact (log-prob, greedy hit)."""
    context, _ = build_context(facts, fillers)
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    shared, _ = prompt_parts(tokenizer, context, facts[0])
    shared_ids = encode(shared)
    cache = model.new_cache(batch_size=1, max_seq_len=len(shared_ids) + 64)
    positions = torch.arange(len(shared_ids), device=model.device)
    ids = torch.tensor([shared_ids], device=model.device)
    model(ids, positions, cache=cache, last_token_only=True)
    scores = []
    for fact in facts:
        shared_again, query = prompt_parts(tokenizer, context, fact)
        if shared_again != shared:
            raise ValueError("the chat template puts the question before the notes' end")
        held, query_ids, answer_ids = len(shared_ids), encode(query), encode(fact.answer)
        scores.append(score_continuation(model, cache, held, query_ids, answer_ids))
    return scores


@lab.register("lost-in-the-middle")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    from glassformer.data.corpus import corpus_text
    from glassformer.interop.pretrained import from_pretrained

    n_facts = ctx.pick(5, 5, 3)
    n_trials = ctx.pick(80, 24, 1)
    filler_chars = ctx.pick(300, 220, 40)
    model, tokenizer = from_pretrained("smollm2")
    model.eval()
    text = corpus_text("modern")
    rng = random.Random(ctx.seed)
    logprobs = [[] for _ in range(n_facts)]
    hits = [[] for _ in range(n_facts)]
    prompt_tokens = []
    for _ in range(n_trials):
        facts = make_facts(n_facts, rng)
        fillers = filler_pieces(text, n_facts - 1, filler_chars, rng)
        for slot, (logprob, hit) in enumerate(run_trial(model, tokenizer, facts, fillers)):
            logprobs[slot].append(logprob)
            hits[slot].append(hit)
        context, _ = build_context(facts, fillers)
        prompt_tokens.append(len(tokenizer.encode(context, add_special_tokens=False)))

    fractions = [i / (n_facts - 1) for i in range(n_facts)]
    accuracy = [sum(h) / len(h) for h in hits]
    mean_logprob = [sum(lp) / len(lp) for lp in logprobs]
    say = ctx.say
    for i, f in enumerate(fractions):
        label = _label(i, n_facts)
        if label:
            say(f"{f:.2f}" + label, f"{f:.2f}" + LABELS_ZH[label])
    rows = [
        {
            say("fact at (fraction of context)", "事实所在位置（占上下文的比例）"): f"{f:.2f}"
            + _label(i, n_facts),
            say("trials", "试验次数"): n_trials,
            say("greedy accuracy", "贪心解码准确率"): accuracy[i],
            say("mean log p(answer) (nats)", "平均 log p(答案)（nats）"): mean_logprob[i],
        }
        for i, f in enumerate(fractions)
    ]
    middle, end = n_facts // 2, n_facts - 1
    chance = 1 / n_facts
    accuracy_gap = paired_gap([float(h) for h in hits[end]], [float(h) for h in hits[middle]])
    logprob_gap = paired_gap(logprobs[end], logprobs[middle])
    group = say(END_BEATS_MIDDLE, "末尾的事实比中间的事实答得更好")
    checks = [
        lab.precondition(
            lab.at_least(
                say(
                    f"best accuracy - chance (1/{n_facts})", f"最高准确率 - 随机猜测（1/{n_facts}）"
                ),
                max(accuracy) - chance,
                0.0,
            )
        ),
        lab.at_least(
            say(
                "accuracy: end − middle, mean − 2 SE over trials",
                "准确率：末尾 − 中间，各次试验的均值 − 2 SE",
            ),
            accuracy_gap[0] - 2 * accuracy_gap[1],
            MIN_ACCURACY_GAP,
            group=group,
        ),
        lab.at_least(
            say(
                "mean log p(answer): end − middle (nats), mean − 2 SE over trials",
                "平均 log p(答案)：末尾 − 中间（nats），各次试验的均值 − 2 SE",
            ),
            logprob_gap[0] - 2 * logprob_gap[1],
            MIN_LOGPROB_GAP,
            group=group,
        ),
    ]
    mean_tokens = sum(prompt_tokens) / len(prompt_tokens)
    notes = [
        say(
            f"{n_trials} prompts of {n_facts} facts each (context about {mean_tokens:.0f} tokens, "
            f"Shakespeare filler between the facts); every prompt asks about all {n_facts} facts, "
            "so each position gets the same prompts and the other facts act as distractors",
            f"{n_trials} 个提示，每个含 {n_facts} 条事实（上下文约 {mean_tokens:.0f} 个 token，"
            f"事实之间填充莎士比亚文本）；每个提示都会问到全部 {n_facts} 条事实，所以每个位置用的"
            "是同样的提示，其他事实充当干扰项",
        ),
        say(
            "greedy accuracy: every digit of the answer is the model's argmax after 'The secret "
            "number of <name> is' - what temperature-0 generation would write; log p is summed "
            "over the answer's tokens (a space and four digits)",
            "贪心解码准确率：在 'The secret number of <name> is' 之后，答案的每一位数字都是模型的"
            " argmax——也就是温度为 0 的生成会写出的内容；log p 是答案各 token（一个空格和四位"
            "数字）的总和",
        ),
        say(
            "the prompt is tokenized in two pieces (notes | question + answer prefix) so all "
            "questions share one prefill; the split sits before a blank line",
            "提示分两段做分词（笔记 | 问题 + 答案前缀），让所有问题共用一次 prefill；"
            "切分点在一个空行之前",
        ),
        say(
            "the seed asks a chat model about a 500-character text; here a 135M model and a few "
            "hundred tokens, so this tests the pattern, not the seed's products",
            "原文是就一段 500 字的文本提问一个对话模型；这里用的是 135M 的模型和几百个 token，"
            "所以检验的是这种规律，而不是原文所说的那些产品",
        ),
    ]
    acc_mean, acc_se = accuracy_gap
    lp_mean, lp_se = logprob_gap
    notes.append(
        say(
            f"end − middle, paired over {n_trials} trials: accuracy {acc_mean:+.3f} ± "
            f"{acc_se:.3f} (SE), log p {lp_mean:+.3f} ± {lp_se:.3f} nats",
            f"末尾 − 中间，按 {n_trials} 次试验配对：准确率 {acc_mean:+.3f} ± {acc_se:.3f}（SE），"
            f"log p {lp_mean:+.3f} ± {lp_se:.3f} nats",
        )
    )
    start_gap = paired_gap(logprobs[0], logprobs[middle])
    acc_start, acc_middle = accuracy[0], accuracy[middle]
    notes.append(
        say(
            f"the fact at the very start against the middle (not part of the seed's exercise): "
            f"accuracy {acc_start:.2f} vs {acc_middle:.2f}, log p {start_gap[0]:+.3f} ± "
            f"{start_gap[1]:.3f} nats; Liu et al.'s 'Lost in the Middle' (2023) found a U-shape, "
            "start and end both above the middle",
            f"最开头的事实与中间的对比（不属于原文的练习）：准确率 {acc_start:.2f} 对 "
            f"{acc_middle:.2f}，log p {start_gap[0]:+.3f} ± {start_gap[1]:.3f} nats；Liu et al. 的 "
            "'Lost in the Middle'（2023）发现的是 U 形：开头和末尾都高于中间",
        )
    )
    data = {
        "fractions": fractions,
        "accuracy": accuracy,
        "mean_logprob": mean_logprob,
        "logprobs": logprobs,
        "hits": hits,
        "context_tokens": prompt_tokens,
    }
    figure = _plot(fractions, accuracy, mean_logprob, n_trials, chance)
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _label(i: int, n: int) -> str:
    if i == 0:
        return " (start)"
    if i == n // 2:
        return " (middle)"
    if i == n - 1:
        return " (end)"
    return ""


def _plot(fractions, accuracy, mean_logprob, n_trials: int, chance: float):
    fig, (left, right) = lab.new_figure(9.0, 3.4, ncols=2)
    left.plot(fractions, accuracy, marker="o")
    left.axhline(chance, color="gray", linestyle=":", label=f"chance (1/{round(1 / chance)})")
    left.set(
        xlabel="position of the fact (0 = start, 1 = end of context)",
        ylabel="greedy accuracy",
        ylim=(-0.02, 1.02),
        title=f"exact answer, {n_trials} prompts",
    )
    left.legend(fontsize=7)
    right.plot(fractions, mean_logprob, marker="o", color="C1")
    right.set(
        xlabel="position of the fact (0 = start, 1 = end of context)",
        ylabel="mean log p(answer digits) (nats)",
        title="SmolLM2-135M: log-prob of the right number",
    )
    return fig
