"""What storing the keys/values in bf16 or fp16 costs and gains (issue 36, part 5; llama.cpp stores
f16 by default, --cache-type-k/-v): the Engine's kv_dtype, `--kv-cache-dtype` on the CLI.

On SmolLM2-135M-Instruct at the precision it serves in by default (the shipped file's int4
blocks), for each cache dtype (fp32, bf16, fp16):

- bytes per token: the cache's keys and values of one position over all layers;
- perplexity on --windows windows of --window-tokens tokens of Shakespeare, the tokens fed in
  chunks of --chunk through the cache, so every attention reads the stored (rounded) keys and
  values, as decoding does; and its change against the fp32 cache;
- greedy agreement: of --new-tokens tokens decoded after each window's first 256 tokens, the
  share equal to the fp32 cache's (the first difference, and everything after it, counts);
- decode tokens/s after --contexts prompt tokens (the fused C step reads the cache in its own
  dtype, so a half cache halves what a long context reads per token); the dtypes alternate
  within each of --runs rounds, median.

    python benchmarks/kv_dtype.py --threads 2
    python benchmarks/kv_dtype.py --windows 1 --window-tokens 256 --contexts 128 --runs 1
    python benchmarks/kv_dtype.py --threads 2 --runs 5 --json benchmarks/results/kv_dtype.json
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from pathlib import Path

import record  # benchmarks/record.py
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def windows(tokenizer, n: int, length: int) -> list[list[int]]:
    """n windows of `length` tokens, each from the middle of another play."""
    from glassformer.data import shakespeare_plays

    plays = list(shakespeare_plays("modern").values())
    step = max(1, len(plays) // n)
    out = []
    for text in plays[::step][:n]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        middle = max(0, len(ids) // 2 - length // 2)
        out.append(ids[middle : middle + length])
    return out


@torch.inference_mode()
def perplexity(model, texts: list[list[int]], dtype: torch.dtype, chunk: int) -> float:
    """exp(mean negative log-likelihood) of every next token, the text fed through a cache of
    `dtype` in chunks (each chunk's attention reads the stored keys, its own included)."""
    total, count = 0.0, 0
    for ids in texts:
        cache = model.new_cache(1, len(ids), dtype=dtype)
        for start in range(0, len(ids) - 1, chunk):
            piece = ids[start : start + chunk]
            positions = torch.arange(start, start + len(piece))
            logits = model(torch.tensor([piece]), positions, cache=cache)[0].float()
            targets = torch.tensor(ids[start + 1 : start + 1 + len(piece)])
            logprobs = F.log_softmax(logits[: len(targets)], dim=-1)
            total -= logprobs[torch.arange(len(targets)), targets].sum().item()
            count += len(targets)
    return math.exp(total / count)


def greedy(engine, prompt: list[int], new_tokens: int):
    from glassformer.infer.sampling import NO_EOS, SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, eos_token_id=NO_EOS)
    row = engine.add(prompt, params)
    while not row.finished:
        engine.step()
    return row


def agreement(a: list[int], b: list[int]) -> int:
    """Tokens equal before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--window-tokens", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1536])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the rows here (benchmarks/results/)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import glassformer as gf
    from glassformer.cli.common import load_for_decode
    from glassformer.cli.precision import DecodeOptions
    from glassformer.nn.quant import precision_name

    model, tokenizer = load_for_decode("smollm2", DecodeOptions(threads=args.threads), "needed")
    texts = windows(tokenizer, args.windows, args.window_tokens)
    rows = {name: {"kv_dtype": name} for name in DTYPES}
    decoded = {}  # name -> each window's greedy tokens
    for name, dtype in DTYPES.items():
        rows[name]["perplexity"] = perplexity(model, texts, dtype, args.chunk)
        tokens = []
        for ids in texts:
            engine = gf.Engine(model, max_rows=1, kv_dtype=dtype)
            tokens.append(greedy(engine, ids[:256], args.new_tokens).tokens)
        decoded[name] = tokens
        rows[name]["bytes_per_token"] = engine.cache.kv_bytes_per_token
        print(f"{name}: perplexity {rows[name]['perplexity']:.4f}", flush=True)
    longest = max(args.contexts) + args.new_tokens
    engines = {
        name: gf.Engine(model, max_rows=1, max_seq_len=longest, kv_dtype=dtype)
        for name, dtype in DTYPES.items()
    }
    prompt = [t for ids in texts for t in ids]
    rates = {name: {c: [] for c in args.contexts} for name in DTYPES}
    for _ in range(args.runs + 1):  # the first round warms up
        for context in args.contexts:
            for name, engine in engines.items():
                row = greedy(engine, prompt[:context], args.new_tokens)
                rates[name][context].append(row.stats.decode_tokens_per_s)
    base = rows["fp32"]
    for name, row in rows.items():
        row["perplexity_change_percent"] = 100 * (row["perplexity"] / base["perplexity"] - 1)
        pairs = zip(decoded[name], decoded["fp32"], strict=True)
        same = sum(agreement(a, b) for a, b in pairs)
        row["same_greedy_tokens"] = same / sum(len(t) for t in decoded["fp32"])
        row["decode_tok_s"] = {str(c): statistics.median(rates[name][c][1:]) for c in args.contexts}
        speeds = ", ".join(f"{t:.1f} tok/s at {c}" for c, t in row["decode_tok_s"].items())
        print(
            f"{name}: {row['bytes_per_token']:,} B/token, perplexity {row['perplexity']:.4f} "
            f"({row['perplexity_change_percent']:+.3f}%), greedy tokens as fp32's "
            f"{row['same_greedy_tokens']:.0%}, decode {speeds}"
        )
    if args.json:
        settings = {
            "model": "SmolLM2-135M-Instruct",
            "weights": precision_name(model),
            "windows": args.windows,
            "window_tokens": args.window_tokens,
            "chunk": args.chunk,
            "new_tokens": args.new_tokens,
            "runs": args.runs,
        }
        record.write(args.json, args.threads, settings | {"rows": list(rows.values())})


if __name__ == "__main__":
    main()
