"""Seed 002 "第⑥步就是 temperature / top_p 在管的地方": the output layer gives every candidate a
score, the sampling step picks one, and "要稳定输出就 temperature=0" is "每步都选分数最高的词".

Measured on SmolLM2 with the library's Engine and sampler. Temperature 0: the same continuation
for every seed, and at every step the token the model's own scores rank first, recomputed here
without the KV cache by a full forward pass over the prompt and the tokens so far. Above 0 the
continuations differ. top_p and top_k act on that one step: thousands of draws from the
library's sampler against the truncated, renormalised distribution computed here with numpy
from the raw logits. That entropy rises with temperature is a property of softmax (dividing the
scores by T > 1 always flattens them): a row, not evidence.
"""

from __future__ import annotations

import numpy as np
import torch

from glassformer.infer.engine import Engine
from glassformer.infer.sampling import SamplingParams, make_generator, sample, sampling_distribution
from glassformer.lab import base as lab

PROMPT = "Write a one-line ad for these wireless headphones:"
TEMPERATURES = (0.0, 0.5, 1.0, 1.5)
TOP_K, TOP_P = 20, 0.9
# Thresholds, stated once. "Stable at temperature 0": one distinct continuation over every seed,
# and every generated token is the argmax of the recomputed scores. Above 0 it is not stable:
# at T = 1 at least 2 distinct continuations. top_p / top_k: no draw outside the set computed
# here, and a total-variation distance between the draws' frequencies and the renormalised
# distribution of at most 0.05 (sampling noise alone gives about 0.01 at 20,000 draws over
# top-k's 20 tokens, 0.02 at quick mode's 6,000).
MAX_TV = 0.05
CHUNK = 500  # draws per call of the sampler: a [CHUNK, V] batch of one row repeated


def entropy_bits(probs: torch.Tensor) -> float:
    p = probs[probs > 0]
    return max(0.0, float(-(p * p.log2()).sum()))  # max: no "-0" for a one-hot


@torch.no_grad()
def greedy_matches(model, prompt: list[int], generated: list[int]) -> int:
    """How many generated tokens are the argmax of the scores a full forward pass (no cache)
    gives at their position: the seed's "每步都选分数最高的词", computed independently."""
    ids = torch.tensor([prompt + generated])
    logits = model(ids)[0]  # (T, V)
    ranked_first = logits[len(prompt) - 1 : -1].argmax(dim=-1).tolist()
    return sum(a == b for a, b in zip(ranked_first, generated, strict=True))


def reference_truncated(logits: np.ndarray, top_k: int | None, top_p: float | None) -> np.ndarray:
    """numpy's T=1 softmax cut to the top_k tokens, or to the smallest set whose mass reaches
    top_p, renormalised: the distribution the seed's sampling step should draw from."""
    z = logits.astype(np.float64) - logits.max()
    probs = np.exp(z) / np.exp(z).sum()
    order = np.argsort(-probs, kind="stable")
    if top_k is not None:
        keep = order[:top_k]
    else:
        n = int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1
        keep = order[:n]
    out = np.zeros_like(probs)
    out[keep] = probs[keep] / probs[keep].sum()
    return out


def draw_frequencies(logits: torch.Tensor, params: SamplingParams, n: int, seed: int) -> np.ndarray:
    """The library sampler's empirical distribution over n draws of one next token."""
    generator = make_generator(seed)
    counts = torch.zeros(logits.shape[-1], dtype=torch.long)
    for start in range(0, n, CHUNK):
        batch = logits.expand(min(CHUNK, n - start), -1)
        counts += torch.bincount(sample(batch, params, generator), minlength=logits.shape[-1])
    return (counts.double() / n).numpy()


