"""Seed 000 §2.5.3: an MoE holds many more parameters than each token uses (671B total / 37B
active in DeepSeek-V3): "知识容量按总参数算，推理成本按激活参数算", so "同等算力下容量更大；
训练和推理都更省".

Three small GPTs, identical but for the FFN, trained on Shakespeare characters with the same
steps and batches, over seeds, until their loss is flat: a dense one with a SwiGLU FFN of width
F ("equal active"), an MoE with E SwiGLU experts of width F/k, top-k routed (a token runs as many
FFN weights as in the dense one: "同等算力"), and a dense one of width E*F/k ("equal total": as
many FFN weights as all E experts). Capacity: the MoE's held-out loss against both. Cost: seconds
per training step, per prompt token and per generated token (the KV cache, batch 1, glassformer's
Engine) of the three, timed in turns, the median of the rounds. DeepSeek-V3's own counts, from
its configuration (calc's "deepseek-v3" preset), are a row: a count from a config is arithmetic,
not a measurement that could disagree with the claim.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from glassformer.calc import parameter_counts, resolve_preset
from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.lab.fit import (
    Schedule,
    eval_loss,
    fit,
    shakespeare_chars,
    unigram_entropy,
    window_batches,
)
from glassformer.lab.timing import time_models
from glassformer.models import build_model
from glassformer.nn.ffn import MoE

N_EXPERTS, TOP_K = 8, 2
LEARNING_RATE = 2e-3  # a usual rate for a small char-level GPT (nanoGPT's baby GPT uses 1e-3)
DENSE, MOE, DENSE_TOTAL = "dense, equal active", "MoE", "dense, equal total"
MODELS_ZH = {DENSE: "稠密，激活参数相同", MOE: "MoE", DENSE_TOTAL: "稠密，总参数相同"}
KINDS_ZH = {"train step": "训练步", "prefill token": "提示 token", "decode token": "生成 token"}
# Thresholds, stated once.
# Preconditions: every model trained to its plateau (the mean loss of the last tenth of training
# within 2% of the tenth before, worst seed), learned the text (held-out loss at least 0.3 nats
# below the unigram entropy), the router did not collapse (no expert above twice the uniform
# share 1/E; collapse onto k experts would be 1/k, four times uniform at E=8, k=2), and more FFN
# weights help at this size (the equal-total dense model beats the equal-active one beyond the
# seeds' spread: otherwise capacity is not what limits these models, and an MoE cannot show it).
# "容量更大": the MoE beats the equal-active dense model beyond the seeds' spread. "容量按总参数算":
# the MoE gets at least half of what going from equal active to equal total dense weights gains.
# "更省": each time of the MoE below the equal-total dense model's beyond the spread.
# "推理成本按激活参数算": the MoE's decode time nearer (on a log scale) the equal-active dense model
# than the equal-total one, t_moe <= sqrt(t_active * t_total).
PLATEAU_TOLERANCE = 0.02
MIN_BELOW_UNIGRAM = 0.3
MAX_SHARE_OVER_UNIFORM = 2.0
MIN_SHARE_OF_GAIN = 0.5


@dataclass(frozen=True)
class Sizes:
    steps: int
    d_model: int
    n_layers: int
    ffn_width: int  # F: the dense FFN's width; experts are F/k wide
    batch_size: int
    length: int
    n_val: int  # held-out windows
    rounds: int  # timing rounds
    n_new: int  # generated tokens per timing round


def sizes(ctx: lab.RunContext) -> Sizes:
    return ctx.pick(
        # full: at 1,500 steps of 4 layers every model's loss still fell 2.2-2.4% over the last
        # tenth (2026-12-05); 3 layers for 2,000 steps cost about the same (one seed of the
        # equal-active model: 213 s against 194, its fall 1.5% against 2.2%)
        full=Sizes(2000, 96, 3, 256, 16, 64, 256, 8, 32),
        quick=Sizes(300, 64, 3, 192, 16, 64, 128, 4, 16),
        tiny=Sizes(4, 32, 1, 64, 2, 16, 4, 1, 3),
    )


def deepseek_counts() -> dict[str, int]:
    counts = parameter_counts(resolve_preset("deepseek-v3"))
    return {"total": counts["total"], "active": counts["active"]}


def model_configs(
    vocab_size: int, d_model: int, n_layers: int, ffn_width: int, length: int, aux: float = 0.01
) -> dict[str, ModelConfig]:
    """The same GPT but for the FFN: dense of width F; MoE of E experts of width F/k (the k a
    token runs hold as many weights as the dense FFN), its balance loss weighted `aux`; dense
    of width E*F/k (as many FFN weights as all E experts)."""
    common = dict(
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=4,
        max_seq_len=length,
        position="rope",
        norm="rms",
        bias=False,
    )
    expert_width = ffn_width // TOP_K
    return {
        DENSE: ModelConfig(**common, ffn="swiglu", d_ff=ffn_width),
        MOE: ModelConfig(
            **common,
            ffn="moe",
            n_experts=N_EXPERTS,
            n_experts_per_token=TOP_K,
            moe_expert_ffn="swiglu",
            d_ff=expert_width,
            moe_aux_loss_coef=aux,
        ),
        DENSE_TOTAL: ModelConfig(**common, ffn="swiglu", d_ff=N_EXPERTS * expert_width),
    }


def seeded_model(cfg: ModelConfig, seed: int):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build_model(cfg)


def expert_load(model) -> tuple[list[list[float]], list[float]]:
    """Per MoE layer: each expert's share of the last forward's assignments, and its aux loss."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    shares = [(m.expert_counts.float() / m.expert_counts.sum()).tolist() for m in layers]
    return shares, [float(m.aux_loss) for m in layers]


