"""Seed 000 §4.3 and §2.3: past the training length, learned absolute positions collapse, RoPE
degrades more gently, and NTK / YaRN scaling stretches RoPE further.

Small char-level GPTs are trained on Shakespeare windows of L tokens, one per position kind
(learned, sinusoidal, RoPE, ALiBi), same steps, same batches. Each is then run once over held-out
windows of 4L tokens and the cross-entropy is read off per position: mean loss in [0, L) (seen
in training), [L, 2L) and [2L, 4L) (never seen). The trained RoPE weights are also evaluated with
rope_scaling switched on at evaluation time only: dynamic NTK and YaRN, both stretching L to 4L.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.lab.fit import Schedule, fit, random_windows, shakespeare_chars, window_batches
from glassformer.models import build_model

EVAL_FACTOR = 4  # evaluation windows are 4x the training length
POSITIONS = ("learned", "sinusoidal", "rope", "alibi")
# Thresholds, stated once. "Collapse" (崩塌): learned positions lose at least 1 nat per character
# beyond L compared with inside it (e^1 ≈ 2.7x the perplexity; a char model's in-range loss is
# ~2 nats). "More gently": RoPE's rise beyond L is smaller than learned's (any margin > 0).
# "Scaling helps": the better of NTK / YaRN lowers RoPE's loss beyond L by at least 0.05 nats,
# more than the wobble between two evaluations of the same windows with different positions.
MIN_LEARNED_RISE = 1.0
MIN_ROPE_ADVANTAGE = 0.0
MIN_SCALING_GAIN = 0.05


def rope_scalings(train_len: int, eval_len: int) -> dict[str, dict]:
    """The evaluation-time scalings of RoPE. Dynamic NTK with factor 1 raises the base by
    (T / L)^(D / (D - 2)) for a T-token input: the NTK-aware rule stretched to exactly T / L.
    YaRN interpolates the slow pairs by eval_len / L and keeps the fast ones."""
    return {
        "rope + NTK (dynamic)": {
            "type": "dynamic",
            "factor": 1.0,
            "original_max_seq_len": train_len,
        },
        "rope + YaRN": {
            "type": "yarn",
            "factor": eval_len / train_len,
            "original_max_seq_len": train_len,
        },
    }


def model_config(position: str, vocab_size: int, train_len: int, eval_len: int, size: dict):
    # Absolute tables need rows up to eval_len to run the long windows at all; rows >= train_len
    # are never trained. RoPE and ALiBi have no table: their max_seq_len is the training length.
    max_seq_len = eval_len if position in ("learned", "sinusoidal") else train_len
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        position=position,
        norm="rms",
        ffn="swiglu",
        **size,
    )


@torch.no_grad()
def loss_per_position(model: nn.Module, input_ids: Tensor, targets: Tensor) -> Tensor:
    """(B, T) windows -> (T,) next-token cross-entropy at each position, averaged over B."""
    model.eval()
    logits = model(input_ids)  # (B, T, V)
    ce = F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")  # (B, T)
    return ce.mean(dim=0)


def band_means(curve: Tensor, train_len: int) -> dict[str, float]:
    """Mean loss in [0, L), [L, 2L) and [2L, T) of a per-position curve."""
    bands = {
        "[0, L)": curve[:train_len],
        "[L, 2L)": curve[train_len : 2 * train_len],
        f"[2L, {len(curve) // train_len}L)": curve[2 * train_len :],
    }
    return {name: float(part.mean()) for name, part in bands.items() if len(part)}


def with_scaling(model: nn.Module, scaling: dict) -> nn.Module:
    """The same trained weights in a model whose RoPE uses `scaling`."""
    cfg = dataclasses.replace(model.cfg, rope_scaling=scaling)
    scaled = build_model(cfg)
    scaled.load_state_dict(model.state_dict())
    return scaled.eval()


@lab.register("length-extrapolation")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    train_len = ctx.pick(64, 64, 8)
    eval_len = EVAL_FACTOR * train_len
    steps = ctx.pick(2000, 800, 3)
    n_eval = ctx.pick(256, 128, 4)
    size = ctx.pick(
        dict(d_model=96, n_layers=3, n_heads=4),
        dict(d_model=64, n_layers=2, n_heads=4),
        dict(d_model=16, n_layers=1, n_heads=2),
    )
    corpus = shakespeare_chars(ctx.pick(None, None, 200_000))
    vocab = corpus.tokenizer.vocab_size
    schedule = Schedule(max_steps=steps, learning_rate=3e-3, warmup_steps=min(50, steps // 10))
    batches = window_batches(corpus.train, 32, train_len, ctx.seed)
    windows = random_windows(
        corpus.val, n_eval, eval_len, torch.Generator().manual_seed(ctx.seed + 1)
    )

    curves: dict[str, Tensor] = {}
    train_loss: dict[str, float] = {}
    for position in POSITIONS:
        torch.manual_seed(ctx.seed)
        model = build_model(model_config(position, vocab, train_len, eval_len, size))
        losses = fit(model, batches, schedule)
        train_loss[position] = losses[-1]
        curves[position] = loss_per_position(model, **windows)
        if position == "rope":
            for name, scaling in rope_scalings(train_len, eval_len).items():
                curves[name] = loss_per_position(with_scaling(model, scaling), **windows)

    bands = {name: band_means(curve, train_len) for name, curve in curves.items()}
    rows = []
    for name, band in bands.items():
        inside, beyond = band["[0, L)"], float(curves[name][train_len:].mean())
        rows.append({"model": name, **band, "beyond L − inside": beyond - inside})

    def rise(name: str) -> float:
        return float(curves[name][train_len:].mean() - curves[name][:train_len].mean())

    rope_beyond = float(curves["rope"][train_len:].mean())
    scaled = {n: float(curves[n][train_len:].mean()) for n in rope_scalings(train_len, eval_len)}
    best_scaled = min(scaled, key=scaled.get)
    checks = [
        lab.at_least(
            "learned: loss beyond L − loss within L (nats)", rise("learned"), MIN_LEARNED_RISE
        ),
        lab.at_least(
            "rise beyond L: learned − RoPE (nats)",
            rise("learned") - rise("rope"),
            MIN_ROPE_ADVANTAGE,
        ),
        lab.at_least(
            f"RoPE loss beyond L: plain − {best_scaled} (nats)",
            rope_beyond - scaled[best_scaled],
            MIN_SCALING_GAIN,
        ),
    ]
    figure = _plot(curves, train_len)
    notes = [
        f"trained {steps} steps on {train_len}-char windows (batch 32, same batches for every "
        f"model), evaluated on {n_eval} held-out windows of {eval_len} chars in one forward each",
        "the learned table has rows up to the evaluation length so the long windows run at all; "
        f"rows {train_len}..{eval_len - 1} never receive a gradient (only weight decay): that is "
        "why learned positions cannot extrapolate",
        "NTK and YaRN change only the RoPE frequencies of the same trained weights, at evaluation "
        "time; dynamic NTK sets its base from the whole window's length, so it also changes the "
        "loss inside [0, L)",
        f"ALiBi (a distance penalty, no position table, no scaling) rises {rise('alibi'):+.3f} "
        f"nats beyond L; sinusoidal {rise('sinusoidal'):+.3f} (its table is added at full "
        "size to the small token embeddings, which also slows its training)",
        "final training loss per model: "
        + ", ".join(f"{k} {v:.3f}" for k, v in train_loss.items()),
    ]
    data = {
        "train_len": train_len,
        "eval_len": eval_len,
        "steps": steps,
        "n_eval_windows": n_eval,
        "loss_per_position": {k: [round(float(x), 4) for x in v] for k, v in curves.items()},
        "final_train_loss": train_loss,
    }
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def smooth(curve: Tensor, width: int) -> Tensor:
    """A centered moving average (edges averaged over what exists)."""
    if width <= 1:
        return curve
    kernel = torch.ones(1, 1, width)
    padded = F.pad(curve[None, None], (width // 2, width - 1 - width // 2))
    counts = F.pad(torch.ones_like(curve)[None, None], (width // 2, width - 1 - width // 2))
    return (F.conv1d(padded, kernel) / F.conv1d(counts, kernel))[0, 0]


def _plot(curves: dict[str, Tensor], train_len: int):
    fig, ax = lab.new_figure(7.0, 3.8)
    width = max(1, train_len // 8)
    for name, curve in curves.items():
        style = "--" if "+" in name else "-"
        ax.plot(range(len(curve)), smooth(curve, width).tolist(), style, label=name, lw=1.3)
    ax.axvline(train_len, color="gray", linestyle=":", label=f"training length L={train_len}")
    ax.set(
        xlabel="position in the window",
        ylabel=f"cross-entropy (nats, moving mean of {width})",
        title="Loss per position, trained at L, evaluated at 4L",
    )
    ax.legend(fontsize=7)
    return fig
