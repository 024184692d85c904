"""Continuous batching vs one prompt at a time on SmolLM2-135M (issues 5 and 13).

Decode is memory-bound: each step reads every weight once to produce one token per row, so a
step for 8 rows reads the weights once for 8 tokens. This script generates the same 8 prompts
(~128 tokens of Shakespeare each, different lengths) two ways, greedy and with no early stop
(every row makes --new-tokens tokens):

- one at a time: the prompts one after another through Engine.generate;
- continuous: one Engine with 8 row slots; row i joins after i * --join-every decode steps
  (its prompt is prefilled into a free slot while the others are mid-generation) and leaves
  when done, so rows sit at different positions in every step.

It prints, for each way, the generated tokens/s over the whole wall time (prefills included)
and the decode tokens/s (every token after each row's first, over the time spent in decode
steps), both ratios, and checks that every row's tokens equal generating it alone.
Each figure is the median over --runs; the two ways are interleaved so load from other
processes hits both alike.

    python benchmarks/batch_generation.py
    python benchmarks/batch_generation.py --runs 1 --new-tokens 8   # a quick check
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

import torch

from glassformer.data import shakespeare_plays
from glassformer.infer.engine import Engine
from glassformer.infer.optimize import optimize_for_decode
from glassformer.infer.sampling import NO_EOS, SamplingParams
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


@dataclass
class Timing:
    prefill_s: float = 0.0  # adding rows: their prompts' prefills and first tokens
    decode_s: float = 0.0  # decode steps: every token after each row's first
    tokens: list[list[int]] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s


def one_at_a_time(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> Timing:
    """Each prompt alone: add its row, step until it is done, then the next."""
    timing = Timing()
    for prompt in prompts:
        start = time.perf_counter()
        row = engine.add(prompt, params)
        added = time.perf_counter()
        while not row.finished:
            engine.step()
        timing.prefill_s += added - start
        timing.decode_s += time.perf_counter() - added
        timing.tokens.append(row.tokens)
    return timing


def continuous(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, join_every: int
) -> Timing:
    """Row i joins after i * join_every steps; step until every row is done."""
    timing, rows, step = Timing(), [], 0
    while len(rows) < len(prompts) or any(not row.finished for row in rows):
        start = time.perf_counter()
        while len(rows) < len(prompts) and len(rows) * join_every <= step:
            rows.append(engine.add(prompts[len(rows)], params))
        added = time.perf_counter()
        engine.step()
        timing.prefill_s += added - start
        timing.decode_s += time.perf_counter() - added
        step += 1
    timing.tokens = [row.tokens for row in rows]
    return timing


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Total generated tokens/s: 8 prompts one at a time vs as one batch.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default="smollm2", help="alias or path for from_pretrained")
    parser.add_argument("--prompts", type=int, default=8, help="prompts, the row slots")
    parser.add_argument("--join-every", type=int, default=4, help="steps between joining rows")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="longest prompt")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--runs", type=int, default=5, help="timed runs; the median is shown")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = from_pretrained(args.model)
    model = optimize_for_decode(model)  # the decode kernels, as `generate` runs
    engine, slots = Engine(model), Engine(model, max_rows=args.prompts)
    prompts = shakespeare_prompts(tokenizer, args.prompts, args.prompt_tokens)
    lengths = [len(p) for p in prompts]
    n_generated = args.prompts * args.new_tokens
    print(
        f"{args.model}: {args.prompts} prompts of {min(lengths)}-{max(lengths)} tokens, "
        f"{args.new_tokens} greedy tokens each, a row joining every {args.join_every} steps | "
        f"threads {torch.get_num_threads()} | median of {args.runs} | torch {torch.__version__}"
    )
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, eos_token_id=NO_EOS)
    warm = SamplingParams(temperature=0.0, max_new_tokens=4, eos_token_id=NO_EOS)
    one_at_a_time(engine, prompts, warm)  # allocates both caches, warms the kernels
    continuous(slots, prompts, warm, args.join_every)

    runs: dict[str, list[Timing]] = {"one at a time": [], "continuous": []}
    for _ in range(args.runs):
        runs["one at a time"].append(one_at_a_time(engine, prompts, params))
        runs["continuous"].append(continuous(slots, prompts, params, args.join_every))
    same = all(
        a.tokens == b.tokens for a, b in zip(runs["one at a time"], runs["continuous"], strict=True)
    )
    n_decoded = n_generated - args.prompts  # every token after each row's first
    print(f"\n{'':>13}  {'seconds':>8}  {'generated tok/s':>15}  {'decode tok/s':>12}")
    totals, decodes = {}, {}
    for name, timings in runs.items():
        total = statistics.median(t.total_s for t in timings)
        decode = statistics.median(t.decode_s for t in timings)
        totals[name], decodes[name] = n_generated / total, n_decoded / decode
        print(f"{name:>13}  {total:>8.2f}  {totals[name]:>15.1f}  {decodes[name]:>12.1f}")
    decode_ratio = decodes["continuous"] / decodes["one at a time"]
    print(
        f"\ncontinuous / one at a time: decode {decode_ratio:.2f}x, "
        f"overall (prefills included) {totals['continuous'] / totals['one at a time']:.2f}x | "
        f"same tokens both ways: {'yes' if same else 'NO'}"
    )


if __name__ == "__main__":
    main()
