"""Does fine-tuning work? "Modernise this First Folio speech" on a play held out whole
(Macbeth), scored by chrF and BLEU (sacrebleu) against the modern edition, for every way
glassformer has of doing the task (issue 16's table):

    copy the input                 the Folio text itself: what spelling changes are worth
    SmolLM2 zero-shot              SmolLM2-135M-Instruct asked with the instruction alone
    SmolLM2 few-shot               5 solved training speeches as earlier turns (seed 000 §6.2)
    SmolLM2 + LoRA q,v r=8         configs/smollm2-lora-folio.toml as it stands
    SmolLM2 + LoRA all linear      the same, adapters on q,k,v,o,gate,up,down
    SmolLM2 + LoRA, int8 base      the same as q,v, the frozen base in int8 (QLoRA's idea)
    SmolLM2 full fine-tune         every weight, learning rate 5e-5 (1e-3 wrecks a full tune)
    folio2modern                   the 0.96M encoder-decoder of configs/folio2modern.toml,
                                   trained from scratch here; longer speeches cut into pieces
                                   of its 48 training characters (translate(max_chars=48))

Every fine-tune is the LoRA config's run (100 steps of 8 conversations, 2,000 random training
speeches of at most 120 characters, Twelfth Night for validation) with one thing changed.
The runs are trained here, each timed from start to the last checkpoint (model load and data
building included), in out/folio-table/<system>; a run folder that already holds a finished
run with its time (table.json) is reused unless --retrain. All chat systems decode greedily
until the end of the assistant's turn (at most 96 tokens), 16 conversations at a time, the
fine-tuned adapters merged into the weights (what `glassformer generate --adapter` runs).

    python benchmarks/finetune_quality.py                       # trains what is missing (~1 h)
    python benchmarks/finetune_quality.py --limit 20 --systems copy,zero-shot   # smoke run

It prints one markdown table (docs/finetune.md's) and writes every system's outputs and scores to
out/folio-table/results.json; --json PATH also writes the table's rows with the command, date and
machine (benchmarks/record.py), for benchmarks/render.py (benchmarks/results/finetune_quality.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import record  # benchmarks/record.py

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent
LORA_CONFIG = REPO / "configs" / "smollm2-lora-folio.toml"
SEQ2SEQ_CONFIG = REPO / "configs" / "folio2modern.toml"


@dataclass(frozen=True)
class System:
    key: str
    name: str
    kind: str  # copy | chat | finetune | seq2seq
    shots: int = 0
    changes: dict[str, dict] = field(default_factory=dict)  # [finetune]/[train] overrides


SYSTEMS = [
    System("copy", "copy the input", "copy"),
    System("zero-shot", "SmolLM2 zero-shot", "chat"),
    System("few-shot", "SmolLM2 few-shot (5 examples in the prompt)", "chat", shots=5),
    System("lora-qv", "SmolLM2 + LoRA on q,v (r = 8)", "finetune"),
    System(
        "lora-all",
        "SmolLM2 + LoRA on all linear layers (r = 8)",
        "finetune",
        changes={"finetune": {"lora_targets": "all-linear"}},
    ),
    System(
        "lora-int8",
        "SmolLM2 + LoRA on q,v (r = 8), int8 base",
        "finetune",
        changes={"finetune": {"quantize": "int8"}},
    ),
    System(
        "full",
        "SmolLM2 full fine-tune",
        "finetune",
        changes={"finetune": {"method": "full"}, "train": {"learning_rate": 5e-5, "min_lr": 5e-6}},
    ),
    System("folio2modern", "folio2modern: 0.96M encoder-decoder from scratch", "seq2seq"),
]


def train_system(system: System, run_dir: Path, retrain: bool) -> dict:
    """Train the system's run into run_dir (unless a finished one is there): its trainable
    parameter count and wall seconds."""
    record_path = run_dir / "table.json"
    if record_path.exists() and not retrain:
        return json.loads(record_path.read_text())
    t0 = time.perf_counter()
    if system.kind == "finetune":
        from glassformer.train.config import load_finetune_config
        from glassformer.train.finetune import FinetuneTrainer

        values = {"train": {"out_dir": str(run_dir)}}
        for section, table in system.changes.items():
            values.setdefault(section, {}).update(table)
        trainer = FinetuneTrainer(
            load_finetune_config(LORA_CONFIG, [], values), progress=False, overwrite=True
        )
        result = trainer.fit()
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        fraction = trainer.trainable_fraction
    else:
        from glassformer.train.config import load_run_config
        from glassformer.train.trainer import Trainer

        run = load_run_config(SEQ2SEQ_CONFIG, [f"train.out_dir={run_dir}"])
        trainer = Trainer(run, progress=False, overwrite=True)
        result = trainer.fit()
        trainable, fraction = sum(p.numel() for p in trainer.model.parameters()), 1.0
    record = {
        "seconds": round(time.perf_counter() - t0, 1),
        "trainable": trainable,
        "fraction": fraction,
        "steps": result.steps,
        "val_loss": result.val_loss,
        "baseline_loss": result.baseline_loss,
    }
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def outputs_of(system: System, run_dir: Path, folios: list[str]) -> list[str]:
    from glassformer.train.folio_eval import modernise, shot_messages

    if system.kind == "copy":
        return list(folios)
    if system.kind == "seq2seq":
        from glassformer.train.translation import load_translator, translate

        model, tokenizer, data = load_translator(str(run_dir))
        return translate(model, tokenizer, folios, max_chars=data.max_pair_chars)
    from glassformer.cli.common import load_with_tokenizer
    from glassformer.infer.optimize import optimize_for_decode

    adapter, quantize, model_name = None, None, "smollm2"
    if system.kind == "finetune":
        ft = system.changes.get("finetune", {})
        if ft.get("method") == "full":
            model_name = str(run_dir)
        else:
            adapter, quantize = str(run_dir), ft.get("quantize")
    model, tokenizer = load_with_tokenizer(model_name, "the table needs text", quantize, adapter)
    if quantize is None:
        model = optimize_for_decode(model)
    return modernise(model, tokenizer, folios, shot_messages(system.shots))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=200, help="held-out speeches scored")
    parser.add_argument(
        "--systems", default=",".join(s.key for s in SYSTEMS), help="comma-separated keys"
    )
    parser.add_argument("--out", default="out/folio-table", help="folder for runs and results")
    parser.add_argument("--retrain", action="store_true", help="train even if a run is there")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the table's rows here")
    args = parser.parse_args()

    import torch

    from glassformer.train.folio_eval import held_out_speeches, score_outputs

    torch.set_num_threads(args.threads)
    keys = args.systems.split(",")
    unknown = sorted(set(keys) - {s.key for s in SYSTEMS})
    if unknown:
        sys.exit(f"--systems: {unknown} unknown; pick from {[s.key for s in SYSTEMS]}")
    out = Path(args.out)
    pairs = held_out_speeches(args.limit)
    folios = [p.folio for p in pairs]
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    for system in (s for s in SYSTEMS if s.key in keys):
        run_dir = out / system.key
        trained = {"seconds": 0.0, "trainable": 0}
        if system.kind in ("finetune", "seq2seq"):
            print(f"[{system.key}] training in {run_dir} ...", flush=True)
            trained = train_system(system, run_dir, args.retrain)
        t0 = time.perf_counter()
        scores = score_outputs(outputs_of(system, run_dir, folios), pairs)
        results[system.key] = {
            "name": system.name,
            **trained,
            "chrf": scores.chrf,
            "bleu": scores.bleu,
            "n_speeches": len(pairs),
            "eval_seconds": round(time.perf_counter() - t0, 1),
            "examples": [
                {"folio": p.folio, "modern": p.modern, "output": o}
                for p, o in zip(pairs, scores.outputs, strict=True)
            ],
        }
        print(
            f"[{system.key}] chrF {scores.chrf:.2f} BLEU {scores.bleu:.2f}"
            f" ({results[system.key]['eval_seconds']} s to decode and score)",
            flush=True,
        )
        out.mkdir(parents=True, exist_ok=True)
        results_path.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    print_table(results, keys, len(pairs))
    if args.json:
        shown = [s for s in SYSTEMS if s.key in keys and s.key in results]
        rows = [table_row(system, results[system.key]) for system in shown]
        record.write(args.json, args.threads, {"n_speeches": len(pairs), "rows": rows})


def table_row(system: System, result: dict) -> dict:
    """What the table shows of one system, unrounded."""
    fraction = result["fraction"] if system.kind == "finetune" else None
    return {
        "key": system.key,
        "name": result["name"],
        "trainable": result["trainable"],
        "fraction": fraction,
        "train_minutes": result["seconds"] / 60,
        "chrf": result["chrf"],
        "bleu": result["bleu"],
    }


def print_table(results: dict, keys: list[str], n: int) -> None:
    print(f"\n{n} held-out Macbeth speeches (at most 120 characters), greedy, sacrebleu\n")
    print("| system | trainable params | train time here | chrF | BLEU |")
    print("|---|---:|---:|---:|---:|")
    for system in SYSTEMS:
        if system.key not in keys or system.key not in results:
            continue
        r = results[system.key]
        params = f"{r['trainable']:,}" if r["trainable"] else "0"
        if system.kind == "finetune":
            params += f" ({r['fraction']:.2%})"
        seconds = r["seconds"]
        time_text = f"{seconds / 60:.1f} min" if seconds else "0"
        print(f"| {r['name']} | {params} | {time_text} | {r['chrf']:.2f} | {r['bleu']:.2f} |")


if __name__ == "__main__":
    main()
