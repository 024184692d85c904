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
            f"{result.baseline_loss:.4f} for the {result.baseline_name} baseline | "
            f"checkpoint in {result.out_dir}"
        )


# --- generate ---------------------------------------------------------------------------------


def _load_with_tokenizer(args: argparse.Namespace, why: str):
    """Set threads, then load --model with its tokenizer (which text commands need)."""
    from glassformer.interop.pretrained import from_pretrained

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, tokenizer = from_pretrained(args.model)
    if tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer.json: {why}")
    return model, tokenizer


def cmd_generate(args: argparse.Namespace) -> None:
    from glassformer.infer.engine import Engine
    from glassformer.tokenizers import IncrementalDecoder

    model, tokenizer = _load_with_tokenizer(args, "generate needs one to encode text")
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
        if token_id == tokenizer.eos_token_id:
            continue  # the end-of-sequence marker is a stop signal, not text
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
    from glassformer.interop.pretrained import from_pretrained

    model, _ = from_pretrained(args.model)
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


# --- embed ------------------------------------------------------------------------------------


def cmd_embed(args: argparse.Namespace) -> None:
    from glassformer.infer.embed import cosine_similarity_matrix, embed
    from glassformer.interop.pretrained import from_pretrained

    model, tokenizer = from_pretrained(args.model)
    if tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer.json: embed needs one to encode text")
    limit = min(args.max_tokens or model.cfg.max_seq_len, model.cfg.max_seq_len)
    sequences = []
    for number, sentence in enumerate(args.sentences, 1):
        ids = tokenizer.encode(sentence)
        if len(ids) > limit:
            print(
                f"note: [{number}] has {len(ids)} tokens; using the first {limit}", file=sys.stderr
            )
            ids = ids[: limit - 1] + ids[-1:]  # keep the closing special token ([SEP])
        sequences.append(ids)
    vectors = embed(model, sequences)  # (N, C), unit length
    shown = vectors.shape[1] if args.full else min(8, vectors.shape[1])
    for number, (sentence, ids, vector) in enumerate(
        zip(args.sentences, sequences, vectors, strict=True), 1
    ):
        values = " ".join(f"{v:+.4f}" for v in vector[:shown].tolist())
        more = "" if shown == len(vector) else f" ... ({len(vector) - shown} more; --full)"
        print(f"[{number}] {sentence!r}: {len(ids)} tokens -> {len(vector)} dims")
        print(f"    [{values}{more}]")
    if args.similarity:
        print_similarity(cosine_similarity_matrix(vectors).tolist())


def print_similarity(matrix: list[list[float]]) -> None:
    labels = [f"[{i}]" for i in range(1, len(matrix) + 1)]
    print("\ncosine similarity:")
    print(" " * 6 + "".join(f"{label:>9}" for label in labels))
    for label, row in zip(labels, matrix, strict=True):
        print(f"{label:<6}" + "".join(f"{value:>9.4f}" for value in row))


# --- convert ----------------------------------------------------------------------------------


def cmd_convert(args: argparse.Namespace) -> None:
    from glassformer.interop.convert import convert_to_hf

    report = convert_to_hf(args.src, args.out, model_type=args.model_type)
    print(f"wrote a Hugging Face {report.model_type} model to {report.out_dir}:")
    for name in report.files:
        print(f"  {name}")
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    print(
        f"load it with transformers: AutoModelForCausalLM.from_pretrained({str(report.out_dir)!r})"
    )


# --- chat -------------------------------------------------------------------------------------


