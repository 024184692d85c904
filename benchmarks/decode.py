"""Generation speed: glassformer against transformers on identical weights (seed 000 §2.5.1).

Decoding one token reads every weight once, so its speed limit is memory bandwidth: with B
rows decoded together, at most B * bandwidth / weight_bytes tokens/s. This script measures the
bandwidth itself (the best of a few 1 GiB reads, torch's sum with the same threads) and prints,
for every configuration, each engine's time to first token (prefill + the first sampled token)
and decode tokens/s (every row's tokens after the first, per second), its ratio to transformers
in the same precision, and its percent of the bandwidth limit. With llama-cpp-python installed,
llama.cpp joins the SmolLM2 batch-1 runs on the shipped Q4_1 GGUF file (same token ids, greedy).

Models: SmolLM2-135M-Instruct (the installed GGUF, dequantized to fp32) and GPT-2 124M with
random weights (preset gpt2-124m). transformers gets the same weights through
glassformer.interop.save_hf_model. Precisions: fp32, bf16 (the whole model in bf16 for both),
int8 (glassformer's weight-only int8 with per-channel scales; transformers has no CPU int8 path
without extra packages, so that row's ratio is to transformers bf16, its fastest). Prompts are
Hamlet's text; generation is greedy with EOS ignored, so every run makes --new-tokens
tokens per row. Runs are interleaved (glassformer, transformers, glassformer, ...) so load from
other processes hits both alike; each figure is the median of --runs.

    python benchmarks/decode.py                                   # everything (~30 min here)
    python benchmarks/decode.py --models smollm2 --batch 1 --prompt 128 --precision fp32
    python benchmarks/decode.py --with-plain   # also glassformer without the decode kernels
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch import nn

from glassformer.config import ModelConfig
from glassformer.data import shakespeare_plays
from glassformer.infer.engine import Engine
from glassformer.infer.optimize import optimize_for_decode
from glassformer.infer.sampling import NO_EOS
from glassformer.interop.hf import save_hf_model
from glassformer.interop.pretrained import from_pretrained
from glassformer.models import build_model

PRECISIONS = ("fp32", "bf16", "int8")


# --- the machine's limit ------------------------------------------------------------------------


def memory_bandwidth_gb_s(gib: float = 1.0, repeats: int = 5) -> float:
    """Best read bandwidth of summing a `gib` GiB fp32 tensor (GB/s, 1e9 bytes)."""
    data = torch.ones(int(gib * 2**30 / 4))
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
    results = engine.generate_batch(prompts, new_tokens, temperature=0, eos_token_id=NO_EOS)
    stats = results[0].stats  # the batch's shared times; tokens/s counts every row
    return stats.time_to_first_token_s, stats.decode_tokens_per_s, [r.token_ids for r in results]


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


class LlamaCpp:
    """llama.cpp through llama-cpp-python (when installed) on the shipped SmolLM2 GGUF file (Q4_1:
    the same weight values glassformer dequantizes, stored in 4.5 bits), fed the same token ids,
    greedy, batch 1."""

    def __init__(self, path: Path, threads: int, n_ctx: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads,
                         n_threads_batch=threads, n_batch=512, verbose=False)  # fmt: skip
        self.bytes_per_token = path.stat().st_size  # nearly all of the file is weights

    def __call__(self, prompts: list[list[int]], new_tokens: int):
        # reset(): llama-cpp-python would otherwise reuse the previous run's matching prompt
        # prefix from its cache and skip the prefill.
        self.llm.reset()
        start = time.perf_counter()
        tokens, first = [], None
        for token in self.llm.generate(prompts[0], top_k=1, temp=0.0, reset=True):
            if first is None:
                first = time.perf_counter()
            tokens.append(int(token))
            if len(tokens) == new_tokens:
                break
        end = time.perf_counter()
        return first - start, (new_tokens - 1) / (end - first), [tokens]


def llama_cpp_runner(name: str, threads: int, n_ctx: int) -> LlamaCpp | None:
    """A llama.cpp contestant for SmolLM2 when llama-cpp-python is installed, else None."""
    import importlib.util

    if name != "smollm2" or importlib.util.find_spec("llama_cpp") is None:
        return None
    from glassformer.interop.pretrained import resolve

    return LlamaCpp(resolve("smollm2"), threads, n_ctx)


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
    if precision == "int8":
        from glassformer.nn.quant import quantize_int8

        return quantize_int8(model)
    return optimize_for_decode(model, precision)


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
    parser.add_argument("--with-plain", action="store_true", help="also glassformer unoptimized")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    bandwidth = memory_bandwidth_gb_s()
    print(f"threads {args.threads} | measured read bandwidth {bandwidth:.1f} GB/s | "
          f"{args.new_tokens} new tokens | median of {args.runs} interleaved runs\n")  # fmt: skip
    header = (
        f"{'model':<20}{'prec':<6}{'batch':>5}{'prompt':>7}  {'engine':<18}{'TTFT ms':>9}"
        f"{'decode tok/s':>14}{'vs HF':>8}{'% of BW limit':>15}{'same tokens':>13}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            base, hf_fp32, tokenizer, label = load_models(name, Path(tmp))
            n_ctx = max(args.prompt) + args.new_tokens + 8
            llama_cpp = llama_cpp_runner(name, args.threads, n_ctx)
            hf_models = {"fp32": hf_fp32, "bf16": copy.deepcopy(hf_fp32).to(torch.bfloat16)}
            print(header)
            for precision in args.precision:
                contestants = {"glassformer": glassformer_variant(base, precision, plain=False)}
                if args.with_plain and precision != "int8":
                    contestants["glassformer plain"] = glassformer_variant(base, precision, True)
                hf_peer = "fp32" if precision == "fp32" else "bf16"
                for batch in args.batch:
                    for length in args.prompt:
                        length = min(length, base.cfg.max_seq_len - args.new_tokens)
                        prompts = prompt_tokens(base.cfg.vocab_size, length, batch, tokenizer)
                        extra = {}
                        if llama_cpp is not None and batch == 1:
                            extra["llama.cpp Q4_1"] = llama_cpp
                        timings = measure(contestants, hf_models[hf_peer], prompts, args, extra)
                        report(label, precision, batch, length, timings, hf_peer,
                               {**contestants, "llama.cpp": llama_cpp}, bandwidth)  # fmt: skip
            print()


def measure(contestants, hf_model, prompts, args, extra=None) -> dict[str, Timing]:
    """Interleaved runs of every glassformer variant, transformers and the `extra` runners
    (name -> callable(prompts, new_tokens) -> (ttft, tok/s, tokens))."""
    extra = extra or {}
    engines = {name: Engine(model) for name, model in contestants.items()}
    timings = {name: Timing() for name in [*engines, "transformers", *extra]}
    # one untimed warm-up each: allocation, kernel selection, the kernels' first build
    for engine in engines.values():
        run_glassformer(engine, prompts, 4)
    run_transformers(hf_model, prompts, 4, pad_id=0)
    for runner in extra.values():
        runner(prompts, 4)
    for _ in range(args.runs):
        for name, engine in engines.items():
            timings[name].add(*run_glassformer(engine, prompts, args.new_tokens))
        timings["transformers"].add(*run_transformers(hf_model, prompts, args.new_tokens, 0))
        for name, runner in extra.items():
            timings[name].add(*runner(prompts, args.new_tokens))
    return timings


def report(label, precision, batch, length, timings, hf_peer, contestants, bandwidth) -> None:
    reference = timings["transformers"]
    for name, timing in timings.items():
        model = contestants.get(name)
        if name == "llama.cpp Q4_1":
            limit = batch * bandwidth * 1e9 / contestants["llama.cpp"].bytes_per_token
            same = "yes" if timing.tokens == reference.tokens else "no"
            ratio = timing.tok_s / reference.tok_s
            print(
                f"{label:<20}{precision:<6}{batch:>5}{length:>7}  {name:<18}"
                f"{timing.ttft_ms:>9.0f}{timing.tok_s:>14.1f}{ratio:>7.2f}x"
                f"{100 * timing.tok_s / limit:>14.0f}%{same:>13}"
            )
            continue
        if model is None:
            engine = f"transformers {hf_peer}"
            limit_model = contestants["glassformer"] if precision != "int8" else None
        else:
            engine, limit_model = name, model
        ratio = timing.tok_s / reference.tok_s
        percent = ""
        if limit_model is not None and (model is not None or precision == hf_peer):
            limit = batch * bandwidth * 1e9 / weight_bytes_per_step(limit_model)
            percent = f"{100 * timing.tok_s / limit:.0f}%"
        same = "" if model is None else ("yes" if timing.tokens == reference.tokens else "no")
        print(
            f"{label:<20}{precision:<6}{batch:>5}{length:>7}  {engine:<18}{timing.ttft_ms:>9.0f}"
            f"{timing.tok_s:>14.1f}{ratio:>7.2f}x{percent:>15}{same:>13}"
        )


if __name__ == "__main__":
    main()
