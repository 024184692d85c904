"""The training loop (seed 000 §2.1-2.2): tokenize, chunk, batch, predict every next token at
once (teacher forcing), step AdamW, evaluate, checkpoint atomically, resume exactly.

Exact resume: batches are a pure function of (seed, step), and a checkpoint holds the weights,
the optimizer moments and the RNG state, so a resumed run repeats an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from glassformer.models import build_model
from glassformer.tokenizers import load_tokenizer
from glassformer.train.checkpoint import (
    list_checkpoints,
    load_model_weights,
    load_optimizer_state,
    optimizer_state_to_tensors,
    read_train_state,
    resolve_checkpoint,
    restore_rng_state,
    rng_state_tensors,
    save_checkpoint,
)
from glassformer.train.config import RunConfig, run_config_json
from glassformer.train.tasks import Task, make_task


@dataclass
class TrainResult:
    out_dir: Path
    steps: int
    train_losses: list[float] = field(default_factory=list)  # one per optimizer step
    val_loss: float | None = None
    baseline_name: str = "baseline"
    baseline_loss: float | None = None  # e.g. unigram entropy: what ignoring context scores
    tokens_per_s: float = 0.0


# --- optimization -------------------------------------------------------------------------------


def make_optimizer(model: nn.Module, cfg) -> torch.optim.AdamW:
    """AdamW (the fused kernel: fastest on CPU in benchmarks/train_throughput.py); weight decay
    only on matrices, not on biases and norm gains."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=True)


def learning_rate(step: int, cfg) -> float:
    """Linear warmup, then cosine decay from learning_rate to min_lr at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.min_lr + cosine * (cfg.learning_rate - cfg.min_lr)


def autocast(dtype: str):
    if dtype == "bf16":
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, batch_size: int, n_batches: int, dtype: str) -> float:
    """Mean loss over the task's fixed validation batches."""
    model.eval()
    losses = []
    for batch in task.val_batches(batch_size, n_batches):
        with autocast(dtype):
            losses.append(model.loss(**batch).ce_loss.item())
    model.train()
    return sum(losses) / len(losses)


def init_matching_weights(model: nn.Module, step_dir: Path) -> None:
    """Copy the checkpoint's tensors that the model has (same name and shape): fine-tuning
    keeps the pretrained encoder, new heads start fresh and unused heads are dropped."""
    from safetensors.torch import load_file

    on_disk = load_file(str(step_dir / "model.safetensors"))
    state = model.state_dict()
    shared = {k: v for k, v in on_disk.items() if k in state and v.shape == state[k].shape}
    if not shared:
        raise ValueError(f"train.init_from={str(step_dir)!r} shares no weights with this model")
    model.load_state_dict(shared, strict=False)
    fresh = sorted(k for k in state if k not in shared)
    unused = sorted(k for k in on_disk if k not in shared)
    print(
        f"initialized {len(shared)} tensors from {step_dir}; new: {', '.join(fresh) or 'none'}; "
        f"not used: {', '.join(unused) or 'none'}"
    )


# --- the loop -----------------------------------------------------------------------------------


