"""Compiled, eager and fused decode steps on SmolLM2-135M (seed 000 §2.5.1: decode is
memory-bound, so what a step spends beyond streaming the weights is overhead to remove).

For each precision (int8 weight-only, fp32 and bf16 through optimize_for_decode) the script
prefills the same prompt into three caches, then times decode steps of the eager model
(model(token, cache=...), the Engine's path for batches and with fast=False), of
CompiledDecoder's compiled step and of the fused C step (infer/fused.py, what Engine(model)
decodes a single row with), in interleaved blocks (eager, compiled, fused, eager, ...) so that
load from other processes hits them alike; each figure is the median over blocks. It also
times the matrix-vector kernels alone (every Linear of one step) and prints the compile time
(the first compiled step).

    python benchmarks/compiled_decode.py                        # int8, fp32, bf16, 2 threads
    python benchmarks/compiled_decode.py --precision int8 --threads 1 --blocks 5
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from glassformer.infer.compiled import CompiledDecoder
from glassformer.infer.fused import FusedStep
from glassformer.infer.huge_pages import to_huge_pages
from glassformer.infer.optimize import DecodeLinear, optimize_for_decode
from glassformer.interop.pretrained import from_pretrained
from glassformer.nn.quant import Int8Linear, quantize_int8

PRECISIONS = ("int8", "fp32", "bf16")


def prepare(model: nn.Module, precision: str) -> nn.Module:
    model = copy.deepcopy(model)
    if precision == "int8":
        return quantize_int8(model)
    return optimize_for_decode(model, dtype=precision)


def step_ms(step, cache, length: int, token: torch.Tensor, n_steps: int) -> float:
    """Mean ms of n_steps decode steps from `length` filled positions (the next call writes
    over them again)."""
    start = time.perf_counter()
    for position in range(length, length + n_steps):
        step(token, cache, position)
    elapsed = time.perf_counter() - start
    return 1e3 * elapsed / n_steps


def kernels_ms(model: nn.Module, n_repeats: int = 20) -> float:
    """ms that the matvec kernels of one decode step take on their own."""
    layers = [m for m in model.modules() if isinstance(m, (Int8Linear, DecodeLinear))]
    dtype = model.tok_emb.weight.dtype
    inputs = [torch.randn(1, 1, layer.in_features, dtype=dtype) for layer in layers]
    for layer, x in zip(layers, inputs, strict=True):
        layer(x)
    start = time.perf_counter()
    for _ in range(n_repeats):
        for layer, x in zip(layers, inputs, strict=True):
            layer(x)
    return 1e3 * (time.perf_counter() - start) / n_repeats


def measure(model: nn.Module, precision: str, args: argparse.Namespace) -> dict[str, float]:
    model = prepare(model, precision)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, args.prompt))
    token = torch.tensor([42])
    decoder = CompiledDecoder(model)
    to_huge_pages(model)  # as Engine(model, huge_pages=True): all three read these pages
    fused = FusedStep(model)  # what Engine(model) decodes a single row with
    capacity = args.prompt + args.blocks * args.steps + 1
    with torch.inference_mode():
        eager_cache = model.new_cache(batch_size=1, max_seq_len=capacity)
        fused_cache = model.new_cache(batch_size=1, max_seq_len=capacity)
        decoder.reserve(1, capacity)
        compiled_cache = decoder.cache
        positions = torch.arange(args.prompt)
        model(prompt, positions, cache=eager_cache, last_token_only=True)
        model(prompt, positions, cache=fused_cache, last_token_only=True)
        decoder.forward(prompt, positions, compiled_cache)

        def eager_step(tok, cache, position):
            return model(tok[:, None], torch.tensor([position]), cache=cache, last_token_only=True)

        def compiled_step(tok, cache, position):
            # Inputs made inside inference mode, as the Engine makes them: the graph's guards
            # include whether each input is an inference tensor.
            decoder.compiled_forward(tok.reshape(1, 1).clone(), torch.tensor([position]), cache)

        def fused_step(tok, cache, position):
            fused(int(tok), position, cache)

        start = time.perf_counter()
        compiled_step(token, compiled_cache, args.prompt)
        compile_s = time.perf_counter() - start
        sides = {"eager": (eager_step, eager_cache), "compiled": (compiled_step, compiled_cache),
                 "fused": (fused_step, fused_cache)}  # fmt: skip
        times = {name: [] for name in sides}
        for block in range(args.blocks + 1):  # every side warms up, then they take turns
            for name, (step, cache) in sides.items():
                ms = step_ms(step, cache, args.prompt, token, args.steps)
                if block:
                    times[name].append(ms)
        matvec = kernels_ms(model)
    medians = {f"{name}_ms": statistics.median(values) for name, values in times.items()}
    return {"compile_s": compile_s, "kernels_ms": matvec, **medians}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (and the kernels')")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens prefilled first")
    parser.add_argument("--steps", type=int, default=20, help="decode steps per timed block")
    parser.add_argument("--blocks", type=int, default=7, help="timed blocks per side")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = from_pretrained("smollm2")
    header = (
        f"{'precision':<9} {'compile s':>9} {'eager ms':>9} {'compiled ms':>11} {'fused ms':>9} "
        f"{'kernels ms':>10} {'eager tok/s':>11} {'compiled tok/s':>14} {'fused tok/s':>11} "
        f"{'compiled/eager':>14} {'fused/compiled':>14}"
    )
    print(f"SmolLM2-135M, {args.threads} threads, {args.prompt}-token prompt, batch 1")
    print(header)
    for precision in args.precision:
        r = measure(model, precision, args)
        print(
            f"{precision:<9} {r['compile_s']:>9.1f} {r['eager_ms']:>9.2f} "
            f"{r['compiled_ms']:>11.2f} {r['fused_ms']:>9.2f} {r['kernels_ms']:>10.2f} "
            f"{1e3 / r['eager_ms']:>11.1f} {1e3 / r['compiled_ms']:>14.1f} "
            f"{1e3 / r['fused_ms']:>11.1f} {r['eager_ms'] / r['compiled_ms']:>13.2f}x "
            f"{r['compiled_ms'] / r['fused_ms']:>13.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
