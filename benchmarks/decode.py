"""Generation speed: glassformer against transformers on identical weights (seed 000 §2.5.1).

Decoding one token reads every weight once, and every cached key and value of its row, so its
speed limit is memory bandwidth: with B rows decoded together, at most
B * bandwidth / (weight_bytes + B * kv_bytes) tokens/s, kv_bytes the cache at the middle decode
step (the prompt and half the new tokens). This script measures the
bandwidth itself, a 1 GiB read (torch's sum with the same threads, from 2 MB pages as the
engines' weights are where the system has them; the best of 3) timed just before every run of
every engine, and takes each engine's median beside its own medians: on a shared machine the
bandwidth moves from run to run (24 to 55 GB/s here within minutes), so a limit measured
once, apart from the runs, says more about that moment than about the engines. It prints,
for every configuration, each engine's time to first token (prefill + the first sampled token)
and decode tokens/s (every row's tokens after the first, per second), its ratio to transformers
in the same precision, and its percent of the bandwidth limit. With llama.cpp's binaries built
(bash benchmarks/build_llama_cpp.sh), llama.cpp joins the SmolLM2 batch-1 runs in the same
precision through its own llama-bench (benchmarks/llama_cpp_peer.py's LlamaBench: the prompt's
processing, then the decode rate after it): the shipped Q4_1 GGUF file requantized by
llama-quantize into F32, BF16 and Q8_0 (in the run, into a temporary folder), and the Q4_1 file
itself beside int4. Keys and values: glassformer keeps them in the model's dtype and llama.cpp
in f16, each its default; --kv-cache-dtype fp16 or bf16 stores them so in both (the Engine's
kv_dtype, llama-bench's -ctk/-ctv), the equal precision to compare at long prompts, where the
cache is a large share of a step's bytes (llama-bench takes no f32). --json writes every row
with the machine, date and command, for benchmarks/render.py to turn into docs/performance.md's
tables.

Models: SmolLM2-135M-Instruct (the installed GGUF, dequantized to fp32) and GPT-2 124M with
random weights (preset gpt2-124m). transformers gets the same weights through
glassformer.interop.save_hf_model. Precisions: fp32, bf16 (the whole model in bf16 for both),
int8 (glassformer's weight-only int8, a scale per 64 weights) and int4 (a scale and a min per
32, Q4_1's form); transformers has no CPU int8 or int4 path without extra packages, so those
rows' ratio is to transformers bf16, its fastest. Prompts are
Hamlet's text; generation is greedy with EOS ignored, so every run makes --new-tokens
tokens per row. Runs are interleaved (glassformer, transformers, glassformer, ...) so load from
other processes hits both alike; each figure is the median of --runs.

    python benchmarks/decode.py                                   # everything (~30 min here)
    python benchmarks/decode.py --models smollm2 --batch 1 --prompt 128 --precision fp32
    python benchmarks/decode.py --models smollm2 --batch 1 --json benchmarks/results/decode.json
    python benchmarks/decode.py --with-plain   # also glassformer unfused, and without kernels
    python benchmarks/decode.py --models smollm2 --batch 1 --kv-cache-dtype fp16  # as llama.cpp

"glassformer" is what `Engine(model)` runs by default: batch-1 steps through the fused C step
(infer/fused.py), batches through the torch modules with the decode kernels. With --with-plain,
"glassformer unfused" is the same model with Engine(model, fast=False) (the modules and the
matrix-vector kernels, one torch op at a time), and "glassformer plain" the model as built.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from llama_cpp_peer import (  # benchmarks/
    LLAMA_CPP_TYPES,
    LlamaBench,
    llama_cpp_files,
    llama_cpp_version,
)
from torch import Tensor, nn

from glassformer.config import ModelConfig
from glassformer.data import shakespeare_plays
from glassformer.infer import huge_pages
from glassformer.infer.engine import Engine
from glassformer.infer.optimize import optimize_for_decode
from glassformer.infer.sampling import NO_EOS, SamplingParams
from glassformer.interop.hf import save_hf_model
from glassformer.interop.pretrained import from_pretrained
from glassformer.models import build_model

PRECISIONS = ("fp32", "bf16", "int8", "int4", "w8a8", "w4a8")
# --kv-cache-dtype: the Engine's kv_dtype and llama-bench's name for the same type
KV_CACHE_DTYPES = {"fp16": (torch.float16, "f16"), "bf16": (torch.bfloat16, "bf16")}
# w8a8 / w4a8: int8 / int4 weights whose inputs are rounded to int8 (glassformer.nn.quant's
# round_inputs), llama.cpp's own arithmetic for Q8_0 / Q4_1 (Q8_0 / Q8_1 activations)


# --- the machine's limit ------------------------------------------------------------------------


def read_buffer(gib: float = 1.0) -> Tensor:
    """`gib` GiB of fp32 ones to read for the bandwidth limit, in 2 MB pages where the system
    has them: the weights the engines read are there too (infer/huge_pages.py), and a read
    from 4 KB pages is slower (benchmarks/huge_pages.py), so it would be no limit."""
    n = int(gib * 2**30 / 4)
    if not huge_pages.supported():
        return torch.ones(n)
    return huge_pages.huge_page_empty(4 * n).view(torch.float32).fill_(1.0)


def memory_bandwidth_gb_s(gib: float = 1.0, repeats: int = 5) -> float:
    """Best read bandwidth of summing a `gib` GiB fp32 tensor (GB/s, 1e9 bytes)."""
    data = read_buffer(gib)
    data.sum()
    best = min(_timed(data.sum) for _ in range(repeats))
    return data.nbytes / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def weight_bytes_per_step(model: nn.Module) -> int:
    """Bytes of the matrices one decode step reads: every parameter and buffer of the blocks,
    the final norm and the lm_head; of the embedding table, one row per token (negligible)."""
    seen, total = set(), 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name.startswith(("tok_emb", "pos_emb")) or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.nbytes
    if model.lm_head.weight is model.tok_emb.weight:  # the head reads the whole shared table
        total += model.tok_emb.weight.nbytes
    return total


def kv_bytes_per_step(cfg: ModelConfig, element_size: int, position: float) -> float:
    """Bytes of the KV cache a decode step at `position` reads: every layer's keys and values."""
    return cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * element_size * position


