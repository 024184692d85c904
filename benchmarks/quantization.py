"""int8 and int4 weight-only quantization on SmolLM2-135M (issues 5, 19): what it costs in
perplexity and what it buys in bytes and decode speed, against fp32 and bf16, measured in one
run.

Contestants: the fp32 and bf16 models prepared by optimize_for_decode, int8 with one scale
per output row ("channel") or per row and group of 64 or 32 columns (--groups), int4 with a
scale and a min per 32 weights (llama.cpp's Q4_1 form), and w8a8 / w4a8: int8 in groups of 32
and int4 whose every input is rounded to int8 in groups of 32 too (round_inputs), the
arithmetic llama.cpp uses for Q8_0 and Q4_1 files. SmolLM2's only shipped weights are a
Q4_1 GGUF file, so "fp32" holds those values dequantized: int4 gives them back (to float
rounding), and its perplexity is fp32's; int8 rounds them again.

With llama.cpp's binaries built (bash benchmarks/build_llama_cpp.sh), --gguf adds GGUF files:
the shipped Q4_1 and llama-quantize's requantizations of it (Q4_0, Q4_K_M by default), each
loaded with quantize="int4" (its 4-bit blocks kept bit for bit, its Q6_K matrices at int8), and
for each file the perplexity llama.cpp itself computes on the same windows ("llama.cpp ppl",
benchmarks/llama_window_ppl.c): the same file read by two programs. llama.cpp multiplies Q4
blocks by activations rounded to 8 bits (Q8_1), so its column is the w4a8 arithmetic's, and the
two columns agree to that rounding.

Perplexity: the first --tokens tokens of one play (held-out text: SmolLM2 was not tuned on this
file), cut into non-overlapping --window-token windows; each window is scored on its own, every
position predicting the next (teacher forcing), ppl = exp(mean NLL). Target: int8 within 1% of
fp32. Decode: Engine.generate with a --prompt-tokens prompt and --new-tokens greedy tokens,
decode tokens/s from GenerationStats; contestants run interleaved (A B C A B C ...) so load
from other processes hits each alike; the median of --runs runs is shown.

    python benchmarks/quantization.py
    python benchmarks/quantization.py --tokens 1024 --runs 1   # a quick look
    python benchmarks/quantization.py --tokens 4096 --runs 3 \
        --json benchmarks/results/quantization.json             # the docs' table
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import record  # benchmarks/record.py
from llama_cpp_peer import requantized_smollm2, window_perplexity  # benchmarks/

from glassformer.data import shakespeare_plays
from glassformer.infer.engine import Engine
from glassformer.infer.optimize import optimize_for_decode
from glassformer.interop.pretrained import from_pretrained
from glassformer.nn.quant import quantize_int4, quantize_int8, round_inputs, weight_bytes


def held_out_ids(tokenizer, play: str, n_tokens: int) -> list[int]:
    plays = shakespeare_plays("modern")
    names = [name for name in plays if play in name]
    if not names:
        raise SystemExit(f"--play {play!r} matches no play: pick one of {', '.join(plays)}")
    ids = tokenizer.encode(plays[names[0]])
    if len(ids) < n_tokens:
        raise SystemExit(f"{names[0]} has {len(ids)} tokens < --tokens {n_tokens}: ask for fewer")
    return ids[:n_tokens]


@torch.inference_mode()
def perplexity(model, ids: list[int], window: int) -> float:
    """exp(mean next-token NLL) over non-overlapping windows scored independently."""
    total_nll, total_targets = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[start : start + window]])  # (1, T)
        if chunk.shape[1] < 2:
            break
        logits = model(chunk).float()  # (1, T, V)
        nll = F.cross_entropy(logits[0, :-1], chunk[0, 1:], reduction="sum")
        total_nll += float(nll)
        total_targets += chunk.shape[1] - 1
    return math.exp(total_nll / total_targets)


def decode_tokens_per_s(engine: Engine, prompt: list[int], new_tokens: int) -> float:
    result = engine.generate(prompt, max_new_tokens=new_tokens, temperature=0.0)
    return result.stats.decode_tokens_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="held-out tokens scored")
    parser.add_argument("--window", type=int, default=512, help="tokens per scored window")
    parser.add_argument("--play", default="hamlet", help="which play (a part of its file name)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5, help="decode runs per contestant")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 reference")
    parser.add_argument("--no-int4", action="store_true", help="skip int4")
    parser.add_argument("--no-a8", action="store_true", help="skip w8a8 and w4a8")
    parser.add_argument(
        "--gguf", nargs="*", default=["Q4_1", "Q4_0", "Q4_K_M"],
        help="GGUF files to load with quantize='int4' (needs llama.cpp's binaries; none: skip)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write every row here (benchmarks/results/)")
    parser.add_argument(
        "--groups",
        nargs="+",
        default=["channel", "64", "32"],
        help="int8 scale groups: 'channel' (one scale per output row) or a column count",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    fp32, tokenizer = from_pretrained("smollm2")
    models = {"fp32": optimize_for_decode(copy.deepcopy(fp32))}
    if not args.no_bf16:
        models["bf16"] = optimize_for_decode(copy.deepcopy(fp32), "bf16")
    for group in args.groups:
        group_size = None if group == "channel" else int(group)
        models[f"int8 {group}"] = quantize_int8(copy.deepcopy(fp32), group_size)
    if not args.no_int4:
        models["int4 32"] = quantize_int4(copy.deepcopy(fp32))
    if not args.no_a8:  # the inputs rounded to int8 too, as llama.cpp computes Q8_0 and Q4_1
        models["w8a8 32"] = round_inputs(quantize_int8(copy.deepcopy(fp32), 32))
        models["w4a8 32"] = round_inputs(quantize_int4(copy.deepcopy(fp32)))
    ids = held_out_ids(tokenizer, args.play, args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        files = requantized_smollm2(args.gguf, Path(tmp), args.threads)
        llama_ppl = {f"gguf {kind}": window_perplexity(path, ids, args.window, args.threads)
                     for kind, path in files.items()}  # fmt: skip
        for kind, path in files.items():
            models[f"gguf {kind}"] = from_pretrained(path, quantize="int4")[0]
    if args.gguf and not files:
        print("no llama-quantize: no GGUF rows (bash benchmarks/build_llama_cpp.sh builds it)\n")

    prompt = ids[: args.prompt_tokens]
    engines = {name: Engine(model, huge_pages=True) for name, model in models.items()}
    for engine in engines.values():  # warm-up: first calls allocate caches and pick kernels
        decode_tokens_per_s(engine, prompt, 4)
    speeds: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.runs):
        for name, engine in engines.items():
            speeds[name].append(decode_tokens_per_s(engine, prompt, args.new_tokens))
    ppl = {name: perplexity(model, ids, args.window) for name, model in models.items()}

    print(
        f"SmolLM2-135M, {args.threads} threads | perplexity on {args.tokens} tokens of "
        f"{args.play} in {args.window}-token windows | decode: {args.prompt_tokens}-token "
        f"prompt, {args.new_tokens} greedy tokens, median of {args.runs}"
    )
    print(f"{'weights':<13} {'MB':>8} {'ppl':>9} {'vs fp32':>9} {'decode tok/s':>13} "
          f"{'x fp32':>7} {'llama.cpp ppl':>14}")  # fmt: skip
    base_speed = statistics.median(speeds["fp32"])
    rows = []
    for name, model in models.items():
        speed = statistics.median(speeds[name])
        peer = f"{llama_ppl[name]:>14.3f}" if name in llama_ppl else ""
        print(
            f"{name:<13} {weight_bytes(model) / 1e6:>8.1f} {ppl[name]:>9.3f} "
            f"{100 * (ppl[name] / ppl['fp32'] - 1):>+8.2f}% {speed:>13.1f} "
            f"{speed / base_speed:>6.2f}x {peer}"
        )
        rows.append(
            {
                "weights": name,
                "mb": weight_bytes(model) / 1e6,
                "perplexity": ppl[name],
                "perplexity_vs_fp32_percent": 100 * (ppl[name] / ppl["fp32"] - 1),
                "decode_tok_s": speed,
                "decode_vs_fp32": speed / base_speed,
                "llama_cpp_perplexity": llama_ppl.get(name),
            }
        )
    if args.json:
        settings = {"model": "SmolLM2-135M", "tokens": args.tokens, "window": args.window}
        settings |= {"play": args.play, "prompt_tokens": args.prompt_tokens}
        settings |= {"new_tokens": args.new_tokens, "runs": args.runs}
        record.write(args.json, args.threads, {**settings, "rows": rows})


if __name__ == "__main__":
    main()
