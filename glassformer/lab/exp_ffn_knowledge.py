"""Seed 000 §5.1 (and seed 002's block section): facts live mostly in the FFN's two big matrices,
and in decoding the FFN, not attention's new row, is a main source of per-token latency.

Knowledge: factual prompts SmolLM2-135M answers right greedily ("The capital of France is" ->
" Paris"); the log-probability of the answer's first token with the FFN outputs of a band of
middle layers zeroed, with the attention outputs of the same layers zeroed, and with as many
sublayers zeroed at random (attention or FFN, any layer: the matched control), each draw a
seed. Latency: one decode step after a prompt, timed module by module with forward hooks.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from glassformer import calc
from glassformer.lab import base as lab

FACTS = [
    ("The capital of France is", " Paris"),
    ("The capital of Germany is", " Berlin"),
    ("The capital of Italy is", " Rome"),
    ("The capital of Japan is", " Tokyo"),
    ("The capital of Spain is", " Madrid"),
    ("The capital of Russia is", " Moscow"),
    ("The capital of Egypt is", " Cairo"),
    ("The Eiffel Tower is located in the city of", " Paris"),
    ("The largest planet in our solar system is", " Jupiter"),
    ("Romeo and Juliet was written by William", " Shakespeare"),
    ("Water is made of hydrogen and", " oxygen"),
    ("The Statue of Liberty is in New", " York"),
    ("The currency of Japan is the", " yen"),
    ("The Great Wall is in", " China"),
]
N_BANDS = 5  # the layers cut into 5 equal windows; the middle one is the claim's "middle band"
MIN_FACTS = 5  # precondition: at least this many facts the model gets right, or no verdict
# Thresholds: a drop counts when it exceeds the spread (lab.exceeds_spread, no extra margin):
# the FFN band's drop in answer log-prob against the attention band's (spread over the facts),
# and against the random control's (spread over the facts of the draws' mean drop). Latency:
# the FFNs' time per decode step against attention's, spread over the timed steps.


def module_sets(model: nn.Module) -> dict[str, list[nn.Module]]:
    """ "ffn" and "attn": each block's FFN and attention module, in layer order."""
    return {"ffn": [b.ffn for b in model.blocks], "attn": [b.attn for b in model.blocks]}


