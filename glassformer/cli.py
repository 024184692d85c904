"""The command line: `glassformer train | generate | info | fill-mask | evaluate | ...` (also
`python -m glassformer`).

Each subcommand parses its flags and calls one typed function. Errors a user can fix print one
clear line (set GLASSFORMER_DEBUG=1 for the traceback).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from collections.abc import Sequence


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _seed(text: str) -> int:
    """A seed as torch takes it: a whole number in 0..2**64-1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"{value} must be in 0..2**64-1")
    return value


# --- train ------------------------------------------------------------------------------------


def cmd_train(args: argparse.Namespace) -> None:
    from glassformer.train.config import load_run_config
    from glassformer.train.trainer import train

    run = load_run_config(args.config, args.set or [])
    result = train(run, resume=args.resume, progress=not args.no_progress, overwrite=args.overwrite)
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
    model, tokenizer = from_pretrained(args.model, quantize=getattr(args, "quantize", None))
    if tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer.json: {why}")
    return _prepare_for_decode(model, args), tokenizer


def _prepare_for_decode(model, args: argparse.Namespace):
    """GPT-family models get the decode kernels (infer/optimize.py) unless --plain; --dtype
    bf16 casts the model. An int8 model (--quantize) already runs on the kernels."""
    import torch

    from glassformer.infer.optimize import optimize_for_decode

    dtype = getattr(args, "dtype", "fp32")
    if getattr(args, "quantize", None):
        if dtype != "fp32":
            raise ValueError(
                f"--quantize {args.quantize} keeps activations in fp32: drop --dtype {dtype}"
            )
        return model
    if getattr(args, "plain", False) or model.cfg.family != "gpt":
        return model.to(torch.bfloat16) if dtype == "bf16" else model
    return optimize_for_decode(model, dtype)


def cmd_generate(args: argparse.Namespace) -> None:
    from glassformer.detokenize import IncrementalDecoder
    from glassformer.infer.engine import Engine

    model, tokenizer = _load_with_tokenizer(args, "generate needs one to encode text")
    engine = Engine(model)
    if len(args.prompt) > 1:
        _generate_batch(args, engine, tokenizer)
        return
    if args.compile:
        _generate_compiled(args, model, tokenizer)
        return
    prompt = args.prompt[0]
    prompt_ids = tokenizer.encode(prompt)
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
    sys.stdout.write(prompt)
    for token_id in stream:
        if token_id == tokenizer.eos_token_id:
            continue  # the end-of-sequence marker is a stop signal, not text
        sys.stdout.write(decoder.push(token_id))
        sys.stdout.flush()
    sys.stdout.write(decoder.flush() + "\n")
    sys.stdout.flush()
    if args.stats:
        print_stats(stream.stats)


def _generate_compiled(args: argparse.Namespace, model, tokenizer) -> None:
    """--compile: a torch.compile'd decode step over a static cache (infer/compiled.py). The
    first step compiles (about 30 s on 2 cores); the text prints when generation ends."""
    from glassformer.infer.compiled import CompiledDecoder

    if args.plain:
        raise ValueError("--compile runs the decode kernels: drop --plain")
    print("compiling the decode step (once per process)...", file=sys.stderr)
    result = CompiledDecoder(model).generate(
        tokenizer.encode(args.prompt[0]),
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_token_id=tokenizer.eos_token_id,
    )
    ids = [t for t in result.token_ids if t != tokenizer.eos_token_id]
    print(args.prompt[0] + tokenizer.decode(ids))
    if args.stats:
        print_stats(result.stats)