def worst_plateau(what: str, runs: list[list[float]]) -> lab.Check:
    """Precondition: lab.converged (the last tenth of training against the tenth before) for the
    seed whose loss still fell most."""
    window = max(1, len(runs[0]) // 10)
    return max(
        (lab.converged(what, losses, window, PLATEAU_TOLERANCE) for losses in runs),
        key=lambda c: c.measured,
    )


@dataclass
class Trained:
    losses: dict[str, list[list[float]]]  # model -> one training curve per seed
    val: dict[str, list[float]]  # model -> held-out loss per seed
    times: dict[str, dict[str, list[float]]]  # model -> kind -> median seconds per seed
    shares: list[list[list[float]]]  # seed -> MoE layer -> expert share of the held-out load
    aux: list[list[float]]  # seed -> MoE layer -> balance loss on the held-out windows


def train_all(ctx: lab.RunContext, size: Sizes, configs: dict, corpus) -> Trained:
    schedule = Schedule(
        max_steps=size.steps, learning_rate=LEARNING_RATE, warmup_steps=max(1, size.steps // 10)
    )
    out = Trained(
        {n: [] for n in configs},
        {n: [] for n in configs},
        {n: {k: [] for k in KINDS_ZH} for n in configs},
        [],
        [],
    )
    for seed in ctx.seeds():
        batches = window_batches(corpus.train, size.batch_size, size.length, seed)
        for name, cfg in configs.items():
            model = seeded_model(cfg, seed)
            out.losses[name].append(fit(model, batches, schedule))
            out.val[name].append(eval_loss(model, corpus.val, size.length, size.n_val, seed=seed))
            if name == MOE:  # eval_loss's forward filled the counts: the held-out load
                layer_shares, layer_aux = expert_load(model)
                out.shares.append(layer_shares)
                out.aux.append(layer_aux)
        fresh = {name: seeded_model(cfg, seed) for name, cfg in configs.items()}
        prompt = corpus.val[: size.length - size.n_new].tolist()
        timed = time_models(fresh, batches(size.steps), prompt, size.n_new, size.rounds)
        for name, by_kind in timed.items():
            for kind, t in by_kind.items():
                out.times[name][kind].append(t)
    return out


@lab.register("moe")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    size, say = sizes(ctx), ctx.say
    corpus = shakespeare_chars(ctx.pick(None, None, 200_000))
    unigram = unigram_entropy(corpus.train)
    configs = model_configs(
        corpus.tokenizer.vocab_size, size.d_model, size.n_layers, size.ffn_width, size.length
    )
    trained = train_all(ctx, size, configs, corpus)
    val = {name: lab.over_seeds(v) for name, v in trained.val.items()}
    cost = {
        name: {kind: lab.over_seeds(ts) for kind, ts in by_kind.items()}
        for name, by_kind in trained.times.items()
    }
    counts = {name: parameter_counts(cfg) for name, cfg in configs.items()}
    for name in configs:
        say(name, MODELS_ZH[name])
    rows = _rows(ctx, size, val, cost, counts, trained.shares)
    checks = _checks(ctx, trained, val, cost, unigram)
    notes = _notes(ctx, size, val, cost, counts, trained)
    figure = _plot(trained.losses, val, cost, torch.tensor(trained.shares).mean(0))
    data = {
        "deepseek_v3": deepseek_counts(),
        "val": trained.val,
        "seconds": trained.times,
        "shares": trained.shares,
        "aux": trained.aux,
        "steps": size.steps,
        "seeds": ctx.seeds(),
        "unigram_entropy": unigram,
        "counts": {n: {"total": c["total"], "active": c["active"]} for n, c in counts.items()},
    }
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _checks(
    ctx: lab.RunContext, trained: Trained, val: dict, cost: dict, unigram: float
) -> list[lab.Check]:
    say = ctx.say
    checks = [
        worst_plateau(
            say(
                f"{name}: relative loss drop over the last tenth of training, worst seed",
                f"{MODELS_ZH[name]}：训练最后十分之一的损失相对降幅（最差的随机种子）",
            ),
            runs,
        )
        for name, runs in trained.losses.items()
    ]
    for name, losses in trained.val.items():
        checks.append(
            lab.precondition(
                lab.at_least(
                    say(
                        f"unigram entropy - {name} held-out loss (nats, worst seed)",
                        f"一元熵 - {MODELS_ZH[name]}的留出损失（nats，最差的随机种子）",
                    ),
                    unigram - max(losses),
                    MIN_BELOW_UNIGRAM,
                )
            )
        )
    largest = max(max(max(layer) for layer in per_seed) for per_seed in trained.shares)
    checks += [
        lab.precondition(
            lab.at_most(
                say(
                    "largest expert share x E (1 = uniform), any layer or seed",
                    "最大专家份额 x E（1 = 均匀），任一层或随机种子",
                ),
                largest * N_EXPERTS,
                MAX_SHARE_OVER_UNIFORM,
            )
        ),
        lab.precondition(
            lab.exceeds_spread(
                say(
                    "held-out loss, dense equal active - dense equal total (nats)",
                    "留出损失：稠密（激活参数相同）- 稠密（总参数相同）（nats）",
                ),
                val[DENSE],
                val[DENSE_TOTAL],
            )
        ),
    ]
    capacity = say(
        "capacity: more at the same compute, counted by total parameters",
        "容量：同等算力下更大，按总参数算",
    )
    gain = val[DENSE].mean - val[DENSE_TOTAL].mean
    checks += [
        lab.exceeds_spread(
            say(
                "held-out loss, dense (equal active) - MoE (nats)",
                "留出损失：稠密（激活参数相同）- MoE（nats）",
            ),
            val[DENSE],
            val[MOE],
            group=capacity,
        ),
        lab.at_least(
            say(
                "MoE's share of the gain from equal active to equal total dense weights",
                "MoE 拿到的“从激活参数相同到总参数相同”稠密模型增益的比例",
            ),
            (val[DENSE].mean - val[MOE].mean) / gain if gain else 0.0,
            MIN_SHARE_OF_GAIN,
            group=capacity,
        ),
    ]
    cheaper = say(
        "cheaper than the dense model of equal capacity (equal total)",
        "比容量相同（总参数相同）的稠密模型更省",
    )
    for kind, kind_zh in KINDS_ZH.items():
        checks.append(
            lab.exceeds_spread(
                say(
                    f"s / {kind}, dense (equal total) - MoE",
                    f"每个{kind_zh}的秒数：稠密（总参数相同）- MoE",
                ),
                cost[DENSE_TOTAL][kind],
                cost[MOE][kind],
                group=cheaper,
            )
        )
    decode = {name: cost[name]["decode token"].mean for name in cost}
    checks.append(
        lab.at_most(
            say(
                "s / generated token, MoE / sqrt(dense equal active x equal total)",
                "每个生成 token 的秒数：MoE / sqrt(稠密激活参数相同 x 稠密总参数相同)",
            ),
            decode[MOE] / (decode[DENSE] * decode[DENSE_TOTAL]) ** 0.5,
            1.0,
            group=say("inference cost follows active parameters", "推理成本按激活参数算"),
        )
    )
    return checks


def _rows(
    ctx: lab.RunContext, size: Sizes, val: dict, cost: dict, counts: dict, shares: list
) -> list[dict]:
    say, deepseek = ctx.say, deepseek_counts()
    model, total, active = (
        say("model", "模型"),
        say("total params", "总参数"),
        say("active params", "激活参数"),
    )
    held = say("held-out loss (nats)", "留出损失（nats）")
    rows = [
        {
            model: say("DeepSeek-V3 (its config, counted)", "DeepSeek-V3（按其配置数出）"),
            total: f"{deepseek['total'] / 1e9:.1f}B",
            active: f"{deepseek['active'] / 1e9:.2f}B",
        },
        {
            model: say("DeepSeek-V3 (published)", "DeepSeek-V3（公布值）"),
            total: "671B",
            active: "37B",
        },
    ]
    for name in counts:
        row = {
            model: name,
            total: counts[name]["total"],
            active: counts[name]["active"],
            held: str(val[name]),
        }
        for kind, kind_zh in KINDS_ZH.items():
            spread = cost[name][kind]
            row[say(f"ms / {kind}", f"毫秒 / {kind_zh}")] = (
                f"{spread.mean * 1e3:.3g} ± {spread.spread * 1e3:.2g}"
            )
        rows.append(row)
    mean_shares = torch.tensor(shares).mean(0)  # (layers, E), over seeds
    for layer, share in enumerate(mean_shares.tolist()):
        rows.append(
            {
                model: say(
                    f"MoE layer {layer}: expert shares (mean over seeds)",
                    f"MoE 第 {layer} 层：各专家份额（随机种子间均值）",
                ),
                total: " ".join(f"{s:.2f}" for s in share),
            }
        )
    return rows


def _notes(
    ctx: lab.RunContext, size: Sizes, val: dict, cost: dict, counts: dict, trained: Trained
) -> list[str]:
    say, seeds = ctx.say, ctx.seeds()
    width, total_width = size.ffn_width // TOP_K, N_EXPERTS * size.ffn_width // TOP_K
    c = {name: (counts[name]["active"], counts[name]["total"]) for name in counts}
    gap, gain = val[DENSE].mean - val[MOE].mean, val[DENSE].mean - val[DENSE_TOTAL].mean

    def ratio(kind: str, other: str) -> str:
        return f"{cost[MOE][kind].mean / cost[other][kind].mean:.2f}x"

    over_total = ", ".join(f"{k} {ratio(k, DENSE_TOTAL)}" for k in KINDS_ZH)
    over_active = ", ".join(f"{k} {ratio(k, DENSE)}" for k in KINDS_ZH)
    zh_total = "，".join(f"{v} {ratio(k, DENSE_TOTAL)}" for k, v in KINDS_ZH.items())
    zh_active = "，".join(f"{v} {ratio(k, DENSE)}" for k, v in KINDS_ZH.items())
    aux = statistics.mean(a for per_seed in trained.aux for a in per_seed)
    share = f"{gap / gain:.2f}" if gain else "-"
    return [
        say(
            f"MoE: {N_EXPERTS} SwiGLU experts of width {width}, top-{TOP_K}, balance loss "
            f"weight 0.01; dense (equal active): one SwiGLU of width {size.ffn_width}; dense "
            f"(equal total): width {total_width}; {size.n_layers} layers, d={size.d_model}. "
            f"Active / total parameters: MoE {c[MOE][0]} / {c[MOE][1]}, dense (equal active) "
            f"{c[DENSE][0]}, dense (equal total) {c[DENSE_TOTAL][0]}",
            f"MoE：{N_EXPERTS} 个宽 {width} 的 SwiGLU 专家，top-{TOP_K}，负载均衡损失权重 0.01；"
            f"稠密（激活参数相同）：一个宽 {size.ffn_width} 的 SwiGLU；稠密（总参数相同）：宽 "
            f"{total_width}；{size.n_layers} 层，d={size.d_model}。激活 / 总参数：MoE {c[MOE][0]} "
            f"/ {c[MOE][1]}，稠密（激活参数相同）{c[DENSE][0]}，稠密（总参数相同）"
            f"{c[DENSE_TOTAL][0]}",
        ),
        say(
            f"all three trained {size.steps} steps on the same {size.batch_size}x{size.length}"
            f"-character batches per seed (seeds {seeds}), lr {LEARNING_RATE:g}, warmup then "
            f"cosine; held-out loss over {size.n_val} windows of the corpus's last tenth",
            f"三个模型在每个随机种子下用相同的 {size.batch_size}x{size.length} 字符批次训练 "
            f"{size.steps} 步（随机种子 {seeds}），学习率 {LEARNING_RATE:g}，先预热再余弦衰减；"
            f"留出损失取语料最后十分之一中的 {size.n_val} 个窗口",
        ),
        say(
            f"held-out loss: dense (equal active) {val[DENSE]}, MoE {val[MOE]}, dense (equal "
            f"total) {val[DENSE_TOTAL]}: the MoE gets {share} of the equal-total model's gain",
            f"留出损失：稠密（激活参数相同）{val[DENSE]}，MoE {val[MOE]}，稠密（总参数相同）"
            f"{val[DENSE_TOTAL]}：MoE 拿到总参数相同模型增益的 {share}",
        ),
        say(
            f"cost on this CPU, MoE over dense (equal total): {over_total}; over dense (equal "
            f"active): {over_active}. {size.rounds} rounds after one warm-up, median per seed; "
            f"generation: a {size.length - size.n_new}-token prompt and {size.n_new} greedy "
            "tokens at batch 1, every model through the same PyTorch modules (the fused C decode "
            "step, which has no MoE, off). glassformer's MoE loops over the experts in Python (a "
            "gather and an index_add per expert that received tokens)",
            f"在这台 CPU 上的开销，MoE 相对稠密（总参数相同）：{zh_total}；相对稠密（激活参数"
            f"相同）：{zh_active}。预热一轮后计时 {size.rounds} 轮，每个随机种子取中位数；生成："
            f"{size.length - size.n_new} token 的提示，批大小 1 贪心生成 {size.n_new} 个 token，"
            "三个模型都走同样的 PyTorch 模块（融合的 C 解码步没有 MoE 版本，一律关闭）。"
            "glassformer 的 MoE 在 Python 里逐个专家循环（每个分到 token 的专家做一次 gather 和 "
            "index_add）",
        ),
        say(
            f"expert shares: fractions of the held-out windows' token-to-expert assignments "
            f"(uniform = 1/{N_EXPERTS} = {1 / N_EXPERTS:.3f}); mean balance loss {aux:.3f} "
            "(1.0 = balanced)",
            f"专家份额：留出窗口中 token 分配到各专家的比例（均匀 = 1/{N_EXPERTS} = "
            f"{1 / N_EXPERTS:.3f}）；负载均衡损失均值 {aux:.3f}（1.0 = 均衡）",
        ),
    ]


def _plot(losses: dict, val: dict, cost: dict, mean_shares: torch.Tensor):
    fig, (curves, bars, load) = lab.new_figure(14.0, 3.8, ncols=3)
    n_steps = len(losses[DENSE][0])
    window = max(1, n_steps // 25)
    for i, (name, runs) in enumerate(losses.items()):
        for seed_losses in runs:
            curves.plot(
                lab.trailing_mean(seed_losses, window),
                color=f"C{i}",
                alpha=0.7,
                label=f"{name}: held-out {val[name]}" if seed_losses is runs[0] else None,
            )
    curves.set(
        xlabel="step",
        ylabel=f"train loss (nats, mean of {window} steps)",
        title="one line per seed",
    )
    curves.legend(fontsize=7)
    kinds = list(KINDS_ZH)
    for i, name in enumerate(cost):
        means = [cost[name][k].mean * 1e3 for k in kinds]
        spreads = [cost[name][k].spread * 1e3 for k in kinds]
        offset = (i - 1) * 0.27  # three bars centred on each kind
        bars.bar(
            [j + offset for j in range(len(kinds))],
            means,
            0.27,
            yerr=spreads,
            capsize=2,
            label=name,
        )
    bars.set_xticks(range(len(kinds)), [f"per\n{k}" for k in kinds])
    bars.set(
        yscale="log",
        ylabel="milliseconds (log scale; mean ± spread over seeds)",
        title="time on this CPU",
    )
    bars.legend(fontsize=7)
    image = load.imshow(mean_shares.numpy(), cmap="viridis", aspect="auto", vmin=0)
    load.set(
        xlabel="expert",
        ylabel="layer",
        title=f"expert share (uniform {1 / N_EXPERTS:.3f})",
        xticks=range(mean_shares.shape[1]),
        yticks=range(mean_shares.shape[0]),
    )
    for layer in range(mean_shares.shape[0]):
        for expert in range(mean_shares.shape[1]):
            load.text(
                expert,
                layer,
                f"{mean_shares[layer, expert]:.2f}",
                ha="center",
                va="center",
                fontsize=7,
                color="w",
            )
    fig.colorbar(image, ax=load, label="share of assignments")
    return fig
