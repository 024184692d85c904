"""The fused decode step against a plain read of the same bytes, in tight alternation: how close
one token's step comes to the memory-bandwidth limit (seed 000 §2.5.1).

A decode step at cache position p must read every weight once (the tied head included) and the
cached keys and values of positions 0..p-1 in every layer. This script times the fused C step
(glassformer/infer/fused.py, what Engine(model) decodes one row with, inside step.unchanged() as
the Engine calls it) at position p, and torch's
sum over a buffer of exactly those bytes in 2 MB pages (where the weights are too), alternating
blocks of --calls steps and --calls reads so that the machine's bandwidth, which moves by the
minute here, is the same for both; figures are medians over --blocks. benchmarks/decode.py
measures the same limit around whole generations, a read just before each run, where a minute's
drift between the read and the run shows in its percent column; this script takes that drift
out.

    python benchmarks/step_bandwidth.py            # GPT-2 and SmolLM2, fp32 bf16 int8 int4
    python benchmarks/step_bandwidth.py --models gpt2 --precision fp32 --positions 128 960
    python benchmarks/step_bandwidth.py --json benchmarks/results/step_bandwidth.json  # the docs'
    GLASSFORMER_KERNELS=avx2 python benchmarks/step_bandwidth.py  # the AVX2 kernels, on AVX-512
    GLASSFORMER_KERNELS=avx512 python benchmarks/step_bandwidth.py  # int4 without AMX's tiles
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import record  # benchmarks/record.py
import torch
from decode import PRECISIONS, glassformer_variant, kv_bytes_per_step, weight_bytes_per_step

from glassformer import kernels
from glassformer.config import ModelConfig
from glassformer.infer import huge_pages
from glassformer.infer.fused import FusedStep
from glassformer.interop.pretrained import from_pretrained
from glassformer.models import build_model


def _block_seconds(fn, calls: int) -> float:
    """Seconds per call over a block of `calls` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(model, position: int, args) -> tuple[float, float, int]:
    """(step GB/s, read GB/s, bytes per step), medians over the blocks."""
    huge_pages.to_huge_pages(model)  # the weights in 2 MB pages too, as the buffer below
    step = FusedStep(model)
    cache = model.new_cache(batch_size=1, max_seq_len=position + args.calls + 1)
    huge_pages.advise_in_place(cache.k)  # the keys and values too, as the Engine's
    huge_pages.advise_in_place(cache.v)
    element = cache.k.element_size()
    nbytes = int(weight_bytes_per_step(model) + kv_bytes_per_step(model.cfg, element, position))
    if huge_pages.supported():
        data = huge_pages.huge_page_empty(nbytes).view(torch.float32)[: nbytes // 4].fill_(1.0)
    else:
        data = torch.ones(nbytes // 4)

    def decode():  # always at `position`: its keys and values are rewritten, the bytes equal
        step(42, position, cache)

    steps, reads = [], []
    # Inside unchanged(), as the Engine's generate and the server run their steps: a bare call
    # first checks that the model is as the step was built from, 0.2-0.3 ms of a 4 ms
    # SmolLM2 int4 step (fused.py), which is no part of reading the weights.
    with torch.inference_mode(), step.unchanged():
        for block in range(args.blocks + 1):  # the first block of each warms up
            s, r = _block_seconds(decode, args.calls), _block_seconds(data.sum, args.calls)
            if block:
                steps.append(nbytes / s / 1e9)
                reads.append(nbytes / r / 1e9)
    return statistics.median(steps), statistics.median(reads), nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "smollm2"])
    parser.add_argument("--precision", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--positions", nargs="+", type=int, default=[128, 960])
    parser.add_argument("--calls", type=int, default=16, help="steps (and reads) per block")
    parser.add_argument("--blocks", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write every row here (benchmarks/results/)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    tiles = " (int4 on AMX's tile unit)" if kernels.amx() else ""
    print(f"{args.threads} threads, {kernels.simd()} kernels{tiles}, blocks of {args.calls} "
          f"steps and {args.calls} reads, median of {args.blocks}\n")  # fmt: skip
    print(f"{'model':<20}{'prec':<6}{'position':>9}{'MB/step':>9}{'step GB/s':>11}"
          f"{'read GB/s':>11}{'step/read':>11}")  # fmt: skip
    for name in args.models:
        if name == "gpt2":  # random weights: the bytes, not the values, set the speed
            torch.manual_seed(0)
            base, label = build_model(ModelConfig.preset("gpt2-124m")), "GPT-2 124M (random)"
        else:
            base, label = from_pretrained("smollm2")[0], "SmolLM2-135M"
        for precision in args.precision:
            model = glassformer_variant(base.eval(), precision, plain=False)
            for position in args.positions:
                step_gb_s, read_gb_s, nbytes = measure(model, position, args)
                print(f"{label:<20}{precision:<6}{position:>9}{nbytes / 1e6:>9.0f}"
                      f"{step_gb_s:>11.1f}{read_gb_s:>11.1f}{step_gb_s / read_gb_s:>10.2f}x",
                      flush=True)  # fmt: skip
                rows.append(
                    {
                        "model": label,
                        "precision": precision,
                        "position": position,
                        "mb_per_step": nbytes / 1e6,
                        "step_gb_s": step_gb_s,
                        "read_gb_s": read_gb_s,
                        "step_over_read": step_gb_s / read_gb_s,
                    }
                )
    if args.json:
        fields = {
            "calls": args.calls,
            "blocks": args.blocks,
            "kernels": kernels.simd(),
            "amx": kernels.amx(),
            "rows": rows,
        }
        record.write(args.json, args.threads, fields)


if __name__ == "__main__":
    main()
