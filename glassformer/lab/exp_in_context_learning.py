"""Seed 000 §6.2: in-context learning: a GPT picks up a new task from examples in its prompt,
with no fine-tuning.

Measured with SmolLM2-135M-Instruct (real weights). A task is a list of pairs (word -> antonym,
country -> capital, word -> its capitals); the prompt is k examples "x -> y" one per line, then
a query "x ->". For each k in 0, 1, 2, 4, 8 the same queries are asked (never among the
examples); a query counts as right when greedy decoding would write exactly its answer (every
answer token the argmax, teacher-forced, as in exp_lost_in_the_middle). The examples are drawn
several times (one draw per seed); accuracy is the mean ± spread over draws. The weights are
hashed before and after: the model learns nothing into its parameters.
"""

from __future__ import annotations

import hashlib
import random

import torch
from torch import nn

from glassformer.lab import base as lab

# Each task: 20 pairs, 8 of them the example pool, the rest queries. "upper" is a rule the
# model can only read off the examples; the other two also need what it knows.
TASKS: dict[str, list[tuple[str, str]]] = {
    "antonym": [
        ("hot", "cold"),
        ("big", "small"),
        ("up", "down"),
        ("fast", "slow"),
        ("happy", "sad"),
        ("light", "dark"),
        ("open", "closed"),
        ("early", "late"),
        ("rich", "poor"),
        ("old", "new"),
        ("wet", "dry"),
        ("hard", "soft"),
        ("long", "short"),
        ("high", "low"),
        ("full", "empty"),
        ("strong", "weak"),
        ("good", "bad"),
        ("true", "false"),
        ("left", "right"),
        ("win", "lose"),
    ],
    "capital": [
        ("France", "Paris"),
        ("Japan", "Tokyo"),
        ("Italy", "Rome"),
        ("Egypt", "Cairo"),
        ("Spain", "Madrid"),
        ("Russia", "Moscow"),
        ("Germany", "Berlin"),
        ("Greece", "Athens"),
        ("Kenya", "Nairobi"),
        ("Peru", "Lima"),
        ("Norway", "Oslo"),
        ("Cuba", "Havana"),
        ("Ireland", "Dublin"),
        ("Austria", "Vienna"),
        ("Poland", "Warsaw"),
        ("Portugal", "Lisbon"),
        ("Thailand", "Bangkok"),
        ("Sweden", "Stockholm"),
        ("Hungary", "Budapest"),
        ("Denmark", "Copenhagen"),
    ],
    "upper": [
        (w, w.upper())
        for w in [
            "dog",
            "cat",
            "tree",
            "house",
            "river",
            "green",
            "apple",
            "stone",
            "music",
            "paper",
            "chair",
            "cloud",
            "bread",
            "horse",
            "night",
            "water",
            "table",
            "light",
            "sugar",
            "field",
        ]
    ],
}
SHOTS = (0, 1, 2, 4, 8)
POOL = 8  # examples are drawn from the first POOL pairs of a shuffle, queries from the rest
# Thresholds, stated once. "Learns the task from the examples": with the most examples the model
# answers at least 0.3 more of the queries than with none, beyond the spread over draws (0.3:
# several queries more out of a handful, not one lucky answer), and at least half of them.
MIN_GAIN = 0.3
MIN_ACCURACY = 0.5
TASKS_ZH = {"antonym": "反义词", "capital": "首都", "upper": "大写"}
NAMES_ZH = {
    "tiny random character GPT": "tiny 随机字符级 GPT",
    "SmolLM2-135M-Instruct": "SmolLM2-135M-Instruct",
}


def format_examples(pairs: list[tuple[str, str]]) -> str:
    return "".join(f"{x} -> {y}\n" for x, y in pairs)


def split_task(pairs: list[tuple[str, str]], draw: int) -> tuple[list, list]:
    """(example pool, queries) for one draw: a shuffle seeded by the draw; disjoint."""
    shuffled = list(pairs)
    random.Random(draw).shuffle(shuffled)
    return shuffled[:POOL], shuffled[POOL:]


