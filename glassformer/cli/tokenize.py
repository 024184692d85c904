"""`glassformer tokenize --model M TEXT`: the pieces and count of a text under a model's
tokenizer or a named vocabulary (seed 002 "token ≠ 字", 练习 2 第 1 步)."""

from __future__ import annotations

import argparse

from glassformer.cli.common import add_command
from glassformer.tokenize import (
    VOCABULARIES,
    Tokenized,
    is_bytes_label,
    tokenize,
    vocabulary_for,
)
from glassformer.tokenizers.guards import panic_reports_hidden


def _shown(piece: str) -> str:
    if is_bytes_label(piece):
        return piece
    return piece.replace(" ", "␣").replace("\n", "\\n")


def format_tokenized(result: Tokenized, text: str, show_ids: bool) -> list[str]:
    """`NAME: N tokens for C characters`, then the pieces between bars (a space shows as ␣, so
    " Intelligence" and "Intelligence" read differently), then the ids if asked."""
    pieces = " | ".join(_shown(piece) for piece in result.pieces)
    plural = "" if result.count == 1 else "s"
    lines = [f"{result.vocabulary}: {result.count} token{plural} for {len(text)} characters"]
    lines.append(f"  {pieces}")
    if show_ids:
        lines.append(f"  ids: {' '.join(map(str, result.ids))}")
    return lines


def cmd_tokenize(args: argparse.Namespace) -> None:
    """the pieces and token count of a text under one or more tokenizers

    Cut TEXT into tokens under each --model (a model alias or path: its own tokenizer; or
    "qwen" / "cl100k": Qwen2.5's and GPT-4's vocabularies) and print how many there are and
    the pieces. A piece that is only part of a character is shown as its bytes in hex, e.g.
    <e6 99>. Special-token spellings in TEXT count as plain text.
    """
    for name in args.model:
        vocabulary = vocabulary_for(name)
        with panic_reports_hidden():  # a hostile tokenizer.json: one error line, not Rust's
            result = tokenize(args.text, vocabulary)
        for line in format_tokenized(result, args.text, args.ids):
            print(line)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "tokenize", cmd_tokenize)
    p.add_argument("text", metavar="TEXT", help='the text to count, e.g. "人工智能"')
    p.add_argument(
        "--model",
        required=True,
        action="append",
        help=f"a model alias or path (smollm2, minilm, a .gguf, a checkpoint) or a vocabulary "
        f"({', '.join(VOCABULARIES)}); repeat to compare",
    )
    p.add_argument("--ids", action="store_true", help="also print the token ids")
