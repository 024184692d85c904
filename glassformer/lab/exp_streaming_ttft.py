"""Seed 002 「KV Cache：为什么第一个 token 慢，后面的快」: calling an API, the first token waits
longest and the rest pour out. A real `glassformer serve` (SmolLM2-135M-Instruct, prefix reuse
off, so every request prefills its whole prompt) is streamed with the official openai client at
several prompt lengths, each repeated; the client times the first token (TTFT: request sent to
first text) and the gaps between the tokens after it, the two numbers the seed says to read.
"""

from __future__ import annotations

import itertools
import statistics
import time

from glassformer.data.corpus import corpus_text
from glassformer.lab import base as lab
from glassformer.lab.serving import Served, serve

# Thresholds. "等得最久": at every prompt length the median first-token time is at least twice
# the median gap between later tokens, and longer than the longest gap of its stream in most
# streams (the rest may meet a scheduler stall on a shared machine). "后面哗哗地吐" while the
# prompt grows: from the shortest to the longest prompt (16x the tokens) the first-token time at
# least doubles (prefill grows with the prompt) while the median gap grows by under 50% (a
# decode step reads every weight; the cache it adds stays small beside them at these lengths).
TTFT_OVER_GAP = 2.0
LONGEST_SHARE = 0.8
TTFT_GROWTH = 2.0
GAP_GROWTH = 1.5


def prompt_ids(tokenizer, n_tokens: int, offset: int) -> list[int]:
    """n_tokens of Shakespeare from a character offset: real text, so the model's replies are
    ordinary English and every prompt is read at the same cost per token."""
    text = corpus_text("modern")[offset : offset + 8 * n_tokens]
    ids = tokenizer.encode(text)
    if len(ids) < n_tokens:
        raise ValueError(f"{len(ids)} tokens at offset {offset}: fewer than {n_tokens}")
    return ids[:n_tokens]


