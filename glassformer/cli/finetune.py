"""`glassformer finetune`: adapt a pretrained model (SmolLM2, any Hugging Face folder, GGUF file
or glassformer run) to chat or text data with LoRA or full fine-tuning (train/finetune.py), and
`glassformer finetune-data folio`: the built-in Folio -> modern chat task as JSONL files."""

from __future__ import annotations

import argparse
from typing import Any

from glassformer.cli.common import add_command, positive_int, seed
from glassformer.devices import DEVICES

# flag dest -> (section, key) of the run config: a flag given on the command line wins over the
# config file and --set.
_FLAG_KEYS = {
    "model": ("finetune", "model"),
    "data": ("finetune", "data"),
    "val_data": ("finetune", "val_data"),
    "method": ("finetune", "method"),
    "lora_rank": ("finetune", "lora_rank"),
    "lora_alpha": ("finetune", "lora_alpha"),
    "lora_dropout": ("finetune", "lora_dropout"),
    "lora_targets": ("finetune", "lora_targets"),
    "quantize": ("finetune", "quantize"),
    "max_seq_len": ("finetune", "max_seq_len"),
    "pack": ("finetune", "packing"),
    "out": ("train", "out_dir"),
    "steps": ("train", "max_steps"),
    "lr": ("train", "learning_rate"),
    "min_lr": ("train", "min_lr"),
    "warmup": ("train", "warmup_steps"),
    "batch_size": ("train", "batch_size"),
    "grad_accum": ("train", "grad_accum_steps"),
    "grad_clip": ("train", "grad_clip"),
    "dtype": ("train", "dtype"),
    "eval_interval": ("train", "eval_interval"),
    "checkpoint_interval": ("train", "checkpoint_interval"),
    "seed": ("train", "seed"),
    "threads": ("train", "threads"),
    "device": ("train", "device"),
}


def flag_values(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The run-config values the flags set, by section (flags left out set nothing)."""
    values: dict[str, dict[str, Any]] = {}
    for dest, (section, key) in _FLAG_KEYS.items():
        value = getattr(args, dest, None)
        if value is not None and value is not False:
            values.setdefault(section, {})[key] = value
    return values


def cmd_finetune(args: argparse.Namespace) -> None:
    """fine-tune a pretrained model on chat or text data (LoRA or full)

    Fine-tune --model on --data, a JSONL file with one {"messages": [...]} conversation
    (learns the assistant turns, rendered with the model's chat template) or {"text": ...}
    (learns every token) per line, or "folio" for the built-in First Folio -> modern task.
    --method lora trains small adapters and writes them in peft's format to --out; --method
    full trains every weight and writes glassformer checkpoints. The trainer is train's:
    warmup + cosine schedule, clipping, accumulation, bf16, atomic checkpoints, --resume.
    """
    from glassformer.train.config import load_finetune_config
    from glassformer.train.distributed import quiet_unless_main
    from glassformer.train.finetune import FinetuneTrainer
    from glassformer.train.signals import StopRequests

    quiet_unless_main()  # under torchrun (train.strategy=ddp): one log, from rank 0
    run = load_finetune_config(args.config, list(args.set or []), flag_values(args))
    with StopRequests():  # Ctrl-C / SIGTERM: stop, keeping the checkpoints and freeing the lock
        trainer = FinetuneTrainer(
            run, resume=args.resume, progress=not args.no_progress, overwrite=args.overwrite
        )
        try:
            result = trainer.fit()
        finally:
            trainer.close()
            trainer.parallel.close()
    ft = run.finetune
    where = (
        f"adapter (peft format) in {result.out_dir}"
        if ft.method == "lora"
        else f"model in {result.out_dir} (from_pretrained loads it)"
    )
    print(
        f"done: {result.steps} steps | val loss {result.val_loss:.4f} nats/token vs"
        f" {result.baseline_loss:.4f} {result.baseline_name} | trained"
        f" {trainer.trainable_fraction:.2%} of the parameters | {where}"
    )


def cmd_finetune_data(args: argparse.Namespace) -> None:
    """write a built-in fine-tuning task as chat JSONL

    folio: "modernise this First Folio speech" instructions from the installed plays, whole
    plays held out as in configs/folio2modern.toml: train.jsonl, validation.jsonl (Twelfth
    Night) and test.jsonl (Macbeth) in --out.
    """
    from glassformer.train.finetune import write_folio_jsonl

    written = write_folio_jsonl(args.out, max_chars=args.max_chars)
    for split, path in written.items():
        n = sum(1 for _ in path.open(encoding="utf-8"))
        print(f"{split}: {n:,} conversations -> {path}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "finetune", cmd_finetune)
    p.add_argument(
        "--config", help="TOML with [finetune] and [train], e.g. configs/smollm2-lora-folio.toml"
    )
    p.add_argument("--model", help="alias (smollm2), Hugging Face folder, .gguf file or run")
    p.add_argument("--data", help='training JSONL ({"messages": [...]} or {"text": ...}), or folio')
    p.add_argument("--val-data", help="validation JSONL (default: the last 5%% of --data)")
    p.add_argument("--method", choices=("lora", "full"), help="lora (default) or full")
    p.add_argument("--lora-rank", type=positive_int, help="adapter rank r (default 8)")
    p.add_argument("--lora-alpha", type=float, help="adapter scale alpha; updates x alpha/r (16)")
    p.add_argument("--lora-dropout", type=float, help="dropout on the adapters' input (0.05)")
    p.add_argument(
        "--lora-targets",
        help="q,v (default), all-linear, or module names such as q,k,v,o,gate,up,down",
    )
    p.add_argument("--quantize", choices=("int8",), help="int8: freeze the base in int8 (LoRA)")
    p.add_argument("--max-seq-len", type=positive_int, help="longest example in tokens (512)")
    p.add_argument(
        "--pack", action="store_true", help="pack several examples per row (document masks)"
    )
    p.add_argument("--out", help="run folder for checkpoints and the adapter (train.out_dir)")
    p.add_argument("--steps", type=positive_int, help="optimizer steps (train.max_steps)")
    p.add_argument("--lr", type=float, help="peak learning rate (train.learning_rate)")
    p.add_argument("--min-lr", type=float, help="learning rate at the end of the cosine")
    p.add_argument("--warmup", type=int, help="warmup steps (train.warmup_steps)")
    p.add_argument("--batch-size", type=positive_int, help="examples per micro-batch")
    p.add_argument("--grad-accum", type=positive_int, help="micro-batches per optimizer step")
    p.add_argument("--grad-clip", type=float, help="clip the gradient norm to this (0: off)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="autocast precision")
    p.add_argument("--eval-interval", type=positive_int, help="evaluate every N steps")
    p.add_argument("--checkpoint-interval", type=positive_int, help="save every N steps")
    p.add_argument("--seed", type=seed, help="seed for batches, adapters and dropout")
    p.add_argument("--threads", type=positive_int, help="torch threads")
    p.add_argument("--device", choices=DEVICES, help="auto, cpu, cuda or mps")
    p.add_argument(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="override a config value, e.g. --set train.weight_decay=0 (repeatable)",
    )
    p.add_argument("--resume", action="store_true", help="continue the run in --out exactly")
    p.add_argument(
        "--overwrite", action="store_true", help="start over in an --out that holds a run"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")

    p = add_command(sub, "finetune-data", cmd_finetune_data)
    p.add_argument("task", choices=("folio",), help="the built-in task to write")
    p.add_argument("--out", default="out/folio-chat", help="folder for the JSONL files")
    p.add_argument(
        "--max-chars", type=positive_int, default=120, help="longest speech in characters"
    )
