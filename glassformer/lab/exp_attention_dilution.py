"""Seed 000 §3.2: attention dilution over long contexts: one softmax row shares its weight among
all the keys, so with thousands of keys a far-away token gets thinned out, one root of a long
chat "forgetting its beginning".

Measured with SmolLM2-135M-Instruct (real weights). A prompt starts with a needle "The password
is 4821.", then n tokens of Shakespeare, then "The password is"; the model should copy the
digits. At the query's last token (the one that predicts the first digit) every head's
attention row is captured (glassformer.inspect.capture, eager path), and its weight on the
needle's digits summed. The head that looks at the digits most at the shortest n is chosen on
selection prompts, then measured on other prompts at every n, together with the strongest head
per prompt and the model's log-probability of the digits. For reference, a softmax row whose
scores stay fixed as keys are added (one key Δ above all the others) puts
1 / (1 + (N - 1) e^-Δ) on that key among N keys: the figure fits Δ at the shortest n.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from torch import nn

from glassformer.inspect.capture import capture
from glassformer.lab import base as lab

# Thresholds, stated once. "Thinned out": as the filler grows from the shortest to the longest
# n (at least 8x the keys), the needle's weight in the selected head, and in the strongest head,
# at most halves (ratio <= 0.5). "Forgets the beginning": the log-probability of the needle's
# digits falls by at least 0.5 nats (e^0.5 ≈ 1.6x less likely). Preconditions: at the shortest n
# the selected head puts at least 0.2 of its row on the digits (it is a head that reads them)
# and greedy decoding copies them in at least half the prompts (the model can do the task).
MAX_WEIGHT_RATIO = 0.5
MIN_LOGPROB_DROP = 0.5
MIN_HEAD_WEIGHT = 0.2
MIN_RECALL = 0.5


@dataclass(frozen=True)
class Prompt:
    """Token ids of one trial: needle, filler, query; the digits are the needle's answer."""

    needle: list[int]
    digits: slice  # where the digits sit inside `needle`
    filler: list[int]  # at least as long as the longest n
    query: list[int]

    @property
    def answer(self) -> list[int]:
        return self.needle[self.digits]

    def ids(self, n_filler: int) -> list[int]:
        return self.needle + self.filler[:n_filler] + self.query


def make_prompt(encode, text: str, n_filler: int, rng: random.Random) -> Prompt:
    """A needle with random 4 digits, n_filler tokens of `text` from a random place, the query."""
    number = rng.randrange(1000, 10000)
    head, digits, tail = encode("The password is"), encode(f" {number}"), encode(".\n")
    start = rng.randrange(0, len(text) - 8 * n_filler - 100)
    filler = encode(text[start : start + 8 * n_filler + 100])[:n_filler]
    if len(filler) < n_filler:
        raise ValueError(f"{8 * n_filler + 100} characters gave fewer than {n_filler} tokens")
    needle = head + digits + tail
    return Prompt(
        needle, slice(len(head), len(head) + len(digits)), filler, encode("\nThe password is")
    )


@dataclass
class Reading:
    needle_weight: torch.Tensor  # (L, H): each head's weight on the digits, from the query
    logprob: float  # log p(digits | prompt), summed over the digit tokens
    recalled: bool  # greedy decoding writes the digits
    n_keys: int  # keys in the query's attention row


@torch.no_grad()
def read_prompt(model: nn.Module, prompt: Prompt, n_filler: int) -> Reading:
    """Prefill all but the query's last token on the fast path, then run that token and the
    digits with attention captured: row 0 of each head is the query's row."""
    ids = prompt.ids(n_filler)
    answer = prompt.answer
    cache = model.new_cache(batch_size=1, max_seq_len=len(ids) + len(answer))
    n, device = len(ids) - 1, model.device
    model(torch.tensor([ids[:-1]], device=device), torch.arange(n, device=device), cache=cache,
          last_token_only=True)  # fmt: skip
    tail = torch.tensor([ids[-1:] + answer[:-1]], device=device)
    with capture(model, residual=False) as cap:
        at = torch.arange(n, n + tail.shape[1], device=device)
        logits = model(tail, at, cache=cache)[0].float()  # (len(answer), V)
    rows = torch.stack([cap.attention[layer][0, :, 0] for layer in range(len(cap.attention))])
    target = torch.tensor(answer, device=logits.device)
    logprob = float(logits.log_softmax(-1).gather(1, target[:, None]).sum())
    recalled = bool((logits.argmax(-1) == target).all())
    return Reading(rows[..., prompt.digits].sum(-1).cpu(), logprob, recalled, len(ids))


