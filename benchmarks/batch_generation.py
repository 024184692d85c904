"""Batched generation vs one prompt at a time on SmolLM2-135M (issue 5).

Decode is memory-bound: each step reads every weight once to produce one token per row, so a
batch of 8 rows reads the weights once for 8 tokens. This script generates the same 8 prompts
(~128 tokens of Shakespeare each, different lengths, so the batch is left-padded) two ways:
batch 1, the prompts one after another through Engine.generate, and batch 8, all at once
through Engine.generate_batch, with greedy decoding and no early stop (every row makes
--new-tokens tokens). It prints total generated tokens/s (all rows' new tokens over the wall
time, prefill included) for each and their ratio, and checks that both produce the same tokens.

Each figure is the median over --runs; the two ways are interleaved (1 8 1 8 ...) so load from
other processes hits both alike.

    python benchmarks/batch_generation.py
    python benchmarks/batch_generation.py --runs 1 --new-tokens 8   # a quick check
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from glassformer.data import shakespeare_plays
from glassformer.infer.engine import Engine
from glassformer.infer.optimize import optimize_for_decode
from glassformer.infer.sampling import NO_EOS
from glassformer.interop.pretrained import from_pretrained


def shakespeare_prompts(tokenizer, n_prompts: int, tokens: int) -> list[list[int]]:
    """n_prompts token lists of about `tokens` tokens (up to 8 fewer, so lengths differ), each
    from the middle of a different play."""
    plays = list(shakespeare_plays("modern").values())
    prompts = []
    for i in range(n_prompts):
        text = plays[(i * 7) % len(plays)]
        middle = len(text) // 2
        ids = tokenizer.encode(text[middle : middle + 8 * tokens])  # ample characters
        prompts.append(ids[: tokens - (i * 3) % 9])
    return prompts


def time_one_at_a_time(engine: Engine, prompts: list[list[int]], new_tokens: int):
    start = time.perf_counter()
    outputs = [
        engine.generate(p, new_tokens, temperature=0.0, eos_token_id=NO_EOS).token_ids
        for p in prompts
    ]
    return time.perf_counter() - start, outputs


def time_batch(engine: Engine, prompts: list[list[int]], new_tokens: int):
    start = time.perf_counter()
    results = engine.generate_batch(prompts, new_tokens, temperature=0.0, eos_token_id=NO_EOS)
    return time.perf_counter() - start, [r.token_ids for r in results]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Total generated tokens/s: 8 prompts one at a time vs as one batch.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default="smollm2", help="alias or path for from_pretrained")
    parser.add_argument("--prompts", type=int, default=8, help="prompts, the batch size")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="longest prompt")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--runs", type=int, default=5, help="timed runs; the median is shown")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = from_pretrained(args.model)
    engine = Engine(optimize_for_decode(model))  # the decode kernels, as `generate` runs
    prompts = shakespeare_prompts(tokenizer, args.prompts, args.prompt_tokens)
    lengths = [len(p) for p in prompts]
    n_generated = args.prompts * args.new_tokens
    print(
        f"{args.model}: {args.prompts} prompts of {min(lengths)}-{max(lengths)} tokens, "
        f"{args.new_tokens} greedy tokens each | threads {torch.get_num_threads()} | median of "
        f"{args.runs} | torch {torch.__version__}"
    )
    # One untimed round of each first: allocates both caches, warms the kernels.
    time_one_at_a_time(engine, prompts, min(args.new_tokens, 4))
    time_batch(engine, prompts, min(args.new_tokens, 4))

    seconds: dict[str, list[float]] = {"batch 1": [], f"batch {args.prompts}": []}
    same = True
    for _ in range(args.runs):
        elapsed, one_by_one = time_one_at_a_time(engine, prompts, args.new_tokens)
        seconds["batch 1"].append(elapsed)
        elapsed, batched = time_batch(engine, prompts, args.new_tokens)
        seconds[f"batch {args.prompts}"].append(elapsed)
        same = same and batched == one_by_one
    medians = {name: statistics.median(s) for name, s in seconds.items()}

    print()
    print(f"{'':>9}  {'seconds':>8}  {'generated tok/s':>15}")
    for name, elapsed in medians.items():
        print(f"{name:>9}  {elapsed:>8.2f}  {n_generated / elapsed:>15.1f}")
    one, batched = medians.values()
    print(
        f"\nbatch {args.prompts} / batch 1 throughput: {one / batched:.2f}x | same tokens both "
        f"ways: {'yes' if same else 'NO'}"
    )


if __name__ == "__main__":
    main()
