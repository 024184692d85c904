"""Training throughput of nanoGPT's "baby GPT" on CPU: fp32 vs bf16 autocast, with MFU against
a matmul peak measured in the same process, and optionally nanoGPT itself timed side by side.

FLOPs per token, nanoGPT's estimate_mfu (PaLM appendix B):

    flops_per_token = 6 * N + 12 * L * H * D * T

N counts the parameters that take part in matmuls: every parameter except the position table,
and except the token table when it is not tied (a lookup is not a matmul; tied, it *is* the
lm_head's V x C matmul, so it stays in). 6 = 2 FLOPs per multiply-add x 3 matmuls per weight
(forward, grad of input, grad of weight). 12 * L * H * D * T is attention's QK^T and AV over all
T keys (the causal half is not discounted, as in nanoGPT). For baby GPT, N = 10.67M and
flops_per_token = 71.1 MFLOP. MFU = tokens/s * flops_per_token / peak, where peak is the best
GFLOP/s of a large square matmul timed here with the same thread count: fp32 for fp32 mode, bf16
for bf16 autocast mode.

Every contestant (glassformer fp32, glassformer bf16, and with --nanogpt the same two for
nanoGPT) starts from the same weights and sees the same seeded batches, so its losses are at
equal tokens. The batches are random but learnable: a seeded random bigram Markov chain, whose
next-token entropy is printed; the loss falls toward it, and bf16 vs fp32 is visible. Timed runs
are interleaved (A B A B ...) so load from other processes hits every contestant alike; each
figure is the median over --runs runs of --steps steps, after --warmup untimed steps.

    python benchmarks/train_throughput.py
    python benchmarks/train_throughput.py --nanogpt /tmp/nanogpt/model.py   # karpathy/nanoGPT

Scaling over processes (issue 17), `--procs 1 2`: the same model and global batch trained by
P processes of --threads / P threads each, launched by torchrun (DDP over gloo on loopback,
through the trainer's own train/distributed.py: each rank takes its rows of the global batch).
Each P is one torchrun job per run, the jobs interleaved (1 2 1 2 ... with the order rotating),
each reporting the median of --steps timed steps after --warmup. Per P it prints tokens/s,
ms/step, and what gradient synchronisation costs: "exposed all-reduce" is the median step minus
the median step taken under DDP's no_sync() (the same work without any all-reduce, measured in
the same job, interleaved), and "all-reduce alone" times one all-reduce of every gradient's
bytes with nothing else running. Scaling efficiency is tokens/s at P processes over tokens/s at
one process: the same cores either way, so 1.00 is the ideal.

    python benchmarks/train_throughput.py --procs 1 2 --runs 3 --steps 4

--json PATH also writes every row with the command, date and machine (benchmarks/record.py),
for benchmarks/render.py: the docs' tables are benchmarks/results/train_throughput.json (with
--nanogpt) and train_processes.json (--procs 1 2 --runs 3 --steps 4).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import record  # benchmarks/record.py
import torch
from torch import Tensor, nn

from glassformer.config import ModelConfig
from glassformer.models.gpt import GPT

MODES = {"fp32": None, "bf16": torch.bfloat16}
REFERENCE_LABEL = "reference (nanoGPT train.py, stated)"
EVAL_BATCHES = 4  # held-out batches for the fp32 eval loss


# --- FLOPs and the measured peak ------------------------------------------------------------


def flops_per_token(model: GPT) -> tuple[int, int]:
    """(N, FLOPs per trained token) by the formula in the module docstring."""
    cfg = model.cfg
    n_params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    if model.pos_emb is not None and isinstance(model.pos_emb.weight, nn.Parameter):
        n_params -= model.pos_emb.weight.numel()
    if not cfg.tie_embeddings:
        n_params -= model.tok_emb.weight.numel()
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * cfg.max_seq_len
    return n_params, 6 * n_params + attention


def matmul_gflops(dtype: torch.dtype, size: int, repeats: int = 3) -> float:
    """Best GFLOP/s of a (size x size) @ (size x size) matmul: the peak MFU is measured against."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    a @ b  # first call: allocation, oneDNN/MKL kernel selection
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


# --- data ------------------------------------------------------------------------------------


