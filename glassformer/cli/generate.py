"""`glassformer generate`: stream a continuation of one prompt, generate several as one batch,
or run a torch.compile'd decode step (--compile). Text is encoded and decoded here; the engine
sees token ids only."""

from __future__ import annotations

import argparse
import sys

from torch import nn

from glassformer.cli.common import (
    DecodeOptions,
    add_command,
    add_decode_flags,
    add_sampling_flags,
    add_thinking_flags,
    decode_engine,
    load_for_decode,
    positive_int,
    sampling_kwargs,
    thinking_options,
)
from glassformer.infer.stats import format_batch_stats, format_stats


def cmd_generate(args: argparse.Namespace) -> None:
    """generate text from a checkpoint

    Prefill the prompt, then decode token by token with a KV cache, streaming. Several prompts
    are generated together, each a row of the engine at its own position, and printed numbered
    when all are done.
    """
    from glassformer.infer.sampling import check_logit_bias_ids

    options = DecodeOptions.from_args(args, compile=args.compile)
    model, tokenizer = load_for_decode(args.model, options, "generate needs one to encode text")
    check_logit_bias_ids(sampling_kwargs(args, None)["logit_bias"], model.cfg.vocab_size)
    if args.show_top and (len(args.prompt) > 1 or args.compile):
        raise ValueError("--show-top follows one prompt on the engine: drop --compile and give one")
    args.thinking, args.prompt_suffix = thinking_options(args, tokenizer, args.model)
    engine = decode_engine(model, tokenizer, options)
    if args.show_top:
        _generate_show_top(args, engine, tokenizer)
    elif len(args.prompt) > 1:
        _generate_batch(args, engine, tokenizer)
    elif args.compile:
        _generate_compiled(args, model, tokenizer)
    else:
        _generate_stream(args, engine, tokenizer)


def _generate_stream(args: argparse.Namespace, engine, tokenizer) -> None:
    """One prompt: print it, then each piece of text as soon as its tokens are complete."""
    from glassformer.detokenize import IncrementalDecoder, StopStringsAfter

    prompt = args.prompt[0]
    stream = engine.stream(
        _encode(args, tokenizer, prompt),
        **sampling_kwargs(args, tokenizer.eos_token_id),
        **args.thinking,
        on_full_context=args.on_full_context,
    )
    # The engine's rule for the printed text: stop strings match after --min-tokens tokens.
    decoder = IncrementalDecoder(tokenizer)
    stop_strings = StopStringsAfter(args.stop, args.min_tokens)
    sys.stdout.write(prompt)
    for n_generated, token_id in enumerate(stream, start=1):
        if token_id == tokenizer.eos_token_id:
            continue  # the end-of-sequence marker is a stop signal, not text
        sys.stdout.write(stop_strings.push_token(decoder.push(token_id), n_generated))
        sys.stdout.flush()
    sys.stdout.write(stop_strings.push(decoder.finish()) + stop_strings.flush() + "\n")
    sys.stdout.flush()
    if args.stats:
        print(format_stats(stream.stats), file=sys.stderr)


def _generate_show_top(args: argparse.Namespace, engine, tokenizer) -> None:
    """--show-top N: for each step, the N most likely next tokens with their probabilities
    under the model's distribution (before temperature and the cuts) and the token chosen,
    then the whole text. The numbers are the engine's logprobs (SamplingParams.logprobs)."""
    import math

    from glassformer.infer.sampling import SamplingParams

    params = SamplingParams(
        **sampling_kwargs(args, tokenizer.eos_token_id), **args.thinking, logprobs=args.show_top
    )
    row = engine.add(
        _encode(args, tokenizer, args.prompt[0]), params, on_full_context=args.on_full_context
    )
    print(f"prompt: {args.prompt[0]!r}")
    for step, token_id in enumerate(engine.follow(row), start=1):
        entry = row.logprobs[step - 1]
        candidates = "  ".join(
            f"{tokenizer.decode([i])!r} {math.exp(logp):.3f}" for i, logp in entry.top
        )
        chosen = f"{tokenizer.decode([token_id])!r} {math.exp(entry.logprob):.3f}"
        print(f"step {step:>3}: chose {chosen:<24} | top: {candidates}")
    ids = [t for t in row.tokens if t != tokenizer.eos_token_id]
    print(args.prompt[0] + tokenizer.decode(ids))
    if args.stats:
        print(format_stats(row.stats), file=sys.stderr)


def _generate_compiled(args: argparse.Namespace, model: nn.Module, tokenizer) -> None:
    """--compile: a torch.compile'd decode step over a static cache (infer/compiled.py). The
    first step compiles (about 30 s on 2 cores); the text prints when generation ends."""
    from glassformer.infer.compiled import CompiledDecoder

    print("compiling the decode step (once per process)...", file=sys.stderr)
    result = CompiledDecoder(model, tokenizer=tokenizer).generate(
        _encode(args, tokenizer, args.prompt[0]),
        **sampling_kwargs(args, tokenizer.eos_token_id),
        **args.thinking,
    )
    ids = [t for t in result.token_ids if t != tokenizer.eos_token_id]
    print(args.prompt[0] + tokenizer.decode(ids))
    if args.stats:
        print(format_stats(result.stats), file=sys.stderr)


def _generate_batch(args: argparse.Namespace, engine, tokenizer) -> None:
    """Several prompts: generate them together (a row each), then print each prompt and its
    continuation on a line of its own, numbered from 1 (a batch does not stream)."""
    results = engine.generate_batch(
        [_encode(args, tokenizer, prompt) for prompt in args.prompt],
        **sampling_kwargs(args, tokenizer.eos_token_id),
        **args.thinking,
        on_full_context=args.on_full_context,
    )
    for number, (prompt, result) in enumerate(zip(args.prompt, results, strict=True), start=1):
        # The end-of-sequence marker is a stop signal, not text.
        text = tokenizer.decode([t for t in result.token_ids if t != tokenizer.eos_token_id])
        print(f"[{number}] {prompt}{text}")
    if args.stats:
        print(format_batch_stats([result.stats for result in results]), file=sys.stderr)


def _encode(args: argparse.Namespace, tokenizer, prompt: str) -> list[int]:
    """The prompt's ids, with --no-think's empty thinking segment after them."""
    return tokenizer.encode(prompt) + args.prompt_suffix


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "generate", cmd_generate)
    p.add_argument(
        "prompt",
        nargs="+",
        metavar="PROMPT",
        help="the text to continue; give several to generate them as one batch",
    )
    p.add_argument(
        "--model",
        required=True,
        help="checkpoint directory (a run's out_dir), alias (smollm2), Hugging Face folder or "
        ".gguf file",
    )
    add_sampling_flags(p, max_new_tokens=200, temperature=0.8)
    add_thinking_flags(p)
    add_decode_flags(p)
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the decode step (about 30 s once; then fewer per-token overheads: "
        "int8 SmolLM2 ~100 vs ~75 tok/s); prints the text at the end instead of streaming",
    )
    p.add_argument(
        "--on-full-context",
        choices=("shift", "stop"),
        default="shift",
        help="when the context window fills up: keep its second half and go on (shift, the "
        "default), or stop",
    )
    p.add_argument(
        "--show-top",
        type=positive_int,
        metavar="N",
        help="print each step's N most likely next tokens with their probabilities (the "
        "model's distribution, before temperature and the cuts) and the token chosen",
    )
    p.add_argument(
        "--stats",
        action="store_true",
        help="print time to first token, decode tokens/s and KV-cache bytes",
    )