def _generate_batch(args: argparse.Namespace, engine, tokenizer) -> None:
    """Several prompts: generate them as one left-padded batch, then print each prompt and its
    continuation on a line of its own, numbered from 1 (a batch does not stream)."""
    prompt_ids = [tokenizer.encode(prompt) for prompt in args.prompt]
    results = engine.generate_batch(
        prompt_ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_token_id=tokenizer.eos_token_id,
    )
    for number, (prompt, result) in enumerate(zip(args.prompt, results, strict=True), start=1):
        # The end-of-sequence marker is a stop signal, not text.
        text = tokenizer.decode([t for t in result.token_ids if t != tokenizer.eos_token_id])
        print(f"[{number}] {prompt}{text}")
    if args.stats:
        stats = [result.stats for result in results]
        batch = stats[0]  # the times, rates and cache bytes are the batch's, shared by all rows
        print(
            f"[batch of {len(stats)}: {sum(s.prompt_tokens for s in stats)} prompt tokens, "
            f"{sum(s.generated_tokens for s in stats)} generated, stop: "
            f"{', '.join(s.stop_reason for s in stats)}] time to first token "
            f"{batch.time_to_first_token_s * 1e3:.1f} ms | decode {batch.decode_tokens_per_s:.1f}"
            f" tok/s (all rows) | prefill {batch.prefill_tokens_per_s:.0f} tok/s | KV cache "
            f"{batch.kv_cache_bytes / 1024:.1f} KiB in use of "
            f"{batch.kv_cache_capacity_bytes / 1024:.1f} KiB allocated",
            file=sys.stderr,
        )


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
    from glassformer.calc import kv_cache_bytes_per_token
    from glassformer.interop.pretrained import from_pretrained

    model, _ = from_pretrained(args.model)
    cfg = model.cfg
    print(f"model: {args.model}")
    if cfg.family == "rnn":
        print(
            f"  family rnn | cell {cfg.cell} | {cfg.n_layers} layers | hidden size {cfg.d_model}"
            f" | vocab {cfg.vocab_size} | training window {cfg.max_seq_len} | norm {cfg.norm} |"
            f" tied embeddings {cfg.tie_embeddings}"
        )
        _print_parameters(model)
        _print_rnn_state(cfg)
        return
    print(
        f"  family {cfg.family} | {cfg.n_layers} layers | d_model {cfg.d_model} | "
        f"{cfg.n_heads} heads ({cfg.n_kv_heads} kv heads, head_dim {cfg.head_dim}) | "
        f"d_ff {cfg.d_ff} | vocab {cfg.vocab_size} | context {cfg.max_seq_len}"
    )
    print(
        f"  position {cfg.position} | norm {cfg.norm} ({cfg.norm_position}) | ffn {cfg.ffn} | "
        f"tied embeddings {cfg.tie_embeddings}"
    )
    _print_parameters(model)
    print("\nKV cache per token (2 x layers x kv_heads x head_dim numbers):")
    for dtype in ("fp32", "bf16"):
        per_token = kv_cache_bytes_per_token(cfg, dtype)
        full = per_token * cfg.max_seq_len
        print(
            f"  {dtype}: {per_token:,} bytes/token | {full / 2**20:.2f} MiB for the full "
            f"{cfg.max_seq_len}-token context"
        )


def _print_parameters(model) -> None:
    from glassformer.calc import parameter_table

    table = parameter_table(model)
    total = sum(table.values())
    print("\nparameters by component:")
    for name, count in sorted(table.items(), key=lambda kv: -kv[1]):
        per_layer = ""
        if name in ("attention", "ffn", "moe router", "recurrent"):
            per_layer = f"  ({count // model.cfg.n_layers:,} per layer)"
        print(f"  {name:<12} {count:>14,}  {100 * count / total:5.1f}%{per_layer}")
    print(f"  {'total':<12} {total:>14,}")


