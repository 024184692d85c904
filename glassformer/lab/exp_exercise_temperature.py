"""Seed 002, 练习 2 第 2 步: the same open prompt ("给这款耳机写一句广告语", and its English
version, since SmolLM2-135M is trained mostly on English) generated 3 times at temperature 0 and
3 times at temperature 1.2; compare stability (how many distinct outputs) and "胡说" (how
surprising the model itself finds the sampled tokens: their mean -log p under its untempered
distribution, nats per token).

The seed gives no sampling code for this exercise, so the first sampler is written here the way
its numpy demo is written: probs = softmax(logits / T), then rng.choice (argmax at T = 0). The
library's Engine (glassformer.infer) is the second reference, with the same prompts and settings.
"""

from __future__ import annotations

import numpy as np
import torch

from glassformer.infer.engine import Engine
from glassformer.infer.sampling import SamplingParams, sampling_distribution
from glassformer.lab import base as lab

PROMPTS = {"zh": "给这款耳机写一句广告语", "en": "Write a one-line ad for these headphones."}
TEMPERATURES = (0.0, 1.2)  # the exercise's two settings
N_SAMPLES = 3  # "各生成 3 次"
# Thresholds: at T = 1.2 the 3 outputs are not all the same (at least 2 distinct: "稳定性" is
# what T = 0 has and T = 1.2 lacks); and the tokens sampled at T = 1.2 are more surprising to
# the model than the greedy ones by more than the spread of the 3 samples (lab.exceeds_spread,
# no extra margin: any difference beyond the samples' own scatter counts as "more 胡说").
# Preconditions: T = 0 gives one output 3 times (greedy obeys its definition) and the hand
# sampler's distribution at T = 1.2 is the library's (to float32 rounding, 1e-6).
SAME_DISTRIBUTION = 1e-6
SAMPLER_ZH = {"hand softmax(logits/T)": "手写 softmax(logits/T)", "library Engine": "库的 Engine"}
LANG_ZH = {"zh": "中文", "en": "英文"}


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def temperature_probs(logits: np.ndarray, temperature: float) -> np.ndarray:
    """softmax(logits / T) in float64; T = 0 is the one-hot argmax ("每步都选分数最高的词")."""
    if temperature == 0:
        one_hot = np.zeros(len(logits))
        one_hot[int(np.argmax(logits))] = 1.0
        return one_hot
    return softmax(logits.astype(np.float64) / temperature)


def entropy_nats(probs: np.ndarray) -> float:
    p = probs[probs > 0]
    return max(0.0, float(-(p * np.log(p)).sum()))


@torch.no_grad()
def hand_sample(
    model, prompt: list[int], temperatures: list[float], n_new: int, seed: int, eos: int | None
) -> list[dict]:
    """One row per temperature, all in one batch with a KV cache; every row draws from
    softmax(logits / T) with its own numpy generator. Returns the prompt's next-token logits
    and per row the new ids (up to and with the first eos) and each new token's -log p under
    the untempered distribution."""
    rows = len(temperatures)
    cache = model.new_cache(batch_size=rows, max_seq_len=len(prompt) + n_new)
    positions = torch.arange(len(prompt))
    logits = model(torch.tensor([prompt] * rows), positions, cache=cache, last_token_only=True)
    first = logits[0, -1].clone()  # (V,) the prompt's next-token logits, for the figure
    rngs = [np.random.default_rng(seed + i) for i in range(rows)]
    out = [{"ids": [], "surprisal": [], "done": False} for _ in range(rows)]
    for position in range(len(prompt), len(prompt) + n_new):
        step = logits[:, -1].double().numpy()  # (R, V)
        chosen = []
        for i, temperature in enumerate(temperatures):
            probs = temperature_probs(step[i], temperature)
            token = int(rngs[i].choice(len(probs), p=probs))
            chosen.append(token)
            if not out[i]["done"]:
                log_p = step[i] - step[i].max() - np.log(np.exp(step[i] - step[i].max()).sum())
                out[i]["ids"].append(token)
                out[i]["surprisal"].append(float(-log_p[token]))
                out[i]["done"] = token == eos
        if all(row["done"] for row in out):
            break
        at = torch.tensor([position])
        logits = model(torch.tensor(chosen)[:, None], at, cache=cache)  # (R, 1, V)
    return first, out