# --- contestants --------------------------------------------------------------------------------


@dataclass
class Timing:
    time_to_first_token_s: list[float] = field(default_factory=list)
    decode_tokens_per_s: list[float] = field(default_factory=list)
    tokens: list[list[int]] | None = None  # the first run's greedy tokens, row by row

    def add(self, ttft: float, tok_s: float, tokens: list[list[int]]) -> None:
        self.time_to_first_token_s.append(ttft)
        self.decode_tokens_per_s.append(tok_s)
        if self.tokens is None:
            self.tokens = tokens

    @property
    def ttft_ms(self) -> float:
        return 1e3 * statistics.median(self.time_to_first_token_s)

    @property
    def tok_s(self) -> float:
        return statistics.median(self.decode_tokens_per_s)


def run_glassformer(engine: Engine, prompts: list[list[int]], new_tokens: int):
    if len(prompts) == 1:
        result = engine.generate(prompts[0], new_tokens, temperature=0, eos_token_id=NO_EOS)
        stats = result.stats
        return stats.time_to_first_token_s, stats.decode_tokens_per_s, [result.token_ids]
    # A batch: every row prefilled (each as it joins, one after another), then decoded
    # together; timed like transformers' batch, from the start until every row has its first
    # token, then every row's later tokens over the time after that. (Each row's own stats
    # count only its own tokens, and its decode clock runs through the later rows' prefills.)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, eos_token_id=NO_EOS)
    if engine.max_rows is None and not engine.rows:
        engine.reserve(len(prompts), min(engine.slot_len, max(map(len, prompts)) + new_tokens))
    start = time.perf_counter()
    rows = [engine.add(prompt, params) for prompt in prompts]
    first = time.perf_counter()
    while any(not row.finished for row in rows):
        engine.step()
    end = time.perf_counter()
    later_tokens = sum(len(row.tokens) - 1 for row in rows)
    return first - start, later_tokens / (end - first), [row.result().token_ids for row in rows]