def bigram_chain(vocab_size: int, branching: int, generator: torch.Generator) -> Tensor:
    """A random transition matrix (V, V): each token has `branching` likely successors."""
    logits = torch.full((vocab_size, vocab_size), -math.inf)
    for token in range(vocab_size):
        successors = torch.randperm(vocab_size, generator=generator)[:branching]
        logits[token, successors] = torch.randn(branching, generator=generator)
    return logits.softmax(dim=-1)


def chain_entropy(transitions: Tensor) -> float:
    """Next-token entropy in nats under the chain's stationary distribution: the loss floor."""
    stationary = torch.full((transitions.shape[0],), 1.0 / transitions.shape[0])
    for _ in range(1000):
        stationary = stationary @ transitions
    plogp = torch.where(transitions > 0, transitions * transitions.log(), 0.0)
    return float(-(stationary * plogp.sum(dim=-1)).sum())


def sample_batches(
    transitions: Tensor, n_batches: int, batch_size: int, seq_len: int, generator: torch.Generator
) -> list[tuple[Tensor, Tensor]]:
    """n_batches (inputs, targets) pairs of shape (B, T), walked along the chain."""
    rows = n_batches * batch_size
    tokens = torch.empty(rows, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(transitions.shape[0], (rows,), generator=generator)
    for t in range(seq_len):
        probs = transitions[tokens[:, t]]  # (rows, V)
        tokens[:, t + 1] = torch.multinomial(probs, 1, generator=generator)[:, 0]
    chunks = tokens.split(batch_size)
    return [(chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()) for chunk in chunks]


# --- contestants -----------------------------------------------------------------------------


def make_optimizer(
    model: nn.Module, kind: str, lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    """AdamW as nanoGPT configures it: decay matrices and embeddings, not biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    implementation = {
        "fused": dict(fused=True),
        "foreach": dict(foreach=True),
        "loop": dict(foreach=False),
    }
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99), **implementation[kind])


@dataclass
class Contestant:
    """One model in one precision, with its own optimizer, walking the shared batch list."""

    name: str
    mode: str
    model: nn.Module
    loss_fn: Callable[[Tensor, Tensor], Tensor]  # (inputs, targets) -> scalar loss
    eval_fn: Callable[[Tensor, Tensor], Tensor]  # the same, never compiled
    optimizer: torch.optim.Optimizer
    losses: list[float] = field(default_factory=list)
    run_seconds: list[float] = field(default_factory=list)
    first_step_s: float = 0.0

    def step(self, batches: list[tuple[Tensor, Tensor]]) -> None:
        inputs, targets = batches[len(self.losses)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=MODES[self.mode] is not None):
            loss = self.loss_fn(inputs, targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(loss.item())

    def run(self, batches: list[tuple[Tensor, Tensor]], steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            self.step(batches)
        return time.perf_counter() - start


def glassformer_loss(model: GPT) -> Callable[[Tensor, Tensor], Tensor]:
    return lambda inputs, targets: model.loss(inputs, targets).loss


def nanogpt_loss(model: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
    return lambda inputs, targets: model(inputs, targets)[1]


# nanoGPT parameter names for glassformer's, for copying the same init into nanoGPT
NANOGPT_NAMES = [
    ("tok_emb.", "transformer.wte."),
    ("pos_emb.", "transformer.wpe."),
    ("final_norm.", "transformer.ln_f."),
    ("blocks.", "transformer.h."),
    (".attn_norm.", ".ln_1."),
    (".attn.qkv_proj.", ".attn.c_attn."),
    (".attn.out_proj.", ".attn.c_proj."),
    (".ffn_norm.", ".ln_2."),
    (".ffn.fc_in.", ".mlp.c_fc."),
    (".ffn.fc_out.", ".mlp.c_proj."),
]


def load_nanogpt(path: Path, cfg: ModelConfig, init: dict[str, Tensor]) -> nn.Module:
    """karpathy/nanoGPT's GPT from its model.py, with glassformer's initial weights copied in."""
    if not (cfg.position == "learned" and cfg.norm == "layer" and cfg.ffn == "gelu"):
        raise SystemExit(
            f"--nanogpt needs a GPT-2-style preset (learned positions, LayerNorm, gelu), got "
            f"position={cfg.position}, norm={cfg.norm}, ffn={cfg.ffn}: use --preset baby-gpt"
        )
    if path.is_dir():
        path = path / "model.py"
    if not path.is_file():
        raise SystemExit(f"--nanogpt {path}: no such file; pass nanoGPT's model.py")
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ng_cfg = module.GPTConfig(
        block_size=cfg.max_seq_len,
        vocab_size=cfg.vocab_size,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        n_embd=cfg.d_model,
        dropout=cfg.dropout,
        bias=cfg.bias,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its parameter count
        model = module.GPT(ng_cfg)
    state = {}
    for name, tensor in init.items():
        for ours, theirs in NANOGPT_NAMES:
            name = name.replace(ours, theirs)
        state[name] = tensor
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [n for n in missing if not n.endswith(".attn.bias")]  # its non-flash mask buffer
    if missing or unexpected:
        raise SystemExit(
            f"nanoGPT names do not match: missing {missing}, unexpected {unexpected}; "
            "update NANOGPT_NAMES for this nanoGPT version"
        )
    return model


@torch.no_grad()
def eval_loss(contestant: Contestant, batches: list[tuple[Tensor, Tensor]]) -> float:
    """Mean fp32 loss on held-out batches: compares what each run learned, not how it ran."""
    return statistics.fmean(float(contestant.eval_fn(x, y)) for x, y in batches)


# --- report ----------------------------------------------------------------------------------


def print_table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(row: list[str]) -> str:  # names left-aligned, numbers right-aligned
        cells = zip(row, widths, strict=True)
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(cells))

    print(line(header))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(line(row))


def report(
    args: argparse.Namespace,
    contestants: list[Contestant],
    evals: dict[int, float],
    peaks: dict[str, float],
    flops: int,
    tokens_per_step: int,
) -> list[dict]:
    """Print the table and the ratios; return every contestant's row (for --json)."""
    rows, tokens_per_s, records = [], {}, []
    for i, c in enumerate(contestants):
        median = statistics.median(c.run_seconds)
        rate = tokens_per_step * args.steps / median
        tokens_per_s[c.name, c.mode] = rate
        per_run = [tokens_per_step * args.steps / s for s in c.run_seconds]
        spread = (max(per_run) - min(per_run)) / rate
        rows.append(
            [
                c.name,
                c.mode,
                f"{rate:,.0f}",
                f"{median / args.steps * 1000:,.1f}",
                f"{spread:.0%}",
                f"{rate * flops / (peaks[c.mode] * 1e9):.1%}",
                f"{c.first_step_s:.2f}",
                f"{c.losses[0]:.4f}",
                f"{statistics.fmean(c.losses[-args.steps :]):.4f}",
                f"{evals[i]:.4f}",
                f"{rate / args.reference_tokens_per_s:.2f}x",
            ]
        )
        records.append(
            {
                "model": c.name,
                "mode": c.mode,
                "tokens_per_s": rate,
                "ms_per_step": median / args.steps * 1000,
                "spread": spread,
                "mfu": rate * flops / (peaks[c.mode] * 1e9),
                "first_step_s": c.first_step_s,
                "first_loss": c.losses[0],
                "final_loss": statistics.fmean(c.losses[-args.steps :]),
                "eval_loss": evals[i],
                "vs_reference": rate / args.reference_tokens_per_s,
            }
        )
    reference = args.reference_tokens_per_s
    reference_mfu = reference * flops / (peaks["fp32"] * 1e9)
    reference_ms = tokens_per_step / reference * 1000
    reference_row = [REFERENCE_LABEL, "fp32", f"{reference:,.0f}", f"{reference_ms:,.1f}", ""]
    reference_row += [f"{reference_mfu:.1%}", "", "", "", "", "1.00x"]
    rows.append(reference_row)
    header = ["model", "mode", "tokens/s", "ms/step", "spread", "MFU", "first step s"]
    header += ["loss@0", "final loss", "eval loss", "vs reference"]
    print_table(rows, header)
    print(
        "spread: (max - min) / median tokens/s over the runs. first step s: includes "
        "torch.compile if on.\n"
        f"final loss: mean training loss of the last {args.steps} steps (same batches in every "
        f"row). eval loss: fp32 loss on {EVAL_BATCHES} held-out batches after training."
    )

    print()
    by_key = {(c.name, c.mode): c for c in contestants}
    for name in dict.fromkeys(c.name for c in contestants):
        if (name, "fp32") in by_key and (name, "bf16") in by_key:
            fp32, bf16 = by_key[name, "fp32"], by_key[name, "bf16"]
            loss_fp32 = statistics.fmean(fp32.losses[-args.steps :])
            loss_bf16 = statistics.fmean(bf16.losses[-args.steps :])
            speedup = tokens_per_s[name, "bf16"] / tokens_per_s[name, "fp32"]
            print(
                f"{name} bf16/fp32: tokens/s {speedup:.2f}x,"
                f" final loss {loss_bf16:.4f} vs {loss_fp32:.4f} ({loss_bf16 - loss_fp32:+.4f},"
                f" {(loss_bf16 - loss_fp32) / loss_fp32:+.2%})"
            )
    if args.nanogpt:
        for mode in args.modes:
            ratio = tokens_per_s["glassformer", mode] / tokens_per_s["nanoGPT", mode]
            print(f"glassformer/nanoGPT {mode}: tokens/s {ratio:.2f}x (same run, interleaved)")
    return records


# --- scaling over processes (--procs) --------------------------------------------------------


def scaling_worker(args: argparse.Namespace) -> None:
    """One rank of a --procs job (under torchrun): time DDP steps, steps without gradient sync,
    and one all-reduce of all the gradients; rank 0 prints the timings as one JSON line."""
    import torch.distributed as dist

    from glassformer.train.distributed import Parallel

    parallel = Parallel.start("auto", torch.device("cpu"))
    world = parallel.ranks.world_size
    torch.set_num_threads(max(1, args.threads // world))
    torch.manual_seed(args.seed)  # every rank builds the same model (DDP checks it)
    cfg = ModelConfig.preset(args.preset, dropout=0.0, attention_backend=args.attention)
    model = GPT(cfg).train()
    parallel.wrap(model, None)
    optimizer = make_optimizer(model, args.optimizer, args.lr, args.weight_decay)
    generator = torch.Generator().manual_seed(args.seed)
    transitions = bigram_chain(cfg.vocab_size, args.branching, generator)
    n_steps = args.warmup + 2 * args.steps
    batches = sample_batches(transitions, n_steps, args.batch_size, cfg.max_seq_len, generator)

    def step(index: int, sync: bool) -> float:
        inputs, targets = batches[index]
        rows, weight = parallel.shard({"input_ids": inputs, "targets": targets})
        start = time.perf_counter()
        with parallel.gradient_sync(sync):
            (parallel.loss(**rows).loss * weight).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for index in range(args.warmup):
        step(index, sync=True)
    synced, local = [], []
    for i in range(args.steps):  # interleaved: load from other processes hits both alike
        synced.append(step(args.warmup + 2 * i, sync=True))
        local.append(step(args.warmup + 2 * i + 1, sync=False))
    allreduce = []
    if world > 1:
        flat = torch.zeros(sum(p.numel() for p in model.parameters()))
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(flat)
            allreduce.append(time.perf_counter() - start)
    if parallel.is_main:
        result = {"procs": world, "threads": torch.get_num_threads(), "step_s": synced}
        result |= {"local_step_s": local, "allreduce_s": allreduce}
        print("RESULT " + json.dumps(result), flush=True)
    parallel.close()


def scaling(args: argparse.Namespace) -> None:
    """Launch one torchrun job per (run, P), interleaved, and print the scaling table."""
    from glassformer.train.distributed import Parallel  # noqa: F401  (fail early if missing)

    cfg = ModelConfig.preset(args.preset)
    tokens_per_step = args.batch_size * cfg.max_seq_len
    bad = [p for p in args.procs if p < 1 or args.batch_size % p or args.threads % p]
    if bad:
        raise SystemExit(
            f"--procs {bad}: each P must divide --batch-size ({args.batch_size}) and --threads"
            f" ({args.threads})"
        )
    print(
        f"{args.preset}: batch {args.batch_size} x {cfg.max_seq_len} = {tokens_per_step} tokens"
        f" per step (global) | {args.threads} threads in all, split over the processes | DDP,"
        f" gloo on 127.0.0.1 | {args.warmup} warm-up steps, then {args.steps} timed steps per"
        f" job, median of {args.runs} interleaved jobs per P | torch {torch.__version__}"
    )
    results: dict[int, list[dict]] = {p: [] for p in args.procs}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    for run in range(args.runs):
        order = args.procs[run % len(args.procs) :] + args.procs[: run % len(args.procs)]
        for procs in order:
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                       str(procs), "--master-addr", "127.0.0.1", "--master-port",
                       str(_free_port()), __file__, "--worker", *sys.argv[1:]]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                raise SystemExit(f"the {procs}-process job failed:\n{done.stderr[-3000:]}")
            results[procs].append(json.loads(lines[-1].removeprefix("RESULT ")))

    def median_of_medians(rows: list[dict], key: str) -> float:
        return statistics.median(statistics.median(r[key]) for r in rows) if rows[0][key] else 0

    rows, rates, records = [], {}, []
    for procs, runs in results.items():
        step = median_of_medians(runs, "step_s")
        local = median_of_medians(runs, "local_step_s")
        alone = median_of_medians(runs, "allreduce_s")
        rates[procs] = tokens_per_step / step
        exposed = f"{(step - local) * 1000:,.0f}" if procs > 1 else "-"
        rows.append(
            [
                f"{procs} x {runs[0]['threads']} threads",
                f"{rates[procs]:,.0f}",
                f"{step * 1000:,.0f}",
                f"{local * 1000:,.0f}" if procs > 1 else "-",
                exposed,
                f"{alone * 1000:,.1f}" if procs > 1 else "-",
            ]
        )
        records.append(
            {
                "processes": procs,
                "threads": runs[0]["threads"],
                "tokens_per_s": rates[procs],
                "ms_per_step": step * 1000,
                "ms_per_step_no_sync": local * 1000 if procs > 1 else None,
                "exposed_allreduce_ms": (step - local) * 1000 if procs > 1 else None,
                "allreduce_alone_ms": alone * 1000 if procs > 1 else None,
            }
        )
    header = ["processes", "tokens/s", "ms/step", "ms/step no sync", "exposed all-reduce ms"]
    print_table(rows, [*header, "all-reduce alone ms"])
    base = min(args.procs)
    for procs in args.procs:
        if procs != base:
            print(
                f"scaling efficiency {procs} processes vs {base}: "
                f"{rates[procs] / rates[base]:.2f} (tokens/s ratio on the same {args.threads}"
                " cores; 1.00 is ideal)"
            )
    if args.json:
        for r in records:
            r["vs_first"] = r["tokens_per_s"] / rates[base]
        settings = {"preset": args.preset, "batch_size": args.batch_size, "runs": args.runs}
        record.write(args.json, args.threads, {**settings, "steps": args.steps, "rows": records})


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- main ------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Training tokens/s, ms/step, MFU and loss at equal tokens for nanoGPT's baby "
        "GPT on CPU, fp32 vs bf16 autocast (optionally vs nanoGPT itself).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--preset", default="baby-gpt", help="glassformer ModelConfig preset")
    parser.add_argument("--batch-size", type=int, default=12, help="sequences per step")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--steps", type=int, default=10, help="training steps per timed run")
    parser.add_argument("--runs", type=int, default=5, help="timed runs; the median is reported")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before the runs")
    parser.add_argument(
        "--modes",
        default="fp32,bf16",
        type=lambda s: s.split(","),
        help="comma-separated precisions: fp32 and/or bf16 (torch.autocast('cpu', bfloat16))",
    )
    parser.add_argument(
        "--optimizer",
        choices=["fused", "foreach", "loop"],
        default="fused",
        help="AdamW implementation; fused measured fastest on CPU here (optimizer.step ~7 ms vs "
        "~17 ms for foreach or the for-loop)",
    )
    parser.add_argument(
        "--attention",
        choices=["sdpa", "eager"],
        default="sdpa",
        help="glassformer's attention_backend: SDPA's is_causal kernel or the written-out steps",
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay on matrices")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the loss function; the compile time shows in 'first step s'",
    )
    parser.add_argument(
        "--peak-size", type=int, default=3072, help="side of the square matmul timed for the peak"
    )
    parser.add_argument(
        "--reference-tokens-per-s",
        type=float,
        default=1650.0,
        help=f"fp32 tokens/s to compare against, printed as '{REFERENCE_LABEL}'",
    )
    parser.add_argument(
        "--nanogpt",
        type=Path,
        default=None,
        help="path to karpathy/nanoGPT's model.py (or its folder): time its GPT in the same "
        "run, same init, batches and optimizer, interleaved with glassformer",
    )
    parser.add_argument("--branching", type=int, default=4, help="successors per token in the data")
    parser.add_argument("--seed", type=int, default=1337, help="seed for weights and data")
    parser.add_argument(
        "--procs",
        type=int,
        nargs="+",
        help="scaling mode: train with each of these process counts (torchrun, DDP over gloo),"
        " --threads split among them, and compare tokens/s",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write every row here (benchmarks/results/)")
    args = parser.parse_args()
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"--modes {unknown} not known: pick from {', '.join(MODES)}")
    if min(args.steps, args.runs, args.warmup) < 1:
        parser.error("--steps, --runs and --warmup must be >= 1 (the first step always warms up)")
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        return scaling_worker(args)
    if args.procs:
        return scaling(args)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = ModelConfig.preset(args.preset, dropout=0.0, attention_backend=args.attention)
    init_model = GPT(cfg)  # every contestant starts from these weights
    init = {k: v.clone() for k, v in init_model.state_dict().items()}
    n_params, flops = flops_per_token(init_model)

    generator = torch.Generator().manual_seed(args.seed)
    transitions = bigram_chain(cfg.vocab_size, args.branching, generator)
    n_train = args.warmup + args.runs * args.steps
    n_batches = n_train + EVAL_BATCHES
    batches = sample_batches(transitions, n_batches, args.batch_size, cfg.max_seq_len, generator)
    train_batches, eval_batches = batches[:n_train], batches[n_train:]

    contestants = []
    names = ["glassformer", "nanoGPT"] if args.nanogpt else ["glassformer"]
    for name in names:
        for mode in args.modes:
            if name == "glassformer":
                model = GPT(cfg)
                model.load_state_dict(init)
                loss_fn = glassformer_loss(model)
            else:
                model = load_nanogpt(args.nanogpt, cfg, init)
                loss_fn = nanogpt_loss(model)
            model.train()
            train_fn = torch.compile(loss_fn) if args.compile else loss_fn
            optimizer = make_optimizer(model, args.optimizer, args.lr, args.weight_decay)
            contestants.append(Contestant(name, mode, model, train_fn, loss_fn, optimizer))

    tokens_per_step = args.batch_size * cfg.max_seq_len
    print(
        f"{args.preset}: {cfg.n_layers} layers, {cfg.n_heads} heads, d_model {cfg.d_model}, "
        f"T {cfg.max_seq_len}, batch {args.batch_size} ({tokens_per_step} tokens/step), "
        f"vocab {cfg.vocab_size}, ffn {cfg.ffn}, {cfg.position} positions, {cfg.norm} norm"
    )
    print(
        f"N = {n_params / 1e6:.2f}M matmul params; FLOPs/token = 6N + 12*L*H*D*T = "
        f"{flops / 1e6:.1f}M | threads {torch.get_num_threads()} | AdamW {args.optimizer} | "
        f"{args.attention} attention"
        f"{' | torch.compile' if args.compile else ''} | torch {torch.__version__}"
    )
    print(
        f"data: seeded random bigram chain, {args.branching} successors/token, entropy "
        f"{chain_entropy(transitions):.3f} nats (uniform: {math.log(cfg.vocab_size):.3f}) | "
        f"{args.warmup} warmup steps, then {args.runs} interleaved runs x {args.steps} steps"
    )

    for c in contestants:
        start = time.perf_counter()
        c.step(train_batches)
        c.first_step_s = time.perf_counter() - start
        for _ in range(args.warmup - 1):
            c.step(train_batches)
    peaks = {mode: 0.0 for mode in ["fp32", *args.modes]}  # fp32 also for the reference row
    for _ in range(args.runs):
        for c in contestants:
            c.run_seconds.append(c.run(train_batches, args.steps))
        for mode in peaks:  # the peak is a best case: keep the best of all rounds
            dtype = MODES[mode] or torch.float32
            peaks[mode] = max(peaks[mode], matmul_gflops(dtype, args.peak_size))
    evals = {i: eval_loss(c, eval_batches) for i, c in enumerate(contestants)}

    print(
        "peak matmul "
        + ", ".join(f"{m} {peak:.1f} GFLOP/s" for m, peak in peaks.items())
        + f" ({args.peak_size}^3, best of {args.runs} rounds); MFU uses the peak of its mode"
    )
    print()
    rows = report(args, contestants, evals, peaks, flops, tokens_per_step)
    if args.json:
        settings = {"preset": args.preset, "batch_size": args.batch_size, "runs": args.runs}
        settings |= {"steps": args.steps, "reference_tokens_per_s": args.reference_tokens_per_s}
        settings["peak_gflop_s"] = peaks
        record.write(args.json, args.threads, {**settings, "rows": rows})


if __name__ == "__main__":
    main()