@torch.no_grad()
def surprisals(model, prompt: list[int], continuations: list[list[int]]) -> list[list[float]]:
    """-log p of each continuation token under the model (T = 1), by teacher forcing: the
    rows are right-padded, which a causal model never sees from earlier positions."""
    longest = max(len(c) for c in continuations)
    ids = torch.zeros(len(continuations), len(prompt) + longest, dtype=torch.long)
    for i, c in enumerate(continuations):
        ids[i, : len(prompt) + len(c)] = torch.tensor(prompt + c)
    log_p = torch.log_softmax(model(ids).double(), dim=-1)  # (R, T, V)
    start = len(prompt) - 1  # the position that predicts the first new token
    return [
        [-float(log_p[i, start + j, t]) for j, t in enumerate(c)]
        for i, c in enumerate(continuations)
    ]


def engine_sample(
    engine: Engine, prompt: list[int], temperatures: list[float], n_new: int, seed: int
) -> list[list[int]]:
    """The library's sampler: one Engine row per temperature, stepped together."""
    rows = [
        engine.add(prompt, SamplingParams(temperature=t, seed=seed + i, max_new_tokens=n_new))
        for i, t in enumerate(temperatures)
    ]
    while engine.step():
        pass
    return [row.result().token_ids for row in rows]


@lab.register("exercise-temperature")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    model, tokenizer, name = _model(ctx)
    n_new = ctx.pick(24, 8, 3)
    # Quick and tiny run the seed's own prompt; full mode adds the English one. The Engine (the
    # second reference) runs the seed's prompt; in full mode both.
    prompts = {
        lang: ids
        for lang, ids in _prompts(tokenizer).items()
        if lang in ctx.pick(("zh", "en"), ("zh",), ("zh", "en"))
    }
    engine_prompts = ctx.pick(("zh", "en"), ("zh",), ("zh",))
    eos = model.cfg.eos_token_id
    temperatures = [t for t in TEMPERATURES for _ in range(N_SAMPLES)]
    engine = Engine(model)
    engine.reserve(len(temperatures), max(len(p) for p in prompts.values()) + n_new + 1)
    rows, checks, summary, first_step = [], [], {}, {}
    for lang, prompt in prompts.items():
        logits, hand = hand_sample(model, prompt, temperatures, n_new, ctx.seed, eos)
        first_step[lang] = logits
        samplers = {
            "hand softmax(logits/T)": ([r["ids"] for r in hand], [r["surprisal"] for r in hand])
        }
        if lang in engine_prompts:
            by_engine = engine_sample(engine, prompt, temperatures, n_new, ctx.seed)
            samplers["library Engine"] = (by_engine, surprisals(model, prompt, by_engine))
        for sampler, (outputs, per_token) in samplers.items():
            for t in TEMPERATURES:
                picked = [i for i, tt in enumerate(temperatures) if tt == t]
                mean_surprisal = [float(np.mean(per_token[i])) for i in picked]
                distinct = len({tuple(outputs[i]) for i in picked})
                summary[(lang, sampler, t)] = (lab.over_seeds(mean_surprisal), distinct)
                for k, i in enumerate(picked):
                    rows.append(
                        _row(
                            ctx,
                            lang,
                            sampler,
                            t,
                            k + 1,
                            outputs[i],
                            mean_surprisal[k],
                            _text(tokenizer, outputs[i]),
                        )
                    )
            greedy, hot = summary[(lang, sampler, 0.0)], summary[(lang, sampler, 1.2)]
            checks += _checks(ctx, lang, sampler, greedy, hot)
        ours = temperature_probs(logits.double().numpy(), 1.2)
        theirs = sampling_distribution(logits[None], SamplingParams(temperature=1.2))[0]
        what = ctx.say(
            f"{lang}: max |hand - library| probability at T=1.2",
            f"{LANG_ZH[lang]}：T=1.2 时手写与库的概率之差的最大绝对值",
        )
        gap = float(np.abs(ours - theirs.double().numpy()).max())
        checks.append(lab.precondition(lab.approx(what, gap, 0, SAME_DISTRIBUTION)))

    notes = _notes(
        ctx, name, prompts, engine_prompts, n_new, len(temperatures), summary, first_step
    )
    figure = _plot(ctx, summary, first_step, tokenizer)
    data = {
        f"{lang}|{sampler}|{t:g}": {"surprisal": list(s.values), "distinct": d}
        for (lang, sampler, t), (s, d) in summary.items()
    }
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _row(
    ctx: lab.RunContext,
    lang: str,
    sampler: str,
    t: float,
    k: int,
    ids: list[int],
    surprisal: float,
    text: str,
) -> dict:
    ctx.say(lang, LANG_ZH[lang])
    return {
        ctx.say("prompt", "提示词"): lang,
        ctx.say("sampler", "采样器"): ctx.say(sampler, SAMPLER_ZH[sampler]),
        ctx.say("T", "温度 T"): t,
        ctx.say("sample", "第几次"): k,
        ctx.say("tokens", "token 数"): len(ids),
        ctx.say("surprisal (nats/token)", "惊讶度（nats/token）"): surprisal,
        ctx.say("text", "文本"): text,
    }


