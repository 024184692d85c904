"""`glassformer calc params | kv-cache | flops | memory | cost`: the calculators of
glassformer/calc/ for a preset, a TOML run config or a loaded model, no training needed (seed 000
§2.1, §2.3, seed 002)."""

from __future__ import annotations

import argparse
import os
import sys

from torch import nn

from glassformer.calc import (
    AnyConfig,
    format_flops,
    format_kv_cache,
    format_parameter_table,
    preset_names,
    resolve_preset,
)
from glassformer.calc.memory_cost import (
    OPTIMIZERS,
    TRAIN_DTYPES,
    check_cost_inputs,
    format_cost,
    format_training_memory,
    measure_peaks,
)
from glassformer.cli.common import add_command_group, positive_int
from glassformer.cli.models import format_model_parameters


def _calc_source(args: argparse.Namespace) -> tuple[AnyConfig, str, nn.Module | None]:
    """(config, name, loaded model or None) from exactly one of --preset, --config, --model."""
    given = [flag for flag in ("preset", "config", "model") if getattr(args, flag)]
    if len(given) != 1:
        raise ValueError(
            f"give exactly one of --preset, --config or --model (got {len(given) or 'none'}): "
            f"presets are {', '.join(preset_names())}"
        )
    if args.preset:
        return resolve_preset(args.preset), args.preset, None
    if args.config:
        return _calc_run_config(args.config, args.vocab_size), args.config, None
    if args.model in preset_names() and not os.path.exists(args.model):
        return resolve_preset(args.model), args.model, None  # --model takes a preset name too
    from glassformer.interop.pretrained import from_pretrained

    model, _ = from_pretrained(args.model)
    return model.cfg, args.model, model


def _calc_run_config(path: str, vocab_size: int | None) -> AnyConfig:
    """A TOML run config's ModelConfig. Its vocabulary comes from the tokenizer the run trains:
    the corpus's characters (char) or data.bpe_vocab_size (bpe), unless --vocab-size says."""
    from glassformer.train.config import load_run_config

    run = load_run_config(path)
    if vocab_size is None and run.data.tokenizer == "bpe":
        vocab_size = run.data.bpe_vocab_size
    if vocab_size is None:
        from glassformer.train.tasks import build_tokenizer, load_documents

        vocab_size = build_tokenizer(run.data, load_documents(run.data)).vocab_size
    print(f"note: vocab_size {vocab_size} (from [data]; --vocab-size to change)", file=sys.stderr)
    return run.model_config(vocab_size)


def cmd_calc_params(args: argparse.Namespace) -> None:
    cfg, name, model = _calc_source(args)
    if model is None:
        print(format_parameter_table(cfg, name))
    else:
        print(format_model_parameters(model, name))  # the loaded weights themselves, counted


def cmd_calc_kv_cache(args: argparse.Namespace) -> None:
    cfg, name, _ = _calc_source(args)
    tokens = cfg.max_seq_len if args.tokens is None else args.tokens
    print(format_kv_cache(cfg, name, tokens, args.dtype, args.batch_size, args.window))


def cmd_calc_flops(args: argparse.Namespace) -> None:
    cfg, name, _ = _calc_source(args)
    print(format_flops(cfg, name, args.context or cfg.max_seq_len))


def cmd_calc_memory(args: argparse.Namespace) -> None:
    cfg, name, _ = _calc_source(args)
    print(
        format_training_memory(
            cfg, name, args.batch, args.seq_len, args.dtype, args.optimizer, args.checkpointing
        )
    )


def cmd_calc_cost(args: argparse.Namespace) -> None:
    check_cost_inputs(args.prompt_tokens, args.new_tokens, args.batch, args.dtype)
    cfg, name, _ = _calc_source(args)
    gflops, gbps = args.peak_gflops, args.peak_gbps
    if gflops is None or gbps is None:
        measured = measure_peaks(1.0, args.dtype)
        gflops, gbps = gflops or measured[0], gbps or measured[1]
    print(
        format_cost(
            cfg, name, args.prompt_tokens, args.new_tokens, args.batch, gflops, gbps, args.dtype
        )
    )


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return value