def cmd_chat(args: argparse.Namespace) -> None:
    from glassformer.chat import ChatSession, SamplingOptions, run_chat
    from glassformer.infer.engine import Engine

    model, tokenizer = _load_with_tokenizer(args, "chat needs one with a chat template")
    sampling = SamplingOptions(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    run_chat(ChatSession(Engine(model), tokenizer, system=args.system, sampling=sampling))


# --- parser -----------------------------------------------------------------------------------


def _add_sampling_flags(
    p: argparse.ArgumentParser, max_new_tokens: int, temperature: float
) -> None:
    """The flags shared by generate and chat: how many tokens, how to sample, threads."""
    p.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=max_new_tokens,
        help=f"most tokens to generate (default {max_new_tokens})",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=temperature,
        help=f"divide logits by this before sampling; 0 = greedy (default {temperature})",
    )
    p.add_argument("--top-k", type=int, help="sample only among the k most likely tokens")
    p.add_argument(
        "--top-p",
        type=float,
        help="sample from the smallest set of tokens whose probability is >= p",
    )
    p.add_argument("--seed", type=int, help="seed for reproducible sampling")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")


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
    p.add_argument(
        "--model",
        required=True,
        help="checkpoint directory (a run's out_dir), alias (smollm2), Hugging Face folder or "
        ".gguf file",
    )
    _add_sampling_flags(p, max_new_tokens=200, temperature=0.8)
    p.add_argument(
        "--on-full-context",
        choices=("shift", "stop"),
        default="shift",
        help="when the context window fills up: keep its second half and go on (shift, the "
        "default), or stop",
    )
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
    p.add_argument(
        "--model",
        required=True,
        help="checkpoint directory, alias (smollm2), Hugging Face folder or .gguf file",
    )
    p.set_defaults(func=cmd_info)

    p = sub.add_parser(
        "chat",
        help="interactive chat with a pretrained model (e.g. --model smollm2)",
        description="Chat in the terminal: each turn is rendered with the model's chat template, "
        "the reply streams as it is generated, and time to first token and tokens/s follow it. "
        "/reset clears the conversation, /exit or Ctrl-D quits, Ctrl-C stops a reply.",
    )
    p.add_argument(
        "--model", required=True, help="alias (smollm2), Hugging Face folder or .gguf file"
    )
    p.add_argument("--system", help="a system message that opens the conversation")
    _add_sampling_flags(p, max_new_tokens=512, temperature=0.7)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser(
        "embed",
        help="sentence embeddings from an encoder (e.g. --model minilm)",
        description="Encode each sentence, mean-pool the encoder's hidden states over its tokens "
        "and L2-normalize (the sentence-transformers recipe). Prints each embedding and, with "
        "--similarity, the cosine similarity matrix.",
    )
    p.add_argument("sentences", nargs="+", metavar="SENTENCE", help="the texts to embed")
    p.add_argument("--model", required=True, help="alias (minilm) or a Hugging Face BERT folder")
    p.add_argument("--similarity", action="store_true", help="print the cosine matrix")
    p.add_argument("--full", action="store_true", help="print every value, not the first 8")
    p.add_argument(
        "--max-tokens",
        type=_positive_int,
        help="cut longer inputs to this many tokens (default: the model's max_seq_len; "
        "sentence-transformers uses 256 for MiniLM)",
    )
    p.set_defaults(func=cmd_embed)

    p = sub.add_parser(
        "convert",
        help="write a model as a Hugging Face folder (safetensors + config.json + tokenizer)",
        description="Convert SRC (an alias such as smollm2, a Hugging Face folder, a GGUF file "
        "or a glassformer checkpoint) into a folder that transformers loads with "
        "AutoModelForCausalLM.from_pretrained and runs with the same logits.",
    )
    p.add_argument("src", metavar="SRC", help="alias, Hugging Face folder, .gguf or checkpoint")
    p.add_argument("out", metavar="OUT", help="folder to write")
    p.add_argument(
        "--to", required=True, choices=("hf",), help="output format: hf (Hugging Face folder)"
    )
    p.add_argument(
        "--model-type",
        help="Hugging Face architecture to write (gpt2, llama, qwen2, mistral, mixtral; default: "
        "the source's own, or the closest to its config)",
    )
    p.set_defaults(func=cmd_convert)
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