def _checks(ctx: lab.RunContext, lang: str, sampler: str, greedy, hot) -> list[lab.Check]:
    """T=0's one output (a precondition: greedy obeys its definition), and the evidence: T=1.2
    less stable (distinct outputs) and more 胡说 (surprisal beyond the samples' spread)."""
    en, zh = f"{lang}, {sampler}", f"{LANG_ZH[lang]}，{SAMPLER_ZH[sampler]}"
    say = ctx.say
    stable = say("T=1.2 is less stable than T=0", "T=1.2 不如 T=0 稳定")
    nonsense = say("T=1.2 says more 胡说", "T=1.2 更“胡说”")
    return [
        lab.precondition(
            lab.approx(
                say(f"{en}: distinct outputs of 3 at T=0", f"{zh}：T=0 下 3 次输出中不同的个数"),
                greedy[1],
                1,
                0,
            )
        ),
        lab.at_least(
            say(f"{en}: distinct outputs of 3 at T=1.2", f"{zh}：T=1.2 下 3 次输出中不同的个数"),
            hot[1],
            2,
            group=stable,
        ),
        lab.exceeds_spread(
            say(
                f"{en}: surprisal T=1.2 - T=0 (nats/token)",
                f"{zh}：惊讶度 T=1.2 减 T=0（nats/token）",
            ),
            hot[0],
            greedy[0],
            group=nonsense,
        ),
    ]


def _notes(
    ctx: lab.RunContext,
    name: str,
    prompts: dict,
    engine_prompts,
    n_new: int,
    n_rows: int,
    summary: dict,
    first_step: dict,
) -> list[str]:
    shown = {k: PROMPTS[k] for k in prompts}
    seeds = f"{ctx.seed}..{ctx.seed + n_rows - 1}"
    notes = [
        ctx.say(
            f"model: {name}; prompts in the chat template: {shown}; Engine on "
            f"{list(engine_prompts)}; {n_new} new tokens at most, seeds {seeds}",
            f"模型：{name}；套用对话模板的提示词：{shown}；"
            f"Engine 跑 {list(engine_prompts)}；最多生成 {n_new} 个 token，"
            f"随机种子 {seeds}",
        )
    ]
    for (lang, sampler, t), (spread, distinct) in summary.items():
        notes.append(
            ctx.say(
                f"{lang}, {sampler}, T={t:g}: {distinct} distinct of {N_SAMPLES}, "
                f"surprisal {spread} nats/token",
                f"{LANG_ZH[lang]}，{SAMPLER_ZH[sampler]}，T={t:g}：{N_SAMPLES} 次中 "
                f"{distinct} 个不同，惊讶度 {spread} nats/token",
            )
        )
    for lang, logits in first_step.items():
        flat = {t: entropy_nats(temperature_probs(logits.double().numpy(), t)) for t in (1, 1.2)}
        notes.append(
            ctx.say(
                f"{lang}: first-token entropy {flat[1]:.2f} nats at T=1, {flat[1.2]:.2f} at T=1.2 "
                "(dividing by T > 1 always flattens: a property of softmax, not a finding)",
                f"{LANG_ZH[lang]}：第一个 token 的熵在 T=1 时 {flat[1]:.2f} nats，T=1.2 时 "
                f"{flat[1.2]:.2f}（除以 T > 1 总会让分布变平：这是 softmax 的性质，不是发现）",
            ),
        )
    return notes


