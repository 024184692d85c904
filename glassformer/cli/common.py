"""What several commands share: registering a command with its help, argument types, the
sampling and device flags, threads, and loading a model with its tokenizer, ready to decode on
the chosen device."""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from glassformer.cli.precision import KV_DTYPES, DecodeOptions, resolve_precision
from glassformer.devices import DEVICES, resolve_device

if TYPE_CHECKING:
    from glassformer.infer.engine import Engine
    from glassformer.tokenizers import Tokenizer


# --- commands ---------------------------------------------------------------------------------

Handler = Callable[[argparse.Namespace], None]


def add_command(
    sub: argparse._SubParsersAction, name: str, handler: Handler
) -> argparse.ArgumentParser:
    """Register the command NAME, which runs handler(args). The handler's docstring is its help,
    so the words a user reads stand beside the code they describe (see _help_and_description;
    `python -OO` strips docstrings, and with them the help, as with click or typer)."""
    p = sub.add_parser(name, **_help_and_description(handler.__doc__ or ""))
    p.set_defaults(func=handler)
    return p


def add_command_group(
    sub: argparse._SubParsersAction, name: str, about: str, dest: str
) -> argparse._SubParsersAction:
    """Register NAME as a group of commands (`NAME WHAT`, WHAT required, stored as args.DEST),
    described by `about` as a command is by its handler's docstring; add the group's commands
    to what this returns."""
    p = sub.add_parser(name, **_help_and_description(about))
    return p.add_subparsers(dest=dest, required=True, metavar="WHAT")


def _help_and_description(text: str) -> dict[str, str | None]:
    """The first paragraph is the help: NAME's line in the parent's --help. The rest is the
    description that `NAME --help` opens with (none if there is no rest)."""
    summary, *rest = re.split(r"\n\s*\n", text.strip(), maxsplit=1)
    return {
        "help": " ".join(summary.split()),
        "description": " ".join(rest[0].split()) if rest else None,
    }


