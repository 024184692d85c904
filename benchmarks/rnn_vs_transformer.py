"""RNN vs Transformer training speed against sequence length (seed 000 §1.3, §2.2).

An LSTM must compute h(t) from h(t-1): T sequential steps per layer. A GPT reads all T positions
in one pass (teacher forcing + causal mask). This script times one training step (forward +
backward, no optimizer) for an LSTM and a GPT of about the same parameter count at sequence
lengths 64..1024, with the batch sized so every step holds the same number of tokens: the work
per step is about the same (6 N FLOPs per token, plus attention's T-proportional term for the
GPT), and what changes is how many sequential steps the LSTM needs and how small each one gets.

A second table times the recurrent cells at one length and the same hidden size: the tutorial's
tanh cell looped in Python (glassformer.models.rnn.RNNCell), torch's fused GRU and LSTM.

Each figure is the median over --runs timed steps after --warmup untimed ones; models are
interleaved (A B A B ...) so load from other processes hits both alike.

    python benchmarks/rnn_vs_transformer.py
    python benchmarks/rnn_vs_transformer.py --lengths 64,256 --runs 3
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from torch import nn

from glassformer.config import ModelConfig
from glassformer.models import build_model


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def lstm_d_model_for(target: int, vocab_size: int, n_layers: int) -> int:
    """The hidden size whose tied LSTM LM has about `target` parameters: per layer
    8C^2 + 8C (torch keeps two bias vectors per gate), plus V*C embedding and 2C norm."""
    a, b, c = 8 * n_layers, 8 * n_layers + vocab_size + 2, -target
    return round((-b + math.sqrt(b * b - 4 * a * c)) / (2 * a))


def time_step(model: nn.Module, ids: torch.Tensor) -> float:
    """Seconds for one forward + backward over ids (B, T)."""
    start = time.perf_counter()
    model.loss(ids, ids).loss.backward()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def median_times(models: dict[str, nn.Module], ids: torch.Tensor, warmup: int, runs: int):
    for model in models.values():
        for _ in range(warmup):
            time_step(model, ids)
    seconds: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(runs):
        for name, model in models.items():  # interleaved
            seconds[name].append(time_step(model, ids))
    return {name: statistics.median(s) for name, s in seconds.items()}


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Training step latency and tokens/s vs sequence length: LSTM vs GPT at "
        "equal parameter count and equal tokens per step.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--lengths", default="64,128,256,512,1024", help="sequence lengths")
    parser.add_argument("--tokens-per-step", type=int, default=4096, help="batch x length")
    parser.add_argument("--preset", default="tiny-shakespeare", help="the GPT's preset")
    parser.add_argument("--lstm-layers", type=int, default=2, help="LSTM layers")
    parser.add_argument("--vocab-size", type=int, default=65, help="vocabulary (characters)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--runs", type=int, default=5, help="timed steps; the median is shown")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per model first")
    parser.add_argument("--cell-length", type=int, default=256, help="length for the cell table")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    lengths = [int(x) for x in args.lengths.split(",")]
    longest = max(lengths)
    gpt_cfg = ModelConfig.preset(args.preset, vocab_size=args.vocab_size, max_seq_len=longest)
    gpt = build_model(gpt_cfg).train()
    C = lstm_d_model_for(n_params(gpt), args.vocab_size, args.lstm_layers)
    lstm_cfg = ModelConfig(
        family="rnn", cell="lstm", vocab_size=args.vocab_size, d_model=C,
        n_layers=args.lstm_layers, n_heads=1, max_seq_len=longest,
    )  # fmt: skip
    lstm = build_model(lstm_cfg).train()
    print(
        f"GPT ({args.preset}: {gpt_cfg.n_layers} layers, d_model {gpt_cfg.d_model}, "
        f"{gpt_cfg.attention_backend}) {n_params(gpt):,} params | LSTM ({args.lstm_layers} "
        f"layers, d_model {C}) {n_params(lstm):,} params | vocab {args.vocab_size}"
    )
    print(
        f"{args.tokens_per_step} tokens/step | threads {torch.get_num_threads()} | median of "
        f"{args.runs} steps after {args.warmup} warmup | forward + backward | "
        f"torch {torch.__version__}"
    )
    print()

    rows = []
    for T in lengths:
        B = max(1, args.tokens_per_step // T)
        ids = torch.randint(args.vocab_size, (B, T))
        med = median_times({"lstm": lstm, "gpt": gpt}, ids, args.warmup, args.runs)
        tokens = B * T
        rows.append(
            [
                str(T), str(B), str(args.lstm_layers * T),
                f"{med['lstm'] * 1e3:,.0f}", f"{med['gpt'] * 1e3:,.0f}",
                f"{tokens / med['lstm']:,.0f}", f"{tokens / med['gpt']:,.0f}",
                f"{med['lstm'] / med['gpt']:.2f}x",
            ]
        )  # fmt: skip
    header = ["T", "B", "LSTM seq. steps", "LSTM ms", "GPT ms", "LSTM tok/s", "GPT tok/s"]
    print_table([*header, "LSTM/GPT time"], rows)
    print(
        "LSTM seq. steps: cell applications that must run one after another (layers x T); "
        "the GPT's\nare its layers, whatever T. LSTM/GPT time > 1: the Transformer trains faster."
    )

    print()
    T = args.cell_length
    B = max(1, args.tokens_per_step // T)
    ids = torch.randint(args.vocab_size, (B, T))
    cells = {
        cell: build_model(lstm_cfg.replace(cell=cell)).train() for cell in ("rnn", "gru", "lstm")
    }
    med = median_times(cells, ids, args.warmup, args.runs)
    rows = [
        [
            name, f"{n_params(cells[name]):,}", f"{med[name] * 1e3:,.0f}",
            f"{B * T / med[name]:,.0f}", f"{med[name] / med['lstm']:.2f}x",
        ]
        for name in cells
    ]  # fmt: skip
    print(f"cells at d_model {C}, {args.lstm_layers} layers, T {T}, B {B}:")
    print_table(["cell", "params", "ms/step", "tok/s", "time vs nn.LSTM"], rows)
    print(
        "rnn: the tutorial's h = tanh(W_xh x + W_hh h + b), a Python loop over time (W_xh for all\n"
        "positions at once); gru/lstm: torch's fused kernels, with 3x/4x the recurrent weights."
    )


if __name__ == "__main__":
    main()
