"""The docs' performance tables, rendered from the benchmarks' JSON (benchmarks/results/*.json):
figures are never typed by hand. Each table sits in README.md or docs/*.md between
`<!-- table: NAME -->` and `<!-- /table -->`; NAME is a key of TABLES (at the bottom), which
names its JSON and the function that draws it. A benchmark writes its JSON with --json PATH
(record.py): the command, date, machine and every row it measured.

    python benchmarks/render.py                      # rewrite every table from its JSON
    python benchmarks/render.py --check              # exit 1 naming each table that differs
    python benchmarks/render.py --show decode-llama  # print one table
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path("benchmarks/results")  # under the repository root
MARKED = re.compile(
    r"^<!-- table: (?P<name>[\w-]+) -->\n(?P<body>.*?)^<!-- /table -->$", re.M | re.S
)
OPENING = re.compile(r"^<!-- table: ", re.M)


def markdown(header: list[str], rows: list[list[str]], align: str = "") -> list[str]:
    """A markdown table; align: one of ':' (right) or '-' per column, default all '-'."""
    rule = "|" + "|".join("---:" if a == ":" else "---" for a in align or "-" * len(header)) + "|"
    return ["| " + " | ".join(header) + " |", rule, *("| " + " | ".join(r) + " |" for r in rows)]


def columns(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    """Console columns as the benchmarks print them: the first `left` left-aligned, the rest
    right-aligned, two spaces apart (their dashed rule left out)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        cells = zip(row, widths, strict=True)
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(cells))

    return [line(header), *map(line, rows)]


def code_block(lines: list[str]) -> list[str]:
    return ["```", *lines, "```"]


# --- benchmarks/decode.py --------------------------------------------------------------------


def stamp(result: dict) -> str:
    m = result["machine"]
    peer = f", llama-cpp-python {m['llama_cpp_python']}" if m.get("llama_cpp_python") else ""
    peer = f"; llama.cpp: {m['llama_cpp']}" if m.get("llama_cpp") else peer
    kv = result.get("kv_cache")  # recorded since decode.py's --kv-cache-dtype
    if kv and m.get("llama_cpp"):
        peer += f"; keys/values: glassformer {kv['glassformer']}, llama.cpp {kv['llama.cpp']}"
    return (
        f"`{result['command']}` ({result['date'][:10]}; {m['cpu']}, {m['threads']} threads, "
        f"read bandwidth {m['read_bandwidth_gb_s']} GB/s at the start, each row's limit from "
        f"reads just before its runs; torch {m['torch']}{peer}; "
        f"{result['new_tokens']} new tokens, median of {result['runs']} runs)"
    )


def decode_rows(result: dict, prompt: int | None = None) -> list[str]:
    """Every engine's row (of one prompt length)."""
    rows = []
    for r in result["rows"]:
        if prompt is not None and r["prompt"] != prompt:
            continue
        same = {None: "", True: "yes", False: "no"}[r["same_tokens_as_transformers"]]
        percent = r["percent_of_bandwidth_limit"]
        rows.append(
            [
                r["model"],
                r["precision"],
                str(r["batch"]),
                str(r["prompt"]),
                r["engine"],
                f"{r['ttft_ms']:.0f}",
                f"{r['decode_tok_s']:.1f}",
                f"{r['vs_transformers']:.2f}x",
                "" if percent is None else f"{percent:.0f}%",
                same,
            ]
        )
    header = ["model", "precision", "batch", "prompt", "engine", "TTFT ms", "decode tok/s"]
    header += ["vs transformers", "% of bandwidth limit", "same tokens"]
    return markdown(header, rows)


