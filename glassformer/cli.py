"""The command line: `glassformer train | generate | info` (also `python -m glassformer`).

Each subcommand parses its flags and calls one typed function. Errors a user can fix print one
clear line (set GLASSFORMER_DEBUG=1 for the traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from glassformer.config import ConfigError


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


# --- train ------------------------------------------------------------------------------------


def cmd_train(args: argparse.Namespace) -> None:
    from glassformer.train.config import load_run_config
    from glassformer.train.trainer import train

    run = load_run_config(args.config, args.set or [])
    result = train(run, resume=args.resume, progress=not args.no_progress)
    if result.val_loss is not None:
        print(
            f"done: {result.steps} steps | val loss {result.val_loss:.4f} nats/token vs "
            f"{result.unigram_entropy:.4f} for the unigram baseline (token frequencies alone) | "
            f"checkpoint in {result.out_dir}"
        )


# --- generate ---------------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> None:
    from glassformer.infer.engine import Engine
    from glassformer.tokenizers import IncrementalDecoder
    from glassformer.train.checkpoint import load

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model)
    if tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer.json: generate needs one to encode text")
    prompt_ids = tokenizer.encode(args.prompt)
    engine = Engine(model)
    stream = engine.stream(
        prompt_ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_token_id=tokenizer.eos_token_id,
        on_full_context=args.on_full_context,
    )
    decoder = IncrementalDecoder(tokenizer)
    sys.stdout.write(args.prompt)
    for token_id in stream:
        sys.stdout.write(decoder.push(token_id))
        sys.stdout.flush()
    sys.stdout.write(decoder.flush() + "\n")
    sys.stdout.flush()
    if args.stats:
        print_stats(stream.stats)


def print_stats(stats) -> None:
    print(
        f"[{stats.prompt_tokens} prompt tokens, {stats.generated_tokens} generated, "
        f"stop: {stats.stop_reason}] time to first token {stats.time_to_first_token_s * 1e3:.1f}"
        f" ms | decode {stats.decode_tokens_per_s:.1f} tok/s | prefill "
        f"{stats.prefill_tokens_per_s:.0f} tok/s | KV cache {stats.kv_cache_bytes / 1024:.1f} KiB"
        f" in use of {stats.kv_cache_capacity_bytes / 1024:.1f} KiB allocated"
        + (f" | context shifted {stats.context_shifts}x" if stats.context_shifts else ""),
        file=sys.stderr,
    )


# --- info -------------------------------------------------------------------------------------


def cmd_info(args: argparse.Namespace) -> None:
    from glassformer.calc import kv_cache_bytes_per_token, parameter_table
    from glassformer.train.checkpoint import load

    model, _ = load(args.model)
    cfg = model.cfg
    print(f"model: {args.model}")
    print(
        f"  family {cfg.family} | {cfg.n_layers} layers | d_model {cfg.d_model} | "
        f"{cfg.n_heads} heads ({cfg.n_kv_heads} kv heads, head_dim {cfg.head_dim}) | "
        f"d_ff {cfg.d_ff} | vocab {cfg.vocab_size} | context {cfg.max_seq_len}"
    )
    print(
        f"  position {cfg.position} | norm {cfg.norm} ({cfg.norm_position}) | ffn {cfg.ffn} | "
        f"tied embeddings {cfg.tie_embeddings}"
    )
    table = parameter_table(model)
    total = sum(table.values())
    print("\nparameters by component:")
    for name, count in sorted(table.items(), key=lambda kv: -kv[1]):
        per_layer = ""
        if name in ("attention", "ffn", "moe router"):
            per_layer = f"  ({count // cfg.n_layers:,} per layer)"
        print(f"  {name:<12} {count:>14,}  {100 * count / total:5.1f}%{per_layer}")
    print(f"  {'total':<12} {total:>14,}")
    print("\nKV cache per token (2 x layers x kv_heads x head_dim numbers):")
    for dtype in ("fp32", "bf16"):
        per_token = kv_cache_bytes_per_token(cfg, dtype)
        full = per_token * cfg.max_seq_len
        print(
            f"  {dtype}: {per_token:,} bytes/token | {full / 2**20:.2f} MiB for the full "
            f"{cfg.max_seq_len}-token context"
        )


# --- parser -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="glassformer",
        description="The Transformer of the tutorials, built from scratch: train, generate, "
        "inspect.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "train",
        help="train a model from a TOML config",
        description="Train a model. The TOML file has [model], [data] and [train] tables; see "
        "configs/ for examples.",
    )
    p.add_argument("--config", help="TOML run config, e.g. configs/shakespeare-char.toml")
    p.add_argument(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="override one config value, e.g. --set train.max_steps=200 --set model.n_layers=2 "
        "(repeatable)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in train.out_dir, exactly where it stopped",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "generate",
        help="generate text from a checkpoint",
        description="Prefill the prompt, then decode token by token with a KV cache, streaming.",
    )
    p.add_argument("prompt", help="the text to continue")
    p.add_argument("--model", required=True, help="checkpoint directory (a run's out_dir)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=200, help="default 200")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="divide logits by this before sampling; 0 = greedy (default 0.8)",
    )
    p.add_argument("--top-k", type=int, help="sample only among the k most likely tokens")
    p.add_argument(
        "--top-p",
        type=float,
        help="sample from the smallest set of tokens whose probability is >= p",
    )
    p.add_argument("--seed", type=int, help="seed for reproducible sampling")
    p.add_argument(
        "--on-full-context",
        choices=("shift", "stop"),
        default="shift",
        help="when the context window fills up: keep its second half and go on (shift, the "
        "default), or stop",
    )
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--stats",
        action="store_true",
        help="print time to first token, decode tokens/s and KV-cache bytes",
    )
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "info",
        help="parameters by component and KV-cache bytes of a checkpoint",
        description="Show a model's shape, its parameter table and its KV-cache cost per token.",
    )
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.set_defaults(func=cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (ConfigError, ValueError, FileNotFoundError) as err:
        if os.environ.get("GLASSFORMER_DEBUG"):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