def tick_label(tokenizer, token_id: int) -> str:
    """lab.token_label, with a byte piece (part of a character's UTF-8, which decodes to the
    replacement glyph U+FFFD) shown as its bytes' escapes, e.g. b'\\xe7\\xbb'."""
    label = lab.token_label(tokenizer, token_id)
    if tokenizer is None or "\ufffd" not in label:
        return label
    from glassformer.tokenize import model_vocabulary

    return repr(model_vocabulary(tokenizer, "model").token_bytes(token_id))


def _model(ctx: lab.RunContext):
    if ctx.tiny:
        from glassformer.config import ModelConfig
        from glassformer.models import build_model

        torch.manual_seed(ctx.seed)
        # init_std 1.0: a peaked softmax, so greedy and T=1.2 differ as in a trained model
        cfg = ModelConfig(
            vocab_size=64,
            d_model=32,
            n_layers=1,
            n_heads=2,
            max_seq_len=64,
            init_std=1.0,
            eos_token_id=None,
        )
        return build_model(cfg).eval(), None, "tiny random GPT"
    from glassformer.interop.pretrained import from_pretrained

    model, tokenizer = from_pretrained("smollm2")
    return model, tokenizer, "SmolLM2-135M-Instruct"


def _prompts(tokenizer) -> dict[str, list[int]]:
    if tokenizer is None:
        return {"zh": [1, 2, 3, 4, 5, 6], "en": [7, 8, 9, 10]}
    return {
        lang: tokenizer.encode_chat([{"role": "user", "content": text}])
        for lang, text in PROMPTS.items()
    }


def _text(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids)).replace("\n", " ")[:48] if tokenizer else str(list(ids))


def _plot(ctx: lab.RunContext, summary: dict, first_step: dict, tokenizer):
    fig, (left, right) = lab.new_figure(9.0, 3.6, ncols=2)
    groups = sorted({(lang, sampler) for lang, sampler, _ in summary})
    labels = [f"{lang} prompt\n{sampler}" for lang, sampler in groups]
    x = np.arange(len(groups))
    for offset, t in ((-0.2, 0.0), (0.2, 1.2)):
        means = [summary[(lang, sampler, t)][0].mean for lang, sampler in groups]
        errs = [summary[(lang, sampler, t)][0].spread for lang, sampler in groups]
        left.bar(x + offset, means, 0.4, yerr=errs, capsize=3, label=f"T={t:g} (3 samples)")
    left.set_xticks(x, labels, fontsize=7)
    left.set_ylabel("surprisal of sampled tokens (nats/token)")
    left.set_title("“胡说”程度：模型自己有多意外")
    left.legend(fontsize=7)
    logits = first_step["zh"].double().numpy()
    top = np.argsort(-logits)[:10]
    names = [tick_label(tokenizer, int(t)) for t in top]
    lab.grouped_bars(
        right,
        names,
        {f"T={t:g}": temperature_probs(logits, t)[top].tolist() for t in (0.0, 1.0, 1.2)},
        rotation=60,
        fontsize=7,
    )
    right.set_ylabel("probability of the first token")
    right.set_title("zh prompt: top 10 first tokens")
    right.legend(fontsize=7)
    return fig
