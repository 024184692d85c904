"""Seed 000 §2.5.3: an MoE holds many more parameters than each token uses (671B total / 37B
active in DeepSeek-V3): more capacity at the same compute, and cheaper to train and to run.

Counts: DeepSeek-V3 from its configuration (calc's count-only "deepseek-v3" preset: MLA, 256
routed experts, top-8, one shared expert) against the published 671B / 37B.
Quality: two small GPTs trained on Shakespeare characters, same steps and batches, over seeds: a
dense one with a SwiGLU FFN of width F, and an MoE one with E SwiGLU experts of width F/k, top-k
routed, so a token runs as many FFN weights in both ("同等算力") while the MoE holds E/k times more.
Cost: seconds per training step, per prompt token (prefill) and per generated token (decode with
the KV cache, batch 1, glassformer's Engine) of the MoE against a dense model of equal *total*
parameters (a SwiGLU of width E*F/k: the same capacity, "知识容量按总参数算") and against the
dense model of equal active parameters; the models are timed in turns, the median of the rounds.
Expert load on the val windows (MoE.expert_counts) is a precondition: a router that collapsed
would make the MoE a smaller dense model.
"""

from __future__ import annotations

import statistics
import time

import torch

from glassformer.calc import parameter_counts, resolve_preset
from glassformer.config import ModelConfig
from glassformer.infer.engine import Engine
from glassformer.lab import base as lab
from glassformer.lab.fit import (
    Schedule,
    eval_loss,
    fit,
    shakespeare_chars,
    unigram_entropy,
    window_batches,
)
from glassformer.models import build_model
from glassformer.nn.ffn import MoE
from glassformer.train.trainer import make_optimizer

N_EXPERTS, TOP_K = 8, 2
LEARNING_RATE = 2e-3  # a usual rate for a small char-level GPT (nanoGPT's baby GPT uses 1e-3)
DENSE, MOE, DENSE_TOTAL = "dense, equal active", "MoE", "dense, equal total"
# Thresholds, stated once.
# DeepSeek-V3's counts within 2% of the report's 671B / 37B (the report rounds to whole billions;
# 2% leaves room for that and nothing more).
PUBLISHED_TOTAL, PUBLISHED_ACTIVE = 671e9, 37e9
COUNT_TOLERANCE = 0.02
# "Larger capacity at the same compute" and "更省" count when the difference exceeds the seeds'
# spread (lab.exceeds_spread, no further margin: the seed names no size for either).
# "推理成本按激活参数算": the MoE's decode time nearer (on a log scale) the dense model of equal
# active parameters than the one of equal total parameters, t_moe <= sqrt(t_active * t_total).
# Preconditions: both models trained (val loss at least 0.3 nats below the unigram entropy, a
# clear use of context) and the router did not collapse (no expert above twice the uniform share
# 1/E; collapse onto k experts would be a share of 1/k, four times uniform at E=8, k=2).
MIN_BELOW_UNIGRAM = 0.3
MAX_SHARE_OVER_UNIFORM = 2.0


def deepseek_counts() -> dict[str, int]:
    counts = parameter_counts(resolve_preset("deepseek-v3"))
    return {"total": counts["total"], "active": counts["active"]}


def model_configs(
    vocab_size: int, d_model: int, n_layers: int, ffn_width: int, length: int
) -> dict[str, ModelConfig]:
    """The same GPT but for the FFN: dense of width F; MoE of E experts of width F/k (the k a
    token runs hold as many weights as the dense FFN); dense of width E*F/k (as many FFN weights
    as all E experts)."""
    common = dict(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=4,
                  max_seq_len=length, position="rope", norm="rms", bias=False)  # fmt: skip
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
        ),
        DENSE_TOTAL: ModelConfig(**common, ffn="swiglu", d_ff=N_EXPERTS * expert_width),
    }


def seeded_model(cfg: ModelConfig, seed: int):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build_model(cfg)


def combined_spread(a: lab.Spread, b: lab.Spread) -> float:
    """The noise a difference of two means is weighed against (as lab.exceeds_spread does)."""
    return (a.spread**2 + b.spread**2) ** 0.5


