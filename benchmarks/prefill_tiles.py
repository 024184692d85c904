"""Prefill's products of int8 and int4 weights on the tile unit against the paths they replaced,
side by side in one run on SmolLM2. int8 and int4 (float inputs): the tile unit's bf16
products with x in three exact bf16 pieces (kernels/tiles_split.h) against an fp32 matmul of
the weights dequantized a slice at a time; w8a8 and w4a8 (inputs rounded to int8): its byte
products, each group's sums in integers (kernels/tiles_a8.h), against x rounded in torch and
then that fp32 matmul. Each pair computes the same function, in another order.

Three tables: each of a layer's four matrices alone at --tokens rows (GMAC/s, and each
product's largest error against the float64 products); a whole 128-token prefill through the
Engine; and a burst, --burst prompts of 128 tokens in one batched forward (what the server runs
when many requests arrive at once). The tile unit is switched off the way GLASSFORMER_KERNELS=
avx512 switches it off (the AVX-512 loops without AMX), round by round, so that the machine's
other load hits both alike; figures are medians over --rounds.

    python benchmarks/prefill_tiles.py
    python benchmarks/prefill_tiles.py --json benchmarks/results/prefill_tiles.json  # the docs'
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import record  # benchmarks/record.py
import torch
from prefill_matmul import _ms, layer_matrices  # benchmarks/prefill_matmul.py

from glassformer import kernels
from glassformer.cli.common import DecodeOptions, load_for_decode
from glassformer.infer.engine import Engine
from glassformer.interop.pretrained import resolve

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import rounded_product  # the tests' float64 reference for rounded inputs

PATHS = {"tiles": "on", "torch": "avx512"}  # GLASSFORMER_KERNELS for each contestant


def side_by_side(fn, rounds: int, calls: int = 1) -> dict[str, float]:
    """Median ms of fn() on each path, the paths alternating round by round."""
    times = {path: [] for path in PATHS}
    for switch in PATHS.values():  # warm-up: each library built and loaded
        with mock.patch.object(kernels, "SWITCH", switch):
            fn()
    for _ in range(rounds):
        for path, switch in PATHS.items():
            with mock.patch.object(kernels, "SWITCH", switch):
                times[path].append(_ms(fn, calls))
    return {path: statistics.median(v) for path, v in times.items()}


def matrices(model, precision: str, tokens: int, rounds: int) -> list[dict]:
    layers = layer_matrices(model)
    print(f"\n{precision}, {tokens} rows, one matrix at a time (GMAC/s, median of {rounds})")
    print("| matrix | shape | tiles | torch | ratio | tiles error | torch error |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name, layer in layers.items():
        x = torch.randn(tokens, layer.in_features)
        if layer.round_inputs:
            want = rounded_product(layer, x)
        else:
            want = x.double() @ layer.dequantize().double().T
        ms = side_by_side(lambda layer=layer, x=x: layer(x), rounds, calls=5)
        error = {}
        for path, switch in PATHS.items():
            with mock.patch.object(kernels, "SWITCH", switch):
                error[path] = (layer(x).double() - want).abs().max().item()
        gmac = tokens * layer.in_features * layer.out_features / 1e9
        rate = {path: gmac / (v / 1e3) for path, v in ms.items()}
        print(f"| {name} | {(layer.out_features, layer.in_features)} | {rate['tiles']:.0f} | "
              f"{rate['torch']:.0f} | {rate['tiles'] / rate['torch']:.2f}x | "
              f"{error['tiles']:.1e} | {error['torch']:.1e} |")  # fmt: skip
        rows.append({"precision": precision, "tokens": tokens, "matrix": name,
                     "shape": [layer.out_features, layer.in_features],
                     "tiles_gmac_s": rate["tiles"], "torch_gmac_s": rate["torch"],
                     "tiles_error": error["tiles"], "torch_error": error["torch"]})  # fmt: skip
    return rows


def whole(model, tokenizer, precision: str, burst: int, rounds: int) -> dict:
    engine = Engine(model, tokenizer=tokenizer)
    prompt = list(range(1000, 1128))

    def prefill():
        engine.cancel(engine.add(prompt))  # the prefill and the first token

    # `burst` distinct 128-token prompts in one batched forward, as the server's burst prefill
    ids = torch.arange(1000, 1128).repeat(burst, 1) + torch.arange(burst)[:, None]
    positions = torch.arange(128).expand(burst, 128)

    def batched():
        cache = model.new_cache(burst, 256)
        model(ids, positions, cache=cache, last_token_only=True)

    one = side_by_side(prefill, rounds)
    many = side_by_side(batched, max(3, rounds // 3))
    print(f"\n{precision}: ms, median of {rounds} (the burst: of {max(3, rounds // 3)})")
    print(f"  one 128-token prompt:  tiles {one['tiles']:6.1f}  torch {one['torch']:6.1f}  "
          f"{one['torch'] / one['tiles']:.2f}x")  # fmt: skip
    print(f"  {burst} x 128 in one forward: tiles {many['tiles']:6.1f}  "
          f"torch {many['torch']:6.1f}  {many['torch'] / many['tiles']:.2f}x")  # fmt: skip
    return {"precision": precision, "prompt_ms": one, "burst": burst, "burst_ms": many}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", nargs="+", default=["int8", "int4", "w8a8", "w4a8"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--burst", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write every row here (benchmarks/results/)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if not kernels.amx():
        raise SystemExit("no AMX tile unit here (kernels.amx() is False): nothing to compare")
    rows, prefills = [], []
    for precision in args.precisions:
        options = DecodeOptions(threads=args.threads, quantize=precision)
        model, tokenizer = load_for_decode(str(resolve("smollm2")), options, "prefill_tiles")
        with torch.inference_mode():
            rows += matrices(model, precision, args.tokens, args.rounds)
            prefills.append(whole(model, tokenizer, precision, args.burst, args.rounds))
    if args.json:
        fields = {"model": "SmolLM2-135M", "rounds": args.rounds, "matrices": rows}
        record.write(args.json, args.threads, {**fields, "prefill": prefills})


if __name__ == "__main__":
    main()
