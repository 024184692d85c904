"""Seed 000 §3.1 (and seed 002's BERT demo): in "The animal didn't cross the street because it
was too tired", self-attention learns it → animal; with "too wide", it should look at street.

Measured in real pretrained models through glassformer.inspect (the eager path's weights): for
each layer, the weight "it" puts on "animal" and on "street", averaged over heads and in the
head that prefers each most. Reported as it is, whatever it shows.
"""

from __future__ import annotations

from glassformer.inspect.capture import attention_view
from glassformer.lab import base as lab

SENTENCES = {
    "tired": "The animal didn't cross the street because it was too tired",
    "wide": "The animal didn't cross the street because it was too wide",
}
# Thresholds: the claim holds in a model if, averaged over heads, some layer puts more weight from
# "it" on the right noun than on the other one (ratio >= 1) - for "tired" animal, for "wide"
# street - and the "tired" and "wide" sentences move that layer's preference the way the claim
# says (both at once).


def noun_weights(model, tokenizer, sentence: str) -> list[dict[str, float]]:
    """Per layer: mean-over-heads and best-head weight of "it" on "animal" and on "street"."""
    view = attention_view(model, tokenizer, sentence, token="it")
    keys = [text.strip().lower() for text in view.key_tokens]
    animal, street = keys.index("animal"), keys.index("street")
    layers = []
    for weights in view.weights:  # (H, Tq, Tk) per layer
        row = weights[:, view.query]  # (H, Tk)
        layers.append(
            {
                "animal": float(row[:, animal].mean()),
                "street": float(row[:, street].mean()),
                "animal best head": float(row[:, animal].max()),
                "street best head": float(row[:, street].max()),
            }
        )
    return layers


def _models(ctx: lab.RunContext) -> dict:
    from glassformer.interop.pretrained import from_pretrained

    names = ctx.pick(["minilm", "smollm2"], ["minilm", "smollm2"], ["minilm"])
    return {name: from_pretrained(name) for name in names}


@lab.register("it-animal")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    rows, checks, data, families = [], [], {}, {}
    for name, (model, tokenizer) in _models(ctx).items():
        families[name] = model.cfg.family
        per_sentence = {k: noun_weights(model, tokenizer, s) for k, s in SENTENCES.items()}
        data[name] = per_sentence
        tired, wide = per_sentence["tired"], per_sentence["wide"]
        for layer, (t, w) in enumerate(zip(tired, wide, strict=True)):
            rows.append(
                {
                    "model": name,
                    "layer": layer,
                    "tired: it→animal": t["animal"],
                    "tired: it→street": t["street"],
                    "wide: it→animal": w["animal"],
                    "wide: it→street": w["street"],
                    "best head animal (tired)": t["animal best head"],
                    "best head street (wide)": w["street best head"],
                }
            )
        both = [t["animal"] / t["street"] >= 1 and w["street"] / w["animal"] >= 1
                for t, w in zip(tired, wide, strict=True)]  # fmt: skip
        best_tired = max(t["animal"] / t["street"] for t in tired)
        best_wide = max(w["street"] / w["animal"] for w in wide)
        checks.append(lab.at_least(f"{name}: best layer, tired, animal/street", best_tired, 1.0))
        checks.append(lab.at_least(f"{name}: best layer, wide, street/animal", best_wide, 1.0))
        checks.append(
            lab.at_least(f"{name}: layers where both sentences point right", sum(both), 1)
        )
    figure = _plot(data)
    notes = []
    for name, family in families.items():
        if family == "gpt":
            notes.append(
                f"{name} is causal: 'it' comes before 'tired'/'wide', so its attention row is the "
                "same in both sentences; a GPT can only resolve the reference at later tokens"
            )
    return lab.Result.from_checks(rows, checks, figure=figure, data={"weights": data}, notes=notes)


def _plot(data: dict):
    fig, axes = lab.new_figure(4.6 * len(data), 3.4, ncols=len(data))
    axes = axes if len(data) > 1 else [axes]
    for ax, (name, per_sentence) in zip(axes, data.items(), strict=True):
        for sentence, style in (("tired", "-"), ("wide", "--")):
            layers = range(len(per_sentence[sentence]))
            for noun in ("animal", "street"):
                ax.plot(layers, [layer[noun] for layer in per_sentence[sentence]], style,
                        marker="o", markersize=3, label=f"{sentence}: it→{noun}")  # fmt: skip
        ax.set(xlabel="layer", ylabel="weight (mean over heads)", title=name)
        ax.legend(fontsize=7)
    return fig