def against_llama(result: dict, prompt: int | None = None) -> list[str]:
    """glassformer beside llama.cpp at each precision, batch 1: decode and TTFT."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in result["rows"]:
        if r["batch"] == 1 and (prompt is None or r["prompt"] == prompt):
            groups.setdefault((r["model"], r["precision"], r["prompt"]), {})[r["engine"]] = r
    rows = []
    for (model, precision, length), engines in groups.items():
        ours = engines.get("glassformer")
        for name, peer in engines.items():
            if not name.startswith("llama.cpp") or ours is None:
                continue
            rows.append(
                [
                    model,
                    precision,
                    str(length),
                    name.removeprefix("llama.cpp "),
                    f"{peer['decode_tok_s']:.1f}",
                    f"{ours['decode_tok_s']:.1f}",
                    f"{ours['decode_tok_s'] / peer['decode_tok_s']:.2f}x",
                    f"{peer['ttft_ms']:.0f}",
                    f"{ours['ttft_ms']:.0f}",
                ]
            )
    header = ["model", "precision", "prompt", "llama.cpp", "llama.cpp decode tok/s"]
    header += ["glassformer decode tok/s", "ratio", "llama.cpp TTFT ms", "glassformer TTFT ms"]
    return markdown(header, rows)


def measured_by(lines: list[str], result: dict) -> list[str]:
    return [*lines, "", f"Measured by {stamp(result)}."]


# --- benchmarks/step_bandwidth.py, huge_pages.py, prefill_matmul.py ----------------------------


def step_bandwidth(result: dict) -> list[str]:
    rows = [
        [
            r["model"],
            r["precision"],
            str(r["position"]),
            f"{r['mb_per_step']:.0f}",
            f"{r['step_gb_s']:.1f}",
            f"{r['read_gb_s']:.1f}",
            f"{r['step_over_read']:.2f}x",
        ]
        for r in result["rows"]
    ]
    header = ["model", "precision", "position", "MB per step", "step GB/s", "read GB/s"]
    return markdown([*header, "step / read"], rows)


def huge_pages(result: dict) -> list[str]:
    rows = [
        [
            f"{r['what']}, {r['unit']}",
            f"{r['pages_4k']:.1f}",
            f"{r['pages_2m']:.1f}",
            f"{r['ratio']:.2f}x",
        ]
        for r in result["rows"]
    ]
    return markdown(["what", "4 KB pages", "2 MB pages", "ratio"], rows)


# --- benchmarks/rag.py -----------------------------------------------------------------------


def rag_indexing(result: dict) -> list[str]:
    r = result["indexing"]
    ours, theirs = r["glassformer_chunks_per_s"], r["sentence_transformers_chunks_per_s"]
    rows = [
        ["glassformer `Encoder.encode`", f"{ours:.1f}", f"{r['ratio']:.2f}x"],
        ["sentence-transformers `encode`", f"{theirs:.1f}", "1.00x"],
        ["`rag index` end to end (chunk, embed, write, index)",
         f"{r['index_documents_chunks_per_s']:.1f}", ""],
    ]  # fmt: skip
    head = [f"{r['chunks']:,} chunks of 128 tokens, all-MiniLM-L6-v2", "chunks/s", "ratio"]
    note = f"The two encoders' vectors differ by at most {r['max_abs_difference']:.1e}."
    return [*markdown(head, rows, "-::"), "", note]


def rag_search(result: dict) -> list[str]:
    rows = [
        [
            f"{r['chunks']:,}",
            r["index"],
            f"{r['store_p50_ms']:.2f} / {r['store_p99_ms']:.2f}",
            f"{r['numpy_p50_ms']:.2f} / {r['numpy_p99_ms']:.2f}",
            f"{r['numpy_p50_ms'] / r['store_p50_ms']:.2f}x",
            f"{r['recall_at_10']:.3f}",
            f"{r['disk_bytes_per_chunk']:,.0f}",
        ]
        for r in result["search"]
    ]
    head = ["chunks", "store's search", "store p50 / p99 ms", "numpy exact p50 / p99 ms",
            "store speed-up at p50", "recall@10", "bytes on disk per chunk"]  # fmt: skip
    return markdown(head, rows, "--:::::")


# --- benchmarks/structured.py ------------------------------------------------------------------


def structured_engines(result: dict) -> list[str]:
    rows = [
        [
            f"{r['engine']}" + (" (glassformer's)" if r["engine"] == "llguidance" else ""),
            f"{r['setup_s']:.2f}",
            f"{r['compiled']} of {r['schemas']}",
            f"{r['accepted']} of {r['schemas']}",
            f"{r['compile_ms_median']:.1f} / {r['compile_ms_max']:.0f}",
            f"{r['mask_us_median']:.0f} / {r['mask_us_p99']:.0f}",
        ]
        for r in result["engines"]
    ]
    head = ["engine", "vocabulary setup s", "schemas compiled", "valid outputs accepted",
            "compile ms median / max", "mask us per token median / p99"]  # fmt: skip
    return markdown(head, rows, "-:::::")


def structured_decode(result: dict) -> list[str]:
    rows = [
        [
            str(r["batch"]),
            str(r["tokens_per_row"]),
            f"{r['free_tokens_per_s']:.1f}",
            f"{r['schema_tokens_per_s']:.1f}",
            f"{r['ratio']:.2f}x",
        ]
        for r in result["decode"]
    ]
    head = ["batch", "tokens per row", "free tok/s", "JSON schema tok/s", "ratio"]
    m = result["machine"]
    note = (
        f"Measured by `{result['command']}` ({result['date'][:10]}; {m['cpu']}, "
        f"{m['threads']} thread, torch {m['torch']}; median of {result['runs']} runs, "
        "alternating)."
    )
    return [*markdown(head, rows, ":::::"), "", note]


def structured_servers(result: dict) -> list[str]:
    """The schema suite and the decode schema through glassformer serve and llama-server."""
    servers = result["servers"]
    speed = {(r["server"], r["clients"]): r for r in servers["speed"]}
    rows = []
    for name, suite in servers["suite"].items():
        cells = [name, f"{suite['valid']} / {suite['invalid']} / {suite['length']} / "
                 f"{suite['refused']}"]  # fmt: skip
        for clients in sorted({c for _, c in speed}):
            r = speed[name, clients]
            cells.append(f"{r['tok_s']:.1f} tok/s, TTFT {r['ttft_s']:.2f} s")
        rows.append(cells)
    ours, peer = servers["suite"]
    ratios = ["glassformer / llama-server", ""]
    for clients in sorted({c for _, c in speed}):
        ratios.append(f"{speed[ours, clients]['tok_s'] / speed[peer, clients]['tok_s']:.2f}x")
    rows.append(ratios)
    head = ["server", "34 schemas: valid / invalid / cut / refused"]
    head += [f"{c} client{'s' if c > 1 else ''}" for c in sorted({c for _, c in speed})]
    m = result["machine"]
    threads = f"{m['threads']} thread{'s' if m['threads'] > 1 else ''}"
    note = (
        f"Measured by `{result['command']}` ({result['date'][:10]}; {m['cpu']}, "
        f"{threads} per server, llama.cpp from {servers['llama_cpp']}; "
        f"median of {result['runs']} runs, the servers alternating)."
    )
    return [*markdown(head, rows, "-" + ":" * (len(head) - 1)), "", note]


def prefill_matmul(result: dict) -> list[str]:
    """Each matrix at two prompt lengths side by side, errors at the longer; then whole prefill."""
    small, large = sorted({r["tokens"] for r in result["matrices"]})
    by = {(r["matrix"], r["tokens"]): r for r in result["matrices"]}
    rows = []
    for name in dict.fromkeys(r["matrix"] for r in result["matrices"]):
        a, b = by[name, small], by[name, large]
        out_features, in_features = a["shape"]
        rows.append(
            [
                f"{name} ({out_features}, {in_features})",
                f"{a['mkl_gflop_s']:.0f} / {a['onednn_gflop_s']:.0f} GFLOP/s",
                f"{a['onednn_vs_mkl']:.2f}x",
                f"{b['mkl_gflop_s']:.0f} / {b['onednn_gflop_s']:.0f} GFLOP/s",
                f"{b['onednn_vs_mkl']:.2f}x",
                f"{b['mkl_error']:.1e} / {b['onednn_error']:.1e}",
            ]
        )
    prefill = {r["tokens"]: r for r in result["prefill"]}
    cells = ["whole fp32 prefill, time to the first token"]
    for tokens in (small, large):
        p = prefill[tokens]
        cells += [f"{p['mkl_ms']:.1f} / {p['onednn_ms']:.1f} ms", f"{p['onednn_vs_mkl']:.2f}x"]
    rows.append([*cells, ""])
    header = ["matrix (out, in)", f"{small} rows: MKL / oneDNN", "ratio"]
    header += [f"{large} rows: MKL / oneDNN", "ratio"]
    header += [f"error vs float64 ({large} rows): MKL / oneDNN"]
    return markdown(header, rows)


def prefill_tiles(result: dict) -> list[str]:
    """int8/int4 and w8a8/w4a8 on the tile unit against the fp32 matmul of the dequantized
    weights (x rounded first for the latter): each matrix, then one prompt's prefill and a burst
    of prompts in one forward."""
    rows = []
    for r in result["matrices"]:
        shape, tiles, torch_ = tuple(r["shape"]), r["tiles_gmac_s"], r["torch_gmac_s"]
        rows.append(
            [
                f"{r['precision']} {r['matrix']} {shape}, {r['tokens']} rows",
                f"{tiles:.0f} GMAC/s",
                f"{torch_:.0f} GMAC/s",
                f"{tiles / torch_:.2f}x",
                f"{r['tiles_error']:.1e} / {r['torch_error']:.1e}",
            ]
        )
    for p in result["prefill"]:
        for what, ms in (("one 128-token prompt", p["prompt_ms"]),
                         (f"{p['burst']} x 128 tokens in one forward", p["burst_ms"])):  # fmt: skip
            rows.append(
                [
                    f"{p['precision']} prefill, {what}",
                    f"{ms['tiles']:.1f} ms",
                    f"{ms['torch']:.1f} ms",
                    f"{ms['torch'] / ms['tiles']:.2f}x",
                    "",
                ]
            )
    header = ["product", "tile unit", "fp32 matmul of the dequantized weights", "speed-up"]
    header += ["error vs float64: tiles / fp32"]
    return markdown(header, rows, "-:::-")


# --- benchmarks/kv_cache.py, quantization.py ---------------------------------------------------


def kv_cache(result: dict) -> list[str]:
    rows = [
        [
            str(r["context"]),
            f"{r['cache_tok_s']:.2f}",
            f"{r['recompute_tok_s']:.2f}",
            f"{r['ratio']:.1f}x",
            f"{r['kv_mib']:.1f}",
        ]
        for r in result["rows"]
    ]
    header = ["context", "with the KV cache, tok/s", "recomputing, tok/s", "ratio"]
    return markdown([*header, "KV cache MiB"], rows)


def kv_dtype(result: dict) -> list[str]:
    contexts = list(result["rows"][0]["decode_tok_s"])
    rows = [
        [
            r["kv_dtype"],
            f"{r['bytes_per_token']:,}",
            f"{r['perplexity']:.3f}",
            f"{r['perplexity_change_percent']:+.3f}%",
            f"{r['same_greedy_tokens']:.0%}",
            *(f"{r['decode_tok_s'][c]:.1f}" for c in contexts),
        ]
        for r in result["rows"]
    ]
    header = ["keys/values", "bytes per token", "perplexity", "vs fp32", "greedy as fp32's"]
    header += [f"decode tok/s after {c}" for c in contexts]
    m = result["machine"]
    note = (
        f"Measured by `{result['command']}` ({result['date'][:10]}; {m['cpu']}, {m['threads']} "
        f"threads; {result['model']} at its {result['weights']} weights; perplexity over "
        f"{result['windows']} windows of {result['window_tokens']} tokens fed in chunks of "
        f"{result['chunk']}; {result['new_tokens']} greedy tokens per window; decode rates the "
        f"median of {result['runs']} rounds, the dtypes alternating)."
    )
    return [*markdown(header, rows, "-::::" + ":" * len(contexts)), "", note]


QUANTIZATION_LABELS = {
    "int8 channel": "int8, a scale per row",
    "int8 64": "int8, a scale per 64 (default)",
    "int8 32": "int8, a scale per 32 (Q8_0)",
    "int4 32": "int4, a scale and a min per 32 (Q4_1)",
    "w8a8 32": "w8a8: int8 per 32, inputs rounded to int8",
    "w4a8 32": "w4a8: int4 (Q4_1), inputs rounded to int8",
    "gguf Q4_1": "GGUF Q4_1 file (shipped)",
    "gguf Q4_0": "GGUF Q4_0 file (llama.cpp, from Q4_1)",
    "gguf Q4_K_M": "GGUF Q4_K_M file (llama.cpp, from Q4_1)",
}


def quantization(result: dict) -> list[str]:
    rows = []
    for r in result["rows"]:
        change, peer = r["perplexity_vs_fp32_percent"], r["llama_cpp_perplexity"]
        rows.append(
            [
                QUANTIZATION_LABELS.get(r["weights"], r["weights"]),
                f"{r['mb']:.1f}",
                f"{r['perplexity']:.3f}",
                "" if r["weights"] == "fp32" else f"{change:+.2f}%",
                f"{r['decode_tok_s']:.1f}",
                f"{r['decode_vs_fp32']:.2f}x",
                "" if peer is None else f"{peer:.3f}",
            ]
        )
    header = ["weights", "MB", "perplexity", "vs fp32", "decode tok/s", "vs fp32"]
    return markdown([*header, "llama.cpp's perplexity"], rows)


# --- benchmarks/train_throughput.py ------------------------------------------------------------

TRAINING_LABELS = {"nanoGPT": "nanoGPT `model.py`, same run"}
MODE_LABELS = {"bf16": "bf16 autocast"}


def training(result: dict, modes: tuple[str, ...] = ("fp32", "bf16")) -> list[str]:
    rows = [
        [
            TRAINING_LABELS.get(r["model"], r["model"]),
            MODE_LABELS.get(r["mode"], r["mode"]),
            f"{r['tokens_per_s']:,.0f}",
            f"{r['mfu']:.1%}",
            f"{r['final_loss']:.4f}",
            f"{r['vs_reference']:.2f}x",
        ]
        for r in result["rows"]
        if r["mode"] in modes
    ]
    reference = f"vs nanoGPT's stated {result['reference_tokens_per_s']:,.0f} tok/s"
    return markdown(["model", "mode", "tokens/s", "MFU", "final loss", reference], rows)


def training_processes(result: dict) -> list[str]:
    def ms(value: float | None, form: str = ",.0f") -> str:
        return "-" if value is None else format(value, form)

    rows = [
        [
            f"{r['processes']} x {r['threads']} threads",
            f"{r['tokens_per_s']:,.0f}",
            ms(r["ms_per_step"]),
            ms(r["ms_per_step_no_sync"]),
            ms(r["exposed_allreduce_ms"]),
            ms(r["allreduce_alone_ms"], ",.1f"),
        ]
        for r in result["rows"]
    ]
    header = ["processes", "tokens/s", "ms/step", "ms/step no sync", "exposed all-reduce ms"]
    lines = columns([*header, "all-reduce alone ms"], rows, left=2)
    first = result["rows"][0]
    for r in result["rows"][1:]:
        lines.append(
            f"scaling efficiency {r['processes']} processes vs {first['processes']}: "
            f"{r['vs_first']:.2f} (tokens/s ratio on the same {result['machine']['threads']} "
            "cores; 1.00 is ideal)"
        )
    return code_block(lines)


# --- benchmarks/serve.py ------------------------------------------------------------------------


def serve_load(result: dict, clients: tuple[int, ...] | None = None) -> list[str]:
    lines = [
        f"{'clients':>7} {'tok/s conc':>11} {'tok/s seq':>10} {'ratio':>6} "
        f"{'p50 TTFT conc':>14} {'p99 TTFT conc':>14} {'p50 TTFT seq':>13}"
    ]
    for r in result["rows"]:
        if clients is None or r["clients"] in clients:
            lines.append(
                f"{r['clients']:>7} {r['tok_s_concurrent']:>11.1f} {r['tok_s_sequential']:>10.1f} "
                f"{r['ratio']:>5.2f}x {r['p50_ttft_concurrent_s']:>13.3f}s "
                f"{r['p99_ttft_concurrent_s']:>13.3f}s {r['p50_ttft_sequential_s']:>12.3f}s"
            )
    return code_block(lines)


def serve_peer(result: dict) -> list[str]:
    """glassformer serve beside llama-server: per precision and load, aggregate tokens/s,
    TTFT and inter-token gap of each, and the ratio; then one client against the engine."""
    by = {}
    for r in result["rows"]:
        ours = r["server"].startswith("glassformer")
        by.setdefault((r["precision"], r["clients"], r["new_tokens"], r["shared_prefix"]), {})[
            "ours" if ours else "peer"
        ] = r
    rows = []
    for (precision, clients, new_tokens, shared), pair in by.items():
        ours, peer = pair["ours"], pair["peer"]
        load = f"{clients} x {new_tokens}" + (f", {shared} shared" if shared else "")
        rows.append(
            [
                f"{precision} / {peer['server'].split()[-1]}",
                load,
                f"{ours['tok_s']:.1f}",
                f"{peer['tok_s']:.1f}",
                f"{ours['tok_s'] / peer['tok_s']:.2f}x",
                f"{ours['p50_ttft_s']:.2f} / {ours['p99_ttft_s']:.2f}",
                f"{peer['p50_ttft_s']:.2f} / {peer['p99_ttft_s']:.2f}",
                f"{ours['p50_gap_ms']:.1f} / {peer['p50_gap_ms']:.1f}",
                f"{ours['cached_tokens']:.0f}" if shared else "",
            ]
        )
    head = ["precision", "clients x new tokens", "glassformer tok/s", "llama-server tok/s",
            "ratio", "glassformer TTFT p50 / p99 s", "llama-server TTFT p50 / p99 s",
            "p50 gap ms (ours / peer)", "cached tokens"]  # fmt: skip
    measured = [e for e in result["engine"] if "served_vs_engine" in e]
    bare = any("bare_vs_engine" in e for e in measured)  # recorded since the bare client
    ceiling = any("client_ceiling" in e for e in measured)  # since the client's CPU
    engine = [
        [
            e["precision"],
            str(e["new_tokens"]),
            f"{e['tok_s']:.1f}",
            f"{e['served_decode_tok_s']:.1f}",
            f"{e['served_vs_engine']:.0%}",
            *([f"{e['client_cpu_ms']:.2f}", f"{e['client_ceiling']:.0%}"] if ceiling else []),
            *([f"{e['bare_decode_tok_s']:.1f}", f"{e['bare_vs_engine']:.0%}"] if bare else []),
        ]
        for e in measured
    ]
    engine_head = ["precision", "new tokens", "engine in process tok/s",
                   "one openai client through the server tok/s", "server / engine",
                   *(["openai client CPU ms a token", "most any server gives it"]
                     if ceiling else []),
                   *(["one bare client tok/s", "bare / engine"] if bare else [])]  # fmt: skip
    m = result["machine"]
    kv = result.get("kv_cache")  # recorded since the --kv-cache-dtype option
    caches = (
        f"; keys/values: glassformer {kv['glassformer']}, llama-server {kv['llama-server']}"
        if kv
        else ""
    )
    threads = f"{m['threads']} thread" + ("s" if m["threads"] != 1 else "")
    note = (
        f"Measured by `{result['command']}` ({result['date'][:10]}; {m['cpu']}, {threads} "
        f"per server, llama.cpp from {result['llama_cpp']}; "
        f"{result['prompt_tokens']}-token prompts, median of {result['runs']} runs, the servers "
        f"alternating{caches})."
    )
    engine_table = (
        [*markdown(engine_head, engine, "-" + ":" * (len(engine_head) - 1)), ""] if engine else []
    )
    return [*markdown(head, rows, "--:::::::"), "", *engine_table, note]


def serve_peer_short(result: dict, precision: str = "int4") -> list[str]:
    """The README's: one precision, distinct prompts, aggregate tokens/s and p99 TTFT of each
    server by client count."""
    by = {}
    for r in result["rows"]:
        if r["precision"] == precision and not r["shared_prefix"]:
            side = "ours" if r["server"].startswith("glassformer") else "peer"
            by.setdefault((r["clients"], r["new_tokens"]), {})[side] = r
    rows = [
        [
            f"{clients} x {new_tokens}",
            f"{pair['ours']['tok_s']:.1f}",
            f"{pair['peer']['tok_s']:.1f}",
            f"{pair['ours']['tok_s'] / pair['peer']['tok_s']:.2f}x",
            f"{pair['ours']['p99_ttft_s']:.2f} / {pair['peer']['p99_ttft_s']:.2f}",
        ]
        for (clients, new_tokens), pair in by.items()
    ]
    head = ["clients x new tokens", "glassformer serve tok/s", "llama-server tok/s", "ratio",
            "p99 TTFT s (ours / peer)"]  # fmt: skip
    return markdown(head, rows, "-::::")


def client_cpu(result: dict) -> list[str]:
    rows = []
    for r in result["rows"]:
        spent = f"{r['client_cpu_ms']:.2f}" if "client_cpu_ms" in r else ""
        share = f"{r['vs_engine']:.0%}" if r["vs_engine"] is not None else "(its own engine)"
        rows.append([r["client"], f"{r['decode_tok_s']:.1f}", share, spent])
    header = ["reader", "decode tok/s", "of the engine's", "its measured CPU ms a token"]
    m = result["machine"]
    run = (
        f"`{result['command']}` ({result['date'][:10]}; {m['cpu']}, {m['threads']} threads; "
        f"{result['model']}, {result['new_tokens']} new tokens, median of {result['runs']} runs)"
    )
    return [*markdown(header, rows, "-:::"), "", f"Measured by {run}."]


def serve_prefill_chunks(result: dict) -> list[str]:
    lines = [
        result["command"],
        f"burst: {result['burst_clients']} clients x {result['prompt_tokens']}-token prompts, "
        f"{result['new_tokens']} new tokens; join: {result['running']} running streams, "
        f"{result['join_prompts']} new {result['join_tokens']}-token prompts; medians of "
        f"{result['repeats']}",
        f"{'prefill chunk':>13} {'tok/s':>6} {'p50 TTFT':>9} {'p99 TTFT':>9} {'vs first':>8} "
        f"{'gap p50':>8} {'gap p99':>8} {'gap max':>8} {'vs first':>8} {'join p99 TTFT':>13}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['prefill_chunk'] or 'off':>13} {r['tok_s']:>6.1f} {r['p50_ttft_s']:>8.3f}s "
            f"{r['p99_ttft_s']:>8.3f}s {r['p99_ttft_vs_first']:>7.2f}x {r['gap_p50_s']:>7.3f}s "
            f"{r['gap_p99_s']:>7.3f}s {r['gap_max_s']:>7.3f}s {r['gap_p99_vs_first']:>7.2f}x "
            f"{r['join_p99_ttft_s']:>12.3f}s"
        )
    return code_block(lines)


# --- benchmarks/finetune_quality.py, finetune.py -----------------------------------------------


def finetune_quality(result: dict, systems: tuple[str, ...] | None = None) -> list[str]:
    rows = []
    for r in result["rows"]:
        if systems is not None and r["key"] not in systems:
            continue
        params = f"{r['trainable']:,}" if r["trainable"] else "0"
        if r["fraction"] is not None:
            params += f" ({r['fraction']:.2%})"
        minutes = r["train_minutes"]
        train_time = f"{minutes:.1f} min" if minutes else "0"
        rows.append([r["name"], params, train_time, f"{r['chrf']:.2f}", f"{r['bleu']:.2f}"])
    return markdown(
        ["system", "trainable params", "train time here", "chrF", "BLEU"], rows, "-::::"
    )


def finetune_speed(result: dict) -> list[str]:
    rows = [
        [
            r["contestant"],
            f"{r['tokens_per_s']:,.0f}",
            f"{r['ms_per_step']:,.1f}",
            f"{r['spread']:.0%}",
            f"{r['trainable']:,}",
            f"{r['params_mb']:,.2f}",
            f"{r['grads_mb']:,.2f}",
            f"{r['optim_mb']:,.2f}",
            f"{r['train_mb']:,.2f}",
        ]
        for r in result["rows"]
    ]
    header = ["contestant", "tokens/s", "ms/step", "spread", "trainable", "params MB"]
    lines = columns([*header, "grads MB", "optim MB", "train MB"], rows)
    speed, target = result["lora_vs_peft"], result["speed_target"]
    paired = result["paired"]
    lines += [
        "",
        f"glassformer LoRA / peft LoRA tokens/s: {speed:.2f}x "
        f"({'meets' if speed >= target else 'MISSES'} the target >= {target:.2f}x; same run, "
        "interleaved)",
        f"paired, round by round: median {paired['median']:.2f}x, glassformer LoRA the faster "
        f"of the two in {paired['faster']} of {paired['rounds']} rounds",
    ]
    return code_block(lines)


# --- the tables and where they go ---------------------------------------------------------------


@dataclass(frozen=True)
class Table:
    source: str  # the JSON's file name in benchmarks/results/
    draw: Callable[[dict], list[str]]


TABLES = {
    "decode-llama": Table("decode.json", lambda r: measured_by(against_llama(r), r)),
    "decode-llama-fp16-cache": Table(
        "decode_fp16_cache.json", lambda r: measured_by(against_llama(r), r)
    ),
    "decode-llama-fp16-cache-128": Table(
        "decode_fp16_cache.json", lambda r: against_llama(r, prompt=128)
    ),
    "decode-128": Table("decode.json", lambda r: measured_by(decode_rows(r, prompt=128), r)),
    "step-bandwidth": Table("step_bandwidth.json", step_bandwidth),
    "step-bandwidth-avx2": Table("step_bandwidth_avx2.json", step_bandwidth),
    "step-bandwidth-amd": Table("step_bandwidth_amd.json", step_bandwidth),
    "decode-llama-amd": Table("decode_amd.json", lambda r: measured_by(against_llama(r), r)),
    "huge-pages": Table("huge_pages.json", huge_pages),
    "prefill-matmul": Table("prefill_matmul.json", prefill_matmul),
    "prefill-tiles": Table("prefill_tiles.json", prefill_tiles),
    "kv-cache": Table("kv_cache.json", kv_cache),
    "kv-dtype": Table("kv_dtype.json", kv_dtype),
    "quantization": Table("quantization.json", quantization),
    "training": Table("train_throughput.json", training),
    "training-processes": Table("train_processes.json", training_processes),
    "serve-load": Table("serve.json", serve_load),
    "serve-prefill-chunks": Table("serve_prefill_chunks.json", serve_prefill_chunks),
    "serve-peer": Table("serve_peer.json", serve_peer),
    "serve-peer-int4": Table("serve_peer.json", serve_peer_short),
    "serve-peer-256": Table("serve_peer_256.json", serve_peer),
    "serve-peer-amd": Table("serve_peer_amd.json", serve_peer),
    "serve-peer-one-client": Table("serve_peer_one_client.json", serve_peer),
    "client-cpu": Table("client_cpu.json", client_cpu),
    "serve-peer-one-client-1-thread": Table("serve_peer_one_client_1thread.json", serve_peer),
    "finetune-quality": Table("finetune_quality.json", finetune_quality),
    "rag-indexing": Table("rag.json", rag_indexing),
    "rag-search": Table("rag.json", rag_search),
    "structured-engines": Table("structured.json", structured_engines),
    "structured-decode": Table("structured.json", structured_decode),
    "structured-servers": Table("structured_servers.json", structured_servers),
    "structured-decode-short": Table("structured.json", lambda r: structured_decode(r)[:-2]),
    "finetune-quality-short": Table(
        "finetune_quality.json", lambda r: finetune_quality(r, ("copy", "lora-qv", "full"))
    ),
    "finetune-speed": Table("finetune.json", finetune_speed),
}


def draw(name: str, root: Path = REPO) -> str:
    """Table `name` as its JSON gives it (lines joined, no final newline)."""
    table = TABLES[name]
    return "\n".join(table.draw(json.loads((root / RESULTS / table.source).read_text())))


def pages(root: Path = REPO) -> list[Path]:
    """The files that may hold tables: the README and the guides."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def rendered(text: str, root: Path = REPO) -> tuple[str, list[str]]:
    """`text` with every marked table drawn from its JSON, and the problems found on the way
    (an unknown table name, an opening marker without its closing one)."""
    problems: list[str] = []

    def replace(match: re.Match) -> str:
        name = match["name"]
        if name not in TABLES:
            problems.append(f"unknown table {name!r}: pick from {', '.join(TABLES)}")
            return match[0]
        # The blank line ends a markdown table: GitHub would read the marker as one more row.
        return f"<!-- table: {name} -->\n{draw(name, root)}\n\n<!-- /table -->"

    text = MARKED.sub(replace, text)
    unclosed = len(OPENING.findall(text)) - len(MARKED.findall(text))
    if unclosed:
        problems.append(f"{unclosed} '<!-- table: NAME -->' without its '<!-- /table -->'")
    return text, problems


