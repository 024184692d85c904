"""`glassformer translate`: First Folio spelling -> modern with an encoder-decoder checkpoint
(train/translation.py), or --eval: chrF and BLEU on the held-out plays against copying."""

from __future__ import annotations

import argparse
import sys

from glassformer.cli.common import add_command, add_threads_flag, positive_int, set_threads


def cmd_translate(args: argparse.Namespace) -> None:
    """modernize First Folio spelling with an encoder-decoder checkpoint

    Translate TEXT (or stdin lines) with a seq2seq checkpoint trained on the Folio -> modern
    spelling task (configs/folio2modern.toml). --eval instead decodes the held-out plays'
    aligned pairs and prints chrF and BLEU (sacrebleu) for the model and for copying the input
    unchanged.
    """
    from glassformer.train import translation

    set_threads(args.threads)
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


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "translate", cmd_translate)
    p.add_argument("texts", nargs="*", metavar="TEXT", help='e.g. "Long liue the King"')
    p.add_argument("--model", required=True, help="checkpoint directory (a run's out_dir)")
    p.add_argument(
        "--beam-size", type=positive_int, default=1, help="1 = greedy (default), else beam"
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
        "--limit", type=positive_int, help="--eval on at most this many pairs, evenly spaced"
    )
    p.add_argument("--examples", type=int, default=3, help="example pairs --eval prints")
    add_threads_flag(p)