class Trainer:
    def __init__(self, run: RunConfig, resume: bool = False, progress: bool = True) -> None:
        self.run = run
        self.cfg = run.train
        self.out_dir = Path(self.cfg.out_dir)
        self.progress = progress
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        torch.manual_seed(self.cfg.seed)

        run.model_config(vocab_size=1)  # fail on a bad [model] before reading the corpus
        resume_dir = self._resume_dir() if resume else None
        init_dir = resolve_checkpoint(self.cfg.init_from) if self.cfg.init_from else None
        # A run started from pretrained weights must read text with their tokenizer.
        tokenizer_dir = resume_dir or init_dir
        self.task = make_task(run, load_tokenizer(tokenizer_dir) if tokenizer_dir else None)
        self.tokenizer = self.task.tokenizer
        self.model_cfg = self.task.model_config(run)

        self.model = build_model(self.model_cfg)
        self.optimizer = make_optimizer(self.model, self.cfg)
        self.step = 0
        self.tokens_seen = 0  # in this process (for tokens/s)
        self.train_losses: list[float] = []
        if resume_dir is not None:
            self._restore(resume_dir)
        elif init_dir is not None:
            init_matching_weights(self.model, init_dir)

    def _resume_dir(self) -> Path | None:
        if not list_checkpoints(self.out_dir):
            print(f"no checkpoint in {self.out_dir} to resume from: starting fresh")
            return None
        return resolve_checkpoint(self.out_dir)

    def _restore(self, step_dir: Path) -> None:
        load_model_weights(self.model, step_dir / "model.safetensors")
        state, tensors = read_train_state(step_dir)
        optim_tensors = {k: v for k, v in tensors.items() if k.startswith("optimizer.")}
        load_optimizer_state(self.optimizer, state["optimizer"], optim_tensors)
        restore_rng_state({k: v for k, v in tensors.items() if not k.startswith("optimizer.")})
        self.step = state["step"]
        self.train_losses = list(state["train_losses"])
        print(f"resumed from {step_dir} at step {self.step}")

    def save(self) -> Path:
        optim_meta, optim_tensors = optimizer_state_to_tensors(self.optimizer)
        state = {
            "step": self.step,
            "train_losses": self.train_losses,
            "optimizer": optim_meta,
            "run_config": self.run.to_dict(),
            "data_position": {"seed": self.cfg.seed, "next_step": self.step},
        }
        return save_checkpoint(
            self.out_dir,
            self.step,
            self.model,
            self.model_cfg,
            tokenizer=self.tokenizer,
            train_state=state,
            train_tensors={**optim_tensors, **rng_state_tensors()},
            keep_last=self.cfg.keep_checkpoints,
        )

    def train_step(self) -> float:
        cfg = self.cfg
        lr = learning_rate(self.step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = 0.0
        for micro in range(cfg.grad_accum_steps):
            micro_step = self.step * cfg.grad_accum_steps + micro
            batch = self.task.train_batch(micro_step, cfg.batch_size, cfg.seed)
            self.tokens_seen += self.task.tokens_in(batch)
            with autocast(cfg.dtype):
                out = self.model.loss(**batch)
            (out.loss / cfg.grad_accum_steps).backward()
            total += out.ce_loss.item() / cfg.grad_accum_steps
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.train_losses.append(total)
        return total

    def fit(self, max_steps: int | None = None) -> TrainResult:
        """Train until max_steps (default: the config's), checkpointing along the way."""
        cfg = self.cfg
        stop = min(max_steps or cfg.max_steps, cfg.max_steps)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "run_config.json").write_text(run_config_json(self.run) + "\n")
        n_params = sum(p.numel() for p in self.model.parameters())
        print(
            f"model: {n_params / 1e6:.2f}M parameters | vocab {self.tokenizer.vocab_size} | "
            f"task {self.task.name}: {self.task.n_train} training examples"
        )
        bar = _progress_bar(self.step, stop, enabled=self.progress)
        self.model.train()
        val_loss = None
        t_start = time.perf_counter()
        tokens_per_s = 0.0
        while self.step < stop:
            loss = self.train_step()
            elapsed = time.perf_counter() - t_start
            tokens_per_s = self.tokens_seen / elapsed
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
            last = self.step == stop
            if self.step % cfg.eval_interval == 0 or last:
                val_loss = evaluate(
                    self.model, self.task, cfg.batch_size, cfg.eval_batches, cfg.dtype
                )
                bar.write(
                    f"step {self.step}: train loss {loss:.4f} | val loss {val_loss:.4f} | "
                    f"{self.task.baseline_name} {self.task.baseline_loss:.4f} | "
                    f"{tokens_per_s:,.0f} tok/s"
                )
            if self.step % cfg.checkpoint_interval == 0 or last:
                self.save()
        bar.close()
        return TrainResult(
            out_dir=self.out_dir,
            steps=self.step,
            train_losses=list(self.train_losses),
            val_loss=val_loss,
            baseline_name=self.task.baseline_name,
            baseline_loss=self.task.baseline_loss,
            tokens_per_s=tokens_per_s,
        )


def _progress_bar(initial: int, total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(
        initial=initial,
        total=total,
        desc="train",
        unit="step",
        disable=not enabled,
        dynamic_ncols=True,
        mininterval=0.5,
    )


def train(run: RunConfig, resume: bool = False, progress: bool = True) -> TrainResult:
    """Train (or resume) the run described by `run` and return its losses."""
    return Trainer(run, resume=resume, progress=progress).fit()