# --- argument types ---------------------------------------------------------------------------


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def positive_int(text: str) -> int:
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def non_negative_int(text: str) -> int:
    value = _whole_number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def non_negative_seconds(text: str) -> float:
    """A duration in seconds, e.g. 600 or 0.5; 0 and above."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds, e.g. 600") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be a finite number of seconds >= 0")
    return value


def logit_bias_entries(text: str) -> list[tuple[int, float]]:
    """--logit-bias ID=BIAS[,ID=BIAS...]: (token id, bias) pairs; SamplingParams checks the
    ranges and the whole set."""
    pairs = []
    for entry in text.split(","):
        token, _, bias = entry.partition("=")
        try:
            pairs.append((int(token), float(bias)))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{entry.strip()!r} is not ID=BIAS: give a token id and a bias, e.g. 50256=-100"
            ) from None
    return pairs


def seed(text: str) -> int:
    """A seed as torch takes it: a whole number in 0..2**64-1."""
    value = _whole_number(text)
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"{value} must be in 0..2**64-1")
    return value


def tcp_port(text: str) -> int:
    """A TCP port to listen on, 1..65535. Port 0 (the system picks a free one) is refused too:
    the address serve prints, and its clients, would not know which port it got."""
    value = _whole_number(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port: give one in 1..65535, e.g. 8000")
    return value


MAX_THREADS = 1024  # more than any CPU has cores; 100,000 crashed torch (a segfault)


def thread_count(text: str) -> int:
    value = positive_int(text)
    if value > MAX_THREADS:
        raise argparse.ArgumentTypeError(
            f"{value} threads is more than {MAX_THREADS}: give 1..{MAX_THREADS} (this machine "
            f"has {os.cpu_count()} cores)"
        )
    return value


# --- threads and devices ----------------------------------------------------------------------


def add_threads_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=thread_count, help="torch threads (default: torch's choice)")


def set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


def add_device_flag(p: argparse.ArgumentParser, help_text: str) -> None:
    p.add_argument("--device", choices=DEVICES, default="auto", help=help_text)


# --- generate and chat ------------------------------------------------------------------------


def add_sampling_flags(p: argparse.ArgumentParser, max_new_tokens: int, temperature: float) -> None:
    """The flags shared by generate and chat: how many tokens and how to sample them."""
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=max_new_tokens,
        help=f"most tokens to generate (default {max_new_tokens})",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=temperature,
        help=f"divide logits by this before sampling; 0 = greedy (default {temperature})",
    )
    p.add_argument("--top-k", type=int, help="sample only among the k most likely tokens")
    p.add_argument(
        "--top-p",
        type=float,
        help="sample from the smallest set of tokens whose probability is >= p",
    )
    p.add_argument(
        "--min-p",
        type=float,
        help="keep only tokens at least this fraction as likely as the most likely one (e.g. 0.05)",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="make tokens already in the text less likely: >1 penalizes repeats (default 1, off)",
    )
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop once the generated text contains TEXT (repeat the flag for several)",
    )
    p.add_argument("--seed", type=seed, help="seed for reproducible sampling")
    p.add_argument(
        "--min-tokens",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="generate at least N tokens: until then the end-of-sequence and stop tokens cannot "
        "be sampled and --stop strings do not match (vLLM's min_tokens; default 0)",
    )
    p.add_argument(
        "--logit-bias",
        type=logit_bias_entries,
        action="append",
        default=[],
        metavar="ID=BIAS",
        help="add BIAS (-100..100) to token ID's logit before sampling, greedy too: -100 bans "
        "the token, 100 all but forces it (OpenAI's logit_bias); repeat the flag or separate "
        "entries with commas, e.g. 13=-100,50256=5",
    )
    constrain = p.add_mutually_exclusive_group()
    constrain.add_argument(
        "--json-schema",
        type=json_schema_arg,
        metavar="FILE|JSON",
        help="the reply is JSON valid under this JSON Schema (a file, or the schema itself, e.g. "
        '\'{"type": "object"}\'): each token is sampled among those that keep it valid',
    )
    constrain.add_argument(
        "--regex",
        metavar="PATTERN",
        help="the whole reply matches this regular expression, e.g. '(yes|no)'",
    )
    constrain.add_argument(
        "--grammar",
        type=grammar_file,
        metavar="FILE",
        help="the reply follows this Lark grammar (llguidance's dialect: start: ..., regex "
        "terminals between slashes; see docs/structured.md)",
    )


def add_thinking_flags(p: argparse.ArgumentParser) -> None:
    """generate, chat and serve: the thinking segment of a model that thinks (<think> ...
    </think>, seed 000 §2.5.2)."""
    p.add_argument(
        "--thinking-budget",
        type=int,
        metavar="N",
        help="a thinking model may think for at most N tokens; then </think> is emitted for it "
        "and it answers (default: no limit)",
    )
    p.add_argument(
        "--no-think",
        action="store_true",
        help="answer at once: the prompt ends with an empty thinking segment (Qwen3's "
        "enable_thinking=False) and no thinking token is allowed",
    )


def thinking_options(
    args: argparse.Namespace, tokenizer, model_name: str
) -> tuple[dict, list[int]]:
    """(SamplingParams keywords, ids to append to the prompt) for the thinking flags. A model
    whose tokenizer has the markers always gets them, so its stats split thinking from answer;
    asking for a budget or --no-think on one without them is an error naming both."""
    from glassformer.infer.thinking import (
        check_budget,
        no_think_suffix,
        require_markers,
        thinking_markers,
    )

    budget = getattr(args, "thinking_budget", None)
    no_think = getattr(args, "no_think", False)
    check_budget(budget)
    if no_think and budget is not None:
        raise ValueError("--no-think and --thinking-budget both set: --no-think is a budget of 0")
    flag = "--no-think" if no_think else "--thinking-budget" if budget is not None else None
    markers = require_markers(tokenizer, model_name, flag) if flag else thinking_markers(tokenizer)
    if markers is None:
        return {}, []
    kwargs = {"think_ids": markers.ids, "thinking_budget": 0 if no_think else budget}
    return kwargs, no_think_suffix(markers) if no_think else []


def sampling_kwargs(args: argparse.Namespace, eos_token_id: int | None) -> dict:
    """The generation keywords that add_sampling_flags' flags set, for every generate path."""
    return {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "stop": tuple(args.stop),
        "seed": args.seed,
        "eos_token_id": eos_token_id,
        "min_tokens": args.min_tokens,
        "logit_bias": [pair for entries in args.logit_bias for pair in entries],
        "json_schema": getattr(args, "json_schema", None),
        "regex": getattr(args, "regex", None),
        "grammar": getattr(args, "grammar", None),
    }


