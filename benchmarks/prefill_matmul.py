"""Prefill's fp32 matmuls on MKL (torch's F.linear) against oneDNN (kernels.linear, where the
Engine's FastLinears sends them), side by side in one run on SmolLM2: the Engine picks MKL on
Intel CPUs and oneDNN elsewhere (kernels.prefill_matmul); this shows whether that holds here.

Two tables: each of a layer's four matrices (fused qkv, output, fused gate/up, down) alone at
--tokens rows, in GFLOP/s and with each product's largest error against float64; then the whole
prefill of a --tokens prompt through the Engine, the same model with either library
(everything else, the fused decode step included, alike). Rounds alternate the contestants so
that the machine's other load hits both alike; figures are medians over --rounds.

    python benchmarks/prefill_matmul.py
    python benchmarks/prefill_matmul.py --tokens 128 1024 --rounds 9
    python benchmarks/prefill_matmul.py --json benchmarks/results/prefill_matmul.json  # the docs'
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import record  # benchmarks/record.py
import torch
import torch.nn.functional as F

from glassformer import kernels
from glassformer.infer.engine import Engine
from glassformer.interop.pretrained import from_pretrained


def _ms(fn, calls: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def layer_matrices(model) -> dict:
    """The four matrices of a layer (SmolLM2's first block), by name: the prefill benchmarks'."""
    block = model.blocks[0]
    return {"qkv": block.attn.qkv_proj, "out": block.attn.out_proj,
            "gate/up": block.ffn.gate_up, "down": block.ffn.down}  # fmt: skip


def matrices(model, tokens: int, rounds: int) -> list[dict]:
    layers = layer_matrices(model)
    print(f"\n{tokens} rows, one matrix at a time (GFLOP/s, median of {rounds}; error vs fp64)")
    print("| matrix | shape | MKL | oneDNN | ratio | MKL error | oneDNN error |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name, layer in layers.items():
        w = layer.weight.detach()
        x = torch.randn(tokens, w.shape[1])
        want = x.double() @ w.double().T
        contestants = {"MKL": lambda x=x, w=w: F.linear(x, w),
                       "oneDNN": lambda x=x, w=w: kernels.linear(x, w)}  # fmt: skip
        times = {k: [] for k in contestants}
        for _ in range(rounds):
            for k, fn in contestants.items():
                times[k].append(_ms(fn, calls=5))
        gflop = 2 * tokens * w.numel() / 1e9
        rate = {k: gflop / (statistics.median(v) / 1e3) for k, v in times.items()}
        error = {k: (fn().double() - want).abs().max().item() for k, fn in contestants.items()}
        mkl, onednn = rate["MKL"], rate["oneDNN"]
        print(f"| {name} | {tuple(w.shape)} | {mkl:.0f} | {onednn:.0f} | {onednn / mkl:.2f}x | "
              f"{error['MKL']:.1e} | {error['oneDNN']:.1e} |")  # fmt: skip
        rows.append(
            {
                "tokens": tokens,
                "matrix": name,
                "shape": list(w.shape),
                "mkl_gflop_s": mkl,
                "onednn_gflop_s": onednn,
                "onednn_vs_mkl": onednn / mkl,
                "mkl_error": error["MKL"],
                "onednn_error": error["oneDNN"],
            }
        )
    return rows


def whole_prefill(model, tokens: int, rounds: int) -> dict:
    engines = {}  # the same Engine, its prefill's matmuls on each library
    for name, library in (("oneDNN", "onednn"), ("MKL", "mkl")):
        with mock.patch.dict(os.environ, {"GLASSFORMER_PREFILL_MATMUL": library}):
            engines[name] = Engine(model)
    prompt = list(range(1000, 1000 + tokens))

    def prefill(engine):
        row = engine.add(prompt)  # prefill and the first token
        engine.cancel(row)

    times = {k: [] for k in engines}
    for engine in engines.values():
        prefill(engine)  # warm-up: cache allocation
    for _ in range(rounds):
        for k, engine in engines.items():
            times[k].append(_ms(lambda e=engine: prefill(e)))
    base = statistics.median(times["MKL"])
    print(f"\nwhole prefill of {tokens} tokens, fp32 (ms to the first token, median of {rounds})")
    for k, v in times.items():
        print(f"  {k:<24} {statistics.median(v):7.1f} ms   {base / statistics.median(v):.2f}x")
    onednn = statistics.median(times["oneDNN"])
    return {"tokens": tokens, "mkl_ms": base, "onednn_ms": onednn, "onednn_vs_mkl": base / onednn}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write every row here (benchmarks/results/)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, _ = from_pretrained("smollm2")
    print(f"torch {torch.__version__}, {args.threads} threads, oneDNN: "
          f"{kernels._onednn_linear() is not None}, CPU: {kernels._cpu_vendor() or '?'}, "
          f"the Engine's default here: {kernels.prefill_matmul()}")  # fmt: skip
    with torch.inference_mode():
        rows = [row for tokens in args.tokens for row in matrices(model, tokens, args.rounds)]
    prefill = [whole_prefill(model, tokens, args.rounds) for tokens in args.tokens]
    if args.json:
        fields = {"model": "SmolLM2-135M", "rounds": args.rounds, "matrices": rows}
        record.write(args.json, args.threads, {**fields, "prefill": prefill})


if __name__ == "__main__":
    main()
