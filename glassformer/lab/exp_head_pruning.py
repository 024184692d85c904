"""Seed 000 §4.2: head pruning, "剪掉相当比例的头模型性能几乎不掉——重要头集中，其余是冗余备份".

On the lab's small character-level Shakespeare GPT (lab/char_gpt.py), every head is switched off
in turn (inspect.ablate: its slice of the input to W_O zeroed) and its importance is the rise of
the validation loss. Then heads are removed cumulatively, least important first (ordered by
that single-head importance, not re-ranked as heads go), and in a few random orders for
comparison; every evaluation uses the same fixed validation windows. No fine-tuning after
pruning: this is the "test-time" pruning of the head-pruning studies.
"""

from __future__ import annotations

import torch

from glassformer.inspect.ablate import ablate_heads, all_heads, as_spec
from glassformer.lab import base as lab
from glassformer.lab.char_gpt import char_gpt
from glassformer.lab.fit import random_windows

# Thresholds, stated once. "剪掉相当比例的头…几乎不掉": removing a quarter of the heads (the least
# important first) raises the validation loss by at most 5% ("almost no drop"). "重要头集中":
# the most important quarter of the heads carries at least half of the summed single-head loss
# increases. Sanity: removing every head raises the loss by at least 20% (heads matter together).
PRUNED_SHARE = 0.25
MAX_PRUNED_INCREASE = 0.05
MIN_TOP_SHARE = 0.5
MIN_ALL_REMOVED_INCREASE = 0.20
TABLE_SHARES = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)


class FixedEval:
    """Validation loss of the model under an ablation, always on the same windows."""

    def __init__(
        self, model: torch.nn.Module, val_ids: torch.Tensor, length: int, n: int, seed: int
    ):
        self.model = model
        self.windows = random_windows(val_ids, n, length, torch.Generator().manual_seed(seed))

    @torch.no_grad()
    def __call__(self, removed: list[tuple[int, int]]) -> float:
        with ablate_heads(self.model, as_spec(removed)):
            return self.model.loss(**self.windows).ce_loss.item()


def removal_curve(evaluate: FixedEval, order: list[tuple[int, int]]) -> list[float]:
    """Loss with the first k heads of `order` removed, k = 0..len(order)."""
    return [evaluate(order[:k]) for k in range(len(order) + 1)]


@lab.register("head-pruning")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    gpt = char_gpt(ctx)
    evaluate = FixedEval(gpt.model, gpt.val_ids, gpt.recipe.context,
                         ctx.pick(64, 32, 4), ctx.seed)  # fmt: skip
    heads = all_heads(gpt.model)
    base = evaluate([])
    importance = {head: evaluate([head]) - base for head in heads}
    by_importance = sorted(heads, key=lambda h: importance[h])
    greedy = removal_curve(evaluate, by_importance)
    generator = torch.Generator().manual_seed(ctx.seed + 1)
    random_curves = []
    for _ in range(ctx.pick(5, 3, 2)):
        order = [heads[i] for i in torch.randperm(len(heads), generator=generator).tolist()]
        random_curves.append(removal_curve(evaluate, order))
    random_mean = [
        sum(c[k] for c in random_curves) / len(random_curves) for k in range(len(heads) + 1)
    ]

    n = len(heads)
    rows = []
    for share in TABLE_SHARES:
        k = round(share * n)
        rows.append({
            "heads removed": f"{k} of {n} ({share:.0%})",
            "loss, least important first": greedy[k],
            "increase": greedy[k] / base - 1,
            "loss, random order (mean)": random_mean[k],
            "increase, random": random_mean[k] / base - 1,
        })  # fmt: skip
    k_pruned = round(PRUNED_SHARE * n)
    gains = sorted((max(v, 0.0) for v in importance.values()), reverse=True)
    top_share = sum(gains[:k_pruned]) / sum(gains) if sum(gains) > 0 else float("nan")
    checks = [
        lab.at_most(f"val loss increase with the {k_pruned} least important of {n} heads removed",
                    greedy[k_pruned] / base - 1, MAX_PRUNED_INCREASE),
        lab.at_least(f"share of the summed single-head loss increases in the top {k_pruned} heads",
                     top_share, MIN_TOP_SHARE),
        lab.at_least("val loss increase with every head removed", greedy[-1] / base - 1,
                     MIN_ALL_REMOVED_INCREASE),
    ]  # fmt: skip
    recipe = gpt.recipe
    notes = [
        f"model: {recipe.shape}, {recipe.schedule.max_steps} training steps on Shakespeare "
        f"characters ({gpt.origin}); final training loss {gpt.train_losses[-1]:.3f}, val loss "
        f"{base:.3f} on {len(evaluate.windows['input_ids'])} fixed windows of {recipe.context} "
        "characters",
        "heads are removed without any fine-tuning afterwards; the order is fixed by each "
        "head's own importance measured alone, so interactions between heads are not searched",
        f"single-head importance ranges {min(importance.values()):+.4f} .. "
        f"{max(importance.values()):+.4f} nats of val loss",
    ]
    if min(importance.values()) < 0:
        notes.append("a negative importance: the model does slightly better without that head "
                     "on these windows")  # fmt: skip
    figure = _plot(gpt.model, heads, importance, greedy, random_curves, base)
    data = {
        "base_loss": base,
        "importance": {f"{layer}.{head}": v for (layer, head), v in importance.items()},
        "order": [f"{layer}.{head}" for layer, head in by_importance],
        "greedy_curve": greedy,
        "random_curves": random_curves,
    }
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _plot(model, heads, importance, greedy, random_curves, base):
    fig, (left, right) = lab.new_figure(10.0, 3.6, ncols=2)
    ks = list(range(len(heads) + 1))
    for i, curve in enumerate(random_curves):
        left.plot(
            ks, curve, color="gray", alpha=0.5, lw=1, label="random order" if i == 0 else None
        )
    left.plot(ks, greedy, marker="o", ms=3, color="C0", label="least important first")
    left.axhline(base, color="black", ls=":", lw=1, label="no head removed")
    left.set(xlabel="heads removed", ylabel="validation loss (nats / char)",
             title="loss as heads are pruned")  # fmt: skip
    left.legend(fontsize=7)
    n_layers = max(layer for layer, _ in heads) + 1
    n_heads = max(head for _, head in heads) + 1
    grid = torch.zeros(n_layers, n_heads)
    for (layer, head), value in importance.items():
        grid[layer, head] = value
    image = right.imshow(grid.numpy(), cmap="viridis", aspect="auto")
    right.set(xlabel="head", ylabel="layer", title="loss increase with one head removed",
              xticks=range(n_heads), yticks=range(n_layers))  # fmt: skip
    fig.colorbar(image, ax=right, label="Δ val loss (nats)")
    return fig
