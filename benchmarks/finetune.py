"""Fine-tuning SmolLM2 on CPU: glassformer LoRA vs glassformer full fine-tuning vs peft LoRA on
transformers, same weights, same batch, same optimizer, in one run (issue 16).

Contestants, all from one load of SmolLM2-135M-Instruct (`from_pretrained("smollm2")`: the
shipped Q4_1 GGUF file dequantized to fp32, so every copy holds exactly the same numbers):

    glassformer LoRA   apply_lora(model, --targets, --rank, --alpha, dropout 0)
    glassformer full   every parameter trains (what `glassformer finetune` does for method=full)
    peft LoRA          transformers LlamaForCausalLM loaded from the folder save_hf_model writes
                       (glassformer's convert path), wrapped by peft's get_peft_model(LoraConfig(
                       r, lora_alpha, target_modules=[q_proj, v_proj], lora_dropout=0.0))

peft's adapters start from glassformer's: its A matrices are copied in (through
glassformer.interop.peft's adapter_state, the tensor names peft itself writes), B is zero in
both, so both LoRA runs compute the same thing step after step, and the "loss" columns must
agree (a check that the comparison is fair, printed as the largest difference).

One training step is what `glassformer finetune` does per step (train/trainer.py train_step):
forward, cross-entropy over the whole batch in fp32, backward, clip_grad_norm_ to
train.grad_clip, AdamW from the trainer's own make_optimizer (fused, decay on matrices only,
TrainConfig's betas and learning rate), zero_grad(set_to_none=True). transformers gets the
same step with the same loss written out on its logits, the way transformers computes it with
`labels` (logits at every position, -100 ignored). The batch, the same every step and for every
contestant:

    --data folio (default)  what `glassformer finetune --config configs/smollm2-lora-folio.toml`
                            trains on: its first batch of --batch-size (default: the config's 8)
                            chat conversations, right-padded, loss on the assistant's tokens only
                            (about 1 position in 7). glassformer's loss runs the head only there.
    --data hamlet           --batch-size rows of --seq-len + 1 tokens of Hamlet (default 4 x 128),
                            a loss at every position: plain language-model training.

After --warmup untimed steps, each round times one step of every contestant in turn
(interleaved, so load from other processes hits all alike, and who goes first rotates);
tokens/s is the positions of the batch (padding included, the same for all) over the median
step time.

Memory is counted, not sampled: bytes of the trainable parameters, their gradients (after
backward, before zero_grad) and the optimizer state (every tensor in optimizer.state: exp_avg,
exp_avg_sq, step), plus the frozen weights for context. Activations are not counted (they are
the same for all three up to the adapters' small extra). The process's peak RSS (all three
models together) is printed once.

    python benchmarks/finetune.py                    # the Folio chat batch, 10 timed steps
    python benchmarks/finetune.py --data hamlet      # 4 x 128 tokens of plain text
    python benchmarks/finetune.py --data hamlet --steps 2 --warmup 1 --batch-size 1 --seq-len 32

It prints one table, a row per contestant: tokens/s, ms/step, spread, trainable parameters, MB
of trainable weights, gradients, optimizer state and frozen weights, loss at the first and last
step; then the ratios glassformer-LoRA / peft-LoRA and glassformer-LoRA / glassformer-full
(tokens/s), LoRA / full optimizer state, with the issue's targets (LoRA at least as fast as
peft's; LoRA optimizer state under 2% of full's), and the peak RSS. --json PATH also writes the
rows and ratios with the command, date and machine (benchmarks/record.py), for
benchmarks/render.py: docs/finetune.md's table is benchmarks/results/finetune.json (--steps 20).
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import record  # benchmarks/record.py
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassformer.data import shakespeare_plays
from glassformer.interop.hf import save_hf_model
from glassformer.interop.peft import adapter_state
from glassformer.interop.pretrained import from_pretrained
from glassformer.nn.lora import apply_lora
from glassformer.train.config import TrainConfig, load_finetune_config
from glassformer.train.finetune import (
    FinetuneTask,
    example_length,
    load_examples,
    pad_token_id,
)
from glassformer.train.trainer import make_optimizer

MB = 1e6
SPEED_TARGET = 1.0  # glassformer LoRA tokens/s / peft LoRA tokens/s, at least
OPTIMIZER_TARGET = 0.02  # LoRA optimizer state / full fine-tuning's, under
FOLIO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "smollm2-lora-folio.toml"


# --- memory -------------------------------------------------------------------------------------


@dataclass
class Memory:
    """Bytes of what training holds besides activations (tied tensors counted once)."""

    trainable_params: int = 0  # numbers, not bytes
    weights: int = 0  # trainable parameters
    grads: int = 0
    optimizer: int = 0
    frozen: int = 0


def count_memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> Memory:
    """Sum numel * element_size over parameters, their .grad and the optimizer state tensors;
    call between backward and zero_grad so the gradients exist."""
    memory = Memory()
    for p in model.parameters():  # shared (tied) parameters come once
        if p.requires_grad:
            memory.trainable_params += p.numel()
            memory.weights += p.numel() * p.element_size()
            if p.grad is not None:
                memory.grads += p.grad.numel() * p.grad.element_size()
        else:
            memory.frozen += p.numel() * p.element_size()
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, Tensor):
                memory.optimizer += value.numel() * value.element_size()
    return memory


def peak_rss_mb() -> float:
    """The process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB


