"""Seed 000 §4.3 and §2.3: past the training length L, absolute positions collapse, RoPE and the
other relative encodings degrade less, and RoPE with NTK / YaRN scaling reaches tens of times L.

Small char-level GPTs are trained on Shakespeare windows of L characters, one per position kind
(learned, sinusoidal, RoPE, ALiBi), same steps, same batches, over several seeds. Each is then
scored on held-out windows (the corpus' validation tail, never trained on) cut to 1, 2, 4, 8 and
16 x L characters: the loss at k x L is the mean next-character cross-entropy over a whole k x L
window, the "perplexity at evaluation length" of the ALiBi and YaRN papers. The trained RoPE
weights are also scored with rope_scaling switched on at evaluation time only: NTK (the base
raised for the window's length) and YaRN (factor k at k x L).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.lab.fit import (
    Schedule,
    fit,
    random_windows,
    shakespeare_chars,
    unigram_entropy,
    window_batches,
)
from glassformer.models import build_model

FACTORS = (1, 2, 4, 8, 16)  # evaluation lengths, in multiples of the training length L
POSITIONS = ("learned", "sinusoidal", "rope", "alibi")  # one trained model per kind and seed
SCALINGS = ("rope + NTK", "rope + YaRN")  # the trained RoPE weights, scaled at evaluation time
ABSOLUTE, RELATIVE = ("learned", "sinusoidal"), ("rope", "alibi")

# Thresholds, stated once (nats per character; a loss is a mean over seeds, a difference counts
# only beyond the seeds' combined spread).
# "崩塌" (collapse): an absolute encoding's loss at 16L is at least 1 nat above its loss at L,
# e^1 ≈ 2.7x the perplexity: the models gain about 1 nat over the unigram entropy (3.3) by
# reading context, so a 1-nat rise gives back about all of it (as bad as ignoring the context).
COLLAPSE_RISE = 1.0
# "外推到训练长度的数十倍" (extends the window): RoPE + NTK / YaRN at 16L stays within 0.1 nats of
# RoPE's loss at L, at most ~10% more perplexity: the long window is as usable as the trained one.
USABLE_MARGIN = 0.1
# "外推性好" / "RoPE 等相对编码缓解" (relative encodings degrade less): RoPE's and ALiBi's rise from
# L to 16L is smaller than each absolute encoding's, by more than the spread (margin 0).
# Precondition: every model learned to read context, its loss at L at least 0.5 nats below the
# unigram entropy of the training characters; otherwise its rise beyond L says nothing.
CONTEXT_GAIN = 0.5

G_ABSOLUTE = "absolute positions collapse beyond L (绝对位置编码…崩塌)"
G_RELATIVE = "RoPE and ALiBi degrade less than absolute positions (RoPE 等相对编码缓解)"
G_SCALED = f"RoPE + NTK / YaRN usable at {FACTORS[-1]}L (外推到训练长度的数十倍)"
GROUPS_ZH = {
    G_ABSOLUTE: "超过 L 后绝对位置编码崩塌（绝对位置编码…崩塌）",
    G_RELATIVE: "RoPE 和 ALiBi 的退化比绝对位置编码小（RoPE 等相对编码缓解）",
    G_SCALED: f"RoPE + NTK / YaRN 在 {FACTORS[-1]}L 仍可用（外推到训练长度的数十倍）",
}
METHODS_ZH = {
    "learned": "可学习位置编码",
    "sinusoidal": "正弦位置编码",
    "rope": "RoPE",
    "alibi": "ALiBi",
    "rope + NTK": "RoPE + NTK",
    "rope + YaRN": "RoPE + YaRN",
}


def rope_scaling(method: str, factor: int, train_len: int) -> dict | None:
    """The evaluation-time rope_scaling of `method` for a window of factor * L tokens. NTK is
    dynamic with factor 1: for a T-token input it raises the base by (T / L)^(D / (D - 2)), the
    NTK-aware rule stretched to exactly T / L (and nothing at T <= L). YaRN interpolates the slow
    pairs by `factor`, keeps the fast ones and sharpens attention by 0.1 ln(factor) + 1."""
    if method == "rope + NTK":
        return {"type": "dynamic", "factor": 1.0, "original_max_seq_len": train_len}
    if method == "rope + YaRN" and factor > 1:
        return {"type": "yarn", "factor": float(factor), "original_max_seq_len": train_len}
    return None


def with_scaling(model: nn.Module, scaling: dict | None) -> nn.Module:
    """The same trained weights in a model whose RoPE uses `scaling` (None: the model itself)."""
    if scaling is None:
        return model
    scaled = build_model(dataclasses.replace(model.cfg, rope_scaling=scaling))
    scaled.load_state_dict(model.state_dict())
    return scaled.eval()


def model_config(position: str, vocab_size: int, train_len: int, eval_len: int, size: dict):
    # Absolute tables need rows up to eval_len to run the long windows at all; rows >= train_len
    # are never trained. RoPE and ALiBi have no table: their max_seq_len is the training length.
    # init_std 0.1 for every kind, not GPT-2's 0.02: token embeddings of std 0.02 are drowned by
    # the sinusoidal table's ±1 entries, and in a short run that model stayed at the unigram loss.
    max_seq_len = eval_len if position in ABSOLUTE else train_len
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        position=position,
        norm="rms",
        ffn="swiglu",
        init_std=0.1,
        **size,
    )


@torch.no_grad()
def loss_per_position(model: nn.Module, input_ids: Tensor, targets: Tensor, chunk: int = 16):
    """(B, T) windows -> (T,) next-token cross-entropy at each position, averaged over B (run
    `chunk` windows at a time, so long windows fit in memory)."""
    model.eval()
    total = torch.zeros(input_ids.shape[1])
    for start in range(0, len(input_ids), chunk):
        logits = model(input_ids[start : start + chunk])  # (b, T, V)
        ce = F.cross_entropy(
            logits.float().transpose(1, 2), targets[start : start + chunk], reduction="none"
        )  # (b, T)
        total += ce.sum(dim=0)
    return total / len(input_ids)


def losses_by_length(
    model: nn.Module, method: str, windows: dict[str, Tensor], train_len: int
) -> tuple[list[float], Tensor]:
    """The loss of `method` on the windows cut to each k * L of FACTORS, and its per-position
    curve over the longest cut."""
    losses, curve = [], torch.empty(0)
    for factor in FACTORS:
        n = factor * train_len
        scored = with_scaling(model, rope_scaling(method, factor, train_len))
        curve = loss_per_position(scored, windows["input_ids"][:, :n], windows["targets"][:, :n])
        losses.append(float(curve.mean()))
    return losses, curve


@lab.register("length-extrapolation")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    train_len = ctx.pick(64, 32, 8)
    eval_len = FACTORS[-1] * train_len
    steps = ctx.pick(2000, 300, 3)
    batch_size = ctx.pick(32, 16, 4)
    n_eval = ctx.pick(128, 48, 4)
    size = ctx.pick(
        dict(d_model=96, n_layers=3, n_heads=4),
        dict(d_model=64, n_layers=2, n_heads=4),
        dict(d_model=16, n_layers=1, n_heads=2),
    )
    seeds = ctx.seeds()
    corpus = shakespeare_chars(ctx.pick(None, None, 200_000))
    vocab = corpus.tokenizer.vocab_size
    schedule = Schedule(max_steps=steps, learning_rate=3e-3, warmup_steps=min(50, steps // 10))
    # The same held-out windows for every seed: the spread is the training seeds' alone.
    windows = random_windows(
        corpus.val, n_eval, eval_len, torch.Generator().manual_seed(ctx.seed + 10_000)
    )

    per_seed: dict[str, list[list[float]]] = {m: [] for m in POSITIONS + SCALINGS}
    curves: dict[str, list[Tensor]] = {m: [] for m in POSITIONS + SCALINGS}
    train_loss: dict[str, list[float]] = {p: [] for p in POSITIONS}
    for seed in seeds:
        batches = window_batches(corpus.train, batch_size, train_len, seed)
        for position in POSITIONS:
            torch.manual_seed(seed)
            model = build_model(model_config(position, vocab, train_len, eval_len, size))
            train_loss[position].append(fit(model, batches, schedule)[-1])
            for method in (position, *SCALINGS) if position == "rope" else (position,):
                losses, curve = losses_by_length(model, method, windows, train_len)
                per_seed[method].append(losses)
                curves[method].append(curve)

    # loss[method][i]: the loss at FACTORS[i] * L over seeds; rise: 16L minus L, seed by seed
    loss = {
        m: [lab.over_seeds(col) for col in zip(*runs, strict=True)] for m, runs in per_seed.items()
    }
    rise = {m: lab.over_seeds([r[-1] - r[0] for r in runs]) for m, runs in per_seed.items()}
    top = f"{FACTORS[-1]}L"
    say = ctx.say
    zh = METHODS_ZH
    for m in loss:
        say(m, zh[m])
    rows = []
    for m, spreads in loss.items():
        row = {say("method", "方法"): m}
        for factor, s in zip(FACTORS, spreads, strict=True):
            row[say(f"{factor}L", f"{factor} 倍 L")] = f"{s.mean:.3f} ± {s.spread:.3f}"
        row[say(f"{top} − L (nats)", f"{top} 与 L 之差（nats）")] = (
            f"{rise[m].mean:+.3f} ± {rise[m].spread:.3f}"
        )
        rows.append(row)

    unigram = unigram_entropy(corpus.train)
    for group, group_zh in GROUPS_ZH.items():
        say(group, group_zh)
    checks = [
        lab.precondition(
            lab.at_most(
                say(f"{p}: held-out loss at L (nats)", f"{zh[p]}：L 处的留出损失（nats）"),
                loss[p][0].mean,
                unigram - CONTEXT_GAIN,
            )
        )
        for p in POSITIONS
    ]
    for p in ABSOLUTE:
        checks.append(
            lab.exceeds_spread(
                say(
                    f"{p}: loss at {top} − loss at L (nats)",
                    f"{zh[p]}：{top} 处的损失 − L 处的损失（nats）",
                ),
                loss[p][-1],
                loss[p][0],
                COLLAPSE_RISE,
                group=G_ABSOLUTE,
            )
        )
    for r in RELATIVE:
        for a in ABSOLUTE:
            checks.append(
                lab.exceeds_spread(
                    say(
                        f"rise L→{top}: {a} − {r} (nats)",
                        f"L→{top} 的上升：{zh[a]} − {zh[r]}（nats）",
                    ),
                    rise[a],
                    rise[r],
                    group=G_RELATIVE,
                )
            )
    for m in SCALINGS:
        checks.append(
            lab.within_spread(
                say(
                    f"{m}: loss at {top} − RoPE's loss at L (nats)",
                    f"{zh[m]}：{top} 处损失 − RoPE 在 L 处损失（nats）",
                ),
                loss[m][-1],
                loss["rope"][0],
                USABLE_MARGIN,
                group=G_SCALED,
            )
        )

    figure = _plot(loss, rise, curves, train_len)
    n_seeds, cuts, last_row = len(seeds), ", ".join(f"{k}L" for k in FACTORS), eval_len - 1
    final_en = ", ".join(f"{p} {lab.over_seeds(v).mean:.3f}" for p, v in train_loss.items())
    final_zh = "，".join(f"{zh[p]} {lab.over_seeds(v).mean:.3f}" for p, v in train_loss.items())
    notes = [
        say(
            f"{n_seeds} seed(s) {seeds}; each model trained {steps} steps on {train_len}-char "
            f"windows of the training split (batch {batch_size}, the same batches for every kind), "
            f"scored on {n_eval} windows of the held-out validation tail cut to "
            f"{cuts} = up to {eval_len} chars",
            f"{n_seeds} 个随机种子 {seeds}；每个模型在训练集的 {train_len} 字符窗口上训练 "
            f"{steps} 步（批大小 {batch_size}，每种位置编码用相同的批次），"
            f"在留出的验证集尾部取 {n_eval} 个窗口评估，截成 {cuts}，最长 {eval_len} 个字符",
        ),
        say(
            f"unigram entropy of the training characters {unigram:.3f} nats; final training loss "
            "per kind: " + final_en,
            f"训练字符的一元熵为 {unigram:.3f} nats；各种位置编码最终的训练损失：" + final_zh,
        ),
        say(
            "the learned table has rows up to the longest window so it runs at all; rows "
            f"{train_len}..{last_row} never receive a gradient (only weight decay)",
            "可学习位置编码的表一直排到最长窗口，这样它才跑得起来；第 "
            f"{train_len}..{last_row} 行从未得到梯度（只有权重衰减）",
        ),
        say(
            "NTK and YaRN change only the RoPE frequencies of the RoPE model's trained weights, at "
            "evaluation time, with no training at the long length; NTK (dynamic) is a no-op at L, "
            "YaRN uses factor k at kL (factor 1 at L: plain RoPE)",
            "NTK 和 YaRN 只在评估时改动 RoPE 模型已训练权重的 RoPE 频率，不在长长度上做任何训练；"
            "NTK（动态）在 L 处不起作用，YaRN 在 kL 处用因子 k（L 处因子为 1：即普通 RoPE）",
        ),
        say(
            f"{top} is the low end of 数十倍 (tens of times L): a pass at {top} would not yet show "
            f"数十倍, a failure already falls short of it at {top}",
            f"{top} 只是“数十倍”的下限：在 {top} 通过还不足以说明数十倍，"
            f"在 {top} 就失败则已经达不到",
        ),
        _reading(loss, rise, top, say),
        _alibi_comparison(loss, top, say),
    ]
    data = {
        "train_len": train_len,
        "factors": list(FACTORS),
        "steps": steps,
        "seeds": seeds,
        "n_eval_windows": n_eval,
        "unigram_entropy": unigram,
        "loss_by_length": per_seed,
        "final_train_loss": train_loss,
        "loss_per_position_mean": {
            m: [round(float(x), 4) for x in torch.stack(c).mean(0)] for m, c in curves.items()
        },
    }
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _reading(loss: dict, rise: dict, top: str, say) -> str:
    """Where each method's loss at the longest window sits against its loss at L."""
    parts, parts_zh = [], []
    for m, r in rise.items():
        over = [
            k
            for k, s in zip(FACTORS, loss[m], strict=True)
            if s.mean - loss[m][0].mean > USABLE_MARGIN
        ]
        where = (
            f"first more than {USABLE_MARGIN} nats above L at {over[0]}L"
            if over
            else f"within {USABLE_MARGIN} nats of L up to {top}"
        )
        where_zh = (
            f"在 {over[0]}L 处首次比 L 高出 {USABLE_MARGIN} nats 以上"
            if over
            else f"直到 {top} 都与 L 相差不超过 {USABLE_MARGIN} nats"
        )
        parts.append(f"{m} {r.mean:+.3f} ({where})")
        parts_zh.append(f"{METHODS_ZH[m]} {r.mean:+.3f}（{where_zh}）")
    return say(
        f"rise from L to {top} (nats): " + "; ".join(parts),
        f"从 L 到 {top} 的上升（nats）：" + "；".join(parts_zh),
    )


