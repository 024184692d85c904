"""Prefix reuse across chat turns on SmolLM2-135M-Instruct (issue 13).

A chat re-renders the whole conversation every turn. Without reuse, turn N prefills every
token of the history again; with it, the Engine keeps the conversation's KV cache between
turns (a parked row) and prefills only the tokens after the prefix the new prompt shares with
the cached one: the user's new message and the template's markers around it.

This script holds a 5-turn conversation through ChatSession (greedy, --reply-tokens per
reply) and times the 5th turn's time to first token two ways on the same prompt: the session,
which reuses its cache, and a fresh Engine that prefills the whole conversation. It prints the
prompt and cached token counts, both times (median of --runs conversations) and their ratio,
and checks that both produce the same reply tokens.

    python benchmarks/chat_prefix.py
    python benchmarks/chat_prefix.py --runs 1 --reply-tokens 8   # a quick check
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from glassformer.chat import ChatSession
from glassformer.infer.engine import Engine
from glassformer.infer.optimize import optimize_for_decode
from glassformer.infer.sampling import SamplingParams
from glassformer.interop.pretrained import from_pretrained

MESSAGES = [
    "Tell me about the planets of the solar system, one sentence each.",
    "Which of them has the most moons, and how many are known?",
    "Explain in a few sentences why Venus is hotter than Mercury.",
    "Now write a short poem about Saturn's rings.",
    "Summarize our conversation so far in two sentences.",
]


def one_conversation(model, tokenizer, reply_tokens: int) -> dict:
    greedy = SamplingParams(max_new_tokens=reply_tokens, temperature=0.0)
    session = ChatSession(Engine(model), tokenizer, sampling=greedy)
    for message in MESSAGES:
        reply = session.send(message, write=lambda _: None)
    prompt = reply.prompt_ids  # the 5th turn's whole conversation
    fresh = Engine(model).generate(
        prompt, reply_tokens, temperature=0.0, eos_token_id=tokenizer.eos_token_id,
        stop_token_ids=sorted(session.stop_ids),
    )  # fmt: skip
    fresh_tokens = [t for t in fresh.token_ids if t not in session.stop_ids]
    return {
        "prompt": len(prompt),
        "cached": reply.stats.cached_prompt_tokens,
        "reuse_s": reply.stats.time_to_first_token_s,
        "prefill_s": fresh.stats.time_to_first_token_s,
        "same": fresh_tokens == reply.token_ids,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Time to first token of a chat's 5th turn: cache reuse vs full prefill.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default="smollm2", help="alias or path for from_pretrained")
    parser.add_argument("--reply-tokens", type=int, default=48, help="greedy tokens per reply")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--runs", type=int, default=5, help="conversations; the median is shown")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = from_pretrained(args.model)
    model = optimize_for_decode(model)  # the decode kernels, as `chat` runs
    one_conversation(model, tokenizer, 2)  # warm-up
    runs = [one_conversation(model, tokenizer, args.reply_tokens) for _ in range(args.runs)]
    reuse = statistics.median(r["reuse_s"] for r in runs)
    prefill = statistics.median(r["prefill_s"] for r in runs)
    first = runs[0]
    print(
        f"{args.model}: 5-turn chat, {args.reply_tokens} greedy tokens per reply | threads "
        f"{torch.get_num_threads()} | median of {args.runs} | torch {torch.__version__}"
    )
    print(f"5th turn: {first['prompt']} prompt tokens, {first['cached']} reused from turn 4")
    print(f"time to first token, reusing the cache: {1000 * reuse:8.1f} ms")
    print(f"time to first token, full prefill:      {1000 * prefill:8.1f} ms")
    same = "yes" if all(r["same"] for r in runs) else "NO"
    print(f"speedup {prefill / reuse:.1f}x | same reply tokens both ways: {same}")


if __name__ == "__main__":
    main()