@lab.register("sampling")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    say = ctx.say
    model, tokenizer, name = _model(ctx)
    prompt = tokenizer.encode(PROMPT) if tokenizer else list(range(1, 9))
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), last_token_only=True)[:, -1].float()  # (1, V)
    engine = Engine(model)
    n_samples, n_tokens, n_draws = (
        ctx.pick(8, 6, 2),
        ctx.pick(24, 12, 3),
        ctx.pick(20000, 6000, 1000),
    )
    outs = {
        t: [
            engine.generate(prompt, n_tokens, temperature=t, seed=s).token_ids
            for s in range(n_samples)
        ]
        for t in TEMPERATURES
    }
    distinct = {t: len({tuple(o) for o in outs[t]}) for t in TEMPERATURES}
    greedy = outs[0.0][0]
    matches = greedy_matches(model, prompt, greedy)
    cut = {}  # label -> (kept by the reference, draws outside it, TV distance)
    for label, top_k, top_p in ((f"top-k {TOP_K}", TOP_K, None), (f"top-p {TOP_P}", None, TOP_P)):
        reference = reference_truncated(logits[0].numpy(), top_k, top_p)
        drawn = draw_frequencies(
            logits, SamplingParams(1.0, top_k=top_k, top_p=top_p), n_draws, ctx.seed
        )
        cut[label] = (
            int((reference > 0).sum()),
            float(drawn[reference == 0].sum()),
            0.5 * float(np.abs(drawn - reference).sum()),
        )

    stable = say(
        "temperature 0 is stable: every step picks the top score",
        "温度 0 输出稳定：每步都选分数最高的词",
    )
    step = say(
        "top-p and top-k cut the distribution at the sampling step",
        "top-p 与 top-k 在采样这一步截断分布",
    )
    checks = [
        lab.approx(
            say(
                f"distinct continuations at T=0 over {n_samples} seeds",
                f"温度 0 下 {n_samples} 个随机种子的不同续写数",
            ),
            distinct[0.0],
            1,
            0,
            group=stable,
        ),
        lab.approx(
            say(
                f"T=0 tokens that are the argmax of a cache-free forward (of {n_tokens})",
                f"温度 0 生成的 token 中等于无缓存完整前向 argmax 的个数（共 {n_tokens} 个）",
            ),
            matches,
            len(greedy),
            0,
            group=stable,
        ),
        lab.at_least(
            say(
                f"distinct continuations at T=1 over {n_samples} seeds",
                f"温度 1 下 {n_samples} 个随机种子的不同续写数",
            ),
            distinct[1.0],
            2,
            group=stable,
        ),
    ]
    for label, (_, outside, tv) in cut.items():
        checks += [
            lab.approx(
                say(
                    f"{label}: share of {n_draws} draws outside the reference set",
                    f"{label}：{n_draws} 次抽样中落在参照集合之外的比例",
                ),
                outside,
                0.0,
                0.0,
                group=step,
            ),
            lab.at_most(
                say(
                    f"{label}: total variation, draws vs numpy reference",
                    f"{label}：抽样频率与 numpy 参照分布的总变差",
                ),
                tv,
                MAX_TV,
                group=step,
            ),
        ]
    rows = _rows(ctx, logits, distinct, outs, tokenizer, cut, n_samples, n_tokens)
    notes = _notes(ctx, name, n_samples, n_draws, matches, greedy, tokenizer)
    entropies = [
        entropy_bits(sampling_distribution(logits, SamplingParams(t))[0]) for t in TEMPERATURES
    ]
    figure = _plot(logits, entropies, [distinct[t] for t in TEMPERATURES], tokenizer)
    data = {
        "entropies_bits": entropies,
        "distinct": [distinct[t] for t in TEMPERATURES],
        "greedy": greedy,
        "greedy_matches": matches,
        "cut": {k: list(v) for k, v in cut.items()},
    }
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _rows(ctx, logits, distinct, outs, tokenizer, cut, n_samples, n_tokens) -> list[dict]:
    say = ctx.say
    sampler, entropy = (
        say("sampler", "采样方式"),
        say("next-token entropy (bits)", "下一个 token 的熵（比特）"),
    )
    top1, kept = say("top-1 prob", "最高概率"), say("tokens kept", "保留的 token 数")
    n_distinct = say(
        f"distinct of {n_samples} x {n_tokens} tok",
        f"{n_samples} 次 x {n_tokens} token 中不同的个数",
    )
    example, tv = say("example", "示例"), say("total variation vs numpy", "与 numpy 的总变差")
    rows = []
    for t in TEMPERATURES:
        probs = sampling_distribution(logits, SamplingParams(temperature=t))[0]
        rows.append(
            {
                sampler: say(f"temperature {t:g}", f"温度 {t:g}"),
                entropy: entropy_bits(probs),
                top1: float(probs.max()),
                kept: int((probs > 0).sum()),
                n_distinct: distinct[t],
                example: _text(tokenizer, outs[t][0]),
                tv: "-",
            }
        )
    for label, (n_kept, _, distance) in cut.items():
        rows.append(
            {
                sampler: say(f"{label} (T=1)", f"{label}（温度 1）"),
                entropy: "-",
                top1: "-",
                kept: n_kept,
                n_distinct: "-",
                example: "-",
                tv: distance,
            }
        )
    return rows