def _alibi_comparison(loss: dict, top: str, say) -> str:
    """ALiBi against the better of RoPE + NTK / YaRN at the longest window."""
    best = min(SCALINGS, key=lambda m: loss[m][-1].mean)
    alibi, scaled = loss["alibi"][-1], loss[best][-1]
    gap = alibi.mean - scaled.mean
    noise = math.hypot(alibi.spread, scaled.spread)
    side = f"ALiBi {'lower' if gap < 0 else 'higher'} by {abs(gap):.3f}"
    side_zh = f"ALiBi {'低' if gap < 0 else '高'} {abs(gap):.3f}"
    if len(alibi.values) < 2:
        reading = f"{side} (one seed: no spread to weigh it against)"
        reading_zh = f"{side_zh}（只有一个随机种子：没有波动可供比较）"
    elif abs(gap) <= noise:
        reading = f"no difference beyond the seeds' spread ({noise:.3f})"
        reading_zh = f"没有超出随机种子波动（{noise:.3f}）的差异"
    else:
        reading = f"{side}, beyond the seeds' spread ({noise:.3f})"
        reading_zh = f"{side_zh}，超出随机种子波动（{noise:.3f}）"
    return say(
        f"ALiBi (a distance penalty, no scaling) at {top}: {alibi}; the better scaled RoPE "
        f"({best}): {scaled}; {reading}",
        f"ALiBi（距离惩罚，不做缩放）在 {top}：{alibi}；较好的缩放 RoPE"
        f"（{METHODS_ZH[best]}）：{scaled}；{reading_zh}",
    )


