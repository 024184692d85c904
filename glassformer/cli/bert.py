"""`glassformer fill-mask | evaluate`: a BERT's guesses at each [MASK], and a trained run scored
on its task (genre: held-out accuracy vs the majority class; mlm: val loss vs unigram entropy)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from glassformer import json_input
from glassformer.cli.common import (
    add_command,
    add_threads_flag,
    load_with_tokenizer,
    positive_int,
    set_threads,
)


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
    """top candidates for each [MASK] from a BERT (e.g. an mlm-trained checkpoint)

    Encode TEXT as [CLS] TEXT [SEP], run the encoder once (both directions) and print the most
    probable tokens with their probabilities at every [MASK].
    """
    from glassformer.infer.fill_mask import fill_mask

    set_threads(args.threads)
    model, tokenizer = load_with_tokenizer(args.model, "fill-mask needs one to encode text")
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
    """score a trained run on its task (genre: held-out accuracy vs majority baseline)

    Rebuild the run's task from its run_config.json and the checkpoint's tokenizer, then print
    the task's scores (genre: accuracy on the held-out plays next to always guessing the
    majority class; mlm: val loss vs unigram entropy).
    """
    from glassformer.interop.checkpoint import load, resolve_checkpoint
    from glassformer.train.config import RunConfig
    from glassformer.train.task_table import make_task

    step_dir = resolve_checkpoint(args.model)
    config_file = next(
        (
            d / "run_config.json"
            for d in (Path(args.model), step_dir.parent)
            if d.is_dir() and (d / "run_config.json").is_file()
        ),
        None,
    )
    if config_file is None:
        raise ValueError(f"{args.model} has no run_config.json: evaluate reads a trained run")
    set_threads(args.threads)
    try:
        saved = json_input.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file} is not valid JSON ({err}): the run is damaged") from None
    run = RunConfig.from_dict(saved)
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


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "fill-mask", cmd_fill_mask)
    p.add_argument("text", metavar="TEXT", help='e.g. "To be or not to [MASK]"')
    p.add_argument(
        "--model", required=True, help="mlm checkpoint directory or BertForMaskedLM folder"
    )
    p.add_argument("--top-k", type=positive_int, default=5, help="candidates per [MASK] (5)")
    add_threads_flag(p)

    p = add_command(sub, "evaluate", cmd_evaluate)
    p.add_argument("--model", required=True, help="a run directory (its out_dir) or step-*")
    add_threads_flag(p)
