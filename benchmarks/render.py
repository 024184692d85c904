"""Markdown tables from benchmarks/decode.py's --json output, for docs/performance.md: figures are
rendered from a run's JSON, stamped with its machine, date and command, never typed by hand.

    python benchmarks/render.py benchmarks/results/decode.json            # every row
    python benchmarks/render.py benchmarks/results/decode.json --prompt 128
    python benchmarks/render.py benchmarks/results/decode.json --llama    # glassformer vs llama.cpp
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def stamp(result: dict) -> str:
    m = result["machine"]
    peer = f", llama-cpp-python {m['llama_cpp_python']}" if m.get("llama_cpp_python") else ""
    return (
        f"`{result['command']}` ({result['date'][:10]}; {m['cpu']}, {m['threads']} threads, "
        f"read bandwidth {m['read_bandwidth_gb_s']} GB/s at the start, each row's limit from "
        f"reads just before its runs; torch {m['torch']}{peer}; "
        f"{result['new_tokens']} new tokens, median of {result['runs']} runs)"
    )


def all_rows(result: dict, prompt: int | None = None) -> list[str]:
    lines = [
        "| model | precision | batch | prompt | engine | TTFT ms | decode tok/s | vs transformers"
        " | % of bandwidth limit | same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if prompt is not None and r["prompt"] != prompt:
            continue
        same = {None: "", True: "yes", False: "no"}[r["same_tokens_as_transformers"]]
        percent = r["percent_of_bandwidth_limit"]
        lines.append(
            f"| {r['model']} | {r['precision']} | {r['batch']} | {r['prompt']} | {r['engine']} | "
            f"{r['ttft_ms']:.0f} | {r['decode_tok_s']:.1f} | {r['vs_transformers']:.2f}x | "
            f"{'' if percent is None else f'{percent:.0f}%'} | {same} |"
        )
    return lines


def against_llama(result: dict) -> list[str]:
    """glassformer beside llama.cpp at each precision, batch 1: decode and TTFT."""
    lines = [
        "| model | precision | prompt | llama.cpp | llama.cpp decode tok/s |"
        " glassformer decode tok/s | ratio | llama.cpp TTFT ms | glassformer TTFT ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, dict[str, dict]] = {}
    for r in result["rows"]:
        if r["batch"] == 1:
            groups.setdefault((r["model"], r["precision"], r["prompt"]), {})[r["engine"]] = r
    for (model, precision, prompt), engines in groups.items():
        ours = engines.get("glassformer")
        for name, peer in engines.items():
            if not name.startswith("llama.cpp") or ours is None:
                continue
            lines.append(
                f"| {model} | {precision} | {prompt} | {name.removeprefix('llama.cpp ')} | "
                f"{peer['decode_tok_s']:.1f} | {ours['decode_tok_s']:.1f} | "
                f"{ours['decode_tok_s'] / peer['decode_tok_s']:.2f}x | {peer['ttft_ms']:.0f} | "
                f"{ours['ttft_ms']:.0f} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("--llama", action="store_true", help="only glassformer vs llama.cpp")
    parser.add_argument("--prompt", type=int, help="only the rows of this prompt length")
    args = parser.parse_args()
    result = json.loads(args.json.read_text())
    lines = against_llama(result) if args.llama else all_rows(result, args.prompt)
    print("\n".join(lines))
    print(f"\nMeasured by {stamp(result)}.")


if __name__ == "__main__":
    main()