def json_schema_arg(value: str) -> str:
    """--json-schema: the schema's JSON text, given inline or as a file (checked later, by
    SamplingParams, with the grammar engine's own message)."""
    if value.lstrip().startswith("{"):
        return value
    path = Path(value)
    if not path.is_file():
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither a JSON object nor a file: give a schema such as "
            '\'{"type": "object"}\' or the path of a .json file holding one'
        )
    return path.read_text(encoding="utf-8")


def grammar_file(value: str) -> str:
    path = Path(value)
    if not path.is_file():
        raise argparse.ArgumentTypeError(
            f"no grammar file {value!r}: give the path of a Lark grammar (start: ...)"
        )
    return path.read_text(encoding="utf-8")


def add_adapter_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--adapter",
        metavar="DIR",
        help="a LoRA adapter folder in peft's format (adapter_config.json + "
        "adapter_model.safetensors, from glassformer finetune or peft) for --model; it is merged "
        "into the weights before running, which computes the same and decodes as fast",
    )


def add_decode_flags(p: argparse.ArgumentParser) -> None:
    """The flags shared by generate, chat and serve: threads, device, precision, kernels and a
    LoRA adapter."""
    add_threads_flag(p)
    add_device_flag(
        p,
        "where the model runs: auto (a CUDA GPU, then Apple's MPS, then the CPU; the CPU for "
        "--quantize and --compile), cpu, cuda or mps (default auto). The decode kernels, "
        "--quantize and --compile serve the CPU only; elsewhere the model runs as built",
    )
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        help="weights and activations in fp32 or bf16 (half the bytes per token); a quantized "
        "GGUF file's weights dequantized. Default: the file's own precision on the CPU (a GGUF "
        "file of 4-bit blocks with a Q8_0 head runs on its blocks as --quantize int4, one all "
        "Q8_0 as --quantize int8: the file's numbers exactly), else fp32",
    )
    p.add_argument(
        "--quantize",
        choices=("int8", "int4", "w8a8", "w4a8"),
        help="int8: weight-only int8, a scale per 64 weights (about 3.7x fewer bytes than fp32); "
        "int4: a scale and a min per 32 weights, llama.cpp's Q4_1 form (about 5x fewer); a "
        "GGUF file's own blocks are kept where they have that form. w8a8, w4a8: int8, int4 with "
        "each layer's input rounded to int8 too, as llama.cpp computes (integer dot products: "
        "faster decoding, a small perplexity change, docs/performance.md)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=tuple(KV_DTYPES),
        help="store the keys/values in fp32, bf16 or fp16 (llama.cpp's --cache-type-k/-v; it "
        "stores f16 by default): bf16 and fp16 take half fp32's bytes per token, rounding each "
        "key and value once (docs/performance.md#kv-cache-precision). Default: the model's dtype",
    )
    p.add_argument(
        "--plain",
        action="store_true",
        help="run the model as built: no decode kernels, no fused decode step (for comparison)",
    )
    add_adapter_flag(p)