def parameter_digest(model: nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in order: equal digests, identical weights."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@torch.no_grad()
def greedy_hit(
    model: nn.Module, cache, held: int, query_ids: list[int], answer_ids: list[int]
) -> bool:
    """Whether greedy decoding after (a prefix of `held` positions in the cache +) query
    writes exactly answer_ids: every answer token is the argmax at the position before it. The
    query is written after the prefix, where the next query is written over it."""
    ids = torch.tensor([query_ids + answer_ids], device=model.device)
    positions = torch.arange(held, held + ids.shape[1], device=model.device)
    logits = model(ids, positions, cache=cache)[0]  # (T, V)
    predicted = logits[len(query_ids) - 1 : -1].argmax(dim=-1)
    return bool((predicted == torch.tensor(answer_ids, device=logits.device)).all())


@torch.no_grad()
def accuracy_with_examples(model, encode, examples, queries) -> float:
    """Share of queries answered right after the prompt of `examples` (prefilled once)."""
    cache, prefix = None, []
    if examples:
        prefix = encode(format_examples(examples))
        cache = model.new_cache(batch_size=1, max_seq_len=len(prefix) + 32)
        ids, positions = torch.tensor([prefix], device=model.device), torch.arange(len(prefix))
        model(ids, positions.to(model.device), cache=cache, last_token_only=True)
    hits = [
        greedy_hit(model, cache, len(prefix), encode(f"{x} ->"), encode(f" {y}"))
        for x, y in queries
    ]
    return sum(hits) / len(hits)


@lab.register("in-context-learning")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    model, encode, name = _model(ctx)
    tasks = ctx.pick(("antonym", "capital", "upper"), ("antonym", "upper"), ("upper",))
    shots = ctx.pick(SHOTS, SHOTS, (0, 1))
    n_queries = ctx.pick(12, 8, 2)
    draws = ctx.seeds()
    before = parameter_digest(model)
    accuracy = {task: [[] for _ in shots] for task in tasks}  # [k][draw]
    for task in tasks:
        for draw in draws:
            pool, queries = split_task(TASKS[task], draw)
            for i, k in enumerate(shots):
                score = accuracy_with_examples(model, encode, pool[:k], queries[:n_queries])
                accuracy[task][i].append(score)
    after = parameter_digest(model)
    spread = {task: [lab.over_seeds(a) for a in accuracy[task]] for task in tasks}
    say = ctx.say
    zh = TASKS_ZH
    rows = [
        {
            say("examples in the prompt", "提示中的示例数"): k,
            **{
                say(f"{task} accuracy", f"{zh[task]}准确率"): str(spread[task][i]) for task in tasks
            },
        }
        for i, k in enumerate(shots)
    ]
    checks = [
        lab.precondition(
            lab.approx(
                say("parameters changed by the run (digest differs)", "运行改动了参数（摘要不同）"),
                float(before != after),
                0,
                0,
            )
        )
    ]
    group = say("learns a task from examples in the prompt", "从提示中的示例学会任务")
    most_k = shots[-1]
    for task in tasks:
        most, none = spread[task][-1], spread[task][0]
        checks.append(
            lab.exceeds_spread(
                say(
                    f"{task}: accuracy with {most_k} - with 0 examples",
                    f"{zh[task]}：{most_k} 个示例时的准确率 - 0 个示例时",
                ),
                most,
                none,
                MIN_GAIN,
                group=group,
            )
        )
        checks.append(
            lab.at_least(
                say(
                    f"{task}: accuracy with {most_k} examples",
                    f"{zh[task]}：{most_k} 个示例时的准确率",
                ),
                most.mean,
                MIN_ACCURACY,
                group=group,
            )
        )
    n_draws, name_zh = len(draws), NAMES_ZH.get(name, name)
    digest_before, digest_after = before[:16], after[:16]
    notes = [
        say(
            f"model: {name}; {n_draws} draw(s) of examples per task, {n_queries} queries each, "
            "never among the examples; the prompt is plain lines 'x -> y', no chat template",
            f"模型：{name_zh}；每个任务抽取 {n_draws} 次示例，每次 {n_queries} 个查询，"
            "查询从不出现在示例中；提示是普通的 'x -> y' 行，不用对话模板",
        ),
        say(
            f"parameter digest before and after: {digest_before}… / {digest_after}…",
            f"运行前后的参数摘要：{digest_before}… / {digest_after}…",
        ),
    ]
    for task in tasks:
        curve = ", ".join(f"{k}: {s.mean:.2f}" for k, s in zip(shots, spread[task], strict=True))
        curve_zh = "，".join(f"{k}：{s.mean:.2f}" for k, s in zip(shots, spread[task], strict=True))
        notes.append(
            say(
                f"{task} accuracy by number of examples: {curve}",
                f"{zh[task]}准确率随示例数的变化：{curve_zh}",
            )
        )
    if ctx.tiny:
        notes.append(
            say(
                "tiny mode: a random 1-layer GPT on characters stands in for SmolLM2",
                "tiny 模式：用一个随机初始化的 1 层字符级 GPT 代替 SmolLM2",
            )
        )
    data = {
        "shots": list(shots),
        "accuracy": accuracy,
        "draws": draws,
        "n_queries": n_queries,
        "digest_before": before,
        "digest_after": after,
    }
    figure = _plot(shots, spread, name)
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _model(ctx: lab.RunContext):
    """(model, encode, name): SmolLM2, or in tiny mode a random character GPT."""
    if ctx.tiny:
        from glassformer.config import ModelConfig
        from glassformer.models import build_model
        from glassformer.tokenizers import CharTokenizer

        text = "".join(format_examples(pairs) for pairs in TASKS.values())
        tokenizer = CharTokenizer.from_text(text)
        torch.manual_seed(ctx.seed)
        cfg = ModelConfig(
            vocab_size=tokenizer.vocab_size,
            d_model=32,
            n_layers=1,
            n_heads=2,
            max_seq_len=256,
            position="rope",
        )
        return build_model(cfg).eval(), tokenizer.encode, "tiny random character GPT"
    from glassformer.interop.pretrained import from_pretrained

    model, tokenizer = from_pretrained("smollm2")
    return (
        model.eval(),
        lambda text: tokenizer.encode(text, add_special_tokens=False),
        ("SmolLM2-135M-Instruct"),
    )


def _plot(shots, spread: dict[str, list[lab.Spread]], name: str):
    fig, ax = lab.new_figure(6.0, 3.4)
    positions = list(range(len(shots)))  # evenly spaced: 0 examples has no place on a log axis
    for task, values in spread.items():
        ax.errorbar(
            positions,
            [s.mean for s in values],
            yerr=[s.spread for s in values],
            marker="o",
            capsize=3,
            label=task,
        )
    ax.set_xticks(positions, [str(k) for k in shots])
    ax.set(
        xlabel="examples in the prompt (k)",
        ylabel="greedy accuracy on held-out queries",
        ylim=(-0.03, 1.03),
        title=f"in-context learning, weights frozen ({name})",
    )
    ax.legend(fontsize=8)
    return fig