def check(root: Path = REPO) -> list[str]:
    """One line per table whose text differs from what its JSON gives, and per bad marker."""
    problems = []
    for page in pages(root):
        text = page.read_text()
        new, found = rendered(text, root)
        where = page.relative_to(root)
        problems += [f"{where}: {p}" for p in found]
        if new == text:
            continue
        for old, match in zip(MARKED.finditer(text), MARKED.finditer(new), strict=True):
            if old["body"] != match["body"]:
                source = RESULTS / TABLES[match["name"]].source
                problems.append(
                    f"{where}: table {match['name']!r} differs from {source}: "
                    "run python benchmarks/render.py"
                )
    return problems


def write(root: Path = REPO) -> list[str]:
    """Rewrite every page's tables from their JSON; return the pages changed."""
    changed = []
    for page in pages(root):
        text = page.read_text()
        new, problems = rendered(text, root)
        if problems:
            raise SystemExit(f"{page.relative_to(root)}: {'; '.join(problems)}")
        if new != text:
            page.write_text(new)
            changed.append(str(page.relative_to(root)))
    return changed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 on a mismatch")
    parser.add_argument("--show", choices=list(TABLES), metavar="NAME", help="print one table")
    args = parser.parse_args()
    if args.show:
        print(draw(args.show))
    elif args.check:
        problems = check()
        print("\n".join(problems) or f"every table equals its JSON ({len(TABLES)} tables)")
        sys.exit(1 if problems else 0)
    else:
        changed = write()
        print("rewrote " + ", ".join(changed) if changed else "every table already equals its JSON")


if __name__ == "__main__":
    main()
