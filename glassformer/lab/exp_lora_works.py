"""Seed 002: "LoRA 敢只训 1% 参数，赌的就是'底子不用动'": fine-tuning a pretrained model with
low-rank adapters on about 1% of its parameters works, because the base need not move.

Measured on a real task with real weights: SmolLM2-135M-Instruct taught to modernise First
Folio speeches (train/finetune.py's folio task: whole plays held out, Macbeth for the test),
fine-tuned three ways with the same data, batches and steps (full mode: the run of
configs/smollm2-lora-folio.toml, 100 steps of 8 conversations, over 3 seeds; quick mode: the
two ends, LoRA on q,v and every weight, 40 steps, one seed):

    LoRA on q,v (r = 8)         ~0.3% of the parameters train
    LoRA on all linear (r = 8)  ~1.8%
    full fine-tune              100% (learning rate 5e-5: LoRA's 1e-3 wrecks a full tune)

Quality is chrF (sacrebleu) of greedy modernisations of held-out Macbeth speeches against the
modern edition, beside the untrained model (zero-shot) and copying the Folio text unchanged
(the bar a model must clear to have learned any spelling change). Each fine-tune is repeated
over seeds (batch order, adapter initialisation, dropout). docs/finetune.md's table
(benchmarks/finetune_quality.py) is the full-length run of the same comparison, with few-shot
prompting, the int8 base and the from-scratch encoder-decoder beside it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from glassformer.lab import base as lab

SYSTEMS = {  # key -> (label, [finetune] changes, learning rate)
    "lora-qv": ("LoRA q,v r=8", {"method": "lora", "lora_targets": "q,v"}, 1e-3),
    "lora-all": ("LoRA all linear r=8", {"method": "lora", "lora_targets": "all-linear"}, 1e-3),
    "full": ("full fine-tune", {"method": "full"}, 5e-5),
}
# Thresholds, stated once. "It works": LoRA's modernisations beat copying the Folio text (any
# margin beyond the seeds' spread: the model learned spelling changes, not only to echo), and
# fall short of the full fine-tune by at most MAX_SHORTFALL chrF points (about the gap between
# two adjacent rows of a translation leaderboard).
MAX_SHORTFALL = 2.0


def _config(base: str, key: str, steps: int, batch: int, seed: int, out: Path) -> dict:
    _, changes, lr = SYSTEMS[key]
    finetune = {"model": base, "data": "folio", "folio_max_chars": 120, "max_seq_len": 192,
                "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.05, **changes}  # fmt: skip
    train = {"out_dir": str(out), "max_steps": steps, "batch_size": batch,
             "learning_rate": lr, "min_lr": lr / 10, "warmup_steps": max(1, steps // 25),
             "weight_decay": 0.0, "eval_interval": steps, "eval_batches": 2,
             "checkpoint_interval": steps, "seed": seed}  # fmt: skip
    return {"finetune": finetune, "train": train}


def _decode_ready(model: torch.nn.Module) -> torch.nn.Module:
    from glassformer.infer.optimize import optimize_for_decode
    from glassformer.nn.lora import merge_lora

    merge_lora(model)
    return optimize_for_decode(model.eval())


def _fine_tune(base: str, key: str, steps: int, batch: int, seed: int, folios, pairs) -> dict:
    """Train one system, then score its modernisations: chrF, BLEU, held-out loss, fraction."""
    from glassformer.train.config import FinetuneRunConfig
    from glassformer.train.finetune import FinetuneTrainer
    from glassformer.train.folio_eval import modernise, score_outputs

    with tempfile.TemporaryDirectory(prefix="lab-lora-") as tmp:
        run = FinetuneRunConfig.from_dict(_config(base, key, steps, batch, seed, Path(tmp)))
        trainer = FinetuneTrainer(run, progress=False, overwrite=True)
        result = trainer.fit()
    fraction = trainer.trainable_fraction
    model = _decode_ready(trainer.model)
    scores = score_outputs(modernise(model, trainer.tokenizer, folios), pairs)
    return {"chrf": scores.chrf, "bleu": scores.bleu, "fraction": fraction,
            "val_loss": result.val_loss, "base_val_loss": result.baseline_loss,
            "example": scores.outputs[0]}  # fmt: skip


@lab.register("lora-works")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    from glassformer.interop.pretrained import from_pretrained
    from glassformer.train.folio_eval import held_out_speeches, modernise, score_outputs

    steps, batch = ctx.pick(100, 40, 2), ctx.pick(8, 8, 2)
    n_speeches = ctx.pick(200, 48, 3)
    # Quick mode compares the two ends, LoRA on q,v and every weight, for the 40 steps that
    # about 11 minutes afford here (at 20 steps LoRA's chrF was 70.2, copying's 71.9); full mode
    # adds LoRA on all linear layers.
    systems = ctx.pick(list(SYSTEMS), ["lora-qv", "full"], list(SYSTEMS))
    seeds = ctx.seeds(quick=1)
    with tempfile.TemporaryDirectory(prefix="lab-lora-base-") as tmp:
        base, name = _base(ctx, Path(tmp))
        pairs = held_out_speeches(n_speeches)
        folios = [p.folio for p in pairs]
        copy = score_outputs(folios, pairs)
        model, tokenizer = from_pretrained(base)
        zero = score_outputs(modernise(_decode_ready(model), tokenizer, folios), pairs)
        runs = {key: [_fine_tune(base, key, steps, batch, s, folios, pairs) for s in seeds]
                for key in systems}  # fmt: skip
    chrf = {key: lab.over_seeds([r["chrf"] for r in runs[key]]) for key in systems}
    copy_chrf = lab.over_seeds([copy.chrf])  # one value: copying has no seed
    rows = [
        {"system": "copy the input", "trainable share": "0", "chrF": f"{copy.chrf:.2f}",
         "BLEU": f"{copy.bleu:.2f}", "held-out loss": ""},
        {"system": f"{name} zero-shot", "trainable share": "0", "chrF": f"{zero.chrf:.2f}",
         "BLEU": f"{zero.bleu:.2f}", "held-out loss": f"{runs['full'][0]['base_val_loss']:.3f}"},
    ]  # fmt: skip
    for key in systems:
        label = SYSTEMS[key][0]
        bleu = lab.over_seeds([r["bleu"] for r in runs[key]])
        loss = lab.over_seeds([r["val_loss"] for r in runs[key]])
        share = f"{runs[key][0]['fraction']:.2%}"
        rows.append({"system": f"{name} + {label}", "trainable share": share,
                     "chrF": str(chrf[key]), "BLEU": str(bleu),
                     "held-out loss": str(loss)})  # fmt: skip
    full_loss = lab.over_seeds([r["val_loss"] for r in runs["full"]])
    checks = [
        lab.precondition(lab.at_most("full fine-tune: held-out loss after - before (nats)",
                                     full_loss.mean - runs["full"][0]["base_val_loss"], 0)),
    ]  # fmt: skip
    for key in (k for k in systems if k != "full"):
        label, share = SYSTEMS[key][0], f"{runs[key][0]['fraction']:.1%}"
        group = f"{label} ({share} of the parameters) works"
        checks += [
            lab.exceeds_spread(f"{label}: chrF - copying the input", chrf[key], copy_chrf,
                               group=group),
            lab.at_least(f"{label}: chrF - full fine-tune's", chrf[key].mean - chrf["full"].mean,
                         -MAX_SHORTFALL, group=group),
        ]  # fmt: skip
    notes = [
        f"model: {name}; {steps} steps of {batch} conversations per fine-tune, {len(seeds)}"
        f" seed(s); {len(pairs)} held-out Macbeth speeches scored, greedy, sacrebleu chrF",
        f"first speech: {folios[0]!r}; modern edition: {pairs[0].modern!r}; zero-shot:"
        f" {zero.outputs[0][:160]!r}; LoRA q,v: {runs['lora-qv'][0]['example'][:160]!r}",
    ]
    if ctx.tiny:
        notes.append("tiny mode: a random 2-layer Llama with SmolLM2's tokenizer stands in")
    data = {"runs": runs, "copy": [copy.chrf, copy.bleu], "zero_shot": [zero.chrf, zero.bleu],
            "seeds": seeds, "steps": steps, "batch": batch, "n_speeches": len(pairs)}  # fmt: skip
    figure = _plot(runs, chrf, copy.chrf, zero.chrf, name)
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _base(ctx: lab.RunContext, tmp: Path) -> tuple[str, str]:
    """(what from_pretrained loads, its name): SmolLM2, or in tiny mode a random small Llama
    folder with SmolLM2's tokenizer and chat template."""
    if not ctx.tiny:
        return "smollm2", "SmolLM2-135M-Instruct"
    from glassformer.config import ModelConfig
    from glassformer.interop.hf import save_hf_model
    from glassformer.interop.pretrained import from_pretrained
    from glassformer.models import build_model

    _, tokenizer = from_pretrained("smollm2")
    torch.manual_seed(ctx.seed)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=16, n_layers=2, n_heads=2,
                      n_kv_heads=1, max_seq_len=256, position="rope", norm="rms",
                      ffn="swiglu", d_ff=32, bias=False, tie_embeddings=True)  # fmt: skip
    save_hf_model(build_model(cfg), tmp, model_type="llama")
    tokenizer.save(tmp)
    return str(tmp), "tiny random Llama"


def _plot(runs: dict, chrf: dict[str, lab.Spread], copy: float, zero: float, name: str):
    fig, ax = lab.new_figure(6.0, 3.6)
    for key in runs:
        label = SYSTEMS[key][0]
        share = 100 * runs[key][0]["fraction"]
        ax.errorbar([share], [chrf[key].mean], yerr=[chrf[key].spread], marker="o", capsize=3,
                    label=f"{label} ({share:.3g}%)")  # fmt: skip
    ax.axhline(copy, color="grey", linestyle="--", label=f"copy the input ({copy:.1f})")
    ax.axhline(zero, color="black", linestyle=":", label=f"zero-shot ({zero:.1f})")
    ax.set_xscale("log")
    ax.set(xlabel="parameters trained (%, log scale)", ylabel="chrF on held-out Macbeth",
           title=f"fine-tuning {name}: quality vs trainable share")  # fmt: skip
    ax.legend(fontsize=8)
    return fig
