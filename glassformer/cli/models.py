"""`glassformer info | embed | convert`: what a model is (its shape, parameters by component and
cache bytes per token), what an encoder makes of sentences, and a model as a Hugging Face
folder."""

from __future__ import annotations

import argparse
import sys

from torch import nn

from glassformer.calc import (
    format_component_table,
    kv_bytes_per_token,
    parameter_table,
    rnn_state_bytes,
)
from glassformer.cli.common import add_command, load_with_tokenizer, positive_int
from glassformer.config import ModelConfig

# --- info -------------------------------------------------------------------------------------


def describe_model(cfg: ModelConfig) -> list[str]:
    """A loaded model's shape: sizes and heads, then position, norm and FFN (an RNN: its cell,
    layers and hidden size, on one line)."""
    if cfg.family == "rnn":
        return [
            f"family rnn | cell {cfg.cell} | {cfg.n_layers} layers | hidden size {cfg.d_model} |"
            f" vocab {cfg.vocab_size} | training window {cfg.max_seq_len} | norm {cfg.norm} | "
            f"tied embeddings {cfg.tie_embeddings}"
        ]
    return [
        f"family {cfg.family} | {cfg.n_layers} layers | d_model {cfg.d_model} | "
        f"{cfg.n_heads} heads ({cfg.n_kv_heads} kv heads, head_dim {cfg.head_dim}) | "
        f"d_ff {cfg.d_ff} | vocab {cfg.vocab_size} | context {cfg.max_seq_len}",
        f"position {cfg.position} | norm {cfg.norm} ({cfg.norm_position}) | ffn {cfg.ffn} | "
        f"tied embeddings {cfg.tie_embeddings}",
    ]


def format_model_parameters(model: nn.Module, name: str) -> str:
    """The parameters of a loaded model by component, per layer and in all, under its shape:
    what `info` and `calc params --model` print (the weights themselves, counted)."""
    about = "\n  ".join(describe_model(model.cfg))  # the table indents the first line only
    return format_component_table(parameter_table(model), model.cfg.n_layers, name, about)


def cmd_info(args: argparse.Namespace) -> None:
    """parameters by component and KV-cache bytes of a checkpoint

    Show a model's shape, its parameter table and its KV-cache cost per token.
    """
    from glassformer.interop.pretrained import from_pretrained

    model, _ = from_pretrained(args.model)
    cfg = model.cfg
    print(format_model_parameters(model, args.model))
    if cfg.family == "rnn":
        parts = "h and c" if cfg.cell == "lstm" else "h"
        print(f"\n{cfg.cell} hidden state, the generation cache ({parts} per layer x d_model):")
        for dtype in ("fp32", "bf16"):
            print(f"  {dtype}: {rnn_state_bytes(cfg, dtype):,} bytes at any context length")
        return
    print("\nKV cache per token (2 x layers x kv_heads x head_dim numbers):")
    for dtype in ("fp32", "bf16"):
        per_token = kv_bytes_per_token(cfg, dtype)
        full = per_token * cfg.max_seq_len
        print(
            f"  {dtype}: {per_token:,} bytes/token | {full / 2**20:.2f} MiB for the full "
            f"{cfg.max_seq_len}-token context"
        )


# --- embed ------------------------------------------------------------------------------------


def cmd_embed(args: argparse.Namespace) -> None:
    """sentence embeddings from an encoder (e.g. --model minilm)

    Encode each sentence, mean-pool the encoder's hidden states over its tokens and
    L2-normalize (the sentence-transformers recipe). Prints each embedding and, with
    --similarity, the cosine similarity matrix.
    """
    from glassformer.infer.embed import cosine_similarity_matrix, embed

    model, tokenizer = load_with_tokenizer(args.model, "embed needs one to encode text")
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
    """write a model as a Hugging Face folder (safetensors + config.json + tokenizer)

    Convert SRC (an alias such as smollm2, a Hugging Face folder, a GGUF file or a glassformer
    checkpoint) into a folder that transformers loads with AutoModelForCausalLM
    (AutoModelForSeq2SeqLM for bart, t5).from_pretrained and runs with the same logits.
    """
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


# --- parsers ----------------------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "info", cmd_info)
    p.add_argument(
        "--model",
        required=True,
        help="checkpoint directory, alias (smollm2), Hugging Face folder or .gguf file",
    )

    p = add_command(sub, "embed", cmd_embed)
    p.add_argument("sentences", nargs="+", metavar="SENTENCE", help="the texts to embed")
    p.add_argument("--model", required=True, help="alias (minilm) or a Hugging Face BERT folder")
    p.add_argument("--similarity", action="store_true", help="print the cosine matrix")
    p.add_argument("--full", action="store_true", help="print every value, not the first 8")
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        help="cut longer inputs to this many tokens (default: the model's max_seq_len; "
        "sentence-transformers uses 256 for MiniLM)",
    )

    p = add_command(sub, "convert", cmd_convert)
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