def smooth(curve: Tensor, width: int) -> Tensor:
    """A centered moving average (edges averaged over what exists)."""
    if width <= 1:
        return curve
    kernel = torch.ones(1, 1, width)
    padded = F.pad(curve[None, None], (width // 2, width - 1 - width // 2))
    counts = F.pad(torch.ones_like(curve)[None, None], (width // 2, width - 1 - width // 2))
    return (F.conv1d(padded, kernel) / F.conv1d(counts, kernel))[0, 0]


def _plot(loss: dict, rise: dict, curves: dict, train_len: int):
    fig, (left, right) = lab.new_figure(10.0, 4.0, ncols=2)
    styles = {m: "--" if m in SCALINGS else "-" for m in loss}
    rope_at_l = loss["rope"][0].mean
    left.axhspan(
        rope_at_l - USABLE_MARGIN,
        rope_at_l + USABLE_MARGIN,
        color="0.88",
        label=f"RoPE at L ± {USABLE_MARGIN} (no difference)",
    )
    for m, spreads in loss.items():
        left.errorbar(
            FACTORS,
            [s.mean for s in spreads],
            yerr=[s.spread for s in spreads],
            fmt=styles[m] + "o",
            ms=3,
            capsize=2,
            lw=1.3,
            label=f"{m} ({FACTORS[-1]}L − L: {rise[m].mean:+.2f})",
        )
    left.set_xscale("log", base=2)
    left.set_xticks(FACTORS, [f"{k}×" for k in FACTORS])
    left.set(
        xlabel=f"evaluation window (multiples of the training length L={train_len})",
        ylabel="held-out cross-entropy (nats/char)",
        title="Loss of a whole window, mean ± spread over seeds",
    )
    left.legend(fontsize=7, loc="upper left")
    width = max(1, train_len // 4)
    for m, seed_curves in curves.items():
        curve = smooth(torch.stack(seed_curves).mean(0), width)
        right.plot(range(1, len(curve) + 1), curve.tolist(), styles[m], label=m, lw=1.2)
    right.axvline(train_len, color="gray", linestyle=":", label=f"L = {train_len}")
    right.set_xscale("log", base=2)
    ticks = [2**i for i in range(0, len(curve).bit_length(), 2)]
    right.set_xticks(ticks, [str(t) for t in ticks])
    right.set(
        xlabel="position in the longest window (characters, log scale)",
        ylabel=f"cross-entropy (nats, moving mean of {width})",
        title=f"Per position, {FACTORS[-1]}L window (mean over seeds)",
    )
    right.legend(fontsize=7)
    return fig
