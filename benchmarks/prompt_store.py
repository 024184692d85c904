"""The server's prompt store (`glassformer serve --prompt-store-mb`, llama-server's --cache-ram):
time to first token of a prompt that comes back after its parked row was evicted.

One server with one running row and one parked slot (--max-batch 1), the shipped SmolLM2 Q4_1
file, the official `openai` client, streaming: a prompt with its own --head-tokens head (a
window of Shakespeare) is answered and parks; another prompt parks and evicts it; then the
first head comes back with a new question. With the store its keys/values are copied from
there (usage's cached_tokens); with --prompt-store-mb 0 it is prefilled again. Both servers in
turn, --rounds heads each; medians.

    python benchmarks/prompt_store.py
    python benchmarks/prompt_store.py --head-tokens 512 --rounds 7 \\
        --json benchmarks/results/prompt_store.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import openai
import record  # benchmarks/record.py
from serve_peer import text_prompts
from servers import glassformer_server

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def first_token(client: openai.OpenAI, model: str, prompt: str) -> tuple[float, int]:
    """Seconds to the first streamed token, and the prompt tokens the server had cached."""
    sent, first, cached = time.perf_counter(), None, 0
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - sent
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    return first, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write every row here (benchmarks/results/)")
    args = parser.parse_args()
    from glassformer.interop.gguf import read_gguf, tokenizer_from_gguf
    from glassformer.interop.pretrained import resolve

    source = resolve("smollm2")
    tokenizer = tokenizer_from_gguf(read_gguf(source))
    heads = text_prompts(tokenizer, 2 * args.rounds, args.head_tokens, first=1)
    rows = []
    for store_mb in (1024, 0):
        serve = ["--model", str(source), "--max-batch", "1", "--prompt-store-mb", str(store_mb)]
        with glassformer_server(serve, args.threads) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
            model = client.models.list().data[0].id
            first_token(client, model, "A warm-up.")
            times, cached = [], []
            for i in range(args.rounds):
                first_token(client, model, heads[2 * i] + "\nWho speaks first?")  # parks
                first_token(client, model, heads[2 * i + 1] + "\nWho speaks?")  # evicts it
                seconds, held = first_token(client, model, heads[2 * i] + "\nWho speaks last?")
                times.append(seconds)
                cached.append(held)
        row = {"prompt_store_mb": store_mb, "ttft_s": statistics.median(times),
               "cached_tokens": statistics.median(cached), "ttfts_s": times}  # fmt: skip
        rows.append(row)
        print(
            f"--prompt-store-mb {store_mb:4d}: the returning prompt's first token after "
            f"{row['ttft_s']:.3f} s (median of {args.rounds}), {row['cached_tokens']:.0f} of its "
            "tokens cached",
            flush=True,
        )
    if args.json:
        settings = {"model": "SmolLM2-135M Q4_1", "head_tokens": args.head_tokens,
                    "rounds": args.rounds}  # fmt: skip
        record.write(args.json, args.threads, settings | {"rows": rows})


if __name__ == "__main__":
    main()