def decode_device(options: DecodeOptions) -> torch.device:
    """Where generation runs, after checking that the flags fit together. The decode kernels
    (infer/optimize.py, int8 weights, the compiled step) are C code for CPU tensors: with
    --quantize or --compile, auto means the CPU, and a GPU named outright is an error."""
    if options.quantize and options.dtype == "bf16":
        raise ValueError(
            f"--quantize {options.quantize} computes in fp32: drop --dtype {options.dtype}"
        )
    if options.compile and options.kv_cache_dtype:
        raise ValueError(
            f"--compile keeps its static cache in the model's dtype: drop --kv-cache-dtype "
            f"{options.kv_cache_dtype}, or --compile"
        )
    if options.compile and options.plain:
        raise ValueError("--compile runs the decode kernels: drop --plain")
    flag = options.cpu_only_flag
    if flag and options.device == "auto":
        return torch.device("cpu")
    device = resolve_device(options.device)
    if flag and device.type != "cpu":
        raise ValueError(
            f"{flag} runs on the CPU decode kernels, not on --device {options.device}: use "
            f"--device cpu, or drop {flag}"
        )
    return device


def load_with_tokenizer(
    model_name: str, why: str, quantize: str | None = None, adapter: str | None = None
) -> tuple[nn.Module, Tokenizer]:
    """--model (with --adapter merged in) and its tokenizer, which every command that reads
    text needs."""
    from glassformer.interop.pretrained import from_pretrained

    if adapter is None:
        model, tokenizer = from_pretrained(model_name, quantize=quantize)
    else:
        model, tokenizer = load_merged(model_name, adapter)
        from glassformer.nn.quant import (
            DEFAULT_GROUP_SIZE,
            quantize_int4,
            quantize_int8,
            round_inputs,
        )

        if quantize in ("int8", "w8a8"):
            model = quantize_int8(model, DEFAULT_GROUP_SIZE)
        elif quantize in ("int4", "w4a8"):
            model = quantize_int4(model)
        if quantize in ("w8a8", "w4a8"):
            model = round_inputs(model)
    if tokenizer is None:
        raise ValueError(f"{model_name} has no tokenizer.json: {why}")
    return model, tokenizer


def load_merged(model_name: str, adapter: str):
    """(model, tokenizer): the float base model with the LoRA adapter folder `adapter` folded
    into its weights. Merging (rather than running the adapter beside the weights) keeps one
    matmul per projection and the decode kernels; the function computed is the same. --quantize
    then rounds the merged weights, so the adapter's update is never lost to int8."""
    from glassformer.interop.peft import load_adapter
    from glassformer.interop.pretrained import from_pretrained
    from glassformer.nn.lora import merge_lora

    model, tokenizer = from_pretrained(model_name)
    load_adapter(model, adapter)
    merge_lora(model)
    return model.eval(), tokenizer


def load_for_decode(
    model_name: str, options: DecodeOptions, why: str
) -> tuple[nn.Module, Tokenizer]:
    """Check the flags, set threads, then load --model with its tokenizer, ready to decode
    (in the precision resolve_precision picks when neither --dtype nor --quantize is given)."""
    device = decode_device(options)
    options = resolve_precision(model_name, options, device)
    set_threads(options.threads)
    model, tokenizer = load_with_tokenizer(
        model_name, why, quantize=options.quantize, adapter=options.adapter
    )
    return prepare_for_decode(model, device, options), tokenizer


def decode_engine(model: nn.Module, tokenizer: Tokenizer, options: DecodeOptions) -> Engine:
    """The engine a decoding command runs on. The CLI owns the model, so unless --plain the
    engine may move its weights (the fused step, huge pages)."""
    from glassformer.infer.engine import Engine

    fast = not options.plain
    kv_dtype = options.kv_dtype
    return Engine(model, tokenizer=tokenizer, fast=fast, huge_pages=fast, kv_dtype=kv_dtype)


def prepare_for_decode(model: nn.Module, device: torch.device, options: DecodeOptions) -> nn.Module:
    """GPT-family models on the CPU get the decode kernels (infer/optimize.py) unless --plain;
    any other model, or any model on another device, runs as built. --dtype bf16 casts the
    model. An int8 model (--quantize) already runs on the kernels."""
    if options.quantize:
        return model
    if options.plain or device.type != "cpu" or model.cfg.family != "gpt":
        dtype = torch.bfloat16 if options.dtype == "bf16" else None
        return model.to(device=device, dtype=dtype)
    from glassformer.infer.optimize import optimize_for_decode

    return optimize_for_decode(model, options.dtype or "fp32")