def _print_rnn_state(cfg) -> None:
    from glassformer.calc import rnn_state_bytes

    parts = "h and c" if cfg.cell == "lstm" else "h"
    print(f"\n{cfg.cell} hidden state, the generation cache ({parts} per layer x d_model):")
    for dtype in ("fp32", "bf16"):
        print(f"  {dtype}: {rnn_state_bytes(cfg, dtype):,} bytes at any context length")


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

    report = convert_to_hf(args.src, args.out, model_type=args.model_type, overwrite=args.overwrite)
    print(f"wrote a Hugging Face {report.model_type} model to {report.out_dir}:")
    for name in report.files:
        print(f"  {name}")
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    seq2seq = report.model_type in ("bart", "t5")
    auto = "AutoModelForSeq2SeqLM" if seq2seq else "AutoModelForCausalLM"
    print(f"load it with transformers: {auto}.from_pretrained({str(report.out_dir)!r})")


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
    # Bytes on stdin that are not UTF-8 become U+FFFD instead of ending the chat.
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="replace")
    session = ChatSession(
        Engine(model), tokenizer, system=args.system, sampling=sampling,
        parse_special=args.parse_special,
    )  # fmt: skip
    run_chat(session)


# --- fill-mask and evaluate (BERT) -------------------------------------------------------------


def encode_with_cls_sep(tokenizer, text: str) -> list[int]:
    """[CLS] text [SEP]: a Hugging Face BERT tokenizer adds them itself, ours does not."""
    ids = list(tokenizer.encode(text))
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    if cls is not None and (not ids or ids[0] != cls):
        ids.insert(0, cls)
    if sep is not None and ids[-1] != sep:
        ids.append(sep)
    return ids


def cmd_fill_mask(args: argparse.Namespace) -> None:
    from glassformer.infer.fill_mask import fill_mask

    model, tokenizer = _load_with_tokenizer(args, "fill-mask needs one to encode text")
    mask_id = getattr(tokenizer, "token_to_id", lambda _: None)("[MASK]")
    if mask_id is None:
        raise ValueError(f"{args.model}'s tokenizer has no [MASK] token: use a BERT checkpoint")
    ids = encode_with_cls_sep(tokenizer, args.text)
    results = fill_mask(model, ids, mask_id, top_k=args.top_k)
    best = list(ids)
    for number, found in enumerate(results, 1):
        print(f"[MASK] {number} (token {found.position}):")
        for token_id, prob in zip(found.token_ids, found.probs, strict=True):
            print(f"  {prob:7.4f}  {tokenizer.decode([token_id])!r}")
        best[found.position] = found.token_ids[0]
    special = {tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]")}
    print("top-1: " + tokenizer.decode([i for i in best if i not in special]).strip())