@contextmanager
def zeroed(modules: list[nn.Module]) -> Iterator[None]:
    """While active, each module's output is replaced by zeros: its residual branch adds
    nothing (pre-norm: x + 0), the ablation of "what this sublayer writes"."""
    handles = [
        m.register_forward_hook(lambda mod, args, out: torch.zeros_like(out)) for m in modules
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def next_token_log_probs(model: nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    """(N, V) log-probabilities of the token after each prompt, in one right-padded batch (a
    causal model never sees the padding from earlier positions)."""
    batch = torch.zeros(len(prompts), max(len(p) for p in prompts), dtype=torch.long)
    for row, p in enumerate(prompts):
        batch[row, : len(p)] = torch.tensor(p)
    with torch.no_grad():
        log_p = torch.log_softmax(model(batch).double(), dim=-1)  # (N, T, V)
    return log_p[torch.arange(len(prompts)), torch.tensor([len(p) - 1 for p in prompts])]


def answer_logprobs(model: nn.Module, prompts: list[list[int]], answers: list[int]) -> np.ndarray:
    """log p(answer's first token | prompt) for every prompt."""
    log_p = next_token_log_probs(model, prompts)  # (N, V)
    return log_p[torch.arange(len(prompts)), torch.tensor(answers)].numpy()


def bands(n_layers: int, n_bands: int = N_BANDS) -> list[range]:
    """n_bands windows of equal width covering the layers in order (the rest on the last)."""
    width = n_layers // n_bands
    edges = [i * width for i in range(n_bands)] + [n_layers]
    return [range(edges[i], edges[i + 1]) for i in range(n_bands)]


class ModuleTimer:
    """Seconds spent inside each hooked module, per forward call of the model."""

    def __init__(self, groups: dict[str, list[nn.Module]]) -> None:
        self.seconds = {name: 0.0 for name in groups}
        self._start: dict[int, float] = {}
        self._handles = []
        for name, modules in groups.items():
            for m in modules:
                self._handles.append(m.register_forward_pre_hook(self._enter))
                self._handles.append(m.register_forward_hook(self._leave(name)))

    def _enter(self, module, args) -> None:
        self._start[id(module)] = time.perf_counter()

    def _leave(self, name: str):
        def hook(module, args, out) -> None:
            self.seconds[name] += time.perf_counter() - self._start.pop(id(module))

        return hook

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


@torch.no_grad()
def decode_step_times(model: nn.Module, context: int, n_steps: int, seed: int) -> list[dict]:
    """Per decode step after a `context`-token prompt: seconds in the FFNs, in attention, in
    the output head, and the whole step."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, context), generator=generator)
    cache = model.new_cache(batch_size=1, max_seq_len=context + n_steps + 1)
    logits = model(prompt, torch.arange(context), cache=cache, last_token_only=True)
    timer = ModuleTimer({**module_sets(model), "output head": [model.lm_head]})
    steps = []
    try:
        for position in range(context, context + n_steps + 1):  # the first step warms up
            timer.reset()
            t0 = time.perf_counter()
            at = torch.tensor([position])
            logits = model(logits[:, -1].argmax(-1, keepdim=True), at, cache=cache)
            steps.append({**timer.seconds, "step": time.perf_counter() - t0})
    finally:
        timer.close()
    return steps[1:]


@lab.register("ffn-knowledge")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    model, tokenizer, name = _model(ctx)
    n_layers = model.cfg.n_layers
    prompts, answers = _facts(tokenizer, model)
    log_p = next_token_log_probs(model, prompts)  # (N, V), unablated
    greedy = log_p.argmax(-1).tolist()
    kept = [i for i, (g, a) in enumerate(zip(greedy, answers, strict=True)) if g == a]
    prompts, answers = [prompts[i] for i in kept], [answers[i] for i in kept]
    base = log_p[kept, answers].numpy()  # log p of the answers the model gets right
    say = ctx.say
    what_, value_, unit_ = say("what", "项目"), say("value", "数值"), say("unit", "单位")
    rows, checks, notes = [], [], []
    checks.append(
        lab.precondition(
            lab.at_least(
                say(
                    f"facts {name} answers right greedily (of {len(FACTS)})",
                    f"{name} 贪心解码答对的事实数（共 {len(FACTS)} 条）",
                ),
                len(kept),
                MIN_FACTS,
            )
        )
    )
    if len(kept) < MIN_FACTS:
        notes.append(
            say(
                f"{name} gets {len(kept)} of {len(FACTS)} facts right: too few to ablate",
                f"{name} 在 {len(FACTS)} 条事实中答对 {len(kept)} 条：太少，无法做消融",
            )
        )
        drops, random_drops, middle = {}, [], bands(n_layers)[N_BANDS // 2]
    else:
        sets = module_sets(model)
        drops = {}
        middle = bands(n_layers)[N_BANDS // 2]
        # every window for the figure in full mode; quick and tiny ablate the middle one only
        for band in ctx.pick(bands(n_layers), [middle], [middle]):
            for kind in ("ffn", "attn"):
                with zeroed([sets[kind][i] for i in band]):
                    drops[(kind, band)] = base - answer_logprobs(model, prompts, answers)
        sublayers = [(kind, i) for kind in ("ffn", "attn") for i in range(n_layers)]
        random_drops = []
        for seed in ctx.seeds():
            picked = random.Random(seed).sample(sublayers, len(middle))
            with zeroed([sets[kind][i] for kind, i in picked]):
                random_drops.append(base - answer_logprobs(model, prompts, answers))
        ffn, attn = (lab.over_seeds(drops[(k, middle)].tolist()) for k in ("ffn", "attn"))
        control = lab.over_seeds(np.mean(random_drops, axis=0).tolist())
        label = f"layers {middle.start}-{middle.stop - 1}"
        label_zh = f"第 {middle.start}-{middle.stop - 1} 层"
        n_draws = len(random_drops)
        nats_drop = say("nats (drop of log p)", "nats（log p 的下降）")
        for what, spread in (
            (say(f"FFN {label} zeroed", f"{label_zh} FFN 置零"), ffn),
            (say(f"attention {label} zeroed", f"{label_zh}注意力置零"), attn),
            (
                say(
                    f"{len(middle)} random sublayers zeroed ({n_draws} draws)",
                    f"随机 {len(middle)} 个子层置零（抽 {n_draws} 次）",
                ),
                control,
            ),
        ):
            rows.append({what_: what, value_: str(spread), unit_: nats_drop})
        in_ffn = say("facts live in the FFNs", "事实存在 FFN 里")
        checks += [
            lab.exceeds_spread(
                say(
                    f"drop: FFN {label} - attention {label} (nats)",
                    f"下降：{label_zh} FFN 减{label_zh}注意力（nats）",
                ),
                ffn,
                attn,
                group=in_ffn,
            ),
            lab.exceeds_spread(
                say(
                    f"drop: FFN {label} - random sublayers (nats)",
                    f"下降：{label_zh} FFN 减随机子层（nats）",
                ),
                ffn,
                control,
                group=in_ffn,
            ),
        ]
        notes.append(
            say(
                f"{len(kept)} facts kept; mean log p of the answer {base.mean():.2f} nats "
                f"unablated; drops: FFN {label} {ffn.mean:.2f}, attention {attn.mean:.2f}, "
                f"random {control.mean:.2f}",
                f"保留 {len(kept)} 条事实；未消融时答案的平均 log p 为 {base.mean():.2f} nats；"
                "下降："
                f"{label_zh} FFN {ffn.mean:.2f}，注意力 {attn.mean:.2f}，随机 {control.mean:.2f}",
            )
        )

    context, n_steps = ctx.pick(512, 64, 8), ctx.pick(16, 5, 2)
    steps = decode_step_times(model, context, n_steps, ctx.seed)
    ffn_t, attn_t, head_t, step_t = (
        lab.over_seeds([s[k] for s in steps]) for k in ("ffn", "attn", "output head", "step")
    )
    flops = calc.flops_per_token(model.cfg, context)
    params = calc.parameter_counts(model.cfg)["components"]
    ffn_flops = 2 * params["ffn"]  # one multiply-add per weight
    step = f"decode step at context {context}"
    step_zh = f"上下文 {context} 时的一步解码"
    seconds = say("s", "秒")
    rows += [
        {what_: say(f"{step}: FFNs", f"{step_zh}：FFN"), value_: str(ffn_t), unit_: seconds},
        {
            what_: say(f"{step}: attention", f"{step_zh}：注意力"),
            value_: str(attn_t),
            unit_: seconds,
        },
        {
            what_: say(f"{step}: output head", f"{step_zh}：输出头"),
            value_: str(head_t),
            unit_: seconds,
        },
        {
            what_: say(f"{step}: whole step", f"{step_zh}：整步"),
            value_: str(step_t),
            unit_: seconds,
        },
        {
            what_: say("FFN share of the step's time", "FFN 占一步时间的比例"),
            value_: f"{ffn_t.mean / step_t.mean:.3f}",
            unit_: "",
        },
        {
            what_: say(
                "FFN share of forward FLOPs per token (calc)",
                "FFN 占每 token 前向 FLOPs 的比例（calc）",
            ),
            value_: f"{ffn_flops / flops['forward']:.3f}",
            unit_: "",
        },
        {
            what_: say("FFN share of parameters (calc)", "FFN 占参数量的比例（calc）"),
            value_: f"{params['ffn'] / sum(params.values()):.3f}",
            unit_: "",
        },
    ]
    checks.append(
        lab.exceeds_spread(
            say(
                f"decode time per step: FFNs - attention (s), context {context}",
                f"每步解码时间：FFN 减注意力（秒），上下文 {context}",
            ),
            ffn_t,
            attn_t,
            group=say("FFN dominates decode latency", "解码延迟主要来自 FFN"),
        )
    )
    ms = {
        k: v.mean * 1e3
        for k, v in (("ffn", ffn_t), ("attn", attn_t), ("head", head_t), ("step", step_t))
    }
    threads = torch.get_num_threads()
    notes.append(
        say(
            f"decode step at context {context}: FFNs {ms['ffn']:.1f} ms, attention "
            f"{ms['attn']:.1f} ms, output head {ms['head']:.1f} ms of "
            f"{ms['step']:.1f} ms ({name}, {threads} thread(s))",
            f"上下文 {context} 时的一步解码：总计 {ms['step']:.1f} ms 中，FFN {ms['ffn']:.1f} ms，"
            f"注意力 {ms['attn']:.1f} ms，输出头 {ms['head']:.1f} ms（{name}，{threads} 个线程）",
        )
    )
    figure = _plot(drops, random_drops, middle, steps, name)
    data = {
        "kept_facts": [FACTS[i][0] for i in kept],
        "drops": {f"{k} {b.start}-{b.stop - 1}": v.tolist() for (k, b), v in drops.items()},
        "random_drops": [d.tolist() for d in random_drops],
        "decode_steps": steps,
    }
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _model(ctx: lab.RunContext):
    if ctx.tiny:  # a random SmolLM2-shaped model: it knows no facts, so the run is inconclusive
        from glassformer.config import ModelConfig
        from glassformer.models import build_model

        torch.manual_seed(ctx.seed)
        cfg = ModelConfig.preset(
            "smollm2-135m",
            n_layers=5,
            vocab_size=512,
            max_seq_len=64,
            d_model=64,
            n_heads=2,
            n_kv_heads=1,
            head_dim=32,
            d_ff=128,
        )
        return build_model(cfg).eval(), None, "SmolLM2-shaped (5 random layers)"
    from glassformer.interop.pretrained import from_pretrained

    model, tokenizer = from_pretrained("smollm2")
    return model, tokenizer, "SmolLM2-135M"


def _facts(tokenizer, model) -> tuple[list[list[int]], list[int]]:
    if tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(3, model.cfg.vocab_size, (len(FACTS), 7), generator=generator)
        return [row[:-1].tolist() for row in ids], [int(row[-1]) for row in ids]
    return ([tokenizer.encode(p) for p, _ in FACTS], [tokenizer.encode(a)[0] for _, a in FACTS])


def _plot(drops: dict, random_drops: list, middle: range, steps: list, name: str):
    fig, (left, right) = lab.new_figure(9.0, 3.6, ncols=2)
    if drops:
        windows = sorted({b for _, b in drops}, key=lambda b: b.start)
        labels = [f"{b.start}-{b.stop - 1}" + (" (middle)" if b == middle else "") for b in windows]
        for offset, kind, title in ((-0.2, "ffn", "FFN zeroed"), (0.2, "attn", "attention zeroed")):
            means = [drops[(kind, b)].mean() for b in windows]
            errs = [drops[(kind, b)].std(ddof=1) for b in windows]
            left.bar(
                np.arange(len(windows)) + offset, means, 0.4, yerr=errs, capsize=3, label=title
            )
        control = np.mean(random_drops, axis=0)
        left.axhline(
            control.mean(),
            color="black",
            linestyle="--",
            label=f"{len(middle)} random sublayers zeroed",
        )
        left.set_xticks(range(len(windows)), labels, fontsize=7)
        left.set_xlabel("layers zeroed")
        left.legend(fontsize=7)
    else:
        left.text(
            0.5, 0.5, "too few facts answered: no ablation", ha="center", transform=left.transAxes
        )
    left.set_ylabel("drop of log p(answer) (nats)")
    left.set_title(f"{name}: where do facts live?")
    parts = ("ffn", "attn", "output head")
    times = [np.mean([s[k] for s in steps]) * 1e3 for k in parts]
    rest = np.mean([s["step"] for s in steps]) * 1e3 - sum(times)
    right.bar(["FFNs", "attention", "output head", "rest"], [*times, max(rest, 0.0)])
    right.set_ylabel("ms per decode step")
    right.set_title("one decode step, by module")
    return fig