def _add_memory_flags(q: argparse.ArgumentParser) -> None:
    # Counts and names are checked by the calculators: a bad one is one line naming the fix.
    q.add_argument("--batch", type=int, required=True, help="sequences per step (B)")
    q.add_argument("--seq-len", type=int, required=True, help="tokens per sequence (T)")
    q.add_argument(
        "--dtype",
        default="fp32",
        help=f"{' or '.join(TRAIN_DTYPES)}: fp32 (default) or bf16 autocast (weights, grads, "
        "optimizer stay fp32)",
    )
    q.add_argument("--optimizer", default="adamw", help=f"{', '.join(OPTIMIZERS)} (adamw)")
    q.add_argument(
        "--checkpointing", action="store_true", help="activation checkpointing, one per layer"
    )


def _add_cost_flags(q: argparse.ArgumentParser) -> None:
    q.add_argument("--prompt-tokens", type=int, required=True, help="prompt length (P)")
    q.add_argument("--new-tokens", type=int, required=True, help="tokens generated (N)")
    q.add_argument("--batch", type=int, default=1, help="sequences decoded together (1)")
    q.add_argument(
        "--dtype", default="bf16", help=f"weights and KV cache: {', '.join(TRAIN_DTYPES)} (bf16)"
    )
    q.add_argument("--peak-gflops", type=positive_float, help="matmul GFLOP/s (default: measure)")
    q.add_argument("--peak-gbps", type=positive_float, help="memory read GB/s (default: measure)")


GROUP_HELP = """parameters, KV-cache bytes and FLOPs of a preset, run config or checkpoint

Calculators from a config, no weights needed (seed 000 §2.1, seed 002): params (the parameter
table, MoE total vs active), kv-cache (bytes per token and in all; what GQA/MQA and a sliding
window change), flops (per token: matmuls and the attention part that grows with the context;
training = 3 x forward), memory (training bytes: parameters, gradients, optimizer state,
activations, with and without checkpointing; seed 000 §2.3), cost (prefill + decode FLOPs,
bytes per decode step and seconds at this machine's measured peaks).
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    calc = add_command_group(sub, "calc", GROUP_HELP, dest="calc_command")
    commands = {
        "params": ("the parameter table by component, per layer and in all", cmd_calc_params),
        "kv-cache": ("KV-cache bytes per token and for --tokens tokens", cmd_calc_kv_cache),
        "flops": ("forward and training FLOPs per token at --context", cmd_calc_flops),
        "memory": ("training memory at --batch x --seq-len, term by term", cmd_calc_memory),
        "cost": ("prefill + decode FLOPs, bytes and seconds on this machine", cmd_calc_cost),
    }
    for what, (text, func) in commands.items():
        q = calc.add_parser(what, help=text, description=text)
        q.add_argument("--preset", help="e.g. llama-7b, gpt3-175b, mixtral-8x7b, deepseek-v3")
        q.add_argument("--config", help="a TOML run config, e.g. configs/shakespeare-char.toml")
        q.add_argument(
            "--model", help="checkpoint directory, alias (smollm2), HF folder, .gguf or a preset"
        )
        q.add_argument(
            "--vocab-size", type=positive_int, help="--config: the tokenizer's vocabulary size"
        )
        if what == "kv-cache":
            q.add_argument(
                "--tokens", type=int, help="cached positions (default: the model's context)"
            )
            q.add_argument("--dtype", default="fp16", help="fp32, bf16, fp16 (default), fp8, int8")
            q.add_argument("--batch-size", type=positive_int, default=1, help="sequences (1)")
            q.add_argument(
                "--window",
                type=positive_int,
                default=4096,
                help="the sliding window of the extra row shown when --tokens exceeds it (4096)",
            )
        if what == "memory":
            _add_memory_flags(q)
        if what == "cost":
            _add_cost_flags(q)
        if what == "flops":
            q.add_argument(
                "--context", type=positive_int, help="context length (default: the model's)"
            )
        q.set_defaults(func=func)