def cmd_evaluate(args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    from glassformer.train.checkpoint import load, resolve_checkpoint
    from glassformer.train.config import RunConfig
    from glassformer.train.tasks import make_task

    step_dir = resolve_checkpoint(args.model)
    config_file = next(
        (d / "run_config.json" for d in (Path(args.model), step_dir.parent) if d.is_dir()
         and (d / "run_config.json").is_file()),
        None,
    )  # fmt: skip
    if config_file is None:
        raise ValueError(f"{args.model} has no run_config.json: evaluate reads a trained run")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    run = RunConfig.from_dict(json.loads(config_file.read_text()))
    model, tokenizer = load(step_dir)
    task = make_task(run, tokenizer)
    if not hasattr(task, "evaluate"):
        raise ValueError(f"task {task.name!r} has no evaluation beyond the trainer's val loss")
    result = task.evaluate(model)
    print(f"{task.name} on {step_dir}:")
    if "accuracy" in result:
        print(
            f"  held-out accuracy {result['accuracy']:.4f} on {result['n_test']} examples vs "
            f"{result['majority_accuracy']:.4f} for always guessing the majority class "
            f"({result['majority_class']})"
        )
    for key, value in result.items():
        shown = f"{value:.4f}" if isinstance(value, float) else value
        print(f"  {key}: {shown}")


# --- translate (encoder-decoder) --------------------------------------------------------------


def cmd_translate(args: argparse.Namespace) -> None:
    from glassformer.train import translation

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, tokenizer, data = translation.load_translator(args.model)
    decoding = dict(beam_size=args.beam_size, length_penalty=args.length_penalty)
    if args.eval:
        pairs = translation.held_out_pairs(args.split, data)
        pairs = translation.evenly_spaced(pairs, args.limit)
        scores = translation.evaluate_translation(model, tokenizer, pairs, **decoding)
        print(translation.format_scores(scores, args.split, n_examples=args.examples))
        return
    texts = args.texts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        raise ValueError("nothing to translate: give TEXT arguments, lines on stdin, or --eval")
    outputs = translation.translate(
        model, tokenizer, texts, **decoding, max_chars=data.max_pair_chars
    )
    for output in outputs:
        print(output)


# --- inspect ----------------------------------------------------------------------------------


def cmd_inspect_attention(args: argparse.Namespace) -> None:
    from pathlib import Path

    from glassformer.inspect import attention_view, plots, top_attended
    from glassformer.interop.pretrained import from_pretrained

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, tokenizer = from_pretrained(args.model)
    if tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer.json: inspect needs one to encode text")
    view = attention_view(
        model,
        tokenizer,
        args.text,
        token=args.token,
        position=args.position,
        kind=args.kind,
        target=args.target,
        max_tokens=args.max_tokens,
    )
    for note in view.notes:
        print(f"note: {note}", file=sys.stderr)
    n_layers, n_heads = len(view.weights), view.weights[0].shape[0]
    layer = args.layer if args.layer is not None else n_layers - 1
    if not -n_layers <= layer < n_layers:
        raise ValueError(f"--layer {layer} does not exist: pick 0..{n_layers - 1}")
    layer %= n_layers
    if args.head is not None and not 0 <= args.head < n_heads:
        raise ValueError(f"--head {args.head} does not exist: pick 0..{n_heads - 1}")
    cfg = model.cfg
    query, label = view.query, view.query_tokens[view.query]
    print(
        f"{args.model}: {cfg.family}, {n_layers} layers x {n_heads} heads | {view.kind} "
        f"attention | {len(view.query_tokens)} query x {len(view.key_tokens)} key tokens | query "
        f"{label!r} at position {query}"
    )
    print(f"top {args.top} keys per layer: mean weight over heads (the head that looks most)")
    for index, weights in enumerate(view.weights):
        found = top_attended(weights[:, query], args.top)  # (H, Tk) row of the query
        cells = [
            f"{view.key_tokens[a.key]}@{a.key} {a.mean_weight:.3f} (head {a.best_head} "
            f"{a.best_head_weight:.3f})"
            for a in found
        ]
        print(f"  layer {index:>2}: " + " | ".join(cells))
    out = Path(args.out)
    name = f"{view.kind} attention of {label!r} (position {query})"
    fig = plots.layer_grid(
        view.weights, view.query_tokens, view.key_tokens, f"{args.model}: {name}, mean over "
        "heads", query=query, max_tokens=args.max_view,
    )  # fmt: skip
    written = [plots.save(fig, out)]
    if args.head is None:
        fig = plots.head_grid(
            view.weights[layer], view.query_tokens, view.key_tokens,
            f"{args.model}: {name}, layer {layer}, every head", query=query,
            max_tokens=args.max_view,
        )  # fmt: skip
        path = out.with_name(f"{out.stem}-layer{layer}-heads{out.suffix or '.png'}")
    else:
        found = top_attended(view.weights[layer][args.head : args.head + 1, query], args.top)
        cells = [f"{view.key_tokens[a.key]}@{a.key} {a.mean_weight:.3f}" for a in found]
        print(f"  layer {layer} head {args.head}: " + " | ".join(cells))
        fig = plots.attention_heatmap(
            view.weights[layer][args.head], view.query_tokens, view.key_tokens,
            f"{args.model}: {name}, layer {layer} head {args.head}", query=query,
            max_tokens=args.max_view,
        )  # fmt: skip
        path = out.with_name(f"{out.stem}-layer{layer}-head{args.head}{out.suffix or '.png'}")
    written.append(plots.save(fig, path))
    print("wrote " + " and ".join(str(p) for p in written))


# --- calc -------------------------------------------------------------------------------------


def _calc_source(args: argparse.Namespace):
    """(config, name, loaded model or None) from exactly one of --preset, --config, --model."""
    from glassformer.calc import preset_names, resolve_preset

    given = [flag for flag in ("preset", "config", "model") if getattr(args, flag)]
    if len(given) != 1:
        raise ValueError(
            f"give exactly one of --preset, --config or --model (got {len(given) or 'none'}): "
            f"presets are {', '.join(preset_names())}"
        )
    if args.preset:
        return resolve_preset(args.preset), args.preset, None
    if args.config:
        return _calc_run_config(args.config, args.vocab_size), args.config, None
    from glassformer.interop.pretrained import from_pretrained

    model, _ = from_pretrained(args.model)
    return model.cfg, args.model, model


def _calc_run_config(path: str, vocab_size: int | None):
    """A TOML run config's ModelConfig. Its vocabulary comes from the tokenizer the run trains:
    the corpus's characters (char) or data.bpe_vocab_size (bpe), unless --vocab-size says."""
    from glassformer.train.config import load_run_config

    run = load_run_config(path)
    if vocab_size is None and run.data.tokenizer == "bpe":
        vocab_size = run.data.bpe_vocab_size
    if vocab_size is None:
        from glassformer.train.tasks import build_tokenizer, load_documents

        vocab_size = build_tokenizer(run.data, load_documents(run.data)).vocab_size
    print(f"note: vocab_size {vocab_size} (from [data]; --vocab-size to change)", file=sys.stderr)
    return run.model_config(vocab_size)


def cmd_calc_params(args: argparse.Namespace) -> None:
    from glassformer.calc import (
        describe,
        format_component_table,
        format_parameter_table,
        parameter_table,
    )

    cfg, name, model = _calc_source(args)
    if model is None:
        print(format_parameter_table(cfg, name))
        return
    table = parameter_table(model)  # the loaded weights themselves, counted
    print(format_component_table(table, cfg.n_layers, name, describe(cfg)))


def cmd_calc_kv_cache(args: argparse.Namespace) -> None:
    from glassformer.calc import format_kv_cache

    cfg, name, _ = _calc_source(args)
    tokens = cfg.max_seq_len if args.tokens is None else args.tokens
    print(format_kv_cache(cfg, name, tokens, args.dtype, args.batch_size, args.window))


def cmd_calc_flops(args: argparse.Namespace) -> None:
    from glassformer.calc import format_flops

    cfg, name, _ = _calc_source(args)
    print(format_flops(cfg, name, args.context or cfg.max_seq_len))


def _add_calc_parser(sub) -> None:
    p = sub.add_parser(
        "calc",
        help="parameters, KV-cache bytes and FLOPs of a preset, run config or checkpoint",
        description="Calculators from a config, no weights needed (seed 000 §2.1, seed 002): "
        "params (the parameter table, MoE total vs active), kv-cache (bytes per token and in "
        "all; what GQA/MQA and a sliding window change), flops (per token: matmuls and the "
        "attention part that grows with the context; training = 3 x forward).",
    )
    calc = p.add_subparsers(dest="calc_command", required=True, metavar="WHAT")
    commands = {
        "params": ("the parameter table by component, per layer and in all", cmd_calc_params),
        "kv-cache": ("KV-cache bytes per token and for --tokens tokens", cmd_calc_kv_cache),
        "flops": ("forward and training FLOPs per token at --context", cmd_calc_flops),
    }
    for what, (text, func) in commands.items():
        q = calc.add_parser(what, help=text, description=text)
        q.add_argument("--preset", help="e.g. llama-7b, gpt3-175b, mixtral-8x7b, deepseek-v3")
        q.add_argument("--config", help="a TOML run config, e.g. configs/shakespeare-char.toml")
        q.add_argument("--model", help="checkpoint directory, alias (smollm2), HF folder, .gguf")
        q.add_argument(
            "--vocab-size", type=_positive_int, help="--config: the tokenizer's vocabulary size"
        )
        if what == "kv-cache":
            q.add_argument(
                "--tokens", type=int, help="cached positions (default: the model's context)"
            )
            q.add_argument("--dtype", default="fp16", help="fp32, bf16, fp16 (default), fp8, int8")
            q.add_argument("--batch-size", type=_positive_int, default=1, help="sequences (1)")
            q.add_argument(
                "--window",
                type=_positive_int,
                default=4096,
                help="the sliding window of the extra row shown when --tokens exceeds it (4096)",
            )
        if what == "flops":
            q.add_argument(
                "--context", type=_positive_int, help="context length (default: the model's)"
            )
        q.set_defaults(func=func)


# --- lab (issue 7: the claims lab) --------------------------------------------------------------


def cmd_lab_list(args: argparse.Namespace) -> None:
    from glassformer.lab.base import discover

    for exp in discover().values():
        print(f"{exp.number:>3}  {exp.name:<24} {exp.title}")
        print(f"     source: {exp.source}")
        print(f"     claim:  {exp.claim.splitlines()[0][:90]}")


def cmd_lab_run(args: argparse.Namespace) -> None:
    from glassformer.lab.base import RunContext
    from glassformer.lab.runner import run_many

    if bool(args.name) == bool(args.all):
        raise ValueError("give one experiment NAME or --all (glassformer lab list shows them)")
    ctx = RunContext(out_dir=args.out, quick=args.quick, tiny=args.tiny, threads=args.threads,
                     seed=args.seed)  # fmt: skip
    records = run_many(None if args.all else [args.name], ctx)
    if len(records) > 1:
        for rec in records:
            print(f"{rec['name']:<24} {rec['verdict']:<20} {rec['seconds']:>7} s")


def cmd_lab_report(args: argparse.Namespace) -> None:
    from glassformer.lab.report import write_report

    print(f"wrote {write_report(args.out, args.to)}")


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
    p.add_argument("--seed", type=_seed, help="seed for reproducible sampling")
    p.add_argument("--threads", type=_positive_int, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="weights and activations in fp32 (default) or bf16 (half the bytes per token)",
    )
    p.add_argument(
        "--quantize",
        choices=("int8",),
        help="int8: weight-only int8, a scale per 64 weights (about 3.7x fewer bytes than fp32)",
    )
    p.add_argument(
        "--plain",
        action="store_true",
        help="run the model as built, without the decode kernels (for comparison)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="glassformer",
        description="The Transformer of the tutorials, built from scratch: train, generate, "
        "inspect.",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the full traceback of an error (before the command: glassformer --debug ...)",
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
        help="continue from the newest checkpoint in train.out_dir, exactly where it stopped "
        "(only [train] values such as max_steps may change)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start a new run in a train.out_dir that already holds one; the old checkpoints "
        "are deleted once the new run has saved its first checkpoint, so a run that fails "
        "early loses nothing (without --resume or --overwrite such a folder is refused)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "generate",
        help="generate text from a checkpoint",
        description="Prefill the prompt, then decode token by token with a KV cache, streaming. "
        "Several prompts are generated together as one left-padded batch and printed numbered "
        "when all are done.",
    )
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
    _add_sampling_flags(p, max_new_tokens=200, temperature=0.8)
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
        "default), or stop (a batch of several prompts always stops)",
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
    p.add_argument(
        "--parse-special",
        action="store_true",
        help="read control tokens typed in a message (<|im_start|>, ...) as tokens, not text "
        "(by default typed text can never forge a turn)",
    )
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
        "AutoModelForCausalLM (AutoModelForSeq2SeqLM for bart, t5).from_pretrained and runs "
        "with the same logits.",
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
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the model files in OUT if it already holds a model (never allowed for "
        "the folders the source itself lives in)",
    )
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser(
        "fill-mask",
        help="top candidates for each [MASK] from a BERT (e.g. an mlm-trained checkpoint)",
        description="Encode TEXT as [CLS] TEXT [SEP], run the encoder once (both directions) and "
        "print the most probable tokens with their probabilities at every [MASK].",
    )
    p.add_argument("text", metavar="TEXT", help='e.g. "To be or not to [MASK]"')
    p.add_argument(
        "--model", required=True, help="mlm checkpoint directory or BertForMaskedLM folder"
    )
    p.add_argument("--top-k", type=_positive_int, default=5, help="candidates per [MASK] (5)")
    p.add_argument("--threads", type=_positive_int, help="torch threads (default: torch's choice)")
    p.set_defaults(func=cmd_fill_mask)

    p = sub.add_parser(
        "evaluate",
        help="score a trained run on its task (genre: held-out accuracy vs majority baseline)",
        description="Rebuild the run's task from its run_config.json and the checkpoint's "
        "tokenizer, then print the task's scores (genre: accuracy on the held-out plays next "
        "to always guessing the majority class; mlm: val loss vs unigram entropy).",
    )
    p.add_argument("--model", required=True, help="a run directory (its out_dir) or step-*")
    p.add_argument("--threads", type=_positive_int, help="torch threads (default: torch's choice)")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser(
        "translate",
        help="modernize First Folio spelling with an encoder-decoder checkpoint",
        description="Translate TEXT (or stdin lines) with a seq2seq checkpoint trained on the "
        "Folio -> modern spelling task (configs/folio2modern.toml). --eval instead decodes the "
        "held-out plays' aligned pairs and prints chrF and BLEU (sacrebleu) for the model and "
        "for copying the input unchanged.",
    )
    p.add_argument("texts", nargs="*", metavar="TEXT", help='e.g. "Long liue the King"')
    p.add_argument("--model", required=True, help="checkpoint directory (a run's out_dir)")
    p.add_argument(
        "--beam-size", type=_positive_int, default=1, help="1 = greedy (default), else beam"
    )
    p.add_argument(
        "--length-penalty",
        type=float,
        default=1.0,
        help="beam search ranks sum(log p) / length**penalty (default 1.0)",
    )
    p.add_argument("--eval", action="store_true", help="score the held-out plays instead")
    p.add_argument(
        "--split",
        choices=("test", "validation"),
        default="test",
        help="which held-out plays --eval scores (default test)",
    )
    p.add_argument(
        "--limit", type=_positive_int, help="--eval on at most this many pairs, evenly spaced"
    )
    p.add_argument("--examples", type=int, default=3, help="example pairs --eval prints")
    p.add_argument("--threads", type=_positive_int, help="torch threads (default: torch's choice)")
    p.set_defaults(func=cmd_translate)

    _add_calc_parser(sub)

    p = sub.add_parser(
        "inspect",
        help="look inside a model: attention maps (inspect attention)",
        description="Look inside a model. `inspect attention` shows which tokens a token "
        "attends to in every layer and plots the attention matrices.",
    )
    inspect_sub = p.add_subparsers(dest="what", required=True, metavar="WHAT")
    p = inspect_sub.add_parser(
        "attention",
        help="which tokens a token attends to, per layer and head, plus heatmaps",
        description="Run TEXT through the model with attention capture on (seed 000 §3.3, "
        "§4.2). For the chosen token print, per layer, the keys it attends to most (mean over "
        "heads) and the single head that attends most to each; write a PNG with one heatmap "
        "per layer (mean over heads) and one with every head of --layer (or only --head).",
    )
    p.add_argument("text", metavar="TEXT", help="e.g. \"The animal didn't cross the street "
                   "because it was too tired\"")  # fmt: skip
    p.add_argument(
        "--model", required=True, help="alias (minilm, smollm2), Hugging Face folder, .gguf "
        "or checkpoint directory",
    )  # fmt: skip
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--token", help="the query token by its text (markers like Ġ ## ▁ ignored; the first "
        "if it occurs several times)",
    )  # fmt: skip
    where.add_argument(
        "--position", type=int, help="the query token by index (default: the last token)"
    )
    p.add_argument(
        "--kind", choices=("self", "encoder", "decoder", "cross"),
        help="which attention (default: self; encoder for seq2seq, where --token is matched "
        "in the source for encoder, in the decoder input for decoder and cross)",
    )  # fmt: skip
    p.add_argument(
        "--target", help="seq2seq: the decoder's text (default: the model's greedy output)"
    )
    p.add_argument("--layer", type=int, help="layer for the per-head plot (default: the last)")
    p.add_argument("--head", type=int, help="plot only this head of --layer")
    p.add_argument("--top", type=_positive_int, default=3, help="keys printed per layer (3)")
    p.add_argument(
        "--out", default="attention.png",
        help="PNG of the layers (default attention.png); the head plot goes beside it as "
        "NAME-layerL-heads.png (NAME-layerL-headH.png with --head)",
    )  # fmt: skip
    p.add_argument(
        "--max-tokens", type=_positive_int, default=512,
        help="cut longer texts to this many tokens (default 512; memory grows as T^2)",
    )  # fmt: skip
    p.add_argument(
        "--max-view", type=_positive_int, default=48,
        help="most query/key tokens a heatmap shows, around the query (default 48)",
    )  # fmt: skip
    p.add_argument("--threads", type=_positive_int, help="torch threads (default: torch's choice)")
    p.set_defaults(func=cmd_inspect_attention)

    p = sub.add_parser(
        "lab",
        help="the claims lab: run the tutorials' checkable claims (lab list | run | report)",
        description="Each experiment tests one claim quoted from the tutorials: it prints the "
        "numbers, writes a figure and a JSON, and says whether the claim holds here.",
    )
    lab_sub = p.add_subparsers(dest="lab_command", required=True, metavar="WHAT")
    q = lab_sub.add_parser("list", help="the experiments, their claims and sources")
    q.set_defaults(func=cmd_lab_list)
    q = lab_sub.add_parser(
        "run", help="run one experiment (NAME) or all (--all)",
        description="Run experiments; write OUT/NAME.json and OUT/NAME.png and print the table, "
        "the checks and the verdict.",
    )  # fmt: skip
    q.add_argument("name", nargs="?", metavar="NAME", help="an experiment (see lab list)")
    q.add_argument("--all", action="store_true", help="run every experiment")
    q.add_argument("--quick", action="store_true", help="small sizes: under 3 min on 2 cores")
    q.add_argument("--tiny", action="store_true", help="smallest sizes (what the tests run)")
    q.add_argument("--out", default="docs/lab", help="results folder (default docs/lab)")
    q.add_argument("--threads", type=_positive_int, help="torch threads (default: torch's)")
    q.add_argument("--seed", type=_seed, default=0, help="random seed (default 0)")
    q.set_defaults(func=cmd_lab_run)
    q = lab_sub.add_parser("report", help="write docs/claims.md from the results folder")
    q.add_argument("--out", default="docs/lab", help="results folder to read (default docs/lab)")
    q.add_argument("--to", default="docs/claims.md", help="markdown file (default docs/claims.md)")
    q.set_defaults(func=cmd_lab_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. A user's mistake (a bad value, a missing or damaged file, a full disk)
    is one line on stderr and exit code 2; a bug keeps its traceback. --debug (or
    GLASSFORMER_DEBUG=1) shows the traceback of a user error too."""
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as err:  # ConfigError, CheckpointError, InteropError too
        if args.debug or os.environ.get("GLASSFORMER_DEBUG"):
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    return 0


def one_line(err: BaseException) -> str:
    """The message of a user error on one line; an OSError names its file (errno text alone
    says "Is a directory" without saying which)."""
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        message = f"{err.filename}: {err.strerror}"
    else:
        message = str(err) or type(err).__name__
    return " ".join(message.split())


if __name__ == "__main__":
    sys.exit(main())
