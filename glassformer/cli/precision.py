"""Which precision a decoding command runs a model in (generate, chat, serve, rag ask): the
flags as given, else the file's own, and the name of what a loaded model decodes in."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from glassformer.cli.common import DecodeOptions


def resolve_precision(
    model_name: str, options: DecodeOptions, device: torch.device
) -> DecodeOptions:
    """The options with the precision a decoding command runs in: --dtype or --quantize as
    given; neither, on the CPU without --adapter or --plain, the file's own (a GGUF file's
    4-bit or 8-bit blocks as they are, interop.pretrained.stored_precision: what llama.cpp runs
    too, the same numbers in a fifth of fp32's bytes); otherwise fp32. A merged adapter changes
    the weights (rounding them would lose part of its update) and --plain runs the model as
    built, so both stay fp32."""
    from dataclasses import replace

    from glassformer.interop.pretrained import stored_precision

    if options.quantize or options.dtype:
        return replace(options, dtype=options.dtype or "fp32")
    own = None
    if device.type == "cpu" and not (options.adapter or options.plain):
        own = stored_precision(model_name)
    return replace(options, dtype="fp32", quantize=own)


def precision_name(model: nn.Module) -> str:
    """What a loaded model decodes in: int4 or int8 (its blocks' Linears), else its float
    dtype (fp32, bf16)."""
    from glassformer.nn.quant import Int4Linear, Int8Linear

    kinds = {type(module) for module in model.modules()}
    if Int4Linear in kinds:
        return "int4"
    if Int8Linear in kinds:
        return "int8"
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
