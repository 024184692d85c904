"""Seed 002 "第⑥步 ... 采样": temperature 0 picks the top token every step (deterministic); higher
temperatures spread the distribution (entropy and distinct continuations grow); top-k and top-p
cut its tail. Measured on SmolLM2 with glassformer.infer.sampling and the Engine's seeds.
"""

from __future__ import annotations

import torch

from glassformer.infer.engine import Engine
from glassformer.infer.sampling import SamplingParams, sampling_distribution
from glassformer.lab import base as lab

PROMPT = "Write a one-line ad for these wireless headphones:"
TEMPERATURES = (0.0, 0.5, 1.0, 1.5)
TOP_K, TOP_P = 20, 0.9
# Thresholds: temperature 0 gives exactly one distinct continuation; entropy must rise with
# temperature (each step >= the last); at the highest temperature more than one continuation.


def entropy_bits(probs: torch.Tensor) -> float:
    p = probs[probs > 0]
    return max(0.0, float(-(p * p.log2()).sum()))  # max: no "-0" for a one-hot


@lab.register("sampling")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    model, tokenizer, name = _model(ctx)
    prompt = tokenizer.encode(PROMPT) if tokenizer else list(range(1, 9))
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), last_token_only=True)[:, -1]  # (1, V)
    engine = Engine(model)
    n_samples, n_tokens = ctx.pick(8, 4, 2), ctx.pick(16, 8, 3)
    rows, checks, entropies, distinct = [], [], [], []
    for temperature in TEMPERATURES:
        probs = sampling_distribution(logits, SamplingParams(temperature=temperature))[0]
        outs = [
            tuple(engine.generate(prompt, n_tokens, temperature=temperature, seed=s).token_ids)
            for s in range(n_samples)
        ]
        entropies.append(entropy_bits(probs))
        distinct.append(len(set(outs)))
        rows.append(
            {
                "sampler": f"temperature {temperature:g}",
                "next-token entropy (bits)": entropies[-1],
                "top-1 prob": float(probs.max()),
                "tokens kept": int((probs > 0).sum()),
                f"distinct of {n_samples} x {n_tokens} tok": distinct[-1],
                "example": _text(tokenizer, outs[0]),
            }
        )
    for label, params in (
        (f"top-k {TOP_K} (T=1)", SamplingParams(1.0, top_k=TOP_K)),
        (f"top-p {TOP_P} (T=1)", SamplingParams(1.0, top_p=TOP_P)),
    ):
        probs = sampling_distribution(logits, params)[0]
        rows.append({"sampler": label, "next-token entropy (bits)": entropy_bits(probs),
                     "top-1 prob": float(probs.max()),
                     "tokens kept": int((probs > 0).sum())})  # fmt: skip
    full = torch.softmax(logits.float(), -1)[0]
    nucleus = int((sampling_distribution(logits, SamplingParams(1.0, top_p=TOP_P))[0] > 0).sum())
    top_mass = float(full.sort(descending=True).values[:nucleus].sum())
    mass_before_last = float(full.sort(descending=True).values[: nucleus - 1].sum())

    # Preconditions: the sampler obeys its own parameters (greedy repeats, top-k keeps k, top-p
    # keeps the smallest nucleus). Evidence: what temperature does to the distribution.
    checks.append(
        lab.precondition(lab.approx("distinct continuations at temperature 0", distinct[0], 1, 0))
    )
    for i in range(1, len(TEMPERATURES)):
        checks.append(lab.at_least(f"entropy rise T={TEMPERATURES[i - 1]:g}->{TEMPERATURES[i]:g}",
                                   entropies[i] - entropies[i - 1], 0))  # fmt: skip
    checks.append(
        lab.at_least(f"distinct continuations at T={TEMPERATURES[-1]:g}", distinct[-1], 2)
    )
    checks += [lab.precondition(c) for c in (
        lab.at_most(f"tokens kept by top-k {TOP_K}", rows[-2]["tokens kept"], TOP_K),
        lab.at_least(f"mass of the top-p {TOP_P} nucleus", top_mass, TOP_P),
        lab.at_most(f"mass without its least token (smallest set: < {TOP_P})",
                    mass_before_last, TOP_P - 1e-9),
    )]  # fmt: skip
    notes = [f"model: {name}; prompt: {PROMPT!r}; seeds 0..{n_samples - 1}"]
    figure = _plot(logits, entropies, distinct, tokenizer)
    data = {"entropies": entropies, "distinct": distinct, "vocab_size": int(logits.shape[-1]),
            "top_p_nucleus": nucleus}  # fmt: skip
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _model(ctx: lab.RunContext):
    if ctx.tiny:
        from glassformer.config import ModelConfig
        from glassformer.models import build_model

        torch.manual_seed(ctx.seed)
        # init_std 1.0: a peaked softmax, not the near-uniform one of a 0.02 init
        cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=64,
                          init_std=1.0)  # fmt: skip
        return build_model(cfg).eval(), None, "tiny random GPT"
    from glassformer.interop.pretrained import from_pretrained

    model, tokenizer = from_pretrained("smollm2")
    return model, tokenizer, "SmolLM2-135M"


def _text(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids)).replace("\n", " ")[:40] if tokenizer else str(list(ids))


def _plot(logits, entropies, distinct, tokenizer):
    fig, (left, right) = lab.new_figure(8.4, 3.4, ncols=2)
    left.plot(TEMPERATURES, entropies, "o-", label="next-token entropy (bits)")
    left.plot(TEMPERATURES, distinct, "s--", label="distinct continuations")
    left.set_xlabel("temperature")
    left.set_title("温度越高，分布越平")
    left.legend(fontsize=7)
    top = torch.topk(logits[0].float(), 10).indices
    samplers = {"T=0.5": SamplingParams(0.5), "T=1": SamplingParams(1.0),
                f"T=1, top-p {TOP_P}": SamplingParams(1.0, top_p=TOP_P)}  # fmt: skip
    tokens = [lab.token_label(tokenizer, int(t)) for t in top]
    lab.grouped_bars(right, tokens, {name: sampling_distribution(logits, params)[0][top].tolist()
                                 for name, params in samplers.items()},
                     rotation=60, fontsize=7)  # fmt: skip
    right.set_ylabel("probability")
    right.set_title("top 10 next tokens")
    right.legend(fontsize=7)
    return fig