# --- contestants --------------------------------------------------------------------------------


@dataclass
class Contestant:
    """A model with its optimizer and loss; `step` is one training step as the trainer's."""

    name: str
    model: nn.Module
    loss_fn: Callable[[Tensor, Tensor], Tensor]  # (inputs, targets) -> scalar fp32 loss
    optimizer: torch.optim.Optimizer
    grad_clip: float
    seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    memory: Memory | None = None

    def step(self, inputs: Tensor, targets: Tensor) -> float:
        start = time.perf_counter()
        loss = self.loss_fn(inputs, targets)
        loss.backward()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        if self.memory is None:  # the first step: gradients and optimizer state both exist now
            self.memory = count_memory(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(loss.item())
        return time.perf_counter() - start


def glassformer_loss(model: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
    return lambda inputs, targets: model.loss(inputs, targets).loss


def transformers_loss(model: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
    """glassformer's loss on transformers' logits, as transformers computes it from `labels`:
    logits at every position, cross-entropy in fp32 where the target is not -100."""

    def loss(inputs: Tensor, targets: Tensor) -> Tensor:
        logits = model(input_ids=inputs, use_cache=False).logits  # (B, T, V)
        flat = logits.float().view(-1, logits.shape[-1])
        return F.cross_entropy(flat, targets.reshape(-1), ignore_index=-100)

    return loss


def peft_lora(glass_lora: nn.Module, folder: Path, dropout: float) -> nn.Module:
    """transformers' copy of the weights in `folder` with peft LoRA adapters on the modules
    glassformer's adapters sit on, holding glassformer's adapter values."""
    import transformers
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    _, tensors, shapes = adapter_state(glass_lora)  # peft tensor names -> values
    ranks = {r for r, _ in shapes.values()}
    alphas = {a for _, a in shapes.values()}
    if len(ranks) != 1 or len(alphas) != 1:
        raise SystemExit(f"peft gets one rank and alpha here, the adapters have {shapes}")
    config = LoraConfig(
        r=ranks.pop(),
        lora_alpha=alphas.pop(),
        target_modules=sorted({name.rsplit(".", 1)[-1] for name in shapes}),  # q_proj, v_proj
        lora_dropout=dropout,
        task_type="CAUSAL_LM",
    )
    transformers.utils.logging.disable_progress_bar()
    with warnings.catch_warnings():  # peft asks transformers a deprecated question
        warnings.simplefilter("ignore", FutureWarning)
        hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
        model = get_peft_model(hf, config)
    wrapped = {
        name.removeprefix("base_model.model.")
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and len(module.lora_A) > 0
    }
    if wrapped != set(shapes):
        raise SystemExit(
            f"peft adapted {len(wrapped)} modules, glassformer {len(shapes)}: targets that cover "
            "only some layers are not mirrored here; use part names (q,v or all-linear)"
        )
    result = set_peft_model_state_dict(model, tensors)
    if result.unexpected_keys:
        raise SystemExit(f"peft did not take {result.unexpected_keys[:3]} ...")
    loaded = {n: p for n, p in model.named_parameters() if "lora_" in n}
    if len(loaded) != len(tensors):
        raise SystemExit(f"peft has {len(loaded)} adapter tensors, glassformer {len(tensors)}")
    for name, value in tensors.items():  # base_model.model.M.lora_A.weight -> ...default.weight
        ours = name.removesuffix(".weight") + ".default.weight"
        if not torch.equal(loaded[ours].detach(), value):
            raise SystemExit(f"peft's {ours} differs from glassformer's adapter")
    return model


def hamlet_batch(tokenizer, batch_size: int, seq_len: int) -> tuple[Tensor, Tensor]:
    """(inputs, targets), each (B, T): rows of T + 1 consecutive Hamlet tokens, shifted by one."""
    text = shakespeare_plays("modern")["hamlet"]
    ids = tokenizer.encode(text)
    need = batch_size * (seq_len + 1)
    if len(ids) < need:
        raise SystemExit(f"Hamlet has {len(ids)} tokens, the batch needs {need}")
    rows = torch.tensor(ids[:need], dtype=torch.long).view(batch_size, seq_len + 1)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def folio_batch(tokenizer, model_positions: int, batch_size: int | None) -> tuple[Tensor, Tensor]:
    """(inputs, targets), each (B, T): the first batch the Folio LoRA config trains on, built by
    the fine-tuning code itself (targets -100 outside the assistant's replies)."""
    run = load_finetune_config(FOLIO_CONFIG)
    ft, cfg = run.finetune, run.train
    train, val = load_examples(ft, tokenizer, example_length(ft, model_positions), cfg.seed)
    task = FinetuneTask(train, val, tokenizer, pad_token_id(tokenizer), pack_len=0)
    batch = task.train_batch(0, batch_size or cfg.batch_size, cfg.seed)
    return batch["input_ids"], batch["targets"]


# --- report -------------------------------------------------------------------------------------


def print_table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(row: list[str]) -> str:  # the name left-aligned, numbers right-aligned
        cells = zip(row, widths, strict=True)
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(cells))

    print(line(header))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(line(row))


def report(contestants: dict[str, Contestant], tokens_per_step: int) -> dict:
    """Print the table and the ratios; return them as a dict (for --json)."""
    rate, rows, records = {}, [], []
    for name, c in contestants.items():
        median = statistics.median(c.seconds)
        rate[name] = tokens_per_step / median
        per_step = [tokens_per_step / s for s in c.seconds]
        m = c.memory
        rows.append(
            [
                name,
                f"{rate[name]:,.0f}",
                f"{median * 1000:,.1f}",
                f"{(max(per_step) - min(per_step)) / rate[name]:.0%}",
                f"{m.trainable_params:,}",
                f"{m.weights / MB:,.2f}",
                f"{m.grads / MB:,.2f}",
                f"{m.optimizer / MB:,.2f}",
                f"{(m.weights + m.grads + m.optimizer) / MB:,.2f}",
                f"{m.frozen / MB:,.1f}",
                f"{c.losses[0]:.4f}",
                f"{c.losses[-1]:.4f}",
            ]
        )
        records.append(
            {
                "contestant": name,
                "tokens_per_s": rate[name],
                "ms_per_step": median * 1000,
                "spread": (max(per_step) - min(per_step)) / rate[name],
                "trainable": m.trainable_params,
                "params_mb": m.weights / MB,
                "grads_mb": m.grads / MB,
                "optim_mb": m.optimizer / MB,
                "train_mb": (m.weights + m.grads + m.optimizer) / MB,
                "frozen_mb": m.frozen / MB,
                "first_loss": c.losses[0],
                "last_loss": c.losses[-1],
            }
        )
    header = ["contestant", "tokens/s", "ms/step", "spread", "trainable", "params MB"]
    header += ["grads MB", "optim MB", "train MB", "frozen MB", "loss@0", "loss@last"]
    print_table(rows, header)
    print(
        "spread: (max - min) / median tokens/s over the timed steps. train MB: trainable "
        "parameters + gradients + optimizer state\n(activations not counted). loss@last: the "
        "last step's loss, warm-up included (same batch every step)."
    )
    print()
    lora, full, peft = (
        contestants[k] for k in ("glassformer LoRA", "glassformer full", "peft LoRA")
    )
    speed = rate["glassformer LoRA"] / rate["peft LoRA"]
    verdict = "meets" if speed >= SPEED_TARGET else "MISSES"
    print(
        f"glassformer LoRA / peft LoRA tokens/s: {speed:.2f}x ({verdict} the target >= "
        f"{SPEED_TARGET:.2f}x; same run, interleaved)"
    )
    # Paired: the two LoRA steps of one round ran back to back, under the same load; the median
    # of their ratios is less moved by load that drifts between rounds than the ratio of medians.
    paired = [p / g for g, p in zip(lora.seconds, peft.seconds, strict=True)]
    faster = sum(r >= 1.0 for r in paired)
    print(
        f"paired, round by round: median {statistics.median(paired):.2f}x, glassformer LoRA"
        f" the faster of the two in {faster} of {len(paired)} rounds"
    )
    print(
        f"glassformer LoRA / glassformer full tokens/s: "
        f"{rate['glassformer LoRA'] / rate['glassformer full']:.2f}x"
    )
    ratio = lora.memory.optimizer / full.memory.optimizer
    verdict = "meets" if ratio < OPTIMIZER_TARGET else "MISSES"
    print(
        f"LoRA / full optimizer state: {ratio:.3%} ({verdict} the target < {OPTIMIZER_TARGET:.0%});"
        f" trainable params + grads + optimizer state: "
        f"{(lora.memory.weights + lora.memory.grads + lora.memory.optimizer) / MB:,.2f} MB vs "
        f"{(full.memory.weights + full.memory.grads + full.memory.optimizer) / MB:,.2f} MB"
    )
    gap = max(abs(a - b) for a, b in zip(lora.losses, peft.losses, strict=True))
    print(
        f"same computation: largest |loss difference| glassformer LoRA vs peft LoRA over "
        f"{len(lora.losses)} steps: {gap:.2e} (same weights, adapters and batch)"
    )
    print(f"peak RSS of this process (all three models together): {peak_rss_mb():,.0f} MB")
    return {
        "rows": records,
        "lora_vs_peft": speed,
        "speed_target": SPEED_TARGET,
        "paired": {"median": statistics.median(paired), "faster": faster, "rounds": len(paired)},
        "lora_vs_full": rate["glassformer LoRA"] / rate["glassformer full"],
        "optimizer_lora_over_full": ratio,
        "largest_loss_difference": gap,
    }


# --- main ---------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Training tokens/s and memory of SmolLM2 fine-tuning: glassformer LoRA vs "
        "glassformer full vs peft LoRA on transformers, same weights and batch.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per contestant")
    parser.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed steps before timing (the first allocates the optimizer state and is where "
        "memory is counted)",
    )
    parser.add_argument(
        "--data",
        choices=("folio", "hamlet"),
        default="folio",
        help="folio: the Folio LoRA config's chat batch (loss on the replies); hamlet: plain text",
    )
    parser.add_argument(
        "--batch-size", type=int, help="sequences per step (default: folio 8, hamlet 4)"
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=128,
        help="tokens per sequence (hamlet; folio rows are "
        "as long as the batch's longest conversation)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    parser.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (scale alpha / r)")
    parser.add_argument(
        "--targets", default="q,v", help="LoRA targets, as apply_lora / finetune.lora_targets"
    )
    parser.add_argument(
        "--lr", type=float, default=TrainConfig.learning_rate, help="AdamW learning rate"
    )
    parser.add_argument(
        "--json", type=Path, help="also write the rows and ratios here (benchmarks/results/)"
    )
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1 (the first step always warms up)")
    if min(args.batch_size or 1, args.seq_len, args.threads, args.rank) < 1:
        parser.error("--batch-size, --seq-len, --threads and --rank must be >= 1")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)  # the LoRA A matrices
    cfg = TrainConfig(learning_rate=args.lr)  # the trainer's optimizer settings and grad_clip

    base, tokenizer = from_pretrained("smollm2")  # fp32
    if args.seq_len > base.cfg.max_seq_len:
        raise SystemExit(f"--seq-len {args.seq_len} is more than SmolLM2's {base.cfg.max_seq_len}")
    if args.data == "hamlet":
        inputs, targets = hamlet_batch(tokenizer, args.batch_size or 4, args.seq_len)
        batch_name = "Hamlet, a loss at every position"
    else:
        inputs, targets = folio_batch(tokenizer, base.cfg.max_seq_len, args.batch_size)
        learned = int((targets != -100).sum())
        batch_name = f"Folio chat, a loss on {learned} of them: the replies"

    full = copy.deepcopy(base).train().requires_grad_(True)
    lora = copy.deepcopy(base).train()
    sites = apply_lora(lora, args.targets, args.rank, args.alpha, 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_hf_model(base, Path(tmp) / "smollm2")
        peft_model = peft_lora(lora, folder, 0.0).train()
    del base

    contestants = {}
    for name, model, loss_fn in [
        ("glassformer LoRA", lora, glassformer_loss(lora)),
        ("glassformer full", full, glassformer_loss(full)),
        ("peft LoRA", peft_model, transformers_loss(peft_model)),
    ]:
        optimizer = make_optimizer(model, cfg)
        contestants[name] = Contestant(name, model, loss_fn, optimizer, cfg.grad_clip)

    tokens_per_step = inputs.numel()
    print(
        f"SmolLM2-135M fp32 | batch {inputs.shape[0]} x {inputs.shape[1]} = {tokens_per_step} "
        f"tokens/step ({batch_name}) | threads {torch.get_num_threads()} | LoRA r={args.rank} "
        f"alpha={args.alpha:g} on {args.targets} ({len(sites)} adapters), dropout 0\n"
        f"AdamW fused (trainer's make_optimizer), lr {cfg.learning_rate:g}, betas "
        f"({cfg.beta1}, {cfg.beta2}), weight decay {cfg.weight_decay} on matrices, grad clip "
        f"{cfg.grad_clip} | {args.warmup} warm-up steps, then median of {args.steps} "
        f"interleaved rounds | torch {torch.__version__}"
    )
    print()

    for c in contestants.values():
        for _ in range(args.warmup):
            c.step(inputs, targets)
    order = list(contestants.values())
    for round_ in range(args.steps):  # who goes first rotates: no one always follows full
        for c in order[round_ % len(order) :] + order[: round_ % len(order)]:
            c.seconds.append(c.step(inputs, targets))
    result = report(contestants, tokens_per_step)
    if args.json:
        settings = {"model": "SmolLM2-135M", "batch": batch_name, "steps": args.steps}
        record.write(args.json, args.threads, {**settings, **result})


if __name__ == "__main__":
    main()