class _Clock:
    """A transformers streamer that notes when each generation step's tokens arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_transformers(model, prompts: list[list[int]], new_tokens: int, pad_id: int):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding, as glassformer's batches
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    clock = _Clock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            streamer=clock if len(prompts) == 1 else None,
        )
    end = time.perf_counter()
    tokens = out[:, width:].tolist()
    if len(prompts) == 1:  # put() #0 is the prompt, #1 the first new token
        first = clock.times[1]
        decode_s = clock.times[-1] - first
    else:  # batched: the streamer takes one row only; time the prefill on its own instead
        first = start + _prefill_seconds(model, ids, mask)
        decode_s = end - first
    rows = len(prompts)
    return first - start, rows * (new_tokens - 1) / decode_s, tokens


def _prefill_seconds(model, ids, mask) -> float:
    with torch.inference_mode():
        return _timed(lambda: model(input_ids=ids, attention_mask=mask, use_cache=True))


# --- models and prompts -------------------------------------------------------------------------


def load_models(name: str, tmp: Path):
    """(glassformer fp32 model, transformers fp32 model, tokenizer or None, label) with
    identical weights."""
    import transformers

    tokenizer = None
    if name == "smollm2":
        model, tokenizer = from_pretrained("smollm2")
        label = "SmolLM2-135M"
    elif name == "gpt2":
        torch.manual_seed(0)
        model = build_model(ModelConfig.preset("gpt2-124m"))
        label = "GPT-2 124M (random)"
    else:
        raise ValueError(f"model {name!r} is not known: pick smollm2 or gpt2")
    model.eval()
    folder = save_hf_model(model, tmp / name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, hf, tokenizer, label


def prompt_tokens(
    vocab_size: int, length: int, batch: int, tokenizer=None, seed: int = 0
) -> list[list[int]]:
    """`batch` prompts of `length` tokens from Hamlet, each from its own place: the model's
    tokens when it has a tokenizer, else the text's bytes folded into the vocabulary (random
    weights: the speed does not depend on the tokenizer)."""
    text = shakespeare_plays("modern")["hamlet"]
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(batch):
        offset = int(torch.randint(0, len(text) - 8 * length, (1,), generator=generator))
        chunk = text[offset : offset + 8 * length]
        if tokenizer is not None:
            prompts.append(tokenizer.encode(chunk)[:length])
        else:
            data = chunk.encode()
            prompts.append([(data[i] * 257 + data[i + 1] * 31) % vocab_size
                            for i in range(length)])  # fmt: skip
    return prompts


def glassformer_variant(base: nn.Module, precision: str, plain: bool) -> nn.Module:
    model = copy.deepcopy(base)
    if plain:
        return model.to(torch.bfloat16) if precision == "bf16" else model
    from glassformer.nn.quant import quantize_int4, quantize_int8, round_inputs

    if precision in ("int8", "w8a8"):
        model = quantize_int8(model)
    elif precision in ("int4", "w4a8"):
        model = quantize_int4(model)
    else:
        return optimize_for_decode(model, precision)
    return round_inputs(model) if precision.startswith("w") else model


# --- the run ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gpt2"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--prompt", nargs="+", type=int, default=[128, 1024])
    parser.add_argument("--precision", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--with-plain", action="store_true", help="also glassformer unfused/plain")
    parser.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES),
                        help="keys/values in this dtype in every glassformer engine and llama.cpp "
                        "(default: glassformer the model's dtype, llama.cpp f16)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write every row here, with the machine")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.kv_dtype, llama_cache = KV_CACHE_DTYPES.get(args.kv_cache_dtype, (None, "f16"))

    bandwidth = memory_bandwidth_gb_s()
    print(f"threads {args.threads} | read bandwidth {bandwidth:.1f} GB/s at the start (best of "
          f"5; each row's limit: the median read just before its own runs) | {args.new_tokens} new "
          f"tokens | median of {args.runs} interleaved runs\n")  # fmt: skip
    header = (
        f"{'model':<20}{'prec':<6}{'batch':>5}{'prompt':>7}  {'engine':<20}{'TTFT ms':>9}"
        f"{'decode tok/s':>14}{'vs HF':>8}{'% of BW limit':>15}{'same tokens':>13}"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            base, hf_fp32, tokenizer, label = load_models(name, Path(tmp))
            gguf = llama_cpp_files(name, args.precision, Path(tmp), args.threads)
            hf_models = {"fp32": hf_fp32, "bf16": copy.deepcopy(hf_fp32).to(torch.bfloat16)}
            print(header)
            for precision in args.precision:
                contestants = {"glassformer": glassformer_variant(base, precision, plain=False)}
                if args.with_plain:
                    contestants["glassformer unfused"] = contestants["glassformer"]
                if args.with_plain and precision in ("fp32", "bf16"):
                    contestants["glassformer plain"] = glassformer_variant(base, precision, True)
                peers = [LLAMA_CPP_TYPES[precision]]
                llama = {f"llama.cpp {kind}": LlamaBench(gguf[kind], args.threads, llama_cache)
                         for kind in peers if kind in gguf}  # fmt: skip
                hf_peer = "fp32" if precision == "fp32" else "bf16"
                for batch in args.batch:
                    for length in args.prompt:
                        length = min(length, base.cfg.max_seq_len - args.new_tokens)
                        prompts = prompt_tokens(base.cfg.vocab_size, length, batch, tokenizer)
                        extra = llama if batch == 1 else {}
                        timings, reads = measure(contestants, hf_models[hf_peer], prompts, args,
                                                 extra)  # fmt: skip
                        where = {"model": label, "precision": precision, "batch": batch,
                                 "prompt": length}  # fmt: skip
                        rows += report(where, timings, hf_peer, {**contestants, **extra}, reads,
                                       args)  # fmt: skip
                del llama
            print()
    if args.json:
        write_json(args.json, rows, bandwidth, args)


def measure(contestants, hf_model, prompts, args, extra=None):
    """Interleaved runs of every glassformer variant, transformers and the `extra` runners
    (name -> callable(prompts, new_tokens) -> (ttft, tok/s, tokens)) -> (timings, reads):
    each engine's median read bandwidth (GB/s) just before its own runs, its limit's basis."""
    extra = extra or {}
    # The fused engines' weights in 2 MB pages ("unfused" shares them); "plain" as torch has them.
    engines = {name: Engine(model, fast=not name.endswith(("unfused", "plain")),
                            huge_pages=not name.endswith("plain"), kv_dtype=args.kv_dtype)
               for name, model in contestants.items()}  # fmt: skip
    runners = {name: functools.partial(run_glassformer, engine)
               for name, engine in engines.items()}  # fmt: skip
    runners["transformers"] = functools.partial(run_transformers, hf_model, pad_id=0)
    runners.update(extra)
    timings = {name: Timing() for name in runners}
    reads = {name: [] for name in runners}
    for runner in runners.values():  # one untimed warm-up each: allocation, the kernels' build
        runner(prompts, 4)
    data = read_buffer()  # 1 GiB, read before every run: the bandwidth limit moves by the minute
    data.sum()
    for _ in range(args.runs):
        for name, runner in runners.items():
            # After a pause: llama.cpp's threads spin for a while after their last token, and
            # a read beside them would see half the machine. The best of 3, as runs are medians.
            time.sleep(0.2)
            reads[name].append(data.nbytes / min(_timed(data.sum) for _ in range(3)) / 1e9)
            timings[name].add(*runner(prompts, args.new_tokens))
    return timings, {name: statistics.median(values) for name, values in reads.items()}


def report(where: dict, timings, hf_peer, contestants, reads: dict, args):
    """Print one line per engine; return them as dicts (for --json). `reads`: each engine's
    GB/s read just before its runs (measure). Its limit counts the bytes of its weights and of
    the KV cache at the middle decode step."""
    reference, batch, rows = timings["transformers"], where["batch"], []
    ours = contestants["glassformer"]
    position = where["prompt"] + args.new_tokens / 2  # the middle decode step's cached positions
    for name, timing in timings.items():
        contestant = contestants.get(name)
        if isinstance(contestant, LlamaBench):  # its KV cache is f16 or bf16
            engine, weight_bytes, element = name, contestant.bytes_per_token, 2
        elif contestant is None:  # transformers: its weights are glassformer's, in hf_peer
            engine, element = f"transformers {hf_peer}", 4 if hf_peer == "fp32" else 2
            same = where["precision"] == hf_peer
            weight_bytes = weight_bytes_per_step(ours) if same else None
        else:  # the cache takes the dtype of the model's float parameters, or --kv-cache-dtype
            engine, weight_bytes = name, weight_bytes_per_step(contestant)
            cache = args.kv_dtype or next(contestant.parameters()).dtype
            element = cache.itemsize
        kv_bytes = batch * kv_bytes_per_step(ours.cfg, element, position)
        bandwidth = reads[name]
        limit = batch * bandwidth * 1e9 / (weight_bytes + kv_bytes) if weight_bytes else None
        row = {**where, "engine": engine, "ttft_ms": timing.ttft_ms, "decode_tok_s": timing.tok_s,
               "vs_transformers": timing.tok_s / reference.tok_s,
               "read_bandwidth_gb_s": round(bandwidth, 2),
               "percent_of_bandwidth_limit": 100 * timing.tok_s / limit if limit else None,
               "same_tokens_as_transformers": None if contestant is None or timing.tokens is None
               else timing.tokens == reference.tokens}  # fmt: skip
        rows.append(row)
        percent = "" if limit is None else f"{row['percent_of_bandwidth_limit']:.0f}%"
        same = {None: "", True: "yes", False: "no"}[row["same_tokens_as_transformers"]]
        print(
            f"{where['model']:<20}{where['precision']:<6}{batch:>5}{where['prompt']:>7}  "
            f"{engine:<20}{timing.ttft_ms:>9.0f}{timing.tok_s:>14.1f}"
            f"{row['vs_transformers']:>7.2f}x{percent:>15}{same:>13}"
        )
    return rows


def write_json(path: Path, rows: list[dict], bandwidth: float, args) -> None:
    import datetime
    import json
    import platform
    import sys

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())  # fmt: skip
    peer = any(row["engine"].startswith("llama.cpp") for row in rows)
    machine = {"cpu": cpu, "cores": os.cpu_count(), "threads": args.threads,
               "read_bandwidth_gb_s": round(bandwidth, 2), "torch": torch.__version__,
               "llama_cpp": llama_cpp_version() if peer else None}  # fmt: skip
    result = {"command": "python " + " ".join(["benchmarks/decode.py", *sys.argv[1:]]),
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": machine, "new_tokens": args.new_tokens, "runs": args.runs,
              "kv_cache": {"glassformer": args.kv_cache_dtype or "the model's dtype",
                           "llama.cpp": args.kv_cache_dtype or "fp16"},
              "rows": rows}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