def _notes(ctx, name, n_samples, n_draws, matches, greedy, tokenizer) -> list[str]:
    return [
        ctx.say(
            f"model: {name}; prompt: {PROMPT!r}; continuations with seeds 0..{n_samples - 1}; "
            f"{n_draws} draws of the next token per truncation",
            f"模型：{name}；提示：{PROMPT!r}；续写用随机种子 0..{n_samples - 1}；每种截断抽取 "
            f"{n_draws} 次下一个 token",
        ),
        ctx.say(
            f"the T=0 continuation {_text(tokenizer, greedy)!r}: {matches} of {len(greedy)} "
            "tokens are the top score of a forward pass over everything before them",
            f"温度 0 的续写 {_text(tokenizer, greedy)!r}：{len(greedy)} 个 token 中有 "
            f"{matches} 个是对其之前全部内容做一次前向后分数最高的词",
        ),
        ctx.say(
            "the entropy rows rise with temperature because dividing the scores by a larger "
            "T flattens any softmax: a property of the formula, shown, not counted as evidence",
            "熵随温度升高，是因为把分数除以更大的 T 会让任何 softmax 变平：这是公式的性质，"
            "只列出，不算作证据",
        ),
    ]


def _model(ctx: lab.RunContext):
    if ctx.tiny:
        from glassformer.config import ModelConfig
        from glassformer.models import build_model

        torch.manual_seed(ctx.seed)
        # init_std 1.0: a peaked softmax, not the near-uniform one of a 0.02 init
        cfg = ModelConfig(
            vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=64, init_std=1.0
        )
        return build_model(cfg).eval(), None, "tiny random GPT"
    from glassformer.interop.pretrained import from_pretrained

    model, tokenizer = from_pretrained("smollm2")
    return model, tokenizer, "SmolLM2-135M"


def _text(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids)).replace("\n", " ")[:40] if tokenizer else str(list(ids))


def _plot(logits, entropies, distinct, tokenizer):
    fig, (left, right) = lab.new_figure(8.4, 3.4, ncols=2)
    left.plot(TEMPERATURES, entropies, "o-", color="C0")
    left.set(xlabel="temperature", ylabel="next-token entropy (bits)", title="温度越高，分布越平")
    twin = left.twinx()
    twin.plot(TEMPERATURES, distinct, "s--", color="C1")
    twin.set_ylabel("distinct continuations", color="C1")
    top = torch.topk(logits[0].float(), 10).indices
    samplers = {
        "T=0.5": SamplingParams(0.5),
        "T=1": SamplingParams(1.0),
        f"T=1, top-p {TOP_P}": SamplingParams(1.0, top_p=TOP_P),
    }
    tokens = [lab.token_label(tokenizer, int(t)) for t in top]
    lab.grouped_bars(
        right,
        tokens,
        {
            name: sampling_distribution(logits, params)[0][top].tolist()
            for name, params in samplers.items()
        },
        rotation=60,
        fontsize=7,
    )
    right.set(ylabel="probability", title="top 10 next tokens")
    right.legend(fontsize=7)
    return fig