def fixed_score_weight(n_keys: int, delta: float) -> float:
    """Softmax weight of one key whose score is delta above each of the other n_keys - 1."""
    return 1.0 / (1.0 + (n_keys - 1) * math.exp(-delta))


def delta_for(weight: float, n_keys: int) -> float:
    """The score margin delta at which fixed_score_weight(n_keys, delta) == weight."""
    return math.log((n_keys - 1) * weight / (1.0 - weight))


@lab.register("attention-dilution")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    model, encode, text, name = _model(ctx)
    fillers = ctx.pick((16, 64, 256, 1024, 2048), (16, 128, 1024), (4, 16))
    n_select, n_eval = ctx.pick(4, 2, 1), ctx.pick(8, 2, 1)
    rng = random.Random(ctx.seed)
    selection = [make_prompt(encode, text, fillers[-1], rng) for _ in range(n_select)]
    evaluation = [make_prompt(encode, text, fillers[-1], rng) for _ in range(n_eval)]

    # Choose the head on prompts that are never evaluated: the most weight on the digits at
    # the shortest filler.
    chosen = torch.stack([read_prompt(model, p, fillers[0]).needle_weight for p in selection])
    layer, head = divmod(int(chosen.mean(0).argmax()), chosen.shape[-1])

    readings = [[read_prompt(model, p, n) for p in evaluation] for n in fillers]  # [n][prompt]
    selected = [
        lab.over_seeds([float(r.needle_weight[layer, head]) for r in rs]) for rs in readings
    ]
    strongest = [lab.over_seeds([float(r.needle_weight.max()) for r in rs]) for rs in readings]
    logprob = [lab.over_seeds([r.logprob for r in rs]) for rs in readings]
    recall = [sum(r.recalled for r in rs) / len(rs) for rs in readings]
    n_keys = [sum(r.n_keys for r in rs) / len(rs) for rs in readings]
    hd = f"L{layer}H{head}"
    say = ctx.say
    rows = [
        {
            say("filler tokens n", "填充 token 数 n"): n,
            say("keys in the row", "该行的键数"): round(n_keys[i]),
            say(f"{hd} weight on digits", f"{hd} 在数字上的权重"): str(selected[i]),
            say("strongest head's weight", "最强头的权重"): str(strongest[i]),
            say("uniform 1/keys", "均匀分布 1/键数"): 1 / n_keys[i],
            say("log p(digits) (nats)", "log p(数字)（nats）"): str(logprob[i]),
            say("greedy recall", "贪心解码召回率"): recall[i],
        }
        for i, n in enumerate(fillers)
    ]
    first, last = fillers[0], fillers[-1]
    diluted = say(
        "a softmax row thins the weight on a far token as keys grow",
        "键越多，softmax 的一行分给远处 token 的权重越稀薄",
    )
    forgets = say(
        "the model forgets the beginning as the context grows", "上下文越长，模型越会忘掉开头"
    )
    checks = [
        lab.precondition(
            lab.at_least(
                say(f"{hd} weight on the digits at n={first}", f"n={first} 时 {hd} 在数字上的权重"),
                selected[0].mean,
                MIN_HEAD_WEIGHT,
            )
        ),
        lab.precondition(
            lab.at_least(
                say(f"greedy recall at n={first}", f"n={first} 时的贪心解码召回率"),
                recall[0],
                MIN_RECALL,
            )
        ),
        lab.at_most(
            say(
                f"{hd} weight on the digits: n={last} / n={first}",
                f"{hd} 在数字上的权重：n={last} / n={first}",
            ),
            _ratio(selected[-1].mean, selected[0].mean),
            MAX_WEIGHT_RATIO,
            group=diluted,
        ),
        lab.at_most(
            say(
                f"strongest head's weight on the digits: n={last} / n={first}",
                f"最强头在数字上的权重：n={last} / n={first}",
            ),
            _ratio(strongest[-1].mean, strongest[0].mean),
            MAX_WEIGHT_RATIO,
            group=diluted,
        ),
        lab.exceeds_spread(
            say(
                f"log p(digits): n={first} - n={last} (nats)",
                f"log p(数字)：n={first} 减 n={last}（nats）",
            ),
            logprob[0],
            logprob[-1],
            MIN_LOGPROB_DROP,
            group=forgets,
        ),
    ]
    weight_0 = min(max(selected[0].mean, 1e-6), 1 - 1e-6)
    delta = delta_for(weight_0, round(n_keys[0]))
    reference = [fixed_score_weight(round(k), delta) for k in n_keys]
    notes = [
        say(
            f"model: {name}; head L{layer}H{head} chosen on {n_select} selection prompt(s) at "
            f"n={first}, measured on {n_eval} other prompt(s); ± is the spread over prompts",
            f"模型：{name}；头 {hd} 在 n={first} 时由 {n_select} 条选择用提示选出，在另外 "
            f"{n_eval} 条提示上测量；± 是各提示间的波动（标准差）",
        ),
        say(
            f"keys grow {n_keys[-1] / n_keys[0]:.1f}x; L{layer}H{head}'s weight on the digits goes "
            f"{selected[0].mean:.3f} -> {selected[-1].mean:.3f}; a row whose scores stayed fixed "
            f"(margin {delta:.2f} fitted at n={first}) would go {reference[0]:.3f} -> "
            f"{reference[-1]:.3f}, a uniform row {1 / n_keys[0]:.3f} -> {1 / n_keys[-1]:.4f}",
            f"键数增长 {n_keys[-1] / n_keys[0]:.1f} 倍；{hd} 在数字上的权重从 "
            f"{selected[0].mean:.3f} 变为 {selected[-1].mean:.3f}；若分数保持不变（在 n={first} "
            f"拟合的差值为 {delta:.2f}），权重会从 {reference[0]:.3f} 变为 {reference[-1]:.3f}，"
            f"均匀分布的一行从 {1 / n_keys[0]:.3f} 变为 {1 / n_keys[-1]:.4f}",
        ),
        say(
            f"the seed speaks of thousands of keys; the longest row here has {round(n_keys[-1])}",
            f"教程说的是成千上万个键；这里最长的一行有 {round(n_keys[-1])} 个",
        ),
    ]
    if ctx.tiny:
        notes.append(
            say(
                "tiny mode: a random 1-layer character GPT stands in for SmolLM2",
                "tiny 模式：用一个随机初始化的 1 层字符级 GPT 代替 SmolLM2",
            )
        )
    data = {
        "fillers": list(fillers),
        "n_keys": n_keys,
        "head": [layer, head],
        "selected_weight": [list(s.values) for s in selected],
        "strongest_weight": [list(s.values) for s in strongest],
        "logprob": [list(s.values) for s in logprob],
        "recall": recall,
        "fixed_score_reference": reference,
        "delta": delta,
    }
    figure = _plot(n_keys, selected, strongest, reference, logprob, f"L{layer}H{head}", name)
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


