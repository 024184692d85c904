"""`glassformer inspect attention`: which tokens a token attends to in every layer and head
(seed 000 §3.3, §4.2), printed and drawn as heatmaps (glassformer/inspect/)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from glassformer.cli.common import (
    add_adapter_flag,
    add_command,
    add_command_group,
    add_device_flag,
    add_threads_flag,
    load_with_tokenizer,
    positive_int,
    set_threads,
)
from glassformer.devices import resolve_device


def cmd_inspect_attention(args: argparse.Namespace) -> None:
    """which tokens a token attends to, per layer and head, plus heatmaps

    Run TEXT through the model with attention capture on (seed 000 §3.3, §4.2). For the chosen
    token print, per layer, the keys it attends to most (mean over heads) and the single head
    that attends most to each; write a PNG with one heatmap per layer (mean over heads) and one
    with every head of --layer (or only --head).
    """
    from glassformer.inspect import attention_view, plots, top_attended

    device = resolve_device(args.device)
    set_threads(args.threads)
    model, tokenizer = load_with_tokenizer(
        args.model, "inspect needs one to encode text", adapter=args.adapter
    )
    model.to(device)
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
    weights = [w.cpu() for w in view.weights]  # L x (H, Tq, Tk)
    n_layers, n_heads = len(weights), weights[0].shape[0]
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
    for index, layer_weights in enumerate(weights):
        found = top_attended(layer_weights[:, query], args.top)  # (H, Tk) row of the query
        cells = [
            f"{view.key_tokens[a.key]}@{a.key} {a.mean_weight:.3f} (head {a.best_head} "
            f"{a.best_head_weight:.3f})"
            for a in found
        ]
        print(f"  layer {index:>2}: " + " | ".join(cells))
    out = Path(args.out)
    name = f"{view.kind} attention of {label!r} (position {query})"
    fig = plots.layer_grid(
        weights,
        view.query_tokens,
        view.key_tokens,
        f"{args.model}: {name}, mean over heads",
        query=query,
        max_tokens=args.max_view,
    )
    written = [plots.save(fig, out)]
    if args.head is None:
        fig = plots.head_grid(
            weights[layer],
            view.query_tokens,
            view.key_tokens,
            f"{args.model}: {name}, layer {layer}, every head",
            query=query,
            max_tokens=args.max_view,
        )
        path = out.with_name(f"{out.stem}-layer{layer}-heads{out.suffix or '.png'}")
    else:
        found = top_attended(weights[layer][args.head : args.head + 1, query], args.top)
        cells = [f"{view.key_tokens[a.key]}@{a.key} {a.mean_weight:.3f}" for a in found]
        print(f"  layer {layer} head {args.head}: " + " | ".join(cells))
        fig = plots.attention_heatmap(
            weights[layer][args.head],
            view.query_tokens,
            view.key_tokens,
            f"{args.model}: {name}, layer {layer} head {args.head}",
            query=query,
            max_tokens=args.max_view,
        )
        path = out.with_name(f"{out.stem}-layer{layer}-head{args.head}{out.suffix or '.png'}")
    written.append(plots.save(fig, path))
    print("wrote " + " and ".join(str(p) for p in written))


GROUP_HELP = """look inside a model: attention maps (inspect attention)

Look inside a model. `inspect attention` shows which tokens a token attends to in every layer and
plots the attention matrices.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    inspect_sub = add_command_group(sub, "inspect", GROUP_HELP, dest="what")
    p = add_command(inspect_sub, "attention", cmd_inspect_attention)
    p.add_argument(
        "text",
        metavar="TEXT",
        help='e.g. "The animal didn\'t cross the street because it was too tired"',
    )
    p.add_argument(
        "--model",
        required=True,
        help="alias (minilm, smollm2), Hugging Face folder, .gguf or checkpoint directory",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--token",
        help="the query token by its text (markers like Ġ ## ▁ ignored; the first "
        "if it occurs several times)",
    )
    where.add_argument(
        "--position", type=int, help="the query token by index (default: the last token)"
    )
    p.add_argument(
        "--kind",
        choices=("self", "encoder", "decoder", "cross"),
        help="which attention (default: self; encoder for seq2seq, where --token is matched "
        "in the source for encoder, in the decoder input for decoder and cross)",
    )
    p.add_argument(
        "--target", help="seq2seq: the decoder's text (default: the model's greedy output)"
    )
    p.add_argument("--layer", type=int, help="layer for the per-head plot (default: the last)")
    p.add_argument("--head", type=int, help="plot only this head of --layer")
    p.add_argument("--top", type=positive_int, default=3, help="keys printed per layer (3)")
    p.add_argument(
        "--out",
        default="attention.png",
        help="PNG of the layers (default attention.png); the head plot goes beside it as "
        "NAME-layerL-heads.png (NAME-layerL-headH.png with --head)",
    )
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=512,
        help="cut longer texts to this many tokens (default 512; memory grows as T^2)",
    )
    p.add_argument(
        "--max-view",
        type=positive_int,
        default=48,
        help="most query/key tokens a heatmap shows, around the query (default 48)",
    )
    add_adapter_flag(p)
    add_threads_flag(p)
    add_device_flag(
        p,
        "where the model runs: auto (a CUDA GPU, then Apple's MPS, then the CPU), cpu, cuda "
        "or mps (default auto); the weights come back to the CPU for printing and plots",
    )
