"""`glassformer merge --model M --adapter DIR --out OUT`: fold a LoRA adapter (peft's format) into
its base model's weights, W + (alpha / r) B A, and write the result as a glassformer checkpoint
that from_pretrained loads and `glassformer convert OUT --to hf` turns into transformers'
format (seed 002: fine-tuning only nudges what is there)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from glassformer.cli.common import add_command


def merge_to_checkpoint(model_name: str, adapter: str, out: str | Path, overwrite: bool = False):
    """Write base + adapter, merged, to `out` (config.json, model.safetensors, the tokenizer)
    through files.write_folder: built beside `out` and swapped in whole, never into the base, the
    adapter or the run either lives in. Returns (out, merged module names)."""
    from glassformer.files import check_destination, write_folder
    from glassformer.interop.checkpoint import checkpoint_folders, save_model_files
    from glassformer.interop.peft import load_adapter
    from glassformer.interop.pretrained import from_pretrained, resolve
    from glassformer.nn.lora import merge_lora

    sources = [*checkpoint_folders(resolve(model_name)), *checkpoint_folders(adapter)]
    check_destination(out, sources)  # before the (slow) load
    model, tokenizer = from_pretrained(model_name)
    load_adapter(model, adapter)
    merged = merge_lora(model)
    details = {"written_by": "glassformer merge", "base": model_name, "adapter": str(adapter)}
    with write_folder(out, "model", sources, overwrite, format="glassformer", **details) as tmp:
        save_model_files(tmp, model.eval(), model.cfg, tokenizer)
    return Path(out), merged


def cmd_merge(args: argparse.Namespace) -> None:
    """fold a LoRA adapter into its base model and save the merged model

    Load --model (alias, Hugging Face folder, .gguf file or checkpoint) in float32, put the peft
    adapter of --adapter on it, fold W + (alpha / r) B A into each weight, and write a glassformer
    checkpoint to --out: `glassformer generate --model OUT` runs it, `glassformer convert OUT
    --to hf OUT-hf` writes it for transformers.
    """
    out, merged = merge_to_checkpoint(args.model, args.adapter, args.out, args.overwrite)
    print(f"merged the adapter into {len(merged)} linear layers of {args.model}; wrote {out}")
    print(f"for transformers: glassformer convert {out} --to hf {out}-hf", file=sys.stderr)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "merge", cmd_merge)
    p.add_argument(
        "--model",
        required=True,
        help="the base model the adapter was trained on: alias "
        "(smollm2), Hugging Face folder, .gguf file or checkpoint directory",
    )
    p.add_argument(
        "--adapter",
        required=True,
        metavar="DIR",
        help="the LoRA adapter folder (adapter_config.json + adapter_model.safetensors)",
    )
    p.add_argument("--out", required=True, help="folder to write the merged model into")
    p.add_argument(
        "--overwrite", action="store_true", help="replace --out if it already holds a model"
    )
