"""`glassformer merge --model M --adapter DIR --out OUT`: fold a LoRA adapter (peft's format) into
its base model's weights, W + (alpha / r) B A, and write the result as a glassformer checkpoint
that from_pretrained loads and `glassformer convert OUT --to hf` turns into transformers'
format (seed 002: fine-tuning only nudges what is there)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from glassformer.cli.common import add_command


def merge_to_checkpoint(model_name: str, adapter: str, out: str | Path, overwrite: bool = False):
    """Write base + adapter, merged, to `out` (config.json, model.safetensors, the tokenizer),
    all at once: the files are written to a hidden folder beside `out` and renamed into place.
    Returns (out, merged module names)."""
    from glassformer.files import fsync_dir, fsync_tree
    from glassformer.interop.checkpoint import save_model_files
    from glassformer.interop.convert import check_out_dir
    from glassformer.interop.peft import load_adapter
    from glassformer.interop.pretrained import from_pretrained, resolve
    from glassformer.nn.lora import merge_lora

    out = Path(out)
    check_out_dir(resolve(model_name), out, overwrite)
    _check_replaceable(out, Path(adapter))
    model, tokenizer = from_pretrained(model_name)
    load_adapter(model, adapter)
    merged = merge_lora(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700 folders; models are shared
        save_model_files(tmp, model.eval(), model.cfg, tokenizer)
        fsync_tree(tmp)
        if out.exists():  # --overwrite: the old folder goes only once the new one is complete
            shutil.rmtree(out)
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, merged


def _check_replaceable(out: Path, adapter: Path) -> None:
    """--out may be new, empty, or (with --overwrite, which check_out_dir has required) a
    folder that holds a model; never the adapter's folder nor a folder of other files, which
    the rename into place would delete."""
    from glassformer.interop.convert import MODEL_FILES

    if adapter.exists() and out.exists() and out.resolve() == adapter.resolve():
        raise ValueError(f"--out {out} is the adapter's folder: write the merged model elsewhere")
    holds_model = any((out / name).exists() for name in MODEL_FILES)
    if out.is_dir() and any(out.iterdir()) and not holds_model:
        raise ValueError(
            f"--out {out} holds files that are not a model: give a new or empty folder"
        )


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
        "--model", required=True, help="the base model the adapter was trained on: alias "
        "(smollm2), Hugging Face folder, .gguf file or checkpoint directory",
    )  # fmt: skip
    p.add_argument(
        "--adapter", required=True, metavar="DIR",
        help="the LoRA adapter folder (adapter_config.json + adapter_model.safetensors)",
    )  # fmt: skip
    p.add_argument("--out", required=True, help="folder to write the merged model into")
    p.add_argument(
        "--overwrite", action="store_true", help="replace --out if it already holds a model"
    )