def _model(ctx: lab.RunContext):
    """(model, encode, filler text, name): SmolLM2, or in tiny mode a random character GPT."""
    from glassformer.data.corpus import corpus_text

    text = corpus_text("modern")
    if ctx.tiny:
        from glassformer.config import ModelConfig
        from glassformer.models import build_model
        from glassformer.tokenizers import CharTokenizer

        text = text[:20_000]
        tokenizer = CharTokenizer.from_text(text + "The password is 0123456789.\n")
        torch.manual_seed(ctx.seed)
        cfg = ModelConfig(
            vocab_size=tokenizer.vocab_size,
            d_model=32,
            n_layers=1,
            n_heads=2,
            max_seq_len=256,
            position="rope",
        )
        return build_model(cfg).eval(), tokenizer.encode, text, "tiny random character GPT"
    from glassformer.interop.pretrained import from_pretrained

    model, tokenizer = from_pretrained("smollm2")
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    return model.eval(), encode, text, "SmolLM2-135M-Instruct"


def _plot(n_keys, selected, strongest, reference, logprob, head: str, name: str):
    fig, (left, right) = lab.new_figure(9.0, 3.4, ncols=2)
    for label, values in (
        (f"{head} (chosen on other prompts)", selected),
        ("strongest head per prompt", strongest),
    ):
        left.errorbar(
            n_keys,
            [s.mean for s in values],
            yerr=[s.spread for s in values],
            marker="o",
            capsize=3,
            label=label,
        )
    left.plot(n_keys, reference, "k--", label="fixed scores (fitted at the left)")
    left.plot(n_keys, [1 / k for k in n_keys], ":", color="grey", label="uniform 1/keys")
    left.set(
        xscale="log",
        yscale="log",
        xlabel="keys in the query's attention row",
        ylabel="weight on the needle's digits",
        title=f"attention on a far token ({name})",
    )
    left.legend(fontsize=7)
    right.errorbar(
        n_keys,
        [s.mean for s in logprob],
        yerr=[s.spread for s in logprob],
        marker="o",
        capsize=3,
        color="C2",
    )
    right.set(
        xscale="log",
        xlabel="keys in the query's attention row",
        ylabel="log p(needle digits) (nats)",
        title="copying the digits back",
    )
    for ax in (left, right):  # ticks at the measured lengths, after the scales are set
        ax.minorticks_off()
        ax.set_xticks(n_keys, [str(round(k)) for k in n_keys])
    return fig