def stream_times(served: Served, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion timed at the client: TTFT, the gaps between later text chunks,
    and the server's usage (tokens billed)."""
    client = served.client()
    start = time.perf_counter()
    stream = client.completions.create(
        model=served.name,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    arrivals, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter())
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    if len(arrivals) < 3 or usage is None:
        raise RuntimeError(f"a stream of {max_tokens} tokens brought {len(arrivals)} text chunks")
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return {"ttft_s": arrivals[0] - start, "gaps_s": gaps, "usage": usage}


def measure(served: Served, lengths: tuple, max_tokens: int, repeats: int) -> dict[int, list]:
    """Streams by prompt length; the lengths interleaved in every repeat, so a slow spell of the
    machine falls on all of them alike, after one warm-up stream at the longest."""
    tokenizer = served.tokenizer
    stream_times(served, prompt_ids(tokenizer, max(lengths), 0), max_tokens)
    streams = {n: [] for n in lengths}
    for repeat in range(repeats):
        for n in lengths:
            prompt = prompt_ids(tokenizer, n, 20_000 * (repeat + 1) + 997 * n)
            streams[n].append(stream_times(served, prompt, max_tokens))
    return streams


def summary(streams: list[dict]) -> dict:
    """Medians over the repeats: TTFT, each stream's median and longest gap, and the share of
    streams whose first token took longer than any later gap."""
    return {
        "ttft_s": statistics.median(s["ttft_s"] for s in streams),
        "gap_s": statistics.median(statistics.median(s["gaps_s"]) for s in streams),
        "longest_gap_s": statistics.median(max(s["gaps_s"]) for s in streams),
        "first_longest": sum(s["ttft_s"] > max(s["gaps_s"]) for s in streams) / len(streams),
        "ttft_spread_s": statistics.stdev(s["ttft_s"] for s in streams),
    }


@lab.register("streaming-ttft")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    lengths = ctx.pick((64, 256, 1024), (64, 256, 1024), (8, 32, 128))
    max_tokens = ctx.pick(32, 16, 8)
    repeats = ctx.pick(5, 3, 3)
    with serve(ctx, max_seq_len=max(lengths) + max_tokens + 8) as served:
        streams = measure(served, lengths, max_tokens, repeats)
        description = served.description
    say, stats = ctx.say, {n: summary(streams[n]) for n in lengths}
    checks = [
        lab.precondition(
            lab.at_least(
                say("streams whose billed prompt is the prompt sent", "计费提示等于所发提示的流"),
                sum(s["usage"]["prompt_tokens"] == n for n in lengths for s in streams[n]),
                len(lengths) * repeats,
            )
        )
    ]
    group = say("the first token waits longest", "第一个 token 等得最久")
    for n in lengths:
        checks.append(
            lab.at_least(
                say(
                    f"{n}-token prompt: TTFT / median gap between later tokens",
                    f"{n} token 的提示：TTFT / 后续 token 间隔的中位数",
                ),
                stats[n]["ttft_s"] / stats[n]["gap_s"],
                TTFT_OVER_GAP,
                group=group,
            )
        )
        checks.append(
            lab.at_least(
                say(
                    f"{n}-token prompt: share of streams whose TTFT exceeds every later gap",
                    f"{n} token 的提示：TTFT 超过其后每个间隔的流所占比例",
                ),
                stats[n]["first_longest"],
                LONGEST_SHARE,
                group=group,
            )
        )
    short, long = stats[lengths[0]], stats[lengths[-1]]
    group = say(
        "TTFT grows with the prompt, the pace after it does not",
        "TTFT 随提示变长而增长，之后的吐字速度不变",
    )
    checks.append(
        lab.at_least(
            say(
                f"TTFT, {lengths[-1]} / {lengths[0]} tokens",
                f"TTFT，{lengths[-1]} / {lengths[0]} token",
            ),
            long["ttft_s"] / short["ttft_s"],
            TTFT_GROWTH,
            group=group,
        )
    )
    checks.append(
        lab.at_most(
            say(
                f"median gap, {lengths[-1]} / {lengths[0]} tokens",
                f"间隔中位数，{lengths[-1]} / {lengths[0]} token",
            ),
            long["gap_s"] / short["gap_s"],
            GAP_GROWTH,
            group=group,
        )
    )
    rows = [_row(say, n, stats[n]) for n in lengths]
    notes = _notes(say, description, lengths, stats, max_tokens, repeats)
    data = {str(n): {"summary": stats[n], "streams": streams[n]} for n in lengths}
    return lab.Result.from_checks(
        rows, checks, figure=_plot(lengths, streams, stats), data=data, notes=notes
    )


def _row(say, n: int, s: dict) -> dict:
    return {
        say("prompt tokens", "提示 token 数"): n,
        say("TTFT ms (median)", "TTFT 毫秒（中位数）"): 1000 * s["ttft_s"],
        say("TTFT ms, spread over repeats", "TTFT 毫秒，重复间的波动（标准差）"): 1000
        * s["ttft_spread_s"],
        say("median gap ms", "间隔中位数（毫秒）"): 1000 * s["gap_s"],
        say("longest gap ms (median)", "最长间隔毫秒（中位数）"): 1000 * s["longest_gap_s"],
        say("tokens/s after the first", "首个之后的 token/秒"): 1 / s["gap_s"],
        say("TTFT / median gap", "TTFT / 间隔中位数"): s["ttft_s"] / s["gap_s"],
    }


def _notes(say, description, lengths, stats, max_tokens, repeats) -> list[str]:
    short, long = stats[lengths[0]], stats[lengths[-1]]
    per_token = (long["ttft_s"] - short["ttft_s"]) / (lengths[-1] - lengths[0])
    return [
        say(
            f"model: {description}, one torch thread, prefix reuse off; {repeats} streams of "
            f"{max_tokens} tokens per prompt length (end of turn ignored), timed at the client",
            f"模型：{description}，单个 torch 线程，关闭前缀复用；每种提示长度流式生成 "
            f"{repeats} 次、每次 {max_tokens} 个 token（忽略结束符），在客户端计时",
        ),
        say(
            f"the first token: {1000 * short['ttft_s']:.0f} ms after {lengths[0]} prompt tokens, "
            f"{1000 * long['ttft_s']:.0f} ms after {lengths[-1]} ({1000 * per_token:.2f} ms per "
            f"extra prompt token); the tokens after it: every {1000 * short['gap_s']:.0f} to "
            f"{1000 * long['gap_s']:.0f} ms",
            f"第一个 token：{lengths[0]} 个提示 token 后 {1000 * short['ttft_s']:.0f} 毫秒，"
            f"{lengths[-1]} 个后 {1000 * long['ttft_s']:.0f} 毫秒（每多一个提示 token 多 "
            f"{1000 * per_token:.2f} 毫秒）；之后的 token：每 {1000 * short['gap_s']:.0f} 到 "
            f"{1000 * long['gap_s']:.0f} 毫秒一个",
        ),
    ]


def _plot(lengths, streams, stats):
    fig, (left, right) = lab.new_figure(9.0, 3.6, ncols=2)
    longest = streams[lengths[-1]][0]
    times = [longest["ttft_s"]]
    for gap in longest["gaps_s"]:
        times.append(times[-1] + gap)
    left.plot(range(1, len(times) + 1), [1000 * t for t in times], "o-", markersize=3)
    left.set_xlabel(f"token of the reply ({lengths[-1]}-token prompt, first stream)")
    left.set_ylabel("arrival since the request (ms)")
    left.set_title("第一个 token 等得最久，后面哗哗地吐", fontsize=9)
    ttft = [1000 * stats[n]["ttft_s"] for n in lengths]
    spread = [1000 * stats[n]["ttft_spread_s"] for n in lengths]
    right.errorbar(lengths, ttft, yerr=spread, fmt="o-", capsize=3, label="TTFT (± spread)")
    right.plot(lengths, [1000 * stats[n]["gap_s"] for n in lengths], "s--", label="median gap")
    right.set_xscale("log", base=2)
    right.set_xticks(lengths, [str(n) for n in lengths])
    right.set_xlabel("prompt length (tokens)")
    right.set_ylabel("milliseconds")
    right.set_title("TTFT 随提示增长，间隔不变", fontsize=9)
    right.legend(fontsize=7)
    return fig
