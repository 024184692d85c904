"""How a decoding command (generate, chat, serve, rag ask) runs a model: its options (device,
precision, kernels) and the precision it runs in (the flags as given, else the file's own); the
name of what a loaded model decodes in is nn.quant.precision_name."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

# --kv-cache-dtype: what the keys/values are stored in (the Engine's kv_dtype)
KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class DecodeOptions:
    """How generate and chat run the model: where, in which precision, on which kernels."""

    device: str = "auto"
    dtype: str | None = None  # None: the file's own precision (resolve_precision)
    quantize: str | None = None
    plain: bool = False
    compile: bool = False
    threads: int | None = None
    adapter: str | None = None
    kv_cache_dtype: str | None = None  # a KV_DTYPES name; None: the model's dtype

    @classmethod
    def from_args(cls, args: argparse.Namespace, compile: bool = False) -> DecodeOptions:
        return cls(
            args.device,
            args.dtype,
            args.quantize,
            args.plain,
            compile,
            args.threads,
            getattr(args, "adapter", None),
            getattr(args, "kv_cache_dtype", None),
        )

    @property
    def kv_dtype(self) -> torch.dtype | None:
        """The Engine's kv_dtype for --kv-cache-dtype (None: the model's own)."""
        return KV_DTYPES.get(self.kv_cache_dtype or "")

    @property
    def cpu_only_flag(self) -> str | None:
        """The flag that needs the CPU decode kernels, if one was given."""
        if self.quantize:
            return f"--quantize {self.quantize}"
        return "--compile" if self.compile else None


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
