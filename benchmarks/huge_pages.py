"""Weights in 4 KB pages against 2 MB pages (glassformer/infer/huge_pages.py), side by side in
one run: a plain 1 GiB read (torch's sum), and SmolLM2's fused decode step (the C call that
decodes one token, glassformer/infer/fused.py) in fp32, bf16, int8 and int4.

Each contestant holds its own copy of the weights: "4 KB" as torch allocated them, "2 MB" moved
by to_huge_pages (as Engine(model, huge_pages=True) does). The step is timed alone (no
sampling, no Python loop around it) at cache position --position, --calls calls per round;
rounds alternate 4 KB and 2 MB so that the machine's other load hits both alike; figures are
medians over --rounds.

    python benchmarks/huge_pages.py
    python benchmarks/huge_pages.py --precision fp32 --rounds 5   # a quick look
    python benchmarks/huge_pages.py --json benchmarks/results/huge_pages.json   # the docs' table
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import record  # benchmarks/record.py
import torch
from decode import PRECISIONS, glassformer_variant  # benchmarks/decode.py

from glassformer.infer import fused
from glassformer.infer.huge_pages import huge_page_empty, supported, to_huge_pages
from glassformer.interop.pretrained import from_pretrained


def _seconds(fn, calls: int) -> float:
    """The median time of `calls` calls of fn."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=20, help="fused steps per round")
    parser.add_argument("--position", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write every row here (benchmarks/results/)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not supported():
        raise SystemExit("this system has no transparent huge pages (Linux, THP not 'never')")

    small = torch.ones(2**28)  # 1 GiB in 4 KB pages
    large = huge_page_empty(2**30).view(torch.float32).fill_(1.0)
    base, _ = from_pretrained("smollm2")
    contestants = {"read 1 GiB": {"4 KB": small.sum, "2 MB": large.sum}}
    for precision in args.precision:
        model = glassformer_variant(base, precision, plain=False)
        moved = copy.deepcopy(model)
        to_huge_pages(moved)
        step_4k, step_2m = fused.FusedStep(model), fused.FusedStep(moved)
        steps = {}
        for pages, step in (("4 KB", step_4k), ("2 MB", step_2m)):
            cache = step.model.new_cache(1, args.position + 1)
            steps[pages] = lambda step=step, cache=cache: step(5, args.position, cache)
        contestants[f"{precision} step"] = steps

    rates = {name: {"4 KB": [], "2 MB": []} for name in contestants}
    for pair in contestants.values():  # warm-up
        for fn in pair.values():
            fn()
    for _ in range(args.rounds):
        for name, pair in contestants.items():
            for pages, fn in pair.items():
                if name.startswith("read"):
                    rates[name][pages].append(2**30 / _seconds(fn, 1) / 1e9)
                else:
                    rates[name][pages].append(1 / _seconds(fn, args.calls))

    print(f"{args.threads} threads | median of {args.rounds} interleaved rounds | fused step: "
          f"{args.calls} calls a round at cache position {args.position}")  # fmt: skip
    print(f"{'what':<28}{'4 KB pages':>12}{'2 MB pages':>12}{'ratio':>8}")
    rows = []
    for name, pair in rates.items():
        small_rate, large_rate = (statistics.median(pair[p]) for p in ("4 KB", "2 MB"))
        unit = "GB/s" if name.startswith("read") else "steps/s"
        what = name if name.startswith("read") else f"SmolLM2 {name}"
        print(
            f"{what + f' ({unit})':<28}{small_rate:>12.1f}{large_rate:>12.1f}"
            f"{large_rate / small_rate:>7.2f}x"
        )
        rows.append(
            {
                "what": name,
                "unit": unit,
                "pages_4k": small_rate,
                "pages_2m": large_rate,
                "ratio": large_rate / small_rate,
            }
        )
    if args.json:
        settings = {"rounds": args.rounds, "calls": args.calls, "position": args.position}
        record.write(args.json, args.threads, {"model": "SmolLM2-135M", **settings, "rows": rows})


if __name__ == "__main__":
    main()