def expert_load(model) -> tuple[list[list[float]], list[float]]:
    """Per MoE layer: each expert's share of the last forward's assignments, and its aux loss."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    shares = [(m.expert_counts.float() / m.expert_counts.sum()).tolist() for m in layers]
    return shares, [float(m.aux_loss) for m in layers]


class Timer:
    """Times one model: a training step (forward, backward, AdamW) on a fixed batch, and greedy
    generation with the Engine (seconds per prompt token and per generated token)."""

    def __init__(self, model, batch: dict[str, torch.Tensor], prompt: list[int], n_new: int):
        self.model, self.batch, self.prompt, self.n_new = model, batch, prompt, n_new
        self.optimizer = make_optimizer(model, Schedule(max_steps=1))

    def train_step(self) -> float:
        self.model.train()
        start = time.perf_counter()
        self.model.loss(**self.batch).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    def generate(self) -> tuple[float, float]:
        stats = Engine(self.model).generate(self.prompt, self.n_new, temperature=0.0).stats
        return 1 / stats.prefill_tokens_per_s, 1 / stats.decode_tokens_per_s


def time_models(models: dict, batch, prompt: list[int], n_new: int, rounds: int) -> dict:
    """Median seconds per train step / prompt token / generated token of each model, timed in
    turns (each round times every model once) so that a busy machine slows all alike. The first
    round is dropped: it pays one-time costs (allocations, AdamW's state)."""
    timers = {name: Timer(model, batch, prompt, n_new) for name, model in models.items()}
    times = {name: {"train step": [], "prefill token": [], "decode token": []} for name in models}
    for round_ in range(rounds + 1):
        for name, timer in timers.items():
            step = timer.train_step()
            prefill, decode = timer.generate()
            if round_ > 0:
                for kind, t in zip(times[name], (step, prefill, decode), strict=True):
                    times[name][kind].append(t)
    return {name: {kind: statistics.median(ts) for kind, ts in by_kind.items()}
            for name, by_kind in times.items()}  # fmt: skip


@lab.register("moe")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    deepseek = deepseek_counts()
    steps, seeds = ctx.pick(1000, 250, 3), ctx.seeds()
    batch_size, length = ctx.pick(16, 16, 2), ctx.pick(64, 64, 16)
    d_model, n_layers, ffn_width = ctx.pick(96, 64, 32), ctx.pick(4, 3, 1), ctx.pick(256, 192, 64)
    n_val, rounds, n_new = ctx.pick(256, 128, 4), ctx.pick(10, 4, 1), ctx.pick(32, 16, 3)

    corpus = shakespeare_chars(ctx.pick(None, None, 200_000))
    unigram = unigram_entropy(corpus.train)
    configs = model_configs(corpus.tokenizer.vocab_size, d_model, n_layers, ffn_width, length)
    schedule = Schedule(max_steps=steps, learning_rate=LEARNING_RATE, warmup_steps=steps // 10)
    val = {DENSE: [], MOE: []}
    losses = {DENSE: [], MOE: []}
    times = {name: {"train step": [], "prefill token": [], "decode token": []} for name in configs}
    shares, aux = [], []
    for seed in seeds:
        batches = window_batches(corpus.train, batch_size, length, seed)
        for name in (DENSE, MOE):
            model = seeded_model(configs[name], seed)
            losses[name].append(fit(model, batches, schedule))
            val[name].append(eval_loss(model, corpus.val, length, n_val, seed=seed))
            if name == MOE:  # eval_loss's forward filled the counts: the val windows' load
                layer_shares, layer_aux = expert_load(model)
                shares.append(layer_shares)
                aux.append(layer_aux)
        fresh = {name: seeded_model(cfg, seed) for name, cfg in configs.items()}
        prompt = corpus.val[:length - n_new].tolist()  # fmt: skip
        for name, by_kind in time_models(fresh, batches(steps), prompt, n_new, rounds).items():
            for kind, t in by_kind.items():
                times[name][kind].append(t)
    val_s = {name: lab.over_seeds(v) for name, v in val.items()}
    time_s = {name: {kind: lab.over_seeds(ts) for kind, ts in by_kind.items()}
              for name, by_kind in times.items()}  # fmt: skip
    counts = {name: parameter_counts(cfg) for name, cfg in configs.items()}

    rows = [{"model": "DeepSeek-V3 (config)", "total params": f"{deepseek['total'] / 1e9:.1f}B",
             "active params": f"{deepseek['active'] / 1e9:.2f}B"}]  # fmt: skip
    for name in configs:
        rows.append({
            "model": f"{name} ({n_layers} layers, d={d_model})",
            "total params": counts[name]["total"],
            "active params": counts[name]["active"],
            "val loss (nats)": str(val_s[name]) if name in val_s else "not trained",
            **{f"ms / {kind}": f"{time_s[name][kind].mean * 1e3:.3g} ± "
                               f"{time_s[name][kind].spread * 1e3:.2g}"
               for kind in time_s[name]},
        })  # fmt: skip
    mean_shares = torch.tensor(shares).mean(0)  # (layers, E), over seeds
    for layer, share in enumerate(mean_shares.tolist()):
        rows.append({"model": f"MoE layer {layer}: expert shares (mean over seeds)",
                     "total params": " ".join(f"{s:.2f}" for s in share)})  # fmt: skip

    largest = max(max(max(layer) for layer in per_seed) for per_seed in shares)
    checks = [
        lab.precondition(lab.at_least(f"unigram entropy - {name} val loss (nats, worst seed)",
                                      unigram - max(val[name]), MIN_BELOW_UNIGRAM))
        for name in (DENSE, MOE)
    ]  # fmt: skip
    checks += [
        lab.precondition(lab.at_most("largest expert share x E (1 = uniform), any layer or seed",
                                     largest * N_EXPERTS, MAX_SHARE_OVER_UNIFORM)),
        lab.approx("DeepSeek-V3 total / 671B", deepseek["total"] / PUBLISHED_TOTAL, 1.0,
                   COUNT_TOLERANCE, group="counts"),
        lab.approx("DeepSeek-V3 active / 37B", deepseek["active"] / PUBLISHED_ACTIVE, 1.0,
                   COUNT_TOLERANCE, group="counts"),
        lab.exceeds_spread("val loss, dense (equal active) - MoE (nats)", val_s[DENSE],
                           val_s[MOE], group="capacity at equal compute"),
        lab.exceeds_spread("s / train step, dense (equal total) - MoE", time_s[DENSE_TOTAL]
                           ["train step"], time_s[MOE]["train step"], group="training cheaper"),
        lab.exceeds_spread("s / prompt token, dense (equal total) - MoE", time_s[DENSE_TOTAL]
                           ["prefill token"], time_s[MOE]["prefill token"],
                           group="inference cheaper"),
        lab.exceeds_spread("s / generated token, dense (equal total) - MoE", time_s[DENSE_TOTAL]
                           ["decode token"], time_s[MOE]["decode token"],
                           group="inference cheaper"),
    ]  # fmt: skip
    decode = {name: time_s[name]["decode token"].mean for name in configs}
    nearer = decode[MOE] / (decode[DENSE] * decode[DENSE_TOTAL]) ** 0.5
    checks.append(
        lab.at_most(
            "s / generated token, MoE / sqrt(dense equal active x equal total)",
            nearer,
            1.0,
            group="inference cost follows active parameters",
        )
    )

    def ratio(kind: str, other: str) -> str:
        return f"{time_s[MOE][kind].mean / time_s[other][kind].mean:.2f}x"

    gap = val_s[DENSE].mean - val_s[MOE].mean
    all_aux = statistics.mean(a for per_seed in aux for a in per_seed)
    noise = combined_spread(val_s[DENSE], val_s[MOE])
    notes = [
        f"MoE: {N_EXPERTS} SwiGLU experts of width {ffn_width // TOP_K}, top-{TOP_K}; dense "
        f"(equal active): one SwiGLU of width {ffn_width}; dense (equal total): width "
        f"{N_EXPERTS * ffn_width // TOP_K}. Active parameters: MoE {counts[MOE]['active']}, dense "
        f"{counts[DENSE]['active']} (the difference is the {d_model}x{N_EXPERTS} routers); total: "
        f"MoE {counts[MOE]['total']}, dense (equal total) {counts[DENSE_TOTAL]['total']}.",
        f"Quality: dense (equal active) and MoE trained {steps} steps on the same {batch_size}x"
        f"{length}-character batches per seed (seeds {seeds}) at lr {LEARNING_RATE:g} (warmup "
        f"{steps // 10}, cosine); val loss over {n_val} windows of the held-out tail. The MoE's "
        "loss adds 0.01 x the aux (balance) loss. The dense model of equal total parameters is "
        "timed, not trained.",
        f"Val loss: dense {val_s[DENSE]}, MoE {val_s[MOE]}: {gap:+.4f} nats in the MoE's favour, "
        + ("beyond" if abs(gap) > noise else "within")
        + f" the seeds' combined spread ({noise:.4f}).",
        "Cost on this CPU, MoE over dense (equal total): train step "
        f"{ratio('train step', DENSE_TOTAL)}, prompt token "
        f"{ratio('prefill token', DENSE_TOTAL)}, generated token "
        f"{ratio('decode token', DENSE_TOTAL)}; MoE over dense (equal active): train step "
        f"{ratio('train step', DENSE)}, prompt token {ratio('prefill token', DENSE)}, generated "
        f"token {ratio('decode token', DENSE)}. Timing: {rounds} rounds after one warm-up, "
        f"median per seed; a training step is {batch_size}x{length} tokens, generation a "
        f"{len(prompt)}-token prompt and {n_new} greedy tokens at batch 1. glassformer's MoE "
        "loops over the experts in Python (a gather and an index_add per expert).",
        f"Expert shares: fractions of the val windows' token-to-expert assignments (uniform = "
        f"1/{N_EXPERTS} = {1 / N_EXPERTS:.3f}); mean aux loss {all_aux:.3f} "
        "(1.0 = balanced).",
    ]
    figure = _plot(losses, val_s, time_s, mean_shares)
    data = {"deepseek_v3": deepseek, "val": val, "seconds": times, "shares": shares, "aux": aux,
            "steps": steps, "seeds": seeds, "counts": {n: {"total": c["total"], "active":
            c["active"]} for n, c in counts.items()}}  # fmt: skip
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _plot(losses: dict, val_s: dict, time_s: dict, mean_shares: torch.Tensor):
    fig, (curves, cost, load) = lab.new_figure(14.0, 3.8, ncols=3)
    n_steps = len(losses[DENSE][0])
    window = max(1, n_steps // 25)
    for i, (name, runs) in enumerate(losses.items()):
        for seed_losses in runs:
            curves.plot(
                lab.trailing_mean(seed_losses, window),
                color=f"C{i}",
                alpha=0.7,
                label=f"{name}: val {val_s[name]}" if seed_losses is runs[0] else None,
            )
    curves.set(xlabel="step", ylabel=f"train loss (nats, mean of {window} steps)",
               title="same active FFN weights, one line per seed")  # fmt: skip
    if abs(val_s[DENSE].mean - val_s[MOE].mean) <= combined_spread(val_s[DENSE], val_s[MOE]):
        curves.text(0.55, 0.45, "no difference beyond the seeds' spread", ha="center",
                    transform=curves.transAxes, fontsize=8)  # fmt: skip
    curves.legend(fontsize=7)
    kinds = list(time_s[MOE])
    for i, name in enumerate(time_s):
        means = [time_s[name][k].mean * 1e3 for k in kinds]
        spreads = [time_s[name][k].spread * 1e3 for k in kinds]
        offset = (i - 1) * 0.27  # three bars centred on each kind
        cost.bar([j + offset for j in range(len(kinds))], means, 0.27, yerr=spreads, capsize=2,
                 label=name)  # fmt: skip
    cost.set_xticks(range(len(kinds)), [f"per\n{k}" for k in kinds])
    cost.set(yscale="log", ylabel="milliseconds (log scale)", title="time on this CPU")
    cost.legend(fontsize=7)
    image = load.imshow(mean_shares.numpy(), cmap="viridis", aspect="auto", vmin=0)
    load.set(xlabel="expert", ylabel="layer", title=f"expert share (uniform {1 / N_EXPERTS:.3f})",
             xticks=range(mean_shares.shape[1]), yticks=range(mean_shares.shape[0]))  # fmt: skip
    for layer in range(mean_shares.shape[0]):
        for expert in range(mean_shares.shape[1]):
            load.text(expert, layer, f"{mean_shares[layer, expert]:.2f}", ha="center",
                      va="center", fontsize=7, color="w")  # fmt: skip
    fig.colorbar(image, ax=load, label="share of assignments")
    return fig
